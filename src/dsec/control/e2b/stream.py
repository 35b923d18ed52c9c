"""envd's server-streaming answers (a process's ``Start``/``Connect``, ``WatchDir``)
written straight to the ASGI ``send``: no Starlette ``StreamingResponse``, no queue, no
task per event.

Why not ``StreamingResponse``: per stream it ran an anyio task group with a task that
listens for the client's disconnect, and the layer fed it through an
``asyncio.Queue`` with an ``asyncio.wait_for`` per event (a task each on Python 3.11),
each a trip through the event loop; a ``commands.run("true")`` (five small writes) spent
~25% of the layer's time there (docs/e2b.md, "Exec overhead"). Here the edge's stream is
iterated in the request's own task and every envelope is sent as it comes; the end
event, the end-of-stream envelope and the chunked terminator go in one final write.

What the old path gave and this one keeps:

- **keep-alive** on a quiet stream (envd sends one every ``keepalive_s``; proxies and
  the SDK's read timeout rely on it): one loop timer, re-armed only when it fires (a
  write just notes the time), so a busy stream costs no timer work per event;
- **a client that goes away ends the reader**: the edge stream (a ``process_connect``
  subscription, a ``file_watch``) is closed and the process runs on, as envd's do. The
  disconnect is watched by one task waiting on ``receive()``, started only once the
  stream has been open ``watch_after_s`` (a command that ends sooner never needs one;
  its disconnect is seen at its end anyway); it cancels the request's task, which
  closes the edge stream and returns quietly;
- **errors** end the stream with Connect's end-of-stream error envelope (``on_error``
  maps them), never a trace;
- the reply budget's ``send`` wrapper (``dsec.control.replybudget``) is the ``send``
  given here, so leases are released as their bytes are written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, TypeVar

from dsec.control.e2b import connect as rpc

__all__ = ["KEEPALIVE", "ConnectStream"]

log = logging.getLogger("dsec.e2b")

T = TypeVar("T")

#: envd's keep-alive event.
KEEPALIVE = rpc.envelope({"event": {"keepalive": {}}})
_START = {"type": "http.response.start", "status": 200,
          "headers": [(b"content-type", b"application/connect+json")]}

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


class ConnectStream(Generic[T]):
    """One server-streaming answer (an ASGI app, used once): ``first`` (the start
    event), then ``frame(item)`` of each item of the stream ``open_()`` gives, until
    an item whose frame says it is the last (its bytes end the stream: they carry the
    end-of-stream envelope) or the stream ends (:data:`connect.END_OK`). ``on_error``
    gives the end-of-stream envelope of an exception raised opening or reading it."""

    __slots__ = ("_done", "_first", "_frame", "_gone", "_ka_task", "_keepalive_s",
                 "_last", "_loop", "_on_error", "_open", "_receive", "_send", "_task",
                 "_timer", "_watch_after_s", "_watcher", "_writing")

    def __init__(self, first: bytes, open_: Callable[[], Awaitable[AsyncIterator[T]]],
                 frame: Callable[[T], tuple[bytes, bool]],
                 on_error: Callable[[BaseException], bytes], *, keepalive_s: float,
                 watch_after_s: float = 0.05) -> None:
        self._first, self._open, self._frame, self._on_error = first, open_, frame, on_error
        self._keepalive_s, self._watch_after_s = keepalive_s, watch_after_s
        self._done = self._gone = self._writing = False
        self._watcher: asyncio.Task[None] | None = None
        self._ka_task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._last = 0.0

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._receive, self._send = receive, send
        await send(_START)
        await self._write(self._first)
        self._timer = loop.call_later(min(self._watch_after_s, self._keepalive_s),
                                      self._tick)
        it: AsyncIterator[T] | None = None
        final = rpc.END_OK
        try:
            try:
                it = await self._open()
                async for item in it:
                    data, last = self._frame(item)
                    if last:
                        final = data
                        break
                    if data:
                        await self._write(data)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - mapped: on_error says how
                final = self._on_error(exc)
            self._stop()
            await send({"type": "http.response.body", "body": final, "more_body": False})
        except asyncio.CancelledError:
            task = self._task
            if not self._gone or task is None:
                raise
            # the client went away (its watcher cancelled us): the reader ends here; the
            # process runs on, as envd's do. Nothing is left to write to.
            task.uncancel()
        finally:
            self._stop()
            if it is not None:
                aclose = getattr(it, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()

    async def _write(self, data: bytes) -> None:
        self._writing = True
        try:
            await self._send({"type": "http.response.body", "body": data, "more_body": True})
        finally:
            self._writing = False
            self._last = self._loop.time()

    def _stop(self) -> None:
        self._done = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for t in (self._watcher, self._ka_task):
            if t is not None and not t.done():
                t.cancel()

    def _tick(self) -> None:
        """The stream's one timer: start the disconnect watcher (once), send a keep-alive
        if nothing was written for ``keepalive_s``, and re-arm for the next due time."""
        if self._done:
            return
        loop = self._loop
        if self._watcher is None:
            self._watcher = loop.create_task(self._watch())
        now = loop.time()
        due = self._last + self._keepalive_s
        if now >= due:
            if not self._writing and (self._ka_task is None or self._ka_task.done()):
                self._ka_task = loop.create_task(self._keepalive())
            due = now + self._keepalive_s
        self._timer = loop.call_at(due, self._tick)

    async def _keepalive(self) -> None:
        if self._done:
            return
        try:
            await self._write(KEEPALIVE)
        except Exception:
            log.debug("E2B stream keep-alive not written", exc_info=True)

    async def _watch(self) -> None:
        """Wait for the client's disconnect; then cancel the request's task (the edge
        stream is closed there)."""
        try:
            while True:
                message = await self._receive()
                if message.get("type") == "http.disconnect":
                    break
        except Exception:
            log.debug("E2B stream receive failed", exc_info=True)
        if not self._done and self._task is not None:
            self._gone = True
            self._task.cancel()
