"""Reconcile as a pure plan (dsec.control.reconcile): the registry against a heartbeat.

A hypothesis property drives random registries and heartbeats through plan_reconcile and
settle_probe with an edge oracle that agrees with the heartbeat (a sandbox missing from
it is gone, or the edge restarted without it), and listed sandboxes the registry does not
hold through settle_unknown with the store's records: carrying the steps out leaves the
node's registry exactly the heartbeat's live set (minus zombies, written-off sandboxes
and sandboxes the control plane has no record of, which are quarantined) plus the
records younger than the heartbeat. An oracle that fails to answer changes nothing.
Then the runner (ControlPlane._reconcile) with a fake edge link.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsec.control.api.plane import ControlPlane
from dsec.control.metrics import ApiMetrics
from dsec.control.reconcile import (
    GONE,
    DestroyWrittenOff,
    Forget,
    Probe,
    Quarantine,
    Record,
    RecordBrief,
    SetPaused,
    WriteOff,
    plan_reconcile,
    settle_probe,
    settle_unknown,
    split_listing,
)
from dsec.control.records import SandboxRecord
from dsec.control.registry import Registry
from dsec.control.store import StateStore
from dsec.errors import ConnectionLost, DsecError, SandboxNotFound
from dsec.wire.spec import SandboxInfo, SandboxSpec

HB = 100.0
IDS = [f"sb-{i:012d}" for i in range(8)]
STATES = ["running", "paused", "destroying", "destroyed", "failed"]


def info(sid: str, state: str, *, node: str = "n1", reason: str | None = None) -> SandboxInfo:
    return SandboxInfo(id=sid, node=node, state=state,  # type: ignore[arg-type]
                       spec=SandboxSpec(project="default"), created_at=1.0,
                       last_active_at=1.0, reason=reason)


@st.composite
def worlds(draw: st.DrawFn) -> dict[str, Any]:
    reg = {sid: RecordBrief(created_at=draw(st.sampled_from([HB - 10, HB + 10])),
                            paused=draw(st.booleans()))
           for sid in draw(st.sets(st.sampled_from(IDS)))}
    listed = {sid: draw(st.sampled_from(STATES)) for sid in draw(st.sets(st.sampled_from(IDS)))}
    zombies = draw(st.sets(st.sampled_from(sorted(listed)))) if listed else set()
    # tombstoned sandboxes were evicted from the registry when they were written off
    unregistered = [s for s in IDS if s not in reg]
    lost = draw(st.sets(st.sampled_from(unregistered))) if unregistered else set()
    # what the edge says of a sandbox missing from its heartbeat: gone, or unknown to it
    missing_answer = {sid: draw(st.sampled_from(["not_found", "destroyed"])) for sid in IDS}
    # the control plane's own records (the store's rows: another replica's creates)
    stored = draw(st.sets(st.sampled_from(IDS)))
    return {"reg": reg, "listed": listed, "zombies": zombies - lost, "lost": lost,
            "missing": missing_answer, "stored": stored}


def _oracle(world: dict[str, Any], probe: Probe, *, flaky: bool) -> SandboxInfo | DsecError:
    if flaky:
        return ConnectionLost("the link dropped")
    sid = probe.sandbox_id
    state = world["listed"].get(sid)
    if state is None or state in GONE:
        if world["missing"][sid] == "not_found" and state is None:
            return SandboxNotFound(f"no sandbox {sid}", sandbox_id=sid)
        return info(sid, state or "destroyed", reason="ttl")
    return info(sid, state)


def _apply(world: dict[str, Any], *, flaky: bool = False) -> tuple[dict[str, RecordBrief],
                                                                   list[str]]:
    reg: dict[str, RecordBrief] = dict(world["reg"])
    destroyed: list[str] = []
    world["quarantined"] = quarantined = set()
    steps = plan_reconcile(hb_time=HB, listed=world["listed"].items(), on_node=set(reg),
                           records=reg, zombies=world["zombies"], lost=world["lost"])
    for step in steps:
        if isinstance(step, DestroyWrittenOff):
            destroyed.extend(step.sandbox_ids)
        elif isinstance(step, SetPaused):
            reg[step.sandbox_id] = RecordBrief(reg[step.sandbox_id].created_at, step.paused)
        elif step.why == "unknown":
            sid = step.sandbox_id
            row = (SandboxRecord(id=sid, node="n1", project="default", created_at=1.0)
                   if sid in world["stored"] else None)
            done = settle_unknown(sid, row, node="n1",
                                  paused=world["listed"][sid] == "paused", lost=world["lost"])
            if isinstance(done, Record):
                assert done.record.id not in reg
                reg[sid] = RecordBrief(HB, done.record.paused)
            elif isinstance(done, Quarantine):
                quarantined.add(sid)
        else:
            done = settle_probe(step, _oracle(world, step, flaky=flaky), node="n1",
                                lost=world["lost"])
            if isinstance(done, (WriteOff, Forget)):
                del reg[done.sandbox_id]
            assert not isinstance(done, (Record, Quarantine))
    return reg, destroyed


@given(worlds())
def test_applying_the_plan_leaves_the_heartbeats_live_set(world: dict[str, Any]) -> None:
    reg, destroyed = _apply(world)
    listed, zombies, lost, before = world["listed"], world["zombies"], world["lost"], world["reg"]
    live = {sid for sid, state in listed.items()
            if state not in GONE and sid not in zombies and sid not in lost}
    younger = {sid for sid, r in before.items() if r.created_at >= HB}
    # a zombie the registry still holds is the watcher's to destroy; the plan leaves it
    kept_zombies = {sid for sid in before if sid in zombies and listed[sid] not in GONE}
    # listed, live, unknown to the registry and to the store: held aside, never recorded
    ghosts = live - set(before) - world["stored"]
    assert set(reg) == (live - ghosts) | younger | kept_zombies, (world, reg)
    assert world["quarantined"] == ghosts
    assert sorted(destroyed) == sorted(s for s, st_ in listed.items()
                                       if s in lost and st_ not in GONE and s not in zombies)
    for sid in live & set(before):
        if listed[sid] in ("running", "paused"):
            assert reg[sid].paused == (listed[sid] == "paused")


@given(worlds())
def test_an_edge_that_does_not_answer_changes_nothing_it_was_asked(
        world: dict[str, Any]) -> None:
    reg, _ = _apply(world, flaky=True)
    listed, zombies, lost = world["listed"], world["zombies"], world["lost"]
    # nothing written off or forgotten; only what the store records is recorded (the
    # edge is not asked about those)
    adopted = {sid for sid, state in listed.items()
               if state not in GONE and sid not in zombies and sid not in lost
               and sid not in world["reg"] and sid in world["stored"]}
    assert set(reg) == set(world["reg"]) | adopted


def test_plan_examples() -> None:
    reg = {"old": RecordBrief(HB - 1, False), "young": RecordBrief(HB + 1, False),
           "here": RecordBrief(HB - 1, False)}
    steps = plan_reconcile(
        hb_time=HB, listed=[("here", "paused"), ("new", "running"), ("dead", "destroyed"),
                            ("ghost", "running"), ("zombie", "running")],
        on_node=set(reg), records=reg, zombies={"zombie"}, lost={"ghost"})
    assert steps == [DestroyWrittenOff(("ghost",)), Probe("old", "missing"),
                     SetPaused("here", True), Probe("new", "unknown")]
    gone = settle_probe(Probe("old", "missing"), SandboxNotFound("no"), node="n1", lost=set())
    assert isinstance(gone, WriteOff) and "node n1 no longer has it" in gone.detail
    assert settle_probe(Probe("old", "missing"), info("old", "destroyed", reason="ttl"),
                        node="n1", lost=set()) == Forget("old", "ttl")
    assert settle_probe(Probe("old", "missing"), ConnectionLost("x"), node="n1",
                        lost=set()) is None
    # an unknown sandbox is the control plane's records' to settle, not the edge's
    assert settle_probe(Probe("new", "unknown"), info("new", "running"), node="n1",
                        lost=set()) is None
    row = SandboxRecord(id="new", node="n1", project="p", created_at=1.0)
    assert settle_unknown("new", row, node="n1", paused=True, lost=set()) == Record(
        SandboxRecord(id="new", node="n1", project="p", created_at=1.0, paused=True))
    assert settle_unknown("new", None, node="n1", paused=False, lost=set()) == Quarantine("new")
    assert settle_unknown("new", row, node="n2", paused=False, lost=set()) == Quarantine("new")
    assert settle_unknown("new", row, node="n1", paused=False, lost={"new"}) is None


def test_split_listing_keeps_only_the_nodes_own_ids() -> None:
    own, foreign = split_listing("n1", ["sb-0123456789ab-n1", "sb-0123456789ab-n10",
                                        "sb-0123456789ab-n2", "junk", "sb-xyz-n1"])
    assert own == ["sb-0123456789ab-n1"]
    assert foreign == ["sb-0123456789ab-n10", "sb-0123456789ab-n2", "junk", "sb-xyz-n1"]


class _Link:
    """An edge link that answers get() from a table, counting calls in flight."""

    def __init__(self, table: dict[str, SandboxInfo | DsecError]) -> None:
        self.table = table
        self.destroyed: list[tuple[list[str], str]] = []
        self.in_flight = self.most = 0

    async def get(self, sid: str) -> SandboxInfo:
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        await asyncio.sleep(0)
        self.in_flight -= 1
        r = self.table[sid]
        if isinstance(r, DsecError):
            raise r
        return r

    async def destroy_many(self, ids: list[str], *, reason: str) -> None:
        self.destroyed.append((ids, reason))


class _Hb:
    def __init__(self, time: float, sandboxes: list[tuple[str, str]]) -> None:
        self.time = time
        self.sandboxes = [type("B", (), {"id": i, "state": s})() for i, s in sandboxes]


async def test_the_runner_probes_at_once_and_settles(store: StateStore) -> None:
    plane = ControlPlane.open(store, metrics=ApiMetrics())
    old, young, kept = (f"sb-{i:012x}-n1" for i in (1, 2, 3))
    for sid, created in ((old, HB - 5), (young, HB + 5), (kept, HB - 5)):
        plane.registry.add_sandbox(SandboxRecord(id=sid, node="n1", project="default",
                                                 created_at=created))
    missing = [f"sb-{i:012x}-n1" for i in range(100, 400)]
    for sid in missing:
        plane.registry.add_sandbox(SandboxRecord(id=sid, node="n1", project="default",
                                                 created_at=HB - 5))
    plane.registry.flush()
    # another replica over the same store created half of the new ones
    news = [f"sb-{i:012x}-n1" for i in range(1000, 1040)]
    other = Registry(store, clock=lambda: HB)
    for sid in news[::2]:
        other.add_sandbox(SandboxRecord(id=sid, node="n1", project="p/x", created_at=HB))
    other.flush()
    link = _Link({old: SandboxNotFound("no"),
                  **{m: info(m, "destroyed", reason="ttl") for m in missing}})
    e = type("E", (), {"node": "n1"})()
    await plane._reconcile(e, link, _Hb(HB, [(kept, "running"),
                                            *((n, "running") for n in news)]))
    plane.registry.flush()
    assert plane.registry.ids_on("n1") == {young, kept, *news[::2]}
    assert {plane.registry.sandbox(n).project for n in news[::2]} == {"p/x"}
    assert plane.quarantined("n1") == sorted(news[1::2])   # no record: not charged
    assert plane.lost(old) is not None            # written off, with a tombstone
    assert link.most > 1                          # probes went out together ...
    assert link.most <= 256                       # ... in bounded chunks


@pytest.mark.parametrize("state", sorted(GONE))
def test_gone_states_are_not_listed_as_alive(state: str) -> None:
    steps = plan_reconcile(hb_time=HB, listed=[("x", state)], on_node=set(), records={},
                           zombies=set(), lost={"x"})
    assert steps == []
