"""Fixtures that run the container suite's behaviour tests on the vm tier
(tests/edge/vm/test_behaviour.py imports them by name).

``backend`` here IS a vm backend, as a node makes it (``make_backend("vm", ...)``: density
on, warm pool on), and it lives for the whole module: its warm-pool template is built
once, before the first test, so every create after it restores a saved guest (~1-2 s
under TCG) instead of booting one (~7-11 s). Its images are a layer store holding the
container suite's busybox tree (``images_dir``), so the tests see the same image and
snapshots work.

After every test, ``no_leftovers`` destroys what the test left (as the container
suite's per-test backend does) and then asserts the host holds nothing of those
sandboxes: no QEMU process, no sandbox directory, no cgroup. At the end of the module
the image's layer files must be byte for byte what they were before any guest ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from dsec.edge.admission import Capacity
from dsec.edge.backends.container.images import StoreImages
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.errors import DsecError
from dsec.image import LayerStore, MountCache
from dsec.wire.spec import SandboxSpec
from tests.edge.container.conftest import SPEC
from tests.edge.container.test_snapshot import Env

__all__ = ["backend", "env", "no_leftovers", "vm_images"]


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@pytest.fixture(scope="module")
def vm_images(tmp_path_factory: pytest.TempPathFactory, images_dir: str
              ) -> Iterator[LayerStore]:
    """A layer store whose "base" is the container suite's busybox tree."""
    store = LayerStore(str(tmp_path_factory.mktemp("vmbeh-store")))
    m = store.add_tree(os.path.join(images_dir, "base"), kind="base", name="base")
    layer = store.layer_path(m)
    before = _digest(layer)
    yield store
    assert _digest(layer) == before, "a guest changed the image's layer file on the host"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend(tmp_path_factory: pytest.TempPathFactory, boot_files: tuple[str, str],
                  vm_images: LayerStore) -> AsyncIterator[Any]:
    from dsec.edge.backends import make_backend
    from dsec.edge.backends.vm.backend import VmBackend
    from dsec.edge.backends.vm.guest import kernel_cmdline

    cache = MountCache()
    root = str(tmp_path_factory.mktemp("vmbeh"))
    b = make_backend("vm", root_dir=os.path.join(root, "vm"),
                     images=StoreImages(vm_images, cache), kernel=boot_files[0],
                     initrd=boot_files[1], append=kernel_cmdline())
    assert isinstance(b, VmBackend) and b.pool is not None
    try:
        # the shapes the smoke set creates: SPEC's, and a default spec's (512 MiB),
        # booted side by side
        await asyncio.gather(b.warm(SPEC), b.warm(SandboxSpec(backend="container")))
        # No more templates: a create of another shape boots cold and does not
        # start a background template build (another boot competing with the tests for
        # the host's 2 cores, for a shape the module creates once or twice).
        b._warm_later = lambda rec, spec: None  # type: ignore[method-assign]
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


@pytest_asyncio.fixture(loop_scope="module")
async def env(tmp_path: Any, boot_files: tuple[str, str],
              monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Env]:
    """test_snapshot.py's ``env`` on the vm tier: its store (the dsec busybox base, which
    has /work and /etc/hostname, unlike the container suite's tree, plus the "mytools"
    toolkit) and an EdgeNode over a vm backend of its own (warm pool off: every create
    boots, so this is the full set only). The node routes specs by their ``backend``
    field, so test_snapshot.py's SPEC names this tier while it runs (the one change)."""
    from dsec.edge.backends import make_backend
    from dsec.edge.backends.vm.guest import kernel_cmdline
    from dsec.image import ensure_busybox_base
    from tests.edge.container import test_snapshot

    monkeypatch.setitem(test_snapshot.SPEC, "backend", "vm")
    root = str(tmp_path)
    store = LayerStore(os.path.join(root, "layers"))
    store.tag(ensure_busybox_base(store).digest, "base")
    tools = os.path.join(root, "tools")
    os.makedirs(os.path.join(tools, "opt/tools/lib"))
    Path(tools, "opt/tools/run.sh").write_text("#!/bin/sh\necho tool-ran\n")
    os.chmod(os.path.join(tools, "opt/tools/run.sh"), 0o755)
    Path(tools, "opt/tools/lib/data.txt").write_text("toolkit data\n")
    store.add_tree(tools, kind="toolkit", name="mytools")
    cache = MountCache()
    b = make_backend("vm", root_dir=os.path.join(root, "vm"),
                     images=StoreImages(store, cache), kernel=boot_files[0],
                     initrd=boot_files[1], append=kernel_cmdline(), warm_pool=False)
    node = EdgeNode(NodeConfig(node_id="n1", capacity=Capacity(
        cpu_milli=64_000, memory_bytes=64 << 30, max_sandboxes=64)), b,
        rng=random.Random(3))
    await node.start()
    try:
        yield Env(node, b, store, cache)
    finally:
        ids = [i.id for i in node.list()]
        if ids:
            await node.destroy_many(ids)
        await node.close()
        try:
            assert _host_state(b) == (set(), [], set()), "destroy left something"
        finally:
            await b.reconcile(set())
            with contextlib.suppress(OSError):
                b.governor.remove_base()
            cache.close()


def _host_state(b: Any) -> tuple[set[str], list[str], set[str]]:
    """The sandboxes of ``b`` the host holds anything of (warm-pool builders aside)."""
    def mine(names: Any) -> set[str]:
        return {n for n in names if not n.startswith("pool-")}
    return (mine(b._qemu_pids()), sorted(os.listdir(os.path.join(b.root_dir, "sb"))),
            mine(b.governor.list_sandboxes()))


@pytest_asyncio.fixture(loop_scope="module", autouse=True)
async def no_leftovers(backend: Any) -> AsyncIterator[None]:
    yield
    for sid in list(backend._vms):
        await backend.destroy(sid)
    assert _host_state(backend) == (set(), [], set()), "destroy left something on the host"

