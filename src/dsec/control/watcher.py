"""The watcher: node liveness from heartbeats, eviction on node loss, preemption victims.

A control loop in the ``handle(*events) -> list[Instruction]`` style (CONVENTIONS.md #3):
it owns no I/O. The runner feeds it :class:`NodeHeartbeat` and :class:`Tick` events (and
:class:`Preempt` requests) and carries out what comes back:

=====================  ================================================================
instruction            what the runner does
=====================  ================================================================
:class:`UpdateNode`    ``placement.update(view)``
:class:`EvictNode`     ``placement.remove(node)``; ``registry.evict_node(node,
                       reason="node_lost")`` (one event per sandbox)
:class:`DestroySandboxes`  tell the edge to destroy these sandboxes (they were evicted
                       while the node was gone; they must not come back to life)
:class:`PreemptSandboxes`  destroy (or pause-and-evict) the victims, then retry the create
:class:`PreemptionFailed`  answer the create with NoCapacity
=====================  ================================================================

A :class:`Preempt` that already fits (counting victims chosen earlier as freed) returns
no instruction.

Liveness uses the time the control plane *received* a heartbeat (``NodeHeartbeat.time``
stamped by the runner's clock), never the node's clock, so node clock skew cannot keep a
dead node alive. Nodes are kept in receipt order, so a tick expires nodes in O(expired).

"I cannot reach my edge" is not "the edge is lost" (issue 12: an apiserver out of file
descriptors once wrote off a healthy edge and destroyed its sandboxes). Only *silence*
counts toward ``ttl_s``: connection refused or reset, no reply in time. A poll that failed
for another reason is a :class:`LinkFailed` event, and it holds the node instead:
``answered`` (the node replied, with an error or an overload refusal: it is alive) or
``blind`` (this side could not look: its own fd, port or memory limits). The node is then
taken out of placement (``UpdateNode`` with ``healthy=False``) but its sandboxes stay;
its TTL counts from the failed poll, as if it had been seen then.
:func:`link_failure_cause` sorts a failed poll's error into the three causes.

A poll that merely timed out is silence only if the apiserver really listened: the
node is ``answered`` (busy, held) when its link carried other replies during the poll
(a tenant once queued 300,000 execs in front of the poll and got a healthy node written
off), and this side is ``blind`` when its own event loop could not run for much of the
poll's deadline (:class:`StallMeter`: CPU-heavy requests, or the host starving the
process).

Every event carries a ``stimulus_id`` (the runner may name it; otherwise the watcher does:
``hb-<node>-<n>``, ``tick-<now>``, ``link-<node>-<n>``, ``preempt-<node>-<n>``), and every
instruction carries the stimulus that caused it, so a log line saying a node was lost or
a sandbox destroyed can name the heartbeat or tick behind it. The watcher keeps a bounded
:attr:`Watcher.story` of what each stimulus did (``story_of(node)`` for tests and logs),
and :meth:`Watcher.validate_state` checks its invariants (Dask's
``WorkerState.handle_stimulus`` / ``validate_state`` are the model).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import msgspec

from dsec.control.placement import PlacementNode
from dsec.errors import (
    DsecError,
    InvalidArgument,
    LocalProtocolError,
    Overloaded,
    Timeout,
    TransportError,
)

__all__ = [
    "DestroySandboxes",
    "EvictNode",
    "Instruction",
    "LinkFailed",
    "LiveSandbox",
    "NodeHeartbeat",
    "Preempt",
    "PreemptSandboxes",
    "PreemptionFailed",
    "StallMeter",
    "StoryEntry",
    "Tick",
    "UpdateNode",
    "Watcher",
    "WatcherConfig",
    "choose_victims",
    "link_failure_cause",
]


class LiveSandbox(msgspec.Struct, frozen=True, kw_only=True):
    """A sandbox a node reports as alive: id, project, its reservation (``cpu_milli``,
    ``memory_bytes``), ``priority`` (higher wins), ``created_at`` (node clock, only
    compared among one node's sandboxes) and ``paused``."""

    id: str
    project: str = "default"
    cpu_milli: int = 0
    memory_bytes: int = 0
    priority: int = 0
    created_at: float = 0.0
    paused: bool = False


class NodeHeartbeat(msgspec.Struct, frozen=True, kw_only=True):
    """One heartbeat as the watcher consumes it.

    ``time``: when the control plane received it (its clock, seconds). ``view``: the node
    as placement sees it (capacity, usage, labels, layers, ...; its ``sandboxes`` and
    ``groups`` are recomputed here from ``sandboxes``, which lists every sandbox alive on
    the node). The apiserver converts the edge's own heartbeat into this.
    """

    time: float
    view: PlacementNode
    sandboxes: tuple[LiveSandbox, ...] = ()
    stimulus_id: str = ""

    @property
    def node(self) -> str:
        return self.view.node


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passes: expire nodes silent since before ``now - ttl_s``."""

    now: float
    stimulus_id: str = ""


LinkCause = Literal["answered", "blind", "silent"]


@dataclass(frozen=True, slots=True)
class LinkFailed:
    """A poll of ``node`` at ``time`` failed for a reason that is not the node's silence
    (see the module docstring): ``answered`` or ``blind``. Holds the node, never
    expires it; ``detail`` says what happened (for logs and ``GET /v1/nodes``)."""

    node: str
    time: float
    cause: Literal["answered", "blind"]
    detail: str = ""
    stimulus_id: str = ""


def link_failure_cause(exc: DsecError, *, heard: bool = False,
                       stalled: bool = False) -> LinkCause:
    """Why a call to a node failed, as liveness sees it.

    - ``answered``: the node replied: any error decoded from its ERROR frame (an
      ``internal_error`` from a handler that hit EMFILE is still a live node), or an
      overload refusal (GOAWAY ``overloaded``) from its listener;
    - ``blind``: this side failed before the node could be asked: its own fd/port/memory
      shortage on connect (a ``TransportError`` with ``detail["local"]``), or a request
      it could not encode (``LocalProtocolError``);
    - ``silent``: no answer: refused, reset, closed, or no reply within the deadline.

    A deadline that passed is not silence when ``heard`` (the link received other bytes
    from the node while this call waited: it is alive, its answer is queued: ``answered``)
    or ``stalled`` (this side's event loop could not run for much of the deadline: it
    was not listening: ``blind``).
    """
    if isinstance(exc, Timeout):
        if heard:
            return "answered"
        if stalled:
            return "blind"
        return "silent"
    if isinstance(exc, Overloaded):
        return "answered"
    if isinstance(exc, TransportError) and exc.detail.get("local"):
        return "blind"
    if isinstance(exc, LocalProtocolError):
        return "blind"
    if isinstance(exc, (TransportError, Timeout)):
        return "silent"
    return "answered"


class StallMeter:
    """How long this process's event loop could not run, from the lateness of a ticker.

    The runner calls :meth:`tick` from a task that sleeps ``interval_s`` between calls;
    a tick that comes late says the loop was busy (or the process descheduled) for that
    long. :meth:`stalled` sums it over a window, counting a tick overdue right now too
    (the loop may be in the middle of its stall when a timer fires). Pure: the runner
    passes the times."""

    __slots__ = ("_keep_s", "_last", "_samples", "interval_s")

    def __init__(self, interval_s: float, *, keep_s: float = 120.0) -> None:
        if not interval_s > 0:
            raise InvalidArgument(f"StallMeter interval_s={interval_s} must be > 0")
        self.interval_s = interval_s
        self._keep_s = keep_s
        self._last: float | None = None
        self._samples: deque[tuple[float, float]] = deque()    # (tick time, lateness)

    def tick(self, now: float) -> None:
        last, self._last = self._last, now
        if last is None:
            return
        late = now - last - self.interval_s
        if late > 0:
            self._samples.append((now, late))
        while self._samples and self._samples[0][0] < now - self._keep_s:
            self._samples.popleft()

    def stalled(self, since: float, now: float) -> float:
        """Seconds of ``[since, now]`` during which the loop was not running."""
        total = 0.0
        for at, late in self._samples:
            lo, hi = max(at - late, since), min(at, now)
            if hi > lo:
                total += hi - lo
        if self._last is not None:   # a tick overdue now: the loop is stalled right now
            overdue_from = max(self._last + self.interval_s, since)
            if now > overdue_from:
                total += now - overdue_from
        return total


@dataclass(frozen=True, slots=True)
class Preempt:
    """Make room on ``node`` for a sandbox of ``priority`` needing these resources."""

    node: str
    cpu_milli: int
    memory_bytes: int
    priority: int
    stimulus_id: str = ""


@dataclass(frozen=True, slots=True)
class UpdateNode:
    view: PlacementNode
    # What caused it (the event's stimulus id); not part of what the instruction is.
    stimulus_id: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class EvictNode:
    """``node`` expired: evict its sandboxes (``sandbox_ids`` as last reported)."""

    node: str
    sandbox_ids: tuple[str, ...]
    reason: str = "node_lost"
    # What caused it (the event's stimulus id); not part of what the instruction is.
    stimulus_id: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class DestroySandboxes:
    node: str
    sandbox_ids: tuple[str, ...]
    reason: str
    # What caused it (the event's stimulus id); not part of what the instruction is.
    stimulus_id: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class PreemptSandboxes:
    node: str
    sandbox_ids: tuple[str, ...]
    for_priority: int
    reason: str = "preempted"
    # What caused it (the event's stimulus id); not part of what the instruction is.
    stimulus_id: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class PreemptionFailed:
    node: str
    reason: str
    # What caused it (the event's stimulus id); not part of what the instruction is.
    stimulus_id: str = field(default="", compare=False)


Event = NodeHeartbeat | Tick | Preempt | LinkFailed
Instruction = UpdateNode | EvictNode | DestroySandboxes | PreemptSandboxes | PreemptionFailed


class StoryEntry(NamedTuple):
    """What one stimulus did: its id, the event kind, the nodes it concerned (the event's
    node, or those a tick expired) and the kinds of the instructions it produced."""

    stimulus_id: str
    event: str
    nodes: tuple[str, ...]
    instructions: tuple[str, ...]


STORY_MAX = 10_000


@dataclass(frozen=True, slots=True, kw_only=True)
class WatcherConfig:
    """``ttl_s``: silence after which a node is expired (seconds; default 10, i.e. several
    missed heartbeats at the edge's 1-2 s interval). ``forget_s``: how long an expired
    node is remembered so that, if it returns, its evicted sandboxes are destroyed."""

    ttl_s: float = 10.0
    forget_s: float = 3600.0

    def __post_init__(self) -> None:
        if not self.ttl_s > 0 or not self.forget_s > 0:
            raise InvalidArgument(
                f"watcher ttl_s={self.ttl_s} and forget_s={self.forget_s} must be > 0")


def _check(ok: bool, broken: str) -> None:
    if not ok:
        raise AssertionError(f"watcher invariant broken: {broken}")


class _Node:
    __slots__ = ("doomed", "groups", "hb", "last_seen", "listed", "listed_of", "zombies")

    def __init__(self, hb: NodeHeartbeat) -> None:
        self.hb = hb
        self.last_seen = hb.time
        self.zombies: set[str] = set()      # evicted while the node was gone
        self.doomed: set[str] = set()       # chosen as preemption victims already
        # The ids and per-project counts of the sandbox tuple ``listed_of``: a heartbeat
        # carrying the very same tuple (the apiserver's light polls reuse the last full
        # list, see PlaneConfig.sandbox_list_interval_s) costs O(1), not O(sandboxes).
        self.listed_of: tuple[LiveSandbox, ...] | None = None
        self.listed: set[str] = set()
        self.groups: dict[str, int] = {}

    def index(self, sandboxes: tuple[LiveSandbox, ...]) -> set[str]:
        """The ids of ``sandboxes`` (cached while the same tuple comes back)."""
        if sandboxes is not self.listed_of:
            self.listed = {s.id for s in sandboxes}
            groups: dict[str, int] = {}
            for s in sandboxes:
                groups[s.project] = groups.get(s.project, 0) + 1
            self.groups = groups
            self.listed_of = sandboxes
        return self.listed


def choose_victims(
    sandboxes: tuple[LiveSandbox, ...] | list[LiveSandbox],
    *,
    free_cpu_milli: int,
    free_memory_bytes: int,
    free_slots: int | None,
    need: Preempt,
    skip: set[str] | frozenset[str] = frozenset(),
) -> list[LiveSandbox] | None:
    """Victims to free room for ``need``: paused first, then lowest priority, then
    youngest; only sandboxes of strictly lower priority. ``None`` if even all of them
    would not make room. Stops as soon as the request fits."""
    cpu, mem = free_cpu_milli, free_memory_bytes
    slots = free_slots

    def fits() -> bool:
        return (cpu >= need.cpu_milli and mem >= need.memory_bytes
                and (slots is None or slots >= 1))

    if fits():
        return []
    eligible = sorted((s for s in sandboxes if s.priority < need.priority and s.id not in skip),
                      key=lambda s: (not s.paused, s.priority, -s.created_at, s.id))
    victims = []
    for s in eligible:
        victims.append(s)
        cpu += s.cpu_milli
        mem += s.memory_bytes
        if slots is not None:
            slots += 1
        if fits():
            return victims
    return None


class Watcher:
    """Node liveness and preemption as a pure state machine."""

    def __init__(self, config: WatcherConfig | None = None) -> None:
        self.config = config or WatcherConfig()
        self._live: OrderedDict[str, _Node] = OrderedDict()   # receipt order
        self._expired: OrderedDict[str, tuple[float, _Node]] = OrderedDict()
        self._now = float("-inf")
        self._seq = 0
        #: What each recent stimulus did, oldest first (bounded: STORY_MAX entries).
        self.story: deque[StoryEntry] = deque(maxlen=STORY_MAX)

    def handle(self, *events: Event) -> list[Instruction]:
        out: list[Instruction] = []
        for ev in events:
            start = len(out)
            if isinstance(ev, NodeHeartbeat):
                sid = ev.stimulus_id or self._name("hb", ev.node)
                self._heartbeat(ev, sid, out)
                nodes: tuple[str, ...] = (ev.node,)
            elif isinstance(ev, Tick):
                sid = ev.stimulus_id or f"tick-{ev.now:.3f}"
                self._tick(ev.now, sid, out)
                nodes = tuple(i.node for i in out[start:] if isinstance(i, EvictNode))
            elif isinstance(ev, Preempt):
                sid = ev.stimulus_id or self._name("preempt", ev.node)
                self._preempt(ev, sid, out)
                nodes = (ev.node,)
            elif isinstance(ev, LinkFailed):
                sid = ev.stimulus_id or self._name("link", ev.node)
                self._link_failed(ev, sid, out)
                nodes = (ev.node,)
            else:
                raise InvalidArgument(f"watcher cannot handle {type(ev).__name__} events")
            self.story.append(StoryEntry(sid, type(ev).__name__, nodes,
                                         tuple(type(i).__name__ for i in out[start:])))
        return out

    def _name(self, kind: str, node: str) -> str:
        self._seq += 1
        return f"{kind}-{node}-{self._seq}"

    def story_of(self, node: str) -> list[StoryEntry]:
        """The stimuli (still in :attr:`story`) that concerned ``node``, oldest first."""
        return [e for e in self.story if node in e.nodes]

    def validate_state(self) -> None:
        """Check the watcher's invariants; AssertionError naming the one broken. For
        tests (run after every event there) and debugging, not the hot path. (Explicit
        raises, not ``assert``: it checks under ``python -O`` too.)"""
        live, expired = self._live, self._expired
        both = live.keys() & expired.keys()
        _check(not both, f"nodes both live and expired: {sorted(both)}")
        seen = [n.last_seen for n in live.values()]
        _check(all(a <= b for a, b in itertools.pairwise(seen)),
               "live nodes out of receipt order (a tick expires in O(expired) by it): "
               f"{[(k, n.last_seen) for k, n in live.items()]}")
        at = [t for t, _ in expired.values()]
        _check(all(a <= b for a, b in itertools.pairwise(at)),
               f"expired nodes out of expiry order: {[(k, t) for k, (t, _) in expired.items()]}")
        for name, node in live.items():
            _check(node.hb.node == name, f"node {name!r} holds the heartbeat of {node.hb.node!r}")
            listed = {s.id for s in node.hb.sandboxes}
            _check(node.zombies <= listed,
                   f"{name}: zombies {sorted(node.zombies - listed)} not in its last heartbeat")
            _check(node.doomed <= listed,
                   f"{name}: victims {sorted(node.doomed - listed)} not in its last heartbeat")
            _check(not node.doomed & node.zombies,
                   f"{name}: {sorted(node.doomed & node.zombies)} both victims and zombies")
            _check(node.last_seen <= self._now,
                   f"{name}: last seen at {node.last_seen} after the watcher's now {self._now}")

    # --- heartbeats -------------------------------------------------------------------
    def _heartbeat(self, hb: NodeHeartbeat, sid: str, out: list[Instruction]) -> None:
        self._now = max(self._now, hb.time)
        node = self._live.pop(hb.node, None)
        if node is None:
            back = self._expired.pop(hb.node, None)
            node = _Node(hb)
            if back is not None:
                # Everything it still runs was evicted while it was gone: nothing can have
                # been placed on an expired node, so every listed sandbox is a zombie.
                node.zombies = {s.id for s in hb.sandboxes}
        node.hb = hb
        node.last_seen = hb.time
        self._put_live(hb.node, node)
        listed = node.index(hb.sandboxes)
        if node.zombies:
            node.zombies &= listed
            if node.zombies:
                out.append(DestroySandboxes(hb.node, tuple(sorted(node.zombies)), "node_lost",
                                            stimulus_id=sid))
        if node.doomed:
            node.doomed &= listed
        out.append(UpdateNode(self._view(hb, node), stimulus_id=sid))

    @staticmethod
    def _view(hb: NodeHeartbeat, node: _Node) -> PlacementNode:
        node.index(hb.sandboxes)
        groups = node.groups
        if node.zombies:
            groups = {}
            for s in hb.sandboxes:
                if s.id not in node.zombies:
                    groups[s.project] = groups.get(s.project, 0) + 1
        return msgspec.structs.replace(hb.view, sandboxes=len(hb.sandboxes),
                                       groups=dict(groups))

    def _link_failed(self, ev: LinkFailed, sid: str, out: list[Instruction]) -> None:
        node = self._live.get(ev.node)
        if node is None:
            return  # never seen, or already expired: nothing to hold
        self._now = max(self._now, ev.time)
        if ev.time > node.last_seen:
            del self._live[ev.node]
            node.last_seen = ev.time
            self._put_live(ev.node, node)
        view = self._view(node.hb, node)
        out.append(UpdateNode(msgspec.structs.replace(view, healthy=False), stimulus_id=sid))

    def _put_live(self, name: str, node: _Node) -> None:
        """Append ``node`` (not in ``_live``) in receipt order. Times come from one clock
        and events in receipt order, so it goes last - unless that clock stepped back
        (``time.time`` can): then it is put in its place, so a silent node is never hidden
        behind one stamped later and the tick's early stop still holds (O(n), rare)."""
        live = self._live
        last = next(reversed(live.values()), None)
        live[name] = node
        if last is not None and last.last_seen > node.last_seen:
            self._live = OrderedDict(sorted(live.items(), key=lambda kv: kv[1].last_seen))

    # --- expiry -------------------------------------------------------------------------
    def _tick(self, now: float, sid: str, out: list[Instruction]) -> None:
        self._now = max(self._now, now)
        deadline = now - self.config.ttl_s
        live = self._live
        while live:
            name, node = next(iter(live.items()))
            if node.last_seen >= deadline:
                break
            del live[name]
            # stamped with the watcher's now (>= now): expiry order holds even if the
            # clock stepped back, and forget_s counts from the latest time known
            self._expired[name] = (self._now, node)
            out.append(EvictNode(name, tuple(sorted(s.id for s in node.hb.sandboxes)),
                                 stimulus_id=sid))
        forget_before = now - self.config.forget_s
        while self._expired:
            name, (at, _) = next(iter(self._expired.items()))
            if at >= forget_before:
                break
            del self._expired[name]

    # --- preemption ---------------------------------------------------------------------
    def _preempt(self, req: Preempt, sid: str, out: list[Instruction]) -> None:
        node = self._live.get(req.node)
        if node is None:
            out.append(PreemptionFailed(req.node, f"node {req.node!r} is not alive",
                                        stimulus_id=sid))
            return
        hb = node.hb
        v = hb.view
        free_cpu = v.cpu_milli_capacity - v.cpu_milli_used
        free_mem = v.memory_bytes_capacity - v.memory_bytes_used
        free_slots = None if v.max_sandboxes is None else v.max_sandboxes - len(hb.sandboxes)
        for s in hb.sandboxes:   # victims already chosen count as freed
            if s.id in node.doomed or s.id in node.zombies:
                free_cpu += s.cpu_milli
                free_mem += s.memory_bytes
                if free_slots is not None:
                    free_slots += 1
        victims = choose_victims(hb.sandboxes, free_cpu_milli=free_cpu,
                                 free_memory_bytes=free_mem, free_slots=free_slots, need=req,
                                 skip=node.doomed | node.zombies)
        if victims is None:
            out.append(PreemptionFailed(
                req.node,
                f"node {req.node!r} cannot make room for cpu_milli={req.cpu_milli}, "
                f"memory_bytes={req.memory_bytes} at priority {req.priority}: even evicting "
                "every lower-priority sandbox would not free enough", stimulus_id=sid))
            return
        if victims:
            node.doomed.update(v.id for v in victims)
            out.append(PreemptSandboxes(req.node, tuple(v.id for v in victims), req.priority,
                                        stimulus_id=sid))

    # --- introspection ------------------------------------------------------------------
    def views(self) -> list[PlacementNode]:
        """The current snapshot of live nodes (for a full placement resync)."""
        return [self._view(n.hb, n) for n in self._live.values()]

    def next_expiry(self) -> float | None:
        """When the next node expires if it stays silent (its last sign of life plus
        ``ttl_s``); None with no live node. O(1): nodes are kept in receipt order. The
        runner ticks at this time, so a node is lost ``ttl_s`` after it was last heard,
        not at the first tick after that."""
        for node in self._live.values():
            return node.last_seen + self.config.ttl_s
        return None

    def expiring(self, now: float) -> list[str]:
        """The nodes a :class:`Tick` at ``now`` would expire, oldest first (the runner
        checks whether a poll in flight has heard from one before it ticks)."""
        deadline = now - self.config.ttl_s
        out = []
        for name, node in self._live.items():
            if node.last_seen >= deadline:
                break
            out.append(name)
        return out

    def live_nodes(self) -> list[str]:
        return list(self._live)

    def zombies(self, node: str) -> frozenset[str]:
        """Sandboxes a returned node still runs that were evicted while it was gone
        (being destroyed; never to be recorded as live again)."""
        n = self._live.get(node)
        return frozenset(n.zombies) if n is not None and n.zombies else frozenset()

    def is_expired(self, node: str) -> bool:
        return node in self._expired
