"""The sandbox lifecycle: a state table, compare-and-set transitions, a per-sandbox event log.

Pure logic: no asyncio, no I/O. The table is the single source of which operation may
happen in which state (DESIGN.md, "Sandboxes")::

    creating -> running <-> (pausing -> paused -> resuming) -> destroying -> destroyed
    failed   <- any in-flight state (creating, pausing, resuming, destroying)

A transition checks the current state and sets the next one with no ``await`` in
between, which on the edge's single event loop is a compare-and-set: of two concurrent
operations on one sandbox exactly one wins, the other gets :class:`InvalidTransition`
naming the sandbox, the event and the state it found.

Events are stored as small tuples ``(time, from, to, reason, detail)`` because the burst
benchmark makes four of them per lifecycle; they become :class:`SandboxEvent` structs
only when someone reads them.
"""

from __future__ import annotations

from typing import Literal, Protocol

from dsec.errors import InvalidTransition
from dsec.wire.spec import SandboxEvent, SandboxState

__all__ = [
    "FINAL_REASONS",
    "IN_FLIGHT",
    "NOTICE_REASONS",
    "TABLE",
    "EventTuple",
    "LifecycleEvent",
    "adopted_lifetime",
    "allowed_from",
    "event_structs",
    "moved_lifetime",
    "next_state",
    "start_clock",
    "stop_clock",
]

LifecycleEvent = Literal[
    "create", "created", "pause", "paused", "resume", "resumed", "destroy", "destroyed", "fail"
]

# {state: {event: next state}}. "create" is the birth event, handled by the node.
TABLE: dict[SandboxState, dict[LifecycleEvent, SandboxState]] = {
    "creating": {"created": "running", "fail": "failed"},
    "running": {"pause": "pausing", "destroy": "destroying"},
    "pausing": {"paused": "paused", "fail": "failed"},
    "paused": {"resume": "resuming", "destroy": "destroying"},
    "resuming": {"resumed": "running", "fail": "failed"},
    "destroying": {"destroyed": "destroyed", "fail": "failed"},
    "destroyed": {},
    # A failed sandbox still holds whatever the backend could not release; destroying
    # it again is the only way out, so nothing stays reserved forever.
    "failed": {"destroy": "destroying"},
}

IN_FLIGHT: frozenset[SandboxState] = frozenset({"creating", "pausing", "resuming", "destroying"})

# Why a sandbox ended. Every sandbox that leaves the node carries one of these in its
# final event, so nothing disappears silently.
FINAL_REASONS: frozenset[str] = frozenset({
    "requested",        # a client asked for destroy
    "ttl",              # spec.ttl_s passed
    "idle_timeout",     # spec.idle_timeout_s passed with idle_action=destroy
    "paused_retention",  # paused longer than the node's paused_retention_s (red team 19 B4)
    "evicted",          # the control plane took the capacity back
    "preempted",        # a higher-priority sandbox needed the room
    "oom",              # the backend reported an out-of-memory kill
    "exited",           # the sandbox's init/worker exited on its own
    "backend_crash",    # the backend lost it
    "node_lost",        # after an edge restart the backend no longer had it
    "create_failed",    # creation failed; everything was rolled back
    "failed",           # an operation failed and cleanup destroyed it
    "shutdown",         # the node was drained
    "node_revoked",     # the node was revoked from the cluster (docs/cluster.md)
    "migrated",         # moved off a drained node: the detail names its new sandbox
    "orphaned",         # the control plane had no record of it past its quarantine
})

# Reasons a backend may report for a sandbox that lives on: recorded as an event whose
# from and to states are equal, never as a death.
# Backends rate-limit them (dsec.edge.notices.NoticeLimiter): a runaway agent can trigger
# one per fork.
NOTICE_REASONS: frozenset[str] = frozenset({
    "oom_kill",         # the OOM killer killed a process inside; the sandbox still runs
    "pids_limit",       # forks inside failed: the sandbox is at its task limit (pids_max)
    "tmpfs_full",       # tmpfs files (/tmp, /dev/shm) hold most of the memory limit, so
                        # new processes get OOM-killed; free them with the file API
    "disk_full",        # a write hit the sandbox's disk cap (or its node's disk pool)
    "network_denied",   # its egress policy dropped packets (counts and examples)
    "network_lost",     # adopted after an edge restart without its router slot: cut off
    "network_ipv6_inert",  # its policy names IPv6 entries this node cannot carry (no
                        # IPv6 for sandboxes): accepted, inert, and said so
    "layer_unavailable",  # a lazily loaded image layer could not be read (blob store
                        # outage, corrupt chunks, its FUSE daemon died): reads got EIO
    "memory_pressure",  # qos (issue 22): paused (and reclaimed) to relieve node memory
                        # pressure, a best-effort sandbox idle longest; resume to go on
})

EventTuple = tuple[float, "SandboxState | None", SandboxState, str, str]


def allowed_from(event: LifecycleEvent) -> list[SandboxState]:
    """States in which ``event`` is legal (for error messages)."""
    return [s for s, evs in TABLE.items() if event in evs]


def next_state(sandbox_id: str, state: SandboxState, event: LifecycleEvent) -> SandboxState:
    """The state after ``event`` in ``state``, or :class:`InvalidTransition`."""
    nxt = TABLE[state].get(event)
    if nxt is None:
        raise InvalidTransition(
            f"sandbox {sandbox_id} cannot {event} while it is {state}; "
            f"{event} is allowed only when it is {' or '.join(allowed_from(event)) or 'never'}",
            sandbox_id=sandbox_id, event=event, state=state,
        )
    return nxt


def event_structs(sandbox_id: str, events: list[EventTuple]) -> list[SandboxEvent]:
    """Turn stored event tuples into wire structs."""
    return [
        SandboxEvent(time=t, sandbox_id=sandbox_id, from_state=f, to_state=to, reason=r, detail=d)
        for (t, f, to, r, d) in events
    ]


# ---------------------------------------------------------------- lifetimes (issue 19)
# A sandbox's TTL is a clock: running (``expires_at``, unix seconds) while the sandbox
# runs, stopped (``ttl_left``, seconds) while it is paused, both None without a TTL.
# Pausing stops it, resuming starts it again: a paused sandbox is never reaped for its
# TTL (before, a sandbox paused with ttl=4 was destroyed with reason ``ttl`` while
# paused), and E2B/Modal users get the whole time they asked for as running time.


class HasClock(Protocol):
    expires_at: float | None
    ttl_left: float | None


def stop_clock(rec: HasClock, now: float) -> None:
    """Pausing: keep what is left of the running clock (never negative)."""
    if rec.expires_at is not None:
        rec.ttl_left = max(0.0, rec.expires_at - now)
        rec.expires_at = None


def start_clock(rec: HasClock, now: float) -> None:
    """Resuming (or adopted running): the time left runs again from ``now``."""
    if rec.ttl_left is not None:
        rec.expires_at = now + rec.ttl_left
        rec.ttl_left = None


def moved_lifetime(expires_at: float | None, ttl_left: float | None, *, stopped: bool,
                   now: float, timeout_s: float, extend: bool,
                   cap_s: float) -> tuple[float | None, float | None]:
    """``set_timeout``: the new ``(expires_at, ttl_left)``. ``stopped``: the sandbox is
    paused (its clock does not run). ``extend`` adds to what is left (a sandbox without
    a TTL gets ``timeout_s``); the result never exceeds ``cap_s`` of lifetime."""
    if stopped or ttl_left is not None:
        left = ttl_left if ttl_left is not None else (
            None if expires_at is None else max(0.0, expires_at - now))
        base = (left or 0.0) if extend else 0.0
        return None, min(base + timeout_s, cap_s)
    base = max(expires_at, now) if extend and expires_at is not None else now
    return min(base + timeout_s, now + cap_s), None


def adopted_lifetime(expires_at: float | None, ttl_left: float | None, *,
                     created_at: float, ttl_s: float | None) -> tuple[float | None, float | None]:
    """A journal line's clock ``(expires_at, ttl_left)``. A line written before
    lifetimes were journaled (neither field) had the creation time plus ``ttl_s``."""
    if expires_at is None and ttl_left is None and ttl_s is not None:
        return created_at + ttl_s, None
    return expires_at, ttl_left
