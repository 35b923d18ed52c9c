"""Test helpers for code that uses the SDK: an in-memory transport, httpx's
``MockTransport`` shape.

``AsyncClient(transport=MockTransport(handler))`` sends every operation to
``handler(op, body)`` instead of a server: ``op`` is the catalogue row
(:mod:`dsec.wire.ops`), ``body`` the request object the SDK built, and what the handler
returns (or awaits) is the reply; raising a :class:`~dsec.errors.DsecError` answers with
it, as a server would. A streaming row's handler returns the items and then the final
reply, as a list. No sockets, no threads: the SDK's own logic (request building, retries,
sessions, typed replies) runs unchanged against it.
"""

from __future__ import annotations

import builtins
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from dsec.wire.api import Info
from dsec.wire.ops import USE_CLIENT_DEFAULT, Deadline, Op, StreamOp, UploadOp

__all__ = ["Handler", "MockTransport"]

Req = TypeVar("Req")
Rep = TypeVar("Rep")
Item = TypeVar("Item")

#: ``handler(op, body) -> reply`` (or an awaitable of it).
Handler = Callable[[Op[Any, Any], Any], Any]


class MockTransport:
    """See the module docstring. ``calls`` records every ``(op.name, body)`` sent."""

    name = "mock"

    def __init__(self, handler: Handler, *, info: Info | None = None) -> None:
        self.handler = handler
        self.info = info or Info(version="mock", project="default",
                                 default_backend="simulated")
        self.calls: builtins.list[tuple[str, Any]] = []
        self.uploaded: builtins.list[bytes] = []
        self.closed = False

    async def call(self, op: Op[Req, Rep], body: Req, *,
                   timeout: Deadline = USE_CLIENT_DEFAULT) -> Rep:
        self.calls.append((op.name, body))
        reply = self.handler(op, body)
        if inspect.isawaitable(reply):
            reply = await reply
        out: Rep = reply
        return out

    async def stream(self, op: StreamOp[Req, Item, Rep], body: Req, *,
                     timeout: Deadline = USE_CLIENT_DEFAULT) -> AsyncIterator[Item | Rep]:
        items: Any = await self.call(op, body, timeout=timeout)
        for item in items:
            yield item

    async def upload(self, op: UploadOp[Req, Rep], body: Req,
                     chunks: AsyncIterator[bytes]) -> Rep:
        """An upload row: the handler gets ``(op, body)``; the chunks are read first and
        recorded in :attr:`uploaded`."""
        self.uploaded.append(b"".join([c async for c in chunks]))
        return await self.call(op, body)

    async def read_stream(self, op: Op[Req, Any], body: Req) -> AsyncIterator[Any]:
        """A streamed file read: the handler returns the pieces, then the FileInfo."""
        items: Any = await self.call(op, body)
        for item in items:
            yield item

    async def write_stream(self, op: Op[Req, Rep], body: Req,
                           chunks: AsyncIterator[bytes]) -> Rep:
        """A streamed file write: the chunks are read first and recorded in
        :attr:`uploaded`; the handler gets ``(op, body)``."""
        self.uploaded.append(b"".join([c async for c in chunks]))
        return await self.call(op, body)

    async def close(self) -> None:
        self.closed = True
