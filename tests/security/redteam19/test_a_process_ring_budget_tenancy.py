"""The edge's process table keeps one node-wide ring budget (``ProcessLimits.ring_budget``,
256 MiB = 256 running processes at the default 1 MiB ring) with no share per tenant:

1. one project's member key fills it with idle background processes (``process_start``
   with ``stdin_open=True`` and a command that waits: ``sleep``/``cat``; 8 sandboxes x 32
   per-sandbox entries), after which **every other project's** ``process_start`` on that
   node is refused with ``CapacityExceeded`` - the exec caps it passes give each tenant
   half of the node, this budget gives one tenant all of it;
2. its starts evict the *ended* entries of any sandbox, oldest first: another
   project's finished background job, whose output its owner was promised it could read
   later ("kept after the exit until the entry is evicted"), is thrown away by a
   stranger's activity.

Below: a node with ``ring_budget`` = 8 rings; project ``acme`` holds 8 waiting processes
(in two sandboxes); project ``other`` must still start one, and ``other``'s ended job
must survive ``acme`` starting more."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from dsec.edge.node import EdgeNode
from dsec.edge.processes import ProcessLimits
from dsec.errors import CapacityExceeded
from dsec.wire.spec import ExecRequest, ExecResult, SandboxSpec
from tests.edge.conftest import make_node

RING = 1 << 10
LIMITS = ProcessLimits(per_sandbox=32, ring_bytes=RING, ring_budget=8 * RING)
WAIT = ExecRequest(argv=("cat",), stdin_open=True)   # waits for stdin: runs until closed


@pytest.fixture
async def node() -> AsyncIterator[EdgeNode]:
    n = make_node()
    await n.start()
    n.processes.limits = LIMITS
    try:
        yield n
    finally:
        await n.close()


async def _sandbox(node: EdgeNode, project: str) -> str:
    return str((await node.create(SandboxSpec(backend="simulated", project=project))).id)


async def test_one_tenant_cannot_take_every_ring_of_the_node(node: EdgeNode) -> None:
    a1, a2 = await _sandbox(node, "acme"), await _sandbox(node, "acme")
    b = await _sandbox(node, "other")
    for i in range(8):
        await node.processes.start(a1 if i % 2 else a2, WAIT)
    try:
        info = await node.processes.start(b, ExecRequest(argv=("true",)))
    except CapacityExceeded as exc:
        pytest.fail(f"project 'other' cannot start a process on this node because project "
                    f"'acme' holds 8 idle background processes: {exc.message}")
    assert info.pid


async def test_a_strangers_starts_do_not_evict_my_ended_output(node: EdgeNode) -> None:
    b = await _sandbox(node, "other")
    job = await node.processes.start(b, ExecRequest(argv=("echo", "result-42")))
    for _ in range(100):
        if not node.processes.list(b)[0].running:
            break
        await asyncio.sleep(0.01)
    a = await _sandbox(node, "acme")
    a2 = await _sandbox(node, "acme")
    for i in range(8):                     # acme fills the budget; may be refused at the end
        try:
            await node.processes.start(a if i % 2 else a2, WAIT)
        except CapacityExceeded:
            break
    pids = [p.pid for p in node.processes.list(b)]
    assert job.pid in pids, (
        "project 'acme' starting background processes evicted project 'other''s ended "
        "job (and the output it kept for a later connect)")
    items = [x async for x in node.processes.connect(b, job.pid)]
    assert isinstance(items[-1], ExecResult)
