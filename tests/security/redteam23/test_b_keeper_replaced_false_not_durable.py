"""Red team 23 B2: a keeper lost while a put's confirmation is pending marks a process
"not durable" for good although the new keeper holds it - a false warning in its
output, and its descriptors are never dropped when it ends (held until the next edge
restart, counted against the keeper's descriptor bound).

``FdStore._lost`` (EOF on the main connection: the keeper died) calls ``_reset``, which
resolves every pending put future with ``{"ok": False, "gone": True}``, then starts a new
keeper and calls ``on_reconnect`` = ``ProcessTable._redeposit_all``, which re-puts every
running process to the new keeper - without setting ``proc.kept`` and before the
background confirmations run. Then ``_confirm_later`` of the old put sees "gone",
``_check_answer`` raises, ``_not_durable`` sets ``kept = False`` and writes "will not
survive an edge restart" into the output. The new keeper's confirmation of the re-put
succeeds, but nothing sets ``kept`` back, so ``_forget`` never drops the key.

The same happens when the old put timed out (a stopped keeper, ack_timeout_s 2 s) and
the keeper is replaced later: ``_redeposit_all`` re-puts the process, ``kept`` stays
False.

Fix: a put answered "gone" is not a refusal when on_reconnect re-put the key (or
_redeposit_all sets ``kept`` and its confirmation supersedes the older one: track the
latest put number per key and ignore answers to earlier ones).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from dsec.edge.fdstore import FdStore
from dsec.wire import ops
from dsec.wire.calls import ExecCall
from dsec.wire.process import ProcessRunItem
from dsec.wire.spec import ExecRequest, ExecResult
from tests.edge.container.test_process_durability import (  # noqa: F401  (fixture)
    SPEC,
    _keepers,
    _read,
    _start,
    edge,
)

pytestmark = pytest.mark.root


def _held(state: str, sid: str) -> list[str]:
    return [k for k in (FdStore(state).keys() or []) if k.startswith(f"{sid}/")]


async def test_keeper_killed_with_a_confirmation_pending(edge) -> None:  # noqa: F811
    try:
        await _scenario(edge)
    finally:
        # the leaked key keeps the keeper alive past the fixture's check: end it here
        await edge.wipe()
        for pid in _keepers(edge):
            os.kill(pid, signal.SIGKILL)


async def _scenario(edge) -> None:  # noqa: F811
    await edge.start()
    async with await edge.client() as c:
        sid = (await c.create(SPEC)).id
        warm = await _start(c, sid, "true")
        await _read(c, sid, warm.pid, until=b"\xff")
        (old,) = _keepers(edge)
        os.kill(old, signal.SIGSTOP)          # the put of the run below is not answered
        out = bytearray()
        end: ExecResult | None = None
        replaced_held: list[str] = []
        async for item in c.stream(ops.PROCESS_RUN, ExecCall(id=sid, req=ExecRequest(
                shell="echo ran; sleep 3; echo done")), timeout=30):
            if isinstance(item, ProcessRunItem):
                if item.started is not None:
                    await asyncio.sleep(0.3)
                    os.kill(old, signal.SIGKILL)      # the keeper dies, unanswered
                    deadline = time.monotonic() + 10
                    while time.monotonic() < deadline:
                        now = _keepers(edge)
                        if now and old not in now:
                            break
                        await asyncio.sleep(0.05)
                    await asyncio.sleep(0.5)          # the new keeper got everything
                    replaced_held = _held(edge.state, sid)
                out.extend(item.data)
            elif isinstance(item, ExecResult):
                end = item
        assert end is not None and end.exit_code == 0, (out, end)
        # premise: the replacement keeper does hold the running process
        assert len(replaced_held) == 1, replaced_held
        await asyncio.sleep(0.5)               # the drop of its end (20 ms batch) went
        left = _held(edge.state, sid)
    assert b"will not survive an edge restart" not in bytes(out) and not left, (
        f"the new keeper held the process, yet its output said: {bytes(out)!r}; "
        f"keys still held after it ended: {left}")
