"""A snapshot of a sandbox on lazy layers moves to another node (issue 17 with issue 16's
relay: migrate, drain --migrate, a fork placed elsewhere): the receiver is granted the
image layers - recorded remote, read from the shared blob store - and only the
snapshot's own layer is relayed. Two real edge nodes (container backend, own layer
stores, own FUSE daemons) on Aether Unix sockets, the apiserver's LayerMover between
them with the control plane's records (its store holds the pushed manifests)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from dsec.control.layers import LayerMeaning, LayerMover
from dsec.edge.backends.container import ContainerBackend
from dsec.edge.backends.container.images import StoreImages
from dsec.edge.client import EdgeClient
from dsec.edge.lazy.layers import LazyConfig, LazyLayers
from dsec.edge.node import EdgeNode
from dsec.edge.service import serve_edge
from dsec.image import LayerStore, MountCache
from dsec.image.manifest import LayerManifest
from dsec.wire.spec import SandboxSpec
from tests.conftest import requires_root
from tests.edge.conftest import make_node
from tests.edge.lazy.conftest import Remote
from tests.image.conftest import sweep_mounts

pytestmark = [requires_root, pytest.mark.serial]   # two FUSE daemons and containers


@dataclass
class Side:
    client: EdgeClient
    store: LayerStore
    lazy: LazyLayers


@pytest.fixture
async def pair(tmp_path: object, remote: Remote) -> AsyncIterator[dict[str, Side]]:
    tmp = str(tmp_path)
    nodes: list[EdgeNode] = []
    servers = []
    sides: dict[str, Side] = {}
    owned: list[tuple[MountCache, LazyLayers]] = []
    try:
        for n in ("a", "b"):
            store = LayerStore(os.path.join(tmp, f"{n}-layers"))
            lazy = LazyLayers(LazyConfig(blob_url=remote.url, node=n, traces=False,
                                         cache_dir=os.path.join(tmp, f"{n}-chunks")))
            cache = MountCache(lazy=lazy)
            lazy.on_restart(cache.rebind_lazy)
            owned.append((cache, lazy))
            backend = ContainerBackend(root_dir=os.path.join(tmp, f"{n}-root"),
                                       images=StoreImages(store, cache, lazy))
            node = make_node(backend, node_id=n)
            await node.start()
            nodes.append(node)
            servers.append(await serve_edge(node, f"unix:{tmp}/{n}.sock"))
            sides[n] = Side(await EdgeClient.connect(f"unix:{tmp}/{n}.sock"), store, lazy)
        yield sides
    finally:
        for s in sides.values():
            await s.client.close()
        for srv in servers:
            await srv.close()
        for node in nodes:
            await node.close()
        sweep_mounts(tmp)
        for cache, lazy in owned:
            cache.close()
            sweep_mounts(cache.root)
            lazy.close()


async def test_a_snapshot_on_lazy_layers_moves_with_only_its_own_layer(
        pair: dict[str, Side], remote: Remote, tmp_path: object) -> None:
    # the control plane's records: the pushed manifests (its store), and the snapshot
    # it saw taken (snapshot_charges: kind, stack, project)
    cp = LayerStore(os.path.join(str(tmp_path), "cp-layers"))
    for m in remote.manifests:
        cp.add_remote(m)
    snaps: dict[str, LayerMeaning] = {}

    def meaning(d: str) -> LayerMeaning | None:
        if d in snaps:
            return snaps[d]
        if not cp.has(d):
            return None
        m = cp.get(d)
        return LayerMeaning(kind=m.kind, parent=m.parent, stack=m.stack,
                            namespace=m.namespace, labels=dict(m.labels))

    def pushed(d: str) -> LayerManifest | None:
        return cp.get(d) if cp.has(d) and cp.get(d).chunk_table is not None else None

    held: dict[str, set[str]] = {"a": set(), "b": set()}   # as heartbeats report
    given: dict[str, set[str]] = {"a": set(), "b": set()}  # granted / copied by digest
    links = {n: s.client for n, s in pair.items()}
    mover = LayerMover(link=links.get, nodes=lambda: list(links),
                       holders=lambda d: [n for n in held if d in held[n]],
                       holds=lambda n, d: d in held[n] or d in given[n],
                       note=lambda n, d: held[n].add(d),
                       copied=lambda n, d: given[n].add(d),
                       meaning=meaning, lazy=lambda n: True, pushed=pushed)

    # a create on node a: the image's layers granted, not copied
    for m in (remote.base, remote.workspace):
        got = await mover.fetch("a", m.digest, kind="image")
        assert got.remote == [m.digest] and got.copied == [] and got.bytes == 0
    a, b = pair["a"], pair["b"]
    assert not os.path.exists(a.store.layer_path(remote.workspace))   # remote: no file
    spec = SandboxSpec(backend="container", memory_bytes=256 << 20, pids_max=256,
                       image=remote.base.digest, workspace=remote.workspace.digest)
    sb = await a.client.create(spec)
    r = await a.client.exec(sb.id, "echo moved > /root/note && md5sum /work/big")
    assert r.exit_code == 0, r.stderr
    snap = await a.client.snapshot(sb.id)
    sm = a.store.get(snap.id)
    assert sm.kind == "snapshot" and set(sm.stack) >= {remote.base.digest,
                                                       remote.workspace.digest}
    snaps[snap.id] = LayerMeaning(kind="snapshot", parent=sm.parent, stack=sm.stack,
                                  namespace=sm.namespace, labels=dict(sm.labels))
    held["a"].add(snap.id)              # a's heartbeat: the snapshot, not the remote layers

    # the move (what migrate / a fork placed on b does before the create there)
    got = await mover.fetch("b", snap.id, kind="snapshot")
    assert got.copied == [snap.id], got
    assert set(got.remote) == set(sm.stack), got
    assert got.bytes == sm.size_bytes == mover.stats.bytes      # only the snapshot's layer
    for d in sm.stack:
        assert b.store.has(d) and not os.path.exists(b.store.layer_path(d)) and \
            b.lazy.knows(d), d
    assert os.path.exists(b.store.layer_path(snap.id))
    assert not os.path.exists(os.path.join(b.store.root, "layers",
                                           remote.workspace.hex + ".erofs"))
    # and the sandbox from it on b reads the snapshot's file and the image's, lazily
    before = b.lazy.stats(fresh=True).get("bytes_fetched", 0)
    moved = await b.client.create(SandboxSpec(backend="container", memory_bytes=256 << 20,
                                              pids_max=256, snapshot=snap.id))
    r = await b.client.exec(moved.id, "cat /root/note /work/readme && md5sum /work/big")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.startswith(b"moved\nworkspace layer\n")
    assert hashlib.md5(remote.big).hexdigest().encode() in r.stdout
    assert b.lazy.stats(fresh=True).get("bytes_fetched", 0) > before   # from the store
    for side, sid in ((a, sb.id), (b, moved.id)):
        await side.client.destroy(sid)
