"""The receiving edge's checks on a layer from another node (dsec.edge.layers): a real
layer built in store A, received into store B through :class:`EdgeLayers` from a
scripted byte stream (the peer is the boundary here: a hostile one is scripted to send
more, other or fewer bytes, or to stall). Whatever is refused leaves no file in B."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import msgspec
import pytest

from dsec.edge.layers import EdgeLayers
from dsec.errors import CapacityExceeded, CorruptLayer, ImageError, InvalidArgument
from dsec.image import LayerStore
from dsec.image.manifest import LayerManifest
from dsec.image.transfer import decode_manifest
from dsec.wire.layers import LayerFetch, LayerRef
from tests.conftest import requires_root
from tests.image.conftest import write_tree

pytestmark = requires_root

_enc = msgspec.json.Encoder()


class ScriptedStream:
    """The peer's side of a duplex stream: hands out ``chunks`` to ``recv``; ``stall``:
    after them it never answers (a peer holding the stream open)."""

    def __init__(self, chunks: list[bytes], *, stall: bool = False) -> None:
        self.chunks = list(chunks)
        self.stall = stall
        self.reads = 0

    async def recv(self, max_bytes: int | None = None) -> bytes:
        self.reads += 1
        if self.chunks:
            return self.chunks.pop(0)
        if self.stall:
            await asyncio.sleep(3600)
        return b""


def pieces(data: bytes, n: int = 1 << 20) -> list[bytes]:
    return [data[i:i + n] for i in range(0, len(data), n)]


@pytest.fixture
def stores(tmp_path: object) -> Iterator[tuple[LayerStore, LayerStore]]:
    yield (LayerStore(os.path.join(str(tmp_path), "a")),
           LayerStore(os.path.join(str(tmp_path), "b")))


def built(store: LayerStore, tmp: str, files: dict[str, str | bytes], **kw: object
          ) -> LayerManifest:
    src = os.path.join(tmp, "src-" + os.urandom(3).hex())
    os.makedirs(src)
    write_tree(src, files)  # type: ignore[arg-type]
    return store.add_tree(src, **kw)  # type: ignore[arg-type]


def leftovers(store: LayerStore) -> list[str]:
    return sorted(os.listdir(os.path.join(store.root, "tmp")))


def layer_bytes(store: LayerStore, m: LayerManifest) -> bytes:
    with open(store.layer_path(m), "rb") as f:
        return f.read()


def receive(b: LayerStore, m: LayerManifest, stream: ScriptedStream, **kw: object
            ) -> LayerManifest:
    edge = EdgeLayers(lambda: b, **kw)  # type: ignore[arg-type]
    got = asyncio.run(edge.receive(_enc.encode(m), stream))  # type: ignore[arg-type]
    assert got.digest == m.digest and got.size_bytes == m.size_bytes
    return b.get(got.digest)


def test_a_whole_layer_is_published_with_its_manifest(
        stores: tuple[LayerStore, LayerStore], tmp_path: object) -> None:
    a, b = stores
    m = built(a, str(tmp_path), {"etc/os": "dsec", "big": os.urandom(3 << 20)}, kind="base")
    data = layer_bytes(a, m)
    got = receive(b, m, ScriptedStream(pieces(data)))
    assert got == m
    assert b.get(m.digest) == m
    assert layer_bytes(b, m) == data
    assert oct(os.stat(b.layer_path(m)).st_mode & 0o777) == "0o400"
    assert leftovers(b) == []
    # idempotent: a second put answers the stored layer without reading a byte
    s = ScriptedStream(pieces(data))
    assert receive(b, m, s) == m and s.reads == 0


@pytest.mark.parametrize("hostile", ["more", "wrong", "truncated", "big_chunk"])
def test_a_lying_peer_is_cut_off_and_nothing_is_kept(
        stores: tuple[LayerStore, LayerStore], tmp_path: object, hostile: str) -> None:
    a, b = stores
    m = built(a, str(tmp_path), {"f": os.urandom(2 << 20)}, kind="base")
    data = layer_bytes(a, m)
    chunks = {
        "more": pieces(data) + [b"x" * 10],
        "wrong": pieces(data[:-1] + bytes([data[-1] ^ 1])),
        "truncated": pieces(data[:-4096]),
        "big_chunk": [data],     # one read over the 1 MiB chunk bound
    }[hostile]
    with pytest.raises(CorruptLayer) as ei:
        receive(b, m, ScriptedStream(chunks))
    msg = str(ei.value)
    assert m.digest in msg and "refused" in msg
    assert not b.has(m.digest)
    assert not os.path.exists(b.layer_path(m))
    assert leftovers(b) == []


def test_a_stalled_peer_is_cut_off(stores: tuple[LayerStore, LayerStore],
                                   tmp_path: object) -> None:
    a, b = stores
    m = built(a, str(tmp_path), {"f": os.urandom(2 << 20)}, kind="base")
    data = layer_bytes(a, m)
    with pytest.raises(CorruptLayer, match="no bytes for 0.3s"):
        receive(b, m, ScriptedStream(pieces(data)[:1], stall=True), idle_timeout_s=0.3)
    assert not b.has(m.digest) and leftovers(b) == []


def test_a_manifest_for_another_digest_or_kind_is_refused() -> None:
    m = LayerManifest(digest="sha256:" + "a" * 64, kind="base", size_bytes=10, created=1.0)
    with pytest.raises(CorruptLayer, match="asked for"):
        decode_manifest(_enc.encode(m), digest="sha256:" + "b" * 64)
    with pytest.raises(CorruptLayer, match="unreadable"):
        decode_manifest(b'{"digest": 1}')
    with pytest.raises(InvalidArgument, match="full digest"):
        decode_manifest(_enc.encode(msgspec.structs.replace(m, digest="sha256:abc")))
    with pytest.raises(CorruptLayer, match="0 bytes"):
        decode_manifest(_enc.encode(msgspec.structs.replace(m, size_bytes=0)))
    with pytest.raises(InvalidArgument, match="full digest"):
        LayerRef(digest="sha256:" + "a" * 12)      # never a prefix
    with pytest.raises(InvalidArgument, match="node id"):
        LayerFetch(node="../x", digest=m.digest)


def test_over_the_budget_is_refused_before_a_byte_is_read(
        stores: tuple[LayerStore, LayerStore], tmp_path: object) -> None:
    a, b = stores
    m = built(a, str(tmp_path), {"f": os.urandom(1 << 20)}, kind="base")
    b.set_budget(m.size_bytes - 1)
    s = ScriptedStream(pieces(layer_bytes(a, m)))
    with pytest.raises(CapacityExceeded, match="budget"):
        receive(b, m, s)
    assert s.reads == 0 and not b.has(m.digest)
    # a disk too full for it: refused too (the host's free space, injected)
    b.set_budget(None)
    s = ScriptedStream(pieces(layer_bytes(a, m)))
    with pytest.raises(CapacityExceeded, match="free"):
        receive(b, m, s, free_bytes=lambda root: 1 << 20)
    assert s.reads == 0 and leftovers(b) == []


def test_fetched_layers_count_against_the_budget(
        stores: tuple[LayerStore, LayerStore], tmp_path: object) -> None:
    """A fetch that takes the store over its budget makes room as a build does: the
    least recently used unreferenced layers go, never the one just fetched."""
    a, b = stores
    old = built(b, str(tmp_path), {"old": os.urandom(1 << 20)}, kind="base")
    m = built(a, str(tmp_path), {"new": os.urandom(1 << 20)}, kind="base")
    os.utime(os.path.join(b.root, "manifests", old.hex + ".json"), (1, 1))  # idle
    b.set_budget(m.size_bytes + old.size_bytes // 2)
    receive(b, m, ScriptedStream(pieces(layer_bytes(a, m))))
    assert b.has(m.digest) and not b.has(old.digest)


def test_concurrent_puts_of_one_digest_coalesce(
        stores: tuple[LayerStore, LayerStore], tmp_path: object) -> None:
    a, b = stores
    m = built(a, str(tmp_path), {"f": os.urandom(3 << 20)}, kind="base")
    data = layer_bytes(a, m)
    edge = EdgeLayers(lambda: b)

    async def both() -> tuple[ScriptedStream, ScriptedStream]:
        s1, s2 = ScriptedStream(pieces(data)), ScriptedStream(pieces(data))
        r = await asyncio.gather(edge.receive(_enc.encode(m), s1),  # type: ignore[arg-type]
                                 edge.receive(_enc.encode(m), s2))  # type: ignore[arg-type]
        assert r[0].digest == r[1].digest == m.digest
        assert [r[0].already, r[1].already] == [False, True]
        return s1, s2

    s1, s2 = asyncio.run(both())
    assert s1.reads > 0 and s2.reads == 0        # the second waited for the first
    assert leftovers(b) == []


def test_a_snapshot_is_published_only_above_its_chain(
        stores: tuple[LayerStore, LayerStore], tmp_path: object) -> None:
    a, b = stores
    base = built(a, str(tmp_path), {"f": "base"}, kind="base")
    snap = built(a, str(tmp_path), {"g": "snap"}, kind="snapshot", stack=(base.digest,),
                 labels={"dsec.io/project": "teama"})
    with pytest.raises(ImageError, match="stands on"):
        receive(b, snap, ScriptedStream(pieces(layer_bytes(a, snap))))
    assert not b.has(snap.digest) and leftovers(b) == []
    chain = EdgeLayers(lambda: a).chain(snap.digest)
    order = [decode_manifest(x).digest for x in chain.manifests]
    assert order == [base.digest, snap.digest]
    for raw in chain.manifests:
        mm = decode_manifest(raw)
        receive(b, mm, ScriptedStream(pieces(layer_bytes(a, mm))))
    assert b.get(snap.digest).stack == (base.digest,)
    assert [x.digest for x in b.lowers(b.get(snap.digest))] == [snap.digest, base.digest]


_KILLED_RECEIVER = r"""
import asyncio, os, sys, msgspec
from dsec.edge.layers import EdgeLayers
from dsec.image import LayerStore
from dsec.image.manifest import LayerManifest
m = msgspec.json.decode(open(sys.argv[2], "rb").read(), type=LayerManifest)
b = LayerStore(sys.argv[1])

class Slow:
    sent = 0
    async def recv(self, n=None):
        if self.sent == 0:
            self.sent = 1
            return b"\0" * 65536
        print("receiving", flush=True)
        await asyncio.sleep(3600)
        return b""

asyncio.run(EdgeLayers(lambda: b).receive(open(sys.argv[2], "rb").read(), Slow()))
"""


def test_kill_9_mid_receive_leaves_nothing_after_restart(
        stores: tuple[LayerStore, LayerStore], tmp_path: object) -> None:
    a, b = stores
    m = built(a, str(tmp_path), {"f": os.urandom(1 << 20)}, kind="base")
    mf = os.path.join(str(tmp_path), "m.json")
    with open(mf, "wb") as f:
        f.write(_enc.encode(m))
    p = subprocess.Popen([sys.executable, "-c", _KILLED_RECEIVER, b.root, mf],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "receiving"
        assert any(n.endswith(".erofs") for n in leftovers(b))   # half a layer, mid-fetch
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    b2 = LayerStore(b.root)        # the edge's restart opens its store: reconciled
    assert leftovers(b2) == []
    assert not b2.has(m.digest)


def test_a_heartbeat_lists_layers_only_when_they_changed(tmp_path: object) -> None:
    """10,000 digests are 730 KB a heartbeat: an edge answers ``images_same`` (no list)
    to a control plane holding its current fingerprint, and the list again once a layer
    arrived (or a name moved)."""
    from tests.edge.conftest import make_node

    root = os.path.join(str(tmp_path), "store")
    store = LayerStore(root)
    node = make_node(layer_store=root)
    first = node.heartbeat(images_gen=None)
    assert not first.images_same and first.images_gen
    same = node.heartbeat(images_gen=first.images_gen)
    assert same.images_same and same.images == [] and same.images_gen == first.images_gen
    m = built(store, str(tmp_path), {"f": "x"}, kind="toolkit", name="t")
    again = node.heartbeat(images_gen=first.images_gen)
    assert not again.images_same and again.images_gen != first.images_gen
    assert m.digest in again.images and "t:latest" in again.images
    assert node.heartbeat(images_gen=again.images_gen).images_same
    store.untag("t:latest")
    moved = node.heartbeat(images_gen=again.images_gen)
    assert not moved.images_same and "t:latest" not in moved.images
    # and over the wire: the encoded unchanged heartbeat is small
    assert len(msgspec.msgpack.encode(node.heartbeat(images_gen=moved.images_gen))) < 400


def test_a_heartbeat_sees_a_layer_file_arrive_and_a_change_within_one_tick(
        tmp_path: object) -> None:
    """Red team 23b B2: the images fingerprint keyed on ``manifests/`` and refs.json
    only, so a layer whose file arrived later (a lazily read layer fetched whole) went
    unreported; and a stamp is blind to a second change within one tick of the kernel's
    coarse clock. ``layers/`` is stamped too, and a stamp younger than a second is not
    trusted (the list is recomputed): here a change is hidden by putting the
    directory's mtime back, as a same-tick change leaves it."""
    from tests.edge.conftest import make_node

    root = os.path.join(str(tmp_path), "store")
    store = LayerStore(root)
    m = built(store, str(tmp_path), {"f": "x"}, kind="toolkit", name="t")
    layer = store.layer_path(m)
    aside = os.path.join(str(tmp_path), "aside.erofs")
    os.rename(layer, aside)                       # the manifest only: read lazily
    node = make_node(layer_store=root)
    lazy = node.heartbeat(images_gen=None)
    assert m.digest not in lazy.images
    os.rename(aside, layer)                       # the whole file arrives
    whole = node.heartbeat(images_gen=lazy.images_gen)
    assert not whole.images_same and m.digest in whole.images
    d = os.path.dirname(layer)
    before = os.stat(d)
    os.rename(layer, aside)                       # gone again, within "one tick":
    os.utime(d, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(d).st_mtime_ns == before.st_mtime_ns
    gone = node.heartbeat(images_gen=whole.images_gen)
    assert not gone.images_same and m.digest not in gone.images
