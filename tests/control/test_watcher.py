from __future__ import annotations

import dataclasses
import random

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from dsec.control.placement import Placement, PlacementNode, PlacementRequest
from dsec.control.quota import QuotaIndex
from dsec.control.records import SandboxRecord
from dsec.control.registry import Registry
from dsec.control.store import StateStore
from dsec.control.watcher import (
    DestroySandboxes,
    EvictNode,
    LinkFailed,
    LiveSandbox,
    NodeHeartbeat,
    Preempt,
    PreemptionFailed,
    PreemptSandboxes,
    Tick,
    UpdateNode,
    Watcher,
    WatcherConfig,
    choose_victims,
    link_failure_cause,
)
from dsec.errors import (
    ConnectionLost,
    InternalError,
    InvalidArgument,
    LocalProtocolError,
    Overloaded,
    RequestTimeout,
)

from .conftest import FakeClock

GiB = 1 << 30


def sb(name: str, node: str = "n1", *, prio: int = 0, created: float = 0.0,
       paused: bool = False, cpu: int = 1000, mem: int = GiB,
       project: str = "org/a") -> LiveSandbox:
    return LiveSandbox(id=f"sb-{name:0>12}-{node}", project=project, cpu_milli=cpu,
                       memory_bytes=mem, priority=prio, created_at=created, paused=paused)


def hb(node: str, t: float, sandboxes: tuple[LiveSandbox, ...] = (), *,
       cpu: int = 8000, mem: int = 32 * GiB, max_sandboxes: int | None = None) -> NodeHeartbeat:
    return NodeHeartbeat(time=t, sandboxes=sandboxes, view=PlacementNode(
        node=node, cpu_milli_capacity=cpu, memory_bytes_capacity=mem,
        cpu_milli_used=sum(s.cpu_milli for s in sandboxes),
        memory_bytes_used=sum(s.memory_bytes for s in sandboxes), max_sandboxes=max_sandboxes))


def test_next_expiry_is_the_oldest_nodes_deadline_and_expiring_what_a_tick_takes() -> None:
    """The plane's expiry timer sleeps until next_expiry() and ticks then, so a node is
    lost ttl_s after its last sign of life, not at the next poll round."""
    w = Watcher(WatcherConfig(ttl_s=3.0))
    assert w.next_expiry() is None
    w.handle(hb("n1", 1.0), hb("n2", 2.0))
    assert w.next_expiry() == 4.0
    assert w.expiring(4.0) == [] and w.expiring(4.01) == ["n1"]
    assert w.expiring(5.5) == ["n1", "n2"]
    w.handle(LinkFailed(node="n1", time=4.0, cause="answered"))   # held: seen at 4.0
    assert w.next_expiry() == 5.0 and w.expiring(5.5) == ["n2"]
    assert w.handle(Tick(5.01)) == [EvictNode("n2", ())]
    assert w.next_expiry() == 7.0


def test_heartbeat_updates_the_placement_view() -> None:
    w = Watcher()
    out = w.handle(hb("n1", 0.0, (sb("1"), sb("2", project="org/b"), sb("3"))))
    assert len(out) == 1 and isinstance(out[0], UpdateNode)
    v = out[0].view
    assert (v.node, v.cpu_milli_used, v.sandboxes, v.groups) == (
        "n1", 3000, 3, {"org/a": 2, "org/b": 1})
    assert w.views() == [v]


def test_silent_node_expires_after_ttl_only() -> None:
    w = Watcher(WatcherConfig(ttl_s=5.0))
    w.handle(hb("n1", 0.0, (sb("1"),)), hb("n2", 3.0))
    assert w.handle(Tick(5.0)) == []
    assert w.handle(hb("n1", 4.0, (sb("1"), sb("2")))) != []
    assert w.handle(Tick(8.5)) == [EvictNode("n2", ())]
    assert w.handle(Tick(9.5)) == [EvictNode("n1", (sb("1").id, sb("2").id))]
    assert w.live_nodes() == [] and w.is_expired("n1")


def test_node_loss_end_to_end_with_registry_quota_and_placement(
        store: StateStore, clock: FakeClock) -> None:
    """The runner's loop: watcher instructions applied to placement and the registry."""
    quota = QuotaIndex()
    reg = Registry(store, clock=clock, quota=quota)
    place = Placement(rng=random.Random(0))
    w = Watcher(WatcherConfig(ttl_s=10.0))

    def run(*events: object) -> list[object]:
        out = w.handle(*events)  # type: ignore[arg-type]
        for ins in out:
            if isinstance(ins, UpdateNode):
                place.update(ins.view)
            elif isinstance(ins, EvictNode):
                place.remove(ins.node)
                reg.evict_node(ins.node, reason=ins.reason)
        reg.flush()
        return out

    live = (sb("1"), sb("2"))
    for s in live:
        reg.add_sandbox(SandboxRecord(id=s.id, node="n1", project=s.project,
                                      cpu_milli=s.cpu_milli, memory_bytes=s.memory_bytes))
    run(hb("n1", 0.0, live), hb("n2", 0.0))
    start = reg.flush()
    run(hb("n2", 9.0))
    run(Tick(10.5))
    evs = reg.read(start)
    assert [(e.kind, e.sandbox_id, e.payload["reason"]) for e in evs] == [
        ("sandbox_removed", live[0].id, "node_lost"), ("sandbox_removed", live[1].id, "node_lost")]
    assert quota.usage("org").sandboxes == 0
    assert place.nodes() == ["n2"]
    for _ in range(5):
        assert place.place(PlacementRequest(cpu_milli=100, memory_bytes=GiB)).node == "n2"

    # n1 comes back still running its evicted sandboxes: told to destroy them, and it
    # gets no registry entries back.
    out = run(hb("n1", 12.0, live))
    assert DestroySandboxes("n1", (live[0].id, live[1].id), "node_lost") in out
    assert reg.sandboxes_on("n1") == []
    # repeated until the node reports them gone, then no more
    assert any(isinstance(i, DestroySandboxes) for i in run(hb("n1", 13.0, live[:1])))
    out = run(hb("n1", 14.0, (sb("9"),)))
    assert not any(isinstance(i, DestroySandboxes) for i in out)


def test_expired_nodes_are_forgotten_after_forget_s() -> None:
    w = Watcher(WatcherConfig(ttl_s=1.0, forget_s=10.0))
    w.handle(hb("n1", 0.0, (sb("1"),)), Tick(2.0))
    w.handle(Tick(13.0))
    assert not w.is_expired("n1")
    out = w.handle(hb("n1", 14.0, (sb("1"),)))
    assert [type(i) for i in out] == [UpdateNode]


def test_preemption_order_paused_then_lowest_priority_then_youngest() -> None:
    live = (
        sb("old-lo", prio=1, created=1.0),
        sb("young-lo", prio=1, created=5.0),
        sb("paused-hi", prio=5, created=2.0, paused=True),
        sb("lo0", prio=0, created=3.0),
        sb("equal", prio=9, created=9.0, paused=True),   # not lower than the request
    )
    got = choose_victims(live, free_cpu_milli=0, free_memory_bytes=0, free_slots=None,
                         need=Preempt("n1", 3500, GiB, priority=9))
    assert got is not None
    assert [v.id for v in got] == [sb("paused-hi").id, sb("lo0").id, sb("young-lo").id,
                                   sb("old-lo").id]
    assert choose_victims(live, free_cpu_milli=0, free_memory_bytes=0, free_slots=None,
                          need=Preempt("n1", 1000, GiB, priority=9)) == [live[2]]
    assert choose_victims(live, free_cpu_milli=0, free_memory_bytes=0, free_slots=None,
                          need=Preempt("n1", 99000, GiB, priority=9)) is None


def test_preempt_through_handle_does_not_pick_the_same_victim_twice() -> None:
    w = Watcher()
    live = (sb("a", prio=0, created=1.0), sb("b", prio=0, created=2.0))
    w.handle(hb("n1", 0.0, live, cpu=2000, mem=2 * GiB))
    first = w.handle(Preempt("n1", 1000, GiB, priority=5))
    second = w.handle(Preempt("n1", 1000, GiB, priority=5))
    assert first == [PreemptSandboxes("n1", (live[1].id,), 5)]
    # the first victim's room is counted as freed already; the second request needs more
    assert second == []
    third = w.handle(Preempt("n1", 2000, GiB, priority=5))
    assert third == [PreemptSandboxes("n1", (live[0].id,), 5)]
    assert isinstance(w.handle(Preempt("n1", 3000, GiB, priority=9))[0], PreemptionFailed)
    assert isinstance(w.handle(Preempt("ghost", 1, 1, priority=9))[0], PreemptionFailed)


def test_slot_limit_preemption_and_bad_input() -> None:
    got = choose_victims((sb("x", prio=0),), free_cpu_milli=10**6, free_memory_bytes=10**12,
                         free_slots=0, need=Preempt("n1", 1, 1, priority=1))
    assert got is not None and len(got) == 1
    with pytest.raises(InvalidArgument, match="ttl_s"):
        WatcherConfig(ttl_s=0)
    with pytest.raises(InvalidArgument, match="cannot handle"):
        Watcher().handle("nonsense")  # type: ignore[arg-type]


def test_a_node_this_side_cannot_reach_is_held_not_expired() -> None:
    """Issue 12: an apiserver out of file descriptors could not poll its own edge and
    wrote it off. Only silence counts toward the TTL; a failed poll that was this side's
    fault (blind) or that the node answered (answered) holds the node out of placement."""
    w = Watcher(WatcherConfig(ttl_s=5.0))
    w.handle(hb("n1", 0.0, (sb("1"),)), hb("n2", 0.0, (sb("2", node="n2"),)))
    out = w.handle(LinkFailed(node="n1", time=4.0, cause="blind", detail="EMFILE"))
    assert [type(i) for i in out] == [UpdateNode]
    assert out[0].view.node == "n1" and out[0].view.healthy is False
    out = w.handle(LinkFailed(node="n1", time=8.0, cause="answered"), Tick(9.0))
    # n2 was silent for 9 s and is lost; n1 was held at 8.0 and is not
    assert [i.node for i in out if isinstance(i, EvictNode)] == ["n2"]
    assert w.live_nodes() == ["n1"]
    assert w.handle(Tick(12.9)) == []
    # held nodes still expire once they fall silent for a whole TTL
    assert [type(i) for i in w.handle(Tick(13.1))] == [EvictNode]
    # a failure on a node already expired (or never seen) changes nothing
    assert w.handle(LinkFailed(node="n1", time=14.0, cause="blind")) == []
    assert w.handle(LinkFailed(node="n9", time=14.0, cause="blind")) == []
    assert w.is_expired("n1")


@pytest.mark.parametrize(("exc", "cause"), [
    (ConnectionLost("could not connect: Too many open files", errno=24, local=True), "blind"),
    (LocalProtocolError("cannot encode"), "blind"),
    (Overloaded("refused: listener at its limit"), "answered"),
    (InternalError("OSError: [Errno 24] Too many open files"), "answered"),
    (InvalidArgument("body does not decode"), "answered"),
    (ConnectionLost("could not connect: Connection refused", errno=111, local=False),
     "silent"),
    (ConnectionLost("connection closed by peer"), "silent"),
    (RequestTimeout("no reply within 5s"), "silent"),
])
def test_link_failure_cause(exc: Exception, cause: str) -> None:
    assert link_failure_cause(exc) == cause  # type: ignore[arg-type]


# ------------------------------------------------- stimuli, story, validate_state (C4)


def test_instructions_carry_their_stimulus_and_the_story_tells_it() -> None:
    w = Watcher(WatcherConfig(ttl_s=5.0))
    live = (sb("1"), sb("2"))
    [up] = w.handle(hb("n1", 0.0, live))
    assert up.stimulus_id == "hb-n1-1"               # named by the watcher when not given
    [evict] = w.handle(Tick(6.0, stimulus_id="tick-A"))
    assert evict == EvictNode("n1", (live[0].id, live[1].id))   # provenance not compared
    assert evict.stimulus_id == "tick-A"
    back = w.handle(NodeHeartbeat(time=7.0, sandboxes=live, view=hb("n1", 7.0).view,
                                  stimulus_id="hb-B"))
    assert {i.stimulus_id for i in back} == {"hb-B"}
    assert [(e.stimulus_id, e.event, e.instructions) for e in w.story_of("n1")] == [
        ("hb-n1-1", "NodeHeartbeat", ("UpdateNode",)),
        ("tick-A", "Tick", ("EvictNode",)),
        ("hb-B", "NodeHeartbeat", ("DestroySandboxes", "UpdateNode")),
    ]
    w.validate_state()


def test_validate_state_names_a_broken_invariant() -> None:
    w = Watcher()
    w.handle(hb("n1", 0.0, (sb("1"),)), hb("n2", 1.0))
    w.validate_state()
    w._live.move_to_end("n1")           # n1 (seen at 0) now after n2 (seen at 1)
    with pytest.raises(AssertionError, match="out of receipt order"):
        w.validate_state()
    w._live.move_to_end("n2")
    w._live["n1"].zombies.add("sb-not-listed")
    with pytest.raises(AssertionError, match="zombies .* not in its last heartbeat"):
        w.validate_state()


NODES = ("n1", "n2", "n3")
POOL = {n: tuple(sb(str(i), n, prio=i % 3, created=float(i), paused=i == 4,
                    cpu=500, mem=GiB // 2) for i in range(6)) for n in NODES}


class WatcherMachine(RuleBasedStateMachine):
    """Random heartbeats, ticks, link failures and preemptions; the watcher's invariants
    hold after every event, every instruction names the stimulus that caused it, and a
    node is expired only after ttl_s of silence."""

    def __init__(self) -> None:
        super().__init__()
        self.w = Watcher(WatcherConfig(ttl_s=5.0, forget_s=30.0))
        self.now = 0.0
        self.n = 0
        self.seen: dict[str, float] = {}      # node -> when it was last heard (model)

    def _handle(self, ev: object) -> list[object]:
        self.n += 1
        sid = f"s{self.n}" if self.n % 2 else ""     # half named by the runner
        ev = dataclasses.replace(ev, stimulus_id=sid) if dataclasses.is_dataclass(ev) \
            else msgspec.structs.replace(ev, stimulus_id=sid)  # type: ignore[type-var]
        out = self.w.handle(ev)  # type: ignore[arg-type]
        self.w.validate_state()
        last = self.w.story[-1]
        assert last.event == type(ev).__name__
        assert last.instructions == tuple(type(i).__name__ for i in out)
        assert (last.stimulus_id == sid) if sid else last.stimulus_id
        assert all(i.stimulus_id == last.stimulus_id for i in out)  # type: ignore[attr-defined]
        return out  # type: ignore[return-value]

    @rule(node=st.sampled_from(NODES), dt=st.floats(0, 4), keep=st.sets(st.integers(0, 5)))
    def heartbeat(self, node: str, dt: float, keep: set[int]) -> None:
        self.now += dt
        sbs = tuple(s for i, s in enumerate(POOL[node]) if i in keep)
        self._handle(hb(node, self.now, sbs, cpu=2000, mem=2 * GiB, max_sandboxes=5))
        self.seen[node] = self.now

    @rule(back=st.floats(0.1, 6))
    def clock_steps_back(self, back: float) -> None:
        """The runner's wall clock (time.time) jumps back: later events carry earlier
        times. Nodes silent longer than ttl_s by the ticks' clock still expire."""
        self.now -= back

    @rule(dt=st.floats(0, 8))
    def tick(self, dt: float) -> None:
        self.now += dt
        out = self._handle(Tick(self.now))
        for ins in out:
            if isinstance(ins, EvictNode):
                assert self.seen[ins.node] < self.now - 5.0, (ins.node, self.seen, self.now)
                del self.seen[ins.node]
        for node, at in self.seen.items():
            assert at >= self.now - 5.0, f"{node} silent since {at}, not expired at {self.now}"

    @rule(node=st.sampled_from(NODES), cause=st.sampled_from(["answered", "blind"]))
    def link_failed(self, node: str, cause: str) -> None:
        out = self._handle(LinkFailed(node=node, time=self.now, cause=cause))  # type: ignore[arg-type]
        if node in self.seen:
            self.seen[node] = max(self.seen[node], self.now)
            assert [type(i) for i in out] == [UpdateNode] and not out[0].view.healthy  # type: ignore[attr-defined]
        else:
            assert out == []

    @rule(node=st.sampled_from(NODES), prio=st.integers(0, 4), cpu=st.integers(0, 2500))
    def preempt(self, node: str, prio: int, cpu: int) -> None:
        out = self._handle(Preempt(node=node, cpu_milli=cpu, memory_bytes=0, priority=prio))
        for ins in out:
            if isinstance(ins, PreemptSandboxes):
                assert node in self.seen
                assert all(int(v[3:15]) % 3 < prio for v in ins.sandbox_ids)


TestWatcherMachine = WatcherMachine.TestCase
TestWatcherMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
