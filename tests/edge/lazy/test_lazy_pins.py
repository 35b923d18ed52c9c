"""Image pins reach the node (issue 17, gap 2): pinned through the SDK, the node's edge
fetches the image whole into its chunk cache and keeps it there under LRU pressure; an
unpin makes it evictable again (the next pin's chunks push it out); an edge restarted
gets its pins again. A real cluster (`dsec edge` processes, FUSE, a file:// blob store);
the images exist only in the blob store (the cluster's layer store knows their
manifests, as after a push from another cluster, and no layer file)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest

from dsec import LocalCluster
from dsec.image import LayerStore
from dsec.image.blob import open_blobstore
from dsec.image.manifest import LayerManifest
from dsec.wire.layers import pins_fingerprint
from tests.conftest import requires_root
from tests.edge.lazy.conftest import push_layer
from tests.image.conftest import write_tree

pytestmark = requires_root

CHUNK = 256 * 1024
BUDGET = 1 << 20               # the chunk cache's LRU budget: under one image


def _wait(what: str, cond: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def world() -> Iterator[tuple[LocalCluster, LayerManifest, LayerManifest]]:
    work = tempfile.mkdtemp(prefix="dsec-pins-")
    try:
        src = LayerStore(os.path.join(work, "src"))
        blob = open_blobstore(f"file://{work}/blobs")
        images = []
        for name in ("pa", "pb"):
            write_tree(os.path.join(work, name), {"data/f": os.urandom(3 << 20)})
            m = src.add_tree(os.path.join(work, name), kind="base", name=name)
            images.append(push_layer(blob, src, m))   # records the chunk table
        with LocalCluster(edges=1, backend="container", blob_store=blob.url,
                          edge_processes=True, lazy_cache_bytes=BUDGET) as cl:
            store = LayerStore(os.path.join(cl.state_dir, "layers"))
            for m in images:
                store.add_remote(m)
            yield cl, images[0], images[1]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _stats(cl: LocalCluster) -> dict[str, Any]:
    paths = glob.glob(os.path.join(cl.state_dir, "edges", "*", "lazy-chunks", "stats.json"))
    assert len(paths) == 1, paths
    try:
        with open(paths[0], "rb") as f:
            doc: dict[str, Any] = json.loads(f.read())
            return doc
    except (FileNotFoundError, ValueError):
        return {}


def _present(cl: LocalCluster, m: LayerManifest) -> int:
    return int(_stats(cl).get("layers", {}).get(m.hex, {}).get("present", 0))


def test_pin_reaches_the_node_and_holds_the_image_whole(
        world: tuple[LocalCluster, LayerManifest, LayerManifest]) -> None:
    cl, a, b = world
    node = cl.runtime.node_ids[0]
    chunks = -(-a.size_bytes // CHUNK)
    with cl.client(session_lease_s=None) as c:
        c.images.pin(a.digest, node=node)
        _wait("the pinned image whole in the node's chunk cache",
              lambda: _present(cl, a) == chunks)
        st = _stats(cl)
        assert st["cache_bytes"] == a.size_bytes > BUDGET      # over budget, kept whole
        assert st["evictions"] == 0 and st["bytes_fetched"] == a.size_bytes
        plane = cl.runtime.plane
        _wait("the node to report the pin applied",
              lambda: plane.edges[node].heartbeat.pins_gen == pins_fingerprint([a.digest]))
        # unpinned, then b pinned: b's chunks push a's out (LRU), b stays whole
        c.images.unpin(a.digest, node=node)
        _wait("the unpin applied", lambda: plane.edges[node].heartbeat.pins_gen == 0)
        assert _present(cl, a) == chunks            # evictable now, not evicted yet
        c.images.pin(b.digest, node=node)
        _wait("b whole", lambda: _present(cl, b) == -(-b.size_bytes // CHUNK))
        _wait("a evicted", lambda: _present(cl, a) == 0)
        st = _stats(cl)
        assert st["cache_bytes"] == b.size_bytes and st["evictions"] == chunks
        _wait("the node to report b pinned",
              lambda: plane.edges[node].heartbeat.pins_gen == pins_fingerprint([b.digest]))


def test_a_restarted_edge_gets_its_pins_again(
        world: tuple[LocalCluster, LayerManifest, LayerManifest]) -> None:
    cl, _, b = world
    node = cl.runtime.node_ids[0]
    plane = cl.runtime.plane
    with cl.client(session_lease_s=None) as c:
        c.images.pin(b.digest, node=node)
    gen = pins_fingerprint([b.digest])
    _wait("the pin applied", lambda: plane.edges[node].heartbeat.pins_gen == gen)
    old = _stats(cl)["pid"]
    cl.kill_edge(node)                 # its supervisor restarts it; it starts with none
    t0 = time.time()
    _wait("the restarted edge's pins", lambda: (
        plane.edges[node].heartbeat.time > t0
        and plane.edges[node].heartbeat.pins_gen == gen
        and _stats(cl).get("pid") not in (None, old)
        and _present(cl, b) == -(-b.size_bytes // CHUNK)))


def test_a_create_through_the_api_is_granted_the_pushed_layers(
        world: tuple[LocalCluster, LayerManifest, LayerManifest]) -> None:
    """The create door: the control plane grants the lazy node the image's pushed
    manifests (layer_grant) instead of relaying the layer, and the node reads it from
    the blob store; nothing was copied whole."""
    cl, a, _ = world
    node = cl.runtime.node_ids[0]
    plane = cl.runtime.plane
    _wait("the node's heartbeat says it reads layers lazily",
          lambda: plane.edges[node].heartbeat is not None
          and plane.edges[node].heartbeat.lazy)
    with cl.client(session_lease_s=None) as c:
        sb = c.sandboxes.create(image=a.digest, backend="container")
        try:
            # the image has no shell: read through the file API (the edge's own reads
            # of the sandbox's root, through overlayfs, EROFS and the FUSE file)
            assert len(sb.files.read("/data/f")) == 3 << 20
        finally:
            sb.kill()
    assert a.digest in plane.edges[node].fetched          # granted, by digest
    assert plane.mover.stats.layers == 0                   # nothing relayed whole


def test_a_forged_chunk_table_fails_the_create_with_a_clear_error(
        world: tuple[LocalCluster, LayerManifest, LayerManifest]) -> None:
    """Red team 17 F1 at the API door: a writer of the blob store swaps a pushed layer's
    chunk table (and its .manifest, to agree); the create through the control plane is
    refused with an error naming the layer and the table - never a sandbox on other
    bytes - and nothing is left recorded on the node."""
    from dsec.errors import DsecError
    from dsec.image.blob import layer_chunks_key, layer_manifest_key
    from dsec.image.chunks import ChunkTable, table_ref

    cl, _, _ = world
    node = cl.runtime.node_ids[0]
    work = tempfile.mkdtemp(prefix="dsec-forge-")
    try:
        src = LayerStore(os.path.join(work, "src"))
        write_tree(os.path.join(work, "pc"), {"data/f": os.urandom(1 << 20)})
        m = src.add_tree(os.path.join(work, "pc"), kind="base", name="pc")
        blob = open_blobstore(cl.runtime.plane.images.blob_store)
        m = push_layer(blob, src, m)
        LayerStore(os.path.join(cl.state_dir, "layers")).add_remote(m)
        root = blob.url.removeprefix("file://")
        table = ChunkTable.decode(blob.get_range(layer_chunks_key(m.digest), 0,
                                                 m.chunk_table.size))   # type: ignore[union-attr]
        hashes = list(table.hashes)
        hashes[0] = bytes(32)                     # the chunk the forger wants to serve
        raw, ref = table_ref(ChunkTable(digest=m.digest, size=table.size,
                                        chunk_size=table.chunk_size, hashes=hashes))
        with open(os.path.join(root, layer_chunks_key(m.digest)), "wb") as f:
            f.write(raw)
        with open(os.path.join(root, layer_manifest_key(m.digest)), "wb") as f:
            f.write(msgspec.json.encode(msgspec.structs.replace(m, chunk_table=ref)))
        with cl.client(session_lease_s=None) as c, \
                pytest.raises(DsecError, match="chunk table") as err:
            c.sandboxes.create(image=m.digest, backend="container")
        assert m.digest in str(err.value)
        assert m.digest not in cl.runtime.plane.edges[node].fetched
    finally:
        shutil.rmtree(work, ignore_errors=True)
