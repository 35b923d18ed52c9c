"""The ``simulated`` backend: no isolation, an in-memory filesystem, configurable latency.

It exists so the control plane and the benchmarks can run 100k+ sandboxes on one
machine (DESIGN.md). Exec and file calls have observable effects: each sandbox has its
own in-memory tree, and a tiny shell understands ``echo cat true false sleep write ls
pwd env exit mkdir rm`` with ``;``, ``&&``, ``||`` and ``>``/``>>`` redirection.

Latencies come from a :class:`NodeLatencyProfile` and are slept on an injected
:class:`~dsec.edge.clock.Clock`. With :meth:`NodeLatencyProfile.zero` no operation ever
suspends (not even ``sleep(0)``), which is what lets the node's batch calls finish
without creating tasks.
"""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import posixpath
import shlex
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from dsec.edge.backend import DeathSink, replay_as_stream
from dsec.edge.clock import Clock, SystemClock
from dsec.errors import (
    BackendError,
    ImageNotFound,
    InUse,
    InvalidArgument,
    NotFound,
    QuotaExceeded,
    ResourceExhausted,
    SandboxNotFound,
)
from dsec.ids import SandboxId
from dsec.wire.files import MAX_WATCHES_PER_SANDBOX, FileEvent, FileEventType
from dsec.wire.spec import (
    TIMEOUT_EXIT_CODE,
    ExecChunk,
    ExecRequest,
    ExecResult,
    FileInfo,
    PauseStats,
    SandboxSpec,
    SandboxStats,
    SnapshotInfo,
    project_of,
)

__all__ = ["NodeLatencyProfile", "SimulatedBackend", "make_backend"]



@dataclass(frozen=True, slots=True, kw_only=True)
class NodeLatencyProfile:
    """Seconds each backend operation takes in the simulation."""

    create_s: float = 0.0
    destroy_s: float = 0.0
    pause_s: float = 0.0
    resume_s: float = 0.0
    exec_s: float = 0.0        # fixed overhead per exec, on top of the command's own sleeps
    file_s: float = 0.0        # per file operation
    adopt_s: float = 0.0
    name: str = "custom"

    @classmethod
    def zero(cls) -> NodeLatencyProfile:
        """Everything instant: measures the node's own overhead."""
        return cls(name="zero")

    @classmethod
    def paper(cls, kind: Literal["container", "fncall", "microvm"] = "container") -> NodeLatencyProfile:
        """Latencies after the DSec paper.

        From the paper: fncall handout ~5 ms, microVM cold start ~900 ms, pause ~4 s.
        Container create uses what this machine measured for our clone/mount/exec fast
        path (2.1-2.9 ms, shared/MACHINE-NOTES.md), rounded up to 3 ms. Assumed (not
        published): resume 1 s after a 4 s pause, destroy 1 ms, exec overhead 1 ms,
        file operation 0.5 ms.
        """
        if kind == "fncall":
            return cls(create_s=0.005, destroy_s=0.0, pause_s=0.0, resume_s=0.0,
                       exec_s=0.001, file_s=0.0005, name="paper-fncall")
        if kind == "microvm":
            return cls(create_s=0.9, destroy_s=0.01, pause_s=4.0, resume_s=1.0,
                       exec_s=0.001, file_s=0.0005, adopt_s=0.001, name="paper-microvm")
        return cls(create_s=0.003, destroy_s=0.001, pause_s=4.0, resume_s=1.0,
                   exec_s=0.001, file_s=0.0005, adopt_s=0.001, name="paper-container")


@dataclass(slots=True)
class _Fs:
    files: dict[str, bytes] = field(default_factory=dict)
    modes: dict[str, int] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=lambda: {"/", "/tmp", "/workspace"})
    mtimes: dict[str, float] = field(default_factory=dict)

    def copy(self) -> _Fs:
        # bytes are immutable: copying the containers copies the tree.
        return _Fs(dict(self.files), dict(self.modes), set(self.dirs), dict(self.mtimes))

    def digest(self) -> str:
        """Content hash of the whole tree (contents, modes, dirs, mtimes)."""
        raw = _msgpack.encode((sorted(self.files.items()), sorted(self.modes.items()),
                               sorted(self.dirs), sorted(self.mtimes.items())))
        return hashlib.sha256(raw).hexdigest()


_msgpack = msgspec.msgpack.Encoder()


@dataclass(slots=True)
class _Box:
    spec: SandboxSpec
    fs: _Fs
    paused: bool = False
    cpu_seconds: float = 0.0
    dead: bool = False          # destroyed: commands still running in it are "killed"
    origin: str | None = None   # the snapshot it was started from
    last: str | None = None     # its latest snapshot
    # file watches (issue 19): (directory, recursive, queue of events; None ends it)
    watchers: list[tuple[str, bool, asyncio.Queue[FileEvent | None]]] = field(
        default_factory=list)


@dataclass(slots=True, frozen=True)
class _Snap:
    info: SnapshotInfo
    fs: _Fs                     # a private copy of the tree at snapshot time
    digest: str                 # _Fs.digest() of that tree


class _Exit(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


class SimulatedBackend:
    """See the module docstring. ``fail_create`` makes every create raise (for tests)."""

    name = "simulated"

    def __init__(self, *, profile: NodeLatencyProfile | None = None,
                 clock: Clock | None = None) -> None:
        self.profile = profile or NodeLatencyProfile.zero()
        self.clock: Clock = clock or SystemClock()
        self._boxes: dict[str, _Box] = {}
        self._snaps: dict[str, _Snap] = {}
        self._sink: DeathSink | None = None

    # ------------------------------------------------------------------ lifecycle
    def watch(self, sink: DeathSink) -> None:
        self._sink = sink

    def kill(self, sid: SandboxId, reason: str = "oom", detail: str = "") -> None:
        """Simulate a sandbox dying on its own (e.g. an OOM kill) and report it."""
        self._boxes.pop(sid, None)
        if self._sink is not None:
            self._sink(sid, reason, detail or f"simulated {reason}")

    @property
    def sandboxes(self) -> frozenset[str]:
        return frozenset(self._boxes)

    async def create(self, sid: SandboxId, spec: SandboxSpec) -> None:
        origin = None
        if spec.snapshot is not None:
            if spec.workspace is not None or spec.toolkits:
                raise InvalidArgument(
                    "a sandbox started from a snapshot takes the snapshot's own image; "
                    "leave workspace and toolkits empty", field="snapshot")
            origin = self._snap(spec.snapshot)
        d = self.profile.create_s
        if d:
            await self.clock.sleep(d)
        if origin is None:
            self._boxes[sid] = _Box(spec, _Fs())
        else:
            self._boxes[sid] = _Box(spec, origin.fs.copy(), origin=origin.info.id)

    async def adopt(self, sid: SandboxId, spec: SandboxSpec) -> bool:
        """The simulation keeps nothing across restarts except the record: the sandbox
        comes back with an empty filesystem (documented limitation, not a real restore)."""
        if self.profile.adopt_s:
            await self.clock.sleep(self.profile.adopt_s)
        self._boxes[sid] = _Box(spec, _Fs())
        return True

    async def destroy(self, sid: SandboxId) -> None:
        d = self.profile.destroy_s
        if d:
            await self.clock.sleep(d)
        box = self._boxes.pop(sid, None)
        if box is not None:
            box.dead = True

    async def pause(self, sid: SandboxId) -> PauseStats:
        box = self._box(sid)
        t0 = time.perf_counter()
        if self.profile.pause_s:
            await self.clock.sleep(self.profile.pause_s)
        box.paused = True
        size = sum(len(v) for v in box.fs.files.values())
        return PauseStats(resident_before_bytes=size, reclaimed_bytes=size,
                          duration_s=time.perf_counter() - t0)

    async def resume(self, sid: SandboxId) -> None:
        box = self._box(sid)
        if not box.paused:  # a no-op, also in time (the node resumes adopted ones)
            return
        if self.profile.resume_s:
            await self.clock.sleep(self.profile.resume_s)
        box.paused = False

    async def set_network(self, sid: SandboxId, spec: SandboxSpec,
                          ceiling_deny: tuple[str, ...], generation: int) -> None:
        """A new egress policy (``network_update``). Simulated sandboxes have no network
        to filter: the policy is recorded, as the spec the sandbox runs with."""
        box = self._box(sid)
        box.spec = spec

    async def stats(self, sid: SandboxId) -> SandboxStats:
        box = self._box(sid)
        size = sum(len(v) for v in box.fs.files.values())
        return SandboxStats(memory_bytes=0 if box.paused else size, memory_peak_bytes=size,
                            cpu_seconds=box.cpu_seconds, pids=0 if box.paused else 1,
                            disk_bytes=size)

    async def close(self) -> None:
        self._boxes.clear()

    # ------------------------------------------------------------------ snapshots
    def _snap(self, ref: str) -> _Snap:
        snap = self._snaps.get(ref)
        if snap is None and isinstance(ref, str) and ref.startswith("sha256:") and len(ref) >= 19:
            hits = [v for k, v in self._snaps.items() if k.startswith(ref)]
            if len(hits) > 1:
                raise InvalidArgument(f"snapshot prefix {ref!r} is ambiguous: it matches "
                                      f"{len(hits)} snapshots; give more digits")
            snap = hits[0] if hits else None
        if snap is None:
            raise ImageNotFound(f"no snapshot {str(ref)[:80]!r} in this simulated backend "
                                "(snapshots live on the node that took them)", ref=str(ref)[:80])
        return snap

    async def snapshot(self, sid: SandboxId, *, strip: tuple[str, ...] = (),
                       max_bytes: int | None = None) -> SnapshotInfo:
        """Copy the in-memory tree (minus ``strip`` patterns), keyed by a content hash.
        Unchanged since the previous snapshot (or the one it started from): that one."""
        box = self._box(sid)
        fs = _strip(box.fs, strip) if strip else box.fs
        digest = fs.digest()
        prev = next((self._snaps[p] for p in (box.last, box.origin)
                     if p is not None and p in self._snaps), None)
        if prev is not None and prev.digest == digest:
            return msgspec.structs.replace(prev.info, unchanged=True)
        parent = prev.info.id if prev is not None else None
        size = sum(len(v) for v in fs.files.values())
        if max_bytes is not None and size > max_bytes:
            raise QuotaExceeded(
                f"snapshot of sandbox {sid} would take {size} bytes, over the limit of "
                f"{max_bytes} bytes; nothing was stored - remove files or raise the quota",
                resource="snapshot_bytes", used=size, limit=max_bytes, requested=size)
        sid_hash = hashlib.sha256(f"{digest}|{parent}|{sid}|{len(self._snaps)}|"
                                  f"{time.time_ns()}".encode()).hexdigest()
        src = self._snaps[box.origin].info if box.origin in self._snaps else None
        spec = box.spec
        info = SnapshotInfo(
            id="sha256:" + sid_hash, parent=parent, sandbox_id=sid, project=project_of(spec),
            image=src.image if src else spec.image,
            workspace=src.workspace if src else spec.workspace,
            toolkits=src.toolkits if src else spec.toolkits, backend=self.name,
            created=self.clock.time(), size_bytes=size)
        self._snaps[info.id] = _Snap(info, fs.copy(), digest)
        box.last = info.id
        return info

    async def snapshots(self) -> list[SnapshotInfo]:
        return [s.info for s in self._snaps.values()]

    async def snapshot_info(self, ref: str) -> SnapshotInfo:
        return self._snap(ref).info

    async def delete_snapshot(self, ref: str) -> SnapshotInfo:
        snap = self._snap(ref)
        sid = snap.info.id
        users = [k for k, b in self._boxes.items() if b.origin == sid]
        children = [k for k, s in self._snaps.items() if s.info.parent == sid]
        if users or children:
            why = ([f"sandbox {u} was started from it" for u in users[:3]]
                   + [f"snapshot {c} builds on it" for c in children[:3]])
            raise InUse(f"snapshot {sid} is in use: {'; '.join(why)}; destroy those first",
                        ref=sid)
        del self._snaps[sid]
        return snap.info

    def images_present(self) -> Iterable[str]:
        """Snapshot ids, so placement can send create(snapshot=...) to this node."""
        return self._snaps.keys()

    def _box(self, sid: str, *, running: bool = False) -> _Box:
        box = self._boxes.get(sid)
        if box is None:
            raise SandboxNotFound(f"simulated backend has no sandbox {sid}", sandbox_id=sid)
        if running and box.paused:
            raise BackendError(f"sandbox {sid} is paused in the backend; resume it first",
                               sandbox_id=sid)
        return box

    # ------------------------------------------------------------------- exec
    async def exec(self, sid: SandboxId, req: ExecRequest) -> ExecResult:
        box = self._box(sid, running=True)
        t0 = self.clock.time()
        if self.profile.exec_s:
            await self.clock.sleep(self.profile.exec_s)
        out, err = bytearray(), bytearray()
        env = {**box.spec.env, **req.env}
        cwd = _norm("/", req.cwd or box.spec.cwd or "/workspace")
        code, timed_out = 0, False
        if cwd not in box.fs.dirs:
            err += f"cd: {cwd}: No such file or directory\n".encode()
            code = 2
        else:
            try:
                code = await self._run(box, req, env, cwd, out, err, t0)
            except TimeoutError:
                code, timed_out = TIMEOUT_EXIT_CODE, True
        cap = req.output_cap_bytes
        return ExecResult(
            exit_code=code, stdout=bytes(out[:cap]), stderr=bytes(err[:cap]),
            stdout_truncated=len(out) > cap, stderr_truncated=len(err) > cap,
            timed_out=timed_out, duration_s=self.clock.time() - t0,
        )

    async def exec_stream(self, sid: SandboxId,
                          req: ExecRequest) -> AsyncIterator[ExecChunk | ExecResult]:
        async for item in replay_as_stream(await self.exec(sid, req)):
            yield item

    async def _run(self, box: _Box, req: ExecRequest, env: dict[str, str], cwd: str,
                   out: bytearray, err: bytearray, t0: float) -> int:
        if req.argv:
            cmds: list[tuple[str, list[str]]] = [(";", list(req.argv))]
        else:
            cmds = _parse(req.shell or "")
        code = 0
        for op, words in cmds:
            if (op == "&&" and code != 0) or (op == "||" and code == 0):
                continue
            words, target, append = _redirect(words)
            buf = bytearray() if target else out
            try:
                code = await self._command(box, words, env, cwd, req, buf, err, t0)
            except _Exit as e:
                return e.code
            if target:
                p = _norm(cwd, target)
                if posixpath.dirname(p) not in box.fs.dirs:
                    err += f"sh: {target}: No such file or directory\n".encode()
                    code = 1
                    continue
                old = box.fs.files.get(p, b"") if append else b""
                box.fs.files[p] = old + bytes(buf)
                box.fs.mtimes[p] = self.clock.time()
        return code

    async def _command(self, box: _Box, words: list[str], env: dict[str, str], cwd: str,
                       req: ExecRequest, out: bytearray, err: bytearray, t0: float) -> int:
        if not words:
            return 0
        cmd, args = words[0], words[1:]
        fs = box.fs
        if cmd == "__syntax_error__":
            err += f"sh: syntax error: {args[0]}\n".encode()
            return 2
        if cmd == "true":
            return 0
        if cmd == "false":
            return 1
        if cmd == "exit":
            raise _Exit(int(args[0]) if args and args[0].lstrip("-").isdigit() else 0)
        if cmd == "echo":
            out += (" ".join(args) + "\n").encode()
            return 0
        if cmd == "pwd":
            out += (cwd + "\n").encode()
            return 0
        if cmd == "env":
            out += "".join(f"{k}={v}\n" for k, v in sorted(env.items())).encode()
            return 0
        if cmd == "cat":
            if not args:
                out += req.stdin
                return 0
            code = 0
            for a in args:
                p = _norm(cwd, a)
                if p in fs.files:
                    out += fs.files[p]
                else:
                    err += f"cat: {a}: No such file or directory\n".encode()
                    code = 1
            return code
        if cmd == "write":  # write PATH [TEXT...]: TEXT or stdin into PATH
            if not args:
                err += b"write: usage: write PATH [TEXT...]\n"
                return 2
            p = _norm(cwd, args[0])
            if posixpath.dirname(p) not in fs.dirs:
                err += f"write: {args[0]}: No such file or directory\n".encode()
                return 1
            fs.files[p] = " ".join(args[1:]).encode() if len(args) > 1 else req.stdin
            fs.mtimes[p] = self.clock.time()
            return 0
        if cmd == "mkdir":
            for a in (x for x in args if not x.startswith("-")):
                p = _norm(cwd, a)
                while p not in fs.dirs:
                    fs.dirs.add(p)
                    p = posixpath.dirname(p)
            return 0
        if cmd == "rm":
            code = 0
            for a in (x for x in args if not x.startswith("-")):
                if fs.files.pop(_norm(cwd, a), None) is None:
                    err += f"rm: {a}: No such file or directory\n".encode()
                    code = 1
            return code
        if cmd == "ls":
            p = _norm(cwd, args[0] if args else ".")
            if p not in fs.dirs:
                err += f"ls: {p}: No such file or directory\n".encode()
                return 2
            out += "".join(n + "\n" for n in sorted(_children(fs, p))).encode()
            return 0
        if cmd == "sleep":
            try:
                secs = float(args[0]) if args else 0.0
            except ValueError:
                err += f"sleep: invalid time interval {args[0]!r}\n".encode()
                return 1
            left = None if req.timeout_s is None else req.timeout_s - (self.clock.time() - t0)
            if left is not None and secs >= left:
                if left > 0:
                    await self.clock.sleep(left)
                if box.dead:
                    raise BackendError("the sandbox was destroyed while the command ran")
                raise TimeoutError
            if secs > 0:
                await self.clock.sleep(secs)
            if box.dead:
                raise BackendError("the sandbox was destroyed while the command ran")
            return 0
        err += f"sh: {cmd}: command not found\n".encode()
        return 127

    # ------------------------------------------------------------------ files
    async def _file_delay(self) -> None:
        if self.profile.file_s:
            await self.clock.sleep(self.profile.file_s)

    async def read_file(self, sid: SandboxId, path: str, *, offset: int = 0,
                        length: int | None = None) -> bytes:
        box = self._box(sid)  # reads work on a paused sandbox
        await self._file_delay()
        p = _abs(path)
        data = box.fs.files.get(p)
        if data is None:
            raise NotFound(f"no file {p} in sandbox {sid}", sandbox_id=sid, path=p)
        end = None if length is None else offset + length
        return data[offset:end]

    async def write_file(self, sid: SandboxId, path: str, data: bytes, *, mode: int = 0o644,
                         append: bool = False) -> None:
        box = self._box(sid, running=True)
        await self._file_delay()
        p = _abs(path)
        if p in box.fs.dirs:
            raise InvalidArgument(f"{p} in sandbox {sid} is a directory", path=p)
        missing, d = [], posixpath.dirname(p)
        while d not in box.fs.dirs:  # missing parents are made, as the container does
            if d in box.fs.files:
                raise InvalidArgument(f"{d} in sandbox {sid} is a file, not a directory",
                                      path=p)
            missing.append(d)
            d = posixpath.dirname(d)
        box.fs.dirs.update(missing)
        if p not in box.fs.files:  # like open(O_CREAT): the mode applies on creation
            box.fs.modes[p] = mode & 0o7777
        _emit(box, "write" if p in box.fs.files else "create", p)
        box.fs.files[p] = (box.fs.files.get(p, b"") + data) if append else bytes(data)
        box.fs.mtimes[p] = self.clock.time()

    async def list_dir(self, sid: SandboxId, path: str) -> list[FileInfo]:
        box = self._box(sid)  # reads work on a paused sandbox
        await self._file_delay()
        p = _abs(path)
        if p not in box.fs.dirs:
            raise NotFound(f"no directory {p} in sandbox {sid}", sandbox_id=sid, path=p)
        return [self._info(box, posixpath.join(p, n)) for n in sorted(_children(box.fs, p))]

    async def stat(self, sid: SandboxId, path: str) -> FileInfo:
        box = self._box(sid)  # reads work on a paused sandbox
        await self._file_delay()
        p = _abs(path)
        if p not in box.fs.dirs and p not in box.fs.files:
            raise NotFound(f"no such path {p} in sandbox {sid}", sandbox_id=sid, path=p)
        return self._info(box, p)

    async def mkdir(self, sid: SandboxId, path: str, *, parents: bool = True) -> None:
        box = self._box(sid, running=True)
        await self._file_delay()
        p = _abs(path)
        if p in box.fs.files:
            raise InvalidArgument(f"{p} in sandbox {sid} is a file", path=p)
        if not parents and posixpath.dirname(p) not in box.fs.dirs:
            raise NotFound(f"parent of {p} does not exist in sandbox {sid}", path=p)
        while p not in box.fs.dirs:
            box.fs.dirs.add(p)
            p = posixpath.dirname(p)

    async def remove(self, sid: SandboxId, path: str, *, recursive: bool = False) -> None:
        box = self._box(sid, running=True)
        await self._file_delay()
        p = _abs(path)
        fs = box.fs
        if p in fs.files:
            del fs.files[p]
            _emit(box, "remove", p)
            return
        if p not in fs.dirs:
            raise NotFound(f"no such path {p} in sandbox {sid}", sandbox_id=sid, path=p)
        if p == "/":
            raise InvalidArgument(f"refusing to remove / in sandbox {sid}")
        inside = [f for f in fs.files if f.startswith(p + "/")]
        subdirs = [d for d in fs.dirs if d.startswith(p + "/")]
        if (inside or subdirs) and not recursive:
            raise InvalidArgument(f"directory {p} in sandbox {sid} is not empty; "
                                  "pass recursive=True", path=p)
        for f in inside:
            del fs.files[f]
        fs.dirs.difference_update(subdirs)
        fs.dirs.discard(p)

    # -------------------------------------------------- streams, rename, watch (issue 19)
    async def read_stream(self, sid: SandboxId, path: str, offset: int, length: int | None,
                          sink: Callable[[bytes], Awaitable[None]]) -> FileInfo:
        box = self._box(sid)
        await self._file_delay()
        p = _abs(path)
        data = box.fs.files.get(p)
        if data is None:
            raise NotFound(f"no file {p} in sandbox {sid}", sandbox_id=sid, path=p)
        info = self._info(box, p)
        end = len(data) if length is None else min(len(data), offset + length)
        for at in range(offset, end, 1 << 20):
            await sink(data[at:min(end, at + (1 << 20))])
        return info

    async def write_stream(self, sid: SandboxId, path: str, mode: int, size: int | None,
                           source: AsyncIterator[bytes]) -> FileInfo:
        self._box(sid, running=True)
        buf = bytearray()
        async for chunk in source:
            buf += chunk
            if size is not None and len(buf) > size:
                raise InvalidArgument(f"write {path!r}: more than the announced size={size} "
                                      "bytes arrived; nothing was changed", field="size")
        if size is not None and len(buf) != size:
            raise InvalidArgument(f"write {path!r}: {len(buf)} bytes arrived, size={size} "
                                  "was announced; nothing was changed", field="size")
        box = self._box(sid, running=True)
        p = _abs(path)
        if p in box.fs.dirs:
            raise InvalidArgument(f"{p} in sandbox {sid} is a directory", path=p)
        box.fs.files.pop(p, None)   # a new file: the mode applies
        await self.write_file(sid, p, bytes(buf), mode=mode)
        box.fs.modes[p] = mode & 0o7777
        return self._info(box, p)

    async def rename_file(self, sid: SandboxId, src: str, dst: str,
                          overwrite: bool) -> FileInfo:
        box = self._box(sid, running=True)
        await self._file_delay()
        s, d, fs = _abs(src), _abs(dst), box.fs
        if s not in fs.files:
            if s in fs.dirs:
                raise InvalidArgument(f"the simulated backend renames files only ({s} is a "
                                      "directory)", path=s)
            raise NotFound(f"no such path {s} in sandbox {sid}", sandbox_id=sid, path=s)
        if d in fs.dirs or (d in fs.files and not overwrite):
            raise InvalidArgument(f"rename {s!r} -> {d!r} in sandbox {sid}: {d!r} exists; "
                                  "pass overwrite=True to replace it", path=d, field="dst")
        if posixpath.dirname(d) not in fs.dirs:
            raise NotFound(f"parent of {d} does not exist in sandbox {sid}", path=d)
        fs.files[d] = fs.files.pop(s)
        fs.modes[d] = fs.modes.pop(s, 0o644)
        fs.mtimes[d] = fs.mtimes.pop(s, 0.0)
        _emit(box, "rename", s)
        _emit(box, "create", d)
        return self._info(box, d)

    async def watch_files(self, sid: SandboxId, path: str, recursive: bool,
                          tenant: str = "") -> AsyncIterator[FileEvent]:
        box = self._box(sid)
        p = _abs(path)
        if p not in box.fs.dirs:
            raise NotFound(f"no directory {p} in sandbox {sid}", sandbox_id=sid, path=p)
        if len(box.watchers) >= MAX_WATCHES_PER_SANDBOX:
            raise ResourceExhausted(f"sandbox {sid} has {len(box.watchers)} watches open, "
                                    "its limit", limit=MAX_WATCHES_PER_SANDBOX)
        entry: tuple[str, bool, asyncio.Queue[FileEvent | None]] = (p, recursive,
                                                                     asyncio.Queue(4096))
        box.watchers.append(entry)
        try:
            while (ev := await entry[2].get()) is not None:
                yield ev
        finally:
            box.watchers.remove(entry)

    def _info(self, box: _Box, p: str) -> FileInfo:
        if p in box.fs.dirs:
            return FileInfo(name=posixpath.basename(p) or "/", path=p, type="dir", mode=0o755)
        return FileInfo(name=posixpath.basename(p), path=p, type="file",
                        size=len(box.fs.files[p]), mode=box.fs.modes.get(p, 0o644),
                        mtime=box.fs.mtimes.get(p, 0.0))


def _emit(box: _Box, kind: FileEventType, path: str) -> None:
    """Tell the box's watches of ``path`` about a change (a full queue: overflow)."""
    parent = posixpath.dirname(path)
    for d, recursive, q in box.watchers:
        if parent == d or (recursive and parent.startswith(d.rstrip("/") + "/")):
            ev = FileEvent(type=kind, path=path, name=posixpath.basename(path))
            try:
                q.put_nowait(ev)
            except asyncio.QueueFull:
                pass


def _strip(fs: _Fs, patterns: tuple[str, ...]) -> _Fs:
    """A copy of ``fs`` without paths matching ``patterns`` (or under a matching dir),
    with pack_diff's rule: a pattern without '/' matches a basename anywhere."""
    def gone(p: str) -> bool:
        rel = p.lstrip("/")
        while rel:
            base = posixpath.basename(rel)
            if any(fnmatch.fnmatchcase(rel if "/" in pat else base, pat) for pat in patterns):
                return True
            rel = posixpath.dirname(rel)
        return False
    out = _Fs(dirs={d for d in fs.dirs if d == "/" or not gone(d)})
    for p, data in fs.files.items():
        if not gone(p):
            out.files[p] = data
            if p in fs.modes:
                out.modes[p] = fs.modes[p]
            if p in fs.mtimes:
                out.mtimes[p] = fs.mtimes[p]
    return out


def _children(fs: _Fs, d: str) -> set[str]:
    prefix = d.rstrip("/") + "/"
    out = set()
    for p in (*fs.files, *fs.dirs):
        if p != d and p.startswith(prefix):
            out.add(p[len(prefix):].split("/", 1)[0])
    return out


def _abs(path: str) -> str:
    if not isinstance(path, str) or not path or "\0" in path:
        raise InvalidArgument(f"invalid path {path!r}: use a non-empty path without NUL")
    return _norm("/", path)


def _norm(cwd: str, path: str) -> str:
    p = posixpath.normpath(posixpath.join(cwd, path))
    return "/" + p.lstrip("/")  # normpath keeps a leading '//'


def _parse(line: str) -> list[tuple[str, list[str]]]:
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|>")
    lex.whitespace_split = True
    cmds: list[tuple[str, list[str]]] = []
    op: str = ";"
    words: list[str] = []
    try:
        tokens = list(lex)
    except ValueError as exc:  # e.g. an unterminated quote
        return [(";", ["__syntax_error__", str(exc)])]
    for tok in tokens:
        if tok in (";", "&&", "||"):
            cmds.append((op, words))
            op, words = tok, []
        else:
            words.append(tok)
    cmds.append((op, words))
    return cmds


def _redirect(words: list[str]) -> tuple[list[str], str | None, bool]:
    for i, w in enumerate(words):
        if w in (">", ">>") and i + 1 < len(words):
            return words[:i] + words[i + 2:], words[i + 1], w == ">>"
    return words, None, False


def make_backend(**opts: object) -> SimulatedBackend:
    return SimulatedBackend(**opts)  # type: ignore[arg-type]
