"""Durable before acknowledged, checked on the journal file itself: what an answered
create, destroy, pause or resume changed is in ``sandboxes.jsonl`` the moment the call
returns (so a kill -9 the next instant keeps it), and a create's intent is there before
the backend starts. The kill -9 tests with real processes are in
tests/edge/container/test_durability.py."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import msgspec

from dsec.edge.backends.simulated import NodeLatencyProfile, SimulatedBackend
from dsec.edge.clock import FakeClock
from dsec.edge.journal import JOURNAL
from dsec.ids import SandboxId
from dsec.wire.spec import ExecRequest, SandboxSpec

from .conftest import make_node


def on_disk(state_dir: str) -> dict[str, tuple[str, str]]:
    """id -> (state, reason) as a restarted edge would read it right now."""
    out: dict[str, tuple[str, str]] = {}
    with open(os.path.join(state_dir, JOURNAL), "rb") as f:
        for line in f.read().splitlines():
            if line.strip():
                rec = msgspec.json.decode(line)
                if rec[0] == "put":
                    out[rec[1]] = (rec[2], "")
                elif rec[0] == "end":
                    out[rec[1]] = (rec[2], rec[6])
    return out


class IntentChecking(SimulatedBackend):
    """Records what the journal file said about a sandbox when its create began."""

    def __init__(self, state_dir: str, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.state_dir = state_dir
        self.seen: dict[str, tuple[str, str] | None] = {}

    async def create(self, sid: SandboxId, spec: SandboxSpec) -> None:
        self.seen[sid] = on_disk(self.state_dir).get(sid)
        await super().create(sid, spec)


async def test_every_answer_is_on_disk_when_it_returns(tmp_path) -> None:  # type: ignore[no-untyped-def]
    state = str(tmp_path / "state")
    clock = FakeClock()
    backend = IntentChecking(state, clock=clock)
    async with make_node(backend, clock=clock, state_dir=state) as node:
        a = await node.create(SandboxSpec())
        assert backend.seen[a.id] == ("creating", "")        # intent before acting
        assert on_disk(state)[a.id] == ("running", "")       # answered = on disk
        await node.pause(a.id)
        assert on_disk(state)[a.id] == ("paused", "")
        await node.resume(a.id)
        assert on_disk(state)[a.id] == ("running", "")
        final = await node.destroy(a.id, reason="evicted")
        assert final.state == "destroyed" and on_disk(state)[a.id] == ("destroyed", "evicted")
        # a batch shares its writes: 50 creates, each intent and running record on disk
        made = await node.create_many([SandboxSpec()] * 50)
        disk = on_disk(state)
        assert all(backend.seen[m.id] == ("creating", "") for m in made)  # type: ignore[union-attr]
        assert all(disk[m.id] == ("running", "") for m in made)  # type: ignore[union-attr]
        assert node.journal is not None and node.journal.syncs <= 4 + 2 * 3


async def test_unanswered_create_is_rolled_back_with_a_reason_at_restart(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The edge stops (here: the call is abandoned and the node closed without running the
    rollback, as a crash would) after the intent was recorded: the restarted node ends
    the sandbox as create_failed instead of forgetting it."""
    state = str(tmp_path / "state")
    clock = FakeClock()
    slow = SimulatedBackend(clock=clock, profile=NodeLatencyProfile(create_s=5.0))
    node = make_node(slow, clock=clock, state_dir=state)
    await node.start()
    task = asyncio.create_task(node.create(SandboxSpec(), sandbox_id="sb-0000000000aa-n1"))
    while clock.sleepers == 0:
        await asyncio.sleep(0)
    assert on_disk(state)["sb-0000000000aa-n1"] == ("creating", "")
    # what a kill -9 leaves: the journal as it is now (copied before any cleanup runs)
    snapshot = Path(state, JOURNAL).read_bytes()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await node.close()
    Path(state, JOURNAL).write_bytes(snapshot)
    async with make_node(clock=clock, state_dir=state) as node2:
        info = node2.get("sb-0000000000aa-n1")
        assert (info.state, info.reason) == ("destroyed", "create_failed")
        assert "edge stopped while creating" in node2.events(info.id)[-1].detail
        assert node2.live_count == 0


async def test_tombstones_answer_after_restart(tmp_path) -> None:  # type: ignore[no-untyped-def]
    state = str(tmp_path / "state")
    clock = FakeClock()
    async with make_node(clock=clock, state_dir=state) as node:
        a = await node.create(SandboxSpec(project="p"))
        await node.exec(a.id, ExecRequest(shell="true"))
        await node.destroy(a.id, reason="ttl")
    async with make_node(clock=clock, state_dir=state) as node2:
        info = node2.get(a.id)
        assert (info.state, info.reason, info.spec.project) == ("destroyed", "ttl", "p")
        assert node2.events(a.id)[-1].reason == "ttl"


async def test_tick_mode_answers_before_writing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The old mode, kept for scale tests: nothing is on disk when create returns."""
    state = str(tmp_path / "state")
    clock = FakeClock()
    async with make_node(clock=clock, state_dir=state, journal_sync="tick") as node:
        a = await node.create(SandboxSpec())
        assert a.id not in on_disk(state)
    async with make_node(clock=clock, state_dir=state, journal_sync="tick") as node2:
        assert node2.get(a.id).state == "running"  # close flushed it


async def test_a_journal_of_an_older_release_reads_its_omitted_defaults(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A spec's backend and project may now be left unset (None: the server decides),
    and specs are written with omitted defaults: a line an older release wrote without
    them meant "simulated" and "default". A restarted edge reads them so (and writes
    them out from then on), live sandboxes and tombstones alike."""
    state = str(tmp_path / "state")
    clock = FakeClock()
    async with make_node(clock=clock, state_dir=state) as node:
        live = await node.create(SandboxSpec())
        gone = await node.create(SandboxSpec())
        await node.destroy(gone.id)
    assert (live.spec.backend, live.spec.project) == ("simulated", "default")
    path = os.path.join(state, JOURNAL)
    lines = Path(path).read_bytes().splitlines()
    old = []
    for line in lines:                      # as the older release wrote them
        rec = msgspec.json.decode(line)
        spec = rec[3]
        if isinstance(spec, dict):
            assert spec.pop("backend") == "simulated" and spec.pop("project") == "default"
        old.append(msgspec.json.encode(rec))
    Path(path).write_bytes(b"\n".join(old) + b"\n")
    async with make_node(clock=clock, state_dir=state) as node2:
        for sid in (live.id, gone.id):
            spec = node2.get(sid).spec
            assert (spec.backend, spec.project) == ("simulated", "default"), sid
        assert [i.id for i in node2.list(project="default")] == [live.id]
        await node2.exec(live.id, ExecRequest(shell="true"))   # the tenant's exec share
