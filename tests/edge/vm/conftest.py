"""Fixtures for vm backend tests: a real QEMU (TCG) guest with vg's agent, images from a
layer store holding the busybox base. Skipped without root, QEMU or the guest kernel
(``make setup`` fetches it); CI has all three."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from dsec.edge.backends.container.images import StoreImages
from dsec.errors import DsecError
from dsec.image import LayerStore, MountCache, ensure_busybox_base


def _boot_files() -> tuple[str, str] | str:
    if os.geteuid() != 0:
        return "needs root (CI runs as root)"
    if shutil.which("qemu-system-x86_64") is None:
        return "needs qemu-system-x86 (make setup)"
    from dsec.edge.backends.vm import guest

    try:
        k = guest.find_kernel()
        return k.vmlinuz, guest.ensure_initramfs(k)
    except DsecError as exc:
        return f"no guest kernel/initramfs: {exc}"


@pytest.fixture(scope="session")
def boot_files() -> tuple[str, str]:
    got = _boot_files()
    if isinstance(got, str):
        pytest.skip(got)
    return got


@pytest.fixture(scope="session")
def vm_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LayerStore]:
    store = LayerStore(str(tmp_path_factory.mktemp("vmstore")))
    store.tag(ensure_busybox_base(store).digest, "base")
    yield store


@pytest.fixture
async def vm_backend(tmp_path: Any, boot_files: tuple[str, str],
                     vm_store: LayerStore) -> AsyncIterator[Any]:
    from dsec.edge.backends.vm.backend import VmBackend
    from dsec.edge.backends.vm.guest import kernel_cmdline

    cache = MountCache()
    b = VmBackend(root_dir=os.path.join(str(tmp_path), "vm"),
                  images=StoreImages(vm_store, cache), kernel=boot_files[0],
                  initrd=boot_files[1], append=kernel_cmdline(), console=True)
    try:
        yield b
    finally:
        for sid in list(b._vms):
            with contextlib.suppress(DsecError):
                await b.destroy(sid)  # type: ignore[arg-type]
        await b.reconcile(set())
        await b.close()
        with contextlib.suppress(OSError):
            b.governor.remove_base()
        cache.close()


@contextlib.contextmanager
def _busy_loops(n: int) -> Iterator[None]:
    procs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.fixture
def cpu_load() -> Callable[[int], contextlib.AbstractContextManager[None]]:
    """``with cpu_load(n):`` runs n busy loops: the CI box runs these tests at host load
    ~10, where a TCG guest's boot-time probing takes seconds, not milliseconds."""
    return _busy_loops
