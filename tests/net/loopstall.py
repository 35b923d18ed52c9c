"""How long the running event loop was blocked: the longest gap between the ticks of a
ticker that asks to wake every 5 ms (tests of holes where one request stalls the edge's
loop - the resolver, execs and every other sandbox's requests wait that long)."""

from __future__ import annotations

import asyncio
import time
from typing import Self

__all__ = ["LoopStall"]


class LoopStall:
    """``async with LoopStall() as s: ...``; then ``s.worst`` is the longest gap (s)."""

    def __init__(self, tick_s: float = 0.005) -> None:
        self.tick_s = tick_s
        self.worst = 0.0
        self._stop = False
        self._task: asyncio.Future[None] | None = None

    async def _run(self) -> None:
        last = time.monotonic()
        while not self._stop:
            await asyncio.sleep(self.tick_s)
            now = time.monotonic()
            self.worst = max(self.worst, now - last)
            last = now

    async def __aenter__(self) -> Self:
        self._task = asyncio.ensure_future(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop = True
        if self._task is not None:
            await self._task
