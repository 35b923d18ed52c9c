"""Red team 23 B3: a ``process_start`` cancelled while it awaits the keeper's
confirmation leaves its process running, listed running, and never checks the answer:
when the keeper refuses (at its descriptor limit) nothing holds the process's
descriptors and nothing says so - a silent loss of durability.

``ProcessTable.start`` awaits ``confirmed()`` (commit 2d64400) inside
``try: ... except DsecError: kill``. A client timeout (or any cancel: the caller's
task, a closed connection) sends CANCEL and the edge cancels the handler there:
``CancelledError`` is not a DsecError, so the process is neither killed nor handed to
``_confirm_in_background``; ``proc.kept`` stays True. The keeper's refusal then arrives
at a future nobody awaits. Before 2d64400 the put's answer was read synchronously in
``_persist`` (no await between spawn and the check), so a cancel could not land there.

Repro: a real ``dsec edge``; its keeper's RLIMIT_NOFILE is lowered under what it holds
(prlimit(2) after it started: a keeper at its limit, as on a host with a small
``ulimit -n``), so the next put's descriptors arrive truncated and are refused
("full"). The keeper is stopped for a moment so the start is still awaiting when the
client gives up after 0.5 s.

Fix: treat a cancel like a failure there (``except BaseException``: kill, or hand the
confirmation to ``_confirm_in_background`` before re-raising the cancel).
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal

import pytest

from dsec.edge.fdstore import FdStore
from dsec.errors import DsecError
from dsec.wire import ops
from dsec.wire.calls import ExecCall, SandboxRef
from dsec.wire.process import ProcessRef
from dsec.wire.spec import ExecChunk, ExecRequest
from tests.edge.container.test_process_durability import (  # noqa: F401  (fixture)
    SPEC,
    _keepers,
    _read,
    _start,
    edge,
)

pytestmark = pytest.mark.root


async def _output_for(c, sid: str, pid: int, seconds: float) -> bytes:
    """What a connect to ``pid`` shows within ``seconds`` (it keeps running)."""
    got = bytearray()

    async def follow() -> None:
        async for item in c.stream(ops.PROCESS_CONNECT, ProcessRef(id=sid, pid=pid),
                                   timeout=None):
            if isinstance(item, ExecChunk):
                got.extend(item.data)

    try:
        await asyncio.wait_for(follow(), seconds)
    except TimeoutError:
        pass
    return bytes(got)


async def test_cancelled_start_refused_by_the_keeper_is_not_silent(edge) -> None:  # noqa: F811
    await edge.start()
    async with await edge.client() as c:
        sid = (await c.create(SPEC)).id
        warm = await _start(c, sid, "true")
        await _read(c, sid, warm.pid, until=b"\xff")
        (keeper,) = _keepers(edge)
        held = len(os.listdir(f"/proc/{keeper}/fd"))
        # the keeper at its descriptor limit: what a put sends arrives truncated
        limits = resource.prlimit(keeper, resource.RLIMIT_NOFILE)
        resource.prlimit(keeper, resource.RLIMIT_NOFILE, (held - 1, limits[1]))
        os.kill(keeper, signal.SIGSTOP)
        try:
            with pytest.raises(DsecError):   # the client gives up: CANCEL to the edge
                await c.call(ops.PROCESS_START, ExecCall(id=sid, req=ExecRequest(
                    shell="echo started; sleep 30")), timeout=0.5)
            await asyncio.sleep(0.5)         # the CANCEL reached the edge (ack_timeout_s 2 s)
        finally:
            os.kill(keeper, signal.SIGCONT)
        await asyncio.sleep(1.0)             # the keeper answered (refused)
        resource.prlimit(keeper, resource.RLIMIT_NOFILE, limits)   # it accepts again
        items = (await c.call(ops.PROCESS_LIST, SandboxRef(id=sid))).items
        running = [p for p in items if p.running and "sleep 30" in str(p.cmd)]
        keys = [k for k in (FdStore(edge.state).keys() or []) if k.startswith(f"{sid}/")]
        out = b""
        if running:
            out = await _output_for(c, sid, running[0].pid, 1.5)
    # the secure outcomes: the process was ended, or it says it is not durable
    assert not running or b"will not survive an edge restart" in out, (
        f"process {running[0].pid} is listed running, the keeper holds {keys} for this "
        f"sandbox, and its output says nothing: {out!r}")
