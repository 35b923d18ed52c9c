"""One caller's traffic on a shared link waits its turn; it never closes the link
(redteam-19 A1/A2).

The edge serves the apiserver's one link, which carries every tenant. Large replies used
to be written whole as handlers finished (24 concurrent 8 MiB replies: 190 MB in the
write buffer at once, then the ``unread_replies`` cut closed the link for everybody), and
server-push STREAM items had no per-stream credit (a stream whose reader lagged was
cancelled 16 MiB behind, or - with unflushed bytes not counted - the link was cut).
Real sockets on loopback."""

from __future__ import annotations

import asyncio

import pytest

from dsec.aether import Router, StreamSender, connect, serve
from dsec.aether.connection import STREAM_BACKLOG_MAX, STREAM_WINDOW, WRITE_HIGH_WATER
from dsec.aether.limits import ProcessBudget, ServerLimits

TOKEN = b"link-backpressure-token-0123456789"
MIB = 1 << 20


async def _served(r: Router, limits: ServerLimits) -> tuple[object, object]:
    budget = ProcessBudget(nofile=lambda: 100_000)
    server = await serve(r, "tcp:127.0.0.1:0", budget=budget, limits=limits)
    return server, await connect(str(server.address), token=TOKEN)


async def test_large_replies_are_parked_not_written_whole_and_small_ones_pass() -> None:
    """24 handlers finish an 8 MiB reply at once on a link whose reader is slow (as the
    apiserver's loop under load). With ``unread_replies_max`` off (an edge) the link
    stays up, every reply arrives, the write buffer never holds more than the high-water
    mark plus one reply, and a small reply is not queued behind the big ones."""
    gate = asyncio.Event()
    peak = 0
    server_conns: list[object] = []

    async def big(_: object) -> bytes:
        await gate.wait()
        return b"b" * (8 * MIB)

    async def small(_: object) -> str:
        return "hi"

    r = Router(token=TOKEN)
    r.add("big", big)
    r.add("small", small)
    server, conn = await _served(r, ServerLimits(unread_replies_max=None,
                                                 max_calls_in_flight=None))
    try:
        calls = [asyncio.ensure_future(conn.call("big", None, timeout=60))  # type: ignore[attr-defined]
                 for _ in range(24)]
        await asyncio.sleep(0.1)
        server_conns = list(server.connections)  # type: ignore[attr-defined]
        (sc,) = server_conns
        gate.set()

        parked = 0

        async def watch() -> None:
            nonlocal peak, parked
            while True:
                peak = max(peak, sc._transport.get_write_buffer_size())  # type: ignore[attr-defined]
                parked = max(parked, sc._parked_bytes)  # type: ignore[attr-defined]
                await asyncio.sleep(0)

        w = asyncio.ensure_future(watch())
        # while big replies are parked, a small call still answers
        assert await conn.call("small", None, timeout=5) == "hi"  # type: ignore[attr-defined]
        got = await asyncio.gather(*calls)
        w.cancel()
        assert [len(g) for g in got] == [8 * MIB] * 24
        assert parked >= 8 * MIB, parked     # they did wait their turn
        assert not sc.closed  # type: ignore[attr-defined]
        assert server.stats.closed.get("unread_replies") is None  # type: ignore[attr-defined]
        # at most the high-water mark plus one reply (and its frame header) in the buffer
        assert peak <= WRITE_HIGH_WATER + 8 * MIB + 64, peak
    finally:
        await conn.close()  # type: ignore[attr-defined]
        await server.close()  # type: ignore[attr-defined]


async def test_parked_replies_count_toward_unread_replies_max_on_a_guarded_listener(
        ) -> None:
    """Parking must not turn the hostile-peer guard into unbounded memory: on a listener
    with ``unread_replies_max`` the parked bytes count, and a peer that never reads is
    cut there (checked with a peer whose socket is never read)."""
    import socket

    import msgspec

    from dsec.aether.connection import AUTH_METHOD
    from dsec.aether.frame import FrameType, encode_parts
    from dsec.aether.messages import encode_request

    async def blob(n: int) -> bytes:
        await asyncio.sleep(0)
        return b"b" * n

    r = Router(token=TOKEN)
    r.add("blob", blob)
    budget = ProcessBudget(nofile=lambda: 100_000)
    server = await serve(r, "tcp:127.0.0.1:0", budget=budget,
                         limits=ServerLimits(unread_replies_max=16 * MIB))
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((server.address.host, server.address.port))
    s.setblocking(False)
    try:
        frames = [encode_parts(FrameType.REQUEST, 1, p := encode_request(
            AUTH_METHOD, msgspec.msgpack.encode(TOKEN))) + p]
        call = encode_request("blob", msgspec.msgpack.encode(2 * MIB))
        frames += [encode_parts(FrameType.REQUEST, sid, call) + call
                   for sid in range(3, 3 + 2 * 30, 2)]
        await asyncio.get_running_loop().sock_sendall(s, b"".join(frames))
        for _ in range(500):
            if server.stats.closed.get("unread_replies"):
                break
            await asyncio.sleep(0.01)
        assert server.stats.closed.get("unread_replies") == 1
    finally:
        s.close()
        await server.close()


@pytest.mark.parametrize("item_size", [64 * 1024, 3 * MIB])
async def test_a_slow_reader_stops_its_own_stream_not_the_link(item_size: int) -> None:
    """A streaming call whose reader lags: the handler waits for the caller's credit (it
    is neither cancelled 16 MiB behind nor allowed to fill the link), the caller never
    holds more than one window plus one item, other calls on the same link answer at
    once meanwhile, and every item arrives in order once the reader reads."""
    total = 48 * MIB
    sent = 0

    async def flood(n: int, out: StreamSender) -> int:
        nonlocal sent
        chunk = b"z" * item_size
        while sent < n:
            await out.send(chunk)       # no other await: a producer that never yields
            sent += len(chunk)
        return sent

    r = Router(token=TOKEN)
    r.add("flood", flood, streaming=True)
    r.add("echo", lambda b: b)
    server, conn = await _served(r, ServerLimits(unread_replies_max=None,
                                                 max_calls_in_flight=None))
    try:
        s = conn.stream("flood", total, item_type=bytes)  # type: ignore[attr-defined]
        it = s.__aiter__()
        first = await it.__anext__()
        await asyncio.sleep(0.3)        # the reader stalls
        slot = s._slot
        assert slot.backlog <= STREAM_WINDOW + item_size, slot.backlog
        assert slot.backlog < STREAM_BACKLOG_MAX
        assert sent < total
        assert await conn.call("echo", "other", timeout=5) == "other"  # type: ignore[attr-defined]
        got = len(first)
        async for item in it:
            assert item == b"z" * item_size
            got += len(item)
        assert got >= total and s.result == got
        assert not conn.closed  # type: ignore[attr-defined]
    finally:
        await conn.close()  # type: ignore[attr-defined]
        await server.close()  # type: ignore[attr-defined]


async def test_senders_count_bytes_not_yet_flushed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer that sends item after item without yielding to the loop (its source
    always ready) used to grow the unflushed buffer without bound: the high-water check
    looked at the transport's buffer only. Without credit (an old caller) the write
    buffer still stays near the high-water mark."""
    peak = 0

    async def flood(n: int, out: StreamSender) -> int:
        nonlocal peak
        conn = out._conn
        for _ in range(n):
            await out.send(b"q" * (256 * 1024))
            peak = max(peak, conn._wbytes + conn._transport.get_write_buffer_size())
        return n

    r = Router(token=TOKEN)
    r.add("flood", flood, streaming=True)
    server, conn = await _served(r, ServerLimits(unread_replies_max=None,
                                                 max_calls_in_flight=None))
    try:
        import dsec.aether.connection as aconn
        # an old caller: STREAMING without CREDIT
        monkeypatch.setattr(aconn, "_CREDIT", 0, raising=False)
        s = conn.stream("flood", 400, item_type=bytes)  # type: ignore[attr-defined]
        monkeypatch.undo()
        n = 0
        async for _ in s:
            n += 1
        assert n == 400 and s.result == 400
        assert peak <= WRITE_HIGH_WATER + 512 * 1024, peak
    finally:
        await conn.close()  # type: ignore[attr-defined]
        await server.close()  # type: ignore[attr-defined]
