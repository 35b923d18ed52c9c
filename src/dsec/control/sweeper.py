"""The leak sweeper: destroys sandboxes a crashed client can no longer clean up.

Three lines of defence against leaks, from cheapest to broadest:

1. **TTL.** Every sandbox created through the API has a lifetime: the request's ``ttl_s``,
   else the server's ``default_ttl_s`` (6 h). The edge reaps it (event ``ttl``) even if
   the whole management plane is down.
2. **Idle timeout** (opt-in per sandbox, ``idle_timeout_s`` + ``idle_action``), also reaped
   by the edge.
3. **Session leases** (this module; opt-in since issue 19: by default a sandbox outlives
   its client until its TTL, as on E2B and Modal). An SDK client made with
   ``session=True`` (and the RL toolkit's pools) opens a session (``POST /v1/sessions``,
   lease 60 s by default) and renews it every lease/3 from a background task; sandboxes it
   creates carry the label ``dsec.io/session=<id>``. When a lease has not been renewed
   for ``lease_s`` seconds (the client crashed or lost the network for that long), the
   sweeper destroys the session's sandboxes with reason ``session_expired``. Closing a
   session (``DELETE /v1/sessions/{id}``, which the SDK's ``AsyncClient.close()`` /
   ``Client.close()`` sends) sweeps at once.

Sessions live in the control plane's state store (``sessions`` table), so every apiserver
replica over one store shares them and a restart keeps them. A session forgotten after its
sandboxes were swept is re-registered by its client's next renew (renew is an upsert), and
a sandbox whose session is unknown is only swept once ``unknown_grace_s`` (default 3
minutes, more than any sane lease) has passed since the sweeper started.

A lease only says a client is gone if the client could have renewed it: while no
apiserver ran (a crash, a restart, an upgrade, a stopped or starved process, a jump of
the wall clock) renewals failed for every client. So a session is expired only once the
sweeper has been watching for a whole lease (``started_at``: when it started, or woke up
from a stall); before, an apiserver back from an outage longer than the lease destroyed
every live client's sandboxes at its first sweep, ahead of their next renewal.

:func:`plan_sweep` is the pure decision; the async loop in
:mod:`dsec.control.api.plane` feeds it and carries out the destroys.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["SESSION_LABEL", "Session", "SweepCandidate", "plan_sweep"]

SESSION_LABEL = "dsec.io/session"


@dataclass(slots=True)
class Session:
    id: str
    principal_id: str
    lease_s: float
    expires_at: float
    closed: bool = False


@dataclass(slots=True, frozen=True)
class SweepCandidate:
    sandbox_id: str
    session: str
    state: str


def plan_sweep(
    now: float, candidates: Iterable[SweepCandidate], sessions: Mapping[str, Session], *,
    started_at: float, unknown_grace_s: float,
) -> list[tuple[str, str]]:
    """``(sandbox_id, reason)`` for every sandbox to destroy now. ``started_at``: since
    when the sweeper has been watching without a break (see the module docstring)."""
    out: list[tuple[str, str]] = []
    for c in candidates:
        if c.state in ("destroyed", "destroying", "failed"):
            continue
        s = sessions.get(c.session)
        if s is None:
            if now - started_at >= unknown_grace_s:
                out.append((c.sandbox_id, "session_unknown"))
        elif s.closed:
            out.append((c.sandbox_id, "session_closed"))
        elif s.expires_at <= now and now - started_at >= s.lease_s:
            out.append((c.sandbox_id, "session_expired"))
    return out
