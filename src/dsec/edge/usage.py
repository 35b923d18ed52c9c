"""Per-sandbox resource use over time (issue 19, ``sb.stats()``): CPU usage in percent
over an interval, and network bytes through a sandbox's own network namespace.

A cgroup only says how much CPU time a sandbox used in total (``cpu.stat usage_usec`` on
v2, ``cpuacct.usage`` on v1); "how busy is it" needs two readings. :class:`CpuUsage`
keeps each sandbox's previous reading, so a trainer polling ``stats()`` every few seconds
gets the usage over its own polling interval at no extra cost; a first call (or one after
a long silence) takes a short sample instead. Pure: the caller passes the time and the
counter; :func:`net_bytes` is the one read of the host.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field
from typing import Final

__all__ = ["OP_BUCKETS", "CpuUsage", "OpTimings", "net_bytes", "parse_net_dev"]


@dataclass(slots=True)
class CpuUsage:
    """``min_interval_s``: a previous reading younger than this is too close to divide
    by (a sample is taken instead); ``max_age_s``: one older than this says little about
    now; ``sample_s``: how long the edge waits between two readings when it has none."""

    min_interval_s: float = 0.2
    max_age_s: float = 120.0
    sample_s: float = 0.25
    _last: dict[str, tuple[float, float]] = field(default_factory=dict)

    def update(self, sid: str, now: float, cpu_s: float) -> tuple[float | None, float | None]:
        """Record a reading; ``(percent, interval_s)`` since the previous one, or
        ``(None, None)`` when there is no usable previous reading (then sample again
        after :attr:`sample_s`). 100 = one core busy for the whole interval."""
        prev = self._last.get(sid)
        if prev is not None and now - prev[0] < self.min_interval_s:
            return None, None        # keep the older reading: a longer interval next time
        self._last[sid] = (now, cpu_s)
        if prev is None or now - prev[0] > self.max_age_s or cpu_s < prev[1]:
            return None, None
        dt = now - prev[0]
        return round(max(0.0, (cpu_s - prev[1]) / dt * 100.0), 2), round(dt, 3)

    def forget(self, sid: str) -> None:
        self._last.pop(sid, None)


def parse_net_dev(text: str) -> tuple[int, int]:
    """``(rx_bytes, tx_bytes)`` summed over the interfaces of ``/proc/<pid>/net/dev``
    but loopback (traffic inside the sandbox is not network use)."""
    rx = tx = 0
    for line in text.splitlines()[2:]:
        name, sep, rest = line.partition(":")   # a device name cannot hold ':'
        if not sep or name.strip() == "lo":
            continue
        cols = rest.split()
        if len(cols) >= 9:
            rx += int(cols[0])
            tx += int(cols[8])
    return rx, tx


def net_bytes(pid: int) -> tuple[int | None, int | None]:
    """Network bytes of the network namespace process ``pid`` is in, or ``(None, None)``
    when it shares the edge's own namespace (they would be the host's bytes) or is
    gone."""
    if pid <= 0:
        return None, None
    try:
        if os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino:
            return None, None
        with open(f"/proc/{pid}/net/dev") as f:
            return parse_net_dev(f.read())
    except (OSError, ValueError):
        return None, None


#: seconds: an exec of `true` takes ~1 ms, a container create ~50 ms-1 s, a pause of a big
#: sandbox (memory handed back) seconds
OP_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0, 60.0, 300.0)


class OpTimings:
    """Durations of the node's operations (create, pause, resume, exec, destroy) and its
    counts (notices by reason), kept as plain bucket counts by the node itself (issue 19):
    the node imports no Prometheus, the collector turns them into families at scrape
    time. One ``observe`` is a bisect and three additions."""

    __slots__ = ("buckets", "counts", "errors", "notices", "sums")

    def __init__(self, buckets: tuple[float, ...] = OP_BUCKETS) -> None:
        self.buckets = buckets
        self.counts: dict[str, list[int]] = {}     # op -> per-bucket counts (+Inf last)
        self.sums: dict[str, float] = {}
        self.errors: dict[str, int] = {}           # op -> failed ones (also observed)
        self.notices: dict[str, int] = {}          # event reason -> count (oom_kill, ...)

    def observe(self, op: str, seconds: float, *, ok: bool = True) -> None:
        c = self.counts.get(op)
        if c is None:
            c = self.counts[op] = [0] * (len(self.buckets) + 1)
            self.sums[op] = 0.0
        c[bisect.bisect_left(self.buckets, seconds)] += 1
        self.sums[op] += seconds
        if not ok:
            self.errors[op] = self.errors.get(op, 0) + 1

    def notice(self, reason: str) -> None:
        self.notices[reason] = self.notices.get(reason, 0) + 1
