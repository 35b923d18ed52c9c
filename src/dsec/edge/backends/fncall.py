"""The ``fncall`` backend: Python calls handed to pre-started, jailed worker processes.

A :class:`WorkerPool` keeps ``pool_size`` interpreters warm (started, imports done,
namespaces built, blocked on their control socket). Workers are forked from a zygote
process that did the imports once (see ``fncall_worker.py``). A call takes one (a pool
hit is a deque pop), admits it into the sandbox, sends it the code or pickled function,
waits with the call's timeout, and then kills the worker: one worker, one call, so no
state leaks between calls. The pool refills in the background, at most ``max_spawning``
starts at a time (each start costs CPU; on 2 cores unbounded refills starve the calls
themselves). An empty pool falls back to a cold start, counted in :attr:`WorkerPool.misses`.

**Isolation** (``FncallBackend(isolate=True)``, the default; see ``fncall_jail.py`` and
docs/isolation.md): every worker runs in its own pid, mount, net, uts, ipc and cgroup
namespaces over a read-only root that holds only the Python runtime, with a fresh /proc
(container masks), private /tmp and /dev/shm, loopback only. At admission the call
process joins the sandbox's cgroup (memory, cpu, pids limits of the spec, via
:mod:`dsec.edge.governor`), gets the sandbox's work dir attached at ``/workspace`` (the
edge hands it a detached ``open_tree`` clone, never a directory fd it could walk out
of), becomes uid 65534 with no capabilities and no_new_privs, and loads the container
seccomp profile. The worker is killed through a pidfd of its pid namespace's init:
every process the call started dies with it, and no pid number is ever signalled.
``isolate=False`` is the old behaviour - the caller's code runs as the edge's user on
the host - kept for hosts without root and as the benchmark's baseline.

A sandbox of this backend is a work directory (its files persist across calls) plus
the spec's environment and a cgroup; processes never persist. With isolation the work
dir is a btrfs subvolume of the node's disk pool with a qgroup cap (``disk_bytes`` of the
spec, default 10 GiB: EDQUOT inside, never a full host disk; see
``container/disk.py``), so the jail's ``/proc/self/mountinfo`` shows no host path for it
and btrfs' own ioctls are refused in the jail. Exec runs ``shell`` as Python code
(the value of a final expression is printed, as in the interactive interpreter) or
``argv = ["python", "-c", CODE]``. :meth:`FncallBackend.call` runs a picklable function.
Worker replies are decoded as plain msgpack, never unpickled: the code in a worker is
hostile.
"""

from __future__ import annotations

import array
import asyncio
import collections
import concurrent.futures
import contextlib
import hashlib
import os
import pickle
import posixpath
import select
import signal
import site
import socket
import struct
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from dsec import ownership
from dsec.edge import filestream
from dsec.edge.backend import DeathSink, Leftover, replay_as_stream
from dsec.edge.backends.container import linux
from dsec.edge.backends.container.census import (
    cgroup_parents,
    claim_cgroup_name,
    hand_over_cgroup_name,
    record_parents,
    recorded_parents,
    release_cgroup_name,
    remove_cgroup_dirs,
    remove_cgroup_dirs_now,
    tasks_of,
)
from dsec.edge.backends.container.disk import DEFAULT_DISK_BYTES, DiskPool, near_cap
from dsec.edge.backends.container.files import SandboxFiles
from dsec.edge.backends.fncall_jail import (
    JAIL_EXTRA_RULES,
    JailConfig,
    clone_tree,
    python_runtime,
    split_profile,
)
from dsec.edge.backends.fncall_uids import UID_REGISTRY, UidRegistry
from dsec.edge.governor import (
    DEFAULT_MAX_SANDBOX_PIDS,
    DEFAULT_PIDS_HEADROOM,
    Governor,
    Limits,
    SandboxCgroup,
    kernel_pid_max,
    pids_budget,
    sandbox_pids,
)
from dsec.edge.notices import NoticeLimiter
from dsec.errors import BackendError, CapacityExceeded, InUse, InvalidArgument, SandboxNotFound
from dsec.fswalk import walk
from dsec.ids import SandboxId
from dsec.rmtree import remove_tree
from dsec.wire.files import FileEvent
from dsec.wire.node import PoolStats
from dsec.wire.spec import (
    TIMEOUT_EXIT_CODE,
    ExecChunk,
    ExecRequest,
    ExecResult,
    FileInfo,
    PauseStats,
    SandboxSpec,
    SandboxStats,
    qos_of,
)

__all__ = ["FNCALL_UIDS", "MAX_VALUE_BYTES", "FncallBackend", "FncallResult", "WorkerPool",
           "make_backend"]

_LEN = struct.Struct("!I")
# A reply carries at most two capped outputs, two strings the worker cuts at 64 KiB (the
# error, a value's repr) and, for a call that wants one, a value of at most
# MAX_VALUE_BYTES; anything larger is a hostile or broken worker, refused before the
# edge allocates it.
REPLY_SLACK = 1 << 20
# The msgpack of a call's return value. The edge decodes it, and decoded msgpack can be
# far larger than its bytes: measured on the dev VM (tracemalloc), 1 MiB of empty
# arrays (one byte each) became 64 MiB of Python lists, of empty maps 72 MiB - so a
# hostile worker gets at most that out of one call. (Before this bound every reply's value was decoded, an exec's too: a 10 MiB
# reply made the edge allocate 750 MiB, and output_cap_bytes=1 GiB allowed 2 GiB.)
MAX_VALUE_BYTES = 1 << 20
# Host uids of jailed sandboxes (FncallBackend(uid=None), the default): each sandbox runs
# as one of its own. The kernel counts some resources per host uid, over every process
# of that uid: inotify instances (fs.inotify.max_user_instances, 128 on the dev VM), fds
# in flight over unix sockets (RLIMIT_NOFILE), pipe buffer pages, RLIMIT_NPROC,
# SIGPENDING and MSGQUEUE. With one uid for all (65534 before), a call holding them made
# every other tenant's calls - and host processes running as nobody - fail inotify_init
# (EMFILE) and fd passing (ETOOMANYREFS). The range lies where systemd documents no
# users (above its container range, below 2^31: some tools read uids as signed), away
# from Debian's subuid ranges and the container backend's user namespaces (100000+).
# Every backend on a host draws from it; fncall_uids.UidRegistry keeps them unique
# host-wide (one host may run several edges).
FNCALL_UIDS: tuple[int, int] = (2_000_000_000, 65536)
# Threads that run the file API beside the event loop (their own pool: a tenant walking a
# huge tree delays other sandboxes' file operations at worst, never the loop or other
# backends' threads).
FILE_THREADS = 4
_T = TypeVar("_T")
WORKDIR = "/workspace"
# The worker is started as `python -I -c BOOT MODE FD`: -I keeps PYTHONPATH, the user
# site and the current directory out; BOOT puts only the edge's own dsec source on the
# path, read from stdin so the host path is not in the argv a jailed call can read.
_BOOT = ("import sys; sys.path.insert(0, sys.stdin.buffer.read().decode()); "
         "from dsec.edge.backends.fncall_worker import main; main(sys.argv[1:])")
# The directory holding the dsec package (this file is dsec/edge/backends/fncall.py),
# found without importing the root package `dsec` from down here (tests/test_layers.py).
_SRC = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))
# The zygote and workers inherit nothing of the edge's environment (API keys, tokens).
_LAUNCH_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "LANG": "C.UTF-8"}


def _pollin(fd: int) -> bool:
    """Readable now (a pidfd: its process exited)? poll(), not select(): on a busy node
    the fd's number can pass select()'s FD_SETSIZE (1024)."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))


class _Reply(msgspec.Struct, kw_only=True, omit_defaults=True):
    exit_code: int = 0
    value: bytes | None = None          # msgpack of the return value, if it had one
    value_repr: str | None = None       # repr when the value was not msgpack-able
    error: str | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_s: float = 0.0
    t_start: float = 0.0                # perf_counter when user code began (handout end)
    jail_error: str | None = None       # the worker could not enter the sandbox


_reply_decoder = msgspec.msgpack.Decoder(_Reply)


@dataclass(slots=True, frozen=True)
class FncallResult:
    """A finished call. ``value`` is the decoded return value (msgpack types) or None."""

    exit_code: int
    value: Any
    value_repr: str | None
    error: str | None
    stdout: bytes
    stderr: bytes
    timed_out: bool
    cold: bool                 # the pool was empty: this call paid for a cold start
    handout_s: float           # from asking for a worker to the call's first line running
    duration_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    died: bool = False         # the worker ended without replying (crash, kill, OOM)


def _set_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def _wait_readable(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()
    loop.add_reader(fd, _set_done, fut)
    try:
        await fut
    finally:
        loop.remove_reader(fd)


async def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    loop = asyncio.get_running_loop()
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError(f"worker closed its socket after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


async def _recv_with_fds(sock: socket.socket, maxfds: int) -> tuple[bytes, list[int]]:
    """One ``recvmsg`` of up to 4 KiB with at most ``maxfds`` SCM_RIGHTS fds."""
    while True:
        try:
            msg, anc, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(4 * maxfds))
        except BlockingIOError:
            await _wait_readable(sock)
            continue
        fds: list[int] = []
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
        return msg, fds


class _Worker:
    """One warm worker. Jailed: ``pidfd`` is its pid namespace's init (killing it kills
    every process of the call). Unjailed: ``pid`` leads its own process group; ``proc``
    is set when the edge started it directly (it must reap it)."""

    __slots__ = ("pid", "pidfd", "proc", "sock", "zygote")

    def __init__(self, pid: int, sock: socket.socket, *, pidfd: int | None = None,
                 proc: asyncio.subprocess.Process | None = None,
                 zygote: asyncio.subprocess.Process | None = None) -> None:
        self.pid, self.sock, self.pidfd, self.proc = pid, sock, pidfd, proc
        self.zygote = zygote  # jailed workers die with it (PR_SET_PDEATHSIG)

    @property
    def alive(self) -> bool:
        if self.sock.fileno() < 0:
            return False
        if self.pidfd is not None and (
                (self.zygote is not None and self.zygote.returncode is not None)
                or _pollin(self.pidfd)):
            return False  # its init exited, or is being killed with its zygote
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    def signal_kill(self) -> None:
        """SIGKILL the worker - jailed: its pid namespace's init, so every process of the
        call - leaving our socket open: whoever waits on it sees EOF."""
        if self.pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        elif self.pid > 0:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)

    def kill(self) -> None:
        """:meth:`signal_kill` and close our socket; :meth:`reap` then waits until the
        worker's processes are gone."""
        self.signal_kill()
        self.pid = 0
        self.sock.close()

    async def reap(self, timeout_s: float = 10.0) -> int | None:
        """Wait until the worker is gone. Jailed: until its init's pidfd turns readable,
        which the kernel does only after every other process of the pid namespace was
        killed and reaped (zap_pid_ns_processes), so nothing the call started is left
        (and the sandbox's pids.current is back down). Returns the exit status when the
        edge started the worker itself, else None."""
        if self.pidfd is not None:
            fd, self.pidfd = self.pidfd, None
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[None] = loop.create_future()
            loop.add_reader(fd, _set_done, fut)
            try:
                async with asyncio.timeout(timeout_s):
                    await fut
            except TimeoutError:
                pass  # stuck in the kernel (e.g. D state); the cgroup removal reports it
            finally:
                loop.remove_reader(fd)
                os.close(fd)
            return None
        if self.proc is not None:
            return await self.proc.wait()
        return None


class _Zygote:
    __slots__ = ("lock", "proc", "sock")

    def __init__(self, proc: asyncio.subprocess.Process, sock: socket.socket) -> None:
        self.proc, self.sock = proc, sock
        self.lock = asyncio.Lock()


class WorkerPool:
    """Warm Python workers; see the module docstring. ``jail``: the isolation every
    worker runs in (None: none at all - the caller's code runs as the edge's user)."""

    # max_spawning: refills in flight. Measured on the 2-core VM, 4 callers back to back
    # (saturating): hit rate 42% with 2, 58% with 4, 76% with 8 (pool 16). Forks from the
    # zygote are cheap, so 4 is the default; beyond that refills steal the calls' CPU.
    def __init__(self, *, pool_size: int = 8, max_spawning: int = 4,
                 python: str = sys.executable, jail: JailConfig | None = None,
                 start_timeout_s: float = 30.0, zygote: bool = True) -> None:
        if pool_size < 0 or max_spawning < 1:
            raise InvalidArgument(f"fncall pool_size={pool_size} must be >= 0 and "
                                  f"max_spawning={max_spawning} >= 1")
        if jail is not None and not zygote:
            raise InvalidArgument("a jailed fncall pool needs its zygote (zygote=True): "
                                  "the zygote builds the jail's root")
        if jail is not None and not (os.path.isabs(jail.mountpoint)
                                     and os.path.isdir(jail.mountpoint)):
            raise InvalidArgument(f"JailConfig.mountpoint={jail.mountpoint!r} must be an "
                                  "existing directory (absolute path) for the jail's root",
                                  field="mountpoint")
        self.pool_size = pool_size
        self.max_spawning = max_spawning
        self.argv = [python, "-I", "-c", _BOOT]
        self.jail = jail
        self.start_timeout_s = start_timeout_s
        self.use_zygote = zygote
        self._zygote: _Zygote | None = None
        self._zygote_failed = False
        self._zygote_start = asyncio.Lock()
        self._ready: collections.deque[_Worker] = collections.deque()
        self._spawning = 0
        self._tasks: set[asyncio.Task[Any]] = set()     # refills
        self._reaping: set[asyncio.Task[Any]] = set()   # workers being waited for
        self._closed = False
        self.hits = 0
        self.misses = 0
        self.spawn_failures = 0
        self.last_spawn_error = ""

    @property
    def ready(self) -> int:
        return len(self._ready)

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 1.0

    def start(self) -> None:
        """Begin filling the pool (needs a running loop)."""
        self._refill()

    async def wait_ready(self, n: int | None = None, timeout: float = 60.0) -> None:
        """Wait until ``n`` (default: pool_size) workers are warm."""
        want = self.pool_size if n is None else n
        self._refill()
        try:
            async with asyncio.timeout(timeout):
                while len(self._ready) < want:
                    await asyncio.sleep(0.005)
        except TimeoutError:
            raise BackendError(f"only {len(self._ready)} of {want} fncall workers warm after "
                               f"{timeout}s; last start error: {self.last_spawn_error or 'none'}"
                               ) from None

    def _refill(self) -> None:
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        while (len(self._ready) + self._spawning < self.pool_size
               and self._spawning < self.max_spawning):
            self._spawning += 1
            t = loop.create_task(self._spawn_into_pool())
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _spawn_into_pool(self) -> None:
        try:
            w = await self._spawn()
        except Exception as exc:  # noqa: BLE001 - counted; the next refill tries again
            self.spawn_failures += 1
            self.last_spawn_error = str(exc)
            w = None
            await asyncio.sleep(0.5)  # do not spin on a broken interpreter
        finally:
            self._spawning -= 1
        if w is not None:
            if self._closed:
                self._discard(w)
            else:
                self._ready.append(w)
        self._refill()

    async def _spawn(self) -> _Worker:
        if self.use_zygote and not self._zygote_failed:
            try:
                return await self._fork()
            except BackendError:
                if self._zygote is None and self.jail is None:
                    self._zygote_failed = True  # could not even start one: go direct
                raise
        return await self._exec()

    async def _launch(self, *flags: str, what: str
                      ) -> tuple[asyncio.subprocess.Process, socket.socket]:
        """Start ``self.argv`` in its own session with one end of a socketpair as its
        channel (passed by fd number); returns the process and our end (non-blocking)."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        src_r, src_w = os.pipe()
        os.write(src_w, _SRC.encode())  # a path: far below the pipe's buffer
        os.close(src_w)
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv, *flags, str(child.fileno()), pass_fds=(child.fileno(),),
                start_new_session=True, stdin=src_r,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
                env=_LAUNCH_ENV, cwd="/")
        except OSError as exc:
            parent.close()
            raise BackendError(f"cannot start {what} {self.argv[0]}: {exc}") from exc
        finally:
            child.close()
            os.close(src_r)
        parent.setblocking(False)
        return proc, parent

    async def _start_zygote(self) -> _Zygote:
        proc, parent = await self._launch("--zygote", what="the fncall zygote")
        config = msgspec.msgpack.encode({"jail": self.jail})
        err: Exception | None = None
        ok = b""
        try:
            async with asyncio.timeout(self.start_timeout_s):
                await asyncio.get_running_loop().sock_sendall(parent, _LEN.pack(len(config))
                                                              + config)
                ok = await _recv_exactly(parent, 1)
                if ok == b"E":
                    more = b""
                    with contextlib.suppress(ConnectionError, OSError):
                        while chunk := await asyncio.get_running_loop().sock_recv(parent, 4096):
                            more += chunk
                    ok += more
        except (TimeoutError, ConnectionError, OSError) as exc:
            err = exc
        if ok != b"Z":
            parent.close()
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            why = ok[1:].decode(errors="replace") if ok.startswith(b"E") else f"{ok!r}, {err!r}"
            raise BackendError(f"fncall zygote did not start: {why}")
        return _Zygote(proc, parent)

    async def _fork(self) -> _Worker:
        """Ask the zygote for a worker: send it one end of a socketpair, get a pid back."""
        async with self._zygote_start:  # one zygote at a time: a replaced one takes its
            if self._zygote is None or self._zygote.proc.returncode is not None:  # workers
                self._zygote = await self._start_zygote()                         # along
        z = self._zygote
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        parent.setblocking(False)
        async with z.lock:
            try:
                z.sock.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                         array.array("i", [child.fileno()]))])
                async with asyncio.timeout(self.start_timeout_s):
                    raw = await _recv_exactly(z.sock, 4)
            except (OSError, TimeoutError) as exc:
                parent.close()
                self._zygote = None
                z.sock.close()
                with contextlib.suppress(ProcessLookupError):
                    z.proc.kill()
                self._background(z.proc.wait())
                raise BackendError(f"fncall zygote failed to fork a worker: {exc!r}") from exc
            finally:
                child.close()
        (pid,) = _LEN.unpack(raw)
        if pid == 0:
            parent.close()
            raise BackendError("fncall zygote could not fork a worker")
        w = _Worker(pid, parent, zygote=z.proc if self.jail is not None else None)
        await self._await_ready(w)
        return w

    async def _await_ready(self, w: _Worker) -> None:
        """The worker's ``R`` (with the pidfd of its init when jailed), or its error."""
        try:
            async with asyncio.timeout(self.start_timeout_s):
                msg, fds = await _recv_with_fds(w.sock, 1)
        except (TimeoutError, ConnectionError, OSError) as exc:
            w.kill()
            await w.reap()
            raise BackendError(f"fncall worker did not become ready: {exc!r}") from exc
        if msg == b"R" and len(fds) == (self.jail is not None):
            if fds:
                w.pidfd = fds[0]
                w.pid = 0  # never signalled by number
            return
        for f in fds:
            os.close(f)
        w.kill()
        await w.reap()
        why = msg[1:].decode(errors="replace") if msg.startswith(b"E") else repr(msg[:64])
        raise BackendError(f"fncall worker failed to start: {why}")

    async def _exec(self) -> _Worker:
        proc, parent = await self._launch("--worker", what="fncall worker")
        w = _Worker(proc.pid, parent, proc=proc)
        try:
            async with asyncio.timeout(self.start_timeout_s):
                ok = await _recv_exactly(parent, 1)
        except (TimeoutError, ConnectionError, OSError) as exc:
            w.kill()
            await w.reap()
            raise BackendError(f"fncall worker did not become ready: {exc!r}") from exc
        if ok != b"R":
            w.kill()
            await w.reap()
            raise BackendError(f"fncall worker sent {ok!r} instead of its ready byte")
        return w

    async def take(self) -> tuple[_Worker, bool]:
        """A warm worker (hit) or a cold-started one (miss); the pool refills either way."""
        if self._closed:
            raise BackendError("the fncall worker pool is closed")
        ready = self._ready
        while ready:
            w = ready.popleft()
            if w.alive:
                self.hits += 1
                self._refill()
                return w, False
            self._discard(w)  # died while waiting (e.g. killed from outside)
        self.misses += 1
        self._refill()
        return await self._spawn(), True

    def _background(self, coro: Any) -> asyncio.Task[Any]:
        """Reap a worker in the background (close() waits for these, never cancels)."""
        t = asyncio.get_running_loop().create_task(coro)
        self._reaping.add(t)
        t.add_done_callback(self._reaping.discard)
        return t

    def _discard(self, w: _Worker) -> None:
        """Kill a worker that served no call, and reap it in the background."""
        w.kill()
        self._background(w.reap())

    async def run(self, request: dict[str, Any], timeout_s: float | None, *,
                  grant: Callable[[], list[int]] | None = None,
                  holder: set[_Worker] | None = None,
                  value_cap: int = MAX_VALUE_BYTES) -> FncallResult:
        """Run one request on a fresh worker and discard the worker.

        ``grant()`` returns the fds that admit the worker into its sandbox (work-dir tree,
        cgroup.procs files); they are sent with the call and closed here. While the call
        runs the worker is in ``holder`` (so a destroy can kill it). ``value_cap``: the
        most bytes of msgpack the return value may have (0: no value wanted - a worker's
        value is then never decoded)."""
        if not 0 <= value_cap <= MAX_VALUE_BYTES:
            raise InvalidArgument(f"value_cap={value_cap} must be within 0..{MAX_VALUE_BYTES}",
                                  field="value_cap")
        request = {**request, "value_cap": value_cap}
        max_reply = 2 * int(request.get("cap", 1 << 20)) + REPLY_SLACK + value_cap
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        w, cold = await self.take()
        handout = time.perf_counter() - t0
        timed_out = False
        reply: _Reply | None = None
        if holder is not None:
            holder.add(w)
        try:
            data = msgspec.msgpack.encode(request)
            payload = memoryview(b"C" + _LEN.pack(len(data)) + data)
            fds = grant() if grant is not None else []
            try:  # one message: the worker wakes once, fds ride on its first byte
                sent = w.sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                   array.array("i", fds))] if fds else [])
            except BlockingIOError as exc:  # a fresh worker's socket buffer is empty
                raise BackendError("fncall worker socket is full before the call") from exc
            except OSError as exc:
                raise BackendError(f"fncall worker is gone before the call: {exc}") from exc
            finally:
                for fd in fds:
                    os.close(fd)
            try:
                async with asyncio.timeout(timeout_s):
                    if sent < len(payload):  # a large request (pickled function, stdin)
                        await loop.sock_sendall(w.sock, payload[sent:])
                    (n,) = _LEN.unpack(await _recv_exactly(w.sock, 4))
                    if n > max_reply:
                        raise BackendError(
                            f"fncall worker sent a {n}-byte reply (limit {max_reply}); "
                            "lower the output or return a smaller value")
                    reply = _reply_decoder.decode(await _recv_exactly(w.sock, n))
            except TimeoutError:
                timed_out = True
            except (ConnectionError, OSError):
                reply = None
            except msgspec.DecodeError as exc:
                raise BackendError(f"fncall worker sent an undecodable reply: {exc}") from exc
        finally:
            w.kill()
            try:
                if w.proc is not None:
                    self._background(w.proc.wait())
                elif w.pidfd is not None:  # return once nothing of the call is left running
                    await asyncio.shield(self._background(w.reap()))
            finally:
                if holder is not None:
                    holder.discard(w)  # after the reap: a destroy waits for this
        dur = time.perf_counter() - t0
        if timed_out:
            return FncallResult(TIMEOUT_EXIT_CODE, None, None, f"timed out after {timeout_s}s", b"",
                                b"", True, cold, handout, dur)
        if reply is None:
            code = await w.reap()
            status = 1 if code is None else (code if code > 0 else 128 - code)
            return FncallResult(status, None, None,
                                "the call's process died before replying"
                                + (f" (exit status {code})" if code is not None else ""),
                                b"", b"", False, cold, handout, dur, died=True)
        if reply.jail_error is not None:
            raise BackendError(f"fncall worker could not enter its sandbox: {reply.jail_error}")
        if reply.t_start:  # the worker's clock is ours (CLOCK_MONOTONIC); clamp a forgery
            handout = min(max(reply.t_start - t0, handout), dur)
        value = None
        if reply.value is not None and value_cap:
            if len(reply.value) > value_cap:
                raise BackendError(f"fncall worker returned a {len(reply.value)}-byte value "
                                   f"(limit {value_cap} bytes of msgpack); return a smaller "
                                   "value or write the result to a file in the work dir")
            try:
                value = msgspec.msgpack.decode(reply.value)
            except msgspec.DecodeError as exc:
                raise BackendError(f"fncall worker sent an undecodable value: {exc}") from exc
        return FncallResult(reply.exit_code, value, reply.value_repr, reply.error,
                            reply.stdout, reply.stderr, False, cold, handout, dur,
                            reply.stdout_truncated, reply.stderr_truncated)

    async def close(self) -> None:
        self._closed = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        while self._ready:
            self._discard(self._ready.popleft())
        await asyncio.gather(*self._reaping, return_exceptions=True)
        z, self._zygote = self._zygote, None
        if z is not None:
            z.sock.close()  # the zygote exits on EOF
            with contextlib.suppress(ProcessLookupError):
                z.proc.kill()
            await z.proc.wait()


# ------------------------------------------------------------------------ the backend
_EXDEV = 18


class WorkFiles(SandboxFiles):
    """The container's confined file API over a fncall work dir: ``openat2`` with
    ``RESOLVE_BENEATH | RESOLVE_NO_XDEV | RESOLVE_NO_MAGICLINKS`` below an O_PATH fd of
    the work dir, so ``..``, absolute symlinks and symlinks swapped in by a concurrent
    call are refused in the kernel, atomically (the old realpath-then-open could be raced
    into reading a host file as root). NO_XDEV also keeps every fd on the work dir's own
    filesystem, which is what the container's fstatfs check is for."""

    _RESOLVE = linux.RESOLVE_BENEATH | linux.RESOLVE_NO_MAGICLINKS | linux.RESOLVE_NO_XDEV

    def _open(self, path: str, flags: int, mode: int = 0) -> int:
        return linux.openat2(self.root_fd, path.lstrip("/") or ".", flags | os.O_CLOEXEC,
                             mode, self._RESOLVE)

    def _err(self, exc: OSError, what: str, path: str) -> Exception:
        if exc.errno == _EXDEV:
            return InvalidArgument(f"{what} {path!r}: the path leaves the sandbox's work dir "
                                   f"of {self.sid} (through '..' or a symlink)", path=path)
        return super()._err(exc, what, path)


@dataclass(slots=True)
class _Box:
    spec: SandboxSpec
    dir: str
    files: WorkFiles
    cg: SandboxCgroup | None = None     # when isolated
    disk_q: str = ""                    # sysfs dir of the work dir's qgroup, when isolated
    uid: int | None = None              # host uid (= gid) its calls run as, when isolated
    active: set[_Worker] = field(default_factory=set)
    oom_seen: int = 0
    pids_seen: int = 0


class FncallBackend:
    """Backend protocol over a :class:`WorkerPool`; a sandbox is a work dir + a cgroup.

    ``isolate`` (default True; needs root): jail every call (module docstring). ``uid``:
    None (default) gives each sandbox a host uid of its own from ``uid_range`` (first,
    count; it owns the work dir, which is how an adopting edge finds it again); 0 runs
    every call as root with the container's capability set; another number runs every
    sandbox as that one uid (a single-tenant node only: the kernel counts inotify
    instances, fds in flight, processes per host uid, so tenants sharing one can starve
    each other). ``root``: where
    the work dirs live (default: a fresh private temp dir removed at close); jailed, they
    are subvolumes of a btrfs disk pool there (``container/disk.py``: ``pool.img``,
    ``pool/<sid>``), unjailed plain directories ``<root>/<sid>``.
    ``default_disk_bytes``: the work dir's cap when the spec has no ``disk_bytes``;
    ``disk_pool_bytes``: the pool's size when first made. ``max_sandbox_pids`` /
    ``pids_headroom`` / ``pids_share`` / ``notice_interval_s``: as for the container
    backend.
    """

    name = "fncall"

    def __init__(self, *, pool_size: int = 8, max_spawning: int = 4, root: str | None = None,
                 pool: WorkerPool | None = None, isolate: bool = True,
                 uid: int | None = None, uid_range: tuple[int, int] = FNCALL_UIDS,
                 uid_registry: str = UID_REGISTRY,
                 cgroup_name: str | None = None, governor: Governor | None = None,
                 default_disk_bytes: int = DEFAULT_DISK_BYTES,
                 disk_pool_bytes: int | None = None,
                 max_sandbox_pids: int = DEFAULT_MAX_SANDBOX_PIDS,
                 pids_headroom: int = DEFAULT_PIDS_HEADROOM,
                 pids_share: float | None = None,
                 notice_interval_s: float = 60.0,
                 runtime: Iterable[str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if uid is not None and not 0 <= uid < 2**32 - 1:
            raise InvalidArgument(f"fncall uid={uid} must be 0..{2**32 - 2}", field="uid")
        first, count = uid_range
        if not (first >= 1 and count >= 1 and first + count <= 2**31):
            raise InvalidArgument(f"fncall uid_range={uid_range} must be (first, count) with "
                                  "first >= 1, count >= 1 and first + count <= 2**31",
                                  field="uid_range")
        if default_disk_bytes < 1 << 20:
            raise InvalidArgument(f"default_disk_bytes={default_disk_bytes} must be >= 1 MiB",
                                  field="default_disk_bytes")
        self.isolate = isolate
        self.uid = uid
        self.uid_range = (first, count)
        self._next_uid = first
        self._uids: UidRegistry | None = None
        self._file_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._file_ops: set[asyncio.Future[Any]] = set()
        self.default_disk_bytes = default_disk_bytes
        self.clock = clock
        self._notices = NoticeLimiter(notice_interval_s)
        self._own_root = root is None
        if root is None:
            _reclaim_dead_roots(tempfile.gettempdir())
            root = tempfile.mkdtemp(prefix=_ROOT_PREFIX)
        else:
            os.makedirs(root, mode=0o700, exist_ok=True)
            # reconcile() removes every work dir this backend does not hold: a second
            # live backend on the same root would delete the first one's sandboxes.
            if ownership.owner_alive(root):
                raise InUse(f"fncall root {root} belongs to another live backend (see "
                            f"{root}.owner); stop it or give this one another root",
                            root=root)
        self.root = os.path.abspath(root)
        ownership.claim(self.root)
        self.governor: Governor | None = None
        self._claimed: str | None = None       # the cgroup name _make_governor claimed
        self._own_parents: list[str] = []
        self.disk: DiskPool | None = None
        self.max_sandbox_pids = max_sandbox_pids
        jail = None
        if isolate:
            if os.geteuid() != 0:
                self._cleanup_root()
                raise BackendError(
                    "the fncall backend isolates calls with namespaces, mounts and cgroups, "
                    "which needs root: run the edge as root, or pass isolate=False to run "
                    "calls unisolated as the edge's own user (trusted code only)")
            os.chmod(self.root, 0o700)  # work dirs may hold anything the sandboxes wrote
            try:
                jail = self._jail_config(runtime)
                self.governor = governor or self._make_governor(cgroup_name, pids_headroom,
                                                                  pids_share)
                # Where this process nests sandbox cgroups, beside where earlier ones
                # did (an edge restarted in another cgroup): reconcile looks in all.
                self._own_parents = cgroup_parents(self.governor.name)
                record_parents(self.root, self.governor.name, self._own_parents)
                self.disk = DiskPool(self.root, size_bytes=disk_pool_bytes)
                if uid is None:
                    self._uids = UidRegistry(uid_registry)
                    # claims of sandboxes a crash removed but did not release
                    self._uids.release_gone(
                        self.root, lambda sid: os.path.lexists(self.work_dir(sid)))
            except BaseException:
                self._cleanup_root()
                raise
        self.pool = pool or WorkerPool(pool_size=pool_size, max_spawning=max_spawning,
                                       jail=jail)
        if isolate and self.pool.jail is None:
            raise InvalidArgument("FncallBackend(isolate=True) was given a pool without a "
                                  "jail; build it with WorkerPool(jail=...) or omit pool=")
        self._boxes: dict[str, _Box] = {}
        self._sink: DeathSink | None = None
        self._started = False
        self._closed = False

    def _cleanup_root(self) -> None:
        if self.disk is not None:
            self.disk.close()
        if self._own_root:     # a directory of our own: what is mounted below goes too
            remove_tree(self.root, detach=True)
        ownership.disown(self.root)

    def _jail_config(self, runtime: Iterable[str] | None) -> JailConfig:
        try:
            from dsec.net.seccomp import compile_rules, profile_rules

            pre, admit = split_profile(profile_rules(allow_nested=False))
            bpf = compile_rules([*pre, *JAIL_EXTRA_RULES])
            bpf_admit = compile_rules(admit)
        except Exception as exc:  # pyseccomp/libseccomp missing or broken
            raise BackendError(f"cannot build the seccomp profile for fncall workers: {exc}; "
                               "install libseccomp2 and the pyseccomp package") from exc
        try:
            paths = tuple(runtime) if runtime is not None else python_runtime(
                sys.prefix, sys.base_prefix, site.getsitepackages())
        except ValueError as exc:
            raise BackendError(str(exc)) from exc
        # Per-sandbox uids: each call names its own; 65534 is the fallback the jail's
        # /etc lists (never used by this backend's calls).
        return JailConfig(uid=65534 if self.uid is None else self.uid, workdir=WORKDIR,
                          runtime=paths, mountpoint=self.root,
                          seccomp=bpf, seccomp_admit=bpf_admit)

    def _make_governor(self, cgroup_name: str | None, pids_headroom: int,
                       share: float | None) -> Governor:
        total, self.max_sandbox_pids = pids_budget(
            kernel_pid_max(), headroom=pids_headroom, max_sandbox=self.max_sandbox_pids,
            share=1.0 if share is None else share)
        name = cgroup_name or "fncall-" + hashlib.sha1(self.root.encode()).hexdigest()[:10]
        # one root per cgroup name: reconcile takes every cgroup under it for its own
        claim_cgroup_name(name, self.root)
        self._claimed = name
        gov = Governor(name=name, favor_dynmods=linux.remount)
        try:
            gov.limit_total_pids(total)
        except OSError as exc:
            raise BackendError(f"cannot cap the pids of all fncall sandboxes: {exc}") from exc
        return gov

    def work_dir(self, sid: str) -> str:
        """Host path of ``sid``'s work dir (``/workspace`` inside its calls)."""
        if self.disk is not None:
            return self.disk.sandbox_path(sid)
        return os.path.join(self.root, sid)

    def watch(self, sink: DeathSink) -> None:
        self._sink = sink

    def pool_stats(self) -> PoolStats:
        """Warm-pool counters for the node's heartbeat (``Heartbeat.pools``)."""
        p = self.pool
        return PoolStats(hits=p.hits, misses=p.misses, size=p.pool_size, ready=p.ready)

    def _ensure_pool(self) -> None:
        if not self._started:
            self._started = True
            self.pool.start()

    def _box(self, sid: str) -> _Box:
        box = self._boxes.get(sid)
        if box is None:
            raise SandboxNotFound(f"fncall backend has no sandbox {sid}", sandbox_id=sid)
        return box

    # ------------------------------------------------------------- lifecycle
    def _check_spec(self, spec: SandboxSpec) -> tuple[int, int | None]:
        """(disk bytes, pids.max) for ``spec``, or InvalidArgument for what fncall cannot
        give: it has loopback only and never nests namespaces."""
        if spec.net.net_mode != "none":
            raise InvalidArgument("the fncall backend has no network beyond loopback; use "
                                  "network mode 'none' (or the container backend)",
                                  field="network")
        if spec.allow_nested:
            raise InvalidArgument("the fncall backend does not allow nested namespaces; drop "
                                  "allow_nested or use the container backend",
                                  field="allow_nested")
        pids = spec.pids_max
        if self.isolate:
            pids = sandbox_pids(pids, self.max_sandbox_pids)
        if spec.disk_bytes is not None:
            return spec.disk_bytes, pids
        if self.disk is not None:
            return self.disk.default_cap(self.default_disk_bytes), pids
        return self.default_disk_bytes, pids

    async def create(self, sid: SandboxId, spec: SandboxSpec) -> None:
        disk, pids = self._check_spec(spec)
        self._ensure_pool()
        d = self.work_dir(sid)
        # No await from here until the box is in self._boxes (or the claim is released).
        uid = self._new_uid(sid) if self.isolate else None
        try:
            if self.disk is not None:
                self.disk.check_fit(disk)
                self.disk.create(sid, disk)  # a subvolume whose qgroup caps it at `disk`
                assert uid is not None
                os.chown(d, uid, uid)
            else:
                os.mkdir(d, 0o700)
        except OSError as exc:
            self._teardown(sid, None, uid)
            raise BackendError(f"cannot make the work dir of {sid}: {exc}") from exc
        except BaseException:
            self._teardown(sid, None, uid)
            raise
        try:
            self._boxes[sid] = self._open_box(sid, spec, pids, fresh=True, uid=uid)
        except BaseException:
            self._teardown(sid, None, uid)
            raise

    def _new_uid(self, sid: str) -> int:
        """The uid for new sandbox ``sid``: the fixed one, or the next one of the range no
        sandbox on this host holds, claimed for it (round robin, so a freed uid is
        reused last)."""
        if self.uid is not None:
            return self.uid
        assert self._uids is not None
        first, count = self.uid_range
        used = {b.uid for b in self._boxes.values()}
        start = self._next_uid
        order = (first + (start - first + i) % count for i in range(count))
        uid = self._uids.claim(self.root, sid, (u for u in order if u not in used))
        if uid is None:
            raise CapacityExceeded(
                f"all {count} fncall sandbox uids ({first}..{first + count - 1}) are held by "
                "sandboxes on this host; destroy sandboxes or give the backends a larger "
                "uid_range", resource="fncall_uids", limit=count)
        self._next_uid = first + (uid - first + 1) % count
        return uid

    def _adopted_uid(self, sid: str, d: str) -> int:
        """An adopted sandbox's uid: the owner of its work dir (given it at create) if it
        is one of our range that no other sandbox on the host holds; otherwise (a uid-0
        or shared-uid sandbox of an older configuration, a clash) a new one, and the
        whole work dir is given to it."""
        if self.uid is not None:
            return self.uid
        assert self._uids is not None
        owner = os.stat(d).st_uid
        first, count = self.uid_range
        if first <= owner < first + count and \
                owner not in {b.uid for b in self._boxes.values()} and \
                self._uids.hold(owner, self.root, sid):
            return owner
        uid = self._new_uid(sid)
        try:
            _chown_tree(d, uid)
        except BaseException:
            self._uids.release(uid, self.root, sid)
            raise
        return uid

    def _open_box(self, sid: str, spec: SandboxSpec, pids: int | None, *,
                  fresh: bool, uid: int | None = None) -> _Box:
        d = self.work_dir(sid)
        if self.isolate and uid is None:
            uid = self._adopted_uid(sid, d)
        cg = None
        gov = self.governor
        if gov is not None:
            limits = Limits(cpu_milli=spec.cpu_milli, memory_bytes=spec.memory_bytes,
                            pids_max=pids, qos=qos_of(spec),   # cgroup side (issue 22)
                            cpu_quota_milli=spec.cpu_quota_milli)
            cg = gov.paths(sid)
            if fresh or not gov.exists(cg):
                gov.remove(cg)  # a leftover of a crashed create with the same id
                cg = gov.create(sid, limits)
        fd = os.open(d, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
        box = _Box(spec, d, WorkFiles(fd, sid, owner=uid), cg, uid=uid)
        if self.disk is not None:
            try:
                box.disk_q = self.disk.qgroup_dir(sid)
            except OSError as exc:
                box.files.close()
                raise BackendError(f"the work dir of {sid} has no disk quota: {exc}") from exc
        if gov is not None and cg is not None:
            box.oom_seen = gov.oom_kills(cg)
            box.pids_seen = gov.pids_limit_hits(cg)
        return box

    def _teardown(self, sid: str, box: _Box | None, uid: int | None = None) -> None:
        """Undo whatever exists of sandbox ``sid``; tolerates every part being gone.
        ``uid``: its claimed uid when there is no box yet (a failed create)."""
        if box is not None and box.uid is not None:
            uid = box.uid
        elif uid is None and self._uids is not None:
            with contextlib.suppress(OSError):  # a leftover: its work dir names its uid
                uid = os.lstat(self.work_dir(sid)).st_uid
        if box is not None:
            for w in list(box.active):
                w.signal_kill()  # its call sees EOF, returns "died" and reaps it
            box.files.close()
        gov = self.governor
        if gov is not None:
            cg = box.cg if box is not None and box.cg is not None else gov.paths(sid)
            if gov.present(cg) and gov.pids(cg):
                gov.kill_all(cg)  # stragglers from before an edge restart
            gov.remove(cg)
        self._notices.forget(sid)
        if self.disk is not None:
            try:
                self.disk.remove(sid)
            except OSError as exc:
                raise BackendError(f"cannot delete the work dir of {sid}: {exc}") from exc
        else:
            remove_tree(self.work_dir(sid))      # never across a mount point
        if self._uids is not None and uid is not None:
            self._uids.release(uid, self.root, sid)

    async def adopt(self, sid: SandboxId, spec: SandboxSpec) -> bool:
        self._ensure_pool()
        if os.path.isdir(self.work_dir(sid)):
            try:
                _, pids = self._check_spec(spec)
                box = self._open_box(sid, spec, pids, fresh=False)
            except Exception:  # noqa: BLE001, S110 - not adoptable: clean up, report it gone
                pass
            else:
                if self.governor is not None and box.cg is not None and \
                        self.governor.pids(box.cg):
                    self.governor.kill_all(box.cg)  # calls cut off by the edge's crash
                self._boxes[sid] = box
                return True
        self._teardown(sid, None)
        return False

    async def destroy(self, sid: SandboxId) -> None:
        box = self._boxes.pop(sid, None)
        if box is not None and box.active:
            for w in list(box.active):
                w.signal_kill()  # each call sees EOF, answers "died" and reaps its worker
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10):
                    while box.active:  # so the cgroup is empty before we remove it
                        await asyncio.sleep(0.005)
        # In a thread: the work dir is the tenant's to fill (a million files took the
        # rmtree seconds, and on the loop every other sandbox's requests waited)
        await asyncio.to_thread(self._teardown, sid, box)

    async def pause(self, sid: SandboxId) -> PauseStats:
        self._box(sid)
        return PauseStats()  # no process outlives a call: nothing to freeze or reclaim

    async def resume(self, sid: SandboxId) -> None:
        self._box(sid)

    async def stats(self, sid: SandboxId) -> SandboxStats:
        box = self._box(sid)
        if self.governor is not None and box.cg is not None:
            mem, peak, cpu, pids = self.governor.stats(box.cg)
            use = DiskPool.usage_at(box.disk_q)
            return SandboxStats(memory_bytes=mem, memory_peak_bytes=peak, cpu_seconds=cpu,
                                pids=pids, disk_bytes=use.used_bytes,
                                disk_cap_bytes=use.cap_bytes,
                                disk_full=self._check_disk(sid, box),
                                memory_limit_bytes=box.spec.memory_bytes,
                                pids_max=box.spec.pids_max,
                                oom_kills=self.governor.oom_kills(box.cg))
        size = 0
        for dirpath, _, files in walk(box.dir):
            for f in files:
                with contextlib.suppress(OSError):
                    size += os.lstat(os.path.join(dirpath, f)).st_size
        return SandboxStats(disk_bytes=size)

    def _check_disk(self, sid: str, box: _Box) -> bool:
        """A sandbox at its disk cap (or on a full pool) gets a ``disk_full`` notice (rate
        limited like every notice, as in the container backend)."""
        if not box.disk_q:
            return False
        use = DiskPool.usage_at(box.disk_q)
        if near_cap(use.used_bytes, use.cap_bytes):
            detail = (f"sandbox {sid} filled its disk cap of {use.cap_bytes} bytes "
                      f"({use.used_bytes} used); writes fail with EDQUOT (Disk quota "
                      "exceeded) until files are removed - free space inside the sandbox "
                      "or create it with a larger disk_bytes")
        else:
            vfs = os.statvfs(box.dir)
            free = vfs.f_bavail * vfs.f_frsize
            if free >= 1 << 20:
                return False
            detail = (f"the node's fncall disk pool is full ({free} bytes free, sandbox "
                      f"{sid} holds {use.used_bytes} of its {use.cap_bytes}-byte cap); "
                      "writes fail with ENOSPC until sandboxes free space")
        self._notice(sid, "disk_full", detail)
        return True

    async def close(self) -> None:
        """Node shutdown. With its own temp root every sandbox goes; with a given root
        the sandboxes stay for the next edge to adopt (work dirs and cgroups). The disk
        pool is unmounted and the parent cgroups go once no sandbox is left. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self.pool.close()
        if self._file_pool is not None:  # file operations in flight finish first
            await asyncio.gather(*self._file_ops, return_exceptions=True)
            self._file_pool.shutdown(wait=True)
        if self._own_root:
            for sid, box in list(self._boxes.items()):
                self._teardown(sid, box)
        for box in self._boxes.values():
            box.files.close()
        self._boxes.clear()
        left = bool(self.disk.sandboxes()) if self.disk is not None else False
        if self.disk is not None:
            self.disk.close()
        if self._own_root:
            remove_tree(self.root, detach=True)
        elif self.disk is None:
            left = any(e.is_dir() for e in os.scandir(self.root))
        if self.governor is not None and not left:
            with contextlib.suppress(OSError, BackendError):
                self.governor.remove_base()
            release_cgroup_name(self.governor.name, self.root)
        elif self.governor is not None:   # left for a later adopt: the next may claim it
            hand_over_cgroup_name(self.governor.name, self.root)
        ownership.disown(self.root)

    # ---------------------------------------------------------------- after a crash
    async def reconcile(self, keep: AbstractSet[str]) -> list[Leftover]:
        """At node start, after adoption: remove every trace of sandboxes the node does not
        keep - the processes still in their cgroups, the cgroups, their work dirs. Jailed
        workers of a dead edge died with its zygote (PR_SET_PDEATHSIG); what a call left
        running is found by its sandbox's cgroup, never by a pid number or a cwd. Unjailed
        workers are found by their cwd under the root and killed by process group."""
        # The backend reconciling this root at start owns its cgroup name (again): an
        # edge killed after another process on the same root re-claimed it left the
        # binding to a dead claimer, and any container edge's start then swept this
        # one's empty cgroups - a paused VM's, an idle base (CI: census.idle_names).
        if self._claimed is not None:
            await asyncio.to_thread(claim_cgroup_name, self._claimed, self.root)
        out = []
        if self.disk is not None and self.governor is not None:
            earlier = await self._reclaim_earlier_parents()
            names = set(self.disk.sandboxes()) | set(self.governor.list_sandboxes())
            for name in sorted(names - set(keep) - set(self._boxes)):
                out.append(self._discard_jailed(name))
            for name in sorted(set(earlier) - names - set(keep) - set(self._boxes)):
                out.append(Leftover(name, "fncall", earlier[name]))
            return out
        strays = _stray_workers(self.root)
        _kill_groups(strays.values())
        for name in sorted(os.listdir(self.root)):
            d = os.path.join(self.root, name)
            if name in keep or name in self._boxes or not os.path.isdir(d):
                continue
            n = sum(1 for cwd in strays if cwd == d or cwd.startswith(d + os.sep))
            remove_tree(d)
            out.append(Leftover(name, "fncall", "work directory"
                                + (f", {n} runaway worker(s)" if n else "")))
        return out

    async def _reclaim_earlier_parents(self) -> dict[str, str]:
        """Kill what runs in, and remove, the sandbox cgroups under parents an earlier
        process of this root used (it ran in another cgroup): none of them is this
        process's - calls never outlive their edge, an adopted sandbox gets its cgroups
        under this process's parents. Returns what was found, by sandbox id."""
        gov = self.governor
        assert gov is not None
        found: dict[str, str] = {}
        for parent in recorded_parents(self.root, gov.name):
            if parent in self._own_parents or not os.path.isdir(parent):
                continue
            for e in os.scandir(parent):
                if not e.is_dir(follow_symlinks=False):
                    continue
                n = sum(len(tasks_of(d)) for d, _, _ in walk(e.path))
                try:
                    await remove_cgroup_dirs([e.path])
                    what = "cgroup under an earlier edge's parent"
                except OSError as exc:
                    what = f"cgroup under an earlier edge's parent, not removed: {exc}"
                found[e.name] = what + (f", {n} runaway process(es)" if n else "")
            with contextlib.suppress(OSError):
                os.rmdir(parent)
        record_parents(self.root, gov.name, self._own_parents)
        return found

    async def discard(self, sid: SandboxId) -> Leftover | None:
        """Remove what is left of a sandbox the node does not know (``reconcile`` for one)."""
        if sid in self._boxes or "/" in sid or sid.startswith("."):
            return None
        if self.disk is not None and self.governor is not None:
            if not (os.path.lexists(self.work_dir(sid))
                    or self.governor.present(self.governor.paths(sid))):
                return None
            return await asyncio.to_thread(self._discard_jailed, sid)
        d = os.path.join(self.root, sid)
        if not os.path.isdir(d):
            return None
        _kill_groups(pgid for cwd, pgid in _stray_workers(d).items())
        await asyncio.to_thread(remove_tree, d)
        return Leftover(sid, "fncall", "work directory")

    def _discard_jailed(self, name: str) -> Leftover:
        gov = self.governor
        assert gov is not None
        cg = gov.paths(name)
        found = (["work directory"] if os.path.lexists(self.work_dir(name)) else []) + \
            (["cgroup"] if gov.present(cg) else [])
        n = len(gov.pids(cg)) if gov.present(cg) else 0
        try:
            self._teardown(name, None)
        except BackendError as exc:
            found.append(f"not all removed: {exc}")
        return Leftover(name, "fncall", ", ".join(
            found + ([f"{n} runaway process(es)"] if n else [])))

    # ---------------------------------------------------------------- calls
    def _grant(self, box: _Box, cg: SandboxCgroup) -> Callable[[], list[int]]:
        """Opens, per call, what admits a worker into ``box``: a detached clone of the
        work dir's mount and the sandbox's ``cgroup.procs`` files."""
        def grant() -> list[int]:
            fds: list[int] = []
            try:
                fds.append(clone_tree(box.dir))
                for path in cg.procs_files:
                    fds.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
            except OSError as exc:
                for fd in fds:
                    os.close(fd)
                raise BackendError(f"cannot hand sandbox {box.files.sid} to a worker (it is "
                                   f"being destroyed, or its work dir or cgroup is gone): "
                                   f"{exc}") from exc
            return fds
        return grant

    async def _run(self, sid: str, box: _Box, request: dict[str, Any],
                   timeout_s: float | None, *, value_cap: int) -> FncallResult:
        self._ensure_pool()
        request["hostname"] = sid
        gov, cg = self.governor, box.cg
        if gov is None or cg is None:
            return await self.pool.run(request, timeout_s, holder=box.active,
                                       value_cap=value_cap)
        request["uid"] = box.uid
        res = await self.pool.run(request, timeout_s, grant=self._grant(box, cg),
                                  holder=box.active, value_cap=value_cap)
        return self._after_call(sid, box, gov, cg, res)

    def _after_call(self, sid: str, box: _Box, gov: Governor, cg: SandboxCgroup,
                    res: FncallResult) -> FncallResult:
        """Turn limit hits during the call into sandbox events (the sandbox lives on)."""
        spec = box.spec
        kills = gov.oom_kills(cg)
        if kills > box.oom_seen:
            n, box.oom_seen = kills - box.oom_seen, kills
            self._notice(sid, "oom_kill", f"the OOM killer killed {n} process(es) of a call in "
                         f"sandbox {sid}, which hit its memory limit of {spec.memory_bytes} "
                         "bytes; the sandbox itself is still there - raise memory_bytes")
            if res.died:
                res = FncallResult(TIMEOUT_EXIT_CODE, None, None,
                                   f"the call was killed by the OOM killer: sandbox {sid} "
                                   f"has memory_bytes={spec.memory_bytes}", res.stdout,
                                   res.stderr, False, res.cold, res.handout_s, res.duration_s,
                                   died=True)
        self._check_disk(sid, box)
        hits = gov.pids_limit_hits(cg)
        if hits > box.pids_seen:
            n, box.pids_seen = hits - box.pids_seen, hits
            self._notice(sid, "pids_limit", f"{n} fork(s) in sandbox {sid} were refused: it "
                         f"reached its pids_max; raise pids_max if the call needs more "
                         "processes")
        return res

    def _notice(self, sid: str, reason: str, detail: str) -> None:
        """Report a notice (the sandbox lives on), at most one per kind and sandbox per
        ``notice_interval_s``; the next one says how many were folded into it."""
        folded = self._notices.admit(sid, reason, self.clock())
        if folded is None:
            return
        if folded:
            detail += (f" ({folded} more notice(s) of this kind in the last "
                       f"{self._notices.interval_s:g} s were folded into this one)")
        if self._sink is not None:
            self._sink(SandboxId(sid), reason, detail)

    def _cwd(self, box: _Box, cwd: str | None) -> str | None:
        """The call's working directory as the worker sees it, or None if it is not a
        directory of the work dir."""
        rel = posixpath.normpath("/" + (cwd or "")).lstrip("/")
        if rel:
            try:
                if box.files.stat(rel).type != "dir":
                    return None
            except (InvalidArgument, SandboxNotFound, LookupError):
                return None
        base = WORKDIR if self.isolate else box.dir
        return posixpath.join(base, rel) if rel else base

    async def call(self, sid: SandboxId, fn: Callable[..., Any], *args: Any,
                   timeout_s: float | None = 60.0, **kwargs: Any) -> FncallResult:
        """Run ``fn(*args, **kwargs)`` in a fresh worker (fn must be picklable by
        reference, i.e. importable in the worker: the standard library and the packages
        installed in the edge's venv)."""
        box = self._box(sid)
        try:
            blob = pickle.dumps((fn, args, kwargs))
        except Exception as exc:
            raise InvalidArgument(f"cannot pickle the call to {fn!r}: {exc}") from exc
        return await self._run(sid, box, {"fn": blob, "cwd": self._cwd(box, None),
                                          "env": dict(box.spec.env)}, timeout_s,
                               value_cap=MAX_VALUE_BYTES)

    async def exec(self, sid: SandboxId, req: ExecRequest) -> ExecResult:
        box = self._box(sid)
        code = _code_of(req)
        cwd = self._cwd(box, req.cwd)
        if cwd is None:
            return ExecResult(exit_code=2, stderr=f"cwd {req.cwd}: no such directory\n".encode())
        gov, cg = self.governor, box.cg
        oom_before = gov.oom_kills(cg) if gov is not None and cg is not None else 0
        r = await self._run(sid, box, {"code": code, "cwd": cwd,
                                       "env": {**box.spec.env, **req.env},
                                       "stdin": req.stdin, "cap": req.output_cap_bytes},
                            req.timeout_s, value_cap=0)  # an exec prints its value
        oom = gov is not None and cg is not None and gov.oom_kills(cg) > oom_before
        cap = req.output_cap_bytes
        stderr = r.stderr
        if r.died and r.error:
            stderr += f"{r.error}\n".encode()
        return ExecResult(exit_code=r.exit_code, stdout=r.stdout[:cap], stderr=stderr[:cap],
                          stdout_truncated=r.stdout_truncated or len(r.stdout) > cap,
                          stderr_truncated=r.stderr_truncated or len(stderr) > cap,
                          timed_out=r.timed_out, duration_s=r.duration_s, oom_killed=oom)

    async def exec_stream(self, sid: SandboxId,
                          req: ExecRequest) -> AsyncIterator[ExecChunk | ExecResult]:
        async for item in replay_as_stream(await self.exec(sid, req)):
            yield item

    # ---------------------------------------------------------------- files
    async def _files(self, sid: SandboxId, op: Callable[[WorkFiles], _T]) -> _T:
        """Run ``op`` beside the event loop, in the backend's file threads. A sandbox
        decides how big its trees are (a 10 GiB cap holds tens of millions of files), so
        walking one on the loop stopped every other sandbox's calls, heartbeats and
        connections: measured on the dev VM, 300,000 files took 15 s to list and 25 s to
        remove. ``op`` gets its own dup of the work dir's fd, closed by its thread, so a
        destroy closing the sandbox's fd meanwhile can never leave the thread holding a
        number the kernel gave to another sandbox's directory."""
        box = self._box(sid)
        files = WorkFiles(os.dup(box.files.root_fd), box.files.sid, owner=box.files.owner,
                          disk_room=box.files.disk_room)

        def work() -> _T:
            try:
                return op(files)
            finally:
                files.close()

        if self._file_pool is None:
            self._file_pool = concurrent.futures.ThreadPoolExecutor(
                FILE_THREADS, thread_name_prefix="dsec-fncall-files")
        try:
            fut = asyncio.get_running_loop().run_in_executor(self._file_pool, work)
        except BaseException:
            files.close()
            raise
        self._file_ops.add(fut)
        fut.add_done_callback(self._file_ops.discard)
        return await fut

    async def read_file(self, sid: SandboxId, path: str, *, offset: int = 0,
                        length: int | None = None) -> bytes:
        return await self._files(sid, lambda f: f.read(path, offset, length))

    async def write_file(self, sid: SandboxId, path: str, data: bytes, *, mode: int = 0o644,
                         append: bool = False) -> None:
        await self._files(sid, lambda f: f.write(path, data, mode=mode, append=append))

    # streamed transfer, rename, watch (issue 19; dsec.edge.filestream drives them)
    def _handle(self, sid: SandboxId) -> WorkFiles:
        """A handle of the sandbox's work dir for one long call (its own dup of the fd,
        closed by the caller)."""
        box = self._box(sid)
        return WorkFiles(os.dup(box.files.root_fd), box.files.sid, owner=box.files.owner,
                         disk_room=box.files.disk_room)

    async def _in_pool(self, fn: Callable[[], _T]) -> _T:
        if self._file_pool is None:
            self._file_pool = concurrent.futures.ThreadPoolExecutor(
                FILE_THREADS, thread_name_prefix="dsec-fncall-files")
        fut = asyncio.get_running_loop().run_in_executor(self._file_pool, fn)
        self._file_ops.add(fut)
        fut.add_done_callback(self._file_ops.discard)
        return await fut

    async def read_stream(self, sid: SandboxId, path: str, offset: int, length: int | None,
                          sink: Callable[[bytes], Awaitable[None]]) -> FileInfo:
        with self._handle(sid) as files:
            return await filestream.read_stream(files, path, offset, length, sink,
                                                self._in_pool)

    async def write_stream(self, sid: SandboxId, path: str, mode: int, size: int | None,
                           source: AsyncIterator[bytes]) -> FileInfo:
        with self._handle(sid) as files:
            return await filestream.write_stream(files, path, mode, size, source,
                                                 self._in_pool)

    async def rename_file(self, sid: SandboxId, src: str, dst: str,
                          overwrite: bool) -> FileInfo:
        return await self._files(sid, lambda f: f.rename(src, dst, overwrite=overwrite))

    async def watch_files(self, sid: SandboxId, path: str, recursive: bool,
                          tenant: str = "") -> AsyncIterator[FileEvent]:
        with self._handle(sid) as files:
            async for ev in filestream.watch(files, path, recursive, self._in_pool,
                                             tenant):
                yield ev

    async def list_dir(self, sid: SandboxId, path: str) -> list[FileInfo]:
        return await self._files(sid, lambda f: f.list(path))

    async def stat(self, sid: SandboxId, path: str) -> FileInfo:
        return await self._files(sid, lambda f: f.stat(path))

    async def mkdir(self, sid: SandboxId, path: str, *, parents: bool = True) -> None:
        await self._files(sid, lambda f: f.mkdir(path, parents=parents))

    async def remove(self, sid: SandboxId, path: str, *, recursive: bool = False) -> None:
        await self._files(sid, lambda f: f.remove(path, recursive=recursive))


def _code_of(req: ExecRequest) -> str:
    if req.shell is not None:
        return req.shell
    argv = req.argv
    if len(argv) == 3 and os.path.basename(argv[0]).startswith("python") and argv[1] == "-c":
        return argv[2]
    raise InvalidArgument(
        f"the fncall backend runs Python code: pass shell=<code> or argv=['python', '-c', <code>], "
        f"not argv={list(argv)!r}", field="argv")


_ROOT_PREFIX = "dsec-fncall-"


def _stray_workers(root: str) -> dict[str, int]:
    """cwd -> process group of *unjailed* fncall workers whose working directory is under
    ``root`` (a worker runs a call in its sandbox's work dir; user code that chdir'd
    elsewhere is not found - see docs/edge.md). Jailed workers are never looked for this
    way: they die with their zygote, and calls are found by their sandbox's cgroup."""
    out: dict[str, int] = {}
    prefix = root.rstrip("/") + "/"
    me = os.getpid()
    for pid_s in os.listdir("/proc"):
        if not pid_s.isdigit() or int(pid_s) == me:
            continue
        try:
            cwd = os.readlink(f"/proc/{pid_s}/cwd")
            if cwd != root and not cwd.startswith(prefix):
                continue
            with open(f"/proc/{pid_s}/cmdline", "rb") as f:
                if b"fncall_worker" not in f.read():
                    continue
            out[cwd] = os.getpgid(int(pid_s))
        except (OSError, ProcessLookupError):
            continue
    return out


def _chown_tree(top: str, uid: int) -> None:
    """Give ``top`` and everything below it to ``uid`` (= gid), never following a
    symlink (only while no call runs in it: at adoption)."""
    os.lchown(top, uid, uid)
    for dirpath, dirnames, filenames in walk(top):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, uid)


def _kill_groups(pgids: Any) -> None:
    for pgid in set(pgids):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def _reclaim_dead_roots(tmp: str) -> None:
    """Remove the default roots of fncall backends whose process died (a crash skips
    ``close``): the processes left in their sandboxes' cgroups, the cgroups, the disk
    pool's mount, the files; unjailed workers still running in them."""
    for e in os.scandir(tmp):
        # Only a directory we made (tmp is every host user's: another user's
        # dsec-fncall-* with an owner record naming a dead process is not ours to kill
        # processes for, unmount or delete).
        if not (e.name.startswith(_ROOT_PREFIX) and e.is_dir(follow_symlinks=False)
                and e.stat(follow_symlinks=False).st_uid == os.geteuid()
                and ownership.owner_alive(e.path) is False):
            continue
        _kill_groups(_stray_workers(e.path).values())
        if os.geteuid() == 0 and os.path.exists(os.path.join(e.path, "pool.img")):
            with contextlib.suppress(OSError, BackendError):
                gov = Governor(name="fncall-" + hashlib.sha1(e.path.encode()).hexdigest()[:10])
                for sid in gov.list_sandboxes():
                    cg = gov.paths(sid)
                    gov.kill_all(cg)
                    gov.remove(cg)
                gov.remove_base()
            name = "fncall-" + hashlib.sha1(e.path.encode()).hexdigest()[:10]
            for parent in recorded_parents(e.path, name):  # it ran in another cgroup
                with contextlib.suppress(OSError):
                    remove_cgroup_dirs_now([parent])
            release_cgroup_name(name, e.path)
            pool = os.path.join(e.path, "pool")
            if os.path.ismount(pool):
                with contextlib.suppress(OSError):
                    linux.umount2(pool, linux.MNT_DETACH)
        remove_tree(e.path, detach=True)     # a dead edge's own root
        ownership.disown(e.path)


def make_backend(**opts: Any) -> FncallBackend:
    return FncallBackend(**opts)
