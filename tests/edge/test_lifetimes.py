"""Lifetimes (issue 19): set_timeout/extend, the TTL clock stopped while paused, the idle
pause's reason, and the deadline's durability across an edge restart (fake clock)."""

from __future__ import annotations

import pytest

from dsec.edge.clock import FakeClock
from dsec.edge.lifecycle import moved_lifetime
from dsec.edge.node import EdgeNode
from dsec.errors import InvalidArgument, InvalidTransition
from dsec.wire.lifetime import SetTimeout
from dsec.wire.spec import MAX_TTL_S, PAUSED_RETENTION_S, ExecRequest, SandboxSpec

from .conftest import make_node


async def test_a_paused_sandbox_is_not_reaped_for_its_ttl(clock: FakeClock,
                                                          node: EdgeNode) -> None:
    """Repro of issue 19: a sandbox paused with ttl=4 was destroyed (reason ttl) while
    paused. Its clock stops at the pause and runs again from the resume."""
    info = await node.create(SandboxSpec(ttl_s=4))
    assert info.expires_at == pytest.approx(clock.time() + 4)
    clock.advance(1)
    await node.pause(info.id)
    paused = node.get(info.id)
    assert paused.expires_at is None and paused.ttl_left_s == pytest.approx(3)
    assert paused.paused_reason == "requested"
    clock.advance(60)
    assert await node.reap() == []
    assert node.get(info.id).state == "paused"
    resumed = await node.resume(info.id)
    assert resumed.expires_at == pytest.approx(clock.time() + 3)
    assert resumed.ttl_left_s is None and resumed.paused_reason == ""
    clock.advance(2.9)
    assert await node.reap() == []
    clock.advance(0.2)
    assert [(a.sandbox_id, a.reason) for a in await node.reap()] == [(info.id, "ttl")]
    assert node.get(info.id).reason == "ttl"


async def test_an_exec_that_resumes_a_paused_sandbox_restarts_its_clock(
        clock: FakeClock, node: EdgeNode) -> None:
    info = await node.create(SandboxSpec(ttl_s=10))
    await node.pause(info.id)
    clock.advance(100)
    await node.exec(info.id, ExecRequest(shell="true"))   # resumes it transparently
    got = node.get(info.id)
    assert got.state == "running" and got.expires_at == pytest.approx(clock.time() + 10)


async def test_set_timeout_and_extend(clock: FakeClock, node: EdgeNode) -> None:
    info = await node.create(SandboxSpec(ttl_s=100))
    t0 = clock.time()
    got = await node.set_timeout(info.id, 5)
    assert got.expires_at == pytest.approx(t0 + 5)           # shortened, not only longer
    got = await node.set_timeout(info.id, 10, extend=True)
    assert got.expires_at == pytest.approx(t0 + 15)
    assert node.events(info.id)[-1].reason == "timeout_set"
    clock.advance(14)
    assert await node.reap() == []
    clock.advance(1)
    assert [a.reason for a in await node.reap()] == ["ttl"]
    # no TTL at all: set_timeout gives one, extend from now
    forever = await node.create(SandboxSpec())
    assert forever.expires_at is None
    got = await node.set_timeout(forever.id, 7, extend=True)
    assert got.expires_at == pytest.approx(clock.time() + 7)
    # paused: sets the time left, which runs from the resume
    await node.pause(forever.id)
    got = await node.set_timeout(forever.id, 30)
    assert got.expires_at is None and got.ttl_left_s == pytest.approx(30)
    got = await node.set_timeout(forever.id, 5, extend=True)
    assert got.ttl_left_s == pytest.approx(35)
    clock.advance(1000)
    assert await node.reap() == []
    assert (await node.resume(forever.id)).expires_at == pytest.approx(clock.time() + 35)
    await node.destroy(forever.id)
    with pytest.raises(InvalidTransition, match="destroyed \\(reason: requested\\)"):
        await node.set_timeout(forever.id, 5)


def test_lifetime_is_capped_and_the_request_validates() -> None:
    exp, left = moved_lifetime(1000.0 + MAX_TTL_S - 1, None, stopped=False, now=1000.0,
                               timeout_s=MAX_TTL_S, extend=True, cap_s=MAX_TTL_S)
    assert (exp, left) == (1000.0 + MAX_TTL_S, None)
    for bad in (0, -1.0, MAX_TTL_S + 1, float("nan")):
        with pytest.raises(InvalidArgument, match="timeout_s"):
            SetTimeout(id="sb-000000000001-n1", timeout_s=bad)


async def test_idle_pause_records_reason_idle(clock: FakeClock, node: EdgeNode) -> None:
    info = await node.create(SandboxSpec(idle_timeout_s=5, idle_action="pause", ttl_s=20))
    clock.advance(6)
    assert [(a.action, a.reason) for a in await node.reap()] == [("pause", "idle")]
    got = node.get(info.id)
    assert got.state == "paused" and got.paused_reason == "idle"
    assert [e.reason for e in node.events(info.id)][-2:] == ["idle", "idle"]
    assert got.ttl_left_s == pytest.approx(14)             # its TTL stopped too


async def test_a_ttl_that_pauses(clock: FakeClock, node: EdgeNode) -> None:
    """ttl_action="pause" (E2B's autoPause): the TTL pauses (reason ``ttl``) instead of
    destroying; resumed (explicitly or by an exec), it runs a whole ttl_s again; the
    paused retention still ends it, so it is never kept forever."""
    info = await node.create(SandboxSpec(ttl_s=20, ttl_action="pause"))
    clock.advance(21)
    assert [(a.action, a.reason) for a in await node.reap()] == [("pause", "ttl")]
    got = node.get(info.id)
    assert got.state == "paused" and got.paused_reason == "ttl"
    assert got.ttl_left_s == pytest.approx(20)
    clock.advance(500)
    assert await node.reap() == []                       # paused: its clock stopped
    await node.exec(info.id, ExecRequest(shell="true"))   # resumes it
    assert node.get(info.id).expires_at == pytest.approx(clock.time() + 20)
    clock.advance(20.5)
    assert [(a.action, a.reason) for a in await node.reap()] == [("pause", "ttl")]
    clock.advance(PAUSED_RETENTION_S + 1)
    assert [(a.action, a.reason) for a in await node.reap()] == [
        ("destroy", "paused_retention")]
    with pytest.raises(InvalidArgument, match="ttl_action"):
        SandboxSpec(ttl_action="sleep").validate()  # type: ignore[arg-type]


async def test_timeout_survives_an_edge_restart(tmp_path: object, clock: FakeClock) -> None:
    """Durable before acknowledged: the deadline set (running) and the time left
    (paused) come back from the journal; a line of the old layout gets created+ttl."""
    state = str(tmp_path)
    async with make_node(clock=clock, state_dir=state) as node:
        a = await node.create(SandboxSpec(ttl_s=1000))
        b = await node.create(SandboxSpec())
        t = clock.time()
        await node.set_timeout(a.id, 50)
        await node.set_timeout(b.id, 70)
        await node.pause(b.id)
    clock.advance(10)
    async with make_node(clock=clock, state_dir=state) as node:
        assert node.get(a.id).expires_at == pytest.approx(t + 50)
        got = node.get(b.id)
        assert got.state == "paused" and got.ttl_left_s == pytest.approx(70)
        clock.advance(41)
        assert [x.sandbox_id for x in await node.reap()] == [a.id]


async def test_a_paused_sandbox_is_destroyed_after_the_paused_retention(
        clock: FakeClock) -> None:
    """Red team 19, B4: paused, the TTL clock stops, and the node's paused_retention_s
    (default PAUSED_RETENTION_S, 7 days) bounds how long it stays paused, measured from
    the pause; then it is destroyed with reason paused_retention (an event). A resume
    ends the retention; the next pause starts a new one."""
    async with make_node(clock=clock, paused_retention_s=100) as node:
        a = await node.create(SandboxSpec(ttl_s=50))
        await node.pause(a.id)
        got = node.get(a.id)
        assert got.paused_until == pytest.approx(clock.time() + 100)
        assert got.ttl_left_s == pytest.approx(50)      # the TTL clock still stops
        clock.advance(60)
        assert await node.reap() == []
        await node.resume(a.id)
        assert node.get(a.id).paused_until is None
        clock.advance(10)
        await node.pause(a.id)                          # a new retention, from now
        clock.advance(99)
        assert await node.reap() == []
        clock.advance(2)
        assert [(x.sandbox_id, x.reason) for x in await node.reap()] == [
            (a.id, "paused_retention")]
        end = node.get(a.id)
        assert end.state == "destroyed" and end.reason == "paused_retention"
    async with make_node(clock=clock) as node:
        b = await node.create(SandboxSpec())
        await node.pause(b.id)
        assert node.get(b.id).paused_until == pytest.approx(
            clock.time() + PAUSED_RETENTION_S)
    with pytest.raises(InvalidArgument, match="paused_retention_s"):
        make_node(paused_retention_s=0)


async def test_the_paused_retention_survives_an_edge_restart(tmp_path: object,
                                                             clock: FakeClock) -> None:
    """Durable: the pause time is journaled, so a restart neither restarts nor drops the
    retention (measured from the pause, with the node's setting at adoption)."""
    state = str(tmp_path)
    async with make_node(clock=clock, state_dir=state, paused_retention_s=100) as node:
        a = await node.create(SandboxSpec())
        await node.pause(a.id)
        t = clock.time()
    clock.advance(80)
    async with make_node(clock=clock, state_dir=state, paused_retention_s=100) as node:
        assert node.get(a.id).paused_until == pytest.approx(t + 100)
        clock.advance(19)
        assert await node.reap() == []
        clock.advance(2)
        assert [(x.sandbox_id, x.reason) for x in await node.reap()] == [
            (a.id, "paused_retention")]
