"""The process table's node budgets are shared fairly between tenants (red team 19,
A4/A5 and its "class"): ring room is taken back from the tenant furthest over its share
(its running rings shrink, the oldest output counted as dropped), stdin in flight has a
node budget with a per-tenant half, and the node's reader backlog cuts the furthest-behind
reader of the tenant holding the most. Simulated backend (the budgets are the edge's own
bookkeeping; tests/security/redteam19 runs the race on the container backend)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from dsec.edge.node import EdgeNode
from dsec.edge.processes import ProcessLimits, _Backlog, _Follower, _Process
from dsec.errors import CapacityExceeded, ResourceExhausted
from dsec.wire.process import ProcessInfo
from dsec.wire.spec import ExecRequest, ExecResult, SandboxSpec
from tests.edge.conftest import make_node

RING = 1 << 10
WAIT = ExecRequest(argv=("cat",), stdin_open=True)


@pytest.fixture
async def node() -> AsyncIterator[EdgeNode]:
    n = make_node()
    await n.start()
    try:
        yield n
    finally:
        await n.close()


async def _sandbox(node: EdgeNode, project: str) -> str:
    return str((await node.create(SandboxSpec(backend="simulated", project=project))).id)


async def test_room_is_taken_from_the_tenant_over_its_share(node: EdgeNode) -> None:
    node.processes.limits = ProcessLimits(per_sandbox=32, ring_bytes=RING,
                                          ring_budget=4 * RING)
    t = node.processes
    a, b, c = (await _sandbox(node, "acme"), await _sandbox(node, "other"),
               await _sandbox(node, "third"))
    held = [await t.start(a, WAIT) for _ in range(4)]       # acme alone: the whole budget
    assert t.reserved_bytes == 4 * RING
    with pytest.raises(CapacityExceeded, match="project acme holds 4096"):
        await t.start(a, WAIT)                               # nobody to take from but itself
    await t.start(b, WAIT)                                   # other: within its share
    await t.start(b, WAIT)
    assert t.reserved_bytes <= 4 * RING
    assert t._by_tenant["other"] == 2 * RING and t._by_tenant["acme"] == 2 * RING
    with pytest.raises(CapacityExceeded, match="project other holds 2048"):
        await t.start(b, WAIT)                               # other at its half now
    await t.start(c, WAIT)                                   # a third tenant: a third each
    assert t.reserved_bytes <= 4 * RING
    assert all(n <= 4 * RING // 3 + RING for n in t._by_tenant.values()), t._by_tenant
    # acme's processes still run, with smaller rings (never below a quarter)
    caps = [t._tables[a][p.pid].ring_cap for p in held]
    assert all(RING // 4 <= x <= RING for x in caps) and min(caps) < RING
    t.close_stdin(a, held[0].pid)
    items = [x async for x in t.connect(a, held[0].pid)]
    assert isinstance(items[-1], ExecResult)


def test_a_shrunk_ring_keeps_its_newest_output() -> None:
    p = _Process(ProcessInfo(pid=1, cmd="x"), 100)
    p.take("stdout", b"a" * 60, 1 << 20)
    p.take("stdout", b"b" * 40, 1 << 20)
    p.shrink(50)
    assert b"".join(c.data for c in p.ring) == b"a" * 10 + b"b" * 40
    assert p.info.output_dropped == 50 and p.ring_size == 50


async def test_stdin_in_flight_has_a_node_budget_with_a_tenant_half(node: EdgeNode) -> None:
    node.processes.limits = ProcessLimits(input_budget=4000)
    t = node.processes
    a, b = await _sandbox(node, "acme"), await _sandbox(node, "other")
    pa = await t.start(a, WAIT)
    await t.input(a, pa.pid, b"x" * 1500)      # held by the backend until stdin closes
    with pytest.raises(ResourceExhausted, match="project acme: 1500"):
        await t.input(a, pa.pid, b"x" * 1500)  # past acme's half (2000)
    pb = await t.start(b, WAIT)
    await t.input(b, pb.pid, b"y" * 1500)      # another tenant still may
    t.close_stdin(a, pa.pid)                   # acme's process runs and ends: released
    items = [x async for x in t.connect(a, pa.pid)]
    assert isinstance(items[-1], ExecResult)
    assert t._input_by_tenant.get("acme", 0) == 0 and t._input == 1500
    pa2 = await t.start(a, WAIT)
    await t.input(a, pa2.pid, b"x" * 1500)


async def test_the_backlog_cuts_within_the_tenant_holding_the_most() -> None:
    bl = _Backlog(120)
    many = [_Follower("acme") for _ in range(3)]
    one = _Follower("other")
    for f in [*many, one]:
        bl.followers.add(f)
    for f in many:
        f.backlog = 30
        bl.add(f, 30)
    one.backlog = 40
    bl.add(one, 40)          # 130 > 120: acme holds 90 of it, other 40 (the single largest)
    assert not one.cut
    assert sum(f.cut for f in many) == 1 and bl.total == 100
    await asyncio.sleep(0)
