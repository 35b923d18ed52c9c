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
import ctypes
import errno
import functools
import os
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeVar, runtime_checkable

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


def hold_temp(name: str) -> None:
    """``name`` (a temporary file this process made) is hidden from watches until
    :func:`release_temp` (names are random: one process's set, no directory needed)."""
    _held[name] = float("inf")


def release_temp(name: str, *, now: float | None = None) -> None:
    """``name`` is done with (committed or removed): hidden a little longer, then not."""
    t = time.monotonic() if now is None else now
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

__all__ = ["CHUNK", "MAX_WATCH_DIRS", "TEMP_PREFIX", "AtomicWrite", "ConfinedFiles",
           "FileStreamBackend", "Run", "held_temp", "hold_temp", "read_stream",
           "release_temp", "watch", "write_stream"]

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

    def watch_files(self, sid: SandboxId, path: str,
                    recursive: bool) -> AsyncIterator[FileEvent]: ...


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


class _Inotify:
    """One inotify instance and the confined directories it watches (wd -> path).

    The O_PATH fd a directory was resolved to is closed once its watch is added: an open
    fd holds the directory's dentry, and the kernel then reports its removal
    (IN_DELETE_SELF) only when the fd closes - a watch never learned its directory was
    gone. The watch itself pins the inode, not the name."""

    def __init__(self, files: ConfinedFiles) -> None:
        fd = _libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            e = ctypes.get_errno()
            raise ResourceExhausted(f"cannot watch files of sandbox {files.sid}: "
                                    f"inotify_init1: {os.strerror(e)}")
        self.fd = fd
        self.files = files
        self.dirs: dict[int, str] = {}

    def add(self, path: str, dir_fd: int) -> None:
        """Watch directory ``dir_fd`` (an O_PATH fd, left open) as ``path``."""
        if len(self.dirs) >= MAX_WATCH_DIRS:
            raise ResourceExhausted(
                f"watch of sandbox {self.files.sid} follows {MAX_WATCH_DIRS} directories, "
                "its limit; watch a smaller tree", limit=MAX_WATCH_DIRS)
        wd = _libc.inotify_add_watch(self.fd, f"/proc/self/fd/{dir_fd}".encode(),
                                     ctypes.c_uint32(_MASK))
        if wd < 0:
            e = ctypes.get_errno()
            if e == errno.ENOSPC:
                raise ResourceExhausted(f"cannot watch {path!r} in sandbox {self.files.sid}: "
                                        "the node's inotify watch limit is reached")
            raise InvalidArgument(f"cannot watch {path!r} in sandbox {self.files.sid}: "
                                  f"{os.strerror(e)}", path=path)
        self.dirs[wd] = path

    def add_tree(self, path: str, dir_fd: int) -> None:
        """Watch ``dir_fd`` and every directory below it (same filesystem, no symlinks
        followed); closes ``dir_fd`` and every fd it opens."""
        stack = [(path, dir_fd)]
        try:
            while stack:
                p, fd = stack.pop()
                try:
                    self.add(p, fd)
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
        self.dirs.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


async def watch(files: ConfinedFiles, path: str, recursive: bool,
                run: Run) -> AsyncIterator[FileEvent]:
    """Yield changes below directory ``path`` until it goes away (then return)."""
    ino = _Inotify(files)
    loop = asyncio.get_running_loop()
    ready = asyncio.Event()
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
        loop.add_reader(ino.fd, ready.set)
        try:
            while True:
                await ready.wait()
                ready.clear()
                try:
                    data = os.read(ino.fd, 64 * 1024)
                except BlockingIOError:
                    continue
                off = 0
                while off + _EVENT.size <= len(data):
                    wd, mask, _cookie, n = _EVENT.unpack_from(data, off)
                    name = data[off + _EVENT.size: off + _EVENT.size + n].split(b"\0", 1)[0]
                    off += _EVENT.size + n
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
            loop.remove_reader(ino.fd)
    finally:
        ino.close()
