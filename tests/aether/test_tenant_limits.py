"""What an *authenticated* peer may make a listener hold (red team of issue 12's limits).

Real sockets on loopback; caps set low so a few hundred calls prove each point."""

from __future__ import annotations

import asyncio

import msgspec
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


async def test_over_the_buffer_budget_the_largest_holder_is_closed_not_an_ordinary_call(
        ) -> None:
    """Three peers each announce a 4 MiB frame and send 1 MiB of it (3 MiB of a 3.5 MiB
    budget); then a client makes an ordinary 1 MiB call. Before the fix the call's own
    connection, whose read crossed the line, was closed (``Overloaded``) and the three
    kept their bytes: in ``dsec up`` that connection can be the apiserver's link to its
    edge. Now the largest holder is closed and the call goes through."""
    from dsec.aether.connection import AUTH_METHOD
    from dsec.aether.frame import FrameType, encode_parts
    from dsec.aether.messages import encode_request
    from tests.aether.conftest import RawPeer

    budget = ProcessBudget(nofile=lambda: 100_000, max_buffered_bytes=7 << 19)
    r = Router(token=TOKEN)
    r.add("echo", lambda b: b)
    server = await serve(r, "tcp:127.0.0.1:0", budget=budget,
                         limits=ServerLimits(frame_timeout_s=30.0))
    hogs: list[RawPeer] = []
    conn = await connect(str(server.address), token=TOKEN)
    try:
        for _ in range(3):
            rd, wr = await asyncio.open_connection(server.address.host, server.address.port)
            p = RawPeer(rd, wr)
            hogs.append(p)
            p.send(FrameType.REQUEST, 1, encode_request(AUTH_METHOD, msgspec.msgpack.encode(TOKEN)))
            assert (await p.frame())[0] == FrameType.RESPONSE
            p.send_raw(encode_parts(FrameType.REQUEST, 3, b"\0" * (4 << 20)) + b"\0" * (1 << 20))
        for _ in range(500):
            if budget.buffered >= 3 << 20:
                break
            await asyncio.sleep(0.01)
        assert budget.buffered >= 3 << 20
        data = b"x" * (1 << 20)
        assert await conn.call("echo", data, timeout=10) == data
        cut = 0
        for p in hogs:
            try:
                f = await p.frame_of(FrameType.GOAWAY, timeout=0.5)
            except (TimeoutError, EOFError):
                continue
            assert b"overloaded" in f[2] and b"holds the most" in f[2]
            cut += 1
        assert cut >= 1
        assert server.stats.closed["buffer_budget"] == cut
        assert budget.buffered <= 7 << 19
    finally:
        await conn.close()
        for p in hogs:
            await p.close()
        await server.close()
    assert budget.buffered == 0 and not budget.holders


async def test_a_streaming_call_whose_reader_falls_behind_is_cancelled_not_buffered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Aether has no per-stream flow control: the connection is read for every call on
    it. A gateway client that never read its exec_stream made the apiserver hold the
    whole output (600 MB for one command). Past STREAM_BACKLOG_MAX unread bytes the
    call is cancelled (the server stops producing) and the reader told why; past
    STREAMS_BACKLOG_MAX for the whole connection, the stream furthest behind goes."""
    import dsec.aether.connection as aconn
    from dsec.errors import ResourceExhausted

    monkeypatch.setattr(aconn, "STREAM_BACKLOG_MAX", 1 << 20)
    monkeypatch.setattr(aconn, "STREAMS_BACKLOG_MAX", 3 << 20)
    sent: dict[int, int] = {}
    cancelled: list[int] = []

    async def gush(n: int, out: aconn.StreamSender) -> str:
        sent[n] = 0
        try:
            for _ in range(1000):
                await out.send(b"x" * 65536)
                sent[n] += 1
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            cancelled.append(n)
            raise
        return "done"

    r = Router()
    r.add("gush", gush, streaming=True)
    budget = ProcessBudget(nofile=lambda: 100_000)
    server = await serve(r, "tcp:127.0.0.1:0", budget=budget)
    conn = await connect(str(server.address))
    try:
        lazy = conn.stream("gush", 0, timeout=30)
        for _ in range(500):
            if cancelled:
                break
            await asyncio.sleep(0.01)
        assert cancelled == [0] and sent[0] < 40          # ~16 items, not 1000
        with pytest.raises(ResourceExhausted, match="fell .* bytes behind"):
            async for _ in lazy:
                pass
        assert conn._stream_backlog == 0
        # four streams read a little at a time: together they pass 3 MiB first
        streams = [conn.stream("gush", i, timeout=30) for i in range(1, 5)]
        for _ in range(500):
            if cancelled[1:]:
                break
            await asyncio.sleep(0.01)
        assert len(cancelled) >= 2 and conn._stream_backlog <= 3 << 20
        for st in streams:
            st.cancel()
        assert conn._stream_backlog == 0
        # the connection itself is fine
        ok = conn.stream("gush", 9, timeout=30)
        n = 0
        async for _ in ok:
            n += 1
        assert (n, ok.result) == (1000, "done")
    finally:
        await conn.close()
        await server.close()


async def test_when_the_fd_share_is_full_of_strangers_a_client_still_gets_in() -> None:
    """The process's connection share (half of RLIMIT_NOFILE: 512 at 1024) can bind
    before any listener's pending cap (1,024): a stranger's idle flood over a few
    addresses then had every client refused (``fds``), with a key or not, and nothing
    was ever evicted. Now the oldest stranger of the listener holding the most goes,
    on whichever listener the client came to."""
    budget = ProcessBudget(nofile=lambda: 40)              # a share of 20 connections
    r = Router(token=TOKEN)
    r.add("echo", lambda b: b)
    flooded = await serve(r, "tcp:127.0.0.1:0", budget=budget)
    other = await serve(r, "tcp:127.0.0.1:0", budget=budget)
    idle: list[asyncio.StreamWriter] = []
    try:
        for i in range(20):
            _, w = await asyncio.open_connection(flooded.address.host, flooded.address.port,
                                                 local_addr=(f"127.0.2.{1 + i % 4}", 0))
            idle.append(w)
        for _ in range(200):
            if budget.connections == 20:
                break
            await asyncio.sleep(0.01)
        assert budget.connections == 20
        clients = []
        try:
            for server in (flooded, other):    # both stay open: each needed room
                clients.append(await connect(str(server.address), token=TOKEN))
                assert await clients[-1].call("echo", "in", timeout=5) == "in"
        finally:
            for c in clients:
                await c.close()
        assert flooded.stats.closed.get("evicted") == 2
        assert not flooded.stats.refused and not other.stats.refused
    finally:
        for w in idle:
            w.close()
        await flooded.close()
        await other.close()


async def test_a_peer_that_leaves_its_replies_unread_is_cut_not_buffered() -> None:
    """Reading stops at the write high-water mark, but the calls already running still
    answer: 300 pipelined read_file calls of an 8 MiB file, never read, grew dsec up by
    1.5 GB. Past ``ServerLimits.unread_replies_max`` unread bytes (written, or finished
    and parked behind the write buffer) the listener cuts the connection."""
    import socket

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
                         limits=ServerLimits(unread_replies_max=8 << 20))
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((server.address.host, server.address.port))
    s.setblocking(False)
    try:
        frames = [encode_parts(FrameType.REQUEST, 1, p := encode_request(
            AUTH_METHOD, msgspec.msgpack.encode(TOKEN))) + p]
        call = encode_request("blob", msgspec.msgpack.encode(1 << 20))
        frames += [encode_parts(FrameType.REQUEST, sid, call) + call
                   for sid in range(3, 3 + 2 * 100, 2)]
        await asyncio.get_running_loop().sock_sendall(s, b"".join(frames))
        for _ in range(500):
            if server.stats.closed.get("unread_replies"):
                break
            await asyncio.sleep(0.01)
        assert server.stats.closed.get("unread_replies") == 1
        for _ in range(300):
            if not server.connections:
                break
            await asyncio.sleep(0.01)
        assert not server.connections and budget.connections == 0
    finally:
        s.close()
        await server.close()


async def test_duplex_streams_keep_flowing_at_max_calls_in_flight_and_have_their_own_cap(
        ) -> None:
    """A duplex handler waits for its peer's frames. Counted toward
    ``max_calls_in_flight``, a client at the cap (a duplex upload plus 3 long calls, at
    cap 4) had its connection paused: the upload's own bytes were never read and it
    stalled until the other calls ended. Duplex streams now run beside the cap, capped on
    their own (``max_calls_in_flight // 16``, at least 1): one more is refused at once."""
    from dsec.aether.connection import DuplexStream
    from dsec.errors import ResourceExhausted
    gate = asyncio.Event()

    async def hold(_: object) -> None:
        await gate.wait()

    async def count(_: object, stream: DuplexStream) -> int:
        n = 0
        async for chunk in stream:
            n += len(chunk)
        return n

    r = Router(token=TOKEN)
    r.add("hold", hold)
    r.add("count", count, duplex=True)
    budget = ProcessBudget(nofile=lambda: 100_000)
    server = await serve(r, "tcp:127.0.0.1:0", budget=budget,
                         limits=ServerLimits(max_calls_in_flight=4))
    conn = await connect(str(server.address), token=TOKEN)
    try:
        up = conn.duplex("count", None, response_type=int)
        held = asyncio.ensure_future(conn.call_batch([("hold", None)] * 4, timeout=30,
                                                     return_exceptions=True))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if next(iter(server.connections)).handlers_running == 5:
                break
        # 4 calls at the cap: the upload's 2 MiB (8 windows) still gets through
        await asyncio.wait_for(up.send(b"x" * (2 << 20)), 10)
        up.close_write()
        assert await asyncio.wait_for(up.result(), 10) == 2 << 20
        gate.set()
        await held
        # the duplex cap: 4 // 16 -> 1 stream at once (a new REQUEST, duplex or not,
        # waits while the connection is at max_calls_in_flight, like any other)
        first = conn.duplex("count", None, response_type=int)
        await first.send(b"a")
        second = conn.duplex("count", None, response_type=int)
        with pytest.raises(ResourceExhausted, match="duplex streams open, the limit is 1"):
            await asyncio.wait_for(second.result(), 10)
        first.close_write()
        assert await asyncio.wait_for(first.result(), 10) == 1
    finally:
        gate.set()
        await conn.close()
        await server.close()
