"""Real blob store servers on loopback, started by the tests: moto's standalone S3
server, Debian's nginx serving a directory (GET with Range, WebDAV PUT/DELETE), and a
TCP proxy that injects faults between a client and either of them.

Each server runs in its own temp dir and process and is torn down by its fixture
(tests/image/blob/conftest.py); nothing is left listening or on disk.
"""

from __future__ import annotations

import socket
import threading
from collections import deque
from dataclasses import dataclass, field

from dsec.image.blob.localservers import (  # noqa: F401 - the tests' names for them
    NGINX,
    MotoServer,
    Nginx,
    free_port,
    wait_http,
)


@dataclass
class Fault:
    """What the proxy does to one client connection.

    ``status``: answer the first request with this HTTP status and close (5xx).
    ``cut_after``: forward this many response bytes (headers included), then close.
    ``flip_at``: flip one response byte at this offset (headers included), then pass.
    ``stall``: accept, read the request, never answer (a hung server).
    ``pause_after``: forward this many response bytes, set ``paused``, then wait for
    ``resume`` before forwarding the rest (to kill the server mid-response)."""

    status: int | None = None
    cut_after: int | None = None
    flip_at: int | None = None
    stall: bool = False
    pause_after: int | None = None
    paused: threading.Event = field(default_factory=threading.Event)
    resume: threading.Event = field(default_factory=threading.Event)


class FaultProxy:
    """A TCP proxy on 127.0.0.1 to ``upstream`` port. Each new client connection takes
    the next :class:`Fault` from :attr:`faults` (none left: pass through). ``conns``
    counts connections, so a test can see how many tries a client made."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.faults: deque[Fault] = deque()
        self.conns = 0
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = int(self.sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._accept, daemon=True)
        self._t.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self.conns += 1
                fault = self.faults.popleft() if self.faults else Fault()
                self._open.add(c)
            threading.Thread(target=self._serve, args=(c, fault), daemon=True).start()

    def _close(self, *socks: socket.socket) -> None:
        for s in socks:
            with self._lock:
                self._open.discard(s)
            try:
                s.close()
            except OSError:
                pass

    def _serve(self, c: socket.socket, fault: Fault) -> None:
        if fault.status is not None or fault.stall:
            try:
                c.recv(65536)
                if fault.stall:
                    self._stop.wait()
                else:
                    body = b"injected fault"
                    c.sendall(f"HTTP/1.1 {fault.status} Injected\r\nContent-Length: "
                              f"{len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            except OSError:
                pass
            self._close(c)
            return
        try:
            u = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=10)
        except OSError:
            self._close(c)
            return
        with self._lock:
            self._open.add(u)

        def up() -> None:
            try:
                while data := c.recv(65536):
                    u.sendall(data)
                u.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        threading.Thread(target=up, daemon=True).start()
        sent = 0
        try:
            while data := u.recv(65536):
                if fault.flip_at is not None and sent <= fault.flip_at < sent + len(data):
                    i = fault.flip_at - sent
                    data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]
                if fault.cut_after is not None and sent + len(data) >= fault.cut_after:
                    c.sendall(data[:fault.cut_after - sent])
                    break
                if fault.pause_after is not None and not fault.paused.is_set() \
                        and sent + len(data) >= fault.pause_after:
                    k = fault.pause_after - sent
                    c.sendall(data[:k])
                    sent += k
                    data = data[k:]
                    fault.paused.set()
                    fault.resume.wait(30)      # the upstream may be killed meanwhile
                c.sendall(data)
                sent += len(data)
        except OSError:
            pass
        self._close(c, u)

    def close(self) -> None:
        self._stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)      # wakes the blocked accept()
        except OSError:
            pass
        self.sock.close()
        with self._lock:
            socks = list(self._open)
        self._close(*socks)
        self._t.join(5)
