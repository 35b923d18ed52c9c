"""The ``fncall`` backend: Python calls handed to pre-started worker processes.

A :class:`WorkerPool` keeps ``pool_size`` interpreters warm (started, imports done,
blocked on their control socket). Workers are forked from a zygote process that did the
imports once (see ``fncall_worker.py``); if the zygote cannot run, each worker is a fresh
interpreter. A call takes one (a pool hit is a deque pop: the
handout target is <= 5 ms, DSec's published figure), sends it the code or pickled
function, waits with the call's timeout, and then kills the worker's whole process group:
one worker, one call, so no state leaks between calls. The pool refills in the
background, at most ``max_spawning`` starts at a time (each start costs CPU; on 2 cores
unbounded refills starve the calls themselves). An empty pool falls back to a cold
start, counted in :attr:`WorkerPool.misses`.

A sandbox of this backend is a working directory (its files persist across calls) plus
the spec's environment; processes never persist. Exec runs ``shell`` as Python code (the
value of a final expression is printed, as in the interactive interpreter) or
``argv = ["python", "-c", CODE]``. :meth:`FncallBackend.call` runs a picklable function.

Security note: there is no isolation here beyond a separate process; worker replies are
decoded as plain msgpack, never unpickled, because the code in a worker is hostile.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import os
import pickle
import shutil
import signal
import socket
import struct
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import msgspec

from dsec import ownership
from dsec.edge.backend import DeathSink, Leftover, replay_as_stream
from dsec.edge.protocol import PoolStats
from dsec.edge.spec import (
    ExecChunk,
    ExecRequest,
    ExecResult,
    FileInfo,
    PauseStats,
    SandboxSpec,
    SandboxStats,
)
from dsec.errors import BackendError, InUse, InvalidArgument, NotFound, SandboxNotFound
from dsec.ids import SandboxId

__all__ = ["FncallBackend", "FncallResult", "WorkerPool", "make_backend"]

_LEN = struct.Struct("!I")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fncall_worker.py")
TIMEOUT_EXIT = 137
# A reply carries at most two capped outputs plus a value; anything larger is a hostile
# or broken worker, refused before the edge allocates it.
REPLY_SLACK = 8 << 20


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
    handout_s: float           # time to get a ready worker
    duration_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False


class _Worker:
    """One warm worker. ``proc`` is set when the edge started it directly (it must reap
    it); zygote-forked workers are reaped by the zygote."""

    __slots__ = ("pid", "proc", "reader", "writer")

    def __init__(self, pid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 proc: asyncio.subprocess.Process | None = None) -> None:
        self.pid, self.reader, self.writer, self.proc = pid, reader, writer, proc

    @property
    def alive(self) -> bool:
        return not self.reader.at_eof() and (self.proc is None or self.proc.returncode is None)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.writer.close()

    async def reap(self) -> int | None:
        if self.proc is not None:
            return await self.proc.wait()
        return None


class _Zygote:
    __slots__ = ("lock", "proc", "sock")

    def __init__(self, proc: asyncio.subprocess.Process, sock: socket.socket) -> None:
        self.proc, self.sock = proc, sock
        self.lock = asyncio.Lock()


class WorkerPool:
    """Warm Python workers; see the module docstring."""

    # max_spawning: refills in flight. Measured on the 2-core VM, 4 callers back to back
    # (saturating): hit rate 42% with 2, 58% with 4, 76% with 8 (pool 16). Forks from the
    # zygote are cheap, so 4 is the default; beyond that refills steal the calls' CPU.
    def __init__(self, *, pool_size: int = 8, max_spawning: int = 4,
                 python: str = sys.executable, isolated: bool = True,
                 start_timeout_s: float = 30.0, zygote: bool = True) -> None:
        if pool_size < 0 or max_spawning < 1:
            raise InvalidArgument(f"fncall pool_size={pool_size} must be >= 0 and "
                                  f"max_spawning={max_spawning} >= 1")
        self.pool_size = pool_size
        self.max_spawning = max_spawning
        self.argv = [python, *(["-I"] if isolated else []), WORKER]
        self.start_timeout_s = start_timeout_s
        self.use_zygote = zygote
        self._zygote: _Zygote | None = None
        self._zygote_failed = False
        self._ready: collections.deque[_Worker] = collections.deque()
        self._spawning = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.hits = 0
        self.misses = 0
        self.spawn_failures = 0

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
        async with asyncio.timeout(timeout):
            while len(self._ready) < want:
                await asyncio.sleep(0.005)

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
        except Exception:  # noqa: BLE001 - counted; the next refill tries again
            self.spawn_failures += 1
            w = None
            await asyncio.sleep(0.5)  # do not spin on a broken interpreter
        finally:
            self._spawning -= 1
        if w is not None:
            if self._closed:
                w.kill()
            else:
                self._ready.append(w)
        self._refill()

    async def _spawn(self) -> _Worker:
        if self.use_zygote and not self._zygote_failed:
            try:
                return await self._fork()
            except BackendError:
                if self._zygote is None:
                    self._zygote_failed = True  # could not even start one: go direct
                raise
        return await self._exec()

    async def _launch(self, *flags: str, what: str
                      ) -> tuple[asyncio.subprocess.Process, socket.socket]:
        """Start ``self.argv`` in its own session with one end of a socketpair as its
        channel (passed by fd number); returns the process and our end."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv, *flags, str(child.fileno()), pass_fds=(child.fileno(),),
                start_new_session=True, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        except OSError as exc:
            parent.close()
            raise BackendError(f"cannot start {what} {self.argv[0]}: {exc}") from exc
        finally:
            child.close()
        return proc, parent

    async def _start_zygote(self) -> _Zygote:
        proc, parent = await self._launch("--zygote", what="the fncall zygote")
        parent.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.start_timeout_s):
                ok = await loop.sock_recv(parent, 1)
        except TimeoutError as exc:
            ok = b""
            err: Exception | None = exc
        else:
            err = None
        if ok != b"Z":
            parent.close()
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise BackendError(f"fncall zygote did not start (got {ok!r}, {err!r})")
        return _Zygote(proc, parent)

    async def _fork(self) -> _Worker:
        """Ask the zygote for a worker: send it one end of a socketpair, get a pid back."""
        loop = asyncio.get_running_loop()
        if self._zygote is None or self._zygote.proc.returncode is not None:
            self._zygote = await self._start_zygote()
        z = self._zygote
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        async with z.lock:
            try:
                z.sock.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                         array.array("i", [child.fileno()]))])
                raw = b""
                async with asyncio.timeout(self.start_timeout_s):
                    while len(raw) < 4:
                        more = await loop.sock_recv(z.sock, 4 - len(raw))
                        if not more:
                            raise ConnectionError("zygote closed its socket")
                        raw += more
            except (OSError, TimeoutError) as exc:
                parent.close()
                self._zygote = None
                with contextlib.suppress(ProcessLookupError):
                    z.proc.kill()
                raise BackendError(f"fncall zygote failed to fork a worker: {exc!r}") from exc
            finally:
                child.close()
        (pid,) = _LEN.unpack(raw)
        if pid == 0:
            parent.close()
            raise BackendError("fncall zygote refused the fork request")
        reader, writer = await asyncio.open_unix_connection(sock=parent, limit=1 << 20)
        w = _Worker(pid, reader, writer)
        await self._await_ready(w)
        return w

    async def _await_ready(self, w: _Worker) -> None:
        try:
            async with asyncio.timeout(self.start_timeout_s):
                ok = await w.reader.readexactly(1)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
            w.kill()
            await w.reap()
            raise BackendError(f"fncall worker did not become ready: {exc!r}") from exc
        if ok != b"R":
            w.kill()
            await w.reap()
            raise BackendError(f"fncall worker sent {ok!r} instead of its ready byte")

    async def _exec(self) -> _Worker:
        proc, parent = await self._launch(what="fncall worker")
        reader, writer = await asyncio.open_unix_connection(sock=parent, limit=1 << 20)
        w = _Worker(proc.pid, reader, writer, proc)
        await self._await_ready(w)
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
            w.kill()  # died while waiting (e.g. killed from outside)
        self.misses += 1
        self._refill()
        return await self._spawn(), True

    async def run(self, request: dict[str, Any], timeout_s: float | None) -> FncallResult:
        """Run one request on a fresh worker and discard the worker."""
        max_reply = 2 * int(request.get("cap", 1 << 20)) + REPLY_SLACK
        t0 = time.perf_counter()
        w, cold = await self.take()
        handout = time.perf_counter() - t0
        timed_out = False
        reply: _Reply | None = None
        try:
            data = msgspec.msgpack.encode(request)
            w.writer.write(_LEN.pack(len(data)) + data)
            try:
                async with asyncio.timeout(timeout_s):
                    (n,) = _LEN.unpack(await w.reader.readexactly(4))
                    if n > max_reply:
                        raise BackendError(
                            f"fncall worker sent a {n}-byte reply (limit {max_reply}); "
                            "lower the output or return a smaller value")
                    reply = _reply_decoder.decode(await w.reader.readexactly(n))
            except TimeoutError:
                timed_out = True
            except (asyncio.IncompleteReadError, ConnectionError):
                reply = None
            except msgspec.DecodeError as exc:
                raise BackendError(f"fncall worker sent an undecodable reply: {exc}") from exc
        finally:
            w.kill()
            if w.proc is not None:
                t = asyncio.get_running_loop().create_task(w.proc.wait())
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)
        dur = time.perf_counter() - t0
        if timed_out:
            return FncallResult(TIMEOUT_EXIT, None, None, f"timed out after {timeout_s}s", b"",
                                b"", True, cold, handout, dur)
        if reply is None:
            code = await w.reap()
            status = 1 if code is None else (code if code > 0 else 128 - code)
            return FncallResult(status, None, None,
                                f"worker died before replying (exit status {code})", b"", b"",
                                False, cold, handout, dur)
        value = None
        if reply.value is not None:
            value = msgspec.msgpack.decode(reply.value)
        return FncallResult(reply.exit_code, value, reply.value_repr, reply.error,
                            reply.stdout, reply.stderr, False, cold, handout, dur,
                            reply.stdout_truncated, reply.stderr_truncated)

    async def close(self) -> None:
        self._closed = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        while self._ready:
            w = self._ready.popleft()
            w.kill()
            with contextlib.suppress(Exception):
                await w.reap()
        z, self._zygote = self._zygote, None
        if z is not None:
            z.sock.close()  # the zygote exits on EOF
            with contextlib.suppress(ProcessLookupError):
                z.proc.kill()
            await z.proc.wait()


class FncallBackend:
    """Backend protocol over a :class:`WorkerPool`; a sandbox is a working directory."""

    name = "fncall"

    def __init__(self, *, pool_size: int = 8, max_spawning: int = 4, root: str | None = None,
                 pool: WorkerPool | None = None) -> None:
        """``root``: where sandbox work dirs live; give a persistent one (``dsec edge``
        uses ``<state-dir>/fncall``) for sandboxes to be adopted after a restart. The
        default is a fresh temp dir per process; making one reclaims the temp dirs of
        processes that died (work dirs and runaway workers)."""
        self.pool = pool or WorkerPool(pool_size=pool_size, max_spawning=max_spawning)
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
        self._boxes: dict[str, tuple[SandboxSpec, str]] = {}
        self._sink: DeathSink | None = None
        self._started = False

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

    def _box(self, sid: str) -> tuple[SandboxSpec, str]:
        box = self._boxes.get(sid)
        if box is None:
            raise SandboxNotFound(f"fncall backend has no sandbox {sid}", sandbox_id=sid)
        return box

    async def create(self, sid: SandboxId, spec: SandboxSpec) -> None:
        self._ensure_pool()
        d = os.path.join(self.root, sid)
        try:
            os.makedirs(d, mode=0o700)
        except OSError as exc:
            raise BackendError(f"cannot make the work dir of {sid}: {exc}") from exc
        self._boxes[sid] = (spec, d)

    async def adopt(self, sid: SandboxId, spec: SandboxSpec) -> bool:
        self._ensure_pool()
        d = os.path.join(self.root, sid)
        if not os.path.isdir(d):
            return False
        self._boxes[sid] = (spec, d)
        return True

    async def destroy(self, sid: SandboxId) -> None:
        box = self._boxes.pop(sid, None)
        d = box[1] if box else os.path.join(self.root, sid)
        shutil.rmtree(d, ignore_errors=True)

    async def pause(self, sid: SandboxId) -> PauseStats:
        self._box(sid)
        return PauseStats()  # no process outlives a call: nothing to freeze or reclaim

    async def resume(self, sid: SandboxId) -> None:
        self._box(sid)

    async def stats(self, sid: SandboxId) -> SandboxStats:
        _, d = self._box(sid)
        size = 0
        for dirpath, _, files in os.walk(d):
            for f in files:
                with contextlib.suppress(OSError):
                    size += os.lstat(os.path.join(dirpath, f)).st_size
        return SandboxStats(disk_bytes=size)

    async def close(self) -> None:
        await self.pool.close()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)
        ownership.disown(self.root)

    # ---------------------------------------------------------------- after a crash
    async def reconcile(self, keep: AbstractSet[str]) -> list[Leftover]:
        """At node start, after adoption: kill workers a dead edge left running (calls
        nobody will read: processes never outlive a call here) and remove the work dirs
        of sandboxes the node does not keep."""
        strays = _stray_workers(self.root)
        _kill_groups(strays.values())
        out = []
        for name in sorted(os.listdir(self.root)):
            d = os.path.join(self.root, name)
            if name in keep or name in self._boxes or not os.path.isdir(d):
                continue
            n = sum(1 for cwd in strays if cwd == d or cwd.startswith(d + os.sep))
            shutil.rmtree(d, ignore_errors=True)
            out.append(Leftover(name, "fncall", "work directory"
                                + (f", {n} runaway worker(s)" if n else "")))
        return out

    async def discard(self, sid: SandboxId) -> Leftover | None:
        d = os.path.join(self.root, sid)
        if sid in self._boxes or "/" in sid or not os.path.isdir(d):
            return None
        _kill_groups(pgid for cwd, pgid in _stray_workers(d).items())
        shutil.rmtree(d, ignore_errors=True)
        return Leftover(sid, "fncall", "work directory")

    # ---------------------------------------------------------------- calls
    async def call(self, sid: SandboxId, fn: Callable[..., Any], *args: Any,
                   timeout_s: float | None = 60.0, **kwargs: Any) -> FncallResult:
        """Run ``fn(*args, **kwargs)`` in a fresh worker (fn must be picklable by
        reference, i.e. importable in the worker)."""
        spec, d = self._box(sid)
        self._ensure_pool()
        try:
            blob = pickle.dumps((fn, args, kwargs))
        except Exception as exc:
            raise InvalidArgument(f"cannot pickle the call to {fn!r}: {exc}") from exc
        return await self.pool.run({"fn": blob, "cwd": d, "env": dict(spec.env)}, timeout_s)

    async def exec(self, sid: SandboxId, req: ExecRequest) -> ExecResult:
        spec, d = self._box(sid)
        self._ensure_pool()
        code = _code_of(req)
        if req.cwd:
            cwd = self._path(d, req.cwd)
            if not os.path.isdir(cwd):
                return ExecResult(exit_code=2, stderr=f"cwd {req.cwd}: no such directory\n".encode())
        else:
            cwd = d
        r = await self.pool.run({"code": code, "cwd": cwd, "env": {**spec.env, **req.env},
                                 "stdin": req.stdin, "cap": req.output_cap_bytes}, req.timeout_s)
        cap = req.output_cap_bytes
        return ExecResult(exit_code=r.exit_code, stdout=r.stdout[:cap], stderr=r.stderr[:cap],
                          stdout_truncated=r.stdout_truncated or len(r.stdout) > cap,
                          stderr_truncated=r.stderr_truncated or len(r.stderr) > cap,
                          timed_out=r.timed_out, duration_s=r.duration_s)

    async def exec_stream(self, sid: SandboxId,
                          req: ExecRequest) -> AsyncIterator[ExecChunk | ExecResult]:
        async for item in replay_as_stream(await self.exec(sid, req)):
            yield item

    # ---------------------------------------------------------------- files
    def _path(self, root: str, path: str) -> str:
        """Map a sandbox path onto its work dir; refuse anything that escapes it."""
        if not isinstance(path, str) or not path or "\0" in path:
            raise InvalidArgument(f"invalid path {path!r}: use a non-empty path without NUL")
        p = os.path.realpath(os.path.join(root, os.path.normpath("/" + path).lstrip("/")))
        if p != root and not p.startswith(root + os.sep):
            raise InvalidArgument(f"path {path!r} leaves the sandbox's work dir", path=path)
        return p

    async def read_file(self, sid: SandboxId, path: str, *, offset: int = 0,
                        length: int | None = None) -> bytes:
        _, d = self._box(sid)
        p = self._path(d, path)
        try:
            with open(p, "rb") as f:  # noqa: ASYNC230 - local work dir, small files
                f.seek(offset)
                return f.read() if length is None else f.read(length)
        except FileNotFoundError as exc:
            raise NotFound(f"no file {path} in sandbox {sid}", sandbox_id=sid, path=path) from exc
        except IsADirectoryError as exc:
            raise InvalidArgument(f"{path} in sandbox {sid} is a directory", path=path) from exc

    async def write_file(self, sid: SandboxId, path: str, data: bytes, *, mode: int = 0o644,
                         append: bool = False) -> None:
        _, d = self._box(sid)
        p = self._path(d, path)
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW
                         | (os.O_APPEND if append else os.O_TRUNC), mode & 0o7777)
        except FileNotFoundError as exc:
            raise NotFound(f"directory of {path} does not exist in sandbox {sid}; mkdir it first",
                           sandbox_id=sid, path=path) from exc
        except IsADirectoryError as exc:
            raise InvalidArgument(f"{path} in sandbox {sid} is a directory", path=path) from exc
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    async def list_dir(self, sid: SandboxId, path: str) -> list[FileInfo]:
        _, d = self._box(sid)
        p = self._path(d, path)
        try:
            names = sorted(os.listdir(p))
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise NotFound(f"no directory {path} in sandbox {sid}", path=path) from exc
        return [self._info(d, os.path.join(p, n)) for n in names]

    async def stat(self, sid: SandboxId, path: str) -> FileInfo:
        _, d = self._box(sid)
        return self._info(d, self._path(d, path))

    def _info(self, root: str, p: str) -> FileInfo:
        try:
            st = os.lstat(p)
        except FileNotFoundError as exc:
            raise NotFound(f"no such path {p[len(root):] or '/'}") from exc
        import stat as st_mod

        kind = ("dir" if st_mod.S_ISDIR(st.st_mode) else "file" if st_mod.S_ISREG(st.st_mode)
                else "symlink" if st_mod.S_ISLNK(st.st_mode) else "other")
        rel = "/" + os.path.relpath(p, root).lstrip(".").lstrip("/") if p != root else "/"
        return FileInfo(name=os.path.basename(rel) or "/", path=rel, type=kind,  # type: ignore[arg-type]
                        size=st.st_size, mode=st.st_mode & 0o7777, mtime=st.st_mtime,
                        link_target=os.readlink(p) if kind == "symlink" else None)

    async def mkdir(self, sid: SandboxId, path: str, *, parents: bool = True) -> None:
        _, d = self._box(sid)
        p = self._path(d, path)
        try:
            os.makedirs(p, exist_ok=True) if parents else os.mkdir(p)
        except FileExistsError:
            pass
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise NotFound(f"parent of {path} does not exist in sandbox {sid}", path=path) from exc

    async def remove(self, sid: SandboxId, path: str, *, recursive: bool = False) -> None:
        _, d = self._box(sid)
        p = self._path(d, path)
        if p == d:
            raise InvalidArgument(f"refusing to remove / in sandbox {sid}")
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p) if recursive else os.rmdir(p)
            else:
                os.unlink(p)
        except FileNotFoundError as exc:
            raise NotFound(f"no such path {path} in sandbox {sid}", path=path) from exc
        except OSError as exc:
            raise InvalidArgument(f"cannot remove {path} in sandbox {sid}: {exc.strerror}; "
                                  "pass recursive=True for a non-empty directory") from exc


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
    """cwd -> process group of fncall workers whose working directory is under
    ``root`` (a worker runs a call in its sandbox's work dir; user code that chdir'd
    elsewhere is not found - see docs/edge.md)."""
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


def _kill_groups(pgids: Any) -> None:
    for pgid in set(pgids):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def _reclaim_dead_roots(tmp: str) -> None:
    """Remove the default roots of fncall backends whose process died (a crash skips
    ``close``), with any worker still running in them."""
    for e in os.scandir(tmp):
        if e.name.startswith(_ROOT_PREFIX) and e.is_dir(follow_symlinks=False) \
                and ownership.owner_alive(e.path) is False:
            _kill_groups(_stray_workers(e.path).values())
            shutil.rmtree(e.path, ignore_errors=True)
            ownership.disown(e.path)


def make_backend(**opts: Any) -> FncallBackend:
    return FncallBackend(**opts)
