"""Pure arithmetic of the chunk path: which chunks a read covers, how misses merge into
ranged requests, how long to back off, and the LRU that decides what the chunk cache
drops. No I/O, no clock: the daemon (:mod:`dsec.edge.lazy.fs`) feeds these."""

from __future__ import annotations

import random
import re
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

__all__ = ["SENT_SHARE", "Breaker", "ChunkLru", "FailureScope", "Run", "backoff_delays",
           "chunk_span", "failure_scope", "judged_by_store", "merge_runs"]

ChunkKey = tuple[str, int]
"""(layer digest hex, chunk index)."""


def chunk_span(offset: int, size: int, chunk_size: int, file_size: int) -> range:
    """Indices of the chunks that bytes ``[offset, offset+size)`` of a ``file_size``
    file touch (clipped at the end of the file; empty past it)."""
    end = min(offset + size, file_size)
    if size <= 0 or offset >= end:
        return range(0)
    return range(offset // chunk_size, (end - 1) // chunk_size + 1)


@dataclass(frozen=True, slots=True)
class Run:
    """``count`` adjacent chunks starting at ``first``: one ranged request."""

    first: int
    count: int

    def byte_range(self, chunk_size: int, file_size: int) -> tuple[int, int]:
        """(offset, length) of the run in the layer file (the last chunk may be short)."""
        off = self.first * chunk_size
        return off, min((self.first + self.count) * chunk_size, file_size) - off


def merge_runs(indices: Iterable[int], max_chunks: int) -> list[Run]:
    """Adjacent chunk indices merged into runs of at most ``max_chunks`` (each one ranged
    request), in ascending order; duplicates collapse."""
    if max_chunks < 1:
        raise ValueError(f"max_chunks={max_chunks} must be >= 1")
    runs: list[Run] = []
    for i in sorted(set(indices)):
        if runs and runs[-1].first + runs[-1].count == i and runs[-1].count < max_chunks:
            runs[-1] = Run(runs[-1].first, runs[-1].count + 1)
        else:
            runs.append(Run(i, 1))
    return runs


def backoff_delays(budget_s: float, *, first_s: float = 0.05, cap_s: float = 2.0,
                   rng: random.Random) -> Iterator[float]:
    """Sleeps between attempts of one fetch: exponential from ``first_s``, capped at
    ``cap_s``, with full jitter (AWS's "full jitter": each sleep uniform in [d/2, d]), and
    ending when the sleeps would pass ``budget_s`` in total: the bound on how long a read
    waits for an unreachable blob store before it fails with EIO."""
    spent, d = 0.0, first_s
    while True:
        s = rng.uniform(d / 2, d)
        if spent + s > budget_s:
            return
        spent += s
        yield s
        d = min(d * 2, cap_s)


class ChunkLru:
    """Which cached chunks go first when the cache is over its byte budget: least
    recently used, never a pinned layer's (an image pinned to this node stays whole)."""

    def __init__(self, budget_bytes: int | None) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"chunk cache budget {budget_bytes} must be >= 0 bytes")
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self._order: OrderedDict[ChunkKey, int] = OrderedDict()
        self.pinned: set[str] = set()

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def touch(self, key: ChunkKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def add(self, key: ChunkKey, size: int) -> list[ChunkKey]:
        """Record a stored chunk; returns the chunks to evict to fit the budget (never
        ``key`` itself, never a pinned layer's), already forgotten here."""
        old = self._order.pop(key, None)
        if old is not None:
            self.bytes -= old
        self._order[key] = size
        self.bytes += size
        return self._fit(keep=key)

    def discard(self, key: ChunkKey) -> None:
        size = self._order.pop(key, None)
        if size is not None:
            self.bytes -= size

    def _fit(self, keep: ChunkKey) -> list[ChunkKey]:
        if self.budget_bytes is None or self.bytes <= self.budget_bytes:
            return []
        out: list[ChunkKey] = []
        for k in list(self._order):
            if self.bytes <= self.budget_bytes:
                break
            if k == keep or k[0] in self.pinned:
                continue
            self.bytes -= self._order.pop(k)
            out.append(k)
        return out

    def keys(self) -> list[ChunkKey]:
        return list(self._order)


Admit = Literal["pass", "probe"]


FailureScope = Literal["store", "layer"]
"""What a failed blob read says: ``"store"`` - the store could not be reached (refused,
reset, a timeout): every layer's reads would fail alike; ``"layer"`` - the store *answered*,
refusing this one object (429, 503 SlowDown, a 5xx for that key): it is up."""

#: The status a blob client put in the error's message when it set none in ``detail``
#: (obstore: "... non-2xx status code: 503 Service Unavailable"; http: "... HTTP 429").
_STATUS = re.compile(r"\b(?:HTTP|status code:?|status:)\s*([1-5]\d\d)\b")


def failure_scope(status: object, message: str) -> FailureScope:
    """Classify a :class:`~dsec.errors.BlobUnavailable` (``status``: its ``detail``
    entry, if any). An HTTP status means the store answered: it refuses *this key*
    (S3 throttles per key prefix, so one tenant hammering its own layer gets 503 SlowDown
    while other layers read fine, red team 22 A2) - never evidence that the store is down
    for every layer. No status: the request got no answer at all."""
    if isinstance(status, int) and 100 <= status <= 599:
        return "layer"
    return "layer" if _STATUS.search(message) else "store"


#: A request given up at its fetch's deadline is evidence against the store only if it
#: was on the wire for at least this share of the retry budget.
SENT_SHARE = 0.5


def judged_by_store(on_wire_s: float, budget_s: float) -> bool:
    """Was a request abandoned at its deadline given a fair chance by the store's side?
    A fetch's deadline counts from the read's start, its wait for a fetch slot included;
    a request that got its slot with milliseconds left and was abandoned says that this
    node's queue was long (one tenant's miss flood), not that the store is down: counted
    against the store, three such in a row opened the breaker for every tenant though the
    store answered every request (red team 22 A2)."""
    return on_wire_s >= SENT_SHARE * budget_s


class Breaker:
    """The blob store's circuit breaker: after ``failures`` fetches in a row ran out
    their retry budget on an unreachable store, it **opens** - misses fail with EIO at
    once, no request sent - for ``open_s``; then it lets **one** request through (the
    half-open probe) while every other miss still fails at once. The probe answering
    closes it; the probe failing opens it again for twice as long (at most
    ``max_open_s``). Any answered request closes it and clears the count.

    Why: without it, every read of an uncached chunk during an outage waits the whole
    retry budget (10 s) before its EIO, and a sandbox walking a tree of N missing files
    hangs N x 10 s; with it, the first ``failures`` x budget seconds find the store down
    and the rest of the outage costs one request per ``open_s``.

    The daemon keeps one for the store and one per layer. The store's counts only a
    store that gave no answer (refused, reset, timeouts of requests that were on the
    wire for a fair share of the budget: :func:`judged_by_store`); a layer's counts the
    store *refusing* that layer (429/5xx: :func:`failure_scope`), so one tenant whose
    hammered key the store throttles fails its own layer's reads fast, not everyone's.
    A corrupt chunk or a missing key counts in neither: they are answers.

    Pure: ``now`` (monotonic seconds) is passed in."""

    def __init__(self, failures: int = 3, open_s: float = 2.0, max_open_s: float = 10.0
                 ) -> None:
        if failures < 1 or open_s <= 0 or max_open_s < open_s:
            raise ValueError(f"breaker: failures={failures} must be >= 1 and "
                             f"0 < open_s={open_s} <= max_open_s={max_open_s}")
        self.failures, self.base_open_s, self.max_open_s = failures, open_s, max_open_s
        self.state: Literal["closed", "open", "half_open"] = "closed"
        self.count = 0                 # consecutive failures while closed
        self.open_s = open_s           # the current (doubling) open time
        self.until = 0.0               # open until (monotonic)
        self.opens = 0                 # times it opened (a counter for metrics)
        self.rejected = 0              # requests refused while open / half-open

    def admit(self, now: float) -> Admit | None:
        """May a request go to the store now? ``"pass"`` (closed), ``"probe"`` (this one
        is the half-open probe: send one attempt, report it), or None (fail fast)."""
        if self.state == "closed":
            return "pass"
        if now >= self.until:
            # open and its time is up; or half-open and the probe was never reported
            # (lost): a new probe, so a breaker can never stay half-open for good
            self.state, self.until = "half_open", now + self.max_open_s
            return "probe"
        self.rejected += 1
        return None

    def retry_in(self, now: float) -> float:
        """Seconds until the next probe may go (0 when closed or a probe is out)."""
        return max(0.0, self.until - now) if self.state == "open" else 0.0

    def success(self) -> bool:
        """A request was answered: closed. True when this closed an open breaker."""
        was = self.state != "closed"
        self.state, self.count, self.open_s = "closed", 0, self.base_open_s
        return was

    def failure(self, now: float, *, probe: bool = False) -> bool:
        """A fetch found the store unreachable (a closed breaker: its whole retry budget;
        a probe: its one attempt). True when this opened the breaker. Failures of
        fetches that started before it opened change nothing while it is open."""
        if probe and self.state == "half_open":
            self.open_s = min(self.open_s * 2, self.max_open_s)
            return self._open(now)
        if self.state != "closed":
            return False
        self.count += 1
        if self.count >= self.failures:
            return self._open(now)
        return False

    def probe_lost(self, now: float) -> None:
        """The probe never reached the store (it waited for a fetch slot): it says
        nothing either way, so the next miss probes again."""
        if self.state == "half_open":
            self.state, self.until = "open", now

    def _open(self, now: float) -> bool:
        self.state, self.until, self.count = "open", now + self.open_s, 0
        self.opens += 1
        return True
