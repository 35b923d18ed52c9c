"""Edges as their own processes: one supervised ``dsec edge`` child per node.

``dsec up`` runs each edge in a process of its own, so an edge crash (or an fd or memory
problem local to one node) is that node's problem, not the control plane's. This module
is the I/O half of the supervision; the decisions (restart, backoff, crash loop) are
:class:`dsec.control.supervisor.Supervision`'s, fed with events from here:

- a child is started with ``subprocess.Popen`` in a session of its own (a Ctrl-C at the
  terminal reaches ``dsec up`` only, which destroys sandboxes through the edges before
  stopping them) and ``--supervisor-pid`` (the edge asks the kernel for SIGTERM when
  ``dsec up`` dies, even by kill -9, and stops keeping its sandboxes for the next start);
- readiness comes over a pipe (``--ready-fd``): the edge writes ``ready`` once it serves
  on its socket, after re-adopting its sandboxes from its journal;
- exit is noticed through a pidfd registered with the event loop (no SIGCHLD handler, no
  child watcher thread; works on any loop, in any thread);
- ``<node>.pid`` (pid and kernel start time, so a reused pid is never mistaken for ours)
  lets the next ``dsec up`` find an edge a killed ``dsec up`` left behind
  (:func:`reclaim_orphan`); ``<node>.log`` collects the child's output, and a crash
  report quotes its tail.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from dsec.control.supervisor import (
    ChildState,
    Event,
    Exited,
    ExitStatus,
    Ready,
    Report,
    RestartPolicy,
    Signal,
    Spawn,
    Start,
    Stop,
    Supervision,
    Tick,
    WakeAt,
)
from dsec.errors import TransportError
from dsec.ownership import start_time

__all__ = ["EdgePaths", "EdgeProcess", "reclaim_orphan"]

log = logging.getLogger("dsec.supervisor")

LOG_ROTATE_BYTES = 8 << 20   # a log this big is moved to <node>.log.1 at the next start


@dataclass(frozen=True, slots=True)
class EdgePaths:
    """Where one local edge keeps its files under ``dsec up``'s state dir."""

    socket: str      # edges/<node>.sock
    state_dir: str   # edges/<node>/ (journal, lock)
    pid_file: str    # edges/<node>.pid
    log_file: str    # edges/<node>.log

    @classmethod
    def under(cls, state_dir: str, node: str) -> EdgePaths:
        d = os.path.join(state_dir, "edges")
        return cls(socket=os.path.join(d, f"{node}.sock"), state_dir=os.path.join(d, node),
                   pid_file=os.path.join(d, f"{node}.pid"),
                   log_file=os.path.join(d, f"{node}.log"))


def _read_text(path: str) -> str:
    with open(path) as f:
        return f.read()


def log_tail(path: str, limit: int = 1500) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - limit))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


class EdgeProcess:
    """One supervised ``dsec edge`` child. ``await start()`` returns once it serves;
    afterwards it is restarted on every crash by the policy until ``await stop()``."""

    def __init__(self, node: str, argv: Sequence[str], paths: EdgePaths, *,
                 policy: RestartPolicy | None = None,
                 on_report: Callable[[str, str, str], None] | None = None,
                 on_ready: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 env: Mapping[str, str] | None = None) -> None:
        self.node = node
        self.argv = list(argv)
        # added to the inherited environment (secrets that must stay out of argv, e.g.
        # a join token: $DSEC_JOIN_TOKEN)
        self.env = dict(env or {})
        self.paths = paths
        self.sup = Supervision(f"edge {node}", policy)
        self.on_report = on_report
        self.on_ready = on_ready
        self.clock = clock
        self.proc: subprocess.Popen[bytes] | None = None
        self._pidfd = -1
        self._ready_r = -1
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self.ready_at: float | None = None     # when it last said ready (clock), if running

    # ------------------------------------------------------------ public face
    @property
    def state(self) -> ChildState:
        return self.sup.state

    @property
    def ever_ready(self) -> bool:
        """It served at least once (so it may hold sandboxes)."""
        return self.sup.ever_ready

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.returncode is None else None

    async def start(self) -> None:
        """Start (or restart by hand) the edge and wait until it serves. Raises
        TransportError, with the tail of its log, if it exits or times out first; it is
        then left stopped (a first start that fails is a configuration problem)."""
        self.begin()
        await self.started()

    def begin(self) -> None:
        """Start the edge without waiting (``await started()`` waits)."""
        self._loop = asyncio.get_running_loop()
        self._feed(Start(self.clock()))

    async def started(self) -> None:
        """Wait for the start :meth:`begin` made; see :meth:`start`."""
        await self._until(lambda: self.state != "starting")
        if self.state != "running":
            why = self.sup.last_exit
            await self.stop(grace_s=0)
            tail = log_tail(self.paths.log_file)
            raise TransportError(
                f"edge {self.node} did not start ({why or 'no exit status'}); the end of "
                f"{self.paths.log_file}:\n{tail or '(empty)'}", node=self.node)

    async def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM, then SIGKILL after ``grace_s`` (default: the policy's), and no more
        restarts. ``grace_s=0`` is kill -9 (a machine that died)."""
        if self._loop is None:
            return
        self._feed(Stop(self.clock(), grace_s))
        await self._until(lambda: self.state in ("stopped", "failed", "idle"))
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def kill(self, signum: int = signal.SIGKILL) -> bool:
        """Send ``signum`` to the edge behind the supervisor's back (a crash, for tests
        and fault drills); the supervisor restarts it. False if it is not running."""
        if self.pid is None:
            return False
        assert self.proc is not None
        self.proc.send_signal(signum)
        return True

    async def wait_state(self, *states: ChildState, timeout: float = 30.0) -> ChildState:
        async with asyncio.timeout(timeout):
            await self._until(lambda: self.state in states)
        return self.state

    # ---------------------------------------------------------- state machine
    async def _until(self, cond: Callable[[], bool]) -> None:
        while not cond():
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()

    def _feed(self, event: Event) -> None:
        for ins in self.sup.handle(event):
            if isinstance(ins, Spawn):
                self._spawn()
            elif isinstance(ins, Signal):
                if self.pid is not None:
                    assert self.proc is not None
                    with contextlib.suppress(ProcessLookupError):
                        self.proc.send_signal(ins.signum)
            elif isinstance(ins, WakeAt):
                self._wake_at(ins.at)
            elif isinstance(ins, Report):
                self._report(ins)
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _wake_at(self, at: float) -> None:
        assert self._loop is not None
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(max(0.0, at - self.clock()),
                                            lambda: self._feed(Tick(self.clock())))

    def _report(self, r: Report) -> None:
        msg = r.message
        if r.level == "error":
            tail = log_tail(self.paths.log_file, 600)
            if tail:
                msg += f"; the end of {self.paths.log_file}:\n{tail}"
        getattr(log, r.level)("%s", msg)
        if self.on_report is not None:
            self.on_report(self.node, r.level, msg)

    # ---------------------------------------------------------------- process
    def _spawn(self) -> None:
        assert self._loop is not None
        loop = self._loop
        p = self.paths
        os.makedirs(os.path.dirname(p.log_file), mode=0o700, exist_ok=True)
        with contextlib.suppress(OSError):
            if os.path.getsize(p.log_file) > LOG_ROTATE_BYTES:
                os.replace(p.log_file, p.log_file + ".1")
        ready_r, ready_w = os.pipe()
        out = -1
        try:
            out = os.open(p.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                          0o600)
            self.proc = subprocess.Popen(
                [*self.argv, "--ready-fd", str(ready_w), "--supervisor-pid", str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, pass_fds=(ready_w,),
                start_new_session=True, env={**os.environ, **self.env} if self.env else None)
        except OSError as exc:
            os.close(ready_r)
            self._report(Report("error", f"edge {self.node} could not be started: {exc}"))
            loop.call_soon(self._feed, Exited(self.clock(), ExitStatus(code=127)))
            return
        finally:
            os.close(ready_w)
            if out >= 0:
                os.close(out)
        pid = self.proc.pid
        self._write_pid(pid)
        self._ready_r = ready_r
        os.set_blocking(ready_r, False)
        loop.add_reader(ready_r, self._on_ready)
        self._pidfd = os.pidfd_open(pid)
        loop.add_reader(self._pidfd, self._on_exit)
        log.debug("edge %s started as pid %d", self.node, pid)

    def _write_pid(self, pid: int) -> None:
        start = start_time(pid, running=True)
        tmp = self.paths.pid_file + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{pid} {start}\n")
        os.replace(tmp, self.paths.pid_file)

    def _close_ready(self) -> None:
        if self._ready_r >= 0:
            assert self._loop is not None
            self._loop.remove_reader(self._ready_r)
            os.close(self._ready_r)
            self._ready_r = -1

    def _on_ready(self) -> None:
        try:
            data = os.read(self._ready_r, 64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        self._close_ready()
        if data.startswith(b"ready"):
            self.ready_at = self.clock()
            self._feed(Ready(self.clock()))
            if self.on_ready is not None:
                self.on_ready(self.node)

    def _on_exit(self) -> None:
        assert self._loop is not None and self.proc is not None
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = -1
        rc = self.proc.wait()
        self.ready_at = None
        self._close_ready()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.paths.pid_file)
        self._feed(Exited(self.clock(), ExitStatus.from_returncode(rc)))


async def reclaim_orphan(paths: EdgePaths, *, grace_s: float = 10.0) -> str | None:
    """Stop an edge a previous ``dsec up`` left running (it was killed before it could
    stop it, and the edge outlived it). The edge is told to stop gracefully first
    (SIGTERM, and SIGCONT in case it was stopped), so its journal keeps its sandboxes
    for the fresh edge to adopt; SIGKILL after ``grace_s``. Returns what it did."""
    try:
        pid_s, _, start_s = _read_text(paths.pid_file).strip().partition(" ")
        pid, start = int(pid_s), int(start_s) if start_s.isdigit() else None
    except (OSError, ValueError):
        return None
    if start is None or start_time(pid, running=True) != start:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(paths.pid_file)
        return None   # gone, or the pid now belongs to someone else
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    try:
        for sig in (signal.SIGTERM, signal.SIGCONT):
            signal.pidfd_send_signal(pidfd, sig)
        deadline = time.monotonic() + grace_s
        how = "stopped"
        while start_time(pid, running=True) == start:
            if time.monotonic() > deadline:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                how = "killed (it ignored SIGTERM)"
                deadline = float("inf")
            await asyncio.sleep(0.02)
    except ProcessLookupError:
        how = "stopped"
    finally:
        os.close(pidfd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(paths.pid_file)
    return f"{how} edge process {pid} left behind by a previous dsec up"
