"""The lazy-layer FUSE filesystem: one read-only regular file per remote layer, whose
reads fetch 256 KiB chunks from a blob store on demand.

Runs in its own process (:mod:`dsec.edge.lazy.daemon`), under trio (pyfuse3's loop). The
directory has one entry per layer the edge registered, named by the layer's sha256 hex:
the edge writes ``<cache_dir>/<hex>.chunks`` (the chunk table) before it mounts
``<mount>/<hex>`` as EROFS, and :meth:`LazyFs.lookup` loads it, so the daemon keeps no
state the edge must replay after a restart.

A read (:meth:`LazyFs.read`) covers a few chunks (:func:`~dsec.edge.lazy.plan.chunk_span`).
Chunks already in the node's chunk cache are read from there; the missing ones are
fetched: misses of one read merged into ranged requests (:func:`merge_runs`), at most
``max_inflight`` requests at once, each retried with jittered backoff until
``retry_budget_s`` has passed, every chunk checked against its sha256 in the table before
it is stored. A chunk that fails its check is fetched once more; if it fails again, or
the store stays unreachable, the read fails with EIO (never with unchecked bytes), and
the daemon reports the cause to the edge (a ``fetch_failed`` line on stdout) so the
sandboxes using the layer get an event. Readers of a chunk already being fetched wait on
that one fetch (``inflight``): 16 sandboxes starting one cold image fetch each chunk once.

The chunk cache is one sparse file per layer (``<hex>.data``, chunks at their own
offsets): a read of cached chunks is one ``pread``. Its byte budget is kept by an LRU
(:class:`~dsec.edge.lazy.plan.ChunkLru`) that punches evicted chunks out
(``FALLOC_FL_PUNCH_HOLE``). A chunk counts as cached only once it is whole and verified;
chunks found on disk when a daemon starts (a restart) are re-verified on their first read,
since a kill -9 could have left one half written.

Eviction, presence checks and the ``pread`` of a read all run on the trio thread with no
``await`` between them, so a chunk cannot be punched out between "it is here" and the
read of its bytes; only the blob request, the hashing and the ``pwrite`` of a fetched chunk
run in worker threads, before the chunk is marked present.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import random
import stat
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pyfuse3
import trio

from dsec.edge.lazy.plan import (
    Breaker,
    ChunkLru,
    FailureScope,
    Run,
    backoff_delays,
    chunk_span,
    failure_scope,
    judged_by_store,
    merge_runs,
)
from dsec.errors import BlobUnavailable, DsecError
from dsec.image.blob import BlobStore, layer_key
from dsec.image.chunks import ChunkTable, verify_chunk

__all__ = ["FETCH_BUCKETS_S", "MAX_RUN_BYTES", "FsConfig", "LazyFs"]

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
SEEK_DATA, SEEK_HOLE = 3, 4

#: Fetch latency histogram bounds (seconds) for ``dsec_lazy_fetch_seconds``.
FETCH_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0)
#: The most bytes one ranged request asks for (16 default chunks).
MAX_RUN_BYTES = 4 << 20
_TIMEOUT_S = 86400.0   # layers never change: the kernel may cache entries and attrs a day


@dataclass(frozen=True, slots=True, kw_only=True)
class FsConfig:
    cache_dir: str
    """Chunk tables (``<hex>.chunks``, written by the edge), cached chunks (``<hex>.data``)
    and traces (``traces/<hex>.json``)."""
    cache_bytes: int | None = None
    """LRU budget of cached chunk bytes on this node (None: no limit)."""
    retry_budget_s: float = 10.0
    """How long one fetch keeps retrying an unreachable blob store before the read fails
    with EIO: the longest a sandbox's read can hang on an outage."""
    max_inflight: int = 8
    """Ranged requests to the blob store at once (reads and prefetch together)."""
    max_prefetch_inflight: int = 2
    """Of those, at most this many for background prefetch, so reads are never starved."""
    max_run_chunks: int = 16
    """Adjacent missing chunks merged into one ranged request, at most (4 MiB)."""
    prefetch_run_chunks: int = 4
    """The same for background prefetch (1 MiB): reads may wait on these."""
    max_layer_inflight: int = 6
    """Of ``max_inflight``, at most this many for one layer, so the misses of one
    sandbox's layer on a slow store leave slots to every other layer (red team 17 F11)."""
    max_waiting_reads: int = 384
    """Reads waiting on fetches at once, all layers; past it a miss fails with EIO at
    once. Below the kernel's ``max_background`` the edge sets (512,
    :data:`dsec.edge.lazy.layers.FUSE_MAX_BACKGROUND`) and the daemon's worker tasks, so
    reads of cached chunks always find a free request slot and worker (F11)."""
    max_waiting_per_layer: int = 192
    """The same for one layer: one sandbox's misses never take every waiting slot."""
    breaker_failures: int = 3
    """Fetches in a row that ran out their retry budget on an unreachable store before
    the store's circuit breaker opens: misses then fail with EIO at once (no request)
    until a half-open probe answers (:class:`~dsec.edge.lazy.plan.Breaker`). The same
    count of fetches of one layer the store refused (429/5xx) opens that layer's own
    breaker, not the store's."""
    breaker_open_s: float = 2.0
    """How long the breaker stays open before its probe; doubled after each failed
    probe, up to ``breaker_max_open_s``."""
    breaker_max_open_s: float = 10.0
    trace_window_s: float = 5.0
    """A layer's access trace is the chunks first read within this long of its first read."""
    stats_path: str | None = None
    stats_interval_s: float = 0.5


@dataclass(slots=True, eq=False)
class _Layer:
    hex: str
    table: ChunkTable
    ino: int
    fd: int
    present: set[int] = field(default_factory=set)   # whole and verified, in the LRU
    stale: set[int] = field(default_factory=set)     # on disk from before: verify first
    first_read: float | None = None
    trace: list[int] = field(default_factory=list)
    traced: set[int] = field(default_factory=set)
    trace_done: bool = False
    waiting: int = 0                                 # reads of this layer waiting on fetches
    limiter: trio.CapacityLimiter | None = None      # its share of the fetch slots
    breaker: Breaker | None = None                   # the store refusing this layer's reads
    refused_cause: str = ""


@dataclass(slots=True)
class Stats:
    reads: int = 0
    bytes_read: int = 0
    chunk_hits: int = 0
    chunk_misses: int = 0
    waits: int = 0                       # misses that waited on another reader's fetch
    requests: int = 0                    # ranged requests sent (attempts)
    chunk_fetches: int = 0               # chunks received and stored
    bytes_fetched: int = 0
    retries: int = 0
    verify_failures: int = 0
    failed_reads: int = 0
    evictions: int = 0
    prefetched_chunks: int = 0
    shed_reads: int = 0                  # misses refused at once: too many already waiting
    abandoned_fetches: int = 0           # blob reads given up at the retry budget
    late_chunks: int = 0                 # chunks such a read wrote after it was given up
    fast_failed_runs: int = 0            # fetches refused at once: the breaker was open
    late_sent: int = 0                   # requests sent too late to judge the store by
    fetch_buckets: list[int] = field(default_factory=lambda: [0] * (len(FETCH_BUCKETS_S) + 1))
    fetch_seconds_sum: float = 0.0
    per_chunk: dict[tuple[str, int], int] = field(default_factory=dict)

    def observe(self, seconds: float) -> None:
        self.fetch_seconds_sum += seconds
        for i, b in enumerate(FETCH_BUCKETS_S):
            if seconds <= b:
                self.fetch_buckets[i] += 1
                return
        self.fetch_buckets[-1] += 1


@dataclass(slots=True, eq=False)
class _Handoff:
    """Who accounts for what one blob read's worker thread wrote to the chunk cache:
    the trio side when it took the result, the thread itself when it was abandoned at
    the retry budget (red team 17 F8) and finished later (its late chunks)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    written: list[int] = field(default_factory=list)
    done: bool = False          # the thread finished (returned or raised)
    abandoned: bool = False     # the trio side gave up waiting for it


class _Queued(BlobUnavailable):
    """A fetch that never got a slot within the retry budget, or got one too late to be
    judged by (:func:`~dsec.edge.lazy.plan.judged_by_store`): a busy node, not a down
    store (one sandbox flooding misses must not open the store's breaker for all)."""


class _FetchFailed(Exception):
    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


def _emit(event: dict[str, Any]) -> None:
    """One event line to the edge (stdout)."""
    sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")
    sys.stdout.flush()


class LazyFs(pyfuse3.Operations):
    """See the module docstring."""

    def __init__(self, blob: BlobStore, config: FsConfig, *,
                 rng: random.Random | None = None) -> None:
        super().__init__()
        self.blob = blob
        self.cfg = config
        self.rng = rng or random.Random()
        self.lru = ChunkLru(config.cache_bytes)
        self.stats = Stats()
        self.layers: dict[str, _Layer] = {}
        self.by_ino: dict[int, _Layer] = {}
        self._next_ino = pyfuse3.ROOT_INODE + 1
        self.inflight: dict[tuple[str, int], trio.Event] = {}
        self.fetch_limiter = trio.CapacityLimiter(config.max_inflight)
        self.prefetch_limiter = trio.CapacityLimiter(config.max_prefetch_inflight)
        self.waiting = 0
        self.breaker = Breaker(config.breaker_failures, config.breaker_open_s,
                               config.breaker_max_open_s)
        self._down_cause = ""            # the last failure that counted toward opening
        self._fast_emitted: dict[str, float] = {}   # layer hex -> last fast-fail event
        self._pinning: set[str] = set()             # pinned layers with a pass running
        os.makedirs(os.path.join(config.cache_dir, "traces"), mode=0o700, exist_ok=True)

    # ----------------------------------------------------------------- layers
    def _load(self, hx: str) -> _Layer | None:
        lay = self.layers.get(hx)
        if lay is not None:
            return lay
        if len(hx) != 64 or any(c not in "0123456789abcdef" for c in hx):
            return None
        try:
            with open(os.path.join(self.cfg.cache_dir, hx + ".chunks"), "rb") as f:
                table = ChunkTable.decode(f.read())
        except (FileNotFoundError, DsecError):
            return None
        if table.digest != "sha256:" + hx:
            return None
        fd = os.open(os.path.join(self.cfg.cache_dir, hx + ".data"),
                     os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if os.fstat(fd).st_size != table.size:
            os.ftruncate(fd, table.size)
        lay = _Layer(hx, table, self._next_ino, fd, limiter=trio.CapacityLimiter(
            max(1, min(self.cfg.max_layer_inflight, self.cfg.max_inflight))),
            breaker=Breaker(self.cfg.breaker_failures, self.cfg.breaker_open_s,
                            self.cfg.breaker_max_open_s))
        self._next_ino += 1
        lay.stale = set(_data_chunks(fd, table))
        for i in sorted(lay.stale):
            # counted against the budget like any cached chunk; verified on first read
            for k in self.lru.add((hx, i), table.chunk_range(i)[1]):
                self._evict(k)
        self.layers[hx] = lay
        self.by_ino[lay.ino] = lay
        return lay

    def _attrs(self, lay: _Layer | None) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        if lay is None:
            a.st_ino = pyfuse3.ROOT_INODE
            a.st_mode = stat.S_IFDIR | 0o500
            a.st_nlink = 2
        else:
            a.st_ino = lay.ino
            a.st_mode = stat.S_IFREG | 0o400
            a.st_nlink = 1
            a.st_size = lay.table.size
            a.st_blocks = (lay.table.size + 511) // 512
        a.st_blksize = 1 << 16
        a.entry_timeout = a.attr_timeout = _TIMEOUT_S
        return a

    # ------------------------------------------------------------- FUSE ops
    async def lookup(self, parent_inode: int, name: bytes,
                     ctx: pyfuse3.RequestContext | None = None) -> pyfuse3.EntryAttributes:
        if parent_inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOENT)
        lay = self._load(name.decode("ascii", "replace"))
        if lay is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attrs(lay)

    async def getattr(self, inode: int,
                      ctx: pyfuse3.RequestContext | None = None) -> pyfuse3.EntryAttributes:
        if inode == pyfuse3.ROOT_INODE:
            return self._attrs(None)
        lay = self.by_ino.get(inode)
        if lay is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attrs(lay)

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        for lay in sorted(self.layers.values(), key=lambda x: x.ino):
            if lay.ino <= start_id:
                continue
            if not pyfuse3.readdir_reply(token, lay.hex.encode(), self._attrs(lay), lay.ino):
                return

    async def releasedir(self, fh: int) -> None:
        return None

    async def open(self, inode: int, flags: int,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if inode not in self.by_ino:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise pyfuse3.FUSEError(errno.EROFS)
        # keep_cache: a layer never changes, so pages read once stay valid across opens
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def release(self, fh: int) -> None:
        return None

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_namemax = 255
        return s

    async def read(self, fh: int, off: int, size: int) -> bytes:
        lay = self.by_ino.get(fh)
        if lay is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        t = lay.table
        span = chunk_span(off, size, t.chunk_size, t.size)
        if not span:
            return b""
        self.stats.reads += 1
        self._trace(lay, span)
        for _ in range(8):
            if self._check_stale(lay, span):
                continue
            missing = [i for i in span if i not in lay.present]
            if not missing:
                break
            self.stats.chunk_misses += len(missing)
            if self.waiting >= self.cfg.max_waiting_reads \
                    or lay.waiting >= self.cfg.max_waiting_per_layer:
                # Every request slot held by a miss would leave reads of cached chunks
                # (other sandboxes') queued in the kernel behind a slow store: shed.
                self.stats.shed_reads += 1
                self.stats.failed_reads += 1
                raise pyfuse3.FUSEError(errno.EIO)
            self.waiting += 1
            lay.waiting += 1
            try:
                await self._ensure(lay, missing, prefetch=False)
            except _FetchFailed:
                self.stats.failed_reads += 1
                raise pyfuse3.FUSEError(errno.EIO) from None
            finally:
                self.waiting -= 1
                lay.waiting -= 1
        else:
            # the budget is smaller than the chunks of one read: they evict each other
            self.stats.failed_reads += 1
            raise pyfuse3.FUSEError(errno.EIO)
        # No await from the presence check to here: nothing can evict these chunks.
        self.stats.chunk_hits += len(span)
        for i in span:
            self.lru.touch((lay.hex, i))
        n = min(size, t.size - off)
        data = os.pread(lay.fd, n, off)
        self.stats.bytes_read += len(data)
        return data

    # ------------------------------------------------------------- fetching
    def _check_stale(self, lay: _Layer, span: Iterable[int]) -> bool:
        """Verify chunks left on disk by an earlier daemon before serving them; a bad
        one is punched out (and then fetched). True when something was dropped."""
        dropped = False
        for i in span:
            if i not in lay.stale:
                continue
            lay.stale.discard(i)
            off, ln = lay.table.chunk_range(i)
            if verify_chunk(lay.table, i, os.pread(lay.fd, ln, off)):
                lay.present.add(i)
            else:
                self.lru.discard((lay.hex, i))
                _punch(lay.fd, off, ln)
                dropped = True
        return dropped

    def _run_cap(self, lay: _Layer, max_run: int | None) -> int:
        """Chunks one ranged request may merge: the configured count, and never more than
        :data:`MAX_RUN_BYTES` (a run is held in memory whole, once per request in flight;
        with 64 MiB chunks 16 of them were 1 GiB each, red team 17 F2)."""
        want = max_run or self.cfg.max_run_chunks
        return max(1, min(want, MAX_RUN_BYTES // lay.table.chunk_size))

    async def _ensure(self, lay: _Layer, missing: list[int], *, prefetch: bool,
                      max_run: int | None = None) -> None:
        """Make ``missing`` present: fetch the ones nobody fetches, wait for the rest.
        Raises _FetchFailed when any of them could not be fetched."""
        mine: list[int] = []
        waits: list[trio.Event] = []
        for i in missing:
            ev = self.inflight.get((lay.hex, i))
            if ev is None:
                self.inflight[(lay.hex, i)] = trio.Event()
                mine.append(i)
            else:
                self.stats.waits += 1
                waits.append(ev)
        failures: list[str] = []
        if mine:
            async with trio.open_nursery() as n:
                for run in merge_runs(mine, self._run_cap(lay, max_run)):
                    n.start_soon(self._fetch_run, lay, run, prefetch, failures)
        for ev in waits:
            await ev.wait()
        lost = [i for i in missing if i not in lay.present]
        if lost:
            raise _FetchFailed(failures[0] if failures else
                               f"chunks {lost[:8]} of layer sha256:{lay.hex} were not fetched")

    async def _fetch_run(self, lay: _Layer, run: Run, prefetch: bool,
                         failures: list[str]) -> None:
        todo = list(range(run.first, run.first + run.count))
        bad_seen: set[int] = set()
        stored: set[int] = set()
        started = time.monotonic()
        delays = backoff_delays(self.cfg.retry_budget_s, rng=self.rng)
        cause = ""
        # what this fetch's failures said (the latest that said anything): the store
        # gave no answer ("store"), or it refused this layer ("layer"); None: nothing
        scope: FailureScope | None = None
        fast = False
        lb = lay.breaker
        assert lb is not None
        try:
            while todo:
                unreachable = False
                for r in merge_runs(todo, self._run_cap(lay, None)):
                    now = time.monotonic()
                    admit = self.breaker.admit(now)
                    if admit is None:
                        fast = True
                        raise _FetchFailed(self._open_cause())
                    ladmit = lb.admit(now)
                    if ladmit is None:
                        if admit == "probe":
                            self.breaker.probe_lost(now)    # not sent: says nothing
                        fast = True
                        raise _FetchFailed(self._refused_cause(lay))
                    try:
                        got = await self._request(lay, r, prefetch,
                                                  started + self.cfg.retry_budget_s)
                    except (DsecError, OSError) as exc:
                        cause = f"{type(exc).__name__}: {exc}"
                        now = time.monotonic()
                        if isinstance(exc, _Queued):
                            # never sent, or sent too late to be judged: no evidence
                            if admit == "probe":
                                self.breaker.probe_lost(now)
                            if ladmit == "probe":
                                lb.probe_lost(now)
                            if "probe" in (admit, ladmit):
                                raise _FetchFailed(cause) from None
                        elif isinstance(exc, (BlobUnavailable, OSError)):
                            status = exc.detail.get("status") \
                                if isinstance(exc, DsecError) else None
                            scope = failure_scope(status, str(exc))
                            if scope == "layer":
                                # the store answered: it is up, it refuses this layer
                                self._breaker_success()
                                if ladmit == "probe":
                                    self._layer_failure(lay, cause, probe=True)
                                    raise _FetchFailed(cause) from None
                            else:
                                if admit == "probe":
                                    self._breaker_failure(cause, probe=True)
                                    raise _FetchFailed(cause) from None
                                if ladmit == "probe":
                                    lb.probe_lost(now)      # says nothing of the layer
                        else:
                            # an answer such as a missing key: both are up
                            if admit == "probe":
                                self._breaker_success()
                            if ladmit == "probe":
                                self._layer_success(lay)
                        unreachable = True
                        break
                    self._breaker_success()
                    self._layer_success(lay)
                    for i in got.bad:
                        self.stats.verify_failures += 1
                        if i in bad_seen:
                            raise _FetchFailed(
                                f"chunk {i} failed its sha256 check twice: the blob store "
                                "serves corrupt bytes for this layer")
                        bad_seen.add(i)
                    for i in got.good:
                        self._stored(lay, i)
                        ev = self.inflight.pop((lay.hex, i), None)
                        if ev is not None:     # its readers go on now, not at the run's end
                            ev.set()
                    stored.update(got.good)
                # (a chunk the LRU dropped again at once is the reader's to retry)
                todo = [i for i in todo if i not in stored]
                if not todo or not unreachable:
                    continue      # done, or only bad chunks left: refetch them at once
                d = next(delays, None)
                # bounded in wall time too: one blob call may itself retry for a while
                if d is None or time.monotonic() - started + d > self.cfg.retry_budget_s:
                    if scope == "store":
                        self._breaker_failure(cause)
                    elif scope == "layer":
                        self._layer_failure(lay, cause)
                    raise _FetchFailed(cause)
                self.stats.retries += 1
                await trio.sleep(d)
        except _FetchFailed as exc:
            elapsed = time.monotonic() - started
            msg = (f"fetching chunks {run.first}..{run.first + run.count - 1} of layer "
                   f"sha256:{lay.hex} from {self.blob.url} failed after {elapsed:.1f}s "
                   f"(retry budget {self.cfg.retry_budget_s:g}s): {exc.cause}")
            failures.append(msg)
            if fast:
                self.stats.fast_failed_runs += 1
            # a fast failure per miss would be a line per read: one a second per layer
            now = time.monotonic()
            if not fast or now - self._fast_emitted.get(lay.hex, -1e9) >= 1.0:
                if fast:
                    self._fast_emitted[lay.hex] = now
                _emit({"ev": "fetch_failed", "layer": lay.hex, "first": run.first,
                       "count": run.count, "cause": msg, "prefetch": prefetch})
        finally:
            for i in range(run.first, run.first + run.count):
                ev = self.inflight.pop((lay.hex, i), None)
                if ev is not None:
                    ev.set()

    def _open_cause(self) -> str:
        return (f"the blob store {self.blob.url} is down ({self.cfg.breaker_failures} "
                "fetches in a row ran out their retry budget; last: "
                f"{self._down_cause[:300]}): reads of chunks not cached on this node fail "
                "at once until a probe request answers (next in "
                f"{self.breaker.retry_in(time.monotonic()):.1f}s)")

    def _refused_cause(self, lay: _Layer) -> str:
        assert lay.breaker is not None
        return (f"the blob store {self.blob.url} refuses reads of layer sha256:{lay.hex} "
                f"({self.cfg.breaker_failures} fetches of it in a row were refused; "
                f"last: {lay.refused_cause[:300]}): reads of its chunks not cached on this "
                "node fail at once until a probe request is answered (next in "
                f"{lay.breaker.retry_in(time.monotonic()):.1f}s); other layers are "
                "unaffected")

    def _layer_failure(self, lay: _Layer, cause: str, *, probe: bool = False) -> None:
        assert lay.breaker is not None
        lay.refused_cause = cause
        if lay.breaker.failure(time.monotonic(), probe=probe):
            _emit({"ev": "layer_refused", "store": self.blob.url, "layer": lay.hex,
                   "cause": cause[:500], "open_s": lay.breaker.open_s})

    def _layer_success(self, lay: _Layer) -> None:
        assert lay.breaker is not None
        if lay.breaker.success():
            _emit({"ev": "layer_served", "store": self.blob.url, "layer": lay.hex})

    def _breaker_failure(self, cause: str, *, probe: bool = False) -> None:
        self._down_cause = cause
        if self.breaker.failure(time.monotonic(), probe=probe):
            _emit({"ev": "store_down", "store": self.blob.url, "cause": cause[:500],
                   "open_s": self.breaker.open_s})

    def _breaker_success(self) -> None:
        if self.breaker.success():
            _emit({"ev": "store_up", "store": self.blob.url})

    @dataclass(slots=True)
    class _Got:
        good: list[int]
        bad: list[int]

    async def _request(self, lay: _Layer, run: Run, prefetch: bool,
                       deadline: float) -> LazyFs._Got:
        """One ranged GET of ``run``, verified and written to the cache file (in a
        worker thread); the chunks are not yet marked present. Given up (BlobUnavailable)
        at ``deadline`` (monotonic), whatever the blob call is doing: a store that
        trickles its answer cannot hold a reader past the retry budget (red team 17 F8).
        The abandoned thread ends within its client's own per-attempt bound; the verified
        chunks it writes then are still counted against the cache budget: it hands them
        to the trio thread (:meth:`_adopt_late`), which records them as chunks to verify
        before serving, evicting others to fit (before, they took disk outside the LRU's
        budget, and a chunk punched out meanwhile came back uncounted)."""
        t = lay.table
        off, length = run.byte_range(t.chunk_size, t.size)
        limiter = self.prefetch_limiter if prefetch else None
        hand = _Handoff()
        token = trio.lowlevel.current_trio_token()

        def work() -> LazyFs._Got:
            try:
                t0 = time.monotonic()
                data = self.blob.get_range(layer_key(t.digest), off, length)
                self.stats.observe(time.monotonic() - t0)
                good, bad = [], []
                view = memoryview(data)
                for i in range(run.first, run.first + run.count):
                    c_off, c_len = t.chunk_range(i)
                    piece = view[c_off - off:c_off - off + c_len]
                    if verify_chunk(t, i, piece):
                        os.pwrite(lay.fd, piece, c_off)
                        with hand.lock:
                            hand.written.append(i)
                        good.append(i)
                    else:
                        bad.append(i)
                return LazyFs._Got(good, bad)
            finally:
                with hand.lock:
                    hand.done = True
                    late = hand.abandoned and bool(hand.written)
                if late:
                    with contextlib.suppress(trio.RunFinishedError):
                        token.run_sync_soon(self._adopt_late, lay, list(hand.written))

        assert lay.limiter is not None
        self.stats.requests += 1
        sent: float | None = None
        with trio.move_on_after(max(0.0, deadline - time.monotonic())) as scope:
            async with contextlib.AsyncExitStack() as slots:
                if limiter is not None:
                    await slots.enter_async_context(limiter)
                await slots.enter_async_context(lay.limiter)
                await slots.enter_async_context(self.fetch_limiter)
                sent = time.monotonic()
                got = await trio.to_thread.run_sync(work, abandon_on_cancel=True)
        if scope.cancelled_caught:
            if sent is None:
                # never got a fetch slot: this node's own queue, not the store, was slow
                raise _Queued(
                    f"blob store {self.blob.url}: {length} bytes at {off} of layer "
                    f"{t.digest} waited the whole retry budget of "
                    f"{self.cfg.retry_budget_s:g}s for a fetch slot (this node's fetches "
                    "are saturated)", store=self.blob.url)
            self.stats.abandoned_fetches += 1
            with hand.lock:
                hand.abandoned = True
                finished = hand.done     # it ended as we gave up: its result is ours
            if finished and hand.written:
                self._adopt_late(lay, list(hand.written))
            on_wire = deadline - sent
            if not judged_by_store(on_wire, self.cfg.retry_budget_s):
                # it got its slot with little of the budget left (this node's queue):
                # no answer within that says nothing about the store (red team 22 A2)
                self.stats.late_sent += 1
                raise _Queued(
                    f"blob store {self.blob.url}: {length} bytes at {off} of layer "
                    f"{t.digest} got no answer in the {on_wire:.2f}s left of the retry "
                    f"budget of {self.cfg.retry_budget_s:g}s after waiting for a fetch "
                    "slot (this node's fetches are saturated)", store=self.blob.url)
            raise BlobUnavailable(
                f"blob store {self.blob.url}: no answer for {length} bytes at {off} of "
                f"layer {t.digest} within the retry budget of {self.cfg.retry_budget_s:g}s",
                store=self.blob.url)
        self.stats.bytes_fetched += sum(t.chunk_range(i)[1] for i in got.good)
        return got

    def _adopt_late(self, lay: _Layer, chunks: list[int]) -> None:
        """Chunks an abandoned blob read wrote after it was given up (trio thread):
        counted in the LRU as chunks on disk to verify before serving (a chunk punched
        out between its late write and now reads as zeros and fails that check), so the
        cache stays within its budget. Chunks already counted are left alone."""
        if self.layers.get(lay.hex) is not lay:
            return                                  # the daemon is closing
        for i in chunks:
            if i in lay.present or i in lay.stale:
                continue
            lay.stale.add(i)
            self.stats.late_chunks += 1
            for k in self.lru.add((lay.hex, i), lay.table.chunk_range(i)[1]):
                self._evict(k)

    def _stored(self, lay: _Layer, i: int) -> None:
        lay.present.add(i)
        lay.stale.discard(i)         # a late write of it was adopted meanwhile
        self.stats.chunk_fetches += 1
        key = (lay.hex, i)
        self.stats.per_chunk[key] = self.stats.per_chunk.get(key, 0) + 1
        for k in self.lru.add(key, lay.table.chunk_range(i)[1]):
            self._evict(k)

    def _evict(self, key: tuple[str, int]) -> None:
        lay = self.layers.get(key[0])
        if lay is None:
            return
        lay.present.discard(key[1])
        lay.stale.discard(key[1])
        off, ln = lay.table.chunk_range(key[1])
        _punch(lay.fd, off, ln)
        self.stats.evictions += 1

    # --------------------------------------------------------- prefetch/pin
    async def prefetch(self, hx: str, chunks: Iterable[int] | None, *, pin: bool = False) -> None:
        """Fetch ``chunks`` of layer ``hx`` (None: all of it) in the background, at most
        ``max_prefetch_inflight`` requests at once; ``pin``: never evict the layer."""
        lay = self._load(hx)
        if lay is None:
            _emit({"ev": "prefetch_failed", "layer": hx, "cause": "unknown layer"})
            return
        if pin:
            self.lru.pinned.add(hx)
            if hx in self._pinning:
                return               # a pass of this pin is running (and will retry)
            self._pinning.add(hx)
        try:
            await self._prefetch(lay, chunks, pin=pin)
        finally:
            if pin:
                self._pinning.discard(hx)
        _emit({"ev": "prefetched", "layer": hx, "pinned": pin,
               "present": len(lay.present), "chunks": lay.table.count})

    async def _prefetch(self, lay: _Layer, chunks: Iterable[int] | None, *,
                        pin: bool) -> None:
        hx = lay.hex
        chunks = None if chunks is None else list(chunks)
        # Small runs, in trace order: a reader that needs a chunk a prefetch has in
        # flight waits for that whole run (measured: 16-chunk prefetch runs made a traced
        # second start 3x slower than the first on a disk-backed store; see the bench).
        run = self.cfg.prefetch_run_chunks
        batch = run * self.cfg.max_prefetch_inflight
        wait = self.cfg.breaker_open_s
        while True:
            want = range(lay.table.count) if chunks is None else \
                [i for i in chunks if 0 <= i < lay.table.count]
            self._check_stale(lay, want)
            todo = [i for i in want if i not in lay.present]
            for k in range(0, len(todo), batch):
                part = [i for i in todo[k:k + batch] if i not in lay.present]
                with contextlib.suppress(_FetchFailed):
                    await self._ensure(lay, part, prefetch=True, max_run=run)
                self.stats.prefetched_chunks += sum(1 for i in part if i in lay.present)
            if not pin or hx not in self.lru.pinned \
                    or all(i in lay.present for i in want):
                break
            # A pinned layer left incomplete (the store was down - the breaker fails the
            # rest of the pass at once - or served corrupt chunks): go on once the store
            # may answer again, for as long as it stays pinned. Before, a pin made during
            # an outage stayed incomplete until the daemon restarted.
            await trio.sleep(max(wait, self.breaker.retry_in(time.monotonic())))
            wait = min(wait * 2, 60.0)

    def _trace(self, lay: _Layer, span: range) -> None:
        if lay.trace_done:
            return
        now = time.monotonic()
        if lay.first_read is None:
            lay.first_read = now
        if now - lay.first_read > self.cfg.trace_window_s:
            self._finish_trace(lay)
            return
        for i in span:
            if i not in lay.traced:
                lay.traced.add(i)
                lay.trace.append(i)

    def _finish_trace(self, lay: _Layer) -> None:
        if lay.trace_done or lay.first_read is None:
            return
        lay.trace_done = True
        path = os.path.join(self.cfg.cache_dir, "traces", lay.hex + ".json")
        _write_atomic(path, json.dumps({"layer": lay.hex, "chunks": lay.trace,
                                        "window_s": self.cfg.trace_window_s}).encode())
        _emit({"ev": "trace", "layer": lay.hex, "chunks": len(lay.trace)})

    async def trace_loop(self) -> None:
        """Close each layer's trace once its window has passed (also when reads stop)."""
        while True:
            await trio.sleep(min(1.0, self.cfg.trace_window_s / 2))
            now = time.monotonic()
            for lay in list(self.layers.values()):
                if not lay.trace_done and lay.first_read is not None \
                        and now - lay.first_read > self.cfg.trace_window_s:
                    self._finish_trace(lay)

    # ----------------------------------------------------------------- stats
    def stats_doc(self) -> dict[str, Any]:
        s = self.stats
        per = s.per_chunk
        return {
            "pid": os.getpid(), "time": time.time(),
            "reads": s.reads, "bytes_read": s.bytes_read, "chunk_hits": s.chunk_hits,
            "chunk_misses": s.chunk_misses, "waits": s.waits, "requests": s.requests,
            "chunk_fetches": s.chunk_fetches, "distinct_chunks_fetched": len(per),
            "max_fetches_per_chunk": max(per.values(), default=0),
            "bytes_fetched": s.bytes_fetched, "retries": s.retries,
            "verify_failures": s.verify_failures, "failed_reads": s.failed_reads,
            "evictions": s.evictions, "prefetched_chunks": s.prefetched_chunks,
            "shed_reads": s.shed_reads, "abandoned_fetches": s.abandoned_fetches,
            "late_chunks": s.late_chunks, "fast_failed_runs": s.fast_failed_runs,
            "late_sent": s.late_sent,
            "breaker_state": self.breaker.state, "breaker_opens": self.breaker.opens,
            "refused_layers": sum(1 for lay in self.layers.values()
                                  if lay.breaker is not None
                                  and lay.breaker.state != "closed"),
            "cache_bytes": self.lru.bytes, "cache_budget_bytes": self.lru.budget_bytes,
            "fetch_buckets": list(s.fetch_buckets), "fetch_bounds": list(FETCH_BUCKETS_S),
            "fetch_seconds_sum": s.fetch_seconds_sum,
            "layers": {hx: {"present": len(lay.present), "chunks": lay.table.count}
                       for hx, lay in self.layers.items()},
        }

    def write_stats(self) -> None:
        if self.cfg.stats_path is not None:
            _write_atomic(self.cfg.stats_path, json.dumps(self.stats_doc()).encode())

    async def stats_loop(self) -> None:
        while True:
            self.write_stats()
            await trio.sleep(self.cfg.stats_interval_s)

    def close(self) -> None:
        for lay in self.layers.values():
            with contextlib.suppress(OSError):
                os.close(lay.fd)
        self.layers.clear()
        self.by_ino.clear()


def _data_chunks(fd: int, table: ChunkTable) -> list[int]:
    """Chunks with any data in the sparse cache file (SEEK_DATA/SEEK_HOLE)."""
    out: set[int] = set()
    pos = 0
    while pos < table.size:
        try:
            start = os.lseek(fd, pos, SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                break
            raise
        end = os.lseek(fd, start, SEEK_HOLE)
        out.update(chunk_span(start, end - start, table.chunk_size, table.size))
        pos = end
    return sorted(out)


_libc = ctypes.CDLL(None, use_errno=True)


def _punch(fd: int, off: int, length: int) -> None:
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                      ctypes.c_long(off), ctypes.c_long(length)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"punching chunk at {off} out of the chunk cache: {os.strerror(e)}")


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
