"""Red team 27 (attacks on the red team 26 fixes: memory groups, the name claim):
shared fixtures and helpers."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator

import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.wire.spec import ExecRequest, SandboxSpec
from tests.edge.container.conftest import _cleanup
from tests.security.conftest import images_dir, probe_binary  # noqa: F401  (pytest fixtures)
from tests.security.redteam26.conftest import group_file, oom_kills, read  # noqa: F401

MIB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))


def spec(project: str, mib: int = 64, qos: str | None = None, **kw: object) -> SandboxSpec:
    return SandboxSpec(backend="container", image="hog", memory_bytes=mib * MIB,  # type: ignore[arg-type]
                       pids_max=64, project=project, qos=qos, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def hog_images(tmp_path_factory: pytest.TempPathFactory, images_dir: str) -> Iterator[str]:  # noqa: F811
    """images_dir plus ``hog``: busybox and /bin/hog (hog.c, static)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("needs gcc (and glibc's static libc.a) to build hog.c")
    d = tmp_path_factory.mktemp("rt27-images")
    shutil.copytree(os.path.join(images_dir, "base"), d / "hog", symlinks=True)
    r = subprocess.run([cc, "-static", "-O1", "-o", str(d / "hog" / "bin" / "hog"),
                        os.path.join(HERE, "hog.c")], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, f"hog.c did not compile: {r.stderr[-2000:]}"
    yield str(d)


@pytest.fixture
async def grouped(tmp_path: object, hog_images: str) -> AsyncIterator[ContainerBackend]:
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                         images=DirectoryImages(hog_images), memory_group_size=2)
    try:
        yield b
    finally:
        await _cleanup(b)


async def mate_answers(b: ContainerBackend, mate: str, gdir: str) -> tuple[list[object], int]:
    """The group-mate runs ``true`` three times: each (exit code, oom_killed), or the
    error when its init was OOM-killed too; and the OOM kills in the group meanwhile."""
    before = oom_kills(gdir)
    results: list[object] = []
    for _ in range(3):
        try:
            r = await b.exec(mate, ExecRequest(argv=("true",), timeout_s=30))  # type: ignore[arg-type]
            results.append((r.exit_code, r.oom_killed))
        except Exception as exc:  # noqa: BLE001 - the mate's init OOM-killed
            results.append((-1, repr(exc)[:120]))
    return results, oom_kills(gdir) - before
