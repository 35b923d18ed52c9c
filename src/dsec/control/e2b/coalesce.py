"""One socket write per loop step on the E2B listener: small writes made in the same
event-loop step go out together.

uvicorn writes a response's status line and headers, each body message and the chunked
terminator with a ``transport.write`` each: a unary envd answer is two writes, a
``commands.run`` stream was six. On loopback (and on most LANs) every write is a segment
that wakes the client to read it; measured with py-spy during 1,500
``commands.run("true")`` on the 2-core box, the E2B app spent ~75% of its time in those
``write(2)`` calls (docs/e2b.md, "Exec overhead"). :class:`CoalescingTransport` keeps the
small writes of one loop step and hands them to the socket as one, at the end of the
step (``call_soon``): headers and the first body of a response leave together.

Bounds and order: a write of ``DIRECT`` bytes or more, or one that brings the held bytes
there, flushes first and goes straight to the transport (a large download's flow control
is the transport's, as before); ``close``/``write_eof`` flush first, ``abort`` drops;
every write of the connection goes through it, so bytes keep their order. Nothing is
written to a transport already closing (a client gone between the write and the flush).
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["DIRECT", "CoalescingTransport", "coalescing_protocol"]

#: Writes this large (or held bytes reaching it) go to the transport at once.
DIRECT = 16 << 10


class CoalescingTransport:
    """``transport`` with the small writes of a loop step joined (module doc)."""

    __slots__ = ("_buf", "_held", "_loop", "_scheduled", "_t")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._t = transport
        self._loop = loop
        self._buf: list[bytes] = []
        self._held = 0
        self._scheduled = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        n = len(data)
        if not n:
            return
        if n >= DIRECT:
            self.flush()
            self._t.write(data)
            return
        self._buf.append(bytes(data))
        self._held += n
        if self._held >= DIRECT:
            self.flush()
        elif not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._flush_soon)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def _flush_soon(self) -> None:
        self._scheduled = False
        self.flush()

    def flush(self) -> None:
        buf = self._buf
        if not buf:
            return
        data = buf[0] if len(buf) == 1 else b"".join(buf)
        buf.clear()
        self._held = 0
        if not self._t.is_closing():
            self._t.write(data)

    def close(self) -> None:
        self.flush()
        self._t.close()

    def write_eof(self) -> None:
        self.flush()
        self._t.write_eof()

    def abort(self) -> None:
        self._buf.clear()
        self._held = 0
        self._t.abort()

    def get_write_buffer_size(self) -> int:
        return self._t.get_write_buffer_size() + self._held

    def __getattr__(self, name: str) -> Any:      # everything else is the transport's
        return getattr(self._t, name)


def coalescing_protocol(base: type[Any]) -> type[Any]:
    """``base`` (a uvicorn HTTP protocol class) writing through :class:`CoalescingTransport`."""

    class CoalescingProtocol(base):  # type: ignore[misc]
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(CoalescingTransport(
                transport, asyncio.get_running_loop()))

    CoalescingProtocol.__name__ = CoalescingProtocol.__qualname__ = (
        f"Coalescing{base.__name__}")
    return CoalescingProtocol
