"""Creation rate over time: a rolling per-project series, pure (no I/O, injected time).

Source: the control plane's registry event log (``sandbox_added`` events, each with its
sandbox's project and the time it was recorded), which every create through every door
and every replica passes through. The dashboard follows that log from the version it last
read (:func:`dsec.control.ui.app` feeds :meth:`CreationSeries.add`) and keeps counts in
fixed buckets per project for ``window_s``; nothing is written anywhere. A page shows only
the projects the caller holds a role on (their sum per bucket), so one tenant never sees
another's activity. On start (or when the log was compacted past where it read) the
series starts from what the log still holds: an apiserver restart loses nothing the log
keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["CreationSeries", "Point"]


@dataclass(frozen=True, slots=True)
class Point:
    start: float      # bucket start (unix seconds)
    count: int        # sandboxes created in [start, start + bucket_s)


@dataclass(slots=True)
class CreationSeries:
    bucket_s: float = 60.0
    window_s: float = 3600.0
    # bucket index (floor(time / bucket_s)) -> project -> creations
    _buckets: dict[int, dict[str, int]] = field(default_factory=dict)
    position: int = -1   # the registry version read up to (-1: not started)

    def add(self, time: float, project: str, now: float) -> None:
        """Count one creation at ``time`` in ``project`` (ignored when outside the window
        ending at ``now``)."""
        b = int(time // self.bucket_s)
        if b < self._oldest(now) or time > now + self.bucket_s:
            return
        per = self._buckets.get(b)
        if per is None:
            per = self._buckets[b] = {}
            self._trim(now)
        per[project] = per.get(project, 0) + 1

    def _oldest(self, now: float) -> int:
        """The first bucket of the window: the one ``now`` falls in is its last."""
        return int(now // self.bucket_s) - int(self.window_s // self.bucket_s) + 1

    def _trim(self, now: float) -> None:
        oldest = self._oldest(now)
        for b in [b for b in self._buckets if b < oldest]:
            del self._buckets[b]

    def series(self, visible: Callable[[str], bool], now: float) -> list[Point]:
        """One point per bucket of the window ending at ``now`` (oldest first, empty
        buckets as 0), counting only projects ``visible`` accepts."""
        self._trim(now)
        last = int(now // self.bucket_s)
        seen: dict[str, bool] = {}
        out: list[Point] = []
        for b in range(self._oldest(now), last + 1):
            total = 0
            for project, c in self._buckets.get(b, {}).items():
                ok = seen.get(project)
                if ok is None:
                    ok = seen[project] = visible(project)
                if ok:
                    total += c
            out.append(Point(start=b * self.bucket_s, count=total))
        return out
