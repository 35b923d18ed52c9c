"""Rate limiting for notices: events about a sandbox that lives on.

A backend reports what happens inside a running sandbox - a process OOM-killed, forks
refused at the task limit, a full disk - as *notices* (``lifecycle.NOTICE_REASONS``): an
event whose from and to states are equal. A runaway agent can trigger one per fork, so a
backend passes each through a :class:`NoticeLimiter` first: the first notice of a kind
goes out at once, later ones of the same (sandbox, reason) at most once per interval, and
the one that goes out says how many were folded into it. Pure: the clock is injected.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["DEFAULT_NOTICE_INTERVAL_S", "NoticeLimiter"]

#: the least time between two notices of one kind about one sandbox
DEFAULT_NOTICE_INTERVAL_S = 10.0


class NoticeLimiter:
    """At most one notice per (sandbox, reason) per ``interval_s``; the rest are counted."""

    def __init__(self, *, interval_s: float = DEFAULT_NOTICE_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s={interval_s} must be >= 0")
        self.interval_s = interval_s
        self.clock = clock
        # (sandbox, reason) -> [time the last notice went out, notices folded since]
        self._last: dict[tuple[str, str], list[float]] = {}

    def admit(self, sandbox_id: str, reason: str) -> int | None:
        """None: drop this notice (it is counted into the next one). Otherwise let it
        through; the value is how many notices were dropped since the last one."""
        now = self.clock()
        key = (sandbox_id, reason)
        slot = self._last.get(key)
        if slot is None:
            self._last[key] = [now, 0]
            return 0
        if now - slot[0] < self.interval_s:
            slot[1] += 1
            return None
        folded = int(slot[1])
        slot[0], slot[1] = now, 0
        return folded

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone: drop its counters."""
        for key in [k for k in self._last if k[0] == sandbox_id]:
            del self._last[key]
