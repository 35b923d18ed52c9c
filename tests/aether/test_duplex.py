"""Duplex Aether streams: raw bytes both ways on one stream id under per-stream credit.

Part one is the sans-IO core (:class:`dsec.aether.state.DuplexFlow`) under hypothesis:
flows exchange STREAM and WINDOW "frames" through in-memory FIFO wires in any order a
schedule draws, and after every step credit is never negative, a receiver never holds
more than the window it granted, and once the schedule is drained every byte arrived, in
order, exactly once. Several streams share one "connection" whose reader takes every
frame (as the shell does): one stream whose reader never reads stops only its own sender.

Part two runs the shell (:class:`dsec.aether.connection.DuplexStream`) over real sockets,
on both event loops: echo with half-close each way, a stalled stream beside a busy one,
a raw peer that ignores credit (cut with the reason), reset from either side, a
connection dying mid-stream, and unary calls unaffected.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsec.aether import Router
from dsec.aether.frame import FrameFlags, FrameType
from dsec.aether.messages import Goaway, method_prefix
from dsec.aether.state import (
    DUPLEX_TRANSITIONS,
    INITIAL_WINDOW,
    MAX_CHUNK,
    MAX_WINDOW,
    DuplexFlow,
    decode_window,
    encode_window,
)
from dsec.errors import (
    ConnectionLost,
    InvalidArgument,
    LocalProtocolError,
    RemoteProtocolError,
    RequestTimeout,
    SandboxNotFound,
    StreamReset,
)

from .conftest import Served

# ================================================================ sans-IO model
Wire = deque[tuple[str, int, bool]]   # ("data", n, fin) | ("window", n, False)


class Side:
    """One end of one stream in the model: a flow, bytes to send, bytes received."""

    def __init__(self, sid: int, payload: bytes, window: int, peer_window: int) -> None:
        self.flow = DuplexFlow(sid, window=window, peer_window=peer_window)
        self.out = payload
        self.sent = 0
        self.delivered = 0          # of ``out``, how much the peer has received
        self.fin_sent = False
        self.buffer = bytearray()   # received, not yet read (what the shell would hold)
        self.read = bytearray()

    def try_send(self, want: int, wire: Wire) -> None:
        if self.fin_sent:
            return
        n = self.flow.sendable(min(want, len(self.out) - self.sent))
        if n:
            self.flow.sent(n)
        fin = self.sent + n == len(self.out)
        if n or fin:
            wire.append(("data", n, fin))
            self.sent += n
            if fin:
                self.flow.send_fin()
                self.fin_sent = True

    def deliver(self, frame: tuple[str, int, bool], peer: Side, back: Wire) -> None:
        kind, n, fin = frame
        if kind == "window":
            self.flow.on_window(n)
            return
        self.flow.on_data(n, fin)
        self.buffer += peer.out[peer.delivered : peer.delivered + n]
        peer.delivered += n

    def consume(self, n: int, back: Wire) -> None:
        n = min(n, len(self.buffer))
        if not n:
            return
        self.read += self.buffer[:n]
        del self.buffer[:n]
        grant = self.flow.consumed(n)
        if grant:
            back.append(("window", grant, False))

    def check(self) -> None:
        f = self.flow
        assert f.send_credit >= 0 and f.recv_credit >= 0 and f.to_grant >= 0
        assert f.unread == len(self.buffer)
        assert f.unread <= f.window            # bounded buffer, whatever the peer did
        if f.can_receive:
            assert f.unread + f.recv_credit + f.to_grant == f.window


@st.composite
def schedules(draw: st.DrawFn) -> tuple[int, bytes, bytes, list[tuple[int, int]]]:
    window = draw(st.sampled_from([1, 7, 64, 1000, 4096]))
    a = draw(st.binary(max_size=6000))
    b = draw(st.binary(max_size=6000))
    steps = draw(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 3000)), max_size=300))
    return window, a, b, steps


@settings(max_examples=300, deadline=None)
@given(schedules())
def test_any_interleaving_keeps_credit_bounded_and_delivers_in_order(
    case: tuple[int, bytes, bytes, list[tuple[int, int]]],
) -> None:
    window, a_out, b_out, steps = case
    a = Side(1, a_out, window, window)
    b = Side(1, b_out, window, window)
    a_to_b: Wire = deque()
    b_to_a: Wire = deque()

    def step(action: int, n: int) -> None:
        if action == 0:
            a.try_send(n, a_to_b)
        elif action == 1:
            b.try_send(n, b_to_a)
        elif action == 2 and a_to_b:
            b.deliver(a_to_b.popleft(), a, b_to_a)
        elif action == 3 and b_to_a:
            a.deliver(b_to_a.popleft(), b, a_to_b)
        elif action == 4:
            b.consume(n, b_to_a)
        elif action == 5:
            a.consume(n, a_to_b)

    for action, n in steps:
        step(action, n)
        a.check()
        b.check()
    # Liveness: with readers that read and wires that deliver, everything gets through
    # (credit comes back); never a state where both wait on each other.
    for _ in range(100_000):
        if a.fin_sent and b.fin_sent and not a_to_b and not b_to_a and not a.buffer \
                and not b.buffer:
            break
        for action in range(6):
            step(action, 1 << 20)
        a.check()
        b.check()
    else:
        raise AssertionError("duplex model stalled with credit outstanding")
    assert bytes(b.read) == a_out and bytes(a.read) == b_out
    assert not a.flow.can_receive and not b.flow.can_receive


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 6), st.integers(0, 5), st.lists(st.integers(0, 50), max_size=400),
       st.sampled_from([16, 100, 1024]))
def test_a_stalled_reader_never_starves_the_other_streams(
    n_streams: int, stalled: int, order: list[int], window: int,
) -> None:
    """N streams share one connection whose reader takes every frame as it comes (the
    shell never stops reading for one stream). Stream ``stalled``'s application never
    reads: its sender stops at one window, every other stream completes."""
    stalled %= n_streams
    size = 5 * window
    senders = [Side(2 * i + 1, os.urandom(size), window, window) for i in range(n_streams)]
    receivers = [Side(2 * i + 1, b"", window, window) for i in range(n_streams)]
    conn: Wire = deque()          # one ordered connection, frames tagged by stream
    tags: deque[int] = deque()
    back: list[Wire] = [deque() for _ in range(n_streams)]

    def round_(pick: int) -> None:
        i = pick % n_streams
        before = len(conn)
        senders[i].try_send(pick * 37 + 1, conn)
        tags.extend([i] * (len(conn) - before))
        if conn:                               # the connection reads one frame, any stream
            j = tags.popleft()
            receivers[j].deliver(conn.popleft(), senders[j], back[j])
        for k in range(n_streams):
            if k != stalled:
                receivers[k].consume(pick * 13 + 1, back[k])
            while back[k]:
                senders[k].deliver(back[k].popleft(), receivers[k], conn)

    for pick in order:
        round_(pick)
    for _ in range(20 * n_streams * size):
        if all(senders[k].fin_sent for k in range(n_streams) if k != stalled) and not conn:
            break
        for pick in range(n_streams):
            round_(pick)
    for k in range(n_streams):
        receivers[k].check()
        senders[k].check()
        if k == stalled:
            assert receivers[k].flow.unread <= window
            assert senders[k].sent <= window      # stopped by credit, nothing more queued
        else:
            receivers[k].consume(size, back[k])
            assert bytes(receivers[k].read) == senders[k].out
    total_held = sum(r.flow.unread for r in receivers)
    assert total_held <= n_streams * window


def test_a_peer_beyond_its_credit_or_after_its_fin_is_a_protocol_error() -> None:
    f = DuplexFlow(1, window=100)
    f.on_data(60, False)
    with pytest.raises(RemoteProtocolError, match=r"sent 41 bytes on duplex stream 1 with "
                       r"only 40 bytes of credit left \(window 100\): it ignores WINDOW"):
        f.on_data(41, False)
    f.on_data(40, True)
    with pytest.raises(RemoteProtocolError, match="1 bytes on duplex stream 1 after the "
                       "peer's FIN"):
        f.on_data(1, False)
    g = DuplexFlow(3, window=100, peer_window=10)
    with pytest.raises(RemoteProtocolError, match="over 2147483647"):
        g.on_window(MAX_WINDOW)
    assert g.sendable(1 << 20) == 10
    g.sent(10)
    assert g.sendable(5) == 0
    g.on_window(5)
    assert g.sendable(1 << 20) == 5
    g.send_fin()
    with pytest.raises(LocalProtocolError, match="closed for writing"):
        g.sendable(1)


def test_window_frames_and_chunks() -> None:
    assert decode_window(encode_window(65536), 5) == 65536
    for bad in (b"", b"\x00\x00\x00", b"\x00\x00\x00\x00", b"\x80\x00\x00\x00",
                b"\x00\x00\x00\x01\x00"):
        with pytest.raises(RemoteProtocolError, match="WINDOW frame on stream 5"):
            decode_window(bad, 5)
    with pytest.raises(LocalProtocolError):
        encode_window(0)
    f = DuplexFlow(1, peer_window=MAX_WINDOW)
    assert f.sendable(10 << 20) == MAX_CHUNK
    with pytest.raises(InvalidArgument):
        DuplexFlow(1, window=0)


def test_grants_are_batched_and_stop_after_fin() -> None:
    f = DuplexFlow(1, window=1000)
    f.on_data(1000, False)
    assert [f.consumed(1) for _ in range(249)] == [0] * 249
    assert f.consumed(1) == 250            # a quarter of the window read: grant it back
    assert f.recv_credit == 250
    f.on_data(250, True)
    assert f.consumed(1000) == 0           # the peer sends nothing more: no WINDOW


def test_half_close_table_is_complete_and_illegal_events_name_the_state() -> None:
    events = ("send_fin", "recv_fin", "end")
    for state, row in DUPLEX_TRANSITIONS.items():
        assert set(row) <= set(events) and "end" in row
        for ev in set(events) - set(row):
            f = DuplexFlow(1)
            f.state = state
            with pytest.raises((LocalProtocolError, RemoteProtocolError), match=state):
                f._step(ev)  # type: ignore[arg-type]


# =================================================================== real sockets
def duplex_router(**kw: Any) -> Router:
    r = Router()

    async def echo(body: Any, s: Any) -> int:
        n = 0
        async for chunk in s:
            n += len(chunk)
            await s.send(chunk)
        return n

    async def upper_after_eof(body: Any, s: Any) -> str:
        """Reads everything first (the caller's half-close), then answers."""
        data = bytearray()
        while chunk := await s.recv():
            data += chunk
        await s.send(bytes(data).upper())
        s.close_write()
        return "done"

    async def flood(body: int, s: Any) -> int:
        await s.send(b"x" * body)
        return body

    async def fail_after(body: int, s: Any) -> None:
        await s.recv(body)
        raise SandboxNotFound("sandbox sb-gone not found", id="sb-gone")

    r.add("echo", echo, duplex=True)
    r.add("upper", upper_after_eof, duplex=True)
    r.add("flood", flood, duplex=True)
    r.add("fail_after", fail_after, duplex=True)
    r.add("plain", lambda body: body)
    for k, v in kw.items():
        r.add(k, v, duplex=True)
    return r


async def test_echo_moves_every_byte_in_order_both_ways(served: Served) -> None:
    conn = await served(duplex_router())
    data = os.urandom(3 * INITIAL_WINDOW + 12345)
    s = conn.duplex("echo", timeout=30)

    async def writer() -> None:
        for i in range(0, len(data), 100_000):
            await s.send(data[i : i + 100_000])
        s.close_write()

    t = asyncio.create_task(writer())
    got = bytearray()
    async for chunk in s:
        got += chunk
    await t
    assert bytes(got) == data
    assert await s.result() == len(data)
    assert await conn.call("plain", 7) == 7


async def test_half_close_each_way(served: Served) -> None:
    conn = await served(duplex_router())
    s = conn.duplex("upper")
    await s.send(b"hello, ")
    await s.send(b"world")
    s.close_write()
    s.close_write()                      # idempotent
    with pytest.raises(LocalProtocolError, match="closed for writing"):
        await s.send(b"more")
    assert await s.recv() == b"HELLO, WORLD"
    assert await s.recv() == b""         # the server's FIN
    assert await s.result() == "done"
    assert await s.recv() == b""


async def test_a_stalled_stream_does_not_stall_another_on_the_same_connection(
    served: Served,
) -> None:
    conn = await served(duplex_router())
    server = await served.server_side(conn)
    stalled = conn.duplex("flood", 8 * INITIAL_WINDOW)  # never read until the end
    await asyncio.sleep(0.05)
    for _ in range(3):
        busy = conn.duplex("echo", timeout=30)
        data = os.urandom(2 * 1024 * 1024)
        t = asyncio.create_task(busy.send(data))
        got = bytearray()
        while len(got) < len(data):
            got += await busy.recv()
        await t
        busy.close_write()
        assert await busy.result() == len(data) and bytes(got) == data
        # The stalled stream holds at most its window, here and in the server's sender.
        assert stalled.unread <= INITIAL_WINDOW
        assert conn._decoder.buffered < INITIAL_WINDOW + 64 * 1024
    (srv_stream,) = [d for d in server._duplex.values() if d.method == "flood"]
    assert srv_stream._flow.send_credit == 0       # waiting for credit, not buffering
    got_n = 0
    async for chunk in stalled:
        got_n += len(chunk)
    assert got_n == 8 * INITIAL_WINDOW and await stalled.result() == got_n


async def test_a_peer_that_ignores_credit_is_cut_with_the_reason(raw_client_of: Any,
                                                                  tmp_path: Any) -> None:
    from dsec.aether import serve

    got: list[int] = []

    async def sink(body: Any, s: Any) -> None:
        await asyncio.sleep(30)            # never reads: only credit bounds the peer

    srv = await serve(duplex_router(sink=sink), f"unix:{tmp_path}/s.sock")
    try:
        peer = await raw_client_of(srv)
        peer.send(int(FrameType.REQUEST), 1, method_prefix("sink") + b"\xc0",
                  int(FrameFlags.DUPLEX))
        chunk = b"z" * MAX_CHUNK
        for _ in range(INITIAL_WINDOW // MAX_CHUNK):
            peer.send(int(FrameType.STREAM), 1, chunk)
        peer.send(int(FrameType.STREAM), 1, b"!")   # one byte over the window
        _, _, payload, _ = await peer.frame_of(FrameType.GOAWAY)
        reason = msgspec.msgpack.decode(payload, type=Goaway).reason
        assert "protocol error" in reason and "ignores WINDOW flow control" in reason
        assert "1 bytes on duplex stream 1 with only 0 bytes of credit" in reason
        assert await peer.closed_by_peer()
        got.append(1)
    finally:
        await srv.close()
    assert got


async def test_reset_from_the_caller_cancels_the_handler_only(served: Served) -> None:
    cancelled = asyncio.Event()

    async def wait_forever(body: Any, s: Any) -> None:
        try:
            await s.recv()
            await s.recv()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    conn = await served(duplex_router(wait_forever=wait_forever))
    other = conn.duplex("echo")
    s = conn.duplex("wait_forever")
    await s.send(b"a")
    await asyncio.sleep(0.02)
    s.reset()
    with pytest.raises(StreamReset, match="reset by this side"):
        await s.recv()
    with pytest.raises(StreamReset):
        await s.send(b"b")
    async with asyncio.timeout(5):
        await cancelled.wait()
    await other.send(b"still here")
    assert await other.recv() == b"still here"
    other.close_write()
    assert await other.result() == 10


async def test_a_failing_handler_resets_the_callers_stream_with_its_error(
    served: Served,
) -> None:
    conn = await served(duplex_router())
    s = conn.duplex("fail_after", 3)
    await s.send(b"abc")
    with pytest.raises(SandboxNotFound, match="sb-gone"):
        await s.recv()
    with pytest.raises(SandboxNotFound):
        await s.result()
    assert await conn.call("plain", 1) == 1


async def test_wrong_call_kind_timeout_and_lost_connection(served: Served) -> None:
    conn = await served(duplex_router())
    with pytest.raises(InvalidArgument, match=r"must be called with Connection.duplex\(\)"):
        await conn.call("echo")
    s = conn.duplex("plain", 1)
    with pytest.raises(InvalidArgument, match=r"must be called with Connection.call\(\)"):
        await s.result()
    slow = conn.duplex("echo", timeout=0.1)
    with pytest.raises(RequestTimeout):
        await slow.recv()
    live = conn.duplex("echo")
    await live.send(b"x")
    assert await live.recv() == b"x"
    await conn.close()
    with pytest.raises(ConnectionLost):
        await live.recv()
    with pytest.raises(ConnectionLost):
        await live.send(b"y")


async def test_many_streams_interleaved_on_one_connection(served: Served) -> None:
    conn = await served(duplex_router())

    async def one(i: int) -> None:
        data = os.urandom(1000 + 7919 * i)
        s = conn.duplex("echo", timeout=30)
        t = asyncio.create_task(s.send(data))
        got = bytearray()
        while len(got) < len(data):
            got += await s.recv()
        await t
        s.close_write()
        assert bytes(got) == data and await s.result() == len(data)

    await asyncio.gather(*(one(i) for i in range(40)),
                         *(conn.call("plain", i) for i in range(40)))
    assert not conn._duplex


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 300_000), min_size=1, max_size=8),
       st.lists(st.integers(1, 200_000), min_size=1, max_size=8), st.booleans())
def test_real_sockets_any_write_and_read_sizes_deliver_every_byte_in_order(
        writes: list[int], reads: list[int], uv: bool) -> None:
    """Over a real socketpair, on either loop: random write sizes one way, random read
    sizes the other, the echo back; bytes in == bytes out, in order, both ways, and
    what is buffered unread never exceeds the window."""
    import socket

    import uvloop

    from dsec.aether import Connection

    async def main() -> None:
        a, b = socket.socketpair()
        (r1, w1) = await asyncio.open_connection(sock=a)
        (r2, w2) = await asyncio.open_connection(sock=b)
        server = Connection(r2, w2, router=duplex_router(), dialer=False, name="s")
        client = Connection(r1, w1, name="c")
        try:
            data = os.urandom(sum(writes))
            s = client.duplex("echo", timeout=60)

            async def writer() -> None:
                off = 0
                for n in writes:
                    await s.send(data[off : off + n])
                    off += n
                s.close_write()

            t = asyncio.create_task(writer())
            got = bytearray()
            i = 0
            while True:
                assert s.unread <= INITIAL_WINDOW
                chunk = await s.recv(reads[i % len(reads)])
                i += 1
                if not chunk:
                    break
                assert len(chunk) <= reads[(i - 1) % len(reads)]
                got += chunk
            await t
            assert bytes(got) == data
            assert await s.result() == len(data)
        finally:
            await client.close()
            await server.close()

    (uvloop.run if uv else asyncio.run)(main())
