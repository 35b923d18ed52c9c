"""The edge side of the zygote: start it, send requests, route replies to waiters.

The zygote is ``dsec-nsexec serve`` (nsexec.c), a ~1 MB static C process: single
threaded, epoll over its request socket, a signalfd for SIGCHLD and the status pipes of
starting creates/background execs. Per request it switches its pid namespace for
children (setns into the sandbox's, or unshare a new one), ``fork()``s - cheap, its
address space is tiny - and the child does cgroup join, namespaces, root, capabilities,
no_new_privs, seccomp and the final execve in C.

Why C and not a Python helper (measured on the 2-core dev VM, 64 execs in flight):
forking a ~20 MB Python helper per exec serialised everything at ~600 execs/s
(``os.fork`` ~1.2 ms here); a Python helper that posix_spawn()ed a C setup binary
reached ~1,500/s but still paid ~170 µs of Python per exec plus a second execve
(~350 µs of CPU on this VM) per exec. This process costs neither.

Replies arrive on one SOCK_SEQPACKET socket read from the event loop; each request id
maps to a callback (a create gets one reply, a foreground exec two: Started then Exited).
If the zygote dies, every waiter fails with :class:`BackendError` and the next request
starts a fresh zygote; running sandboxes are unaffected (they do not depend on it).
The seccomp programs are compiled here once (libseccomp via pyseccomp) and handed to the
zygote as two memfds; each child loads one with a single prctl.
"""

from __future__ import annotations

import array
import asyncio
import errno
import itertools
import logging
import os
import select
import socket
import subprocess
from collections.abc import Callable
from typing import Protocol

from dsec.edge.backends.container.nsexec import ensure_nsexec
from dsec.edge.backends.container.protocol import (
    MAX_REQUEST_BYTES,
    Failed,
    Reply,
    Request,
    decode_reply,
    encode,
)
from dsec.errors import BackendError, DsecError, InvalidArgument
from dsec.net.seccomp import compile_profile

__all__ = ["INIT_BINARIES", "ZygoteClient"]

INIT_BINARIES = ("/usr/bin/catatonit",)

ReplyHandler = Callable[[Reply, list[int]], None]


class ZygoteProcess(Protocol):
    """What the client uses of the zygote's process (:class:`subprocess.Popen` has it)."""

    @property
    def pid(self) -> int: ...
    def kill(self) -> None: ...
    def wait(self, timeout: float | None = None) -> int: ...


ZygoteSpawner = Callable[[list[str], str, list[int]], ZygoteProcess]
log = logging.getLogger(__name__)


# sendmsg errors that mean the helper is gone; any other fails only the request at hand.
_HELPER_GONE = frozenset({errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.ECONNREFUSED})


def _size_send_buffer(sock: socket.socket) -> None:
    """Let one SOCK_SEQPACKET message carry the largest request the helper takes: a unix
    datagram may be at most the sender's ``SO_SNDBUF`` (minus a little), which defaults to
    ~208 KiB - less than the 1 MiB of argv + env the API admits. Root may exceed
    ``net.core.wmem_max`` with ``SO_SNDBUFFORCE``; the kernel doubles what it is given.
    A limit, not an allocation: memory is used only by requests in flight."""
    want = MAX_REQUEST_BYTES + (64 << 10)
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_SNDBUFFORCE, want)
    except OSError:  # not root: as far as wmem_max allows; bigger requests fail alone
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, want)


_SO_SNDBUFFORCE = 32  # <asm-generic/socket.h>; not exported by Python's socket module


class ZygoteClient:
    def __init__(self, *, nsexec_dir: str | None = None) -> None:
        """``nsexec_dir``: where ``dsec-nsexec`` is built/cached (default
        :func:`~.nsexec.default_cache_dir`)."""
        self.nsexec_dir = nsexec_dir
        self.proc: ZygoteProcess | None = None
        self.sock: socket.socket | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.handlers: dict[int, ReplyHandler] = {}
        self.ids = itertools.count(1)
        #: who starts the zygote instead of this process (the edge's descriptor keeper,
        #: dsec.edge.fdstore: then the commands it starts are the keeper's to reap once
        #: zygote and edge are gone, and their exit status survives an edge restart).
        #: ``spawner(argv with {0}.. for fds, executable, fds)``; None: a child of ours.
        self.spawner: ZygoteSpawner | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def _start(self) -> None:
        self.loop = asyncio.get_running_loop()
        # Compiles once per source version (~0.3 s), then a stat.
        binary = ensure_nsexec(self.nsexec_dir)
        init = next((p for p in INIT_BINARIES if os.path.exists(p)), "")
        bpf = []
        for nested in (False, True):
            fd = os.memfd_create("dsec-seccomp", os.MFD_CLOEXEC)
            os.write(fd, compile_profile(allow_nested=nested))
            bpf.append(fd)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        _size_send_buffer(ours)
        try:
            self.proc = self._spawn(binary, init, theirs.fileno(), bpf)
        finally:
            theirs.close()
            for fd in bpf:
                os.close(fd)
        ours.setblocking(False)
        self.sock = ours
        self.loop.add_reader(ours.fileno(), self._readable)

    def _spawn(self, binary: str, init: str, sock: int, bpf: list[int]) -> ZygoteProcess:
        # argv[0] is a bare name: every exec's final process shows the zygote's argv
        # in /proc/<pid>/cmdline inside the sandbox until its execve, and the binary's
        # path is a host path (the nsexec cache dir).
        if self.spawner is not None:
            try:
                return self.spawner(["dsec-nsexec", "serve", "{0}", "{1}", "{2}", init],
                                    binary, [sock, *bpf])
            except DsecError as exc:
                log.warning("the descriptor keeper could not start the container helper "
                            "(%s): starting it here; its processes' exit status will not "
                            "survive an edge restart", exc)
        return subprocess.Popen(
            ["dsec-nsexec", "serve", str(sock), str(bpf[0]), str(bpf[1]), init],
            executable=binary, pass_fds=[sock, *bpf], stdin=subprocess.DEVNULL,
            close_fds=True)

    def next_id(self) -> int:
        return next(self.ids)

    def send(self, req: Request, fds: list[int], handler: ReplyHandler | None) -> None:
        """Send ``req`` (with ``fds``); ``handler`` gets every reply carrying its id
        (None: keep the handler already registered for that id, e.g. for a Kill)."""
        try:
            data = encode(req)
        except ValueError as exc:
            raise InvalidArgument(f"cannot pass this request to a sandbox: {exc}") from exc
        if self.sock is None:
            self._start()
        assert self.sock is not None
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] \
            if fds else []
        if handler is not None:
            self.handlers[req.id] = handler
        try:
            try:
                self.sock.sendmsg([data], anc)
            except BlockingIOError:
                self._send_when_room(data, anc)
        except OSError as exc:
            self.handlers.pop(req.id, None)
            if exc.errno not in _HELPER_GONE:
                # This request could not be sent (too big, a bad fd, no memory right now):
                # it fails alone. Killing the helper for it failed every other create and
                # exec in flight on the node (an argv over the socket's ~208 KiB default did).
                raise BackendError(f"cannot pass this request to the container helper: "
                                   f"{exc}") from exc
            self._dead(f"send failed: {exc}")
            raise BackendError(f"container helper process is gone ({exc}); retry") from exc

    def _send_when_room(self, data: bytes, anc: list[tuple[int, int, bytes]]) -> None:
        """The zygote is far behind (our send buffer is full): wait for room synchronously
        - rare, and queueing fds in memory is worse - but keep reading its replies while
        waiting. The zygote itself blocks on sending a reply while *our* receive buffer is
        full; a plain blocking sendmsg here deadlocked both for good (seen with 600 execs
        gathered on one backend)."""
        poller = select.poll()
        while True:
            if self.sock is None:
                raise BrokenPipeError(errno.EPIPE, "the container helper went away")
            try:
                self.sock.sendmsg([data], anc)
                return
            except BlockingIOError:
                pass
            poller.register(self.sock.fileno(), select.POLLIN | select.POLLOUT)
            events = poller.poll(1000)
            poller.unregister(self.sock.fileno())
            if any(ev & (select.POLLIN | select.POLLHUP | select.POLLERR) for _, ev in events):
                self._readable()

    def done(self, rid: int) -> None:
        self.handlers.pop(rid, None)

    def _readable(self) -> None:
        assert self.sock is not None
        while True:
            try:
                data, anc, _, _ = self.sock.recvmsg(1 << 16, socket.CMSG_SPACE(16),
                                                    socket.MSG_CMSG_CLOEXEC)
            except BlockingIOError:
                return
            except OSError as exc:
                self._dead(str(exc))
                return
            if not data:
                self._dead("it exited")
                return
            fds = array.array("i")
            for level, kind, blob in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(blob[: len(blob) - len(blob) % 4])
            reply = decode_reply(data)
            handler = self.handlers.get(reply.id)
            if handler is None:
                for fd in fds:
                    os.close(fd)
                continue
            handler(reply, list(fds))

    def _dead(self, why: str) -> None:
        if self.sock is not None and self.loop is not None:
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
        self.sock = None
        if self.proc is not None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.proc = None
        handlers, self.handlers = self.handlers, {}
        for rid, h in handlers.items():
            h(Failed(rid, f"container helper process died: {why}"), [])

    def close(self) -> None:
        """Stop the zygote. Sandboxes it started keep running."""
        if self.sock is not None and self.loop is not None:
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

