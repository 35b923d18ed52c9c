"""Streamed file transfer, rename and watch on the edge (issue 19, docs/api.md "Files").

A backend that keeps its sandboxes' files in a real directory tree (container, fncall)
hands out a confined handle (:class:`~dsec.edge.backends.container.files.SandboxFiles`:
every path through ``openat2`` in the sandbox's root, final components relative to a
confined parent fd); the drivers here move bytes between such a handle and an Aether
duplex stream in pieces of :data:`CHUNK`, each blocking call on a worker thread, so
memory per stream is one piece plus the stream's credit window however large the file.

- :func:`read_stream`: one fd opened at the start (a file replaced meanwhile is read
  whole as it was opened), ``pread`` in pieces, each sent under the caller's credit.
- :func:`write_stream`: a temporary file in the target's directory, renamed over the
  target only after the caller half-closed and (``size`` given) every byte arrived;
  any failure, a dropped connection or a cancelled call removes it.
- :func:`watch`: inotify on O_PATH fds of confined directories (added through
  ``/proc/self/fd/N``, so the kernel watches exactly the inode we resolved, never a
  path it could resolve again elsewhere); subdirectories of a recursive watch are
  opened relative to their parent with no symlink followed and no mount crossed.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import errno
import functools
import os
import struct
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import ClassVar, Protocol, TypeVar, runtime_checkable

from dsec.errors import DsecError, InvalidArgument, ResourceExhausted
from dsec.ids import SandboxId
from dsec.wire.files import FileEvent, FileEventType
from dsec.wire.spec import FileInfo

# Streamed writes land in an unnamed file (O_TMPFILE) in their target's directory, given
# a name only at commit (linked as ``<TEMP_PREFIX><random hex>``, then renamed over the
# target): an edge killed mid-upload leaves nothing behind (red team 19, B11: the kernel
# frees an unnamed file with its last descriptor). A filesystem without O_TMPFILE gets a
# named temporary file from the start. A watch hides only the names this edge process
# holds (:func:`held_temp`), never a name by its prefix alone: sandbox code may name its
# own files so (red team 19, B12). Here, below the backends (which import this module),
# so a watch can ask without importing a backend.
TEMP_PREFIX = ".dsec-upload-"
# A released name stays hidden this long: the watch reads its events (the link, the
# rename away) after the commit that released it.
_TEMP_LINGER_S = 30.0
_held: dict[str, float] = {}     # name -> hidden until (monotonic; inf while held)
_held_lock = threading.Lock()    # the file threads hold and release; watches read


def hold_temp(name: str) -> None:
    """``name`` (a temporary file this process made) is hidden from watches until
    :func:`release_temp` (names are random: one process's set, no directory needed)."""
    with _held_lock:
        _held[name] = float("inf")


def release_temp(name: str, *, now: float | None = None) -> None:
    """``name`` is done with (committed or removed): hidden a little longer, then not."""
    t = time.monotonic() if now is None else now
    with _held_lock:
        _held[name] = t + _TEMP_LINGER_S
        if len(_held) > 4096:
            for k, until in list(_held.items()):
                if until < t:
                    del _held[k]


def held_temp(name: str, *, now: float | None = None) -> bool:
    """Whether ``name`` is one of this process's upload temporaries (in flight, or
    released in the last few seconds)."""
    until = _held.get(name)
    if until is None:
        return False
    return until >= (time.monotonic() if now is None else now)


# What the streams need of a confined file handle, as Protocols: the backends that hand
# one out (``dsec.edge.backends.container.files.SandboxFiles``) import this module, so
# importing them back (even for annotations) would be a cycle.
class AtomicWrite(Protocol):
    """An atomic replacement in progress (``SandboxFiles.begin_write``)."""

    @property
    def written(self) -> int: ...
    def write(self, data: bytes | memoryview) -> None: ...
    def commit(self) -> FileInfo: ...
    def abort(self) -> None: ...


class ConfinedFiles(Protocol):
    """A sandbox's files, confined to its root (``SandboxFiles`` of the container
    backend, which the fncall backend uses too)."""

    @property
    def sid(self) -> str: ...
    def open_read(self, path: str) -> tuple[int, FileInfo]: ...
    def begin_write(self, path: str, *, mode: int = 0o644,
                    size: int | None = None) -> AtomicWrite: ...
    def open_dir(self, path: str) -> int: ...
    def open_subdir(self, dir_fd: int, name: str) -> int | None: ...

__all__ = ["CHUNK", "MAX_QUEUED_EVENTS", "MAX_WATCH_DIRS", "TEMP_PREFIX", "WATCH_BUDGET_MAX",
           "AtomicWrite", "ConfinedFiles",
           "FileStreamBackend", "Run", "held_temp", "hold_temp", "read_stream", "release_temp",
           "watch", "watch_budget",
           "watch_dir_budget", "write_stream"]

_T = TypeVar("_T")
class Run(Protocol):
    """Runs a blocking call beside the event loop (a backend's file threads)."""

    def __call__(self, fn: Callable[[], _T], /) -> Awaitable[_T]: ...


# One piece read from or written to the file per thread hop. Measured on the dev VM: the
# hop costs ~30-60 us, so at 1 MiB it is <1% of a piece's transfer; the duplex stream
# cuts it into 64 KiB frames under its 256 KiB window anyway.
CHUNK = 1 << 20
# Directories one recursive watch follows (each an inotify watch and an O_PATH fd).
MAX_WATCH_DIRS = 4096
# Watches open at once on one node: half of the host's per-uid inotify instance budget
# (fs.inotify.max_user_instances, 128 by default, shared by every root process of the
# host), however many sandboxes; one top-level project may hold half of that. The edge
# itself uses ONE inotify instance for all of them (dsec.edge.filestream), so this
# bounds the edge's share of kernel watches and queues, not instances; tied to the
# host's instance budget so a host that raised it for inotify-heavy use allows more.
WATCH_BUDGET_MAX = 4096


def watch_budget() -> int:
    """File watches one node keeps open (see above): max_user_instances / 2."""
    try:
        with open("/proc/sys/fs/inotify/max_user_instances") as f:
            n = int(f.read())
    except (OSError, ValueError):
        n = 128
    return max(2, min(WATCH_BUDGET_MAX, n // 2))


def watch_dir_budget() -> int:
    """inotify watches (directories) the edge's one instance holds over every watch:
    half of the host's per-uid fs.inotify.max_user_watches (shared with every root
    process); past it a watch is refused with ResourceExhausted, unless its project is
    within its fair share and can take room from a project over its share (see
    :meth:`_Hub.add`)."""
    try:
        with open("/proc/sys/fs/inotify/max_user_watches") as f:
            n = int(f.read())
    except (OSError, ValueError):
        n = 8192
    return max(MAX_WATCH_DIRS, n // 2)


@runtime_checkable
class FileStreamBackend(Protocol):
    """A backend that streams files (container, fncall, simulated)."""

    async def read_stream(self, sid: SandboxId, path: str, offset: int, length: int | None,
                          sink: Callable[[bytes], Awaitable[None]]) -> FileInfo:
        """Send the file's bytes to ``sink`` piece by piece; answer the file as opened."""
        ...

    async def write_stream(self, sid: SandboxId, path: str, mode: int, size: int | None,
                           source: AsyncIterator[bytes]) -> FileInfo:
        """Replace ``path`` atomically with what ``source`` yields."""
        ...

    async def rename_file(self, sid: SandboxId, src: str, dst: str,
                          overwrite: bool) -> FileInfo: ...

    def watch_files(self, sid: SandboxId, path: str, recursive: bool,
                    tenant: str = "") -> AsyncIterator[FileEvent]:
        """Changes below ``path``; ``tenant`` (the sandbox's top-level project) shares
        the node's watched directories fairly with the other tenants."""
        ...


async def read_stream(files: ConfinedFiles, path: str, offset: int, length: int | None,
                      sink: Callable[[bytes], Awaitable[None]], run: Run) -> FileInfo:
    """Stream ``path`` from ``offset`` (``length`` bytes, None: to its end) into ``sink``."""
    fd, info = await run(functools.partial(files.open_read, path))
    try:
        pos, left = offset, length
        while left is None or left > 0:
            n = CHUNK if left is None else min(CHUNK, left)
            data = await run(functools.partial(os.pread, fd, n, pos))
            if not data:
                break
            await sink(data)
            pos += len(data)
            if left is not None:
                left -= len(data)
    finally:
        os.close(fd)
    return info


async def write_stream(files: ConfinedFiles, path: str, mode: int, size: int | None,
                       source: AsyncIterator[bytes], run: Run) -> FileInfo:
    """Write what ``source`` yields to a temporary file, then rename it over ``path``."""
    pending = await run(functools.partial(files.begin_write, path, mode=mode, size=size))
    try:
        buf = bytearray()
        async for chunk in source:
            buf += chunk
            if len(buf) >= CHUNK:
                piece = bytes(buf)
                buf.clear()
                await run(functools.partial(pending.write, piece))
            if size is not None and pending.written + len(buf) > size:
                raise InvalidArgument(
                    f"write {path[:200]!r}: more than the announced size={size} bytes "
                    "arrived; nothing was changed", field="size", size=size)
        if buf:
            await run(functools.partial(pending.write, bytes(buf)))
        if size is not None and pending.written != size:
            raise InvalidArgument(
                f"write {path[:200]!r}: {pending.written} bytes arrived, size={size} was "
                "announced (the upload was cut short?); nothing was changed",
                field="size", size=size, received=pending.written)
        return await run(pending.commit)
    except BaseException:
        # a failure, a reset stream or a cancelled call: the temporary file goes, the
        # old file stays as it was (shielded: a cancellation must not skip the unlink)
        await asyncio.shield(asyncio.get_running_loop().run_in_executor(None, pending.abort))
        raise


# ----------------------------------------------------------------------- inotify
_IN_MODIFY = 0x002
_IN_ATTRIB = 0x004
_IN_MOVED_FROM = 0x040
_IN_MOVED_TO = 0x080
_IN_CREATE = 0x100
_IN_DELETE = 0x200
_IN_DELETE_SELF = 0x400
_IN_MOVE_SELF = 0x800
_IN_Q_OVERFLOW = 0x4000
_IN_IGNORED = 0x8000
_IN_ONLYDIR = 0x01000000
_IN_ISDIR = 0x40000000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_MASK = (_IN_MODIFY | _IN_ATTRIB | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE
         | _IN_DELETE_SELF | _IN_MOVE_SELF | _IN_ONLYDIR)
# No IN_DONT_FOLLOW: the path given is /proc/self/fd/N, a magic link to the very inode
# resolved confined; following it is the point (with it, the link itself was watched).
_EVENT = struct.Struct("iIII")
_libc = ctypes.CDLL(None, use_errno=True)


def _event_type(mask: int) -> FileEventType | None:
    """inotify mask -> the event type (fsnotify's mapping, which E2B's watch reports)."""
    if mask & (_IN_CREATE | _IN_MOVED_TO):
        return "create"
    if mask & _IN_DELETE:
        return "remove"
    if mask & _IN_MOVED_FROM:
        return "rename"
    if mask & _IN_MODIFY:
        return "write"
    if mask & _IN_ATTRIB:
        return "chmod"
    return None


# Events one watch may have queued (its consumer behind): past it they are dropped and
# the watch gets one "overflow" event, as the kernel does for a whole instance.
MAX_QUEUED_EVENTS = 16384


class _Hub:
    """The edge's ONE inotify instance (per event loop), shared by every watch of every
    sandbox (A6). inotify instances are a per-uid budget of the whole host
    (fs.inotify.max_user_instances, 128 by default) which the edge - root - shares with
    systemd, udev and every other root daemon; one instance per watch let one tenant's
    watches take all of them. Here a watch is a subscriber of the kernel watches (wds)
    it added: the kernel gives the same wd for the same inode, so a wd is refcounted
    over its subscribers and removed when the last one leaves; events are read once on
    the loop and queued to each subscriber of their wd. The directories watched over
    the whole instance are bounded by :func:`watch_dir_budget`, shared fairly between
    the top-level projects holding watches (red team 22, C1; the rule of the process
    rings, dsec.edge.processes): one project may follow the whole budget while nobody
    else needs it, but a project within its share (the budget divided among the
    projects holding watched directories, itself included) takes directories from the
    project furthest over its share - that project's watches stop following them and
    get an ``incomplete`` event - and is never refused by it.

    ``add``/``drop`` run on file threads (a recursive watch adds thousands of
    directories off the loop), hence the lock around the wd table."""

    _by_loop: ClassVar[dict[asyncio.AbstractEventLoop, _Hub]] = {}

    def __init__(self, loop: asyncio.AbstractEventLoop, sid: str) -> None:
        fd = _libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            e = ctypes.get_errno()
            raise ResourceExhausted(f"cannot watch files of sandbox {sid}: "
                                    f"inotify_init1: {os.strerror(e)}")
        self.fd, self.loop = fd, loop
        self.lock = threading.RLock()
        self.subs: dict[int, set[_Inotify]] = {}
        self.users = 0
        loop.add_reader(fd, self._readable)

    @classmethod
    def acquire(cls, sid: str) -> _Hub:
        loop = asyncio.get_running_loop()
        hub = cls._by_loop.get(loop)
        if hub is None or hub.fd < 0:
            hub = cls._by_loop[loop] = cls(loop, sid)
        hub.users += 1
        return hub

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0 and self.fd >= 0:
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1
            self.subs.clear()
            if self._by_loop.get(self.loop) is self:
                del self._by_loop[self.loop]

    def add(self, sub: _Inotify, path: str, dir_fd: int) -> int:
        with self.lock:
            if sub.closed or self.fd < 0:
                # a recursive add still running on a file thread after its watch was
                # cancelled: nothing may be added for a subscriber that is gone
                raise ResourceExhausted(f"watch of sandbox {sub.files.sid} was closed")
            budget = watch_dir_budget()
            while len(self.subs) >= budget:
                held = self._held()
                tenants = set(held) | {sub.tenant}
                share = max(1, budget // len(tenants))
                have = held.get(sub.tenant, 0)
                over = {t: n - share for t, n in held.items()
                        if t != sub.tenant and n > share}
                if have + 1 <= share and over and self._reclaim(
                        max(over, key=over.__getitem__)):
                    continue
                raise _OverShare(
                    f"cannot watch {path!r} in sandbox {sub.files.sid}: the node's file "
                    f"watches follow {len(self.subs)} directories, its budget ({budget}: "
                    f"half of fs.inotify.max_user_watches); project {sub.tenant or '-'} "
                    f"follows {have} of them (its share while {len(tenants)} projects "
                    f"watch: {share}); watch a smaller tree or close other watches",
                    limit=budget, share=share)
            wd = _libc.inotify_add_watch(self.fd, f"/proc/self/fd/{dir_fd}".encode(),
                                         ctypes.c_uint32(_MASK))
            if wd < 0:
                e = ctypes.get_errno()
                if e == errno.ENOSPC:
                    raise ResourceExhausted(f"cannot watch {path!r} in sandbox "
                                            f"{sub.files.sid}: the node's inotify watch "
                                            "limit is reached")
                raise InvalidArgument(f"cannot watch {path!r} in sandbox {sub.files.sid}: "
                                      f"{os.strerror(e)}", path=path)
            self.subs.setdefault(wd, set()).add(sub)
            sub.dirs[wd] = path
            return int(wd)

    def _held(self) -> dict[str, int]:
        """Directories each project's watches follow (a directory two watches of one
        project follow counts twice: each holds it). Only asked when the budget is
        full, so it is counted then rather than kept."""
        subs = {s for users in self.subs.values() for s in users}
        held: dict[str, int] = {}
        for s in subs:
            held[s.tenant] = held.get(s.tenant, 0) + len(s.dirs)
        return held

    def _reclaim(self, victim: str) -> bool:
        """Take one directory from project ``victim``: the one its largest watch added
        last (never a watch's own root: that is the watch), told to that watch as an
        ``incomplete`` event. False when it has none to give."""
        subs = {s for users in self.subs.values() for s in users
                if s.tenant == victim and len(s.dirs) > 1}
        if not subs:
            return False
        big = max(subs, key=lambda s: len(s.dirs))
        wd, path = next(reversed(big.dirs.items()))
        self.drop(big, [wd])
        big.dirs.pop(wd, None)
        big.lost(path)
        return True

    def drop(self, sub: _Inotify, wds: list[int]) -> None:
        with self.lock:
            for wd in wds:
                users = self.subs.get(wd)
                if users is None or sub not in users:
                    continue
                users.discard(sub)
                if not users:
                    del self.subs[wd]
                    if self.fd >= 0:
                        _libc.inotify_rm_watch(self.fd, wd)

    def _readable(self) -> None:
        try:
            data = os.read(self.fd, 64 * 1024)
        except OSError:
            return          # EAGAIN (read by a racing wakeup) or closed
        off = 0
        while off + _EVENT.size <= len(data):
            wd, mask, _cookie, n = _EVENT.unpack_from(data, off)
            name = data[off + _EVENT.size: off + _EVENT.size + n].split(b"\0", 1)[0]
            off += _EVENT.size + n
            with self.lock:
                if mask & _IN_Q_OVERFLOW:
                    targets = {s for users in self.subs.values() for s in users}
                else:
                    targets = set(self.subs.get(wd, ()))
                    if mask & _IN_IGNORED:
                        self.subs.pop(wd, None)
            for t in targets:
                t.push(wd, mask, name)


class _OverShare(ResourceExhausted):
    """The node's watched-directory budget is full and the adding project may take no
    room (:meth:`_Hub.add`): past a watch's root, the watch goes on incomplete."""


class _Inotify:
    """One watch: the confined directories it follows (wd -> path) on the edge's shared
    instance (:class:`_Hub`) and the events queued for it.

    The O_PATH fd a directory was resolved to is closed once its watch is added: an open
    fd holds the directory's dentry, and the kernel then reports its removal
    (IN_DELETE_SELF) only when the fd closes - a watch never learned its directory was
    gone. The watch itself pins the inode, not the name."""

    def __init__(self, files: ConfinedFiles, tenant: str = "") -> None:
        self.files = files
        self.tenant = tenant
        self.dirs: dict[int, str] = {}
        self.queue: collections.deque[tuple[int, int, bytes]] = collections.deque()
        # directories this watch stopped following (or never followed) for its
        # project's share of the node's budget: told as ``incomplete`` events
        self.missing: collections.deque[str] = collections.deque()
        self.ready = asyncio.Event()
        self.closed = False
        self.hub: _Hub | None = _Hub.acquire(files.sid)
        self.loop = asyncio.get_running_loop()

    def lost(self, path: str) -> None:
        """Directory ``path`` is not followed (any thread: adds run on file threads)."""
        self.missing.append(path)
        self.loop.call_soon_threadsafe(self.ready.set)

    def push(self, wd: int, mask: int, name: bytes) -> None:
        if len(self.queue) >= MAX_QUEUED_EVENTS:
            self.queue.clear()
            mask = _IN_Q_OVERFLOW
        self.queue.append((wd, mask, name))
        self.ready.set()

    def add(self, path: str, dir_fd: int) -> None:
        """Watch directory ``dir_fd`` (an O_PATH fd, left open) as ``path``."""
        if len(self.dirs) >= MAX_WATCH_DIRS:
            raise ResourceExhausted(
                f"watch of sandbox {self.files.sid} follows {MAX_WATCH_DIRS} directories, "
                "its limit; watch a smaller tree", limit=MAX_WATCH_DIRS)
        assert self.hub is not None, "add after close"
        self.hub.add(self, path, dir_fd)
    def add_tree(self, path: str, dir_fd: int) -> None:
        """Watch ``dir_fd`` and every directory below it (same filesystem, no symlinks
        followed); closes ``dir_fd`` and every fd it opens."""
        stack = [(path, dir_fd)]
        try:
            while stack:
                p, fd = stack.pop()
                try:
                    try:
                        self.add(p, fd)
                    except _OverShare:
                        if not self.dirs:
                            raise       # the watch's root: the watch is refused
                        # its project is over its share: the watch goes on without
                        # this subtree (nor the rest of the walk), and says so
                        self.lost(p)
                        return
                    try:
                        with os.scandir(f"/proc/self/fd/{fd}") as it:
                            names = [e.name for e in it if e.is_dir(follow_symlinks=False)]
                    except OSError:
                        continue
                    for name in names:
                        sub = self.files.open_subdir(fd, name)
                        if sub is not None:
                            stack.append((p.rstrip("/") + "/" + name, sub))
                finally:
                    os.close(fd)
        finally:
            for _, fd in stack:
                os.close(fd)

    def close(self) -> None:
        if self.hub is not None:
            with self.hub.lock:     # no add (a file thread) after this
                self.closed = True
                self.hub.drop(self, list(self.dirs))
                self.dirs.clear()
            self.hub.release()
            self.hub = None


async def watch(files: ConfinedFiles, path: str, recursive: bool,
                run: Run, tenant: str = "") -> AsyncIterator[FileEvent]:
    """Yield changes below directory ``path`` until it goes away (then return).
    ``tenant`` (the sandbox's top-level project) shares the node's watched directories
    with the other tenants (:class:`_Hub`)."""
    ino = _Inotify(files, tenant)
    try:
        root_fd = await run(functools.partial(files.open_dir, path))
        root = "/" + path.strip("/") if path.strip("/") else "/"
        if recursive:
            await run(functools.partial(ino.add_tree, root, root_fd))
        else:
            try:
                ino.add(root, root_fd)
            finally:
                os.close(root_fd)
        root_wd = next(iter(ino.dirs))
        while True:
            await ino.ready.wait()
            ino.ready.clear()
            while ino.missing:
                gone = ino.missing.popleft()
                yield FileEvent(type="incomplete", path=gone,
                                name=gone.rstrip("/").rpartition("/")[2])
            while ino.queue:
                wd, mask, name = ino.queue.popleft()
                if mask & _IN_Q_OVERFLOW:
                    yield FileEvent(type="overflow", path=root)
                    continue
                where = ino.dirs.get(wd)
                if where is None:
                    continue
                if mask & (_IN_IGNORED | _IN_DELETE_SELF | _IN_MOVE_SELF):
                    if wd == root_wd:
                        return          # the watched directory itself went away
                    if mask & _IN_IGNORED:
                        ino.dirs.pop(wd, None)
                    continue
                kind = _event_type(mask)
                if kind is None:
                    continue
                nm = name.decode("utf-8", "surrogateescape")
                if nm.startswith(TEMP_PREFIX) and held_temp(nm):
                    continue    # the file API's own temporary files: its atomic
                    # writes show as one create (the rename into place); a file
                    # the sandbox names so is the sandbox's, and shown
                full = where.rstrip("/") + "/" + nm
                yield FileEvent(type=kind, path=full, name=nm)
                if recursive and kind == "create" and mask & _IN_ISDIR:
                    # resolved again from the root, confined (a name swapped for a
                    # symlink meanwhile resolves inside the sandbox, and a kernel
                    # filesystem is refused by open_dir's fstatfs check)
                    try:
                        sub = files.open_dir(full)
                    except DsecError:
                        continue
                    ino.add_tree(full, sub)
    finally:
        ino.close()
