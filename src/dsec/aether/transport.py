"""Aether transports: Unix domain sockets and TCP, listener and dialer.

Addresses are strings so they fit in config files and CLI flags:
``unix:/run/dsec/edge.sock`` or ``tcp:127.0.0.1:7070`` (``tcp:[::1]:7070`` for IPv6).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from typing import Literal, Self

from dsec.aether.connection import AUTH_METHOD, AetherProtocol, Connection, Router
from dsec.aether.frame import DEFAULT_MAX_FRAME
from dsec.errors import ConnectionLost, InvalidArgument, TransportError

__all__ = ["Address", "Server", "connect", "parse_address", "serve"]


@dataclass(slots=True, frozen=True)
class Address:
    kind: Literal["unix", "tcp"]
    path: str = ""
    host: str = ""
    port: int = 0

    def __str__(self) -> str:
        if self.kind == "unix":
            return f"unix:{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp:{host}:{self.port}"


def parse_address(text: str) -> Address:
    """Parse ``unix:PATH`` or ``tcp:HOST:PORT``."""
    kind, sep, rest = text.partition(":")
    if sep and kind == "unix" and rest:
        return Address("unix", path=os.path.abspath(rest))
    if sep and kind == "tcp":
        host, sep2, port = rest.rpartition(":")
        host = host.strip("[]")
        if sep2 and host and port.isdigit() and int(port) < 65536:
            return Address("tcp", host=host, port=int(port))
    raise InvalidArgument(
        f"invalid Aether address {text!r}: use 'unix:/path/to.sock' or 'tcp:HOST:PORT'"
    )


async def connect(
    address: str | Address, *, router: Router | None = None, timeout: float | None = 10.0,
    max_frame: int = DEFAULT_MAX_FRAME, token: bytes | str | None = None,
) -> Connection:
    """Dial ``address`` and return a ready connection (which can also serve ``router``).

    ``token``: authenticate first, for endpoints whose Router requires one."""
    addr = parse_address(address) if isinstance(address, str) else address
    loop = asyncio.get_running_loop()

    def factory() -> AetherProtocol:
        return AetherProtocol(router=router, dialer=True, max_frame=max_frame, name=str(addr))

    try:
        async with asyncio.timeout(timeout):
            if addr.kind == "unix":
                transport, proto = await loop.create_unix_connection(factory, addr.path)
            else:
                transport, proto = await loop.create_connection(factory, addr.host, addr.port)
    except TimeoutError as exc:
        raise ConnectionLost(f"could not connect to {addr} within {timeout}s") from exc
    except OSError as exc:
        raise ConnectionLost(f"could not connect to {addr}: {exc.strerror or exc}") from exc
    _tune(transport)
    assert proto.conn is not None  # set in connection_made
    conn = proto.conn
    if token is not None:
        raw = token.encode() if isinstance(token, str) else token
        try:
            await conn.call(AUTH_METHOD, raw, timeout=timeout)
        except BaseException:
            await conn.close("authentication failed")
            raise
    return conn


def _tune(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Server:
    """A listening Aether endpoint; every accepted connection serves ``router``."""

    def __init__(self, router: Router, address: Address, max_frame: int) -> None:
        self.router = router
        self.address = address
        self._max_frame = max_frame
        self._server: asyncio.base_events.Server | None = None
        self.connections: set[Connection] = set()

    def _protocol(self) -> AetherProtocol:
        return AetherProtocol(router=self.router, dialer=False, max_frame=self._max_frame,
                              name=f"{self.address}<-peer", on_connection=self._accepted)

    def _accepted(self, conn: Connection) -> None:
        _tune(conn._transport)
        self.connections.add(conn)
        conn._close_callbacks.append(self.connections.discard)

    async def start(self) -> Server:
        addr = self.address
        loop = asyncio.get_running_loop()
        if addr.kind == "unix":
            _make_private_dirs(os.path.dirname(addr.path) or ".")
            with contextlib.suppress(FileNotFoundError):
                if _socket_alive(addr.path):
                    raise TransportError(
                        f"cannot listen on {addr}: a live process already serves it; stop "
                        "it or pick another path")
                os.unlink(addr.path)  # a stale socket file from a process that died
            sock = _bind_private_unix(addr.path)
            try:
                self._server = await loop.create_unix_server(self._protocol, sock=sock)
            except BaseException:
                sock.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(addr.path)
                raise
        else:
            self._server = await loop.create_server(self._protocol, addr.host, addr.port)
            if addr.port == 0:  # report the port the kernel picked
                port = self._server.sockets[0].getsockname()[1]
                self.address = Address("tcp", host=addr.host, port=port)
        return self

    async def close(self, *, grace: float | None = None) -> None:
        """Stop listening, then close every connection (see ``Connection.close``)."""
        if self._server is not None:
            self._server.close()
        await asyncio.gather(
            *(c.close("server shutting down", grace=grace) for c in list(self.connections)),
            return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        if self.address.kind == "unix":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.address.path)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _make_private_dirs(path: str) -> None:
    """Create the missing directories of ``path``, each 0700. ``os.makedirs`` gives the
    ones it creates the umask's mode (0777 under umask 0), and a directory others may
    write lets them swap the socket for their own: the apiserver would then talk to an
    impostor edge. Directories that exist are left as they are."""
    missing: list[str] = []
    d = os.path.abspath(path)
    while not os.path.isdir(d):
        missing.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)


def _bind_private_unix(path: str) -> socket.socket:
    """A Unix socket bound at ``path`` that never exists there with a mode other than
    0600 (the edge socket is for root / the apiserver only: whoever connects runs
    commands in sandboxes). bind(2) creates the file with the umask's mode, so binding
    in place and chmod'ing after left a window (forever, under umask 0, for a peer that
    connected in it); instead bind inside a fresh 0700 directory next to ``path`` (via
    ``/proc/self/fd``, so a long ``path`` does not hit the 108-byte sun_path limit),
    chmod, and rename into place."""
    tmp = tempfile.mkdtemp(prefix=".aether-", dir=os.path.dirname(path) or ".")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        dfd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        try:
            sock.bind(f"/proc/self/fd/{dfd}/s")
            os.chmod("s", 0o600, dir_fd=dfd)
            os.rename("s", path, src_dir_fd=dfd)
        finally:
            os.close(dfd)
    except BaseException:
        sock.close()
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sock


def _socket_alive(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


async def serve(
    router: Router, address: str | Address, *, max_frame: int = DEFAULT_MAX_FRAME
) -> Server:
    """Listen on ``address`` and serve ``router`` until ``await server.close()``."""
    addr = parse_address(address) if isinstance(address, str) else address
    server = Server(router, addr, max_frame)
    try:
        return await server.start()
    except OSError as exc:
        raise TransportError(f"cannot listen on {addr}: {exc.strerror or exc}") from exc
