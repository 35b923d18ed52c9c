"""Collecting (or streaming) a process's stdout/stderr with a per-stream cap.

The read ends of the pipes are non-blocking and read from the event loop; bytes past
``cap`` are read and dropped (the writer is never blocked, so ``yes`` runs until its
timeout without growing memory) and the stream is flagged truncated. After the process
exits the pipes are drained of what is already in them and closed - a background child
that inherited stdout cannot keep the call open.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Literal

from dsec.wire.spec import ExecChunk

__all__ = ["OutputPump", "StdinFeeder"]

_READ = 1 << 16
StreamName = Literal["stdout", "stderr"]


class OutputPump:
    """Reads two pipe fds into buffers (or ``on_chunk`` when streaming), capped."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fds: dict[StreamName, int], cap: int,
                 on_chunk: Callable[[ExecChunk], None] | None = None) -> None:
        self.loop = loop
        self.fds = dict(fds)
        self.cap = cap
        self.on_chunk = on_chunk
        self.bufs: dict[StreamName, bytearray] = {k: bytearray() for k in fds}
        self.sizes: dict[StreamName, int] = {k: 0 for k in fds}
        self.truncated: dict[StreamName, bool] = {k: False for k in fds}
        self.eof = asyncio.Event()
        for name, fd in self.fds.items():
            os.set_blocking(fd, False)
            loop.add_reader(fd, self._readable, name)

    def _take(self, name: StreamName, data: bytes) -> None:
        room = self.cap - self.sizes[name]
        if room <= 0:
            self.truncated[name] = True
            return
        if len(data) > room:
            data = data[:room]
            self.truncated[name] = True
        self.sizes[name] += len(data)
        if self.on_chunk is not None:
            self.on_chunk(ExecChunk(stream=name, data=data))
        else:
            self.bufs[name] += data

    def _readable(self, name: StreamName) -> None:
        fd = self.fds.get(name)
        if fd is None:
            return
        try:
            data = os.read(fd, _READ)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self._take(name, data)
        else:
            self._close(name)

    def _close(self, name: StreamName) -> None:
        fd = self.fds.pop(name, None)
        if fd is not None:
            self.loop.remove_reader(fd)
            os.close(fd)
        if not self.fds:
            self.eof.set()

    def finish(self) -> None:
        """The process is gone: take what is buffered in the pipes, then close them."""
        for name in list(self.fds):
            fd = self.fds[name]
            for _ in range(1024):  # at most 64 MiB of leftovers; the rest is dropped
                try:
                    data = os.read(fd, _READ)
                except (BlockingIOError, OSError):
                    break
                if not data:
                    break
                self._take(name, data)
            self._close(name)


class StdinFeeder:
    """Writes ``data`` into a non-blocking pipe from the event loop, then closes it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, data: bytes) -> None:
        self.loop, self.fd, self.view = loop, fd, memoryview(data)
        os.set_blocking(fd, False)
        loop.add_writer(fd, self._writable)
        self.closed = False

    def _writable(self) -> None:
        try:
            n = os.write(self.fd, self.view[: 1 << 16])
            self.view = self.view[n:]
        except BlockingIOError:
            return
        except OSError:  # reader gone (EPIPE): the command did not want more input
            self.view = self.view[:0]
        if not self.view:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.remove_writer(self.fd)
            os.close(self.fd)
