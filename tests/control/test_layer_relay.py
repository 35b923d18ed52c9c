"""The apiserver's relay (dsec.control.layers) between real Aether servers on Unix
sockets: two edge nodes with their own stores, and a hostile holder (a router whose
``edge.layer_get`` stalls or sends too much) to check what the relay and the receiver
do with a peer that lies."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import pytest

from dsec.aether import Router, connect, serve
from dsec.aether.connection import DuplexStream
from dsec.control.layers import LayerMover, relay
from dsec.edge.client import EdgeClient
from dsec.edge.node import EdgeNode
from dsec.edge.service import serve_edge
from dsec.errors import CorruptLayer, ImageNotFound
from dsec.image import LayerStore
from dsec.image.manifest import LayerManifest
from dsec.wire import ops
from dsec.wire.layers import LayerChain, LayerRef
from tests.conftest import requires_root
from tests.edge.conftest import make_node

pytestmark = requires_root


@dataclass
class Two:
    a: EdgeClient
    b: EdgeClient
    a_store: LayerStore
    b_store: LayerStore
    tmp: str


@pytest.fixture
async def two(tmp_path: object) -> AsyncIterator[Two]:
    tmp = str(tmp_path)
    nodes: list[EdgeNode] = []
    servers = []
    clients = []
    try:
        for n in ("a", "b"):
            node = make_node(node_id=n, layer_store=os.path.join(tmp, f"{n}-layers"))
            await node.start()
            nodes.append(node)
            servers.append(await serve_edge(node, f"unix:{tmp}/{n}.sock"))
            clients.append(await EdgeClient.connect(f"unix:{tmp}/{n}.sock"))
        yield Two(clients[0], clients[1], LayerStore(os.path.join(tmp, "a-layers")),
                  LayerStore(os.path.join(tmp, "b-layers")), tmp)
    finally:
        for c in clients:
            await c.close()
        for s in servers:
            await s.close()
        for node in nodes:
            await node.close()


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write(path: str, data: bytes) -> None:
    """What a compromised holder's operator does to its own store's files."""
    with open(path, "wb") as f:
        f.write(data)


def _layer(store: LayerStore, tmp: str, size: int) -> LayerManifest:
    src = os.path.join(tmp, "src-" + os.urandom(3).hex())
    os.makedirs(src)
    with open(os.path.join(src, "f"), "wb") as f:
        f.write(os.urandom(size))
    return store.add_tree(src, kind="toolkit")


async def test_relay_copies_and_a_second_put_answers_without_reading(two: Two) -> None:
    m = _layer(two.a_store, two.tmp, 5 << 20)
    chain = await two.a.call(ops.LAYER_CHAIN, LayerRef(digest=m.digest))
    first = await relay(two.a, two.b, chain.manifests[-1], m.digest)
    assert (first.digest, first.size_bytes, first.already) == (m.digest, m.size_bytes, False)
    assert _read(two.a_store.layer_path(m)) == _read(two.b_store.layer_path(m))
    again = await relay(two.a, two.b, chain.manifests[-1], m.digest)
    assert again.already
    assert os.listdir(os.path.join(two.b_store.root, "tmp")) == []


async def test_the_mover_coalesces_one_digest_onto_one_node(two: Two) -> None:
    m = _layer(two.a_store, two.tmp, 3 << 20)
    held: dict[str, set[str]] = {"a": {m.digest}, "b": set()}
    links = {"a": two.a, "b": two.b}
    mover = LayerMover(link=links.get, holders=lambda d: [n for n in held if d in held[n]],
                       nodes=lambda: list(links), holds=lambda n, d: d in held[n],
                       note=lambda n, d: held[n].add(d))
    got = await asyncio.gather(*(mover.fetch("b", m.digest) for _ in range(4)))
    assert sum(len(g.copied) for g in got) == 1          # one relay, three waited for it
    assert mover.stats.layers == 1 and mover.stats.bytes == m.size_bytes
    assert m.digest in held["b"] and two.b_store.has(m.digest)
    with pytest.raises(ImageNotFound, match="no healthy node"):
        await mover.fetch("b", "sha256:" + "0" * 64)
    # a snapshot is never fetched where an image is asked for, nor the reverse
    src = os.path.join(two.tmp, "snap-tree")
    os.makedirs(src)
    snap = two.a_store.add_tree(src, kind="snapshot", stack=(m.digest,),
                                labels={"dsec.io/project": "p"})
    held["a"].add(snap.digest)
    with pytest.raises(ImageNotFound, match="it is a snapshot"):
        await mover.fetch("b", snap.digest, kind="image")
    fresh = LayerMover(link=links.get, holders=lambda d: ["a"], nodes=lambda: ["a"],
                       holds=lambda n, d: False, note=lambda n, d: None)
    with pytest.raises(ImageNotFound, match="not a snapshot"):
        await fresh.fetch("b", m.digest, kind="snapshot")
    assert not two.b_store.has(snap.digest)


class Hostile:
    """A holder whose ``layer_get`` sends ``head`` then stalls (or, ``extra``, sends more
    than the layer)."""

    def __init__(self, real: LayerStore, m: LayerManifest, *, extra: bool) -> None:
        self.real, self.m, self.extra = real, m, extra

    def router(self) -> Router:
        r = Router()
        r.add(ops.LAYER_CHAIN.edge_method, self.chain, request_type=LayerRef)
        r.add(ops.LAYER_GET.edge_method, self.get, request_type=LayerRef, duplex=True)
        return r

    def chain(self, b: LayerRef) -> LayerChain:
        return LayerChain(manifests=[msgspec.json.encode(self.m)])

    async def get(self, b: LayerRef, stream: DuplexStream) -> None:
        data = _read(self.real.layer_path(self.m))
        if self.extra:
            await stream.send(data + b"\0" * (1 << 20))
            stream.close_write()
            return
        await stream.send(data[: len(data) // 2])
        await asyncio.sleep(3600)


@pytest.mark.parametrize("extra", [False, True], ids=["stalls", "sends-more"])
async def test_a_hostile_holder_is_cut_off_and_the_receiver_keeps_nothing(
        two: Two, extra: bool) -> None:
    m = _layer(two.a_store, two.tmp, 3 << 20)
    hostile = Hostile(two.a_store, m, extra=extra)
    server = await serve(hostile.router(), f"unix:{two.tmp}/hostile.sock")
    conn = await connect(f"unix:{two.tmp}/hostile.sock")
    evil = EdgeClient(conn)      # no node_info: the protocol check is not what this tests
    try:
        with pytest.raises(CorruptLayer) as ei:
            await relay(evil, two.b, msgspec.json.encode(m), m.digest, idle_timeout_s=0.5)
        assert m.digest in str(ei.value)
        assert ("sent nothing for 0.5s" in str(ei.value)) != extra
        for _ in range(100):      # the receiver's handler ends on the reset
            if os.listdir(os.path.join(two.b_store.root, "tmp")) == []:
                break
            await asyncio.sleep(0.02)
        assert os.listdir(os.path.join(two.b_store.root, "tmp")) == []
        assert not two.b_store.has(m.digest)
    finally:
        await evil.close()
        await conn.close()
        await server.close()


async def test_a_fetch_publishes_the_control_planes_meaning_not_the_holders(two: Two) -> None:
    """Red team 16 F1 at the relay: the holder ``a`` rewrote its snapshot's manifest (a
    layer of its own under it, another project, a label). The mover takes what the
    layer is and stands on from the control plane's record (``meaning``) and only the
    bytes from the holder: ``b`` stores the recorded stack, project and kind, never
    the forged layer; a layer with no record does not move at all."""
    from dsec.control.layers import LayerMeaning
    from dsec.image.manifest import PROJECT_LABEL

    img = _layer(two.a_store, two.tmp, 1 << 20)
    evil = _layer(two.a_store, two.tmp, 1 << 20)
    src = os.path.join(two.tmp, "snap-tree2")
    os.makedirs(src)
    snap = two.a_store.add_tree(src, kind="snapshot", stack=(img.digest,),
                                labels={PROJECT_LABEL: "victim"}, namespace="victim")
    forged = msgspec.structs.replace(snap, stack=(evil.digest, img.digest),
                                     namespace="thief", labels={PROJECT_LABEL: "thief"},
                                     name="stolen")
    _write(os.path.join(two.a_store.root, "manifests", snap.hex + ".json"),
           msgspec.json.encode(forged))
    records = {
        snap.digest: LayerMeaning(kind="snapshot", stack=(img.digest,), namespace="victim",
                                  labels={PROJECT_LABEL: "victim"}),
        img.digest: LayerMeaning(kind="toolkit"),
    }
    links = {"a": two.a, "b": two.b}
    held: dict[str, set[str]] = {"a": {snap.digest, img.digest, evil.digest}, "b": set()}
    mover = LayerMover(link=links.get, holders=lambda d: [n for n in held if d in held[n]],
                       nodes=lambda: list(links), holds=lambda n, d: d in held[n],
                       note=lambda n, d: held[n].add(d), meaning=records.get)
    got = await mover.fetch("b", snap.digest, kind="snapshot")
    assert got.copied == [img.digest, snap.digest]
    stored = two.b_store.get(snap.digest)
    assert stored.stack == (img.digest,) and stored.kind == "snapshot"
    assert (stored.namespace, stored.labels, stored.name) == (
        "victim", {PROJECT_LABEL: "victim"}, None)
    assert not two.b_store.has(evil.digest)
    # the kind is the record's too: a toolkit the holder calls a snapshot is no snapshot
    tk = _layer(two.a_store, two.tmp, 1 << 20)
    records[tk.digest] = LayerMeaning(kind="toolkit")
    held["a"].add(tk.digest)
    path = os.path.join(two.a_store.root, "manifests", tk.hex + ".json")
    _write(path, msgspec.json.encode(msgspec.structs.replace(tk, kind="snapshot")))
    with pytest.raises(ImageNotFound, match="not a snapshot"):
        await mover.fetch("b", tk.digest, kind="snapshot")
    assert not two.b_store.has(tk.digest)
    # no record: the holder's word alone moves nothing
    with pytest.raises(ImageNotFound, match="not one this cluster recorded"):
        await mover.fetch("b", evil.digest)
    assert not two.b_store.has(evil.digest)
