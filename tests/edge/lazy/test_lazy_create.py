"""A cold create on lazy layers waits on the blob store off the edge's event loop
(issue 17, gap 1): while it waits, the node's other sandboxes answer; a create cancelled
meanwhile leaves no mount reference once the cancellation surfaces; and the node's mount
cache shares and releases other layers while one layer's first mount is in progress."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import msgspec
import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.edge.backends.container.images import StoreImages
from dsec.edge.lazy.layers import LazyConfig, LazyLayers
from dsec.image import LayerStore, MountCache
from dsec.image.blob import BlobStore, open_blobstore
from dsec.image.manifest import LayerManifest
from tests.conftest import requires_root
from tests.edge.container.conftest import _cleanup, new_sid
from tests.edge.lazy.conftest import Node, Remote, fuse_mounts
from tests.edge.lazy.test_lazy_sandbox import sh, spec_of
from tests.image.conftest import sweep_mounts

pytestmark = requires_root

SAFETY_S = 30.0
"""The gate opens by itself after this long, so code that blocks the loop behind it (the
old create) fails the test instead of hanging it."""


@dataclass(eq=False)
class GatedBlob:
    """The node's blob store, with reads of keys naming ``hold`` blocked until ``gate`` is
    set (a blob store that stopped answering; ``entered`` says a read is waiting)."""

    inner: BlobStore
    hold: str = ""
    gate: threading.Event = field(default_factory=threading.Event)
    entered: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        return self.inner.url

    def _wait(self, key: str) -> None:
        if self.hold and self.hold in key:
            self.entered.set()
            self.gate.wait(SAFETY_S)

    def head(self, key: str) -> int | None:
        self._wait(key)
        return self.inner.head(key)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        self._wait(key)
        return self.inner.get_range(key, offset, length)

    def put_file(self, key: str, path: str) -> None:
        self.inner.put_file(key, path)

    def put_bytes(self, key: str, data: bytes) -> None:
        self.inner.put_bytes(key, data)

    def delete(self, key: str) -> None:
        self.inner.delete(key)


@pytest.fixture
def gated(tmp_path: object, remote: Remote) -> Iterator[tuple[Node, GatedBlob]]:
    tmp = str(tmp_path)
    blob = GatedBlob(open_blobstore(remote.url))
    store = LayerStore(os.path.join(tmp, "node-store"))
    lazy = LazyLayers(LazyConfig(blob_url=remote.url, cache_dir=os.path.join(tmp, "chunks"),
                                 retry_budget_s=1.0, traces=False), blob=blob)
    cache = MountCache(lazy=lazy)
    try:
        yield Node(store, lazy, cache, StoreImages(store, cache, lazy)), blob
    finally:
        blob.gate.set()
        sweep_mounts(tmp)
        cache.close()
        sweep_mounts(cache.root)
        lazy.close()


@pytest.fixture
async def gated_backend(gated: tuple[Node, GatedBlob],
                        tmp_path: object) -> AsyncIterator[ContainerBackend]:
    node, _ = gated
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"), images=node.images)
    try:
        yield b
    finally:
        await _cleanup(b)


def _erofs_mounts_under(root: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [ln.split(" ")[4] for ln in f
                if " - erofs " in ln and ln.split(" ")[4].startswith(root + "/")]


async def test_cold_create_waiting_on_the_blob_store_does_not_stall_other_sandboxes(
        gated_backend: ContainerBackend, gated: tuple[Node, GatedBlob],
        remote: Remote) -> None:
    b, (node, blob) = gated_backend, gated
    node.images.grant([remote.base])
    other = new_sid()
    await b.create(other, msgspec.structs.replace(spec_of(remote), workspace=None,
                                                  toolkits=()))
    blob.hold = remote.workspace.hex            # the workspace layer: not on this node yet
    timer = threading.Timer(SAFETY_S, blob.gate.set)
    timer.start()

    async def grant_then_create() -> None:
        # what the control plane asks: layer_grant (the edge runs it off its loop:
        # EdgeNode.grant_layers), then the create
        await asyncio.to_thread(node.images.grant, remote.manifests)
        await b.create(cold_sid, spec_of(remote))
    try:
        cold_sid = new_sid()
        cold = asyncio.create_task(grant_then_create())
        assert await asyncio.to_thread(blob.entered.wait, SAFETY_S)
        r = await sh(b, other, "echo still here")
        # answered while the cold create still waits on the blob store
        assert not blob.gate.is_set() and not cold.done()
        assert r.exit_code == 0 and r.stdout == b"still here\n"
        blob.gate.set()
        await cold
        r = await sh(b, cold_sid, "cat /work/readme")
        assert r.exit_code == 0 and r.stdout == b"workspace layer\n"
    finally:
        timer.cancel()
        blob.gate.set()


async def test_cancelled_cold_create_leaves_no_mount(
        gated_backend: ContainerBackend, gated: tuple[Node, GatedBlob],
        remote: Remote) -> None:
    b, (node, blob) = gated_backend, gated
    node.images.grant(remote.manifests)         # the control plane's layer_grant
    def ours() -> set[str]:
        # this node's daemon only: other workers' lazy nodes mount and unmount theirs
        # meanwhile (/run/dsec/m*, seen in the full suite)
        return {m for m in fuse_mounts() if m.startswith(node.lazy.root + "/")}
    before = ours()
    # the workspace's first mount (its superblock read through FUSE) waits after the
    # base layer was mounted: the cancel lands mid-acquire, and the thread goes on to
    # mount all three layers
    src = GatedSource(node.lazy, hold=remote.workspace.digest)
    node.cache.lazy = src
    sid = new_sid()
    cold = asyncio.create_task(b.create(sid, spec_of(remote)))
    assert await asyncio.to_thread(src.entered.wait, SAFETY_S)
    cold.cancel()
    opener = threading.Timer(0.2, src.gate.set)  # the mount goes on after the cancel
    opener.start()
    try:
        with pytest.raises(asyncio.CancelledError):
            await cold
    finally:
        opener.cancel()
        src.gate.set()
        blob.gate.set()
        node.cache.lazy = node.lazy
    assert node.cache.mounted() == {}
    assert _erofs_mounts_under(node.cache.root) == []
    assert sid not in b.sandbox_ids() and not os.path.exists(b._dir(sid))
    assert ours() == before                     # the daemon's own mount only
    # and the node is whole: the same create now succeeds and reads every layer
    await b.create(sid, spec_of(remote))
    r = await sh(b, sid, "cat /opt/tool /work/readme")
    assert r.exit_code == 0 and r.stdout == b"toolkit layer\nworkspace layer\n"


@dataclass(eq=False)
class GatedSource:
    """A lazy source whose ``path`` of one layer blocks (its first mount in progress)."""

    inner: LazyLayers
    hold: str
    gate: threading.Event = field(default_factory=threading.Event)
    entered: threading.Event = field(default_factory=threading.Event)

    def path(self, manifest: LayerManifest) -> str | None:
        if manifest.digest == self.hold:
            self.entered.set()
            self.gate.wait(SAFETY_S)
        return self.inner.path(manifest)


def test_mount_cache_shares_other_layers_while_one_mounts(
        node: Node, remote: Remote) -> None:
    stack = node.images.stack_for(spec_of(remote))        # resolves all three (remote)
    src = GatedSource(node.lazy, hold=remote.workspace.digest)
    cache = MountCache(lazy=src)
    got: list[str] = []
    try:
        base = cache.acquire(remote.base, node.store.layer_path(remote.base))
        slow = threading.Thread(target=lambda: got.append(cache.acquire(
            remote.workspace, node.store.layer_path(remote.workspace))))
        slow.start()
        assert src.entered.wait(SAFETY_S)
        fast = threading.Thread(target=lambda: (
            cache.acquire(remote.base, node.store.layer_path(remote.base)),
            cache.release(remote.base.digest)))
        fast.start()
        fast.join(SAFETY_S)
        assert not fast.is_alive() and not src.gate.is_set()
        assert cache.refs(remote.base.digest) == 1
        src.gate.set()
        slow.join(SAFETY_S)
        assert got and os.listdir(got[0])
        # a second caller of the layer being mounted shares that one mount
        assert cache.acquire(remote.workspace,
                             node.store.layer_path(remote.workspace)) == got[0]
        assert cache.refs(remote.workspace.digest) == 2
        assert base in cache.mounted().values() and len(stack.layers) == 3
    finally:
        src.gate.set()
        cache.close()
        sweep_mounts(cache.root)
