"""The apiserver's doors of streamed files (issue 19): the Aether gateway's duplex relay
and the REST routes ``GET``/``PUT /v1/sandboxes/{id}/files/content`` and
``GET /v1/sandboxes/{id}/files/watch``.

The policy (who may, which edge) is :class:`~dsec.control.api.service.ApiService`'s:
:meth:`~dsec.control.api.service.ApiService.open_file_stream` checks the caller's role
on the sandbox's project and opens the edge's duplex stream. What is here only moves
bytes between that stream and the caller, one piece at a time: the edge stream's credit
(256 KiB) and the caller's (its Aether credit, or TCP's window under uvicorn's flow
control for REST) bound what the apiserver holds per transfer, whatever the file's
size. The same functions serve the E2B layer's ``/files`` (control/e2b).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from dsec.aether.connection import DuplexStream
from dsec.errors import DsecError
from dsec.wire.spec import FileInfo

if TYPE_CHECKING:
    from dsec.control.api.service import ApiService, Caller
    from dsec.wire.files import ReadStream, WriteStream

__all__ = ["gateway_relay", "read_chunks", "sized_read", "watch_line", "write_chunks"]


def watch_line(item: object) -> dict[str, object]:
    """One NDJSON line of REST's watch: ``{"event": {...}}`` per change, then
    ``{"end": {"reason": ...}}`` (an error: ``{"error": {...}}``)."""
    from dsec.wire.files import WatchEnd
    if isinstance(item, WatchEnd):
        return {"end": {"reason": item.reason}}
    return {"event": item}


async def _pump_in(src: DuplexStream, dst: DuplexStream) -> None:
    """The caller's bytes to the edge, then its FIN."""
    async for chunk in src:
        await dst.send(chunk)
    dst.close_write()


# Measured trade-off (09:25, loaded dev VM, one loopback hop, 128 MiB in 1 MiB sends):
# a receiver widening its duplex window beyond the protocol's 256 KiB made transfers
# slower, not faster (256 KiB: 225-640 MB/s; 1 MiB: 145-220; 4 MiB: 63-99), as bytes
# then pile up in the receiver's queue and the sockets' buffers; so file streams keep
# the default window, which also bounds what each hop holds per transfer.
async def gateway_relay(client: DuplexStream, edge: DuplexStream,
                        done: Callable[[], Awaitable[FileInfo]]) -> FileInfo:
    """Relay a duplex file call between a gateway caller and its edge both ways until
    the edge answers (``done``: the edge stream's result, errors mapped); the caller's
    stream ends with that answer. Either side going away resets the other."""
    up = asyncio.create_task(_pump_in(client, edge))
    try:
        while chunk := await edge.recv():
            await client.send(chunk)
        client.close_write()
        return await done()
    except BaseException:
        edge.reset("the caller's stream ended")
        raise
    finally:
        up.cancel()
        with contextlib.suppress(BaseException):
            await up


async def sized_read(service: ApiService, caller: Caller, req: ReadStream
                     ) -> tuple[ReadStream, FileInfo]:
    """For a door that must say the size before the body (REST's Content-Length): the
    file as the edge *opens* it, and ``req`` with ``length`` set to exactly what will be
    sent (the rest of the file from ``offset``, within the length asked).

    The size comes from the opened file (a zero-length ``file_read_stream``: the edge
    opens the path - symlinks followed inside the sandbox, as ``req.user`` when set -
    and answers its fstat), never from ``stat``, which describes a symlink itself
    (its size is the target's name length: red team 21, B5). A file that changes
    between this open and the read's is cut to this size, or ends the body early
    (an error at the client, never a short file)."""
    import msgspec

    from dsec.wire import ops
    probe = msgspec.structs.replace(req, offset=0, length=0)
    edge, done = await service.open_file_stream(caller, ops.FILE_READ_STREAM, probe)
    edge.close_write()
    try:
        while await edge.recv():
            pass
        info: FileInfo = await done()
    except BaseException:
        edge.reset("the size probe was given up")
        raise
    n = max(0, info.size - req.offset)
    if req.length is not None:
        n = min(n, req.length)
    return msgspec.structs.replace(req, length=n), info


async def read_chunks(service: ApiService, caller: Caller, req: ReadStream
                      ) -> tuple[bytes, AsyncIterator[bytes]]:
    """Open a streamed read: (its first piece, an iterator of the rest). Errors before
    the first byte (no such file, no access, ...) are raised here, so REST can still
    answer them with their status; an error after it ends the iterator by raising."""
    from dsec.wire import ops
    edge, done = await service.open_file_stream(caller, ops.FILE_READ_STREAM, req)
    edge.close_write()
    try:
        first = await edge.recv()
        if not first:
            await done()
    except BaseException:
        edge.reset("the read was given up")
        raise

    async def rest() -> AsyncIterator[bytes]:
        try:
            if first:
                while chunk := await edge.recv():
                    yield chunk
                await done()
        except BaseException:
            edge.reset("the reader went away")
            raise
    return first, rest()


async def write_chunks(service: ApiService, caller: Caller, req: WriteStream,
                       chunks: AsyncIterable[bytes]) -> FileInfo:
    """Send ``chunks`` as the content of a streamed write; the file as written. A
    caller that goes away mid-upload (``chunks`` raising) resets the edge's stream, so
    the edge removes its temporary file and the old file stays."""
    from dsec.wire import ops
    edge, done = await service.open_file_stream(caller, ops.FILE_WRITE_STREAM, req)
    try:
        async for chunk in chunks:
            if chunk:
                await edge.send(chunk)   # raises the edge's error if it answered one
        edge.close_write()
        return await done()
    except DsecError:
        edge.reset("the upload failed")
        raise
    except BaseException:
        edge.reset("the uploader went away")
        raise
