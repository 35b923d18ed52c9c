"""``sandbox.files``: a sandbox's files from the SDK (async and sync).

Small calls (``list``, ``stat``, ``exists``, ``mkdir``, ``remove``, ``rename``) are one
request each. Contents of any size stream (docs/sdk.md "Files"):

- ``write(path, data)`` takes bytes, a str, a binary file object or an (async) iterator
  of bytes and replaces the file **atomically** (``file_write_stream``: the sandbox sees
  the old file or the whole new one, never a part; a dropped connection changes
  nothing). Memory here is one piece (1 MiB) whatever the size.
- ``read(path, stream=True)`` yields the file's bytes as they arrive
  (``file_read_stream``; over the gateway under Aether credit, over REST under TCP's
  window), so a slow consumer holds the sender back instead of buffering.
- ``upload(local, remote)`` / ``download(remote, local)``: files on this machine, with
  a ``progress(done_bytes)`` callback; a download lands in a temporary file renamed
  into place when complete.
- ``watch(dir)`` yields :class:`~dsec.wire.files.FileEvent` (create, write, remove,
  rename, chmod) until the directory goes away, ``timeout`` passes or you stop.
"""

from __future__ import annotations

import asyncio
import builtins
import os
import tempfile
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from typing import IO, Any, Literal, overload

from dsec.client.parts import Runs, SandboxPart, closing
from dsec.errors import NotFound, PayloadTooLarge
from dsec.wire import ops
from dsec.wire.calls import FileRef, Mkdir, ReadFile, Remove, WriteFile
from dsec.wire.files import FileEvent, ReadStream, Rename, Watch, WatchEnd, WriteStream
from dsec.wire.spec import FILE_CHUNK_BYTES, FileInfo, read_in_chunks

__all__ = ["PIECE", "AsyncFiles", "Files", "Progress", "WriteData"]

# Bytes read from a local file or a file object per piece.
PIECE = 1 << 20
#: ``progress(done)``: bytes moved so far (called after each piece).
Progress = Callable[[int], None]
WriteData = bytes | bytearray | memoryview | str | IO[bytes] | Iterable[bytes] | \
    AsyncIterable[bytes]


async def _pieces(data: WriteData, progress: Progress | None) -> AsyncIterator[bytes]:
    """``data`` as pieces of bytes (file objects and sync iterators read beside the
    loop: a disk or a generator must not stall the client's other calls)."""
    done = 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done)
    if isinstance(data, str):
        data = data.encode()
    if isinstance(data, (bytes, bytearray, memoryview)):
        view = memoryview(data)
        for at in range(0, len(view), PIECE):
            piece = bytes(view[at:at + PIECE])
            yield piece
            tick(len(piece))
        return
    if hasattr(data, "read"):
        f: Any = data
        while piece := await asyncio.to_thread(f.read, PIECE):
            yield bytes(piece)
            tick(len(piece))
        return
    if isinstance(data, AsyncIterable):
        async for piece in data:
            yield bytes(piece)
            tick(len(piece))
        return
    it = iter(data)

    def step() -> bytes | None:
        return next(it, None)
    while True:
        got: bytes | None = await asyncio.to_thread(step)
        if got is None:
            return
        yield bytes(got)
        tick(len(got))


class AsyncFiles:
    """``sandbox.files``: read, write, upload, download, list, stat, exists, mkdir,
    rename, remove, watch (raw bytes; see the module docstring)."""

    def __init__(self, sb: SandboxPart) -> None:
        self._sb = sb

    async def _transport(self) -> Any:
        return await self._sb._c._transport()

    @overload
    async def read(self, path: str, *, offset: int = 0, length: int | None = None,
                   stream: Literal[False] = False, user: str | None = None) -> bytes: ...

    @overload
    async def read(self, path: str, *, offset: int = 0, length: int | None = None,
                   stream: Literal[True], user: str | None = None) -> AsyncIterator[bytes]: ...

    async def read(self, path: str, *, offset: int = 0, length: int | None = None,
                   stream: bool = False, user: str | None = None
                   ) -> bytes | AsyncIterator[bytes]:
        """The file's bytes (from ``offset``, ``length`` of them). ``stream=True``: an
        async iterator of pieces as they arrive, for files of any size; without it the
        whole file in memory (in 8 MiB requests up to 64 MiB, streamed beyond).
        ``user``: read as that sandbox user (their rights; see "Files as a user")."""
        if stream:
            return self._stream(path, offset, length, user=user)

        async def piece(at: int, n: int) -> bytes:
            return await self._sb._c.call(ops.READ_FILE, ReadFile(
                id=self._sb.id, path=path, offset=at, length=n, user=user))
        try:
            return await read_in_chunks(piece, offset, length)
        except PayloadTooLarge:
            return b"".join([c async for c in self._stream(path, offset, length,
                                                           user=user)])

    async def _stream(self, path: str, offset: int, length: int | None,
                      sink: list[FileInfo] | None = None, *,
                      user: str | None = None) -> AsyncIterator[bytes]:
        t = await self._transport()
        async with closing(t.read_stream(ops.FILE_READ_STREAM, ReadStream(
                id=self._sb.id, path=path, offset=offset, length=length,
                user=user))) as items:
            async for item in items:
                if isinstance(item, FileInfo):
                    if sink is not None:
                        sink.append(item)
                else:
                    yield item

    async def read_text(self, path: str, *, user: str | None = None) -> str:
        return (await self.read(path, user=user)).decode()

    async def write(self, path: str, data: WriteData, *, mode: int = 0o644,
                    append: bool = False, size: int | None = None,
                    progress: Progress | None = None,
                    user: str | None = None) -> FileInfo | None:
        """Replace ``path`` atomically with ``data`` (bytes, str, a binary file object,
        or an iterator / async iterator of bytes): the file as written. ``size``, when
        known, lets the sandbox refuse an upload its disk cannot take before any byte
        moves. ``append=True`` adds bytes/str at the end instead (not atomic; None).
        ``user``: written as that sandbox user - their rights decide, and the file (and
        any parent made) is theirs (docs/sdk.md "Files as a user")."""
        if append:
            if not isinstance(data, (bytes, bytearray, memoryview, str)):
                raise TypeError("append takes bytes or str")
            raw = data.encode() if isinstance(data, str) else bytes(data)
            for at in range(0, max(1, len(raw)), FILE_CHUNK_BYTES):
                await self._sb._c.call(ops.WRITE_FILE, WriteFile(
                    id=self._sb.id, path=path, data=raw[at:at + FILE_CHUNK_BYTES],
                    mode=mode, append=True, user=user), idempotent=False)
            return None
        if size is None and isinstance(data, (bytes, bytearray, memoryview)):
            size = len(data)
        t = await self._transport()
        info: FileInfo = await t.write_stream(
            ops.FILE_WRITE_STREAM, WriteStream(id=self._sb.id, path=path, mode=mode,
                                               size=size, user=user),
            _pieces(data, progress))
        return info

    async def upload(self, local: str | os.PathLike[str], remote: str, *,
                     mode: int | None = None, progress: Progress | None = None,
                     user: str | None = None) -> FileInfo:
        """Copy local file ``local`` to ``remote`` in the sandbox (atomically; its
        permission bits unless ``mode`` is given; ``user``: as that sandbox user)."""
        st = os.stat(local)
        f = await asyncio.to_thread(open, local, "rb")
        with f:
            info = await self.write(remote, f, mode=st.st_mode & 0o7777 if mode is None
                                    else mode, size=st.st_size, progress=progress,
                                    user=user)
        assert info is not None
        return info

    async def download(self, remote: str, local: str | os.PathLike[str], *,
                       progress: Progress | None = None,
                       user: str | None = None) -> FileInfo:
        """Copy ``remote`` from the sandbox to local file ``local``: written to a
        temporary file beside it and renamed into place once complete (an interrupted
        download leaves ``local`` as it was). ``local`` may be a directory."""
        dest = os.fspath(local)
        if os.path.isdir(dest):
            dest = os.path.join(dest, os.path.basename(remote.rstrip("/")) or "file")
        fd, tmp = tempfile.mkstemp(prefix=".dsec-download-", dir=os.path.dirname(dest) or ".")
        got: list[FileInfo] = []
        try:
            with os.fdopen(fd, "wb") as f:
                done = 0
                async for chunk in self._stream(remote, 0, None, got, user=user):
                    await asyncio.to_thread(f.write, chunk)
                    done += len(chunk)
                    if progress is not None:
                        progress(done)
            if got:
                os.chmod(tmp, got[0].mode & 0o777)
            os.replace(tmp, dest)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        return got[0]

    async def list(self, path: str = "/", *,
                   user: str | None = None) -> builtins.list[FileInfo]:
        return (await self._sb._c.call(ops.LIST_DIR, FileRef(id=self._sb.id, path=path,
                                                             user=user))).items

    async def stat(self, path: str, *, user: str | None = None) -> FileInfo:
        return await self._sb._c.call(ops.STAT, FileRef(id=self._sb.id, path=path,
                                                        user=user))

    async def exists(self, path: str, *, user: str | None = None) -> bool:
        try:
            await self.stat(path, user=user)
            return True
        except NotFound:
            return False

    async def mkdir(self, path: str, *, parents: bool = True,
                    user: str | None = None) -> None:
        """Create directory ``path``; ``parents=False``: ``NotFound`` when its parent is
        missing (else the missing parents are created too, like ``mkdir -p``)."""
        await self._sb._c.call(ops.MKDIR, Mkdir(id=self._sb.id, path=path, parents=parents,
                                                user=user))

    async def rename(self, src: str, dst: str, *, overwrite: bool = False,
                     user: str | None = None) -> FileInfo:
        """Move ``src`` to ``dst`` inside the sandbox (same filesystem); an existing
        ``dst`` is refused unless ``overwrite``. The moved entry's FileInfo."""
        return await self._sb._c.call(ops.FILE_RENAME, Rename(
            id=self._sb.id, src=src, dst=dst, overwrite=overwrite, user=user))

    async def remove(self, path: str, *, recursive: bool = False,
                     user: str | None = None) -> None:
        # not retried on a lost connection: a repeat after it happened says NotFound
        await self._sb._c.call(ops.REMOVE, Remove(id=self._sb.id, path=path,
                                                  recursive=recursive, user=user))

    async def watch(self, path: str, *, recursive: bool = False,
                    timeout: float | None = None) -> AsyncIterator[FileEvent]:
        """Changes below directory ``path`` as they happen (``recursive``: in its
        subdirectories too), until it is removed, ``timeout`` seconds pass, or you stop
        iterating. Works on a paused sandbox (changes then come from outside it)."""
        t = await self._transport()
        async with closing(t.stream(ops.FILE_WATCH, Watch(
                id=self._sb.id, path=path, recursive=recursive, timeout_s=timeout),
                timeout=None)) as items:
            async for item in items:
                if isinstance(item, WatchEnd):
                    return
                yield item


class Files:
    """See :class:`AsyncFiles` (the same methods, blocking; streams are iterators)."""

    def __init__(self, client: Runs, a: AsyncFiles) -> None:
        self._c = client
        self._a = a

    def _iter(self, agen: AsyncIterator[Any]) -> Iterator[Any]:
        async def step() -> Any:
            return await agen.__anext__()
        try:
            while True:
                try:
                    yield self._c._run(step())
                except StopAsyncIteration:
                    return
        finally:
            close = getattr(agen, "aclose", None)
            if close is not None:
                self._c._run(close())

    @overload
    def read(self, path: str, *, offset: int = 0, length: int | None = None,
             stream: Literal[False] = False, user: str | None = None) -> bytes: ...

    @overload
    def read(self, path: str, *, offset: int = 0, length: int | None = None,
             stream: Literal[True], user: str | None = None) -> Iterator[bytes]: ...

    def read(self, path: str, *, offset: int = 0, length: int | None = None,
             stream: bool = False, user: str | None = None) -> bytes | Iterator[bytes]:
        if stream:
            return self._iter(self._a._stream(path, offset, length, user=user))
        return self._c._run(self._a.read(path, offset=offset, length=length, user=user))

    def read_text(self, path: str, *, user: str | None = None) -> str:
        return self._c._run(self._a.read_text(path, user=user))

    def write(self, path: str, data: WriteData, *, mode: int = 0o644,
              append: bool = False, size: int | None = None,
              progress: Progress | None = None, user: str | None = None) -> FileInfo | None:
        return self._c._run(self._a.write(path, data, mode=mode, append=append, size=size,
                                          progress=progress, user=user))

    def upload(self, local: str | os.PathLike[str], remote: str, *,
               mode: int | None = None, progress: Progress | None = None,
               user: str | None = None) -> FileInfo:
        return self._c._run(self._a.upload(local, remote, mode=mode, progress=progress,
                                           user=user))

    def download(self, remote: str, local: str | os.PathLike[str], *,
                 progress: Progress | None = None, user: str | None = None) -> FileInfo:
        return self._c._run(self._a.download(remote, local, progress=progress, user=user))

    def list(self, path: str = "/", *, user: str | None = None) -> builtins.list[FileInfo]:
        return self._c._run(self._a.list(path, user=user))

    def stat(self, path: str, *, user: str | None = None) -> FileInfo:
        return self._c._run(self._a.stat(path, user=user))

    def exists(self, path: str, *, user: str | None = None) -> bool:
        return self._c._run(self._a.exists(path, user=user))

    def mkdir(self, path: str, *, parents: bool = True, user: str | None = None) -> None:
        self._c._run(self._a.mkdir(path, parents=parents, user=user))

    def rename(self, src: str, dst: str, *, overwrite: bool = False,
               user: str | None = None) -> FileInfo:
        return self._c._run(self._a.rename(src, dst, overwrite=overwrite, user=user))

    def remove(self, path: str, *, recursive: bool = False, user: str | None = None) -> None:
        self._c._run(self._a.remove(path, recursive=recursive, user=user))

    def watch(self, path: str, *, recursive: bool = False,
              timeout: float | None = None) -> Iterator[FileEvent]:
        return self._iter(self._a.watch(path, recursive=recursive, timeout=timeout))
