"""Fixtures for the security suite: a busybox image plus a static C probe, and backends.

The probe (``probe.c``, compiled once per session with ``gcc -static``) is stacked into
sandboxes as a toolkit layer (``toolkits=("probe",)`` -> ``/probe``), so a test can make
raw system calls from inside a sandbox (clone3, keyctl, io_uring, x32/i386 ABIs, ...)
that busybox cannot. The ``backend``/``runc_backend`` fixtures are the container
suite's own (they destroy every sandbox and remove the cgroups even when a test fails);
they pick up this module's ``images_dir``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator

import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.backends.container.testimage import build_busybox_root
from dsec.wire.spec import ExecRequest, SandboxSpec
from tests.edge.container.conftest import _cleanup, backend, new_sid  # noqa: F401

__all__ = ["PROBE_SPEC", "new_sid", "probe", "sh"]

HERE = os.path.dirname(os.path.abspath(__file__))

PROBE_SPEC = SandboxSpec(backend="container", toolkits=("probe",), memory_bytes=256 << 20,
                         pids_max=256)


@pytest.fixture(scope="session")
def probe_binary(tmp_path_factory: pytest.TempPathFactory) -> str:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("needs gcc (and glibc's static libc.a) to build the sandbox probe")
    out = str(tmp_path_factory.mktemp("probe") / "probe")
    r = subprocess.run([cc, "-static", "-O1", "-o", out, os.path.join(HERE, "probe.c")],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, f"probe.c did not compile: {r.stderr[-2000:]}"
    return out


@pytest.fixture(scope="session")
def images_dir(tmp_path_factory: pytest.TempPathFactory, probe_binary: str) -> Iterator[str]:
    d = tmp_path_factory.mktemp("sec-images")
    build_busybox_root(str(d / "base"))
    os.makedirs(d / "probe")
    shutil.copy2(probe_binary, d / "probe" / "probe")
    yield str(d)


def _rmdir_everywhere(name: str) -> None:
    """rmdir every (empty) cgroup directory called ``name`` in any v1/v2 hierarchy."""
    for top in os.listdir("/sys/fs/cgroup"):
        for dirpath, dirnames, _ in os.walk(os.path.join("/sys/fs/cgroup", top)):
            if dirpath.count("/") > 8:
                dirnames[:] = []
                continue
            if name in dirnames:
                try:
                    os.rmdir(os.path.join(dirpath, name))
                except OSError:
                    pass
                dirnames.remove(name)


@pytest.fixture
async def runc_backend(tmp_path: object, images_dir: str) -> AsyncIterator[ContainerBackend]:
    """The container suite's runc fixture, plus removal of the ``dsec-<name>`` parents runc
    makes in controllers the governor does not manage (blkio, cpuset, devices, ...)."""
    if shutil.which("runc") is None:
        pytest.skip("needs runc")
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "rroot"),
                         images=DirectoryImages(images_dir), runtime="runc")
    try:
        yield b
    finally:
        await _cleanup(b)
        _rmdir_everywhere(f"dsec-{b.cgroup_name}")


async def sh(b: ContainerBackend, sid: str, cmd: str, **kw: object) -> tuple[int, str]:
    r = await b.exec(sid, ExecRequest(shell=cmd, timeout_s=20, **kw))
    return r.exit_code, (r.stdout + r.stderr).decode(errors="replace")


async def probe(b: ContainerBackend, sid: str, *args: str) -> tuple[int, str]:
    """Run ``/probe args...``; returns (exit code, the probe's result word)."""
    r = await b.exec(sid, ExecRequest(argv=("/probe", *args), timeout_s=20))
    out = r.stdout.decode(errors="replace").strip()
    word = out.splitlines()[-1].split("=", 1)[-1] if out else ""
    return r.exit_code, word
