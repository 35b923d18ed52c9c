"""Time as an injected dependency (CONVENTIONS.md #4).

The edge reads wall time for timestamps that are persisted and compared across restarts
(``created_at``, TTL and idle deadlines) and sleeps for simulated latencies. Production
uses :class:`SystemClock`; tests use :class:`FakeClock`, whose sleepers wake only when the
test calls :meth:`FakeClock.advance`, so TTL and latency-profile logic is tested without
real waiting and without patching the standard library.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol

__all__ = ["Clock", "FakeClock", "SystemClock"]


class Clock(Protocol):
    def time(self) -> float:
        """Wall-clock seconds since the epoch."""

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of this clock's time."""


class SystemClock:
    """The real clock: :func:`time.time` and :func:`asyncio.sleep`."""

    __slots__ = ()

    def time(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class FakeClock:
    """A clock that only moves when told to. ``sleep`` waits until :meth:`advance` passes it."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def time(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.now + seconds, next(self._seq), fut))
        await fut

    @property
    def sleepers(self) -> int:
        """How many sleeps are waiting (cancelled ones excluded)."""
        return sum(1 for _, _, f in self._sleepers if not f.done())

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleeper whose deadline has passed."""
        self.now += seconds
        while self._sleepers and self._sleepers[0][0] <= self.now:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():
                fut.set_result(None)
