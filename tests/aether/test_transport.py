"""Transports: Unix sockets and TCP, listener and dialer, addresses."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from pathlib import Path
from typing import Any

import pytest
import uvloop

from dsec.aether import Address, Router, connect, parse_address, serve
from dsec.errors import ConnectFailed, ConnectionLost, InvalidArgument, TransportError


def _router() -> Router:
    r = Router()
    r.add("echo", lambda b: b)

    async def whoami(_: Any) -> str:
        return "async"

    r.add("whoami", whoami)
    return r


async def _exercise(address: str) -> Address:
    server = await serve(_router(), address)
    try:
        conn = await connect(server.address)
        try:
            assert await conn.call("echo", [1, b"two"]) == [1, b"two"]
            assert await conn.call("whoami") == "async"
            assert await conn.call_batch([("echo", i) for i in range(50)]) == list(range(50))
            assert await conn.ping(b"x") == b"x"
        finally:
            await conn.close()
        return server.address
    finally:
        await server.close()


async def test_unix_socket(tmp_path: Path) -> None:
    path = tmp_path / "run" / "edge.sock"
    addr = await _exercise(f"unix:{path}")
    assert addr == Address("unix", path=str(path))
    assert not path.exists()  # close() removes the socket file


async def test_tcp_on_an_ephemeral_port() -> None:
    addr = await _exercise("tcp:127.0.0.1:0")
    assert addr.kind == "tcp" and addr.port != 0


def test_both_transports_under_uvloop(tmp_path: Path) -> None:
    async def main() -> None:
        await _exercise(f"unix:{tmp_path}/u.sock")
        await _exercise("tcp:127.0.0.1:0")

    uvloop.run(main())


async def test_unix_socket_is_private_and_a_stale_file_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "edge.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # a socket file nobody listens on, as a crashed process leaves it
    server = await serve(_router(), f"unix:{path}")
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with pytest.raises(TransportError, match="a live process already serves it"):
            await serve(_router(), f"unix:{path}")
        conn = await connect(f"unix:{path}")
        assert await conn.call("echo", 1) == 1
        await conn.close()
    finally:
        await server.close()


async def test_server_close_closes_its_connections(tmp_path: Path) -> None:
    server = await serve(_router(), f"unix:{tmp_path}/s.sock")
    conn = await connect(server.address)
    assert await conn.call("echo", 1) == 1
    await server.close()
    with pytest.raises(ConnectionLost):
        async with asyncio.timeout(5):
            while True:  # the GOAWAY/EOF may take a moment to arrive
                await conn.call("echo", 2)
                await asyncio.sleep(0.01)
    assert conn.going_away or conn.closed
    await conn.close()


async def test_connecting_to_nothing_is_connect_failed(tmp_path: Path) -> None:
    """Nothing was sent: ConnectFailed, not ConnectionLost (which says a request on the
    connection may have been carried out)."""
    with pytest.raises(ConnectFailed, match="could not connect to unix:"):
        await connect(f"unix:{tmp_path}/nobody.sock")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens on this port now
    with pytest.raises(ConnectFailed, match=f"could not connect to tcp:127.0.0.1:{port}"):
        await connect(f"tcp:127.0.0.1:{port}")


async def test_listening_on_a_taken_port_is_a_transport_error() -> None:
    first = await serve(_router(), "tcp:127.0.0.1:0")
    try:
        with pytest.raises(TransportError, match="cannot listen on tcp:127.0.0.1"):
            await serve(_router(), str(first.address))
    finally:
        await first.close()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("tcp:127.0.0.1:7070", Address("tcp", host="127.0.0.1", port=7070)),
        ("tcp:[::1]:80", Address("tcp", host="::1", port=80)),
        ("tcp:edge-3.local:0", Address("tcp", host="edge-3.local", port=0)),
        ("unix:/run/dsec/edge.sock", Address("unix", path="/run/dsec/edge.sock")),
    ],
)
def test_parse_address(text: str, expected: Address) -> None:
    assert parse_address(text) == expected
    if expected.kind == "tcp":
        assert parse_address(str(expected)) == expected


@pytest.mark.parametrize("bad", ["", "edge.sock", "unix:", "tcp:host", "tcp:host:99999",
                                 "tcp::80", "http://x:1"])
def test_bad_addresses_say_what_to_write(bad: str) -> None:
    with pytest.raises(InvalidArgument, match="use 'unix:/path/to.sock' or 'tcp:HOST:PORT'"):
        parse_address(bad)
