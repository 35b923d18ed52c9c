"""Aether connections: request/response multiplexing over an asyncio stream pair.

The thin asyncio shell around :mod:`dsec.aether.frame`. One :class:`Connection` can both
call and serve: calls it initiates use odd stream ids on the dialing side and even ids on
the accepting side, so the two directions never collide.

Performance notes (measured on the 2-core dev VM, see bench suite ``protocol``):
- Writes are corked: every frame produced while handling one read wakeup (or queued by
  many tasks in one loop iteration) goes out in one ``writelines``, which is what makes
  pipelining and :meth:`Connection.call_batch` cheap.
- Synchronous handlers run inline in the read loop; only ``async def`` handlers cost a
  task. A per-request task was ~40% of a no-op round trip.
- Call timeouts use one ``loop.call_later`` handle per call instead of
  ``asyncio.wait_for``, which allocates a task per call.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from dsec.errors import (
    ConnectionLost,
    DsecError,
    InvalidArgument,
    LocalProtocolError,
    RemoteProtocolError,
    RequestTimeout,
    UnknownMethod,
    error_from_wire,
)
from dsec.aether.frame import DEFAULT_MAX_FRAME, FrameDecoder, FrameFlags, FrameType, encode_parts
from dsec.aether.messages import ErrorBody, Goaway, decode_request, encode_request, error_body

__all__ = ["CallStream", "Connection", "Router", "StreamSender"]

log = logging.getLogger("dsec.aether")

T = TypeVar("T")
FRAMES_PER_WAKEUP = 64
READ_CHUNK = 256 * 1024
WRITE_HIGH_WATER = 4 * 1024 * 1024

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}
_NIL = b"\xc0"


def _decoder(tp: Any) -> msgspec.msgpack.Decoder[Any]:
    d = _decoders.get(tp)
    if d is None:
        d = _decoders[tp] = msgspec.msgpack.Decoder(tp) if tp is not None else msgspec.msgpack.Decoder()
    return d


def _encode_body(body: Any) -> bytes:
    if body is None:
        return _NIL
    try:
        return _encoder.encode(body)
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalProtocolError(f"cannot encode message body of type {type(body).__name__}: {exc}") from exc


@dataclass(slots=True, frozen=True)
class _Route:
    handler: Callable[..., Any]
    request_type: Any
    is_async: bool
    streaming: bool


class Router:
    """Method name -> handler. Handlers take the decoded body (and a StreamSender when
    ``streaming``) and return a msgpack-able result; sync handlers run inline."""

    def __init__(self) -> None:
        self._routes: dict[str, _Route] = {}

    def add(
        self,
        method: str,
        handler: Callable[..., Any],
        *,
        request_type: Any = None,
        streaming: bool = False,
    ) -> None:
        if method in self._routes:
            raise ValueError(f"method {method!r} is already registered")
        encode_request(method, b"")  # validates the name
        is_async = inspect.iscoroutinefunction(handler)
        if streaming and not is_async:
            raise ValueError(f"streaming handler for {method!r} must be async")
        self._routes[method] = _Route(handler, request_type, is_async, streaming)

    def route(
        self, method: str, *, request_type: Any = None, streaming: bool = False
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.add(method, fn, request_type=request_type, streaming=streaming)
            return fn
        return deco

    def get(self, method: str) -> _Route | None:
        return self._routes.get(method)

    @property
    def methods(self) -> list[str]:
        return sorted(self._routes)


class StreamSender:
    """Given to streaming handlers: ``await stream.send(item)`` pushes a STREAM frame."""

    __slots__ = ("_conn", "_sid")

    def __init__(self, conn: Connection, sid: int) -> None:
        self._conn = conn
        self._sid = sid

    async def send(self, item: Any) -> None:
        self._conn._send(FrameType.STREAM, self._sid, _encode_body(item))
        await self._conn._maybe_drain()


class _StreamSlot:
    __slots__ = ("items", "waiter", "done", "result", "error", "item_type")

    def __init__(self, item_type: Any) -> None:
        self.items: collections.deque[bytes] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.done = False
        self.result: bytes | None = None
        self.error: BaseException | None = None
        self.item_type = item_type

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


class CallStream:
    """Async iterator over a streaming call's items; ``result`` holds the final reply."""

    def __init__(
        self, conn: Connection, sid: int, slot: _StreamSlot, response_type: Any,
        timer: asyncio.TimerHandle | None,
    ) -> None:
        self._conn, self._sid, self._slot = conn, sid, slot
        self._response_type = response_type
        self._timer = timer
        self.result: Any = None

    def __aiter__(self) -> CallStream:
        return self

    async def __anext__(self) -> Any:
        slot = self._slot
        while True:
            if slot.items:
                return _decoder(slot.item_type).decode(slot.items.popleft())
            if slot.done:
                self._finish()
                if slot.error is not None:
                    raise slot.error
                self.result = _decoder(self._response_type).decode(slot.result or _NIL)
                raise StopAsyncIteration
            slot.waiter = self._conn._loop.create_future()
            try:
                await slot.waiter
            except asyncio.CancelledError:
                self.cancel()
                raise
            finally:
                slot.waiter = None

    def _finish(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def cancel(self) -> None:
        """Stop the call: the server's handler is cancelled."""
        self._finish()
        if not self._slot.done:
            self._slot.done = True
            self._conn._abandon(self._sid)

    async def __aenter__(self) -> CallStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()


class Connection:
    """One multiplexed Aether connection over ``(reader, writer)``."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        router: Router | None = None,
        dialer: bool = True,
        max_frame: int = DEFAULT_MAX_FRAME,
        name: str = "",
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._router = router
        self._loop = asyncio.get_running_loop()
        self._decoder = FrameDecoder(max_frame=max_frame)
        self._max_frame = max_frame
        self._next_sid = 1 if dialer else 2
        self._pending: dict[int, asyncio.Future[bytes] | _StreamSlot] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._wbuf: list[bytes] = []
        self._flush_scheduled = False
        self._closed = False
        self._goaway = False
        self._close_error: BaseException | None = None
        self._closed_event = asyncio.Event()
        self.name = name
        self._read_task = self._loop.create_task(self._read_loop())

    # ----------------------------------------------------------------- public API
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    async def call(
        self, method: str, body: Any = None, *, timeout: float | None = None,
        response_type: Any = None,
    ) -> Any:
        """Send one request and wait for its reply (decoded as ``response_type``)."""
        payload = encode_request(method, _encode_body(body))
        fut, sid, timer = self._start(payload, timeout, method)
        if self._wbuf_size_high():
            await self._maybe_drain()
        try:
            data = await fut
        except asyncio.CancelledError:
            self._abandon(sid)
            raise
        finally:
            if timer is not None:
                timer.cancel()
        return _decoder(response_type).decode(data)

    async def call_batch(
        self, calls: Sequence[tuple[str, Any]], *, timeout: float | None = None,
        response_type: Any = None, return_exceptions: bool = False,
    ) -> list[Any]:
        """N calls with one slot-registration pass, one write and one deadline.

        On the wire this is exactly N REQUEST frames. With ``return_exceptions`` failed
        calls appear as exception objects in the result list; otherwise the first
        failure is raised after every call has finished.
        """
        self._check_open()
        payloads = [encode_request(m, _encode_body(b)) for m, b in calls]
        loop = self._loop
        sids: list[int] = []
        futs: list[asyncio.Future[bytes]] = []
        for p in payloads:
            sid = self._next_sid
            self._next_sid += 2
            fut: asyncio.Future[bytes] = loop.create_future()
            self._pending[sid] = fut
            sids.append(sid)
            futs.append(fut)
            self._wbuf.append(encode_parts(FrameType.REQUEST, sid, p))
            self._wbuf.append(p)
        self._flush()
        timer = None
        if timeout is not None:
            timer = loop.call_later(timeout, self._expire_many, sids, timeout, "call_batch")
        try:
            await asyncio.wait(futs) if futs else None
        except asyncio.CancelledError:
            for sid in sids:
                self._abandon(sid)
            raise
        finally:
            if timer is not None:
                timer.cancel()
        out: list[Any] = []
        first: BaseException | None = None
        dec = _decoder(response_type)
        for f in futs:
            exc = f.exception()
            if exc is not None:
                if first is None:
                    first = exc
                out.append(exc)
            else:
                try:
                    out.append(dec.decode(f.result()))
                except msgspec.DecodeError as e:
                    err = RemoteProtocolError(f"undecodable reply in call_batch: {e}")
                    first = first or err
                    out.append(err)
        if first is not None and not return_exceptions:
            raise first
        return out

    def stream(
        self, method: str, body: Any = None, *, timeout: float | None = None,
        item_type: Any = None, response_type: Any = None,
    ) -> CallStream:
        """Start a streaming call; iterate the result for STREAM items."""
        self._check_open()
        payload = encode_request(method, _encode_body(body))
        sid = self._next_sid
        self._next_sid += 2
        slot = _StreamSlot(item_type)
        self._pending[sid] = slot
        self._send(FrameType.REQUEST, sid, payload, FrameFlags.STREAMING)
        timer = None
        if timeout is not None:
            timer = self._loop.call_later(timeout, self._expire_many, [sid], timeout, method)
        return CallStream(self, sid, slot, response_type, timer)

    async def ping(self, payload: bytes = b"", *, timeout: float | None = 10.0) -> bytes:
        fut, sid, timer = self._start(payload, timeout, "ping", ftype=FrameType.PING)
        try:
            return await fut
        finally:
            if timer is not None:
                timer.cancel()
            self._pending.pop(sid, None)

    async def close(self, reason: str = "closed by local side") -> None:
        """Say GOAWAY, fail what is pending, close the socket."""
        if not self._closed:
            try:
                self._send(FrameType.GOAWAY, 0, _encode_body(Goaway(reason=reason)))
                self._flush()
            except Exception:  # noqa: BLE001 - best effort on an already broken socket
                pass
            self._shutdown(ConnectionLost(f"connection {self.name or ''} closed: {reason}".replace("  ", " ")))
        await self.wait_closed()

    async def wait_closed(self) -> None:
        await self._closed_event.wait()
        if not self._read_task.done():
            await asyncio.gather(self._read_task, return_exceptions=True)

    # ---------------------------------------------------------------- internals
    def _check_open(self) -> None:
        if self._closed:
            raise self._lost_error()
        if self._goaway:
            raise ConnectionLost(f"connection {self.name} is going away; open a new one")

    def _lost_error(self) -> ConnectionLost:
        err = self._close_error
        if isinstance(err, ConnectionLost):
            return err
        return ConnectionLost(f"connection {self.name} lost: {err}" if err else "connection closed")

    def _start(
        self, payload: bytes, timeout: float | None, what: str, ftype: FrameType = FrameType.REQUEST
    ) -> tuple[asyncio.Future[bytes], int, asyncio.TimerHandle | None]:
        self._check_open()
        sid = self._next_sid
        self._next_sid += 2
        fut: asyncio.Future[bytes] = self._loop.create_future()
        self._pending[sid] = fut
        self._send(ftype, sid, payload)
        timer = None
        if timeout is not None:
            if timeout <= 0:
                raise InvalidArgument(f"request timeout must be positive, got {timeout}")
            timer = self._loop.call_later(timeout, self._expire_many, [sid], timeout, what)
        return fut, sid, timer

    def _expire_many(self, sids: list[int], timeout: float, what: str) -> None:
        for sid in sids:
            slot = self._pending.get(sid)
            if slot is None:
                continue
            err = RequestTimeout(
                f"Aether request {what!r} got no reply within its request timeout of {timeout:g}s",
                timeout_s=timeout,
            )
            if isinstance(slot, _StreamSlot):
                slot.error, slot.done = err, True
                slot.wake()
            elif not slot.done():
                slot.set_exception(err)
            self._abandon(sid)

    def _abandon(self, sid: int) -> None:
        """Forget a call we no longer wait for and tell the server to stop working on it."""
        if self._pending.pop(sid, None) is not None and not self._closed:
            self._send(FrameType.CANCEL, sid, b"")

    def _send(self, ftype: int, sid: int, payload: bytes, flags: int = 0) -> None:
        self._wbuf.append(encode_parts(ftype, sid, payload, flags))
        if payload:
            self._wbuf.append(payload)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._wbuf or self._closed:
            self._wbuf.clear()
            return
        buf, self._wbuf = self._wbuf, []
        try:
            self._writer.writelines(buf)
        except (ConnectionError, OSError, RuntimeError) as exc:
            self._shutdown(ConnectionLost(f"write on connection {self.name} failed: {exc}"))

    def _wbuf_size_high(self) -> bool:
        t = self._writer.transport
        return t is not None and t.get_write_buffer_size() > WRITE_HIGH_WATER

    async def _maybe_drain(self) -> None:
        if self._wbuf_size_high():
            self._flush()
            try:
                await self._writer.drain()
            except (ConnectionError, OSError) as exc:
                self._shutdown(ConnectionLost(f"connection {self.name} lost while writing: {exc}"))
                raise self._lost_error() from exc

    async def _read_loop(self) -> None:
        reader, dec = self._reader, self._decoder
        try:
            while True:
                data = await reader.read(READ_CHUNK)
                if not data:
                    dec.eof()
                    self._shutdown(ConnectionLost(f"connection {self.name} closed by peer"))
                    return
                dec.feed(data)
                while True:
                    frames = dec.frames(FRAMES_PER_WAKEUP)
                    for f in frames:
                        self._on_frame(f.type, f.stream_id, f.payload, f.flags)
                    self._flush()
                    if len(frames) < FRAMES_PER_WAKEUP:
                        break
                    await asyncio.sleep(0)  # let handlers and callers run between batches
                if self._wbuf_size_high():
                    await self._maybe_drain()
        except RemoteProtocolError as exc:
            log.warning("closing Aether connection %s: %s", self.name, exc)
            self._shutdown(ConnectionLost(f"connection {self.name} closed: peer sent invalid data ({exc})"))
        except (ConnectionError, OSError) as exc:
            self._shutdown(ConnectionLost(f"connection {self.name} lost: {exc}"))
        except asyncio.CancelledError:
            self._shutdown(ConnectionLost(f"connection {self.name} closed"))
            raise
        except Exception as exc:  # a bug here must not leave callers hanging
            log.exception("Aether read loop crashed on %s", self.name)
            self._shutdown(ConnectionLost(f"connection {self.name} failed internally: {exc!r}"))

    def _on_frame(self, ftype: int, sid: int, payload: bytes, flags: int) -> None:
        if ftype == FrameType.RESPONSE or ftype == FrameType.PONG:
            slot = self._pending.pop(sid, None)
            if slot is None:
                return  # reply to a call we abandoned (timeout/cancel race): drop it
            if isinstance(slot, _StreamSlot):
                slot.result, slot.done = payload, True
                slot.wake()
            elif not slot.done():
                slot.set_result(payload)
        elif ftype == FrameType.REQUEST:
            self._on_request(sid, payload, flags)
        elif ftype == FrameType.STREAM:
            slot = self._pending.get(sid)
            if isinstance(slot, _StreamSlot):
                slot.items.append(payload)
                slot.wake()
        elif ftype == FrameType.ERROR:
            slot = self._pending.pop(sid, None)
            if slot is None:
                return
            try:
                eb = _decoder(ErrorBody).decode(payload)
                err: BaseException = error_from_wire(eb.code, eb.message, eb.detail)
            except msgspec.DecodeError as exc:
                err = RemoteProtocolError(f"undecodable ERROR body on stream {sid}: {exc}")
            if isinstance(slot, _StreamSlot):
                slot.error, slot.done = err, True
                slot.wake()
            elif not slot.done():
                slot.set_exception(err)
        elif ftype == FrameType.CANCEL:
            task = self._tasks.pop(sid, None)
            if task is not None:
                task.cancel()
        elif ftype == FrameType.PING:
            self._send(FrameType.PONG, sid, payload)
        elif ftype == FrameType.GOAWAY:
            self._goaway = True

    def _on_request(self, sid: int, payload: bytes, flags: int) -> None:
        try:
            method, raw = decode_request(payload)
        except RemoteProtocolError as exc:
            self._reply_error(sid, exc)
            return
        route = self._router.get(method) if self._router is not None else None
        if route is None:
            self._reply_error(sid, UnknownMethod(f"unknown Aether method {method!r}", method=method))
            return
        try:
            body = _decoder(route.request_type).decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._reply_error(sid, InvalidArgument(f"bad body for {method!r}: {exc}", method=method))
            return
        if route.streaming != bool(flags & FrameFlags.STREAMING):
            how = "conn.stream()" if route.streaming else "conn.call()"
            self._reply_error(sid, InvalidArgument(f"method {method!r} must be called with {how}"))
            return
        if not route.is_async:
            try:
                result = route.handler(body)
            except Exception as exc:
                self._reply_handler_error(sid, method, exc)
                return
            self._reply(sid, result)
            return
        args = (body, StreamSender(self, sid)) if route.streaming else (body,)
        task = self._loop.create_task(self._run_handler(sid, method, route.handler(*args)))
        self._tasks[sid] = task

    async def _run_handler(self, sid: int, method: str, coro: Awaitable[Any]) -> None:
        try:
            result = await coro
        except asyncio.CancelledError:
            self._tasks.pop(sid, None)
            if not self._closed:
                raise
            return
        except Exception as exc:
            self._tasks.pop(sid, None)
            self._reply_handler_error(sid, method, exc)
            return
        if self._tasks.pop(sid, None) is not None:
            self._reply(sid, result)

    def _reply(self, sid: int, result: Any) -> None:
        try:
            data = _encode_body(result)
        except LocalProtocolError as exc:
            self._reply_error(sid, exc)
            return
        if len(data) > self._max_frame:
            self._reply_error(sid, LocalProtocolError(
                f"reply of {len(data)} bytes exceeds the {self._max_frame}-byte frame limit"))
            return
        self._send(FrameType.RESPONSE, sid, data)

    def _reply_handler_error(self, sid: int, method: str, exc: Exception) -> None:
        if not isinstance(exc, DsecError):
            log.error("handler for %r raised", method, exc_info=exc)
        self._reply_error(sid, exc)

    def _reply_error(self, sid: int, exc: BaseException) -> None:
        self._send(FrameType.ERROR, sid, _encode_body(error_body(exc)))

    def _shutdown(self, err: BaseException) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_error = err
        pending, self._pending = self._pending, {}
        for slot in pending.values():
            if isinstance(slot, _StreamSlot):
                if not slot.done:
                    slot.error, slot.done = err, True
                    slot.wake()
            elif not slot.done():
                slot.set_exception(err)
        tasks, self._tasks = self._tasks, {}
        for t in tasks.values():
            t.cancel()
        try:
            if self._wbuf:
                self._writer.writelines(self._wbuf)
            self._wbuf.clear()
            self._writer.close()
        except Exception:  # noqa: BLE001 - socket already gone
            pass
        self._closed_event.set()
        current = asyncio.current_task()
        if current is not self._read_task and not self._read_task.done():
            self._read_task.cancel()

