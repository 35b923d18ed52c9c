"""``process_run`` on the edge's process table (issue 20): one call that starts a process
exactly as ``process_start`` does and follows it as ``process_connect`` does. Simulated
backend (the table's bookkeeping is the edge's own; the container backend and every door
are tests/client/test_processes.py's and tests/test_catalogue.py's):

- its first item is the entry, then the output, then the end;
- its limits are process_start's (the per-sandbox table, the node's ring budget), and a
  refused run holds nothing (its ring and slot released);
- closing the stream mid-way ends the reader, not the process: it stays in the table,
  running, and another client connects by the pid of the first item, types into it and
  reads everything it printed;
- an entry evicted right after a quick command's end still gives its reader the output
  and the end (the run holds the entry, not its pid).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from dsec.edge.node import EdgeNode
from dsec.edge.processes import ProcessLimits
from dsec.errors import CapacityExceeded, RateLimited
from dsec.wire.process import ProcessInfo
from dsec.wire.spec import ExecChunk, ExecRequest, ExecResult, SandboxSpec
from tests.edge.conftest import make_node

RING = 1 << 10
CAT = ExecRequest(argv=("cat",), stdin_open=True)


@pytest.fixture
async def node() -> AsyncIterator[EdgeNode]:
    n = make_node()
    await n.start()
    try:
        yield n
    finally:
        await n.close()


async def _sandbox(node: EdgeNode, project: str = "acme") -> str:
    return str((await node.create(SandboxSpec(backend="simulated", project=project))).id)


async def test_entry_first_then_output_then_end(node: EdgeNode) -> None:
    sid = await _sandbox(node)
    items = [x async for x in node.processes.run(sid, ExecRequest(shell="echo hi; echo there",
                                                                  tag="t"))]
    assert isinstance(items[0], ProcessInfo) and items[0].pid > 0 and items[0].tag == "t"
    assert isinstance(items[-1], ExecResult) and items[-1].exit_code == 0
    chunks = items[1:-1]
    assert chunks and all(isinstance(c, ExecChunk) for c in chunks)
    assert b"".join(c.data for c in chunks if isinstance(c, ExecChunk)) == b"hi\nthere\n"
    # it is in the table like any started process
    assert [p.pid for p in node.processes.list(sid)] == [items[0].pid]


async def test_limits_are_process_starts(node: EdgeNode) -> None:
    t = node.processes
    t.limits = ProcessLimits(per_sandbox=2, ring_bytes=RING, ring_budget=3 * RING)
    a = await _sandbox(node)
    runs = [t.run(a, CAT) for _ in range(2)]
    firsts = [await anext(r) for r in runs]
    pids = [f.pid for f in firsts if isinstance(f, ProcessInfo)]
    assert len(pids) == 2
    with pytest.raises(RateLimited, match="per-sandbox limit"):
        await anext(t.run(a, CAT))
    assert t.reserved_bytes == 2 * RING and not t._starting  # the refused run holds nothing
    b = await _sandbox(node)
    first = await anext(t.run(b, CAT))
    assert isinstance(first, ProcessInfo)
    with pytest.raises(CapacityExceeded, match="budget of 3072"):
        await anext(t.run(b, CAT))
    assert t.reserved_bytes == 3 * RING
    for r in runs:
        await r.aclose()
    for pid in pids:
        t.close_stdin(a, pid)
        assert isinstance([x async for x in t.connect(a, pid)][-1], ExecResult)


async def test_closing_the_stream_keeps_the_process(node: EdgeNode) -> None:
    t = node.processes
    sid = await _sandbox(node)
    run = t.run(sid, CAT)
    info = await anext(run)
    assert isinstance(info, ProcessInfo)
    reader = asyncio.ensure_future(anext(run))    # the reader waits for output
    await asyncio.sleep(0.05)
    p = t._tables[sid][info.pid]
    assert len(p.followers) == 1 and not reader.done()
    reader.cancel()                                # the client went away mid-stream
    with pytest.raises(asyncio.CancelledError):
        await reader
    await run.aclose()
    assert len(p.followers) == 0
    assert next(e for e in t.list(sid) if e.pid == info.pid).running   # it runs on
    # another client, by the pid of the first item: types into it, reads it all
    await t.input(sid, info.pid, b"one\n")
    await t.input(sid, info.pid, b"two\n")
    t.close_stdin(sid, info.pid)
    items = [x async for x in t.connect(sid, info.pid)]
    assert isinstance(items[-1], ExecResult) and items[-1].exit_code == 0
    assert b"".join(c.data for c in items if isinstance(c, ExecChunk)) == b"one\ntwo\n"


async def test_an_evicted_quick_command_still_ends_its_run(node: EdgeNode) -> None:
    t = node.processes
    t.limits = ProcessLimits(per_sandbox=1, ring_bytes=RING, ring_budget=4 * RING)
    sid = await _sandbox(node)
    run = t.run(sid, ExecRequest(shell="echo quick"))
    info = await anext(run)
    assert isinstance(info, ProcessInfo)
    for _ in range(500):          # it ends (the reader has not read a byte yet)
        if not next(e for e in t.list(sid) if e.pid == info.pid).running:
            break
        await asyncio.sleep(0.01)
    await t.start(sid, ExecRequest(shell="true"))      # evicts it: the one slot
    assert info.pid not in [e.pid for e in t.list(sid) if e.cmd == "echo quick"]
    rest = [x async for x in run]
    assert isinstance(rest[-1], ExecResult) and rest[-1].exit_code == 0
    assert b"".join(c.data for c in rest if isinstance(c, ExecChunk)) == b"quick\n"
