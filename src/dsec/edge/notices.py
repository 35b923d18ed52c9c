"""Rate-limited notices: a backend reports a repeating condition (a disk that stays full,
a pids limit hit again and again) as one event per interval, not one per occurrence.

Pure: the caller passes the clock reading; nothing here sleeps or does I/O.
"""

from __future__ import annotations

__all__ = ["NoticeLimiter"]


class NoticeLimiter:
    """At most one notice per (sandbox, reason) every ``interval_s`` seconds.

    A sandbox whose writes keep failing on its full disk would otherwise add an event
    per failed command and push its lifecycle history out of the bounded event feed."""

    def __init__(self, interval_s: float = 60.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"notice interval_s={interval_s} must be positive")
        self.interval_s = interval_s
        self._last: dict[str, dict[str, float]] = {}

    def allow(self, sid: str, reason: str, now: float) -> bool:
        """True (and remember ``now``) if a ``reason`` notice for ``sid`` may go out."""
        seen = self._last.setdefault(sid, {})
        last = seen.get(reason)
        if last is not None and now - last < self.interval_s:
            return False
        seen[reason] = now
        return True

    def forget(self, sid: str) -> None:
        """Drop what is remembered about ``sid`` (it was destroyed)."""
        self._last.pop(sid, None)
