"""The chunk path when the blob store is down or stuck (issue 17, left open by the last
session): a circuit breaker turns the outage into fast EIO after a few fetches found the
store unreachable, with one half-open probe at a time; and the chunks a blob read given up
at the retry budget writes *late* are counted against the chunk cache's budget.

The daemon's filesystem (:class:`dsec.edge.lazy.fs.LazyFs`) is driven in-process under
trio, with a real chunk cache directory and real worker threads, against a blob store whose
answers the test controls; one test goes through the real FUSE daemon and an HTTP store
that refuses connections."""

from __future__ import annotations

import errno
import hashlib
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pyfuse3
import pytest
import trio

from dsec.edge.lazy.fs import FsConfig, LazyFs, _data_chunks
from dsec.edge.lazy.layers import LazyConfig, LazyLayers
from dsec.edge.metrics import lazy_families
from dsec.errors import BlobUnavailable
from dsec.image.blob import open_blobstore
from dsec.image.chunks import ChunkTable, build_chunk_table
from tests.conftest import requires_root
from tests.edge.lazy.conftest import Remote

CS = 256 * 1024


@dataclass(eq=False)
class Store:
    """A blob store holding one layer file; ``down`` makes every read fail as an
    unreachable store does, ``gate`` (when set) holds reads until it is set."""

    data: bytes
    url: str = "test://store"
    down: bool = False
    gate: threading.Event | None = None
    calls: list[tuple[int, int]] = field(default_factory=list)
    returned: threading.Event = field(default_factory=threading.Event)

    def head(self, key: str) -> int | None:
        return len(self.data)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        self.calls.append((offset, length))
        if self.gate is not None:
            self.gate.wait(30)
        if self.down:
            raise BlobUnavailable("connection refused (test)", store=self.url)
        try:
            return self.data[offset:offset + length]
        finally:
            self.returned.set()

    def put_file(self, key: str, path: str) -> None:
        raise AssertionError("a node does not write layers")

    def put_bytes(self, key: str, data: bytes) -> None:
        raise AssertionError("a node does not write layers")

    def delete(self, key: str) -> None:
        raise AssertionError("a node does not delete layers")


@dataclass
class Layer:
    data: bytes
    table: ChunkTable
    hex: str


def make_layer(tmp: str, chunks: int) -> Layer:
    data = os.urandom(chunks * CS)
    path = os.path.join(tmp, "layer")
    with open(path, "wb") as f:
        f.write(data)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    table = build_chunk_table(path, CS, expect_digest=digest)
    os.makedirs(os.path.join(tmp, "cache"), exist_ok=True)
    hx = digest.removeprefix("sha256:")
    with open(os.path.join(tmp, "cache", hx + ".chunks"), "wb") as f:
        f.write(table.encode())
    return Layer(data, table, hx)


def run_fs(store: Store, tmp: str, layer: Layer,
           body: Callable[[LazyFs, int], Awaitable[None]],
           **cfg: object) -> None:
    fs = LazyFs(store, FsConfig(cache_dir=os.path.join(tmp, "cache"), **cfg))  # type: ignore[arg-type]
    try:
        lay = fs._load(layer.hex)
        assert lay is not None
        trio.run(body, fs, lay.ino)
    finally:
        fs.close()


async def read(fs: LazyFs, ino: int, chunk: int) -> bytes | int:
    """Chunk ``chunk``'s first 4 KiB as a sandbox's read gets them, or the errno."""
    try:
        return await fs.read(ino, chunk * CS, 4096)
    except pyfuse3.FUSEError as exc:
        return exc.errno


def test_an_outage_opens_the_breaker_then_misses_fail_at_once(tmp_path: object) -> None:
    tmp = str(tmp_path)
    layer = make_layer(tmp, 8)
    store = Store(layer.data, down=True)

    async def body(fs: LazyFs, ino: int) -> None:
        for c in (0, 1):                      # the store found down, twice, the slow way
            before = len(store.calls)
            assert await read(fs, ino, c) == errno.EIO
            assert len(store.calls) - before >= 2, "the fetch was not retried"
        assert fs.breaker.state == "open"
        sent = len(store.calls)
        t0 = time.monotonic()
        for c in (2, 3, 4):
            assert await read(fs, ino, c) == errno.EIO
        assert time.monotonic() - t0 < 0.2, "misses with the breaker open waited"
        assert len(store.calls) == sent, "requests went to a store known to be down"
        # half-open: one probe; the store still down -> open again, for twice as long
        await trio.sleep(0.45)
        assert await read(fs, ino, 5) == errno.EIO
        assert len(store.calls) == sent + 1
        assert fs.breaker.state == "open" and fs.breaker.open_s == pytest.approx(0.8)
        # the store back: the next probe answers, the breaker closes, data flows
        store.down = False
        await trio.sleep(0.85)
        assert await read(fs, ino, 6) == layer.data[6 * CS:6 * CS + 4096]
        assert str(fs.breaker.state) == "closed"
        assert await read(fs, ino, 2) == layer.data[2 * CS:2 * CS + 4096]
        doc = fs.stats_doc()
        assert doc["breaker_opens"] == 2 and doc["fast_failed_runs"] >= 3

    # a budget of 1 s, not 0.3: under load (CI, 4 workers) the first attempt started so
    # late that no retry fitted in 0.3 s ("the fetch was not retried")
    run_fs(store, tmp, layer, body, retry_budget_s=1.0, breaker_failures=2,
           breaker_open_s=0.4)


def test_a_missing_key_or_a_corrupt_chunk_does_not_open_the_breaker(tmp_path: object
                                                                    ) -> None:
    """Only an unreachable store counts: a store that answers (here with wrong bytes)
    is not down, whatever one layer's chunks look like."""
    tmp = str(tmp_path)
    layer = make_layer(tmp, 4)
    store = Store(bytes(len(layer.data)))          # zeros: every chunk fails its sha256

    async def body(fs: LazyFs, ino: int) -> None:
        for c in range(4):
            assert await read(fs, ino, c) == errno.EIO
        assert fs.breaker.state == "closed"
        assert fs.stats.verify_failures == 8

    run_fs(store, tmp, layer, body, retry_budget_s=0.3, breaker_failures=1)


def test_a_pin_made_during_an_outage_completes_once_the_store_is_back(tmp_path: object
                                                                      ) -> None:
    """Pinning fetches the whole layer in the background; with the store down (the
    breaker failing the rest of the pass at once) the pass ends incomplete, and the
    layer must still end up whole once the store answers (the old code gave up)."""
    tmp = str(tmp_path)
    layer = make_layer(tmp, 12)
    store = Store(layer.data, down=True)

    async def body(fs: LazyFs, ino: int) -> None:
        lay = fs.by_ino[ino]
        async with trio.open_nursery() as n:
            n.start_soon(lambda: fs.prefetch(layer.hex, None, pin=True))
            await trio.sleep(0.6)
            assert not lay.present
            store.down = False
            with trio.fail_after(10):
                while len(lay.present) < lay.table.count:
                    await trio.sleep(0.05)
        assert os.pread(lay.fd, len(layer.data), 0) == layer.data

    run_fs(store, tmp, layer, body, retry_budget_s=0.2, breaker_failures=1,
           breaker_open_s=0.2)


def test_misses_queued_behind_a_busy_node_do_not_open_the_breaker(tmp_path: object
                                                                   ) -> None:
    """A fetch that waited its whole budget for a fetch slot (this node's own queue: one
    sandbox flooding misses) says nothing about the store: only requests that were sent
    and got no answer count, so a stuck request plus a queue behind it stays below a
    4-failure threshold with 4 misses."""
    tmp = str(tmp_path)
    layer = make_layer(tmp, 4)
    gate = threading.Event()
    store = Store(layer.data, gate=gate)
    got: list[bytes | int] = []

    async def body(fs: LazyFs, ino: int) -> None:
        async def one(c: int) -> None:
            got.append(await read(fs, ino, c))
        try:
            async with trio.open_nursery() as n:
                n.start_soon(one, 0)
                await trio.sleep(0.02)              # chunk 0's request is out (stuck)
                for c in (1, 2, 3):
                    n.start_soon(one, c)            # queued behind it: one slot
        finally:
            gate.set()
        assert got == [errno.EIO] * 4
        # an abandoned request gives its slot back: one queued miss may still be sent,
        # with a few ms of its budget left - it does not count either (red team 22 A2:
        # the store is judged only by requests that had a fair share of the budget on
        # the wire); the others timed out in the queue and do not
        assert fs.breaker.count == 1 and 1 <= len(store.calls) <= 2
        assert str(fs.breaker.state) == "closed"

    run_fs(store, tmp, layer, body, retry_budget_s=0.3, max_inflight=1,
           breaker_failures=4)


@dataclass(eq=False)
class RefusingStore:
    """Two layers; reads of the one named in ``refuse`` are answered HTTP 503 (the
    store throttling one key), the other is served."""

    blobs: dict[str, bytes]
    refuse: str = ""
    url: str = "test://refusing"
    calls: list[str] = field(default_factory=list)

    def head(self, key: str) -> int | None:
        return len(self._blob(key))

    def _blob(self, key: str) -> bytes:
        return next(v for k, v in self.blobs.items() if k in key)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        self.calls.append(key)
        if self.refuse and self.refuse in key:
            raise BlobUnavailable(f"blob store {self.url}: read {key}: HTTP 503",
                                  store=self.url, key=key, status=503)
        return self._blob(key)[offset:offset + length]

    def put_file(self, key: str, path: str) -> None:
        raise AssertionError("a node does not write layers")

    def put_bytes(self, key: str, data: bytes) -> None:
        raise AssertionError("a node does not write layers")

    def delete(self, key: str) -> None:
        raise AssertionError("a node does not delete layers")


def test_a_layer_the_store_refuses_fails_fast_alone_then_recovers(tmp_path: object
                                                                   ) -> None:
    """Red team 22 A2: a store answering 503 for one layer opens that layer's breaker
    (its misses then fail at once, no request) and never the store's: another layer's
    reads go on; once the store serves the layer again its probe closes the breaker."""
    tmp = str(tmp_path)
    hot = make_layer(tmp, 6)
    other = make_layer(tmp, 2)
    store = RefusingStore({hot.hex: hot.data, other.hex: other.data}, refuse=hot.hex)
    fs = LazyFs(store, FsConfig(cache_dir=os.path.join(tmp, "cache"), retry_budget_s=0.2,
                                breaker_failures=2, breaker_open_s=0.3))

    async def body() -> None:
        h, o = fs._load(hot.hex), fs._load(other.hex)
        assert h is not None and o is not None and h.breaker is not None
        for c in (0, 1):
            assert await read(fs, h.ino, c) == errno.EIO
        assert h.breaker.state == "open" and fs.breaker.state == "closed"
        sent, t0 = len(store.calls), time.monotonic()
        assert await read(fs, h.ino, 2) == errno.EIO
        assert time.monotonic() - t0 < 0.1 and len(store.calls) == sent   # no request
        assert await read(fs, o.ino, 1) == other.data[CS:CS + 4096]
        assert fs.stats_doc()["refused_layers"] == 1
        store.refuse = ""
        await trio.sleep(0.35)
        assert await read(fs, h.ino, 3) == hot.data[3 * CS:3 * CS + 4096]   # the probe
        assert str(h.breaker.state) == "closed" and fs.breaker.opens == 0

    try:
        trio.run(body)
    finally:
        fs.close()


def test_late_bytes_of_an_abandoned_fetch_count_against_the_cache_budget(
        tmp_path: object) -> None:
    """A blob read stuck past the retry budget is abandoned (the read gets EIO); when
    its thread finally returns it writes the verified chunk into the cache file. Those
    bytes must be in the LRU's books: with a 2-chunk budget, the cache never holds 3
    (the old code left the late chunk on disk, counted nowhere)."""
    tmp = str(tmp_path)
    layer = make_layer(tmp, 4)
    gate = threading.Event()
    store = Store(layer.data, gate=gate)

    async def body(fs: LazyFs, ino: int) -> None:
        assert await read(fs, ino, 0) == errno.EIO        # stuck, abandoned
        store.gate = None
        gate.set()                                        # ... and it lands late
        await trio.to_thread.run_sync(store.returned.wait, 5)
        lay = fs.by_ino[ino]
        for _ in range(100):                              # its pwrite, then hand-off
            await trio.sleep(0.01)
            if 0 in _data_chunks(lay.fd, lay.table) and fs.lru.bytes:
                break
        assert await read(fs, ino, 1) == layer.data[CS:CS + 4096]
        assert await read(fs, ino, 2) == layer.data[2 * CS:2 * CS + 4096]
        on_disk = _data_chunks(lay.fd, lay.table)
        assert len(on_disk) * CS <= 2 * CS, (
            f"chunks {on_disk} are in the cache file, over its 2-chunk budget: the late "
            "write of the abandoned fetch is not counted")
        assert fs.lru.bytes == len(on_disk) * CS
        # a late chunk still counted is verified before it is served
        assert await read(fs, ino, 0) == layer.data[:4096]

    run_fs(store, tmp, layer, body, retry_budget_s=0.2, cache_bytes=2 * CS)


def test_a_late_chunk_punched_out_before_its_hand_off_is_never_served_as_zeros(
        tmp_path: object) -> None:
    """The hand-off marks late chunks "verify before serving": a chunk evicted (punched)
    between the late write and the hand-off reads back as zeros and is fetched again."""
    tmp = str(tmp_path)
    layer = make_layer(tmp, 2)
    store = Store(layer.data)

    async def body(fs: LazyFs, ino: int) -> None:
        lay = fs.by_ino[ino]
        fs._adopt_late(lay, [1])                          # counted, yet a hole on disk
        assert 1 in lay.stale and fs.lru.bytes == CS
        assert await read(fs, ino, 1) == layer.data[CS:CS + 4096]
        assert fs.stats.chunk_fetches == 1

    run_fs(store, tmp, layer, body, retry_budget_s=0.3)


@requires_root
def test_through_fuse_an_unreachable_store_gives_fast_eio_once_known_down(
        remote: Remote, tmp_path: object) -> None:
    """The real daemon, its HTTP client, a port that refuses connections: after two
    reads found the store down (each after the retry budget), the next reads of
    uncached chunks fail with EIO at once."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()                                        # nothing listens there now
    lazy = LazyLayers(LazyConfig(blob_url=f"http://127.0.0.1:{port}/blob",
                                 cache_dir=os.path.join(str(tmp_path), "c"),
                                 retry_budget_s=0.5, breaker_failures=2,
                                 breaker_open_s=30.0, traces=False),
                      blob=open_blobstore(remote.url))
    try:
        lazy.register(remote.workspace)
        fd = os.open(lazy.path(remote.workspace) or "", os.O_RDONLY)
        try:
            took = []
            for i in range(5):
                t0 = time.monotonic()
                with pytest.raises(OSError) as err:
                    os.pread(fd, 4096, i * CS)
                took.append(time.monotonic() - t0)
                assert err.value.errno == errno.EIO
        finally:
            os.close(fd)
        assert took[0] >= 0.25, took     # backoff sleeps (the kernel may retry a readahead)
        assert max(took[2:]) < 0.2, f"reads with the store known down still waited: {took}"
        st = lazy.stats(fresh=True)
        assert st["breaker_opens"] == 1 and st["breaker_state"] == "open"
        fams = {f.name: f.samples[0].value for f in lazy_families(st, 0)}
        assert fams["dsec_lazy_store_circuit_open"] == 1.0
        assert fams["dsec_lazy_store_circuit_opens"] == 1.0
        assert fams["dsec_lazy_fast_failed_fetches"] >= 3
    finally:
        lazy.close()
