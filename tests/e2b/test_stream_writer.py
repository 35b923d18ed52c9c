"""The envd stream writer (dsec.control.e2b.stream.ConnectStream) at the ASGI seam, with
a real asyncio loop and an in-memory client: what a process stream writes (one final
write with the end), the keep-alive of a quiet stream that then goes on (the old
``wait_for`` cancelled the watch it timed out), a client that goes away closing the edge
stream, and errors ending the stream as Connect says. Pure: no cluster."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator
from typing import Any

import pytest

from dsec.control.e2b import connect as rpc
from dsec.control.e2b.stream import KEEPALIVE, ConnectStream
from dsec.errors import NotFound

FIRST = rpc.envelope({"event": {"start": {"pid": 7}}})


def _frames(body: bytes) -> list[tuple[int, Any]]:
    out, i = [], 0
    while i < len(body):
        flags, n = struct.unpack_from(">BI", body, i)
        out.append((flags, json.loads(body[i + 5:i + 5 + n])))
        i += 5 + n
    return out


class _Client:
    """The ASGI side of one request: records each message; ``leave()`` disconnects."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._gone = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)

    def leave(self) -> None:
        self._gone.set()

    @property
    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.messages if m["type"] == "http.response.body"]


def _frame(item: Any) -> tuple[bytes, bool]:
    if item == "end":
        return rpc.envelope({"event": {"end": {"exitCode": 0}}}) + rpc.END_OK, True
    return rpc.data_event("stdout", item.encode()), False


def test_a_quick_stream_is_start_then_one_final_write() -> None:
    closed: list[bool] = []

    async def source() -> AsyncIterator[str]:
        try:
            yield "aGk="
            yield "end"
            yield "never read"
        finally:
            closed.append(True)

    async def main() -> _Client:
        c = _Client()

        async def open_() -> AsyncIterator[str]:
            return source()
        await ConnectStream(FIRST, open_, _frame, lambda e: b"", keepalive_s=30)(
            {}, c.receive, c.send)
        return c
    c = asyncio.run(main())
    start = c.messages[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert (b"content-type", b"application/connect+json") in start["headers"]
    bodies = c.bodies
    assert [m.get("more_body") for m in c.messages[1:]] == [True, True, False]
    assert bodies[0] == FIRST
    assert _frames(bodies[1]) == [(0, {"event": {"data": {"stdout": "aGk="}}})]
    # the end event and the end-of-stream envelope: one write, the last
    assert _frames(bodies[2]) == [(0, {"event": {"end": {"exitCode": 0}}}), (2, {})]
    assert closed == [True]          # the edge stream was closed after its end


def test_a_quiet_stream_gets_keepalives_and_goes_on() -> None:
    """Past several keep-alive periods of silence the stream still delivers what comes
    next (the old writer's ``wait_for`` cancelled the edge stream at its first timeout:
    a WatchDir went deaf after 50 s)."""
    async def main() -> _Client:
        c = _Client()
        release = asyncio.Event()

        async def source() -> AsyncIterator[str]:
            await release.wait()
            yield "bGF0ZQ=="
            yield "end"

        async def open_() -> AsyncIterator[str]:
            return source()
        task = asyncio.ensure_future(ConnectStream(
            FIRST, open_, _frame, lambda e: b"", keepalive_s=0.05, watch_after_s=0.01)(
            {}, c.receive, c.send))
        await asyncio.sleep(0.3)
        release.set()
        await asyncio.wait_for(task, 5)
        return c
    c = asyncio.run(main())
    bodies = c.bodies
    kas = [b for b in bodies if b == KEEPALIVE]
    assert 2 <= len(kas) <= 8, len(kas)
    assert _frames(bodies[-2]) == [(0, {"event": {"data": {"stdout": "bGF0ZQ=="}}})]
    assert _frames(bodies[-1])[-1] == (2, {})
    assert c.messages[-1]["more_body"] is False


def test_a_client_that_leaves_closes_the_edge_stream() -> None:
    async def main() -> tuple[_Client, list[str], bool]:
        c = _Client()
        events: list[str] = []

        async def source() -> AsyncIterator[str]:
            try:
                yield "YQ=="
                await asyncio.sleep(3600)     # a process that runs on, silent
                yield "end"
            finally:
                events.append("closed")

        async def open_() -> AsyncIterator[str]:
            return source()
        task = asyncio.ensure_future(ConnectStream(
            FIRST, open_, _frame, lambda e: b"", keepalive_s=30, watch_after_s=0.01)(
            {}, c.receive, c.send))
        await asyncio.sleep(0.05)
        c.leave()
        await asyncio.wait_for(task, 5)      # returns quietly: no CancelledError
        return c, events, task.cancelled()
    c, events, cancelled = asyncio.run(main())
    assert events == ["closed"] and not cancelled
    assert all(m.get("more_body", True) for m in c.messages[1:])   # no end written


def test_a_cancel_from_outside_still_propagates() -> None:
    async def main() -> None:
        c = _Client()

        async def source() -> AsyncIterator[str]:
            await asyncio.sleep(3600)
            yield "end"

        async def open_() -> AsyncIterator[str]:
            return source()
        task = asyncio.ensure_future(ConnectStream(
            FIRST, open_, _frame, lambda e: b"", keepalive_s=30, watch_after_s=0.01)(
            {}, c.receive, c.send))
        await asyncio.sleep(0.05)
        task.cancel()                         # a server shutting down, not the client
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(main())


@pytest.mark.parametrize("where", ["open", "read"])
def test_errors_end_the_stream_as_connect_says(where: str) -> None:
    async def main() -> _Client:
        c = _Client()

        async def source() -> AsyncIterator[str]:
            yield "YQ=="
            raise NotFound("process 7 is gone")

        async def open_() -> AsyncIterator[str]:
            if where == "open":
                raise NotFound("process 7 is gone")
            return source()

        def on_error(exc: BaseException) -> bytes:
            return rpc.end_stream(("not_found", str(exc)))
        await ConnectStream(FIRST, open_, _frame, on_error, keepalive_s=30)(
            {}, c.receive, c.send)
        return c
    c = asyncio.run(main())
    assert c.messages[-1]["more_body"] is False
    assert _frames(c.bodies[-1]) == [(2, {"error": {"code": "not_found",
                                                    "message": "process 7 is gone"}})]


def test_envelopes_built_by_concatenation_match_json() -> None:
    assert rpc.data_event("stderr", b"AAE=") == rpc.envelope(
        {"event": {"data": {"stderr": "AAE="}}})
    assert rpc.END_OK == rpc.end_stream() == rpc.frame(b"{}", rpc.END_STREAM)
    # a name that is not UTF-8 (surrogate-escaped) still encodes, escaped
    odd = b"f\xff".decode("utf-8", "surrogateescape")
    assert _frames(rpc.envelope({"name": odd})) == [(0, {"name": odd})]
