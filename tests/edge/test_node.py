"""EdgeNode behaviour over the simulated backend (fake clock, no real waiting)."""

from __future__ import annotations

import asyncio
import errno
import itertools

import pytest

from dsec.edge.admission import Capacity
from dsec.edge.backends.simulated import NodeLatencyProfile, SimulatedBackend
from dsec.edge.clock import FakeClock
from dsec.edge.journal import SandboxJournal
from dsec.edge.node import EdgeNode
from dsec.errors import (
    BackendError,
    CapacityExceeded,
    InUse,
    InvalidArgument,
    InvalidTransition,
    SandboxNotFound,
    WrongNode,
)
from dsec.wire.spec import ExecRequest, PauseStats, SandboxSpec

from .conftest import make_node


async def test_create_exec_files_destroy_with_events(node: EdgeNode) -> None:
    info = await node.create(SandboxSpec(labels={"team": "rl"}, project="org/a"))
    assert info.state == "running" and info.node == "n1" and info.id.endswith("-n1")
    r = await node.exec(info.id, ExecRequest(shell="echo hi > /tmp/a && cat /tmp/a; false"))
    assert (r.exit_code, r.stdout) == (1, b"hi\n")
    await node.write_file(info.id, "/workspace/x.txt", b"data")
    assert await node.read_file(info.id, "/workspace/x.txt", offset=1, length=2) == b"at"
    assert [f.name for f in await node.list_dir(info.id, "/workspace")] == ["x.txt"]
    assert node.list(labels={"team": "rl"})[0].id == info.id
    assert node.list(project="other") == []
    final = await node.destroy(info.id)
    assert final.state == "destroyed" and final.reason == "requested"
    evs = node.events(info.id)
    assert [(e.from_state, e.to_state) for e in evs] == [
        (None, "creating"), ("creating", "running"), ("running", "destroying"),
        ("destroying", "destroyed")]
    assert evs[-1].reason == "requested"
    assert node.pool.held == frozenset() and node.live_count == 0


async def test_bad_input_gets_typed_errors_and_creates_nothing(node: EdgeNode) -> None:
    backend = node.backends["simulated"]
    with pytest.raises(InvalidArgument, match="cpu_milli"):
        await node.create(SandboxSpec(cpu_milli=-5))
    with pytest.raises(InvalidArgument, match="memory_bytes"):
        await node.create(SandboxSpec(memory_bytes=2**62))
    with pytest.raises(InvalidArgument, match=r"isolation 'vm' \(backend 'vm'\) is not "
                       r"offered by node n1; offered: simulated \(container\)"):
        await node.create(SandboxSpec(backend="vm"))
    with pytest.raises(WrongNode):
        await node.create(SandboxSpec(), sandbox_id="sb-000000000001-other")
    assert node.live_count == 0 and node.pool.held == frozenset()
    assert backend.sandboxes == frozenset()  # type: ignore[attr-defined]
    with pytest.raises(SandboxNotFound, match="sb-000000000001-n1"):
        await node.exec("sb-000000000001-n1", ExecRequest(shell="true"))
    with pytest.raises(WrongNode, match="node n2"):
        await node.pause("sb-000000000001-n2")
    with pytest.raises(InvalidArgument, match="invalid sandbox id"):
        node.get("not-an-id")
    info = await node.create(SandboxSpec())
    for t in (0.0, -1.0):
        with pytest.raises(InvalidArgument, match="timeout_s"):
            await node.exec(info.id, ExecRequest(shell="true", timeout_s=t))
    with pytest.raises(InvalidArgument, match="destroy reason"):
        await node.destroy(info.id, reason="because")
    await node.destroy(info.id)
    for op in (node.exec(info.id, ExecRequest(shell="true")), node.pause(info.id),
               node.resume(info.id), node.destroy(info.id), node.read_file(info.id, "/x")):
        with pytest.raises(InvalidTransition, match="destroyed.*reason: requested"):
            await op
    assert node.get(info.id).state == "destroyed"


async def test_exactly_max_sandboxes_under_full_contention(clock: FakeClock) -> None:
    node = make_node(clock=clock,
                     capacity=Capacity(cpu_milli=10**6, memory_bytes=2**50, max_sandboxes=5))
    async with node:
        res = await node.create_many([SandboxSpec()] * 40)
        ok = [r for r in res if not isinstance(r, Exception)]
        errs = [r for r in res if isinstance(r, CapacityExceeded)]
        assert len(ok) == 5 and len(errs) == 35
        assert errs[0].detail["short"] == {"sandboxes": 1}
        assert node.pool.count == 5 and node.live_count == 5


class FaultyBackend(SimulatedBackend):
    """Fails at a chosen step; tracks what it holds so leaks are visible."""

    def __init__(self, fail: str, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.fail = fail
        self.destroy_fails = False

    async def create(self, sid, spec):  # type: ignore[no-untyped-def]
        if self.fail == "before":
            raise RuntimeError("disk on fire")
        await super().create(sid, spec)
        if self.fail == "after":  # resources allocated, then failure: must be cleaned up
            raise BackendError("mount failed after allocating")

    async def destroy(self, sid):  # type: ignore[no-untyped-def]
        if self.destroy_fails:
            raise RuntimeError("umount busy")
        await super().destroy(sid)


class FailingJournal(SandboxJournal):
    """A real journal whose second write fails (the running record, after the backend
    succeeded and the intent was written), as on a disk that just filled up."""

    def __init__(self, state_dir: str) -> None:
        super().__init__(state_dir)
        self.appends = 0

    def _append(self, data: bytes) -> None:
        self.appends += 1
        if self.appends == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        super()._append(data)


@pytest.mark.parametrize("step", ["before", "after", "journal", "cancel"])
async def test_failure_at_each_creation_step_leaks_nothing(step: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    clock = FakeClock()
    if step == "cancel":
        backend = SimulatedBackend(clock=clock, profile=NodeLatencyProfile(create_s=5.0))
    else:
        backend = FaultyBackend(step if step in ("before", "after") else "none", clock=clock)
    node = make_node(backend, clock=clock)
    if step == "journal":
        node.journal = FailingJournal(str(tmp_path))
    await node.start()
    try:
        if step == "cancel":
            task = asyncio.create_task(node.create(SandboxSpec()))
            while clock.sleepers == 0:
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            with pytest.raises((BackendError, RuntimeError, OSError)) as ei:
                await node.create(SandboxSpec())
            assert "BackendError" in type(ei.value).__name__
        assert node.live_count == 0
        assert node.pool.held == frozenset()
        assert backend.sandboxes == frozenset()
        feed = node.feed().events
        assert feed[-1].to_state == "failed" and feed[-1].reason == "create_failed"
        sid = feed[-1].sandbox_id
        with pytest.raises(InvalidTransition, match="failed"):
            await node.exec(sid, ExecRequest(shell="true"))
    finally:
        await node.close()


async def test_failed_cleanup_keeps_reservation_visible_until_destroyed() -> None:
    clock = FakeClock()
    backend = FaultyBackend("after", clock=clock)
    backend.destroy_fails = True
    async with make_node(backend, clock=clock) as node:
        with pytest.raises(BackendError):
            await node.create(SandboxSpec())
        [info] = node.list()
        assert info.state == "failed" and node.pool.count == 1
        backend.destroy_fails = False
        final = await node.destroy(info.id, reason="failed")
        assert final.state == "destroyed" and node.pool.count == 0


async def test_concurrent_operations_exactly_one_wins(clock: FakeClock) -> None:
    backend = SimulatedBackend(clock=clock, profile=NodeLatencyProfile(pause_s=4.0, destroy_s=1.0))
    async with make_node(backend, clock=clock) as node:
        info = await node.create(SandboxSpec())
        pause = asyncio.create_task(node.pause(info.id))
        await asyncio.sleep(0)
        with pytest.raises(InvalidTransition, match="cannot destroy while it is pausing"):
            await node.destroy(info.id)
        # a second pause is not a conflict: it waits for the first and succeeds (pause
        # and resume are idempotent; issue 18)
        again = asyncio.create_task(node.pause(info.id))
        await asyncio.sleep(0)
        assert not again.done()
        while clock.sleepers == 0:      # the backend's step runs as its own task
            await asyncio.sleep(0)
        clock.advance(4.0)
        await pause
        assert await again == PauseStats()
        assert node.get(info.id).state == "paused"
        d1 = asyncio.create_task(node.destroy(info.id))
        d2 = asyncio.create_task(node.destroy(info.id))
        while clock.sleepers == 0:
            await asyncio.sleep(0)
        clock.advance(1.0)
        res = await asyncio.gather(d1, d2, return_exceptions=True)
        assert sum(isinstance(r, InvalidTransition) for r in res) == 1
        assert node.get(info.id).state == "destroyed"


async def test_exec_on_paused_sandbox_resumes_it_once(clock: FakeClock) -> None:
    backend = SimulatedBackend(clock=clock, profile=NodeLatencyProfile(resume_s=1.0))
    async with make_node(backend, clock=clock) as node:
        info = await node.create(SandboxSpec())
        await node.write_file(info.id, "/tmp/keep", b"1")
        await node.pause(info.id)
        execs = [asyncio.create_task(node.exec(info.id, ExecRequest(shell="cat /tmp/keep")))
                 for _ in range(3)]
        reader = asyncio.create_task(node.read_file(info.id, "/tmp/keep"))
        while clock.sleepers == 0:
            await asyncio.sleep(0)
        clock.advance(1.0)
        assert [r.stdout for r in await asyncio.gather(*execs)] == [b"1"] * 3
        assert await reader == b"1"
        resumes = [e for e in node.events(info.id) if e.to_state == "resuming"]
        assert len(resumes) == 1 and resumes[0].reason == "auto_resume"
        assert node.get(info.id).state == "running"


async def test_ttl_and_idle_timeout_reaping(clock: FakeClock, node: EdgeNode) -> None:
    ttl = await node.create(SandboxSpec(ttl_s=10))
    idle_d = await node.create(SandboxSpec(idle_timeout_s=5))
    idle_p = await node.create(SandboxSpec(idle_timeout_s=5, idle_action="pause"))
    forever = await node.create(SandboxSpec())
    clock.advance(4)
    await node.exec(idle_d.id, ExecRequest(shell="true"))  # activity moves its deadline
    clock.advance(2)  # t=6
    acts = await node.reap()
    assert {(a.sandbox_id, a.action, a.reason) for a in acts} == {
        (idle_p.id, "pause", "idle")}
    assert node.get(idle_p.id).state == "paused"
    clock.advance(5)  # t=11
    acts = await node.reap()
    assert {(a.sandbox_id, a.reason) for a in acts} == {(ttl.id, "ttl"), (idle_d.id, "idle_timeout")}
    assert node.events(ttl.id)[-1].reason == "ttl"
    assert node.events(idle_d.id)[-1].reason == "idle_timeout"
    assert node.get(idle_p.id).state == "paused"
    assert {i.id for i in node.list()} == {idle_p.id, forever.id}
    assert await node.reap() == []


async def test_backend_reported_death_gets_a_final_event(clock: FakeClock) -> None:
    backend = SimulatedBackend(clock=clock)
    async with make_node(backend, clock=clock) as node:
        info = await node.create(SandboxSpec())
        backend.kill(info.id, "oom", "memory limit of 512 MiB hit")
        for _ in range(5):
            await asyncio.sleep(0)
        assert node.get(info.id).state == "destroyed"
        last = node.events(info.id)[-1]
        assert (last.reason, last.detail) == ("oom", "memory limit of 512 MiB hit")
        assert node.pool.count == 0


async def test_heartbeat_and_feed(clock: FakeClock) -> None:
    async with make_node(clock=clock, labels={"zone": "a"}, feed_size=6) as node:
        a = await node.create(SandboxSpec(image="py", priority=3, cpu_milli=250))
        b = await node.create(SandboxSpec(image="base"))
        await node.pause(b.id)
        hb = node.heartbeat()
        assert hb.node == "n1" and hb.labels == {"zone": "a"}
        assert hb.counts == {"running": 1, "paused": 1}
        assert hb.usage.cpu_milli == 1250 and hb.usage.sandboxes == 2
        assert hb.images == ["base", "py"] and hb.backends == ["simulated"]
        brief = {s.id: s for s in hb.sandboxes or []}
        assert (brief[a.id].priority, brief[a.id].cpu_milli, brief[a.id].state) == (3, 250, "running")
        assert node.heartbeat(include_sandboxes=False).sandboxes is None
        # 2 creates x 2 events + pause x 2 = 6 events, feed holds all 6
        f = node.feed(0, limit=4)
        assert len(f.events) == 4 and f.next == 4 and f.lost == 0
        f2 = node.feed(f.next)
        assert [e.to_state for e in f2.events] == ["pausing", "paused"] and f2.next == 6
        await node.destroy(a.id)  # 2 more events push the 2 oldest out
        f3 = node.feed(0)
        assert f3.lost == 2 and f3.events[0].to_state == "creating" and f3.next == 8
        assert node.feed(8).events == [] and node.feed(8).next == 8


async def test_event_log_is_bounded_and_keeps_birth(clock: FakeClock) -> None:
    async with make_node(clock=clock, events_per_sandbox=5) as node:
        info = await node.create(SandboxSpec())
        for _ in range(5):
            await node.pause(info.id)
            await node.resume(info.id)
        evs = node.events(info.id)
        assert len(evs) == 5 and evs[0].from_state is None and evs[-1].to_state == "running"


async def test_restart_adopts_what_the_journal_holds(tmp_path, clock: FakeClock) -> None:  # type: ignore[no-untyped-def]
    state = str(tmp_path / "state")
    async with make_node(clock=clock, state_dir=state) as node:
        a = await node.create(SandboxSpec(project="p"))
        b = await node.create(SandboxSpec(cpu_milli=300))
        c = await node.create(SandboxSpec())
        await node.pause(b.id)
        await node.destroy(c.id)
        with pytest.raises(InUse, match="locked by another edge"):
            make_node(clock=clock, state_dir=state).journal.open()  # type: ignore[union-attr]
    async with make_node(clock=clock, state_dir=state) as node2:
        assert {i.id: i.state for i in node2.list()} == {a.id: "running", b.id: "paused"}
        assert node2.pool.usage().cpu_milli == 1300
        assert node2.get(a.id).spec.project == "p"
        assert node2.events(a.id)[-1].reason == "adopted"
        r = await node2.exec(b.id, ExecRequest(shell="echo back"))  # transparent resume
        assert r.stdout == b"back\n"

    class Forgetful(SimulatedBackend):
        async def adopt(self, sid, spec):  # type: ignore[no-untyped-def]
            return False

    async with make_node(Forgetful(clock=clock), clock=clock, state_dir=state) as node3:
        assert node3.live_count == 0 and node3.pool.count == 0
        assert node3.get(a.id).state == "destroyed"
        assert node3.events(a.id)[-1].reason == "node_lost"
    async with make_node(clock=clock, state_dir=state) as node4:
        assert node4.live_count == 0  # node_lost records were removed from the journal


async def test_busy_sandbox_is_not_idle_and_destroy_during_exec_is_named(clock: FakeClock) -> None:
    async with make_node(clock=clock) as node:
        info = await node.create(SandboxSpec(idle_timeout_s=5))
        long = asyncio.create_task(node.exec(info.id, ExecRequest(shell="sleep 8; echo done")))
        while clock.sleepers == 0:
            await asyncio.sleep(0)
        clock.advance(6)
        assert await node.reap() == []  # a command is running: not idle
        clock.advance(2)  # t=8: the command finishes, activity restarts the idle clock
        assert (await long).stdout == b"done\n"
        clock.advance(4)
        assert await node.reap() == []
        clock.advance(2)
        assert [a.reason for a in await node.reap()] == ["idle_timeout"]
        other = await node.create(SandboxSpec())
        running = asyncio.create_task(node.exec(other.id, ExecRequest(shell="sleep 100")))
        while clock.sleepers == 0:
            await asyncio.sleep(0)
        await node.destroy(other.id, reason="evicted")
        clock.advance(100)
        with pytest.raises(InvalidTransition, match="destroyed \\(reason: evicted\\) while exec"):
            await running


async def test_death_reported_during_create_is_handled_after_it(clock: FakeClock) -> None:
    class DiesAtBirth(SimulatedBackend):
        async def create(self, sid, spec):  # type: ignore[no-untyped-def]
            await super().create(sid, spec)
            self.kill(sid, "exited", "init exited with status 1")

    async with make_node(DiesAtBirth(clock=clock), clock=clock) as node:
        info = await node.create(SandboxSpec())
        for _ in range(5):
            await asyncio.sleep(0)
        assert node.get(info.id).state == "destroyed"
        assert node.events(info.id)[-1].reason == "exited" and node.pool.count == 0


async def test_simulated_shell_reports_syntax_errors_and_unknown_commands(
        node: EdgeNode, clock: FakeClock) -> None:
    info = await node.create(SandboxSpec())
    r = await node.exec(info.id, ExecRequest(shell="echo 'unterminated"))
    assert r.exit_code == 2 and r.stderr.startswith(b"sh: syntax error")
    r = await node.exec(info.id, ExecRequest(shell="frobnicate"))
    assert r.exit_code == 127 and b"frobnicate: command not found" in r.stderr
    task = asyncio.create_task(node.exec(info.id, ExecRequest(shell="sleep 5", timeout_s=1)))
    while clock.sleepers == 0:
        await asyncio.sleep(0)
    clock.advance(1)
    r = await task
    assert (r.exit_code, r.timed_out) == (137, True)


@pytest.mark.parametrize("seed", range(5))
async def test_random_concurrent_operations_keep_invariants(seed: int) -> None:
    """Many overlapping operations with latencies: the books always balance."""
    import random

    from dsec.edge.lifecycle import FINAL_REASONS

    rnd = random.Random(seed)
    clock = FakeClock()
    backend = SimulatedBackend(clock=clock, profile=NodeLatencyProfile(
        create_s=0.3, destroy_s=0.2, pause_s=0.5, resume_s=0.4, exec_s=0.1))
    node = make_node(backend, clock=clock,
                     capacity=Capacity(cpu_milli=6000, memory_bytes=2**40, max_sandboxes=8))
    async with node:
        ids: list[str] = []
        tasks: list[asyncio.Task[object]] = []
        for _ in range(300):
            op = rnd.choice(["create", "create", "exec", "pause", "resume", "destroy"])
            if op == "create" or not ids:
                spec = SandboxSpec(cpu_milli=rnd.choice([500, 1000, 2000]))
                tasks.append(asyncio.create_task(node.create(spec)))
            else:
                sid = rnd.choice(ids)
                if op == "exec":
                    coro: object = node.exec(sid, ExecRequest(shell="echo x"))
                elif op == "pause":
                    coro = node.pause(sid)
                elif op == "resume":
                    coro = node.resume(sid)
                else:
                    coro = node.destroy(sid)
                tasks.append(asyncio.create_task(coro))  # type: ignore[arg-type]
            await asyncio.sleep(0)
            clock.advance(rnd.choice([0.0, 0.1, 0.25]))
            await asyncio.sleep(0)
            ids = [i.id for i in node.list()] or ids
        while not all(t.done() for t in tasks):
            clock.advance(0.5)
            await asyncio.sleep(0)
        kinds: set[str] = set()
        for t in tasks:
            exc = t.exception()
            assert exc is None or isinstance(exc, (InvalidTransition, CapacityExceeded)), exc
            kinds.add(type(exc).__name__ if exc else type(t.result()).__name__)
        # the run really exercised contention, conflicts, pauses, execs and destroys
        assert {"CapacityExceeded", "InvalidTransition", "PauseStats", "ExecResult",
                "SandboxInfo"} <= kinds, kinds
        assert any(e.reason == "auto_resume" for e in node.feed(0, limit=100_000).events)
        live = node.list()
        assert node.pool.held == {i.id for i in live}
        assert node.pool.usage().cpu_milli == sum(i.spec.cpu_milli for i in live)
        assert backend.sandboxes == {i.id for i in live}
        assert all(i.state in ("running", "paused") for i in live)
        for e in node.feed(0, limit=100_000).events:
            if e.to_state == "destroyed":
                assert e.reason in FINAL_REASONS
        for sid in {e.sandbox_id for e in node.feed(0, limit=100_000).events}:
            evs = node.events(sid)
            for a, b in itertools.pairwise(evs):
                assert a.to_state == b.from_state  # an unbroken chain of transitions
