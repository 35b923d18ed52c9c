"""Connections over real sockets: multiplexing, batches, streams, cancellation, errors.

Most tests run twice (fixture ``served``): over serve()/connect() on a Unix socket, and
over two ``Connection(reader, writer)`` on a socketpair.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from dsec.aether import Connection, Router
from dsec.aether.frame import FrameFlags, FrameType, encode_parts
from dsec.aether.messages import ErrorBody, Goaway, encode_request
from dsec.errors import (
    ConnectionLost,
    InternalError,
    InvalidArgument,
    PayloadTooLarge,
    RemoteProtocolError,
    RequestTimeout,
    SandboxNotFound,
    UnknownMethod,
)

from .conftest import Pair, RawPeer, Served, socketpair_streams


class Point(msgspec.Struct):
    x: int
    y: int


def basic_router() -> Router:
    r = Router()
    r.add("echo", lambda body: body)
    r.add("add", lambda p: p.x + p.y, request_type=Point)

    async def sleep_echo(body: list[Any]) -> Any:
        await asyncio.sleep(body[0])
        return body[1]

    r.add("sleep_echo", sleep_echo)
    return r


# ------------------------------------------------------------------ basic calls
async def test_calls_typed_bodies_and_ping(served: Served) -> None:
    conn = await served(basic_router())
    assert await conn.call("echo", {"a": [1, b"raw"]}) == {"a": [1, b"raw"]}
    assert await conn.call("echo") is None
    assert await conn.call("add", Point(2, 3)) == 5
    assert await conn.call("echo", {"x": 1, "y": 2}, response_type=Point) == Point(1, 2)
    assert await conn.ping(b"hello") == b"hello"
    assert conn.in_flight == 0


async def test_interleaved_concurrent_calls_each_get_their_own_reply(served: Served) -> None:
    conn = await served(basic_router())
    rnd = random.Random(7)
    delays = [rnd.choice([0, 0, 0.001, 0.005, 0.01]) for _ in range(300)]

    async def one(i: int) -> Any:
        if i % 3 == 0:
            return await conn.call("echo", i)
        return await conn.call("sleep_echo", [delays[i], i])

    results = await asyncio.gather(*(one(i) for i in range(300)))
    assert results == list(range(300))


async def test_call_batch_mixes_results_and_errors(served: Served) -> None:
    conn = await served(basic_router())
    calls = [("echo", i) for i in range(100)] + [("nope", None), ("add", "not a point")]
    out = await conn.call_batch(calls, return_exceptions=True)
    assert out[:100] == list(range(100))
    assert isinstance(out[100], UnknownMethod)
    assert isinstance(out[101], InvalidArgument)
    with pytest.raises(UnknownMethod):
        await conn.call_batch(calls)
    assert await conn.call_batch([]) == []
    assert await conn.call_batch([("echo", {"x": 1, "y": 1})], response_type=Point) == [Point(1, 1)]


async def test_call_batch_is_n_calls_on_the_wire() -> None:
    """The bytes of call_batch([...]) equal those of N concurrent call()s, byte for byte."""
    calls = [("echo", i) for i in range(10)] + [("add", {"x": 1, "y": 2})]

    async def capture(use_batch: bool) -> bytes:
        (r1, w1), (r2, w2) = await socketpair_streams()
        conn = Connection(r1, w1)
        peer = RawPeer(r2, w2)
        try:
            if use_batch:
                task = asyncio.ensure_future(conn.call_batch(calls))
            else:
                task = asyncio.ensure_future(
                    asyncio.gather(*(conn.call(m, b) for m, b in calls)))
            for _ in calls:
                _, sid, _, _ = await peer.frame()
                peer.send(FrameType.RESPONSE, sid, b"\xc0")
            assert await task == [None] * len(calls)
            return bytes(peer.received)
        finally:
            await conn.close()
            await peer.close()

    batch_bytes = await capture(True)
    calls_bytes = await capture(False)
    expected = b"".join(
        encode_parts(FrameType.REQUEST, 1 + 2 * i, p) + p
        for i, p in enumerate(encode_request(m, msgspec.msgpack.encode(b)) for m, b in calls))
    assert batch_bytes == calls_bytes == expected


async def test_replies_arriving_byte_by_byte_and_in_random_fragments(raw_pair: Pair) -> None:
    conn, peer = raw_pair.conn, raw_pair.peer
    tasks = [asyncio.ensure_future(conn.call("echo", i)) for i in range(20)]
    sids = [(await peer.frame())[1] for _ in range(20)]
    bodies = [msgspec.msgpack.encode(["x" * (i * 37), i]) for i in range(20)]
    wire = b"".join(encode_parts(FrameType.RESPONSE, sid, b) + b
                    for sid, b in zip(reversed(sids), reversed(bodies), strict=True))
    rnd = random.Random(11)
    i = 0
    while i < len(wire):
        n = 1 if i < 400 else rnd.randint(1, 300)  # first frames one byte per write
        peer.send_raw(wire[i : i + n])
        await peer.writer.drain()
        await asyncio.sleep(0)  # let the connection read each piece on its own
        i += n
    # replies came in reverse order; each call still gets its own
    assert await asyncio.gather(*tasks) == [["x" * (i * 37), i] for i in range(20)]


# ----------------------------------------------------------- server exceptions
async def test_handler_errors_come_back_typed_and_the_connection_stays_usable(
    served: Served,
) -> None:
    r = Router()

    def missing(body: Any) -> None:
        raise SandboxNotFound(f"sandbox {body} not found", sandbox_id=body)

    def buggy(body: Any) -> None:
        raise ZeroDivisionError("division by zero")

    async def async_buggy(body: Any) -> None:
        await asyncio.sleep(0)
        raise KeyError(body)

    def huge_detail(body: Any) -> None:
        raise SandboxNotFound("sandbox gone", big=2**70)

    r.add("missing", missing)
    r.add("buggy", buggy)
    r.add("async_buggy", async_buggy)
    r.add("huge_detail", huge_detail)
    r.add("unencodable", lambda body: object())
    r.add("returns_coroutine", lambda body: asyncio.sleep(0))
    r.add("echo", lambda body: body)
    conn = await served(r)

    with pytest.raises(SandboxNotFound) as e:
        await conn.call("missing", "sb-9")
    assert e.value.message == "sandbox sb-9 not found"
    assert e.value.detail == {"sandbox_id": "sb-9"}
    with pytest.raises(InternalError, match="ZeroDivisionError: division by zero"):
        await conn.call("buggy")
    with pytest.raises(InternalError, match="KeyError: 'k'"):
        await conn.call("async_buggy", "k")
    with pytest.raises(SandboxNotFound, match="sandbox gone") as e:
        await conn.call("huge_detail")
    assert e.value.detail == {}
    with pytest.raises(InternalError, match="cannot be encoded"):
        await conn.call("unencodable")
    with pytest.raises(InternalError, match="register an `async def` handler"):
        await conn.call("returns_coroutine")
    assert await conn.call("echo", "still fine") == "still fine"
    assert not conn.closed


async def test_unknown_method_and_bad_body_answer_errors_not_disconnects(served: Served) -> None:
    conn = await served(basic_router())
    with pytest.raises(UnknownMethod, match="unknown Aether method 'nope'.*serves: add, echo"):
        await conn.call("nope")
    with pytest.raises(InvalidArgument, match="the add request does not decode: "):
        await conn.call("add", {"x": "one"})
    assert await conn.call("add", Point(1, 1)) == 2


async def test_undecodable_bodies_and_bad_prefixes_from_a_raw_client() -> None:
    """A hand-written REQUEST with garbage gets an ERROR frame, then the peer goes on."""
    (r1, w1), (r2, w2) = await socketpair_streams()
    served_conn = Connection(r2, w2, router=basic_router(), dialer=False)
    peer = RawPeer(r1, w1)
    try:
        async def error_for(sid: int, payload: bytes) -> ErrorBody:
            peer.send(FrameType.REQUEST, sid, payload)
            ftype, rsid, body, _ = await peer.frame()
            assert (ftype, rsid) == (FrameType.ERROR, sid)
            return msgspec.msgpack.decode(body, type=ErrorBody)

        eb = await error_for(1, b"\x04echo\xc1")  # 0xc1 is never valid msgpack
        assert eb.code == "invalid_argument" and "does not decode" in eb.message
        eb = await error_for(3, b"\x04echo")  # no body at all
        assert eb.code == "invalid_argument"
        eb = await error_for(5, b"\x09ech")  # method length longer than the payload
        assert eb.code == "local_protocol_error" and "method name prefix" in eb.message
        eb = await error_for(7, b"\x00\xc0")
        assert eb.code == "local_protocol_error"
        eb = await error_for(9, b"\x03\xff\xfe\xfd\xc0")
        assert eb.code == "unknown_method"
        peer.send(FrameType.REQUEST, 11, b"\x04echo\xa2ok")
        assert await peer.frame() == (FrameType.RESPONSE, 11, b"\xa2ok", 0)
        assert not served_conn.closed
    finally:
        await served_conn.close()
        await peer.close()


async def test_calling_a_streaming_method_with_call_is_invalid(served: Served) -> None:
    r = Router()

    @r.route("tail", streaming=True)
    async def tail(body: Any, out: Any) -> None:
        await out.send(1)

    r.add("echo", lambda b: b)
    conn = await served(r)
    with pytest.raises(InvalidArgument, match="must be called with Connection.stream"):
        await conn.call("tail")
    with pytest.raises(InvalidArgument, match="must be called with Connection.call"):
        async for _ in conn.stream("echo", 1):
            pass


# ------------------------------------------------------------------- streaming
async def test_streaming_items_then_result(served: Served) -> None:
    r = Router()

    @r.route("count", streaming=True)
    async def count(n: int, out: Any) -> str:
        for i in range(n):
            await out.send({"i": i, "data": b"x" * i})
        return "done"

    @r.route("fail_midway", streaming=True)
    async def fail_midway(n: int, out: Any) -> None:
        for i in range(n):
            await out.send(i)
        raise SandboxNotFound("sandbox vanished mid-stream")

    conn = await served(r)
    s = conn.stream("count", 200)
    items = [item async for item in s]
    assert items == [{"i": i, "data": b"x" * i} for i in range(200)]
    assert s.result == "done"

    got: list[int] = []
    with pytest.raises(SandboxNotFound, match="vanished"):
        async for item in conn.stream("fail_midway", 5):
            got.append(item)
    assert got == [0, 1, 2, 3, 4]
    assert conn.in_flight == 0


# ----------------------------------------------------- cancellation, timeouts
def blocking_router() -> tuple[Router, dict[str, asyncio.Event]]:
    """A ``block`` handler that waits forever and records its start and cancellation."""
    r = Router()
    events: dict[str, asyncio.Event] = {}

    async def block(key: str) -> None:
        events.setdefault(key + ":started", asyncio.Event()).set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            events.setdefault(key + ":cancelled", asyncio.Event()).set()
            raise

    @r.route("block_stream", streaming=True)
    async def block_stream(key: str, out: Any) -> None:
        await out.send("first")
        await block(key)

    r.add("block", block)
    r.add("echo", lambda b: b)
    return r, events


async def wait_for_event(events: dict[str, asyncio.Event], key: str) -> None:
    async with asyncio.timeout(5):
        while key not in events:
            await asyncio.sleep(0.001)
        await events[key].wait()


async def test_cancelling_the_caller_cancels_the_server_handler(served: Served) -> None:
    r, events = blocking_router()
    conn = await served(r)
    task = asyncio.ensure_future(conn.call("block", "a"))
    await wait_for_event(events, "a:started")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for_event(events, "a:cancelled")
    assert conn.in_flight == 0
    assert await conn.call("echo", 1) == 1


async def test_a_timeout_raises_request_timeout_and_cancels_the_handler(served: Served) -> None:
    r, events = blocking_router()
    conn = await served(r)
    with pytest.raises(RequestTimeout, match="'block' got no reply within its request timeout"):
        await conn.call("block", "t", timeout=0.05)
    await wait_for_event(events, "t:cancelled")
    with pytest.raises(InvalidArgument, match="positive"):
        await conn.call("echo", timeout=0)


async def test_call_batch_timeout_fails_only_the_slow_calls(served: Served) -> None:
    r, events = blocking_router()
    conn = await served(r)
    out = await conn.call_batch([("echo", 1), ("block", "b1"), ("echo", 2), ("block", "b2")],
                                timeout=0.1, return_exceptions=True)
    assert out[0] == 1 and out[2] == 2
    assert isinstance(out[1], RequestTimeout) and isinstance(out[3], RequestTimeout)
    await wait_for_event(events, "b1:cancelled")
    await wait_for_event(events, "b2:cancelled")


async def test_cancelling_a_batch_cancels_every_handler(served: Served) -> None:
    r, events = blocking_router()
    conn = await served(r)
    task = asyncio.ensure_future(conn.call_batch([("block", "c1"), ("block", "c2")]))
    await wait_for_event(events, "c2:started")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for_event(events, "c1:cancelled")
    await wait_for_event(events, "c2:cancelled")


async def test_leaving_a_stream_early_cancels_its_handler(served: Served) -> None:
    r, events = blocking_router()
    conn = await served(r)
    async with conn.stream("block_stream", "s") as s:
        assert await s.__anext__() == "first"
    await wait_for_event(events, "s:cancelled")
    with pytest.raises(RequestTimeout):
        async for _ in conn.stream("block_stream", "s2", timeout=0.05):
            pass
    await wait_for_event(events, "s2:cancelled")


async def test_closing_cancels_running_handlers_and_fails_pending_calls(served: Served) -> None:
    r, events = blocking_router()
    conn = await served(r)
    task = asyncio.ensure_future(conn.call("block", "z"))
    await wait_for_event(events, "z:started")
    await conn.close("test over")
    with pytest.raises(ConnectionLost, match="test over"):
        await task
    await wait_for_event(events, "z:cancelled")
    with pytest.raises(ConnectionLost):
        await conn.call("echo")


# ------------------------------------------------------------------ size limits
async def test_oversize_bodies_are_refused_before_sending(served: Served) -> None:
    r = basic_router()
    r.add("big_reply", lambda n: b"x" * n)
    conn = await served(r, max_frame=4096)
    with pytest.raises(PayloadTooLarge, match="exceeds the connection's max_frame of 4096"):
        await conn.call("echo", b"x" * 5000)
    with pytest.raises(PayloadTooLarge):
        await conn.call_batch([("echo", 1), ("echo", b"x" * 5000)])
    with pytest.raises(PayloadTooLarge, match="reply to 'big_reply' is 5003 bytes"):
        await conn.call("big_reply", 5000)
    assert await conn.call("big_reply", 4000) == b"x" * 4000
    assert conn.in_flight == 0 and not conn.closed


async def test_large_payloads_with_backpressure(served: Served) -> None:
    """Many MiB in flight both ways: callers wait on the write buffer, nothing is lost."""
    conn = await served(basic_router())
    blob = bytes(range(256)) * 4096  # 1 MiB
    out = await asyncio.gather(*(conn.call("echo", [i, blob]) for i in range(24)))
    assert [o[0] for o in out] == list(range(24))
    assert all(o[1] == blob for o in out)


# ------------------------------------------------------ corruption from a peer
CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    "magic": lambda w: b"HTTP" + w[4:],
    "version": lambda w: w[:4] + b"\x00\x07" + w[6:],
    "oversize": lambda w: w[:15] + (1 << 30).to_bytes(4, "big") + w[19:],
    "crc": lambda w: w[:-1] + bytes([w[-1] ^ 1]),
    "type": lambda w: w[:14] + b"\x63" + w[15:],
}


def _reply_frame(sid: int) -> bytes:
    return encode_parts(FrameType.RESPONSE, sid, b"\xc0") + b"\xc0"


@pytest.mark.parametrize("kind", [*CORRUPTIONS, "truncated"])
async def test_corrupt_reply_closes_the_connection_and_fails_pending_calls(
    raw_pair: Pair, kind: str
) -> None:
    conn, peer = raw_pair.conn, raw_pair.peer
    calls = [asyncio.ensure_future(conn.call("echo", i)) for i in range(3)]
    for _ in range(3):
        await peer.frame()
    peer.send_raw(_reply_frame(1))  # the first call completes normally
    if kind == "truncated":
        peer.send_raw(_reply_frame(3)[:-5])
        await peer.close()
    else:
        peer.send_raw(CORRUPTIONS[kind](_reply_frame(3)))
    assert await calls[0] is None
    for t in calls[1:]:
        with pytest.raises(ConnectionLost, match="sent invalid data") as e:
            await t
        assert isinstance(e.value.__cause__, RemoteProtocolError)
    assert conn.closed
    assert isinstance(conn.protocol_error, RemoteProtocolError)
    with pytest.raises(ConnectionLost):
        await conn.call("echo")


@pytest.mark.parametrize("kind", [*CORRUPTIONS, "reused-stream-id"])
async def test_corrupt_request_closes_only_that_connection(
    kind: str, tmp_path: Any, raw_client_of: Any
) -> None:
    from dsec.aether import connect, serve

    server = await serve(basic_router(), f"unix:{tmp_path}/c.sock")
    good = await connect(server.address)
    try:
        bad = await raw_client_of(server)
        req = encode_request("echo", b"\xa1x")
        if kind == "reused-stream-id":
            bad.send(FrameType.REQUEST, 5, req)
            bad.send(FrameType.REQUEST, 3, req)
        else:
            bad.send_raw(CORRUPTIONS[kind](encode_parts(FrameType.REQUEST, 1, req) + req))
        _, _, body, _ = await bad.frame_of(FrameType.GOAWAY)
        assert "protocol error" in msgspec.msgpack.decode(body, type=Goaway).reason
        assert await bad.closed_by_peer()
        assert await good.call("echo", "unaffected") == "unaffected"
        assert len(server.connections) == 1
    finally:
        await good.close()
        await server.close()


async def test_peer_closing_fails_pending_calls(raw_pair: Pair) -> None:
    conn, peer = raw_pair.conn, raw_pair.peer
    task = asyncio.ensure_future(conn.call("echo"))
    await peer.frame()
    await peer.close()
    with pytest.raises(ConnectionLost, match="closed by peer"):
        await task


async def test_reply_for_an_abandoned_call_is_dropped(raw_pair: Pair) -> None:
    conn, peer = raw_pair.conn, raw_pair.peer
    gone = asyncio.ensure_future(conn.call("echo"))
    _, old, _, _ = await peer.frame()
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    peer.send(FrameType.RESPONSE, old, b"\xc0")
    peer.send(FrameType.STREAM, old, b"\xc0")
    peer.send(FrameType.ERROR, old, b"\xc1")
    task = asyncio.ensure_future(conn.call("echo"))
    _, sid, _, _ = await peer.frame_of(FrameType.REQUEST)
    peer.send(FrameType.RESPONSE, sid, b"\xa2ok")
    assert await task == "ok"


@pytest.mark.parametrize("ftype", [FrameType.RESPONSE, FrameType.STREAM, FrameType.ERROR,
                                   FrameType.PONG, FrameType.WINDOW, FrameType.CANCEL])
async def test_a_frame_for_a_stream_never_opened_closes_the_connection(
        raw_pair: Pair, ftype: FrameType) -> None:
    # Nothing answers such frames (no backpressure): a peer free to send them forever
    # would cost a decode each, for as long as it likes. No honest peer sends one.
    conn = raw_pair.conn
    task = asyncio.ensure_future(conn.call("echo"))
    await raw_pair.peer.frame()
    raw_pair.peer.send(ftype, 10**9 + (ftype is FrameType.CANCEL), b"\x00\x00\x00\x01")
    with pytest.raises(ConnectionLost, match="never opened"):
        await task
    assert conn.closed and conn.protocol_error is not None


async def test_late_frames_past_the_per_call_budget_close_the_connection(
        raw_pair: Pair) -> None:
    conn, peer = raw_pair.conn, raw_pair.peer
    conn.limit_late_frames(4)
    gone = asyncio.ensure_future(conn.call("echo"))
    _, old, _, _ = await peer.frame()
    gone.cancel()
    for _ in range(8):              # one call opened: 4 x (1 + 1) tolerated
        peer.send(FrameType.STREAM, old, b"\xc0")
    task = asyncio.ensure_future(conn.call("echo"))
    _, sid, _, _ = await peer.frame_of(FrameType.REQUEST)
    peer.send(FrameType.RESPONSE, sid, b"\xa2ok")
    assert await task == "ok" and not conn.closed
    for _ in range(5):
        peer.send(FrameType.STREAM, old, b"\xc0")
    await asyncio.wait_for(conn.wait_closed(), 5)
    assert conn.closed and "late frames per call" in str(conn.protocol_error)


async def test_undecodable_reply_fails_only_that_call(raw_pair: Pair) -> None:
    conn, peer = raw_pair.conn, raw_pair.peer
    t1 = asyncio.ensure_future(conn.call("echo"))
    t2 = asyncio.ensure_future(conn.call("echo", response_type=Point))
    t3 = asyncio.ensure_future(conn.call("echo"))
    sids = [(await peer.frame())[1] for _ in range(3)]
    peer.send(FrameType.RESPONSE, sids[0], b"\xc1")
    peer.send(FrameType.RESPONSE, sids[1], b"\xa2no")
    peer.send(FrameType.ERROR, sids[2], b"\xc1")
    with pytest.raises(RemoteProtocolError, match="does not decode as msgpack"):
        await t1
    with pytest.raises(RemoteProtocolError, match="does not decode as Point"):
        await t2
    with pytest.raises(RemoteProtocolError, match="undecodable ERROR body"):
        await t3
    t4 = asyncio.ensure_future(conn.call("echo"))
    _, sid, _, _ = await peer.frame()
    peer.send(FrameType.RESPONSE, sid, b"\x01")
    assert await t4 == 1


async def test_the_peer_is_answered_pings_and_cancels_frames_flow(raw_pair: Pair) -> None:
    conn, peer = raw_pair.conn, raw_pair.peer
    peer.send(FrameType.PING, 2, b"are you there")
    assert await peer.frame() == (FrameType.PONG, 2, b"are you there", 0)
    task = asyncio.ensure_future(conn.call("echo", timeout=0.05))
    req = await peer.frame()
    assert req[0] == FrameType.REQUEST and req[3] == 0
    with pytest.raises(RequestTimeout):
        await task
    assert await peer.frame() == (FrameType.CANCEL, req[1], b"", 0)
    s = conn.stream("tail", "x")
    req = await peer.frame()
    assert req[0] == FrameType.REQUEST and req[3] == FrameFlags.STREAMING | FrameFlags.CREDIT
    s.cancel()
    assert await peer.frame() == (FrameType.CANCEL, req[1], b"", 0)


# ------------------------------------------------------------------------ GOAWAY
async def test_goaway_fails_unprocessed_calls_as_retryable(raw_pair: Pair) -> None:
    conn, peer = raw_pair.conn, raw_pair.peer
    t1 = asyncio.ensure_future(conn.call("echo", 1))
    t3 = asyncio.ensure_future(conn.call("echo", 3))
    await peer.frame()
    await peer.frame()
    peer.send(FrameType.GOAWAY, 0, msgspec.msgpack.encode(Goaway(reason="draining",
                                                                 last_stream_id=1)))
    with pytest.raises(ConnectionLost, match="not processed and is safe to retry") as e:
        await t3
    assert e.value.detail == {"retryable": True}
    assert conn.going_away
    with pytest.raises(ConnectionLost, match="GOAWAY \\(draining\\)"):
        await conn.call("echo")
    peer.send(FrameType.RESPONSE, 1, b"\x01")  # the processed call still completes
    assert await t1 == 1


async def test_graceful_close_lets_calls_in_flight_finish(served: Served) -> None:
    conn = await served(basic_router())
    slow = asyncio.ensure_future(conn.call("sleep_echo", [0.05, "finished"]))
    await asyncio.sleep(0.01)
    server_conn = await served.server_side(conn)
    closing = asyncio.ensure_future(server_conn.close("maintenance", grace=5))
    assert await slow == "finished"
    await closing
    with pytest.raises(ConnectionLost):
        await conn.call("echo")


async def test_goaway_drops_requests_that_crossed_it() -> None:
    """After sending GOAWAY a side starts no handler for later requests."""
    (r1, w1), (r2, w2) = await socketpair_streams()
    ran: list[int] = []
    r = Router()
    r.add("note", lambda i: ran.append(i))
    srv = Connection(r2, w2, router=r, dialer=False)
    peer = RawPeer(r1, w1)
    try:
        peer.send(FrameType.REQUEST, 1, encode_request("note", b"\x01"))
        assert (await peer.frame())[0] == FrameType.RESPONSE
        closing = asyncio.ensure_future(srv.close("bye", grace=0.2))
        ftype, sid, body, _ = await peer.frame()
        assert (ftype, sid) == (FrameType.GOAWAY, 0)
        assert msgspec.msgpack.decode(body, type=Goaway) == Goaway(reason="bye", last_stream_id=1)
        peer.send(FrameType.REQUEST, 3, encode_request("note", b"\x03"))
        await closing
        assert ran == [1]
    finally:
        await srv.close()
        await peer.close()


# ------------------------------------------------------------- flow control
@pytest.mark.parametrize("variant", ["protocol", "streams"])
async def test_a_client_that_never_reads_replies_is_not_buffered_without_bound(
    tmp_path: Any, raw_client_of: Any, variant: str
) -> None:
    from dsec.aether import serve
    from dsec.aether.connection import WRITE_HIGH_WATER

    r = Router()
    r.add("big", lambda _: b"x" * (1 << 20))
    server = None
    if variant == "protocol":
        server = await serve(r, f"unix:{tmp_path}/fc.sock")
        peer = await raw_client_of(server)
    else:
        (r1, w1), (r2, w2) = await socketpair_streams()
        sconn = Connection(r2, w2, router=r, dialer=False)
        peer = RawPeer(r1, w1)
    try:
        req = encode_request("big", b"\xc0")
        for i in range(64):  # asks for 64 MiB of replies, reads none of them
            peer.send(FrameType.REQUEST, 1 + 2 * i, req)
        async with asyncio.timeout(5):
            if server is not None:
                while not server.connections:
                    await asyncio.sleep(0.001)
                (sconn,) = server.connections
            while not sconn._pause:
                await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        buffered = sconn._transport.get_write_buffer_size()
        # at most a high-water mark in the socket plus one mark's worth of replies being
        # flushed when the check fired - not the 64 MiB asked for
        assert buffered <= 2 * WRITE_HIGH_WATER + (1 << 20)
        # reading the replies lets the server go on, and every reply arrives
        for i in range(64):
            ftype, sid, payload, _ = await peer.frame()
            assert (ftype, sid, len(payload)) == (FrameType.RESPONSE, 1 + 2 * i, (1 << 20) + 5)
    finally:
        if server is not None:
            await server.close()
        else:
            await sconn.close()
            await peer.close()
