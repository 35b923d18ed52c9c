"""What an *authenticated* peer may make a listener hold (red team of issue 12's limits).

Real sockets on loopback; caps set low so a few hundred calls prove each point."""

from __future__ import annotations

import asyncio

import pytest

from dsec.aether import Router, connect, serve
from dsec.aether.limits import ProcessBudget, ServerLimits
from dsec.errors import InvalidArgument

TOKEN = b"tenant-limits-token-0123456789"


async def test_a_peer_pipelining_calls_gets_at_most_max_calls_in_flight_handled_at_once(
        ) -> None:
    """One connection pipelines 300 calls to a handler that waits: the server runs at
    most ``max_calls_in_flight`` of them and leaves the rest unread in the socket (no
    refusal), then serves every one as handlers finish. Before the cap, each REQUEST
    became a task at once: 40,000 pipelined execs per connection grew the gateway by
    300 MB and queued in front of the apiserver's heartbeat polls."""
    running, peak = 0, 0
    gate = asyncio.Event()

    async def hold(n: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        try:
            await gate.wait()
            return n
        finally:
            running -= 1

    r = Router(token=TOKEN)
    r.add("hold", hold)
    r.add("echo", lambda b: b)
    budget = ProcessBudget(nofile=lambda: 100_000)
    server = await serve(r, "tcp:127.0.0.1:0", budget=budget,
                         limits=ServerLimits(max_calls_in_flight=8))
    conn = await connect(str(server.address), token=TOKEN)
    other = await connect(str(server.address), token=TOKEN)
    try:
        calls = asyncio.ensure_future(conn.call_batch([("hold", i) for i in range(300)],
                                                      timeout=30))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if running == 8:
                break
        await asyncio.sleep(0.2)              # room to overshoot, had there been none
        assert (running, peak) == (8, 8)
        # the cap is per connection: another one is served meanwhile
        assert await other.call("echo", "hi", timeout=5) == "hi"
        gate.set()
        assert await calls == list(range(300))
        assert peak == 8
        # and the capped connection is read again: still usable
        assert await conn.call("echo", "after", timeout=5) == "after"
    finally:
        await conn.close()
        await other.close()
        await server.close()


async def test_a_peer_that_hangs_up_with_calls_queued_at_the_cap_is_let_go() -> None:
    gate = asyncio.Event()

    async def hold(_: object) -> None:
        await gate.wait()

    r = Router(token=TOKEN)
    r.add("hold", hold)
    budget = ProcessBudget(nofile=lambda: 100_000)
    server = await serve(r, "tcp:127.0.0.1:0", budget=budget,
                         limits=ServerLimits(max_calls_in_flight=4))
    conn = await connect(str(server.address), token=TOKEN)
    try:
        batch = asyncio.ensure_future(conn.call_batch([("hold", None)] * 50, timeout=30,
                                                      return_exceptions=True))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if server.connections and next(iter(server.connections)).handlers_running == 4:
                break
        (sconn,) = server.connections
        assert sconn.handlers_running == 4
        await conn.close()
        await batch
        for _ in range(200):
            if not server.connections:
                break
            await asyncio.sleep(0.01)
        assert not server.connections and sconn.handlers_running == 0
        assert budget.connections == 0
    finally:
        gate.set()
        await server.close()


def test_max_calls_in_flight_must_be_positive_or_none() -> None:
    with pytest.raises(InvalidArgument, match="max_calls_in_flight=0"):
        ServerLimits(max_calls_in_flight=0)
    assert ServerLimits(max_calls_in_flight=None).max_calls_in_flight is None
