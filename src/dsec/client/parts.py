"""What a part of a sandbox handle (``sb.files``, ``sb.processes``, ``sb.pty``) needs of
its sandbox and client, as Protocols.

``client.core`` and ``client.sync`` build each sandbox with its parts, so a part that
imported them back, even for annotations, would be an import cycle (the ``siblings``
contract in pyproject.toml). The parts take these instead; the SDK's classes fit them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from dsec.wire.ops import Op

if TYPE_CHECKING:
    from dsec.client.transport import Transport

__all__ = ["Calls", "Runs", "SandboxPart", "closing"]

T = TypeVar("T")
Req = TypeVar("Req")
Rep = TypeVar("Rep")


class Calls(Protocol):
    """The async client (``AsyncClient``): a typed call of a catalogue row, and its
    transport for streaming rows."""

    async def call(self, op: Op[Req, Rep], body: Req, *,
                   idempotent: bool | None = None) -> Rep: ...
    async def _transport(self) -> Transport: ...


class SandboxPart(Protocol):
    """A sandbox of the async SDK (``dsec.client.core.AsyncSandbox``): its id and client."""

    @property
    def id(self) -> str: ...
    @property
    def _c(self) -> Calls: ...


class Runs(Protocol):
    """The sync client (``dsec.client.sync.Client``): runs a coroutine on its loop."""

    def _run(self, coro: Coroutine[Any, Any, T]) -> T: ...


_A = TypeVar("_A", bound="AsyncIterator[Any]")


@contextlib.asynccontextmanager
async def closing(items: _A) -> AsyncIterator[_A]:
    """``async with closing(t.stream(...)) as items``: a transport's stream closed when the
    block ends, also when its consumer stops early (a ``return`` at the final item, a
    ``break``, an exception), not left to a finalizer that a sync client's loop never
    runs (the "Task was destroyed but it is pending!" of a CLI exiting)."""
    try:
        yield items
    finally:
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()
