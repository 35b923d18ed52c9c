"""Aether test fixtures: real sockets on both ends, plus a raw peer that speaks frames by
hand so tests can send what a well-behaved Connection never would."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest
import uvloop

from dsec.aether import Connection, Router, Server, connect, serve
from dsec.aether.frame import FrameDecoder, FrameType, encode_parts


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[
    str, Callable[[], asyncio.AbstractEventLoop]
]:
    """Every async Aether test runs on the stdlib loop and on uvloop (what dsec runs on):
    their transports differ in flow control and write paths."""
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


class RawPeer:
    """One end of a socket driven frame by frame (no Connection logic)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = FrameDecoder()
        self.received = bytearray()

    def send_raw(self, data: bytes) -> None:
        self.writer.write(data)

    def send(self, ftype: int, sid: int, payload: bytes = b"", flags: int = 0) -> None:
        self.writer.write(encode_parts(ftype, sid, payload, flags) + payload)

    async def frame(self, timeout: float = 5.0) -> tuple[int, int, bytes, int]:
        """The next frame the other end sent (raises TimeoutError if none comes)."""
        async with asyncio.timeout(timeout):
            while True:
                f = self.decoder.next_raw()
                if f is not None:
                    return f
                data = await self.reader.read(65536)
                if not data:
                    raise EOFError("the other end closed the connection")
                self.received += data
                self.decoder.feed(data)

    async def frame_of(self, ftype: FrameType, timeout: float = 5.0) -> tuple[int, int, bytes, int]:
        """The next frame of ``ftype``, skipping others (e.g. a GOAWAY before a close)."""
        while True:
            f = await self.frame(timeout)
            if f[0] == ftype:
                return f

    async def closed_by_peer(self, timeout: float = 5.0) -> bool:
        """True once the other end closes; frames sent before that are skipped."""
        async with asyncio.timeout(timeout):
            while await self.reader.read(65536):
                pass
        return True

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass


@dataclass
class Pair:
    """A client Connection and the raw peer at the other end of its socket."""

    conn: Connection
    peer: RawPeer


async def socketpair_streams() -> tuple[
    tuple[asyncio.StreamReader, asyncio.StreamWriter],
    tuple[asyncio.StreamReader, asyncio.StreamWriter],
]:
    a, b = socket.socketpair()
    return await asyncio.open_connection(sock=a), await asyncio.open_connection(sock=b)


@pytest.fixture
async def raw_pair() -> AsyncIterator[Pair]:
    """A stream-pair Connection (dialer side) facing a RawPeer."""
    (r1, w1), (r2, w2) = await socketpair_streams()
    conn = Connection(r1, w1, name="under-test")
    peer = RawPeer(r2, w2)
    try:
        yield Pair(conn, peer)
    finally:
        await conn.close()
        await peer.close()


@pytest.fixture
async def raw_client_of(tmp_path: object) -> AsyncIterator[Callable[[Server], object]]:
    """Open RawPeers to a Server's address; all closed at the end."""
    peers: list[RawPeer] = []

    async def open_peer(server: Server) -> RawPeer:
        addr = server.address
        if addr.kind == "unix":
            r, w = await asyncio.open_unix_connection(addr.path)
        else:
            r, w = await asyncio.open_connection(addr.host, addr.port)
        p = RawPeer(r, w)
        peers.append(p)
        return p

    try:
        yield open_peer
    finally:
        for p in peers:
            await p.close()


class Served:
    """``await served(router)`` -> a client Connection to a server of ``router``.

    ``protocol``: serve()/connect() over a Unix socket (the transport-level variant).
    ``streams``: both ends are ``Connection(reader, writer)`` over a socketpair.
    """

    def __init__(self, variant: str, tmp_path: object) -> None:
        self.variant = variant
        self.tmp_path = tmp_path
        self.servers: list[Server] = []
        self.conns: list[Connection] = []
        self._server_side: dict[int, Connection | Server] = {}

    async def __call__(self, router: Router, **kw: int) -> Connection:
        if self.variant == "protocol":
            srv = await serve(router, f"unix:{self.tmp_path}/aether-{len(self.servers)}.sock",
                              **kw)
            self.servers.append(srv)
            c = await connect(srv.address, **kw)
            self._server_side[id(c)] = srv
        else:
            (r1, w1), (r2, w2) = await socketpair_streams()
            s = Connection(r2, w2, router=router, dialer=False, name="server", **kw)
            c = Connection(r1, w1, name="client", **kw)
            self.conns.append(s)
            self._server_side[id(c)] = s
        self.conns.append(c)
        return c

    async def server_side(self, client: Connection) -> Connection:
        """The serving Connection at the other end of ``client``."""
        s = self._server_side[id(client)]
        if isinstance(s, Connection):
            return s
        async with asyncio.timeout(5):
            while not s.connections:  # the accept may land after connect() returned
                await asyncio.sleep(0.001)
        (conn,) = s.connections
        return conn

    async def close(self) -> None:
        for c in self.conns:
            await c.close()
        for s in self.servers:
            await s.close()


@pytest.fixture(params=["protocol", "streams"])
async def served(request: pytest.FixtureRequest, tmp_path: object) -> AsyncIterator[Served]:
    s = Served(request.param, tmp_path)
    try:
        yield s
    finally:
        await s.close()
