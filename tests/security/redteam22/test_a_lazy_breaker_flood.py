"""A2: one tenant's flood of misses opens the blob store's breaker for every tenant.

The breaker must count only an *unreachable* store; the fix for "one sandbox flooding
misses" (``_Queued``) only covers a fetch that never got a slot. But a miss's deadline is
``started + retry_budget_s`` counted from when the read began, *including* its wait for a
fetch slot: a miss that gets its slot just before its deadline is sent with milliseconds
left, abandoned, and counted as "store down" (BlobUnavailable, ``sent`` True). A tenant
that keeps the node's fetch slots busy with many misses of its own layer (here a healthy
store taking 0.1 s per request, one slot) makes every queued miss of its own time out
*after* getting a slot, in a row: the breaker opens, and another tenant's read of another
layer - which the healthy store would answer - fails with EIO at once.
The secure behaviour: a store that answers every request is never "down".
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import time
from dataclasses import dataclass, field

import pyfuse3
import trio

from dsec.edge.lazy.fs import FsConfig, LazyFs
from dsec.image.chunks import build_chunk_table

CS = 256 * 1024


@dataclass(eq=False)
class SlowStore:
    """A healthy store: every read answers, correctly, in ``delay`` seconds."""

    blobs: dict[str, bytes]
    delay: float = 0.1
    url: str = "test://slow"
    calls: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def head(self, key: str) -> int | None:
        return len(self._blob(key))

    def _blob(self, key: str) -> bytes:
        for k, v in self.blobs.items():
            if k in key:
                return v
        raise AssertionError(key)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        with self.lock:
            self.calls += 1
        time.sleep(self.delay)
        return self._blob(key)[offset:offset + length]


def _layer(cache: str, chunks: int) -> tuple[str, bytes]:
    data = os.urandom(chunks * CS)
    hx = hashlib.sha256(data).hexdigest()
    path = os.path.join(cache, "src-" + hx)
    with open(path, "wb") as f:
        f.write(data)
    table = build_chunk_table(path, CS, expect_digest="sha256:" + hx)
    os.unlink(path)
    with open(os.path.join(cache, hx + ".chunks"), "wb") as f:
        f.write(table.encode())
    return hx, data


async def _read(fs: LazyFs, ino: int, chunk: int) -> bytes | int:
    try:
        data: bytes = await fs.read(ino, chunk * CS, 4096)
        return data
    except pyfuse3.FUSEError as exc:
        return exc.errno


def test_a_tenants_flood_on_a_healthy_store_does_not_fail_others_reads(tmp_path: object
                                                                        ) -> None:
    cache = os.path.join(str(tmp_path), "cache")
    os.makedirs(cache)
    hostile, hostile_data = _layer(cache, 12)
    victim, victim_data = _layer(cache, 2)
    store = SlowStore({hostile: hostile_data, victim: victim_data})
    fs = LazyFs(store, FsConfig(cache_dir=cache, retry_budget_s=0.3, max_inflight=1,
                                breaker_failures=3, breaker_open_s=5.0,
                                breaker_max_open_s=5.0))
    results: list[bytes | int] = []

    async def body() -> None:
        h = fs._load(hostile)
        v = fs._load(victim)
        assert h is not None and v is not None

        async def one(c: int) -> None:
            results.append(await _read(fs, h.ino, c))
        async with trio.open_nursery() as n:     # the flood: misses a few ms apart
            for c in range(12):
                n.start_soon(one, c)
                await trio.sleep(0.01)
        assert store.calls >= 1                   # the store answered what it was sent
        got = await _read(fs, v.ino, 0)           # another tenant, another layer
        assert got == victim_data[:4096], (
            f"a read of another layer failed with {got!r} at once: the breaker is "
            f"{fs.breaker.state} (opened {fs.breaker.opens}x) though the store answered "
            f"every one of its {store.calls} requests")

    try:
        trio.run(body)
    finally:
        fs.close()


@dataclass(eq=False)
class ThrottlingStore(SlowStore):
    """S3 throttles per key prefix (503 SlowDown / 429): the store answers every
    request, but refuses the one layer a tenant hammers; other layers read fine."""

    hot: str = ""

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        with self.lock:
            self.calls += 1
        if self.hot in key:
            from dsec.errors import BlobUnavailable
            raise BlobUnavailable(f"blob store {self.url}: read of {key}: HTTP 503 "
                                  "SlowDown (throttled; test)", store=self.url, key=key)
        return self._blob(key)[offset:offset + length]


def test_one_layer_throttled_by_the_store_does_not_fail_other_layers(tmp_path: object
                                                                      ) -> None:
    """The same class of hole without any timing: the store *answers* (503/429 for the
    one key prefix a tenant hammers) and that counts as "unreachable", so three misses of
    the tenant's own layer open the breaker for every layer of the node."""
    cache = os.path.join(str(tmp_path), "cache")
    os.makedirs(cache)
    hostile, hostile_data = _layer(cache, 4)
    victim, victim_data = _layer(cache, 2)
    store = ThrottlingStore({hostile: hostile_data, victim: victim_data}, delay=0.0,
                            hot=hostile)
    fs = LazyFs(store, FsConfig(cache_dir=cache, retry_budget_s=0.2, breaker_failures=3,
                                breaker_open_s=5.0, breaker_max_open_s=5.0))

    async def body() -> None:
        h = fs._load(hostile)
        v = fs._load(victim)
        assert h is not None and v is not None
        for c in range(3):
            assert await _read(fs, h.ino, c) == errno.EIO     # the tenant's own: refused
        got = await _read(fs, v.ino, 0)
        assert got == victim_data[:4096], (
            f"a read of another layer failed with {got!r} at once: the breaker is "
            f"{fs.breaker.state} because one key was throttled")

    try:
        trio.run(body)
    finally:
        fs.close()
