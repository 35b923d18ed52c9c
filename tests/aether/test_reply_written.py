"""``after_reply_written``: what a handler holds for its reply is given back once the reply
is out (the apiserver's reply budget), on every way a call ends. Holding while a peer does
not read is tested through the gateway (tests/control/test_reply_budget.py)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import msgspec
import pytest

from dsec.aether import Router, after_reply_written, serve
from dsec.aether.frame import FrameType
from dsec.aether.messages import encode_request
from dsec.errors import InvalidArgument

from .conftest import RawPeer, Served


def _router(log: list[str]) -> Router:
    r = Router()

    async def big(n: int) -> bytes:
        after_reply_written(lambda: log.append(f"written {n}"))
        return b"x" * n

    async def fails(_: Any) -> None:
        after_reply_written(lambda: log.append("after error"))
        raise InvalidArgument("no")

    async def child(_: Any) -> int:
        done = asyncio.Event()

        async def sub() -> None:     # inherits the handler's context: not the handler
            after_reply_written(lambda: log.append("child ended"))
            await done.wait()
        t = asyncio.ensure_future(sub())
        await asyncio.sleep(0)
        done.set()
        await t
        return 1

    async def hang(_: Any) -> None:
        after_reply_written(lambda: log.append("cancelled"))
        await asyncio.Event().wait()

    r.add("big", big)
    r.add("fails", fails)
    r.add("child", child)
    r.add("hang", hang)
    return r


async def _until(cond: Any) -> None:
    async with asyncio.timeout(5):
        while not cond():
            await asyncio.sleep(0.01)


async def test_hooks_run_once_the_reply_is_out_or_the_call_ended(served: Served) -> None:
    log: list[str] = []
    conn = await served(_router(log))
    assert len(await conn.call("big", 3 << 20)) == 3 << 20
    await _until(lambda: "written 3145728" in log)
    assert await conn.call("big", 10) == b"x" * 10
    await _until(lambda: "written 10" in log)
    with pytest.raises(InvalidArgument):
        await conn.call("fails")
    await _until(lambda: "after error" in log)
    assert await conn.call("child") == 1
    await _until(lambda: "child ended" in log)
    with pytest.raises(Exception):           # noqa: B017 - whatever the timeout raises
        await conn.call("hang", timeout=0.2)  # the caller gives up: CANCEL
    await _until(lambda: "cancelled" in log)
    assert sorted(log) == sorted(["written 3145728", "written 10", "after error",
                                  "child ended", "cancelled"])


def test_outside_a_handler_the_hook_runs_at_once() -> None:
    log: list[int] = []
    after_reply_written(lambda: log.append(1))
    assert log == [1]


async def test_a_peer_that_does_not_read_keeps_them_pending_parked_ones_too(
        tmp_path: object) -> None:
    """Two 6 MiB replies to a peer that reads nothing: the first fills the write buffer
    (writing pauses), the second is parked behind it; neither hook runs until the peer
    reads them both; a peer that hangs up instead releases them too."""
    log: list[str] = []
    srv = await serve(_router(log), f"unix:{tmp_path}/s")
    try:
        for ending in ("read", "hang up"):
            log.clear()
            reader, writer = await asyncio.open_unix_connection(f"{tmp_path}/s")
            peer = RawPeer(reader, writer)
            for sid in (1, 3):
                payload = encode_request("big", msgspec.msgpack.encode(6 << 20))
                peer.send(int(FrameType.REQUEST), sid, payload)
            await asyncio.sleep(0.5)               # both answered, nothing read
            assert log == [], log
            if ending == "read":
                for _ in range(2):
                    assert (await peer.frame_of(FrameType.RESPONSE, timeout=10))[0]
            else:
                await peer.close()
            await _until(lambda: len(log) == 2)
            assert log == ["written 6291456"] * 2
            await peer.close()
    finally:
        await srv.close()



@pytest.mark.parametrize("link", ["unix", "tcp"])
async def test_a_reply_under_high_water_is_written_once_the_buffer_is_empty(
        tmp_path: Any, link: str) -> None:
    """Red team 21, B9: a 3 MiB reply (under the 4 MiB high-water mark) to a peer that
    reads nothing stays pending (it is in this process, not in the kernel); meanwhile
    the connection still reads and answers (the drain watch is no backpressure); once
    the peer reads it all, the hook runs and the buffer marks are back."""
    log: list[str] = []
    if link == "unix":
        srv = await serve(_router(log), f"unix:{tmp_path}/s")
        reader, writer = await asyncio.open_unix_connection(f"{tmp_path}/s")
    else:                   # the gateway's listener: plain TCP (TLS is a proxy's)
        srv = await serve(_router(log), "tcp:127.0.0.1:0")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        sock.connect(("127.0.0.1", srv.address.port))
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock)
    peer = RawPeer(reader, writer)
    try:
        await _until(lambda: len(srv.connections) == 1)
        (conn,) = srv.connections
        if link == "tcp":   # loopback TCP autotunes to MiBs: what the kernel takes is out
            conn._transport.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        peer.send(int(FrameType.REQUEST), 1,
                  encode_request("big", msgspec.msgpack.encode(3 << 20)))
        await asyncio.sleep(0.5)                   # answered, nothing read
        assert log == [], log
        peer.send(int(FrameType.REQUEST), 3,
                  encode_request("fails", msgspec.msgpack.encode(None)))
        await _until(lambda: "after error" in log)   # still read and served
        assert "written 3145728" not in log
        sids: set[int] = set()
        while len(sids) < 2:
            _, sid, _, _ = await peer.frame(timeout=10)
            sids.add(sid)
        await _until(lambda: "written 3145728" in log)
        assert not conn._drain_watch and not conn._protocol._watch_paused
    finally:
        await peer.close()
        await srv.close()
