"""Aether transports: Unix domain sockets and TCP, listener and dialer.

Addresses are strings so they fit in config files and CLI flags:
``unix:/run/dsec/edge.sock`` or ``tcp:127.0.0.1:7070`` (``tcp:[::1]:7070`` for IPv6).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import errno
import ipaddress
import logging
import os
import socket
import ssl as _ssl
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Self

import msgspec

from dsec.aether.connection import AUTH_METHOD, AetherProtocol, Connection, Guard, Router
from dsec.aether.frame import DEFAULT_MAX_FRAME, FrameType, encode_parts
from dsec.aether.limits import (
    DEFAULT_LIMITS,
    Admission,
    ListenerStats,
    ProcessBudget,
    ServerLimits,
    process_budget,
)
from dsec.aether.messages import Goaway
from dsec.errors import ConnectFailed, ConnectionLost, InvalidArgument, Overloaded, TransportError
from dsec.rmtree import remove_tree

__all__ = ["Address", "Server", "connect", "parse_address", "peer_key", "refusal_frame",
           "serve"]

log = logging.getLogger("dsec.aether")

BACKLOG = 1024                  # listen(2) backlog: a burst waits to be refused, not dropped
ACCEPT_BATCH = 128              # accepts per readiness callback before other work runs
ACCEPT_BACKOFF_MIN = 0.05       # seconds accepting pauses after EMFILE, doubling ...
ACCEPT_BACKOFF_MAX = 1.0        # ... up to this
REFUSAL_LOG_INTERVAL = 10.0     # at most one refusal summary per listener this often
_OUT_OF_FDS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# accept() errors that concern one peer only (it left before we took it): carry on.
_PEER_GONE = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.ECONNRESET})
_UCRED = struct.Struct("3i")    # struct ucred: pid, uid, gid
# connect() errors that are this side's own shortage, not the peer's absence.
_LOCAL_ERRNOS = _OUT_OF_FDS | {errno.EADDRNOTAVAIL, errno.EAGAIN}
# A TLS 1.3 handshake is one round trip and a few ms of CPU; a peer that has not finished
# it in this long is not a client worth a pending slot (its slot is evictable sooner).
TLS_HANDSHAKE_TIMEOUT_S = 5.0


@dataclass(slots=True)
class _Handshake:
    """A socket admitted to a TLS listener whose handshake has not finished: it holds
    one pending slot of ``peer`` until ``released``."""
    peer: str
    released: bool = False


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
    ssl: _ssl.SSLContext | None = None, server_hostname: str | None = None,
    peer_check: Callable[[bytes], None] | None = None,
) -> Connection:
    """Dial ``address`` and return a ready connection (which can also serve ``router``).

    ``token``: authenticate first, for endpoints whose Router requires one.
    ``ssl``: TLS over a tcp: address (``server_hostname``: the name the peer's certificate
    must carry); ``peer_check`` is then given the peer certificate's DER right after the
    handshake, before any call, and refuses the connection by raising (the cluster's
    revocation denylist, :mod:`dsec.cluster.ca`)."""
    addr = parse_address(address) if isinstance(address, str) else address
    loop = asyncio.get_running_loop()

    def factory() -> AetherProtocol:
        return AetherProtocol(router=router, dialer=True, max_frame=max_frame, name=str(addr))

    try:
        async with asyncio.timeout(timeout):
            if addr.kind == "unix":
                transport, proto = await loop.create_unix_connection(factory, addr.path)
            elif ssl is not None:
                # TLS (joined edges): measured on loopback, 2-core VM under load, medians
                # (dsec.bench.cluster_join): 1 call in flight 24.6k/s plain vs 10.0k/s TLS
                # (quieter run: 27.8k vs 18.8k), 64 in flight 112k vs 100k (167k vs 147k):
                # one record per frame each way costs most when nothing is pipelined.
                transport, proto = await loop.create_connection(
                    factory, addr.host, addr.port, ssl=ssl, server_hostname=server_hostname,
                    ssl_handshake_timeout=timeout)
            else:
                transport, proto = await loop.create_connection(factory, addr.host, addr.port)
    except TimeoutError as exc:
        raise ConnectFailed(f"could not connect to {addr} within {timeout}s") from exc
    except _ssl.SSLError as exc:
        # the peer's certificate is not the CA's, names another node, or it refused ours
        raise ConnectFailed(f"TLS handshake with {addr} failed: {exc.reason or exc} (is "
                            f"the peer a node of this cluster, named "
                            f"{server_hostname!r}?)") from exc
    except OSError as exc:
        # Out of fds, buffers or ephemeral ports *here* says nothing about the peer: the
        # control plane must not write a node off for its own exhaustion.
        local = exc.errno in _LOCAL_ERRNOS
        why = " (a limit of this process or host, not of the peer)" if local else ""
        raise ConnectFailed(f"could not connect to {addr}: {exc.strerror or exc}{why}",
                            errno=exc.errno, local=local) from exc
    _tune(transport)
    assert proto.conn is not None  # set in connection_made
    conn = proto.conn
    if peer_check is not None:
        obj = transport.get_extra_info("ssl_object")
        der = obj.getpeercert(binary_form=True) if obj is not None else None
        try:
            if der is None:
                raise ConnectFailed(f"{addr}: no TLS peer certificate to check")
            peer_check(der)
        except BaseException:
            await conn.close("peer certificate refused")
            raise
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
    """A listening Aether endpoint; every accepted connection serves ``router``.

    The server runs its own accept loop (instead of ``loop.create_server``) so that it
    decides about a connection before a transport and protocol exist for it: a peer over
    one of the :class:`~dsec.aether.limits.ServerLimits` is sent a GOAWAY with code
    ``overloaded`` and the reason, and closed, for the price of one ``send``; and running
    out of file descriptors (EMFILE/ENFILE) neither spins nor stops the listener.
    """

    def __init__(self, router: Router, address: Address, max_frame: int | None = None, *,
                 limits: ServerLimits | None = None, budget: ProcessBudget | None = None,
                 ssl: _ssl.SSLContext | None = None) -> None:
        lim = limits or DEFAULT_LIMITS
        if max_frame is not None and max_frame != lim.max_frame:
            lim = dataclasses.replace(lim, max_frame=max_frame,
                                      pending_max_frame=min(lim.pending_max_frame, max_frame))
        self.router = router
        self.address = address
        self.ssl = ssl      # TLS on every accepted connection (tcp: only)
        self.limits = lim
        self.budget = budget or process_budget()
        self.stats = ListenerStats()
        self.admission = Admission(lim, self.budget, name=f"listener {address}",
                                   stats=self.stats)
        self.connections: set[Connection] = set()
        # Not yet authenticated, oldest first: when the listener's pending slots are full
        # the oldest is dropped for the newcomer, so a flood of idle connections cannot
        # lock out clients that authenticate at once (they hold a slot for one round trip).
        self._pending: dict[Connection, None] = {}
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._attaching: set[asyncio.Task[None]] = set()
        # TLS listeners: sockets still in their handshake, oldest first. They hold a
        # pending slot like a connection that has not authenticated, so they are evicted
        # like one (first: a peer past the handshake has shown the CA's certificate) -
        # else sockets that never send a ClientHello fill the listener and the
        # apiserver's own dial is refused (red team 16 F8).
        self._handshakes: dict[asyncio.Task[None], _Handshake] = {}
        self._closing = False
        self._paused: asyncio.TimerHandle | None = None
        self._backoff = ACCEPT_BACKOFF_MIN
        self._logged_at: float | None = None
        self._logged_refused = 0

    # ------------------------------------------------------------------ listening
    def _listen_socket(self) -> socket.socket:
        addr = self.address
        if addr.kind == "unix":
            _make_private_dirs(os.path.dirname(addr.path) or ".")
            with contextlib.suppress(FileNotFoundError):
                if _socket_alive(addr.path):
                    raise TransportError(
                        f"cannot listen on {addr}: a live process already serves it; stop "
                        "it or pick another path")
                os.unlink(addr.path)  # a stale socket file from a process that died
            # Appears 0600 and already listening (see _bind_private_unix): the edge
            # socket is for root / the apiserver only, and whoever sees the path may dial.
            sock = _bind_private_unix(addr.path, BACKLOG)
        else:
            infos = socket.getaddrinfo(addr.host, addr.port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
            family, _, _, _, sockaddr = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(sockaddr)
                sock.listen(BACKLOG)
            except BaseException:
                sock.close()
                raise
            if addr.port == 0:  # report the port the kernel picked
                self.address = Address("tcp", host=addr.host, port=sock.getsockname()[1])
        sock.setblocking(False)
        return sock

    async def start(self) -> Server:
        self._loop = asyncio.get_running_loop()
        self._sock = self._listen_socket()
        self.admission.name = f"listener {self.address}"
        self.budget.pools.add(self)
        self._loop.add_reader(self._sock.fileno(), self._on_acceptable)
        _SPARE.ensure()
        _return_big_buffers_to_the_os()
        return self

    def _on_acceptable(self) -> None:
        lsock = self._sock
        if lsock is None:
            return
        for _ in range(ACCEPT_BATCH):
            try:
                sock, addr = lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.stats.accept_errors += 1
                if exc.errno in _PEER_GONE:
                    continue
                if exc.errno in _OUT_OF_FDS:
                    self._out_of_fds(lsock, exc)
                else:
                    log.warning("accept on %s failed: %s; pausing %.2fs", self.address, exc,
                                self._backoff)
                    self._pause_accepting()
                return
            self._backoff = ACCEPT_BACKOFF_MIN
            self._admit(sock, addr)

    def _out_of_fds(self, lsock: socket.socket, exc: OSError) -> None:
        """accept() failed for want of a file descriptor: hand back the spare one to tell
        the peers waiting in the backlog why they are refused (so they do not hang), then
        stop accepting for a moment (so a full fd table is not polled in a busy loop)."""
        for _ in range(ACCEPT_BATCH):
            if not _SPARE.release():
                break
            try:
                sock, _ = lsock.accept()
            except OSError:
                break
            self._refuse(sock, "out_of_fds",
                         f"the server is out of file descriptors ({exc.strerror}); retry later")
            _SPARE.ensure()
        _SPARE.ensure()
        self._log_refusals(force=f"accept on {self.address}: {exc.strerror}")
        self._pause_accepting()

    def _pause_accepting(self) -> None:
        loop, lsock = self._loop, self._sock
        if loop is None or lsock is None or self._paused is not None:
            return
        loop.remove_reader(lsock.fileno())
        delay = self._backoff
        self._backoff = min(ACCEPT_BACKOFF_MAX, self._backoff * 2)
        self._paused = loop.call_later(delay, self._resume_accepting)

    def _resume_accepting(self) -> None:
        self._paused = None
        if self._loop is not None and self._sock is not None and not self._closing:
            self._loop.add_reader(self._sock.fileno(), self._on_acceptable)

    # ------------------------------------------------------------------ admission
    def _admit(self, sock: socket.socket, addr: Any) -> None:
        peer = _peer_key(sock, addr)
        verdict = self.admission.admit(peer)
        if verdict is not None and verdict[0] == "pending_full" and self.pending_count():
            self.evict_oldest_pending()
            verdict = self.admission.admit(peer)
        elif verdict is not None and verdict[0] == "fds" and self.budget.make_room():
            verdict = self.admission.admit(peer)
        if verdict is not None:
            self._refuse(sock, *verdict)
            return
        try:
            sock.setblocking(False)
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            sock.close()
            self.admission.release(peer, established=False)
            return
        assert self._loop is not None
        hs = _Handshake(peer)
        task = self._loop.create_task(self._attach(sock, peer, hs))
        self._attaching.add(task)
        task.add_done_callback(self._attaching.discard)
        if self.ssl is not None:
            self._handshakes[task] = hs
            task.add_done_callback(self._handshake_over)

    def _handshake_over(self, task: asyncio.Task[None]) -> None:
        self._handshakes.pop(task, None)

    def _release_handshake(self, hs: _Handshake) -> None:
        if not hs.released:
            hs.released = True
            self.admission.release(hs.peer, established=False)

    async def _attach(self, sock: socket.socket, peer: str, hs: _Handshake) -> None:
        assert self._loop is not None
        guard = Guard(limits=self.limits, budget=self.budget, stats=self.stats, peer=peer,
                      on_established=self._established)

        def accepted(conn: Connection) -> None:
            # the handshake is over: from here the Connection holds the slot (never
            # evicted as a handshake, never released twice)
            hs.released = True
            self._accepted(conn)

        def factory() -> AetherProtocol:
            return AetherProtocol(router=self.router, dialer=False,
                                  max_frame=self.limits.max_frame,
                                  name=f"{self.address}<-{peer or 'peer'}",
                                  on_connection=accepted, guard=guard)

        try:
            if self.ssl is None:
                await self._loop.connect_accepted_socket(factory, sock)
                return
            try:
                # The handshake happens here, bounded by a short deadline (at most the
                # auth deadline): a peer that opens a socket and never finishes it holds
                # a pending slot no longer than one that never authenticates, and is the
                # first evicted when the listener's pending slots are full.
                await self._loop.connect_accepted_socket(
                    factory, sock, ssl=self.ssl,
                    ssl_handshake_timeout=min(self.limits.auth_timeout_s or 60.0,
                                              TLS_HANDSHAKE_TIMEOUT_S))
            except (OSError, TimeoutError) as exc:   # ssl.SSLError is an OSError
                sock.close()
                self._release_handshake(hs)
                self.stats.refuse("tls")
                log.info("listener %s: TLS handshake with %s failed: %s", self.address,
                         peer, getattr(exc, "reason", None) or exc)
        except BaseException:
            sock.close()
            if self.ssl is None:
                self.admission.release(peer, established=False)
            else:
                self._release_handshake(hs)
            raise

    def pending_count(self) -> int:
        return len(self._pending) + len(self._handshakes)

    def evict_oldest_pending(self) -> bool:
        """Close the oldest connection that has not authenticated yet, to make room:
        first a socket still in its TLS handshake (its slot is given back at once, the
        handshake task is cancelled and closes the socket), else the oldest connection
        that has not authenticated."""
        while self._handshakes:
            task, hs = next(iter(self._handshakes.items()))
            del self._handshakes[task]
            if hs.released or task.done():
                continue
            self._release_handshake(hs)
            self.stats.refuse("evicted")
            task.cancel()
            return True
        if not self._pending:
            return False
        oldest = next(iter(self._pending))
        oldest._cut("evicted", "dropped to make room: the slots for connections that have "
                    "not authenticated yet are full; authenticate right after connecting",
                    code=Overloaded.code)
        return True

    def _accepted(self, conn: Connection) -> None:
        self.connections.add(conn)
        if not conn.established:
            self._pending[conn] = None
        conn._close_callbacks.append(self._released)
        if self._closing:
            conn._shutdown(ConnectionLost(f"connection {conn.name} closed: server shutting down"))

    def _established(self, conn: Connection) -> None:
        self._pending.pop(conn, None)
        self.admission.establish(conn.peer)

    def _released(self, conn: Connection) -> None:
        self._pending.pop(conn, None)
        if conn in self.connections:
            self.connections.discard(conn)
            self.admission.release(conn.peer, established=conn.established)

    def _refuse(self, sock: socket.socket, kind: str, reason: str) -> None:
        """Tell the peer why (GOAWAY, code ``overloaded``) and close, without a transport.
        On a TLS listener the refusal is a plain close: a plaintext frame is no answer a
        TLS client can read (it reports a garbled record, not the reason)."""
        self.stats.refuse(kind)
        if self.ssl is not None:
            with contextlib.suppress(OSError):
                sock.close()
            self._log_refusals()
            return
        try:
            sock.setblocking(False)
            sock.send(refusal_frame(reason))
            sock.shutdown(socket.SHUT_WR)
            # Read what the peer already sent (e.g. its auth call): closing with unread
            # input makes the kernel answer RST, which can overtake our GOAWAY.
            for _ in range(4):
                if not sock.recv(65536):
                    break
        except OSError:  # BlockingIOError: nothing (more) to read; or the peer is gone
            pass
        finally:
            sock.close()
        self._log_refusals()

    def _log_refusals(self, force: str = "") -> None:
        assert self._loop is not None
        now = self._loop.time()
        last = self._logged_at
        if not force and last is not None and now - last < REFUSAL_LOG_INTERVAL:
            return
        total = self.stats.refused_total
        log.warning("%slistener %s refused %d connection(s)%s (so far by kind: %s); open %d, "
                    "waiting to authenticate %d", f"{force}: " if force else "", self.address,
                    total - self._logged_refused,
                    "" if last is None else f" in the last {now - last:.0f}s",
                    self.stats.refused, self.admission.open, self.admission.pending)
        self._logged_at = now
        self._logged_refused = total

    # ------------------------------------------------------------------ closing
    async def close(self, *, grace: float | None = None) -> None:
        """Stop listening, then close every connection (see ``Connection.close``)."""
        self._closing = True
        self.budget.pools.discard(self)
        if self._paused is not None:
            self._paused.cancel()
            self._paused = None
        lsock, self._sock = self._sock, None
        if lsock is not None:
            if self._loop is not None:
                self._loop.remove_reader(lsock.fileno())
            lsock.close()
        if self._attaching:
            await asyncio.gather(*list(self._attaching), return_exceptions=True)
        await asyncio.gather(
            *(c.close("server shutting down", grace=grace) for c in list(self.connections)),
            return_exceptions=True)
        if self.address.kind == "unix" and lsock is not None:
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


def _bind_private_unix(path: str, backlog: int) -> socket.socket:
    """A listening Unix socket at ``path`` that never exists there with a mode other than
    0600, nor before it listens (the edge socket is for root / the apiserver only:
    whoever connects runs commands in sandboxes; and a client that waits for the path
    must not be refused). bind(2) creates the file with the umask's mode, so it is bound
    inside a fresh 0700 directory next to ``path`` (via ``/proc/self/fd``, so a long
    ``path`` does not hit the 108-byte sun_path limit), chmod'ed, set listening, and
    renamed into place."""
    tmp = tempfile.mkdtemp(prefix=".aether-", dir=os.path.dirname(path) or ".")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        dfd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        try:
            sock.bind(f"/proc/self/fd/{dfd}/s")
            os.chmod("s", 0o600, dir_fd=dfd)
            sock.listen(backlog)
            os.rename("s", path, src_dir_fd=dfd)
        finally:
            os.close(dfd)
    except BaseException:
        sock.close()
        raise
    finally:
        remove_tree(tmp)
    return sock


def refusal_frame(reason: str) -> bytes:
    """A whole GOAWAY frame (stream 0, code ``overloaded``) saying why a connection is
    refused; the peer's calls fail with :class:`~dsec.errors.Overloaded`."""
    body = msgspec.msgpack.encode(Goaway(reason=reason[:1000], code=Overloaded.code))
    return encode_parts(int(FrameType.GOAWAY), 0, body) + body


def _peer_key(sock: socket.socket, addr: Any) -> str:
    """What per-peer limits count by: the IP of a TCP peer, the uid of a Unix one."""
    if sock.family == socket.AF_UNIX:
        try:
            cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            return f"uid:{_UCRED.unpack(cred)[1]}"
        except OSError:
            return "unix"
    if isinstance(addr, tuple) and addr:
        return peer_key(str(addr[0]))
    return str(addr)


def peer_key(host: str) -> str:
    """What per-address limits count an IP peer by: an IPv4 address as is; an IPv6 one
    by its /64 (one host is handed a whole /64: 2^64 addresses would make per-address
    limits moot); an IPv4-mapped one by its IPv4."""
    if ":" not in host:
        return host
    try:
        ip = ipaddress.IPv6Address(host.split("%", 1)[0])
    except ValueError:
        return host
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))


class _SpareFd:
    """One file descriptor the process keeps in hand so that, when ``accept`` fails with
    EMFILE, a listener can still accept one peer at a time to tell it why it is refused
    (libuv's "EMFILE trick", plus the reason)."""

    def __init__(self) -> None:
        self.fd: int | None = None

    def ensure(self) -> None:
        if self.fd is None:
            try:
                self.fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self.fd = None

    def release(self) -> bool:
        if self.fd is None:
            return False
        os.close(self.fd)
        self.fd = None
        return True


_SPARE = _SpareFd()

# glibc raises its mmap threshold each time a mmapped block is freed (up to 32 MiB), so
# after the first big partial frames are freed, later ones come from the heap and stay
# mapped when freed. Measured with 1,000 authenticated senders each holding 1 MiB of a
# 16 MiB frame, three rounds, RSS over the idle baseline after they hung up: dynamic
# threshold 66 -> 244 -> 271 MB; pinned at 1 MiB 83 -> 117 -> 117 MB (at 128 KiB 88 ->
# 94 -> 94 MB, but every 256 KiB socket read would then be an mmap/munmap pair).
_MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3          # mallopt parameter number (malloc.h)
_pinned = False


def _return_big_buffers_to_the_os() -> None:
    """Pin glibc's mmap threshold (once per process, unless the operator set
    MALLOC_MMAP_THRESHOLD_): buffers of large frames are then unmapped when freed."""
    global _pinned
    if _pinned:
        return
    _pinned = True
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
    except (OSError, AttributeError):  # not glibc: its own policy stands
        pass


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
    router: Router, address: str | Address, *, max_frame: int | None = None,
    limits: ServerLimits | None = None, budget: ProcessBudget | None = None,
    ssl: _ssl.SSLContext | None = None,
) -> Server:
    """Listen on ``address`` and serve ``router`` until ``await server.close()``.

    ``limits``: what one listener lets its peers hold (default
    :data:`~dsec.aether.limits.DEFAULT_LIMITS`); ``max_frame`` overrides its frame limit.
    ``budget``: what all listeners of the process share (default: the process's).
    ``ssl``: serve TLS on a tcp: address (a server context, e.g. one requiring client
    certificates of the cluster CA: :func:`dsec.cluster.ca.server_context`)."""
    addr = parse_address(address) if isinstance(address, str) else address
    if ssl is not None and addr.kind != "tcp":
        raise InvalidArgument(f"TLS is for tcp: listeners, not {addr}")
    server = Server(router, addr, max_frame, limits=limits, budget=budget, ssl=ssl)
    try:
        return await server.start()
    except OSError as exc:
        raise TransportError(f"cannot listen on {addr}: {exc.strerror or exc}") from exc
