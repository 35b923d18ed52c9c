"""What a listener lets its peers hold: connection caps, deadlines and byte budgets.

An unauthenticated local user once filled a ``dsec up`` process's 20,000 file
descriptors with 21,000 idle TCP connections in about 50 s: execs failed with EMFILE,
the apiserver could not read its own edge's heartbeat and wrote the node off (issue 12).
Every listener of dsec (the Aether gateway, edge sockets, REST) is therefore admitted
through the same pure bookkeeping here:

- **per listener**: at most ``max_connections`` open, of which at most ``max_pending``
  not yet authenticated ("pending");
- **per peer address** (TCP: the IP; Unix sockets: the peer's uid): at most
  ``max_connections_per_peer`` open and ``max_pending_per_peer`` pending, so one address
  cannot take every slot;
- **per process** (:class:`ProcessBudget`): accepted connections of all listeners
  together use at most ``connection_share`` of ``RLIMIT_NOFILE``; the rest stays
  reserved for the node's own links (apiserver to edge), exec pipes, sandboxes' pidfds,
  journals and databases. Bytes of incoming frames buffered by all connections together
  are capped at ``max_buffered_bytes``.

A connection beyond a cap is accepted only to be told why (an Aether GOAWAY with code
``overloaded``, or an HTTP 503) and closed at once: the peer gets a clear, retryable
refusal instead of a hang, and the node never reaches EMFILE on its own work.

Deadlines (enforced by the connection, see :mod:`dsec.aether.connection`): a pending
connection must authenticate (Aether: call ``aether.auth``; no-token endpoints: send a
first valid frame) within ``auth_timeout_s`` and may not send frames larger than
``pending_max_frame`` before that; an established connection with nothing in flight is
closed after ``idle_timeout_s`` of silence; a frame whose header has arrived must be
complete within ``frame_timeout_s`` (a peer announcing 16 MiB and sending 1 MiB does not
keep the server holding it).

This module is pure logic: no sockets, no asyncio. ``ProcessBudget`` reads the fd limit
through an injected callable.
"""

from __future__ import annotations

import resource
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from dsec.aether.frame import DEFAULT_MAX_FRAME, MAX_FRAME_LIMIT
from dsec.errors import InvalidArgument

__all__ = [
    "DEFAULT_LIMITS",
    "Admission",
    "ListenerStats",
    "PendingPool",
    "ProcessBudget",
    "ServerLimits",
    "process_budget",
    "soft_nofile",
]


@dataclass(slots=True, frozen=True, kw_only=True)
class ServerLimits:
    """Limits of one listener. ``None`` means no limit of that kind."""

    # Connections open at once on this listener, and from one peer address.
    max_connections: int | None = 8192
    max_connections_per_peer: int | None = 2048
    # Of those, not yet authenticated (an idle flood lives here): per listener, per peer.
    max_pending: int | None = 1024
    max_pending_per_peer: int | None = 64
    # Seconds a new connection has to authenticate (or, on an endpoint without a token,
    # to deliver its first frame) before it is closed.
    auth_timeout_s: float | None = 10.0
    # Seconds an established connection may stay silent with no call in flight either
    # way. Long enough for an SDK between rollouts; the apiserver polls edges every 1 s.
    idle_timeout_s: float | None = 900.0
    # Seconds a frame may take from its header to its last byte (16 MiB at 140 KB/s).
    frame_timeout_s: float | None = 120.0
    # Calls of one connection handled at once (async handlers running); at the cap the
    # connection is not read until one ends (backpressure, nothing is refused). Without
    # it a tenant pipelining 40,000 execs per connection made the gateway hold them all
    # (RSS +300 MB) and queue them in front of the apiserver's polls of its edge, which
    # timed out until the node was written off (node_lost). Edges leave it off: their
    # one peer, the apiserver, multiplexes every tenant over a link it must keep read.
    max_calls_in_flight: int | None = 1024
    # Bytes of our replies the peer may leave unread (in the write buffer, or finished and
    # waiting for it to drain) before it is closed: a tenant that pipelined 300 read_file
    # calls of an 8 MiB file and never read grew dsec up by 1.5 GB. Edges leave it off:
    # their one authenticated peer is the apiserver (it holds the edge's token or
    # certificate: root in every sandbox anyway), whose link carries every tenant; one
    # tenant's big replies there wait their turn (backpressure), they never close it.
    unread_replies_max: int | None = 64 << 20
    # The authenticated peer multiplexes many tenants over one connection (the apiserver,
    # on an edge): once established it is not counted as a holder of the process's
    # buffer budget (so never cut as the largest one); its input is bounded by the read
    # high-water mark plus one frame.
    shared_link: bool = False
    # Largest frame (bytes) accepted before authentication; an auth call is < 200 bytes.
    pending_max_frame: int = 4096
    # Largest frame (bytes) accepted after it.
    max_frame: int = DEFAULT_MAX_FRAME

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_connections_per_peer", "max_pending",
                     "max_pending_per_peer", "max_calls_in_flight", "unread_replies_max"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise InvalidArgument(f"ServerLimits.{name}={v} must be >= 1 or None")
        for name in ("auth_timeout_s", "idle_timeout_s", "frame_timeout_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise InvalidArgument(f"ServerLimits.{name}={v} must be > 0 seconds or None")
        if not 64 <= self.pending_max_frame <= self.max_frame <= MAX_FRAME_LIMIT:
            raise InvalidArgument(
                f"ServerLimits needs 64 <= pending_max_frame ({self.pending_max_frame}) <= "
                f"max_frame ({self.max_frame}) <= {MAX_FRAME_LIMIT}")


DEFAULT_LIMITS = ServerLimits()


def soft_nofile() -> int:
    """This process's soft RLIMIT_NOFILE (file descriptors it may hold)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class PendingPool(Protocol):
    """A listener's connections that have not authenticated yet (see ProcessBudget)."""

    def pending_count(self) -> int: ...

    def evict_oldest_pending(self) -> bool: ...


@dataclass(slots=True, eq=False, kw_only=True)
class ProcessBudget:
    """What all listeners of one process share: file descriptors and buffered bytes.

    ``connection_share`` of the soft fd limit may go to accepted connections (0.5: at the
    20,000 of the incident, 10,000 connections and 10,000 fds for the node's own work;
    raise RLIMIT_NOFILE for more). ``max_buffered_bytes`` caps the bytes of incoming
    frames held by all connections together (partial frames, unprocessed input).
    """

    connection_share: float = 0.5
    max_buffered_bytes: int | None = 256 << 20
    nofile: Callable[[], int] = soft_nofile
    connections: int = 0
    buffered: int = 0
    lingering: int = 0      # closed connections still draining their peer (<= 1 s each)
    # Who holds the buffered bytes (connection -> bytes; only those holding some): over
    # the budget, the largest holder is closed, not whichever connection's next read
    # happened to cross the line (that used to be a client mid-way through an ordinary
    # 1 MiB write - or the apiserver's own link to its edge - while a few strangers
    # held 16 MiB partial frames each).
    holders: dict[object, int] = field(default_factory=dict)
    # Every listener's not-yet-authenticated connections: when the fd share is what is
    # full, the oldest of the listener holding the most is dropped for a newcomer, as
    # when one listener's pending slots are full. Without it a stranger's idle flood
    # over a few addresses filled a small share (RLIMIT_NOFILE 1024: 512) with pending
    # connections, and every client, key or not, was refused.
    pools: weakref.WeakSet[PendingPool] = field(default_factory=weakref.WeakSet)

    def __post_init__(self) -> None:
        if not 0 < self.connection_share < 1:
            raise InvalidArgument(
                f"connection_share={self.connection_share} must be between 0 and 1: the "
                "rest of the fd limit is the node's own reserve")

    def connection_limit(self) -> int:
        """Accepted connections the process may hold at once (all listeners)."""
        return max(1, int(self.nofile() * self.connection_share))

    def over_buffer(self) -> bool:
        return self.max_buffered_bytes is not None and self.buffered > self.max_buffered_bytes

    def hold(self, holder: object, held: int) -> None:
        """``holder`` now holds ``held`` bytes (0: none); ``buffered`` follows."""
        before = self.holders.pop(holder, 0)
        if held:
            self.holders[holder] = held
        self.buffered += held - before

    def make_room(self) -> bool:
        """Drop the oldest unauthenticated connection of the listener holding the most;
        False if no listener holds any."""
        pool = max(self.pools, key=lambda p: p.pending_count(), default=None)
        return pool is not None and pool.pending_count() > 0 and pool.evict_oldest_pending()

    def largest_holder(self) -> object | None:
        """The holder of the most buffered bytes (the one to close when over budget)."""
        if not self.holders:
            return None
        return max(self.holders.items(), key=lambda kv: kv[1])[0]


_PROCESS_BUDGET: ProcessBudget | None = None


def process_budget() -> ProcessBudget:
    """The budget every listener of this process shares unless given its own."""
    global _PROCESS_BUDGET
    if _PROCESS_BUDGET is None:
        _PROCESS_BUDGET = ProcessBudget()
    return _PROCESS_BUDGET


@dataclass(slots=True, eq=False)
class ListenerStats:
    """Counters of one listener (what was admitted, refused and cut, and why)."""

    accepted: int = 0
    refused: dict[str, int] = field(default_factory=dict)   # by refusal kind
    closed: dict[str, int] = field(default_factory=dict)    # by reason: auth_timeout, ...
    accept_errors: int = 0                                  # EMFILE/ENFILE/... on accept

    def refuse(self, kind: str) -> None:
        self.refused[kind] = self.refused.get(kind, 0) + 1

    def close(self, kind: str) -> None:
        self.closed[kind] = self.closed.get(kind, 0) + 1

    @property
    def refused_total(self) -> int:
        return sum(self.refused.values())


class Admission:
    """Connection counts of one listener, and whether one more may come in.

    ``admit(peer)`` returns ``None`` and counts the connection as pending, or a
    ``(kind, reason)`` refusal; ``establish(peer)`` moves it to established (it
    authenticated); ``release(peer, established)`` forgets it when it closes."""

    __slots__ = ("budget", "by_peer", "limits", "name", "open", "pending", "pending_by_peer",
                 "stats")

    def __init__(self, limits: ServerLimits, budget: ProcessBudget, *, name: str = "",
                 stats: ListenerStats | None = None) -> None:
        self.limits = limits
        self.budget = budget
        self.name = name
        self.stats = stats if stats is not None else ListenerStats()
        self.open = 0
        self.pending = 0
        self.by_peer: dict[str, int] = {}
        self.pending_by_peer: dict[str, int] = {}

    def admit(self, peer: str) -> tuple[str, str] | None:
        lim = self.limits
        on = self.name or "this listener"
        # Per-peer caps first: a peer over its own share is refused without costing
        # anyone else a slot (the listener may evict its oldest pending one otherwise).
        n_peer = self.by_peer.get(peer, 0)
        if lim.max_connections_per_peer is not None and n_peer >= lim.max_connections_per_peer:
            return ("peer_full", (f"{on} already holds {n_peer} connections from {peer} (the "
                    "per-peer limit); close some or retry later"))
        p_peer = self.pending_by_peer.get(peer, 0)
        if lim.max_pending_per_peer is not None and p_peer >= lim.max_pending_per_peer:
            return ("peer_pending_full", (f"{on} already has {p_peer} unauthenticated "
                    f"connections from {peer} (the per-peer limit); authenticate the open "
                    "ones or retry later"))
        if lim.max_connections is not None and self.open >= lim.max_connections:
            return ("listener_full", (f"{on} is at its limit of {lim.max_connections} "
                    "connections; retry later"))
        if lim.max_pending is not None and self.pending >= lim.max_pending:
            return ("pending_full", (f"{on} has {self.pending} connections waiting to "
                    f"authenticate (its limit); retry later"))
        budget = self.budget
        cap = budget.connection_limit()
        if budget.connections >= cap:
            return ("fds", (f"this process holds {budget.connections} connections, the share "
                    f"of its file descriptors reserved for them ({cap}); the rest is kept "
                    "for its own work; retry later"))
        self.open += 1
        self.pending += 1
        self.by_peer[peer] = n_peer + 1
        self.pending_by_peer[peer] = p_peer + 1
        budget.connections += 1
        self.stats.accepted += 1
        return None

    def establish(self, peer: str) -> None:
        self.pending -= 1
        _dec(self.pending_by_peer, peer)

    def release(self, peer: str, *, established: bool) -> None:
        self.open -= 1
        self.budget.connections -= 1
        _dec(self.by_peer, peer)
        if not established:
            self.pending -= 1
            _dec(self.pending_by_peer, peer)


def _dec(counts: dict[str, int], key: str) -> None:
    n = counts.get(key, 0) - 1
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)
