"""The container backend's processes (issue 19): a command the edge's process table owns.

Started through the zygote like a foreground exec (its own exec cgroup, so a kill takes
everything it started), with ``track``: the zygote answers ``Running`` (host and
namespace pids) once the command's execve succeeded, or ``Failed`` with why it could not
start (a missing program, user or cwd: :class:`~dsec.errors.CannotRun`), then ``Exited``.

Like a foreground exec it is forked from the sandbox's exec helper when one runs (issue
20: the per-exec intermediate - fork, cgroup joins, setns, capability drop, seccomp load -
was nearly all of a start's time; nsexec.c, forward_exec), with the same exceptions
(``hide``: Landlock cannot be applied under the helper's seccomp filter; user-namespace
and nested sandboxes) and the same fallback: a helper that refuses (gone, at the task
limit, a lazy devpts not mounted yet for a pty) answers ``Failed`` with an errno before
any command ran, and the start is redone the per-exec way. Nothing after the start
differs: the helper forks the command with ``CLONE_PARENT``, so its parent is the zygote
either way - the zygote reaps it and reports its status, and after an edge restart it is
the descriptor keeper's orphan (the zygote's parent, a child subreaper) like any other,
which keeps its exit status (:mod:`dsec.edge.fdkeeper`). A best-effort command inherits
SCHED_IDLE from its helper (set before the helper served anything) instead of getting it
after it reported running.

- **Pipes**: stdout and stderr are read from the event loop into the table's sink as they
  come (nothing accumulates here: the table's ring bounds what is kept); stdin is a pipe
  kept open for :meth:`ContainerProcess.write` when asked (``stdin_open``), else
  ``/dev/null`` (or the request's one-shot ``stdin``).
- **PTY**: the command's side opens a terminal in the sandbox's own devpts and sends the
  master back over its stdin, which for a pty exec is a socket made here
  (``nsexec.c``, ``setup_pty``); the master is then read as stdout and written as stdin,
  and resized with TIOCSWINSZ (the kernel sends SIGWINCH to the foreground group).
  A Ctrl-C is the byte ``\\x03`` written to it: the line discipline signals the
  terminal's foreground process group, inside the sandbox, as on any terminal.
- **Signals** go to the command's process group (``killpg`` of its host pid, which is
  its session and group id: ``setsid`` at start), only while its pidfd says the pid is
  still ours (unreaped: the zygote reaps it); SIGKILL also kills everything in its
  exec cgroup (whatever it started, in any group).
- **Input** waits in a bounded buffer (``input_pending``): a writer beyond it waits for
  the command to read, up to ``input_wait_s``, then gets ``ResourceExhausted``.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import os
import signal
import socket
import struct
import termios
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Protocol

from dsec.edge.backends.container.protocol import (
    Exec,
    Exited,
    Failed,
    Reply,
    Running,
    Started,
    exec_failure,
)
from dsec.edge.processes import ExitStatus, OutputSink
from dsec.edge.qos import qos_process
from dsec.errors import (
    BackendError,
    DsecError,
    InvalidArgument,
    InvalidTransition,
    ResourceExhausted,
)
from dsec.wire.spec import qos_of

if TYPE_CHECKING:
    from dsec.edge.backends.container.box import Box
    from dsec.edge.backends.container.native import ZygoteClient
    from dsec.edge.governor import ExecCgroup, Governor
    from dsec.wire.spec import ExecRequest

__all__ = ["LOST", "ContainerProcess", "ProcessBackend", "adopt", "spawn"]

_READ = 1 << 16
#: the end of an adopted process: nothing of this edge reaped it, its status is unknown
LOST = Failed(0, "exit status lost in the edge restart")
#: writes that may wait for room in one process's input buffer at once
MAX_WAITERS = 4
StreamName = Literal["stdout", "stderr"]


class ProcessBackend(Protocol):
    """What a process needs of its backend (``ContainerBackend``): the zygote that
    starts it, a pidfd of the sandbox's init for the start, the governor and exec cgroups it runs in, and how a command is killed
    and its cgroup cleared. A Protocol: the backend imports this module (spawn_process),
    so importing it back (even for annotations) would be a cycle."""

    @property
    def _zygote(self) -> ZygoteClient: ...
    @property
    def _devnull(self) -> int: ...
    @property
    def governor(self) -> Governor: ...
    @property
    def exec_start_timeout_s(self) -> float: ...
    @property
    def exec_helper(self) -> bool: ...

    def _helper(self, box: Box) -> int: ...

    def _init_fd(self, box: Box) -> contextlib.AbstractContextManager[int]: ...
    def _new_exec_cgroup(self, box: Box) -> ExecCgroup: ...
    def _kill_exec(self, rid: int, ec: ExecCgroup, *, send: bool = True) -> None: ...
    async def _clear_exec_cgroup(self, box: Box, ec: ExecCgroup) -> None: ...
    def _release_exec_cgroup(self, box: Box, ec: ExecCgroup) -> None: ...


class ContainerProcess:
    """One process of the table on the container backend (module docstring)."""

    def __init__(self, backend: ProcessBackend, box: Box, rid: int, ec: ExecCgroup,
                 sink: OutputSink, *, pty: tuple[int, int] | None, input_pending: int,
                 input_wait_s: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.backend, self.box, self.rid, self.ec, self.sink = backend, box, rid, ec, sink
        self.pid = 0                    # in the sandbox
        self.host_pid = 0
        self.pidfd = -1
        self.pty = pty
        self.master = -1
        self.sock: socket.socket | None = None
        self.readers: dict[int, StreamName] = {}
        self.stdin_fd = -1
        self.pending = bytearray()
        self.closing_stdin = False
        self.input_pending, self.input_wait_s = input_pending, input_wait_s
        self.waiters = 0
        self.drained = asyncio.Event()
        self.drained.set()
        self.started: asyncio.Future[Reply] = self.loop.create_future()
        self.exited: asyncio.Future[Reply] = self.loop.create_future()
        self.killed = False
        self.timed_out = False
        self.timer: asyncio.TimerHandle | None = None
        self.t0 = time.monotonic()
        self.gone = False
        self.adopted = False            # taken back after an edge restart (not the zygote's)
        #: the exec helper's request id it was forked from (inherits its qos), 0: per-exec
        self.helper = 0
        #: an adopted process's exit status from whoever reaped it (blocking; None: lost)
        self.lost_status: Callable[[], int | None] | None = None
        #: the table's hook: the descriptors to keep across a restart changed
        self.fds_changed: Callable[[], None] | None = None

    def held_fds(self) -> dict[str, int]:
        """The descriptors a restarted edge needs to take this process back: its output
        pipes' read ends, its stdin's write end, or its terminal master."""
        out: dict[str, int] = {}
        for fd, stream in self.readers.items():
            if fd != self.master:
                out["out" if stream == "stdout" else "err"] = fd
        if self.master >= 0:
            out["pty"] = self.master
        elif self.stdin_fd >= 0 and not self.closing_stdin:
            out["in"] = self.stdin_fd
        return out

    def identity(self) -> tuple[int, int, str]:
        """What names it across an edge restart: host pid, that pid's start time, and
        its exec cgroup's directory."""
        from dsec.ownership import start_time
        return self.host_pid, start_time(self.host_pid) or 0, self.ec.dir

    def _changed(self) -> None:
        if self.fds_changed is not None:
            self.fds_changed()

    # ------------------------------------------------------------------ zygote replies
    def on_reply(self, reply: Reply, fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)
        if isinstance(reply, (Started, Running)) and not self.helper:
            qos_process(self.box.spec, reply.pid)   # qos (issue 22): BE runs SCHED_IDLE
        if isinstance(reply, Running):
            if not self.started.done():
                self.started.set_result(reply)
            return
        if isinstance(reply, Failed) and not self.started.done():
            self.started.set_result(reply)   # could not start; Exited follows
            return
        if isinstance(reply, (Exited, Failed)):
            # Exited; or Failed after Running: the zygote died (the command may live on,
            # but nothing will report its end: it counts as ended here)
            self.backend._zygote.done(self.rid)
            if not self.started.done():
                self.started.set_result(reply)
            if not self.exited.done():
                self.exited.set_result(reply)
        # Started: the intermediate's; the command's pids come with Running

    # ------------------------------------------------------------------ output
    def read_from(self, fd: int, stream: StreamName) -> None:
        os.set_blocking(fd, False)
        self.readers[fd] = stream
        self.loop.add_reader(fd, self._readable, fd)

    def _readable(self, fd: int) -> None:
        stream = self.readers.get(fd)
        if stream is None:
            return
        try:
            data = os.read(fd, _READ)
        except BlockingIOError:
            return
        except OSError:             # EIO: a pty whose every terminal holder is gone
            data = b""
        if data:
            self.sink(stream, data)
        else:
            self._close_reader(fd)

    def _close_reader(self, fd: int) -> None:
        if self.readers.pop(fd, None) is None:
            return
        self.loop.remove_reader(fd)
        if fd == self.master:
            self._close_master()
        else:
            os.close(fd)

    def _drain(self) -> None:
        """The command is gone: take what its pipes (or terminal) still hold, close them.
        Bounded: a background child that inherited them cannot keep us reading."""
        for fd in list(self.readers):
            stream = self.readers[fd]
            for _ in range(256):      # at most 16 MiB of leftovers; the rest is dropped
                try:
                    data = os.read(fd, _READ)
                except OSError:
                    break
                if not data:
                    break
                self.sink(stream, data)
            self._close_reader(fd)

    # ------------------------------------------------------------------ pty master
    def await_master(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.setblocking(False)
        self.loop.add_reader(sock.fileno(), self._master_arrives)

    def _master_arrives(self) -> None:
        sock = self.sock
        if sock is None:
            return
        try:
            _, anc, _, _ = sock.recvmsg(1, socket.CMSG_SPACE(4 * 4),
                                        socket.MSG_CMSG_CLOEXEC)
        except BlockingIOError:
            return
        except OSError:
            anc = []
        fds = array.array("i")
        for level, kind, blob in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(blob[: len(blob) - len(blob) % 4])
        self._close_sock()
        if not fds:
            return       # it died before its terminal was ready (its reason: stderr)
        for extra in fds[1:]:
            os.close(extra)
        self.master = fds[0]
        self.stdin_fd = self.master
        self.read_from(self.master, "stdout")
        if self.pending:
            self.loop.add_writer(self.master, self._writable)
        self._changed()

    def _close_sock(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(ValueError, OSError):
                self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None

    def _close_master(self) -> None:
        if self.master >= 0:
            if self.stdin_fd == self.master:
                self._stop_writer()
                self.stdin_fd = -1
            os.close(self.master)
            self.master = -1

    # ------------------------------------------------------------------ input
    async def write(self, data: bytes) -> None:
        if self.gone or self.exited.done():
            raise InvalidTransition(f"process {self.pid} in sandbox {self.box.sid} has "
                                    "exited", sandbox_id=self.box.sid, pid=self.pid)
        if self.closing_stdin or (self.stdin_fd < 0 and self.pty is None):
            raise InvalidTransition(f"stdin of process {self.pid} in sandbox "
                                    f"{self.box.sid} is closed", sandbox_id=self.box.sid,
                                    pid=self.pid)
        if len(self.pending) + len(data) > self.input_pending and self.waiters >= MAX_WAITERS:
            # each waiting write holds its data here: a flood of them must not
            raise ResourceExhausted(
                f"process {self.pid} in sandbox {self.box.sid} has {len(self.pending)} "
                f"bytes of input waiting and {self.waiters} more writes queued behind "
                "them; send input in order, one write at a time",
                sandbox_id=self.box.sid, limit=MAX_WAITERS)
        self.waiters += 1
        try:
            await self._room(len(data))
        finally:
            self.waiters -= 1
        self.pending += data
        if self.stdin_fd >= 0:
            self._writable()
            if self.pending:
                self.loop.add_writer(self.stdin_fd, self._writable)

    async def _room(self, n: int) -> None:
        deadline = time.monotonic() + self.input_wait_s
        while len(self.pending) + n > self.input_pending and self.pending:
            left = deadline - time.monotonic()
            try:
                self.drained.clear()
                async with asyncio.timeout(max(left, 0.001)):
                    await self.drained.wait()
            except TimeoutError:
                raise ResourceExhausted(
                    f"process {self.pid} in sandbox {self.box.sid} has not read the "
                    f"{len(self.pending)} bytes of input waiting for it (at most "
                    f"{self.input_pending} wait) within {self.input_wait_s:g} s",
                    sandbox_id=self.box.sid, limit=self.input_pending) from None
            if self.gone or self.exited.done():
                raise InvalidTransition(f"process {self.pid} in sandbox {self.box.sid} "
                                        "has exited", sandbox_id=self.box.sid, pid=self.pid)

    def _writable(self) -> None:
        fd = self.stdin_fd
        if fd < 0:
            return
        while self.pending:
            try:
                n = os.write(fd, self.pending[:_READ])
            except BlockingIOError:
                return
            except OSError:          # the reader is gone (EPIPE): input goes nowhere
                self.pending.clear()
                break
            del self.pending[:n]
        self._stop_writer()
        self.drained.set()
        if self.closing_stdin and fd != self.master:
            os.close(fd)
            self.stdin_fd = -1
            self._changed()

    def _stop_writer(self) -> None:
        if self.stdin_fd >= 0:
            with contextlib.suppress(ValueError, OSError):
                self.loop.remove_writer(self.stdin_fd)

    def close_stdin(self) -> None:
        if self.pty is not None:
            # a terminal has no end of file to give; its EOF character (^D at a line's
            # start) is what a program reading it takes as one
            self.pending += b"\x04"
            if self.stdin_fd >= 0:
                self._writable()
            return
        self.closing_stdin = True
        if self.stdin_fd >= 0 and not self.pending:
            self._stop_writer()
            os.close(self.stdin_fd)
            self.stdin_fd = -1
        self._changed()   # the keeper's copy of the write end goes too: EOF reaches it

    # ------------------------------------------------------------------ control
    def signal(self, sig: int) -> None:
        if self.gone or self.exited.done() or not self.host_pid:
            return
        if sig == signal.SIGKILL:
            self.killed = True
            self.backend._kill_exec(self.rid, self.ec, send=not self.adopted)
            return
        try:
            # its pidfd first: unreaped (the zygote reaps it), so its pid - its process
            # group's id - is still its own, not a recycled host pid
            signal.pidfd_send_signal(self.pidfd, 0)
            os.killpg(self.host_pid, sig)
        except (ProcessLookupError, OSError):
            pass

    def resize(self, cols: int, rows: int) -> None:
        if self.pty is None:
            raise InvalidArgument(f"process {self.pid} in sandbox {self.box.sid} has no "
                                  "terminal", field="pid", sandbox_id=self.box.sid)
        self.pty = (cols, rows)
        if self.master >= 0:
            with contextlib.suppress(OSError):
                fcntl.ioctl(self.master, termios.TIOCSWINSZ,
                            struct.pack("HHHH", rows, cols, 0, 0))

    def _timeout(self) -> None:
        self.timed_out = True
        self.killed = True
        self.backend._kill_exec(self.rid, self.ec, send=not self.adopted)

    # ------------------------------------------------------------------ end
    async def wait(self) -> ExitStatus:
        try:
            reply = await asyncio.shield(self.exited)
        finally:
            if self.timer is not None:
                self.timer.cancel()
        if reply is LOST and self.lost_status is not None:
            # not our child: the keeper reaped it (dsec.edge.fdstore), if it was its
            st = await asyncio.to_thread(self.lost_status)
            if st is not None:
                reply = Exited(0, st, self.host_pid)
        self._drain()
        self._release()
        if self.gone:
            pass                  # its sandbox went, its cgroups with it
        elif self.killed:
            await self.backend._clear_exec_cgroup(self.box, self.ec)
        else:
            self.backend._release_exec_cgroup(self.box, self.ec)
        if isinstance(reply, Exited):
            st = reply.status
            sig = os.WTERMSIG(st) if os.WIFSIGNALED(st) else None
            code = os.waitstatus_to_exitcode(st)
            return ExitStatus(128 - code if code < 0 else code, signal=sig,
                              timed_out=self.timed_out)
        if reply is LOST:
            self.sink("stderr", (
                f"dsec: process {self.pid} ended after an edge restart; its exit status "
                "was lost in the edge restart (the exec helper that was its parent went "
                "with the old edge)\n").encode())
            return ExitStatus(-1, timed_out=self.timed_out)
        self.sink("stderr", f"dsec: {getattr(reply, 'message', reply)}\n".encode())
        return ExitStatus(-1, timed_out=self.timed_out)

    def _release(self) -> None:
        """Every descriptor this process held, closed (idempotent)."""
        for fd in list(self.readers):
            self._close_reader(fd)
        self._close_sock()
        self._close_master()
        if self.stdin_fd >= 0:
            self._stop_writer()
            os.close(self.stdin_fd)
            self.stdin_fd = -1
        if self.pidfd >= 0:
            if self.adopted:
                with contextlib.suppress(ValueError, OSError):
                    self.loop.remove_reader(self.pidfd)
            os.close(self.pidfd)
            self.pidfd = -1
        self.pending.clear()
        self.drained.set()

    def abandon(self) -> None:
        """The sandbox is gone (its processes with it): stop reading, close everything;
        :meth:`wait` returns with whatever the zygote reports, or SIGKILL now."""
        self.gone = True
        if self.timer is not None:
            self.timer.cancel()
        self._release()
        if not self.exited.done():
            self.backend._zygote.done(self.rid)
            self.exited.set_result(Exited(self.rid, signal.SIGKILL, self.host_pid))


class _HelperRefused(Exception):
    """The exec helper did not fork the command (it never ran): start it the per-exec way."""


async def spawn(backend: ProcessBackend, box: Box, req: ExecRequest, argv: list[str],
                env: list[str], sink: OutputSink, *, input_pending: int = 1 << 20,
                input_wait_s: float = 30.0) -> ContainerProcess:
    """Start ``req`` as a process of the table; answered once its command runs. Through
    the sandbox's exec helper when one runs (the module docstring says when not)."""
    helper = 0
    if (backend.exec_helper and not box.spec.user_namespace and not box.spec.allow_nested
            and not req.hide):
        helper = backend._helper(box)
        if not helper and box.helper_start is not None and qos_of(box.spec) == "be":
            # as _native_exec: best-effort waits for its SCHED_IDLE helper rather than run
            # a moment as SCHED_OTHER from the zygote (issue 22)
            helper = await asyncio.shield(box.helper_start)
    if helper:
        box.helper_busy += 1   # never retired while it serves (_retire_idle_helper)
        try:
            return await _spawn(backend, box, req, argv, env, sink, helper,
                                input_pending=input_pending, input_wait_s=input_wait_s)
        except _HelperRefused:
            pass
        finally:
            box.helper_busy -= 1
            box.helper_used = time.monotonic()
    return await _spawn(backend, box, req, argv, env, sink, 0,
                        input_pending=input_pending, input_wait_s=input_wait_s)


async def _spawn(backend: ProcessBackend, box: Box, req: ExecRequest, argv: list[str],
                 env: list[str], sink: OutputSink, helper: int, *, input_pending: int,
                 input_wait_s: float) -> ContainerProcess:
    zyg = backend._zygote
    ec = backend._new_exec_cgroup(box)
    rid = zyg.next_id()
    pty = (req.pty.cols, req.pty.rows) if req.pty is not None else None
    p = ContainerProcess(backend, box, rid, ec, sink, pty=pty, input_pending=input_pending,
                         input_wait_s=input_wait_s)
    p.helper = helper
    local: list[int] = []      # every fd made here, closed on failure
    theirs: list[int] = []     # the command's ends, closed here once sent
    sock_ours: socket.socket | None = None
    try:
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        local += [err_r, err_w]
        theirs.append(err_w)
        if pty is not None:
            sock_ours, sock_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            local.append(sock_theirs.detach())
            theirs.append(local[-1])
            send_fds = [-1, local[-1], err_w, err_w]      # [0]: the init's pidfd, below
        else:
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            local += [out_r, out_w]
            theirs.append(out_w)
            if req.stdin_open or req.stdin:
                in_r, in_w = os.pipe2(os.O_CLOEXEC)
                local += [in_r, in_w]
                theirs.append(in_r)
            else:
                in_r, in_w = backend._devnull, -1
            send_fds = [-1, in_r, out_w, err_w]
        # a native sandbox holds no pidfd while idle (issue 22): one for this send only
        with backend._init_fd(box) as pidfd:
            send_fds[0] = pidfd
            zyg.send(Exec(id=rid, argv=argv, env=env, cwd=req.cwd, user=req.user,
                          cgroup_procs=ec.procs_files, nested=box.spec.allow_nested,
                          background=False, userns=box.spec.user_namespace,
                          pids_index=ec.pids_index, home_procs=backend.governor.home_procs(),
                          hide=req.hide, helper=helper, track=True, pty=pty),
                     send_fds, p.on_reply)
    except BaseException:
        if sock_ours is not None:
            sock_ours.close()
        for fd in local:
            os.close(fd)
        backend.governor.remove_exec(ec)
        raise
    for fd in theirs:
        os.close(fd)
    p.read_from(err_r, "stderr")
    if pty is not None:
        assert sock_ours is not None
        p.await_master(sock_ours)
    else:
        p.read_from(out_r, "stdout")
        if in_w >= 0:
            os.set_blocking(in_w, False)
            p.stdin_fd = in_w
            if req.stdin:
                await p.write(req.stdin)
            if not req.stdin_open:
                p.close_stdin()
    try:
        try:
            async with asyncio.timeout(backend.exec_start_timeout_s):
                reply = await asyncio.shield(p.started)
        except TimeoutError:
            p.killed = True
            backend._kill_exec(rid, ec)
            raise BackendError(
                f"process in sandbox {box.sid} did not start its command within "
                f"{backend.exec_start_timeout_s:g} s (held before its execve, e.g. by a "
                "SIGSTOP from a process inside); it was killed", sandbox_id=box.sid) from None
        if helper and isinstance(reply, Failed) and reply.errno:
            # the helper refused it (gone, at the task limit, no devpts yet for a pty,
            # too big): nothing ran - a command's own failure to start carries no errno
            raise _HelperRefused
        if not isinstance(reply, Running):
            p.killed = True
            msg = getattr(reply, "message", "") or "it exited before it started"
            raise exec_failure(box.sid, msg)
    except _HelperRefused:
        zyg.done(rid)      # that Failed was its last reply: no Exited follows
        p.abandon()
        await backend._clear_exec_cgroup(box, ec)
        raise
    except BaseException as exc:
        # it never became a process of the table: end it, collect it, free everything
        if isinstance(exc, (DsecError, asyncio.CancelledError)):
            backend._kill_exec(rid, ec)
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            async with asyncio.timeout(10.0):
                await asyncio.shield(p.exited)
        zyg.done(rid)
        p.abandon()
        await backend._clear_exec_cgroup(box, ec)
        raise
    p.host_pid, p.pid = reply.pid, reply.ns_pid
    try:
        p.pidfd = os.pidfd_open(reply.pid)
    except OSError:
        p.pidfd = -1            # already reaped: it ended; signals are moot
    if req.timeout_s is not None:
        p.timer = p.loop.call_later(req.timeout_s, p._timeout)
    return p


def adopt(backend: ProcessBackend, box: Box, ec: ExecCgroup, sink: OutputSink, *,
          pid: int, host_pid: int, host_start: int, fds: dict[str, int],
          pty: tuple[int, int] | None, deadline_in_s: float | None,
          input_pending: int = 1 << 20, input_wait_s: float = 30.0,
          lost_status: Callable[[], int | None] | None = None,
          ) -> ContainerProcess | None:
    """Take back a process a previous edge started (its descriptors ``fds`` from the
    keeper; they become this object's). None if ``host_pid`` is no longer that process
    (``host_start`` differs: it ended, its pid may be another's now); the caller closes
    nothing then: ``fds`` are closed here.

    Its end is learned from its pidfd (readable once it exits); its status is not (it
    is not our child): :data:`LOST`. Signals go to its process group as for any process
    of the table; SIGKILL and its timeout kill its exec cgroup."""
    from dsec.ownership import start_time
    p = ContainerProcess(backend, box, 0, ec, sink, pty=pty, input_pending=input_pending,
                         input_wait_s=input_wait_s)
    p.adopted = True
    p.lost_status = lost_status
    try:
        pidfd = os.pidfd_open(host_pid)
    except OSError:
        pidfd = -1
    if pidfd < 0 or start_time(host_pid, running=True) != host_start:
        if pidfd >= 0:
            os.close(pidfd)
        for fd in fds.values():
            os.close(fd)
        return None
    p.host_pid, p.pid, p.pidfd = host_pid, pid, pidfd
    if "pty" in fds:
        p.master = fds["pty"]
        p.stdin_fd = p.master
        p.read_from(p.master, "stdout")
    else:
        if "out" in fds:
            p.read_from(fds["out"], "stdout")
        if "in" in fds:
            os.set_blocking(fds["in"], False)
            p.stdin_fd = fds["in"]
        else:
            p.closing_stdin = True
    if "err" in fds:
        p.read_from(fds["err"], "stderr")
    p.started.set_result(Running(0, host_pid, pid))

    def ended() -> None:
        with contextlib.suppress(ValueError, OSError):
            p.loop.remove_reader(pidfd)
        if not p.exited.done():
            p.exited.set_result(LOST)

    p.loop.add_reader(pidfd, ended)
    if deadline_in_s is not None:
        p.timer = p.loop.call_later(max(deadline_in_s, 0.0), p._timeout)
    return p
