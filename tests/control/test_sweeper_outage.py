"""The session sweeper after an apiserver outage (issue 12: recovery must not mislead or
destroy). While no apiserver runs - a crash and a slow restart, an upgrade, a process
stopped or starved, a jump of the wall clock - no client can renew its session lease.
An apiserver back from an outage longer than the lease used to destroy every live
client's sandboxes (``session_expired``) at its first sweep, 5 s after it started,
ahead of the clients' next renewal (every lease/3: 20 s by default).
"""

from __future__ import annotations

from dsec.control.api.plane import ControlPlane
from dsec.control.metrics import ApiMetrics
from dsec.control.store import open_store
from dsec.control.sweeper import Session, SweepCandidate, plan_sweep


def test_a_session_that_lapsed_while_no_apiserver_ran_gets_a_lease_to_renew() -> None:
    sessions = {"s": Session("s", "alice", lease_s=60.0, expires_at=1000.0)}
    cands = [SweepCandidate("sb-1", "s", "running")]
    # the apiserver came back at 1100, its lease lapsed at 1000 (the outage was longer)
    assert plan_sweep(1105.0, cands, sessions, started_at=1100.0, unknown_grace_s=180) == []
    # a whole lease after it came back without a renewal: the client is gone
    assert plan_sweep(1160.0, cands, sessions, started_at=1100.0, unknown_grace_s=180) == [
        ("sb-1", "session_expired")]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def test_a_stalled_or_clock_jumped_sweeper_restarts_its_watch(store_url: str) -> None:
    """SIGSTOP of the apiserver past a lease, or its wall clock jumping ahead: the next
    round notices it woke far later than asked and gives every session a lease again."""
    clock = Clock()
    store = open_store(store_url)
    plane = ControlPlane.open(store, metrics=ApiMetrics(), clock=clock)
    try:
        plane._started_at = plane._last_sweep = clock.t      # as start() sets them
        for _ in range(3):                       # running normally: passes 5 s apart
            clock.t += plane.config.sweep_interval_s
            await plane.sweep_tick()
        assert plane._started_at == 1000.0
        clock.t += 300.0                          # stopped for 5 minutes
        await plane.sweep_tick()
        assert plane._started_at == clock.t
    finally:
        store.close()
