"""Rate-limited notices: events about a sandbox that lives on.

A backend reports what happens inside a running sandbox - a process OOM-killed, forks
refused at the task limit, a disk that stays full - as *notices*
(``lifecycle.NOTICE_REASONS``: an event whose from and to states are equal). A runaway
agent can trigger one per fork or per failed write, which would push the sandbox's
lifecycle history out of the bounded event feed, so a backend passes each through a
:class:`NoticeLimiter`: the first of a kind goes out at once, later ones of the same
(sandbox, reason) at most once per interval, and the one that goes out says how many were
folded into it.

Pure: the caller passes the clock reading; nothing here sleeps or does I/O.
"""

from __future__ import annotations

__all__ = ["NoticeLimiter"]


class NoticeLimiter:
    """At most one notice per (sandbox, reason) every ``interval_s`` seconds; the rest
    are counted into the next one."""

    def __init__(self, interval_s: float = 60.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"notice interval_s={interval_s} must be positive")
        self.interval_s = interval_s
        # sandbox -> reason -> [time the last notice went out, notices folded since]
        self._last: dict[str, dict[str, list[float]]] = {}

    def admit(self, sid: str, reason: str, now: float) -> int | None:
        """None: drop this notice (it is counted into the next one). Otherwise let it out
        (and remember ``now``); the value is how many were dropped since the last one."""
        seen = self._last.setdefault(sid, {})
        slot = seen.get(reason)
        if slot is None:
            seen[reason] = [now, 0]
            return 0
        if now - slot[0] < self.interval_s:
            slot[1] += 1
            return None
        folded = int(slot[1])
        slot[0], slot[1] = now, 0
        return folded

    def forget(self, sid: str) -> None:
        """Drop what is remembered about ``sid`` (it was destroyed)."""
        self._last.pop(sid, None)
