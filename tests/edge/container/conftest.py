"""Fixtures for the container backend: a busybox image and a backend that always cleans up."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import AsyncIterator, Iterator

import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.backends.container.linux import MNT_DETACH, umount2
from dsec.edge.backends.container.testimage import build_busybox_root
from dsec.ids import NodeId, SandboxId, new_sandbox_id
from dsec.wire.spec import SandboxSpec

pytestmark = pytest.mark.root

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")


@pytest.fixture(scope="session")
def images_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    d = tmp_path_factory.mktemp("images")
    build_busybox_root(str(d / "base"))
    yield str(d)


def new_sid() -> SandboxId:
    return new_sandbox_id(NodeId("t1"))


SPEC = SandboxSpec(backend="container", memory_bytes=256 << 20, pids_max=256)


async def _cleanup(b: ContainerBackend) -> None:
    for sid in b.sandbox_ids():
        try:
            await b.destroy(SandboxId(sid))
        except Exception:  # noqa: BLE001, S110 - keep cleaning the rest
            pass
    gov = b.governor
    await b.close()
    for sid in gov.list_sandboxes():  # anything a failing test left behind
        cg = gov.paths(sid)
        gov.kill_all(cg)
        gov.remove(cg, wait_s=5)
    mem = gov.layout.bases.get("memory")
    if mem is not None and os.path.isdir(mem):   # memory groups a failing test left
        for e in os.scandir(mem):
            if e.is_dir() and e.name.startswith("+mg-"):
                with contextlib.suppress(OSError):
                    os.rmdir(e.path)
    gov.remove_base()
    if os.path.ismount(b.disk.path):  # sandboxes left for adoption keep the disk pool
        umount2(b.disk.path, MNT_DETACH)
    if b.shared_scratch and os.path.ismount(b.shared_scratch):   # ... and the scratch
        umount2(b.shared_scratch, MNT_DETACH)
    # The pool image is preallocated (2 GiB in the suite): a test's leftover would hold
    # real disk until pytest's temp dirs rotate out.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(b.disk.image)


@pytest.fixture
async def backend(tmp_path: object, images_dir: str) -> AsyncIterator[ContainerBackend]:
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                         images=DirectoryImages(images_dir))
    try:
        yield b
    finally:
        await _cleanup(b)


@pytest.fixture
async def runc_backend(tmp_path: object, images_dir: str) -> AsyncIterator[ContainerBackend]:
    if os.geteuid() != 0 or shutil.which("runc") is None:
        pytest.skip("needs root and runc")
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "rroot"),
                         images=DirectoryImages(images_dir), runtime="runc")
    try:
        yield b
    finally:
        await _cleanup(b)
