"""Aether connections: request/response multiplexing over an asyncio transport.

The thin asyncio shell around :mod:`dsec.aether.frame`. One :class:`Connection` can both
call and serve: calls it initiates use odd stream ids on the dialing side and even ids on
the accepting side, so the two directions never collide. A connection is built either
over any asyncio stream pair (``Connection(reader, writer)``, bytes pumped by one task) or,
by :func:`dsec.aether.transport.connect`/``serve``, straight on a transport through
:class:`AetherProtocol` (bytes handed over in ``data_received``, no pump task). Both share
everything below the byte source.

The rules of the conversation - stream-id parity and order, which calls are pending, the
authentication gate, GOAWAY - are decided by :class:`dsec.aether.state.ConnectionState`,
which does no I/O and is tested on its own under hypothesis; this module keeps what needs
the event loop: futures and call slots, handler tasks, write corking, read pausing and
flow control, timers, listener budgets (measured: within 1% of rpc_cpu_us before it).

Performance notes (measured on the 2-core dev VM with the bench suite ``protocol``).
CPU per no-op call, both ends in one process (``rpc_cpu_us``), before -> after the
changes below: one at a time 21.0 -> 13.4 us, 64 pipelined 7.4 -> 3.9 us, call_batch(64)
7.2 -> 2.9 us.
- Reading in ``Protocol.data_received`` instead of a task awaiting ``StreamReader.read``
  saves a future, a task wakeup and a buffer copy per read.
- Writes are corked: every frame produced while handling one read wakeup (or queued by
  many tasks in one loop iteration) goes out in one ``write``; small frames are joined
  into one bytes object (uvloop then takes its single-buffer ``write(2)`` fast path),
  large ones go out with ``writelines`` so payloads are never copied.
- Synchronous handlers run inline in the read path; only ``async def`` handlers cost a
  task. A per-request task was ~40% of a no-op round trip.
- The read path handles frames as plain tuples and dispatches on ints, never building
  ``Frame`` objects or enum members; ``call_batch`` waits on one future for all its slots
  instead of ``asyncio.wait`` over N futures.
- Call timeouts use one ``loop.call_later`` handle per call (one per batch) instead of
  ``asyncio.wait_for``, which allocates a task per call.
- What is left per call is interpreter work spread thin (struct + two zlib.crc32 calls per
  frame ~0.5 us each way, the call coroutine, the future, msgspec); the next step would be
  a compiled codec and slot table, not more I/O changes.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import functools
import inspect
import logging
import zlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self

import msgspec

from dsec.aether.frame import (
    _CRC,
    _HEAD,
    DEFAULT_MAX_FRAME,
    MAGIC,
    MAX_FRAME_LIMIT,
    VERSION,
    FrameDecoder,
    FrameFlags,
    FrameType,
    encode_parts,
)
from dsec.aether.limits import ListenerStats, ProcessBudget, ServerLimits
from dsec.aether.messages import ErrorBody, error_body, method_prefix
from dsec.aether.state import (
    AUTH_METHOD,
    ConnectionState,
    DuplexFlow,
    Side,
    Verdict,
    decode_window,
    encode_window,
)
from dsec.errors import (
    ConnectionLost,
    DsecError,
    InternalError,
    InvalidArgument,
    LocalProtocolError,
    Overloaded,
    PayloadTooLarge,
    RemoteProtocolError,
    RequestTimeout,
    ResourceExhausted,
    StreamReset,
    Unauthenticated,
    UnknownMethod,
    error_from_wire,
)
from dsec.wire.outcome import undecodable

__all__ = ["AUTH_METHOD", "AetherProtocol", "CallStream", "Connection", "DuplexStream", "Guard",
           "Router", "StreamSender", "after_reply_written", "current_peer"]

# AUTH_METHOD (from dsec.aether.state): the method a peer calls first on an endpoint whose
# Router has a token (body: the token as msgpack bin). Edges listening on TCP require it;
# their Unix sockets are root-only.

log = logging.getLogger("dsec.aether")

FRAMES_PER_WAKEUP = 64          # frames handled before other tasks get a turn
READ_CHUNK = 256 * 1024         # StreamReader.read size for stream-pair connections
WRITE_HIGH_WATER = 4 * 1024 * 1024   # callers wait (and servers stop reading) above this
WRITE_LOW_WATER = 1 * 1024 * 1024
READ_HIGH_WATER = 4 * 1024 * 1024    # undigested input bytes before reading pauses
_JOIN_LIMIT = 64 * 1024         # corked output up to this size is joined into one write
CLOSE_LINGER = 1.0              # seconds a closed socket may take to flush before it is reset
# Bytes of STREAM items a streaming call may hold unread before it is cancelled. Aether has
# no per-stream flow control (the connection is read for every call on it), so without
# this a gateway client that never read its exec_stream made the apiserver hold the
# whole output (600 MB for one `head -c 600M /dev/zero`, output cap up to 1 GiB).
STREAM_BACKLOG_MAX = 16 * 1024 * 1024
# On a listener with max_calls_in_flight: the peer's duplex streams served at once per
# connection are at most that cap // MAX_DUPLEX_SHARE (1,024 -> 64). Each holds at most
# one credit window (256 KiB) of input, so 64 are <= 16 MiB per connection.
MAX_DUPLEX_SHARE = 16
# ... and all streaming calls of one connection together (the largest backlog goes first).
STREAMS_BACKLOG_MAX = 64 * 1024 * 1024
# Credit of one server-push stream whose caller grants it (FrameFlags.CREDIT on the
# REQUEST; WINDOW frames on the call's stream id as its reader takes items, batched per
# quarter window). The sender waits at zero, so a reader that falls behind holds at most
# this (plus one item) and stops its own producer - never the link, never another
# stream. Without it six `head -c 400M /dev/zero` exec_streams, read at full speed over
# REST, outran the apiserver's loop and were cancelled 16 MiB behind (or, with the
# unflushed bytes not counted, made the edge cut the shared link). 4 MiB: below the
# 16 MiB per-stream cut with room for one 1 MiB item; throughput measured in the report
# of branch fixlink (exec_stream 400 MB over REST: no loss against no credit).
STREAM_WINDOW = 4 * 1024 * 1024
# Bytes of our replies a listener's peer may leave unread before it is cut:
# ServerLimits.unread_replies_max (64 MiB; edges: none, they park replies instead).
# Replies up to this size are written at once even while the link's write buffer is over
# its high-water mark; larger ones wait their turn in order (Connection._park): a
# 16-byte exec result must not queue behind 190 MB of another tenant's file reads.
PARK_MIN = 64 * 1024
# Write buffer marks of a connection that has not authenticated yet: its replies are
# small ERROR/PONG frames; a peer that does not read them stops being read far sooner.
PENDING_WRITE_HIGH = 64 * 1024
PENDING_WRITE_LOW = 16 * 1024
# Connections of a process closed on a listener limit that may linger (each holding its
# fd for up to CLOSE_LINGER) so their GOAWAY is read; beyond that they close at once.
MAX_LINGERING = 256

# Frame types as plain ints: comparing against IntEnum members costs an attribute lookup
# on the enum class per frame.
_REQUEST = int(FrameType.REQUEST)
_RESPONSE = int(FrameType.RESPONSE)
_ERROR = int(FrameType.ERROR)
_STREAM = int(FrameType.STREAM)
_CANCEL = int(FrameType.CANCEL)
_PING = int(FrameType.PING)
_PONG = int(FrameType.PONG)
_GOAWAY = int(FrameType.GOAWAY)
_WINDOW = int(FrameType.WINDOW)
_STREAMING = int(FrameFlags.STREAMING)
_DUPLEX = int(FrameFlags.DUPLEX)
_FIN = int(FrameFlags.FIN)
_CREDIT = int(FrameFlags.CREDIT)
_CALL_KIND = _STREAMING | _DUPLEX   # the REQUEST flags that must match the route's kind

# Why reading is paused (bit mask): too much undigested input, or too much unsent output
# while this side waits for nothing from the peer (see _on_write_paused).
_PAUSE_INPUT = 1
_PAUSE_OUTPUT = 2

_NIL = b"\xc0"
_crc32 = zlib.crc32
_encoder = msgspec.msgpack.Encoder()
_ANY = msgspec.msgpack.Decoder()
_ERROR_DECODER = msgspec.msgpack.Decoder(ErrorBody)
_DISPATCH, _DROP, _BAD_METHOD, _AUTH = (
    Verdict.DISPATCH, Verdict.DROP, Verdict.BAD_METHOD, Verdict.AUTH)
_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}
_prefixes: dict[str, bytes] = {}
_PREFIX_CACHE_MAX = 4096


def _decoder(tp: Any) -> msgspec.msgpack.Decoder[Any]:
    if tp is None:
        return _ANY
    d = _decoders.get(tp)
    if d is None:
        d = _decoders[tp] = msgspec.msgpack.Decoder(tp)
    return d


def _prefix(method: str) -> bytes:
    p = _prefixes.get(method)
    if p is None:
        p = method_prefix(method)
        if len(_prefixes) < _PREFIX_CACHE_MAX:
            _prefixes[method] = p
    return p


def _encode_body(body: Any) -> bytes:
    if body is None:
        return _NIL
    try:
        return _encoder.encode(body)
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalProtocolError(
            f"cannot encode message body of type {type(body).__name__}: {exc}") from exc


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and not timeout > 0:
        raise InvalidArgument(
            f"request timeout must be a positive number of seconds or None, got {timeout!r}")


# --------------------------------------------------------------------------- routing
@dataclass(slots=True, frozen=True)
class _Route:
    method: str
    handler: Callable[..., Any]
    request_type: Any
    decoder: msgspec.msgpack.Decoder[Any]
    is_async: bool
    streaming: bool
    with_context: bool
    duplex: bool
    kind: int           # the REQUEST flags (& _CALL_KIND) this route is called with


#: Checks the credential a peer sent with AUTH_METHOD; ``peer`` is its address key
#: (``ip`` or ``uid:N``; "" when unknown). Returns to accept, raises a DsecError
#: (Unauthenticated, RateLimited, ...) to refuse; the connection is then closed.
#: What it returns is the connection's *context* (:attr:`Connection.auth_context`), handed
#: to every handler registered ``with_context=True``: the credential is checked once per
#: connection and the handlers see who it belongs to (e.g. the gateway's API key session)
#: without it riding in every body.
Authenticator = Callable[[bytes, str], object]


class Router:
    """Method name -> handler. Handlers take the decoded body (and a StreamSender when
    ``streaming``) and return a msgpack-able result; sync handlers run inline in the read
    path, so they must not block. A handler added ``with_context=True`` takes the
    connection's context first: ``handler(ctx, body[, sender])``, ``ctx`` being what the
    authenticator returned (None on a token or open endpoint).

    A body that fails its type's validation (``__post_init__`` raising a
    :class:`~dsec.errors.DsecError`) is refused with that error itself (class, message and
    detail), not a generic decode failure: the same words a caller gets from any door.

    Authentication (per connection, before any method): ``token`` (a shared secret,
    compared in constant time) or ``authenticate`` (a callable that checks the
    credential, e.g. an API key); ``credential`` names it in error messages."""

    def __init__(self, *, token: bytes | str | None = None,
                 authenticate: Authenticator | None = None,
                 credential: str = "token") -> None:
        if token is not None and authenticate is not None:
            raise InvalidArgument("a Router takes a token or an authenticate callable, not both")
        self._routes: dict[str, _Route] = {}
        # Keyed by the raw REQUEST prefix (u8 length + ascii name) so the read path finds
        # the route without decoding the method name.
        self._by_prefix: dict[bytes, _Route] = {}
        # With a token (or authenticator), each connection must first call AUTH_METHOD;
        # until then every other request is refused (see Connection._on_unauthenticated).
        self.token: bytes | None = token.encode() if isinstance(token, str) else token
        self.authenticate = authenticate
        self.credential = credential

    @property
    def requires_auth(self) -> bool:
        return self.token is not None or self.authenticate is not None

    def add(
        self,
        method: str,
        handler: Callable[..., Any],
        *,
        request_type: Any = None,
        streaming: bool = False,
        with_context: bool = False,
        duplex: bool = False,
    ) -> None:
        """Serve ``method``. ``streaming``: the handler also takes a :class:`StreamSender`;
        ``duplex``: it takes a :class:`DuplexStream` (raw bytes both ways under per-stream
        credit, see docs/aether.md) and its return value ends the call."""
        if method in self._routes:
            raise InvalidArgument(f"Aether method {method!r} is already registered")
        try:
            prefix = method_prefix(method)
        except LocalProtocolError as exc:
            raise InvalidArgument(str(exc)) from exc
        is_async = inspect.iscoroutinefunction(handler)
        if streaming and duplex:
            raise InvalidArgument(f"handler for {method!r} is streaming or duplex, not both")
        if (streaming or duplex) and not is_async:
            kind = "streaming" if streaming else "duplex"
            raise InvalidArgument(f"{kind} handler for {method!r} must be an async def")
        decoder = msgspec.msgpack.Decoder(request_type) if request_type is not None else _ANY
        route = _Route(method, handler, request_type, decoder, is_async, streaming,
                       with_context, duplex,
                       _STREAMING if streaming else _DUPLEX if duplex else 0)
        self._routes[method] = route
        self._by_prefix[prefix] = route

    def route(
        self, method: str, *, request_type: Any = None, streaming: bool = False,
        with_context: bool = False, duplex: bool = False,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.add(method, fn, request_type=request_type, streaming=streaming,
                     with_context=with_context, duplex=duplex)
            return fn
        return deco

    def get(self, method: str) -> _Route | None:
        return self._routes.get(method)

    @property
    def methods(self) -> list[str]:
        return sorted(self._routes)


# ------------------------------------------------------------------------ the peer
# The connection serving the request a handler runs for (None outside a handler).
_PEER: contextvars.ContextVar[Connection | None] = contextvars.ContextVar("dsec_aether_peer",
                                                                        default=None)


def current_peer() -> str | None:
    """Who sent the request a handler is serving: :attr:`Connection.peer`, the address
    key the listener counts it by (the IP over TCP, ``uid:<n>`` over a Unix socket),
    None where unknown (a connection not accepted by a listener) or outside a handler.
    Per-client limits (the gateway's budget for failed API keys) key on it, so one
    peer's flood does not spend everybody's budget."""
    conn = _PEER.get()
    return None if conn is None else conn.peer or None


def after_reply_written(callback: Callable[[], None]) -> None:
    """Call ``callback`` once the reply of the async handler running now has left this
    process's write buffer for the most part (written, and the connection's write buffer
    not paused above its high-water mark), or at once when the handler ends without a
    reply to write (an error, a cancel, the connection gone). Outside an async handler of
    a served call: at once. What a handler holds for its reply (the apiserver's per-tenant
    budget of reply bytes) is given back here, not when the handler returns: a peer that
    does not read its replies keeps them charged."""
    conn = _PEER.get()
    task = None if conn is None else asyncio.current_task()
    if conn is None or task is None or conn._closed:
        callback()
        return
    hooks = conn._reply_hooks.get(task)
    if hooks is None:
        hooks = conn._reply_hooks[task] = []
        # After the handler's own _handler_done (done callbacks run in order), which
        # takes them; a task the handler started (it inherits the context) is no
        # handler: its hooks run when it ends.
        task.add_done_callback(conn._task_hooks_left)
    hooks.append(callback)


def _run_hooks(hooks: list[Callable[[], None]]) -> None:
    for h in hooks:
        try:
            h()
        except Exception:  # one hook's bug must not stop the others
            log.exception("after_reply_written callback %r failed", h)


# --------------------------------------------------------------------- call slots
class _Slot:
    """A pending call that is not a plain future (batches and streams)."""

    __slots__ = ()

    def ok(self, sid: int, payload: bytes) -> None:
        raise NotImplementedError

    def fail(self, sid: int, exc: BaseException) -> None:
        raise NotImplementedError


class _Batch(_Slot):
    """All calls of one call_batch: one future, completed when the last reply is in."""

    __slots__ = ("first", "fut", "n", "remaining", "results")

    def __init__(self, first: int, n: int, fut: asyncio.Future[None]) -> None:
        self.first = first
        self.n = n
        self.results: list[Any] = [None] * n
        self.remaining = n
        self.fut = fut

    def ok(self, sid: int, payload: bytes | BaseException) -> None:
        self.results[(sid - self.first) >> 1] = payload
        self.remaining -= 1
        if not self.remaining and not self.fut.done():
            self.fut.set_result(None)

    fail = ok  # type: ignore[assignment]  # an exception object is stored like a reply

    def sids(self) -> range:
        return range(self.first, self.first + 2 * self.n, 2)


class _StreamSlot(_Slot):
    __slots__ = ("backlog", "done", "error", "items", "result", "taken", "waiter")

    def __init__(self) -> None:
        self.items: collections.deque[bytes] = collections.deque()
        self.backlog = 0     # bytes of items received and not yet taken by the reader
        self.taken = 0       # bytes taken by the reader not yet given back as credit
        self.waiter: asyncio.Future[None] | None = None
        self.done = False
        self.result: bytes | None = None
        self.error: BaseException | None = None

    def item(self, payload: bytes) -> None:
        self.items.append(payload)
        self.backlog += len(payload)
        self._wake()

    def ok(self, sid: int, payload: bytes) -> None:
        if not self.done:
            self.result, self.done = payload, True
            self._wake()

    def fail(self, sid: int, exc: BaseException) -> None:
        if not self.done:
            self.error, self.done = exc, True
            self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


def _resolve(slot: asyncio.Future[bytes] | _Slot, sid: int, payload: bytes) -> None:
    if isinstance(slot, _Slot):
        slot.ok(sid, payload)
    elif not slot.done():
        slot.set_result(payload)


def _reject(slot: asyncio.Future[bytes] | _Slot, sid: int, exc: BaseException) -> None:
    if isinstance(slot, _Slot):
        slot.fail(sid, exc)
    elif not slot.done():
        slot.set_exception(exc)


class _SendCredit:
    """What a server-push stream may still send before the caller's next WINDOW."""

    __slots__ = ("credit", "waiter")

    def __init__(self, credit: int) -> None:
        self.credit = credit
        self.waiter: asyncio.Future[None] | None = None

    def grant(self, increment: int) -> None:
        self.credit += increment
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


class StreamSender:
    """Given to streaming handlers: ``await stream.send(item)`` pushes a STREAM frame
    (waiting for the caller's credit when it grants some, and for the link's buffer)."""

    __slots__ = ("_conn", "_credit", "_sid")

    def __init__(self, conn: Connection, sid: int, credit: _SendCredit | None = None) -> None:
        self._conn = conn
        self._sid = sid
        self._credit = credit

    async def send(self, item: Any) -> None:
        conn = self._conn
        if conn._closed:
            raise conn._lost_error()
        data = _encode_body(item)
        if len(data) > conn._max_frame:
            raise PayloadTooLarge(
                f"stream item of {len(data)} bytes exceeds the connection's max_frame of "
                f"{conn._max_frame} bytes; send it in smaller pieces", size=len(data))
        credit = self._credit
        if credit is not None:
            # The caller grants credit per stream (WINDOW frames as its reader takes
            # items): wait for it, so a slow reader stops this producer only, never the
            # link. One item may overdraw the credit (items are not split).
            while credit.credit <= 0:
                if conn._closed:
                    raise conn._lost_error()
                w = credit.waiter = conn._loop.create_future()
                try:
                    await w
                finally:
                    credit.waiter = None
            credit.credit -= len(data)
        conn._send(_STREAM, self._sid, data)
        if conn._wbytes + conn._transport.get_write_buffer_size() > WRITE_HIGH_WATER:
            await conn._drain()


class CallStream:
    """Async iterator over a streaming call's items; ``result`` holds the final reply."""

    def __init__(
        self, conn: Connection, sid: int, slot: _StreamSlot, item_type: Any,
        response_type: Any, timer: asyncio.TimerHandle | None, method: str,
    ) -> None:
        self._conn, self._sid, self._slot = conn, sid, slot
        self._item_decoder = _decoder(item_type)
        self._response_type = response_type
        self._timer = timer
        self._method = method
        self.result: Any = None

    def __aiter__(self) -> CallStream:
        return self

    async def __anext__(self) -> Any:
        slot = self._slot
        while True:
            if slot.items:
                raw = slot.items.popleft()
                slot.backlog -= len(raw)
                conn = self._conn
                conn._stream_backlog -= len(raw)
                slot.taken += len(raw)
                if slot.taken >= STREAM_WINDOW // 4 and not slot.done and not conn._closed:
                    # credit back for what the reader took (the server waits at zero)
                    conn._send(_WINDOW, self._sid, encode_window(slot.taken))
                    slot.taken = 0
                try:
                    return self._item_decoder.decode(raw)
                except msgspec.DecodeError as exc:
                    self.cancel()
                    raise RemoteProtocolError(
                        f"stream item of {self._method!r} does not decode: {exc}") from exc
            if slot.done:
                self._finish()
                if slot.error is not None:
                    raise slot.error
                self.result = _decode_reply(slot.result or _NIL, self._response_type,
                                            self._method)
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
        """Stop the call: a CANCEL frame goes out and the server's handler is cancelled."""
        self._finish()
        slot = self._slot
        if slot.backlog:
            self._conn._stream_backlog -= slot.backlog
            slot.backlog = 0
            slot.items.clear()
        if not self._slot.done:
            self._slot.done = True
            self._conn._abandon(self._sid)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()


class DuplexStream(_Slot):
    """One duplex stream, at either end: raw bytes both ways on one stream id.

    The caller gets it from :meth:`Connection.duplex`, the server's handler (registered
    ``duplex=True``) as its last argument. Each direction has its own credit
    (:class:`~dsec.aether.state.DuplexFlow`): :meth:`send` waits while the peer has granted
    nothing, and the reader's :meth:`recv` grants credit back as it takes bytes. The
    connection keeps reading for every other stream meanwhile, so a slow reader only ever
    stops its own stream's sender, and at most one window per stream is buffered.

    - :meth:`close_write` half-closes this side (FIN): the peer's :meth:`recv` then
      answers ``b""`` once it has read everything; the other direction carries on.
    - The server's handler returning ends the call (RESPONSE, read by the caller's
      :meth:`result`); it implies its FIN, and whatever the caller still sends is dropped.
    - :meth:`reset` (either side) aborts: the caller sends CANCEL (the server's handler is
      cancelled), the server's handler raising answers ERROR; a pending :meth:`recv` or
      :meth:`send` on the other end raises :class:`~dsec.errors.StreamReset` (or the
      handler's error). The connection and its other streams are unaffected.
    """

    __slots__ = ("_caller", "_chunks", "_conn", "_done", "_error", "_final", "_final_waiter",
                 "_flow", "_response_type", "_rwaiter", "_swaiter", "_timer", "method", "sid")

    def __init__(self, conn: Connection, sid: int, method: str, *, caller: bool,
                 response_type: Any = None) -> None:
        self._conn = conn
        self.sid = sid
        self.method = method
        self._caller = caller
        self._flow = DuplexFlow(sid)
        self._chunks: collections.deque[bytes] = collections.deque()
        self._rwaiter: asyncio.Future[None] | None = None
        self._swaiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None      # reset: both directions raise it
        self._done = False                            # the call is over (reply or reset)
        self._final: bytes | None = None              # the caller's RESPONSE payload
        self._final_waiter: asyncio.Future[None] | None = None
        self._response_type = response_type
        self._timer: asyncio.TimerHandle | None = None

    # -------------------------------------------------------------- writing
    async def send(self, data: bytes | bytearray | memoryview) -> None:
        """Send ``data`` in order, waiting for the peer's credit as needed (pieces of at
        most 64 KiB). Raises StreamReset after a reset, LocalProtocolError after
        :meth:`close_write`, ConnectionLost when the connection is gone."""
        conn = self._conn
        flow = self._flow
        view = memoryview(data)
        total = len(view)
        off = 0
        while off < total:
            if self._error is not None:
                raise self._error
            if conn._closed:
                raise conn._lost_error()
            if self._done:
                raise StreamReset(
                    f"duplex stream {self.sid} ({self.method!r}) on connection {conn.name} "
                    "is over (the call was answered): nothing more can be sent")
            n = flow.sendable(total - off)
            if not n:
                w = self._swaiter = conn._loop.create_future()
                try:
                    await w
                finally:
                    self._swaiter = None
                continue
            flow.sent(n)
            conn._send(_STREAM, self.sid, bytes(view[off : off + n]))
            off += n
            if conn._wbytes + conn._transport.get_write_buffer_size() > WRITE_HIGH_WATER:
                await conn._drain()

    def close_write(self) -> None:
        """Half-close: tell the peer this side sends nothing more (STREAM with FIN).
        Idempotent; a no-op once the call is over."""
        if self._done or self._error is not None or not self._flow.can_send:
            return
        self._flow.send_fin()
        if not self._conn._closed:
            self._conn._send(_STREAM, self.sid, b"", _FIN)

    # -------------------------------------------------------------- reading
    async def recv(self, max_bytes: int | None = None) -> bytes:
        """The next bytes from the peer (at most ``max_bytes``), ``b""`` once it has
        half-closed (or the call ended) and everything was read. Raises StreamReset (or
        the call's error) after a reset."""
        conn = self._conn
        chunks = self._chunks
        while True:
            if chunks:
                chunk = chunks.popleft()
                if max_bytes is not None and len(chunk) > max_bytes > 0:
                    chunks.appendleft(chunk[max_bytes:])
                    chunk = chunk[:max_bytes]
                self._consumed(len(chunk))
                return chunk
            if self._error is not None:
                raise self._error
            if not self._flow.can_receive:
                return b""
            if conn._closed:
                raise conn._lost_error()
            w = self._rwaiter = conn._loop.create_future()
            try:
                await w
            finally:
                self._rwaiter = None

    def __aiter__(self) -> DuplexStream:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self.recv()
        if not chunk:
            raise StopAsyncIteration
        return chunk

    def _consumed(self, n: int) -> None:
        grant = self._flow.consumed(n)
        conn = self._conn
        if grant and not self._done and not conn._closed:
            conn._send(_WINDOW, self.sid, encode_window(grant))

    # ------------------------------------------------------------ the call
    @property
    def unread(self) -> int:
        """Bytes received and not yet read (at most the window)."""
        return self._flow.unread

    @property
    def done(self) -> bool:
        return self._done

    async def result(self) -> Any:
        """The caller's end: wait for the server's reply (decoded as ``response_type``);
        raises the call's error. Reading what the server sent before it is still possible."""
        if not self._caller:
            raise InvalidArgument("result() is the caller's; a duplex handler returns its reply")
        while not self._done:
            w = self._final_waiter = self._conn._loop.create_future()
            try:
                await w
            except asyncio.CancelledError:
                self.reset()
                raise
            finally:
                self._final_waiter = None
        if self._final is None:
            assert self._error is not None
            raise self._error
        return _decode_reply(self._final, self._response_type, self.method)

    def reset(self, reason: str = "reset by this side") -> None:
        """Abort the stream: the caller sends CANCEL (the server's handler is cancelled);
        on the server's side, the handler should raise (its ERROR ends the call)."""
        if self._done:
            return
        if self._caller:
            self._finish_timer()
            self._conn._abandon(self.sid)
        self._on_reset(StreamReset(
            f"duplex stream {self.sid} ({self.method!r}) was {reason}"))

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._caller:
            self.reset("left unfinished by its caller")

    # --------------------------------------------- frames (from the Connection)
    def _on_data(self, payload: bytes, flags: int) -> None:
        self._flow.on_data(len(payload), bool(flags & _FIN))   # RemoteProtocolError: cut
        if payload:
            self._chunks.append(payload)
        self._wake_reader()

    def _on_window(self, increment: int) -> None:
        self._flow.on_window(increment)
        w = self._swaiter
        if w is not None and not w.done():
            w.set_result(None)

    def _wake_reader(self) -> None:
        w = self._rwaiter
        if w is not None and not w.done():
            w.set_result(None)

    def _wake_all(self) -> None:
        self._wake_reader()
        for w in (self._swaiter, self._final_waiter):
            if w is not None and not w.done():
                w.set_result(None)

    def _finish_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_end(self) -> None:
        """The call is over without error: what was received can still be read."""
        if self._done:
            return
        self._done = True
        self._flow.end()
        self._conn._duplex.pop(self.sid, None)
        self._finish_timer()
        self._wake_all()

    def _on_reset(self, exc: BaseException) -> None:
        if self._done:
            return
        self._done = True
        self._error = exc
        self._flow.end()
        self._chunks.clear()
        self._conn._duplex.pop(self.sid, None)
        self._finish_timer()
        self._wake_all()

    # _Slot: the caller's pending entry (RESPONSE / ERROR / timeout / connection gone)
    def ok(self, sid: int, payload: bytes) -> None:
        if not self._done:
            self._final = payload
            self._on_end()

    def fail(self, sid: int, exc: BaseException) -> None:
        self._on_reset(exc)


def _decode_reply(data: bytes, response_type: Any, method: str) -> Any:
    try:
        return _decoder(response_type).decode(data)
    except msgspec.DecodeError as exc:
        want = "msgpack" if response_type is None else getattr(
            response_type, "__name__", repr(response_type))
        raise RemoteProtocolError(
            f"reply to Aether method {method!r} does not decode as {want}: {exc}") from exc


# ---------------------------------------------------------------------- connection
@dataclass(slots=True, eq=False)
class Guard:
    """What a listener imposes on a connection it accepted (see :mod:`dsec.aether.limits`):
    its limits, the process budget its buffered bytes count against, its counters, the
    peer's address key and what to call once it authenticates."""

    limits: ServerLimits
    budget: ProcessBudget
    stats: ListenerStats
    peer: str
    on_established: Callable[[Connection], None]


#: late frames (for ended streams) a listener's peer may send per call before it is cut
#: off; see Connection.limit_late_frames
LATE_FRAMES_PER_CALL = 1024


class Connection:
    """One multiplexed Aether connection.

    ``Connection(reader, writer)`` runs over any asyncio stream pair; ``connect()`` and
    ``serve()`` build the faster transport-level variant (same behaviour).
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        router: Router | None = None,
        dialer: bool = True,
        max_frame: int = DEFAULT_MAX_FRAME,
        name: str = "",
        guard: Guard | None = None,
    ) -> None:
        transport = writer.transport
        self._setup(transport, router, dialer, max_frame, name, guard)  # type: ignore[arg-type]
        self._writer: asyncio.StreamWriter | None = writer
        self._protocol: AetherProtocol | None = None
        self._pump: asyncio.Task[None] | None = self._loop.create_task(self._pump_reader(reader))

    @classmethod
    def _over_transport(
        cls, transport: asyncio.Transport, protocol: AetherProtocol, *,
        router: Router | None, dialer: bool, max_frame: int, name: str,
        guard: Guard | None = None,
    ) -> Connection:
        self = cls.__new__(cls)
        self._setup(transport, router, dialer, max_frame, name, guard)
        self._writer = None
        self._protocol = protocol
        self._pump = None
        return self

    def _setup(
        self, transport: asyncio.Transport, router: Router | None, dialer: bool,
        max_frame: int, name: str, guard: Guard | None = None,
    ) -> None:
        if not 0 < max_frame <= MAX_FRAME_LIMIT:
            raise InvalidArgument(f"max_frame must be 1..{MAX_FRAME_LIMIT} bytes, got {max_frame}")
        self._loop = asyncio.get_running_loop()
        self._transport = transport
        self._router = router
        self._routes: dict[bytes, _Route] = router._by_prefix if router is not None else {}
        self._token = router.token if router is not None else None
        self._auth_required = router is not None and router.requires_auth
        # The stream rules (ids, pending calls, auth gate, GOAWAY) live in a sans-IO
        # state object; _pending is its pending table (one dict: the hot paths index it).
        self._state: ConnectionState[asyncio.Future[bytes] | _Slot] = ConnectionState(
            Side.DIALER if dialer else Side.ACCEPTOR, auth_required=self._auth_required)
        self._pending = self._state.pending
        self._auth_context: object = None   # what the router's authenticator returned
        self._decoder = FrameDecoder(max_frame=max_frame)
        # Listener limits (None on dialed connections and plain stream pairs): until it
        # is established (authenticated, or a first frame on a no-token endpoint) a
        # connection gets small frames and buffers, and a deadline; see _watch.
        self._guard = guard
        self._established = guard is None
        self._read_high = READ_HIGH_WATER
        self._write_high = WRITE_HIGH_WATER
        self._held = 0                      # bytes counted in guard.budget.buffered
        self._stream_backlog = 0            # unread STREAM bytes of all our streaming calls
        # Async handlers of the peer's calls allowed at once (None: no cap); at the cap
        # (_calls_full) frames are not handled until one finishes (see _on_request).
        self._max_calls = guard.limits.max_calls_in_flight if guard is not None else None
        self._calls_full = False
        # The peer's duplex streams being served. They do not count toward _max_calls: a
        # duplex handler waits for the peer's frames, which a connection paused at the
        # cap would never read (every stream of a client at the cap stalled for good).
        # Capped on their own instead: one more is refused at once, reading goes on.
        self._served_duplex: set[int] = set()    # their stream ids
        # The peer's streaming calls being served whose caller grants credit, by stream id.
        self._push_credit: dict[int, _SendCredit] = {}
        # Large replies waiting for the write buffer to fall below high water (_park).
        self._parked: collections.deque[tuple[int, bytes]] = collections.deque()
        self._parked_bytes = 0
        # after_reply_written callbacks: of a handler still running (by its task), of a
        # parked reply (by stream id), of replies written while writing is paused.
        self._reply_hooks: dict[asyncio.Task[Any], list[Callable[[], None]]] = {}
        self._parked_hooks: dict[int, list[Callable[[], None]]] = {}
        self._written_hooks: list[Callable[[], None]] = []
        # The transport's write marks are at 0 until its buffer is empty, for the
        # written hooks (_check_written); _write_low is what they go back to.
        self._drain_watch = False
        self._write_low = WRITE_LOW_WATER
        self._unparker: asyncio.Task[None] | None = None
        self._max_duplex = (None if self._max_calls is None
                            else max(1, self._max_calls // MAX_DUPLEX_SHARE))
        self._opened_at = 0.0               # loop time the listener accepted it
        self._last_rx = 0.0                 # loop time of the last bytes received
        self._partial_since: float | None = None
        self._watch_at = float("inf")
        self._watch_handle: asyncio.TimerHandle | None = None
        self._goaway_error: DsecError | None = None
        self._lingering = False             # closed by us, draining the peer (see _shutdown)
        self._max_frame = max_frame
        self._tasks: dict[int, asyncio.Task[Any]] = {}
        # Duplex streams open in either direction (ours and the peer's), by stream id.
        self._duplex: dict[int, DuplexStream] = {}
        self._dying: list[asyncio.Task[Any]] = []
        self._wbuf: list[bytes] = []
        self._wbytes = 0
        self._flush_scheduled = False
        self._process_scheduled = False
        self._pause = 0
        self._pump_waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._close_error: BaseException | None = None
        self._protocol_error: RemoteProtocolError | None = None
        self._closed_event = asyncio.Event()
        self._transport_gone = asyncio.Event()
        self._close_callbacks: list[Callable[[Connection], None]] = []
        self.name = name
        high, low = WRITE_HIGH_WATER, WRITE_LOW_WATER
        if guard is not None:
            lim = guard.limits
            if self._auth_required:
                # Until it authenticates, a peer is a stranger: small frames, small
                # buffers. (On an endpoint without a token there is nothing to wait for:
                # only the first-frame deadline applies.)
                self._decoder.set_max_frame(
                    lim.pending_max_frame,
                    "frames are limited to this size until the connection authenticates")
                self._read_high = 2 * lim.pending_max_frame
                high, low = PENDING_WRITE_HIGH, PENDING_WRITE_LOW
                self._write_high, self._write_low = high, low
            # A listener's peer is a stranger: frames for its ended calls (a CANCEL after
            # the reply, credit after a push ended) are bounded too (see limit_late_frames).
            self._state.stale_per_call = LATE_FRAMES_PER_CALL
            self._last_rx = self._opened_at = now = self._loop.time()
            if lim.auth_timeout_s is not None:
                self._arm_watch(now + lim.auth_timeout_s)
        try:
            transport.set_write_buffer_limits(high=high, low=low)
        except (AttributeError, NotImplementedError):  # a transport without flow control
            pass

    # ----------------------------------------------------------------- public API
    def limit_late_frames(self, per_call: int) -> None:
        """Close the connection (a logged protocol error) once the peer has sent more than
        ``per_call`` frames per call (either side's, plus one) for streams that had
        ended. For a peer that is not trusted to stop (a guest agent): such frames get no
        answer, so nothing else slows it down. Frames for streams never opened close it
        at the first, whatever this says."""
        self._state.stale_per_call = per_call

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def in_flight(self) -> int:
        """Calls this side is waiting on."""
        return len(self._pending)

    @property
    def handlers_running(self) -> int:
        """Async handlers running for the peer's requests."""
        return len(self._tasks)

    @property
    def protocol_error(self) -> RemoteProtocolError | None:
        """Why the connection was closed, if the peer sent invalid data."""
        return self._protocol_error

    @property
    def going_away(self) -> bool:
        """A GOAWAY was sent or received: no new calls start on this connection."""
        return self._state.going_away

    @property
    def auth_context(self) -> object:
        """What the router's authenticator returned for this connection's credential
        (None before authentication, on a token endpoint and on dialed connections);
        handlers added ``with_context=True`` receive it as their first argument."""
        return self._auth_context

    @property
    def established(self) -> bool:
        """Past the listener's admission: authenticated (or, on an endpoint without a
        token, delivered a first frame). Always true for dialed connections."""
        return self._established

    @property
    def last_received(self) -> float:
        """Loop time (``loop.time()``) of the last bytes received from the peer; 0.0 before
        any. Lets a caller whose request timed out tell a busy peer (it kept sending
        other replies) from a silent one."""
        return self._last_rx

    @property
    def peer(self) -> str:
        """The peer's address key as the listener counts it ("" when not accepted by one)."""
        return self._guard.peer if self._guard is not None else ""

    async def call(
        self, method: str, body: Any = None, *, timeout: float | None = None,
        response_type: Any = None,
    ) -> Any:
        """Send one request and wait for its reply (decoded as ``response_type``).

        A timeout or a cancellation of the awaiting task sends CANCEL, and the server
        cancels the handler.
        """
        st = self._state
        if not st.can_open:
            raise self._unusable()
        payload = ((_prefixes.get(method) or _prefix(method))
                   + (_NIL if body is None else _encode_body(body)))
        if len(payload) > self._max_frame:
            raise self._too_large(method, len(payload))
        if timeout is not None:
            _check_timeout(timeout)
        if self._wbytes + self._transport.get_write_buffer_size() > WRITE_HIGH_WATER:
            await self._drain()
            if not st.can_open:
                raise self._unusable()
        fut: asyncio.Future[bytes] = self._loop.create_future()
        sid = st.open(fut)
        self._send(_REQUEST, sid, payload)
        if timeout is None:
            try:
                data = await fut
            except asyncio.CancelledError:
                self._abandon(sid)
                raise
        else:
            timer = self._loop.call_later(timeout, self._expire, sid, timeout, method)
            try:
                data = await fut
            except asyncio.CancelledError:
                self._abandon(sid)
                raise
            finally:
                timer.cancel()
        if response_type is None:
            try:
                return _ANY.decode(data)
            except msgspec.DecodeError:
                pass  # raise the explanatory error below
        return _decode_reply(data, response_type, method)

    async def call_batch(
        self, calls: Sequence[tuple[str, Any]], *, timeout: float | None = None,
        response_type: Any = None, return_exceptions: bool = False,
    ) -> list[Any]:
        """N calls with one slot-registration pass, one write and one deadline.

        On the wire this is exactly N REQUEST frames. With ``return_exceptions`` failed
        calls appear as exception objects in the result list; otherwise the first
        failure is raised after every call has finished.
        """
        st = self._state
        if not st.can_open:
            raise self._unusable()
        _check_timeout(timeout)
        payloads: list[bytes] = []
        for method, body in calls:
            p = _prefix(method) + _encode_body(body)
            if len(p) > self._max_frame:
                raise self._too_large(method, len(p))
            payloads.append(p)
        if not payloads:
            return []
        if self._wbytes + self._transport.get_write_buffer_size() > WRITE_HIGH_WATER:
            await self._drain()
            if not st.can_open:
                raise self._unusable()
        loop = self._loop
        batch = _Batch(st.next_sid, len(payloads), loop.create_future())
        sid = st.open_many(batch, len(payloads))
        wbuf = self._wbuf
        nbytes = 0
        for p in payloads:
            wbuf.append(encode_parts(_REQUEST, sid, p))
            wbuf.append(p)
            nbytes += 25 + len(p)
            sid += 2
        self._wbytes += nbytes
        self._flush()
        timer = None
        if timeout is not None:
            timer = loop.call_later(timeout, self._expire_batch, batch, timeout)
        try:
            await batch.fut
        except asyncio.CancelledError:
            self._abandon_batch(batch)
            raise
        finally:
            if timer is not None:
                timer.cancel()
        out = batch.results
        first_error: BaseException | None = None
        dec = _decoder(response_type)
        for i, r in enumerate(out):
            if isinstance(r, BaseException):
                first_error = first_error or r
                continue
            try:
                out[i] = dec.decode(r)
            except msgspec.DecodeError as exc:
                err = RemoteProtocolError(
                    f"reply to call {i} ({calls[i][0]!r}) of a call_batch does not decode: {exc}")
                out[i] = err
                first_error = first_error or err
        if first_error is not None and not return_exceptions:
            raise first_error
        return out

    def stream(
        self, method: str, body: Any = None, *, timeout: float | None = None,
        item_type: Any = None, response_type: Any = None,
    ) -> CallStream:
        """Start a streaming call; iterate the result for STREAM items, then read
        ``.result``. ``timeout`` bounds the whole call."""
        if not self._state.can_open:
            raise self._unusable()
        _check_timeout(timeout)
        payload = _prefix(method) + _encode_body(body)
        if len(payload) > self._max_frame:
            raise self._too_large(method, len(payload))
        slot = _StreamSlot()
        sid = self._state.open(slot)
        self._send(_REQUEST, sid, payload, _STREAMING | _CREDIT)
        timer = None
        if timeout is not None:
            timer = self._loop.call_later(timeout, self._expire, sid, timeout, method)
        return CallStream(self, sid, slot, item_type, response_type, timer, method)

    def duplex(
        self, method: str, body: Any = None, *, timeout: float | None = None,
        response_type: Any = None,
    ) -> DuplexStream:
        """Start a duplex call: raw bytes both ways under per-stream credit (a REQUEST
        with the DUPLEX flag; the server's handler takes a :class:`DuplexStream`).
        ``timeout`` bounds the whole call; ``await stream.result()`` is the reply."""
        st = self._state
        if not st.can_open:
            raise self._unusable()
        _check_timeout(timeout)
        payload = _prefix(method) + _encode_body(body)
        if len(payload) > self._max_frame:
            raise self._too_large(method, len(payload))
        stream = DuplexStream(self, st.next_sid, method, caller=True,
                              response_type=response_type)
        sid = st.open(stream)
        self._duplex[sid] = stream
        self._send(_REQUEST, sid, payload, _DUPLEX)
        if timeout is not None:
            stream._timer = self._loop.call_later(timeout, self._expire, sid, timeout, method)
        return stream

    async def ping(self, payload: bytes = b"", *, timeout: float | None = 10.0) -> bytes:
        """Round trip a PING; returns the payload the peer echoed."""
        if self._closed:
            raise self._unusable()
        _check_timeout(timeout)
        if len(payload) > self._max_frame:
            raise self._too_large("ping", len(payload))
        fut: asyncio.Future[bytes] = self._loop.create_future()
        sid = self._state.open(fut)
        self._send(_PING, sid, bytes(payload))
        timer = None
        if timeout is not None:
            timer = self._loop.call_later(timeout, self._expire, sid, timeout, "ping")
        try:
            return await fut
        finally:
            if timer is not None:
                timer.cancel()
            self._state.take(sid)

    def abort(self, reason: str) -> None:
        """Close at once and throw away everything not yet delivered: pending calls fail
        with ConnectionLost, and a TCP socket is closed with SO_LINGER 0, so the kernel
        drops the bytes still queued for the peer and sends RST. For a peer written off
        (a node the control plane declared lost): with a plain close the kernel keeps
        retransmitting what the dead link holds, and when the network heals the peer
        carries out requests whose callers were answered long ago (a create queued
        before a partition made a sandbox nobody held, ~13 s after the link came back:
        tests/cluster/test_hosts_partition.py)."""
        if self._closed:
            return
        import socket
        import struct

        sock = self._transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:  # already gone: nothing left to send
                pass
        self._wbuf.clear()
        self._wbytes = 0
        self._shutdown(ConnectionLost(f"connection {self.name} aborted: {reason}"))
        try:
            self._transport.abort()
        except Exception:  # noqa: BLE001, S110 - the socket is already gone
            pass

    async def close(self, reason: str = "closed by local side", *,
                    grace: float | None = None) -> None:
        """Send GOAWAY, then close.

        With ``grace`` (seconds) the connection first waits up to that long for calls in
        flight in both directions to finish (no new ones start); with None it closes at
        once, failing pending calls with ConnectionLost and cancelling running handlers.
        """
        if not self._closed:
            self._send_goaway(reason)
            if grace is not None:
                deadline = self._loop.time() + grace
                # Polling keeps the hot path free of idle bookkeeping; closing is rare.
                while (self._pending or self._tasks) and not self._closed:
                    left = deadline - self._loop.time()
                    if left <= 0:
                        break
                    await asyncio.sleep(min(0.005, left))
            self._shutdown(ConnectionLost(f"connection {self.name} closed: {reason}"))
        await self.wait_closed()

    async def wait_closed(self) -> None:
        """Until the connection is closed, its handlers finished and its socket released."""
        await self._closed_event.wait()
        waits: list[Awaitable[Any]] = list(self._dying)
        if self._pump is not None and self._pump is not asyncio.current_task():
            waits.append(self._pump)
        if waits:
            await asyncio.gather(*waits, return_exceptions=True)
        if self._writer is not None:
            try:
                await self._writer.wait_closed()
            except (ConnectionError, OSError):
                pass
        else:
            await self._transport_gone.wait()

    # ------------------------------------------------------------- errors, state
    def _unusable(self) -> DsecError:
        if self._goaway_error is not None:
            return self._goaway_error
        if self._closed:
            return self._lost_error()
        received = self._state.goaway_received
        why = (f"the peer said GOAWAY ({received})" if received is not None
               else "it is closing")
        return ConnectionLost(
            f"connection {self.name} takes no new calls: {why}; open a new connection",
            retryable=True)

    def _lost_error(self) -> DsecError:
        if self._goaway_error is not None:
            return self._goaway_error
        err = self._close_error
        if isinstance(err, ConnectionLost):
            return err
        return ConnectionLost(f"connection {self.name} lost: {err}" if err else
                              f"connection {self.name} closed")

    def _too_large(self, what: str, size: int) -> PayloadTooLarge:
        return PayloadTooLarge(
            f"{what!r} request of {size} bytes exceeds the connection's max_frame of "
            f"{self._max_frame} bytes; send smaller pieces or raise max_frame on both ends",
            size=size, max_frame=self._max_frame)

    # --------------------------------------------------------------- call slots
    def _expire(self, sid: int, timeout: float, what: str) -> None:
        slot = self._state.take(sid)
        if slot is None:
            return
        _reject(slot, sid, RequestTimeout(
            f"Aether request {what!r} got no reply within its request timeout of {timeout:g}s",
            timeout_s=timeout))
        if not self._closed:
            self._send(_CANCEL, sid, b"")

    def _expire_batch(self, batch: _Batch, timeout: float) -> None:
        pending = self._pending
        for sid in batch.sids():
            if pending.get(sid) is batch:
                del pending[sid]
                batch.fail(sid, RequestTimeout(
                    f"call {(sid - batch.first) >> 1} of a call_batch got no reply within "
                    f"the batch's request timeout of {timeout:g}s", timeout_s=timeout))
                if not self._closed:
                    self._send(_CANCEL, sid, b"")

    def _abandon(self, sid: int) -> None:
        """Forget a call we no longer wait for and tell the server to stop working on it."""
        if self._state.take(sid) is not None and not self._closed:
            self._send(_CANCEL, sid, b"")

    def _abandon_batch(self, batch: _Batch) -> None:
        pending = self._pending
        for sid in batch.sids():
            if pending.get(sid) is batch:
                del pending[sid]
                if not self._closed:
                    self._send(_CANCEL, sid, b"")

    # ------------------------------------------------------------------ writing
    def _send(self, ftype: int, sid: int, payload: bytes, flags: int = 0) -> None:
        # encode_parts inlined (~0.1 us per frame): stream ids here come from our counter
        # or from a decoded u64, and lengths were checked against max_frame, so the
        # fields always fit.
        head = _HEAD.pack(MAGIC, VERSION, sid, ftype, len(payload), flags)
        wbuf = self._wbuf
        wbuf.append(head + _CRC.pack(_crc32(payload, _crc32(head))))
        if payload:
            wbuf.append(payload)
        self._wbytes += 25 + len(payload)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        buf = self._wbuf
        if not buf:
            return
        nbytes, self._wbytes = self._wbytes, 0
        if self._closed:
            buf.clear()
            return
        try:
            if len(buf) == 1:
                self._transport.write(buf[0])
            elif nbytes <= _JOIN_LIMIT:
                self._transport.write(b"".join(buf))
            else:
                self._transport.writelines(buf)
        except (ConnectionError, OSError, RuntimeError) as exc:
            buf.clear()
            self._shutdown(ConnectionLost(f"write on connection {self.name} failed: {exc}"))
            return
        buf.clear()
        if self._drain_watch:
            size = self._transport.get_write_buffer_size()
            p = self._protocol
            if not size:            # all in the kernel already: no resume will come
                self._check_written()
            elif p is not None and p._watch_paused and size > self._write_high:
                p._pause_for_real()     # the transport is paused already (the watch)
        if self._guard is not None:
            self._check_unread()

    async def _drain(self) -> None:
        """Wait until the transport's write buffer is below its low-water mark."""
        self._flush()
        try:
            if self._writer is not None:
                await self._writer.drain()
            elif self._protocol is not None:
                await self._protocol._wait_writable()
        except (ConnectionError, OSError) as exc:
            self._shutdown(ConnectionLost(f"connection {self.name} lost while writing: {exc}"))
            raise self._lost_error() from exc

    def _send_goaway(self, reason: str, code: str = "") -> None:
        if self._closed:
            return
        body = self._state.go_away(reason, code)
        if body is not None:
            self._send(_GOAWAY, 0, body)
            self._flush()

    # ------------------------------------------------------------------ reading
    def _on_data(self, data: bytes) -> None:
        if self._closed:
            return
        try:
            self._decoder.feed(data)
        except RemoteProtocolError as exc:
            self._fail_protocol(exc)
            return
        if (not self._process_scheduled and not self._pause & _PAUSE_OUTPUT
                and not self._request_waits()):
            self._process()
        elif self._decoder.buffered > self._read_high:
            self._pause_reading(_PAUSE_INPUT)
        if not self._closed:
            self._last_rx = self._loop.time()
            if self._guard is not None and (self._held or self._decoder.buffered):
                self._account()   # the common case holds nothing

    def _request_waits(self) -> bool:
        """At max_calls_in_flight with a REQUEST next: it (and what follows it) waits for
        a handler to end. Other frames (a duplex stream's bytes and credit, CANCEL, PING)
        are still handled at the cap: a duplex upload's own bytes must not wait behind
        the calls that filled it."""
        if not self._calls_full:
            return False
        nxt = self._decoder.next_type()
        return nxt is None or nxt == _REQUEST

    def _process(self) -> None:
        """Handle up to FRAMES_PER_WAKEUP frames, then write every reply in one go."""
        self._process_scheduled = False
        if self._closed or self._pause & _PAUSE_OUTPUT or self._request_waits():
            return
        next_raw = self._decoder.next_raw
        on_frame = self._on_frame
        try:
            for _ in range(FRAMES_PER_WAKEUP):
                f = next_raw()
                if f is None:
                    break
                on_frame(*f)
                if self._closed:
                    return
                if self._request_waits():
                    break   # at max_calls_in_flight: the rest waits for a handler to end
                if not self._established and not self._auth_required:
                    self._establish()  # a no-token endpoint: the first valid frame admits
                if self._wbytes > self._write_high:
                    # Stop handling requests while the peer does not take our replies;
                    # _on_write_resumed carries on with the frames still buffered.
                    self._flush()
                    if (not self._closed and not self._pending
                            and self._transport.get_write_buffer_size() > self._write_high):
                        self._pause_reading(_PAUSE_OUTPUT)
                    if self._closed or self._pause & _PAUSE_OUTPUT:
                        return
            else:
                # More may be buffered: let callers and handlers run first.
                self._process_scheduled = True
                self._loop.call_soon(self._process)
                if self._decoder.buffered > self._read_high:
                    self._pause_reading(_PAUSE_INPUT)
        except RemoteProtocolError as exc:
            self._fail_protocol(exc)
            return
        except Exception as exc:  # a bug here must not leave callers hanging
            log.exception("Aether connection %s failed while handling a frame", self.name)
            self._shutdown(ConnectionLost(
                f"connection {self.name} failed internally: {type(exc).__name__}: {exc}"))
            return
        if self._pause & _PAUSE_INPUT and not self._process_scheduled:
            self._resume_reading(_PAUSE_INPUT)
        if self._wbuf:
            self._flush()
        if self._guard is not None and self._held:
            self._account()

    def _on_frame(self, ftype: int, sid: int, payload: bytes, flags: int) -> None:
        if ftype == _RESPONSE:
            # ConnectionState.take, inlined on the hottest path (a method call per reply
            # measured ~1% of a pipelined call): _pending is the state's pending table.
            slot = self._pending.pop(sid, None)
            if slot is not None:
                if isinstance(slot, _Slot):
                    slot.ok(sid, payload)
                elif not slot.done():
                    slot.set_result(payload)
            else:  # a reply to a call we abandoned (dropped), or a made-up one
                self._state.on_unsolicited("RESPONSE", sid)
        elif ftype == _REQUEST:
            self._on_request(sid, payload, flags)
        elif ftype == _STREAM:
            slot = self._pending.get(sid)
            if isinstance(slot, _StreamSlot):
                slot.item(payload)
                self._stream_backlog += len(payload)
                if slot.backlog > STREAM_BACKLOG_MAX:
                    self._stream_overflow(sid, slot)
                elif self._stream_backlog > STREAMS_BACKLOG_MAX:
                    self._streams_overflow()
            else:
                d = self._duplex.get(sid)
                if d is not None:
                    d._on_data(payload, flags)
                else:  # a stream that ended (its late bytes are dropped) or none at all
                    self._state.on_unsolicited("STREAM", sid)
        elif ftype == _ERROR:
            slot = self._state.take(sid)
            if slot is not None:
                _reject(slot, sid, self._wire_error(sid, payload))
            else:
                self._state.on_unsolicited("ERROR", sid)
        elif ftype == _CANCEL:
            task = self._tasks.pop(sid, None)
            if task is not None:
                task.cancel()
            d = self._duplex.get(sid) if self._duplex else None
            if d is not None and not d._caller:
                d._on_reset(StreamReset(
                    f"duplex stream {sid} ({d.method!r}) was cancelled by the caller"))
            if task is None and d is None:  # a call that had ended, or none at all
                self._state.on_unsolicited("CANCEL", sid)
        elif ftype == _PING:
            self._send(_PONG, sid, payload)
        elif ftype == _PONG:
            slot = self._state.take(sid)
            if slot is not None:
                _resolve(slot, sid, payload)
            else:
                self._state.on_unsolicited("PONG", sid)
        elif ftype == _WINDOW:
            increment = decode_window(payload, sid)
            d = self._duplex.get(sid)
            if d is not None:
                d._on_window(increment)
            else:
                c = self._push_credit.get(sid)
                if c is not None:
                    c.grant(increment)
                else:
                    self._state.on_unsolicited("WINDOW", sid)
        else:  # _GOAWAY; the decoder lets no other type through
            self._on_goaway(payload)

    def _stream_overflow(self, sid: int, slot: _StreamSlot) -> None:
        """A streaming call's reader fell too far behind: cancel the call (the server
        stops producing) and fail the reader, rather than buffer without bound. A link
        cannot be paused for one slow stream without stalling every other call on it."""
        backlog = slot.backlog
        self._state.take(sid)
        slot.items.clear()
        slot.backlog = 0
        self._stream_backlog -= backlog
        slot.fail(sid, ResourceExhausted(
            f"streaming call on stream {sid} of connection {self.name} was cancelled: its "
            f"reader fell {backlog} bytes behind (the limit is {STREAM_BACKLOG_MAX}); read "
            "the stream as it comes", backlog=backlog, limit=STREAM_BACKLOG_MAX))
        if not self._closed:
            self._send(_CANCEL, sid, b"")

    def _streams_overflow(self) -> None:
        """All streaming calls together hold too much unread: cancel the ones furthest
        behind until back under STREAMS_BACKLOG_MAX."""
        while self._stream_backlog > STREAMS_BACKLOG_MAX:
            worst = max(((sid, slot) for sid, slot in self._pending.items()
                         if isinstance(slot, _StreamSlot)),
                        key=lambda kv: kv[1].backlog, default=None)
            if worst is None or not worst[1].backlog:
                self._stream_backlog = 0    # nothing left to hold it: resync
                return
            self._stream_overflow(*worst)

    def _wire_error(self, sid: int, payload: bytes) -> BaseException:
        try:
            eb = _ERROR_DECODER.decode(payload)
        except msgspec.DecodeError as exc:
            return RemoteProtocolError(f"undecodable ERROR body on stream {sid}: {exc}")
        return error_from_wire(eb.code, eb.message, eb.detail)

    def _on_goaway(self, payload: bytes) -> None:
        st = self._state
        unprocessed = st.on_goaway(payload)
        if st.goaway_code:
            # e.g. "overloaded": the listener refused this connection at its limits.
            self._goaway_error = error_from_wire(
                st.goaway_code, f"connection {self.name} refused by the server: "
                f"{st.goaway_received}", {"retryable": True})
        for sid, slot in unprocessed:
            _reject(slot, sid, self._goaway_error or ConnectionLost(
                f"connection {self.name} is going away ({st.goaway_received}); the call "
                f"on stream {sid} was not processed and is safe to retry", retryable=True))

    def _on_request(self, sid: int, payload: bytes, flags: int) -> None:
        verdict = self._state.on_request(sid, payload)
        if verdict is not _DISPATCH:
            if verdict is _DROP:
                return  # after our GOAWAY: the peer fails this call itself, as retryable
            if verdict is _BAD_METHOD:
                # Codes name what the caller raises: it produced the invalid frame.
                self._reply_error(sid, LocalProtocolError(
                    f"REQUEST payload of {len(payload)} bytes on stream {sid} has no valid "
                    "method name prefix (u8 length, then that many ascii bytes)"))
                return
            self._on_unauthenticated(sid, payload, verdict is _AUTH)
            return
        n = payload[0]
        route = self._routes.get(payload[: 1 + n])
        if route is None:
            method = payload[1 : 1 + n].decode("ascii", "backslashreplace")
            served = self._router.methods if self._router is not None else []
            known = ", ".join(served[:20]) + (", ..." if len(served) > 20 else "")
            self._reply_error(sid, UnknownMethod(
                f"unknown Aether method {method!r} (this peer serves: {known or 'nothing'})",
                method=method))
            return
        try:
            # Slicing copies; below ~4 KiB that is cheaper than building a memoryview.
            body = route.decoder.decode(
                payload[1 + n :] if len(payload) < 4096 else memoryview(payload)[1 + n :])
        except msgspec.DecodeError as exc:
            if isinstance(exc.__cause__, DsecError):
                # The type's own validation refused it (msgspec wraps what __post_init__
                # raised in a ValidationError): answer with that error unchanged.
                self._reply_error(sid, exc.__cause__)
                return
            # worded as every door words it (REST too): the operation, not the door's
            # method or type name; the method in the detail
            err = undecodable(route.method.partition(".")[2] or route.method, exc)
            err.detail["method"] = route.method
            self._reply_error(sid, err)
            return
        except RecursionError:
            # msgpack nested deeper than msgspec recurses: the caller's bad input, not a
            # fault of this peer (it used to escape the read loop)
            self._reply_error(sid, InvalidArgument(
                f"the {route.method} request body is nested too deeply; a request is a "
                "flat record of fields", method=route.method))
            return
        if flags & _CALL_KIND != route.kind:
            how = ("Connection.stream()" if route.streaming else
                   "Connection.duplex()" if route.duplex else "Connection.call()")
            self._reply_error(sid, InvalidArgument(
                f"Aether method {route.method!r} must be called with {how}",
                method=route.method))
            return
        # The handler (and the task running it, which copies the context) sees the peer
        # through current_peer(); a set/reset pair costs ~0.2 us (measured here, loaded).
        peer = _PEER.set(self)
        try:
            if not route.is_async:
                try:
                    result = (route.handler(self._auth_context, body) if route.with_context
                              else route.handler(body))
                except Exception as exc:  # noqa: BLE001 - any handler failure becomes an ERROR
                    self._reply_handler_error(sid, route.method, exc)
                    return
                self._reply(sid, route.method, result)
                return
            if route.duplex and self._max_duplex is not None \
                    and len(self._served_duplex) >= self._max_duplex:
                self._reply_error(sid, ResourceExhausted(
                    f"this connection already has {len(self._served_duplex)} duplex streams "
                    f"open, the limit is {self._max_duplex}; end one (or open another "
                    "connection)", limit=self._max_duplex, method=route.method))
                return
            try:
                if route.kind:
                    extra: StreamSender | DuplexStream
                    if route.streaming:
                        credit = None
                        if flags & _CREDIT:
                            credit = self._push_credit[sid] = _SendCredit(STREAM_WINDOW)
                        extra = StreamSender(self, sid, credit)
                    else:
                        self._served_duplex.add(sid)
                        extra = self._duplex[sid] = DuplexStream(self, sid, route.method,
                                                                 caller=False)
                    coro = (route.handler(self._auth_context, body, extra) if route.with_context
                            else route.handler(body, extra))
                elif route.with_context:
                    coro = route.handler(self._auth_context, body)
                else:
                    coro = route.handler(body)
            except Exception as exc:  # noqa: BLE001 - e.g. a handler with the wrong signature
                d = self._duplex.pop(sid, None)
                self._served_duplex.discard(sid)
                if d is not None:
                    d._on_reset(StreamReset(f"handler for {route.method!r} failed to start"))
                self._reply_handler_error(sid, route.method, exc)
                return
            task = self._loop.create_task(coro)
        finally:
            _PEER.reset(peer)
        tasks = self._tasks
        tasks[sid] = task
        task.add_done_callback(functools.partial(self._handler_done, sid, route.method))
        if self._max_calls is not None and len(tasks) - len(self._served_duplex) >= self._max_calls:
            # Like HTTP/2's MAX_CONCURRENT_STREAMS, but as backpressure: the peer's further
            # frames are not handled until one of these calls ends. They wait undecoded
            # (up to the read high-water mark, then in the peer's socket), not as tasks;
            # reading goes on below that mark, so a hang-up is still noticed.
            self._calls_full = True

    def _handler_done(self, sid: int, method: str, task: asyncio.Task[Any]) -> None:
        hooks = self._reply_hooks.pop(task, None) if self._reply_hooks else None
        try:
            self._answer_handler(sid, method, task, hooks)
        finally:
            if hooks:
                _run_hooks(hooks)   # nothing left to wait for (else _answer_handler took them)

    def _answer_handler(self, sid: int, method: str, task: asyncio.Task[Any],
                        hooks: list[Callable[[], None]] | None) -> None:
        if self._push_credit:
            self._push_credit.pop(sid, None)
        if self._duplex:
            d = self._duplex.get(sid)
            if d is not None and not d._caller:
                # The handler's answer ends the stream: no more bytes either way.
                d._on_end()
        self._served_duplex.discard(sid)
        if self._calls_full:
            self._calls_ended(len(self._tasks) - (self._tasks.get(sid) is task)
                              - len(self._served_duplex))
        if self._tasks.get(sid) is not task:
            return  # the caller cancelled it, or the connection closed: nobody to tell
        del self._tasks[sid]
        if self._closed:
            return
        if task.cancelled():
            self._reply_error(sid, InternalError(
                f"handler for {method!r} was cancelled on the server", method=method))
            return
        exc = task.exception()
        if exc is not None:
            self._reply_handler_error(sid, method, exc)
            return
        data = self._encode_reply(sid, method, task.result())
        if data is None:
            return
        if len(data) > PARK_MIN and (self._parked or self._wbytes
                                     + self._transport.get_write_buffer_size() > self._write_high):
            if hooks:
                self._parked_hooks[sid] = hooks[:]
                hooks.clear()
            self._park(sid, data)
        else:
            self._send(_RESPONSE, sid, data)
            if hooks:
                self._when_written(hooks[:])
                hooks.clear()

    def _task_hooks_left(self, task: asyncio.Task[Any]) -> None:
        hooks = self._reply_hooks.pop(task, None)
        if hooks:
            _run_hooks(hooks)

    def _when_written(self, hooks: list[Callable[[], None]]) -> None:
        """Run ``hooks`` once what was just sent has left the transport's write buffer
        (after the flush scheduled by _send; else when the buffer is empty)."""
        self._written_hooks.extend(hooks)
        self._loop.call_soon(self._check_written)

    def _check_written(self) -> None:
        """Run the written hooks if the transport's write buffer is empty: every byte
        before them is in the kernel's socket buffer, not in this process (red team 21,
        B9: "not paused", i.e. under the 4 MiB high-water mark, released a reply's
        lease while all of it sat unread here). Else watch for the buffer to empty:
        asyncio tells only of a paused transport falling to its low-water mark, so the
        marks go to 0 until then (_watch_drain); the hooks run on that resume."""
        p = self._protocol
        if self._closed or p is None:
            hooks, self._written_hooks = self._written_hooks, []
            _run_hooks(hooks)
            return
        if self._wbytes or self._transport.get_write_buffer_size():
            if self._written_hooks:
                self._watch_drain()
            return
        hooks, self._written_hooks = self._written_hooks, []
        if self._drain_watch:
            self._drain_watch = False
            self._set_write_limits(self._write_high, self._write_low)
        _run_hooks(hooks)

    def _watch_drain(self) -> None:
        if self._drain_watch:
            return
        self._drain_watch = True
        # pauses the transport now (its buffer is not empty): AetherProtocol.pause_writing
        # knows it for a watch, not for backpressure, while under the high-water mark
        self._set_write_limits(0, 0)

    def _set_write_limits(self, high: int, low: int) -> None:
        try:
            self._transport.set_write_buffer_limits(high=high, low=low)
        except (AttributeError, NotImplementedError):   # no flow control: no watch either
            self._drain_watch = False

    def _park(self, sid: int, data: bytes) -> None:
        """Hold a large reply until the link's write buffer is below its high-water mark
        (then write the parked ones in order, one high-water mark at a time). Replies used
        to be written whole as handlers finished: 24 concurrent 8 MiB read_file calls put
        190 MB in the edge's write buffer at once, and the guard below cut the apiserver's
        shared link - failing every tenant's calls on the node."""
        self._parked.append((sid, data))
        self._parked_bytes += len(data)
        self._check_unread()
        if self._unparker is None and not self._closed:
            self._unparker = self._loop.create_task(self._unpark())

    async def _unpark(self) -> None:
        try:
            while self._parked and not self._closed:
                if self._wbytes + self._transport.get_write_buffer_size() > self._write_high:
                    await self._drain()
                    continue
                sid, data = self._parked.popleft()
                self._parked_bytes -= len(data)
                self._send(_RESPONSE, sid, data)
                if self._parked_hooks:
                    hooks = self._parked_hooks.pop(sid, None)
                    if hooks:
                        self._when_written(hooks)
        except DsecError:
            pass    # the connection is gone; _shutdown dropped what was parked
        finally:
            self._unparker = None

    def _check_unread(self) -> None:
        """On a listener with ``unread_replies_max``: cut a peer that leaves more of our
        replies unread (written or parked) than that."""
        g = self._guard
        if g is None or self._state.goaway_sent is not None:
            return
        limit = g.limits.unread_replies_max
        if limit is None:
            return
        unread = self._transport.get_write_buffer_size() + self._parked_bytes
        if unread > limit:
            self._cut("unread_replies", (
                f"the peer left {unread} bytes of replies unread (the limit is "
                f"{limit}); read replies as they come"), code=Overloaded.code)

    def _calls_ended(self, running: int) -> None:
        """A handler ended while reading was paused at max_calls_in_flight (``running``
        are left): resume once the connection is below the cap again."""
        if self._closed or self._max_calls is None or running >= self._max_calls:
            return
        self._calls_full = False
        if not self._process_scheduled and not self._pause & _PAUSE_OUTPUT:
            self._process_scheduled = True
            self._loop.call_soon(self._process)

    def _on_unauthenticated(self, sid: int, payload: bytes, is_auth: bool) -> None:
        """The one request an unauthenticated peer may make is AUTH_METHOD with the token
        (or credential); a wrong one closes the connection (no guessing on one socket)."""
        router = self._router
        assert router is not None
        n = payload[0]
        if not is_auth:
            self._reply_error(sid, Unauthenticated(
                f"this Aether endpoint requires a {router.credential}: call "
                f"{AUTH_METHOD!r} first (connect(..., token=...))"))
            return
        try:
            offered = msgspec.msgpack.decode(payload[1 + n :], type=bytes)
        except msgspec.DecodeError:
            offered = b""
        refusal: DsecError
        if self._token is not None:
            if self._state.token_matches(offered, self._token):
                self._accept_auth(sid)
                return
            refusal = Unauthenticated("wrong Aether token; connection closed")
        else:
            assert router.authenticate is not None
            try:
                context = router.authenticate(offered, self.peer)
            except DsecError as exc:
                refusal = exc
            except Exception as exc:
                log.error("Aether authenticator failed", exc_info=exc)
                refusal = InternalError(f"authentication failed: {type(exc).__name__}")
            else:
                self._auth_context = context
                self._accept_auth(sid)
                return
        self._reply_error(sid, refusal)
        # GOAWAY now: requests the peer pipelined behind this one (a second guess) are
        # not served; the close follows once this wakeup's frames are handled.
        reason = f"authentication failed ({refusal.code})"
        body = self._state.refuse_auth(reason)
        if body is not None:
            self._send(_GOAWAY, 0, body)
        self._loop.call_soon(self._close_now, reason)

    def _accept_auth(self, sid: int) -> None:
        self._state.accept_auth()
        self._establish()
        self._reply(sid, AUTH_METHOD, None)

    # ------------------------------------------------------------ listener limits
    def _establish(self) -> None:
        """Past admission: full frame size and buffers, idle timeout instead of the
        authentication deadline."""
        g = self._guard
        if self._established or g is None:
            self._established = True
            return
        self._established = True
        lim = g.limits
        self._decoder.set_max_frame(self._max_frame)
        self._read_high = READ_HIGH_WATER
        self._write_high, self._write_low = WRITE_HIGH_WATER, WRITE_LOW_WATER
        if not self._drain_watch:   # else restored when the buffer is empty
            try:
                self._transport.set_write_buffer_limits(high=WRITE_HIGH_WATER,
                                                        low=WRITE_LOW_WATER)
            except (AttributeError, NotImplementedError):
                pass
        g.on_established(self)
        self._cancel_watch()
        if lim.idle_timeout_s is not None:
            self._arm_watch(self._loop.time() + lim.idle_timeout_s)
        if self._partial_since is not None and lim.frame_timeout_s is not None:
            self._arm_watch(self._partial_since + lim.frame_timeout_s)

    def _account(self) -> None:
        """Keep the process budget's count of buffered input bytes in step with this
        connection's, refuse the connection that pushes it over, and time partial frames."""
        g = self._guard
        assert g is not None
        dec = self._decoder
        # An established shared link (the apiserver's, on an edge) is not a holder: its
        # input is bounded by READ_HIGH_WATER plus one frame, and cutting it as "the
        # largest holder" would fail every tenant on the node for strangers' bytes.
        held = 0 if self._established and g.limits.shared_link else dec.buffered
        delta = held - self._held
        if delta:
            self._held = held
            budget = g.budget
            budget.hold(self, held)
            if delta > 0 and budget.over_buffer():
                self._over_budget(budget)
                if self._closed:
                    return
        if dec.partial:
            if self._partial_since is None:
                self._partial_since = now = self._loop.time()
                ft = g.limits.frame_timeout_s
                if ft is not None:
                    self._arm_watch(now + ft)
        else:
            self._partial_since = None

    def _over_budget(self, budget: ProcessBudget) -> None:
        """Over the process's buffer budget: close the largest holders (the one that
        crossed the line only if it is the largest) until back under it."""
        while budget.over_buffer():
            hog = budget.largest_holder()
            if not isinstance(hog, Connection) or hog._closed:
                budget.holders.pop(hog, None)
                if hog is None:
                    return
                continue
            hog._cut("buffer_budget", (
                f"the server holds {budget.buffered} bytes of incoming frames across its "
                f"connections, over its budget of {budget.max_buffered_bytes}, and this "
                f"connection holds the most ({hog._held}); retry later"),
                code=Overloaded.code)
            if hog is self:
                return

    def _arm_watch(self, at: float) -> None:
        if at < self._watch_at:
            if self._watch_handle is not None:
                self._watch_handle.cancel()
            self._watch_at = at
            self._watch_handle = self._loop.call_at(at, self._watch)

    def _cancel_watch(self) -> None:
        if self._watch_handle is not None:
            self._watch_handle.cancel()
            self._watch_handle = None
        self._watch_at = float("inf")

    def _watch(self) -> None:
        """The listener's deadlines, checked lazily: one timer per connection, moved only
        when it fires (no per-frame rescheduling)."""
        self._watch_handle = None
        self._watch_at = float("inf")
        g = self._guard
        if self._closed or g is None:
            return
        lim = g.limits
        now = self._loop.time()
        nxt = float("inf")
        if not self._established:
            if lim.auth_timeout_s is not None:
                deadline = self._opened_at + lim.auth_timeout_s
                if now >= deadline:
                    what = ("authenticate" if self._auth_required
                            else "send its first frame")
                    self._cut("auth_timeout",
                              f"the connection did not {what} within "
                              f"{lim.auth_timeout_s:g}s of connecting")
                    return
                nxt = deadline
        elif lim.idle_timeout_s is not None:
            if self._pending or self._tasks:
                nxt = now + lim.idle_timeout_s   # busy: look again later
            else:
                deadline = self._last_rx + lim.idle_timeout_s
                if now >= deadline:
                    self._cut("idle", f"idle for {lim.idle_timeout_s:g}s with no call in "
                              "flight; reconnect to carry on")
                    return
                nxt = deadline
        if self._partial_since is not None and lim.frame_timeout_s is not None:
            deadline = self._partial_since + lim.frame_timeout_s
            if now >= deadline:
                self._cut("frame_timeout",
                          f"a frame begun {now - self._partial_since:.0f}s ago is still "
                          f"incomplete ({self._decoder.buffered} bytes in; the limit is "
                          f"{lim.frame_timeout_s:g}s per frame)")
                return
            nxt = min(nxt, deadline)
        if nxt != float("inf"):
            self._arm_watch(nxt)

    def _cut(self, kind: str, reason: str, *, code: str = "") -> None:
        """Close at once on a listener limit, telling the peer why (GOAWAY)."""
        if self._closed:
            return
        if self._guard is not None:
            self._guard.stats.close(kind)
        log.info("closing Aether connection %s (%s): %s", self.name, kind, reason)
        self._send_goaway(reason, code)
        err: DsecError = (error_from_wire(code, f"connection {self.name} closed: {reason}")
                          if code else ConnectionLost(f"connection {self.name} closed: {reason}"))
        self._shutdown(err, linger=True)

    def _close_now(self, reason: str) -> None:
        self._loop.create_task(self.close(reason))

    def _reply(self, sid: int, method: str, result: Any) -> None:
        data = self._encode_reply(sid, method, result)
        if data is not None:
            self._send(_RESPONSE, sid, data)

    def _encode_reply(self, sid: int, method: str, result: Any) -> bytes | None:
        """The RESPONSE payload of ``result``, or None after answering an ERROR instead."""
        try:
            data = _NIL if result is None else _encode_body(result)
        except LocalProtocolError as exc:
            why = exc.message
            if inspect.isawaitable(result):  # e.g. a lambda around an async function
                if inspect.iscoroutine(result):
                    result.close()
                why = ("it returned an awaitable; register an `async def` handler so the "
                       "connection awaits it")
            log.error("handler for %r returned an unencodable value: %s", method, why)
            self._reply_error(sid, InternalError(
                f"handler for {method!r} returned a value that cannot be encoded: {why}",
                method=method))
            return None
        if len(data) > self._max_frame:
            self._reply_error(sid, PayloadTooLarge(
                f"reply to {method!r} is {len(data)} bytes, over the connection's max_frame of "
                f"{self._max_frame} bytes; page the result or raise max_frame on both ends",
                method=method, size=len(data)))
            return None
        return data

    def _reply_handler_error(self, sid: int, method: str, exc: BaseException) -> None:
        if not isinstance(exc, DsecError):
            log.error("handler for %r raised", method, exc_info=exc)
        self._reply_error(sid, exc)

    def _reply_error(self, sid: int, exc: BaseException) -> None:
        body = error_body(exc)
        try:
            data = _encoder.encode(body)
        except (TypeError, ValueError, OverflowError):  # e.g. an int beyond 64 bits in detail
            data = b""
        if not data or len(data) > self._max_frame:  # keep code and message, drop detail
            data = _encoder.encode(ErrorBody(code=body.code, message=body.message[:1000]))
        self._send(_ERROR, sid, data)

    # ------------------------------------------------------------ flow control
    def _pause_reading(self, why: int) -> None:
        if not self._pause and not self._closed:
            try:
                self._transport.pause_reading()
            except (AttributeError, NotImplementedError, RuntimeError):
                pass
        if why & _PAUSE_OUTPUT and not self._pause & _PAUSE_OUTPUT and self._writer is not None:
            # Stream pairs: the StreamWriter owns the transport's resume_writing callback.
            self._loop.create_task(self._resume_after_drain(self._writer))
        self._pause |= why

    async def _resume_after_drain(self, writer: asyncio.StreamWriter) -> None:
        try:
            await writer.drain()
        except (ConnectionError, OSError):
            return  # the connection is going down anyway
        self._on_write_resumed()

    def _resume_reading(self, why: int) -> None:
        was = self._pause
        self._pause &= ~why
        if was and not self._pause and not self._closed:
            try:
                self._transport.resume_reading()
            except (AttributeError, NotImplementedError, RuntimeError):
                pass
            w, self._pump_waiter = self._pump_waiter, None
            if w is not None and not w.done():
                w.set_result(None)

    def _on_write_paused(self) -> None:
        # A peer that sends requests but does not read our replies must not make us buffer
        # without bound: stop reading its requests. Only while we wait for nothing from it,
        # or two peers calling each other could each stop reading the other's replies.
        if not self._pending:
            self._pause_reading(_PAUSE_OUTPUT)

    def _on_write_resumed(self) -> None:
        if self._written_hooks or self._drain_watch:
            self._check_written()
        if self._pause & _PAUSE_OUTPUT:
            self._resume_reading(_PAUSE_OUTPUT)
            if not self._process_scheduled and not self._closed:
                self._process_scheduled = True
                self._loop.call_soon(self._process)

    # --------------------------------------------------------- end of the line
    def _on_eof(self) -> None:
        if self._closed:
            return
        while self._process_scheduled and not self._closed:
            self._process()  # complete frames still queued behind the 64-frame limit
        if self._closed:
            return
        if self._pause & _PAUSE_OUTPUT or self._calls_full:
            # It stopped reading our replies (or pipelined past max_calls_in_flight) and
            # has now hung up: its queued requests have nobody to answer to. Not a
            # protocol error.
            self._shutdown(ConnectionLost(
                f"connection {self.name} closed by peer with {self._decoder.buffered} bytes "
                "of its requests not handled"))
            return
        try:
            self._decoder.eof()
        except RemoteProtocolError as exc:
            self._fail_protocol(exc)
            return
        received = self._state.goaway_received
        why = f" ({received})" if received else ""
        self._shutdown(ConnectionLost(f"connection {self.name} closed by peer{why}"))

    def _on_lost(self, exc: BaseException | None) -> None:
        if self._lingering:
            self._lingering = False
            assert self._guard is not None
            self._guard.budget.lingering -= 1
        if not self._closed:
            if exc is None:
                self._on_eof()
            else:
                self._shutdown(ConnectionLost(f"connection {self.name} lost: {exc}"))
        self._transport_gone.set()

    def _fail_protocol(self, exc: RemoteProtocolError) -> None:
        """Corruption or a protocol violation: nothing more from this byte stream can be
        trusted, so close it; pending calls fail with ConnectionLost caused by ``exc``."""
        if self._established:
            log.warning("closing Aether connection %s: %s", self.name, exc)
        else:  # an unauthenticated peer: one log line each would let it flood the log
            log.debug("closing unauthenticated Aether connection %s: %s", self.name, exc)
        if self._guard is not None:
            self._guard.stats.close("protocol_error")
        self._protocol_error = exc
        self._send_goaway(f"protocol error: {exc.message}")
        err = ConnectionLost(f"connection {self.name} closed: the peer sent invalid data "
                             f"({exc.message})")
        err.__cause__ = exc
        self._shutdown(err)

    def _shutdown(self, err: BaseException, *, linger: bool = False) -> None:
        """Close: fail pending calls with ``err``, cancel handlers, release buffers.
        ``linger``: half-close and discard what the peer still sends for up to
        CLOSE_LINGER seconds, so a final GOAWAY is not overtaken by the RST the kernel
        sends when a socket is closed with unread input."""
        if self._closed:
            return
        self._closed = True
        self._close_error = err
        # Whatever the peer left half-sent is garbage now: free it at once (a Connection
        # and its AetherProtocol refer to each other, so without this a partial 16 MiB
        # frame would wait for the cyclic garbage collector).
        self._decoder.release()
        if self._guard is not None:
            self._cancel_watch()
            self._guard.budget.hold(self, 0)
            self._held = 0
            self._partial_since = None
        buf = self._wbuf
        if buf:  # a final GOAWAY or replies already produced
            try:
                self._transport.writelines(buf)
            except Exception:  # noqa: BLE001, S110 - the socket is already gone
                pass
            buf.clear()
            self._wbytes = 0
        self._parked.clear()
        self._parked_bytes = 0
        self._push_credit.clear()
        hooks = self._written_hooks + [h for hs in self._parked_hooks.values() for h in hs] \
            + [h for hs in self._reply_hooks.values() for h in hs]
        self._written_hooks, self._parked_hooks, self._reply_hooks = [], {}, {}
        _run_hooks(hooks)
        pending = self._state.close()
        self._pending = self._state.pending
        for sid, slot in pending.items():
            _reject(slot, sid, err)
        duplex, self._duplex = self._duplex, {}
        for d in duplex.values():
            d._on_reset(err)
        tasks, self._tasks = self._tasks, {}
        for t in tasks.values():
            t.cancel()
        self._dying.extend(tasks.values())
        try:
            tr = self._transport
            g = self._guard
            if (linger and g is not None and self._writer is None
                    and g.budget.lingering < MAX_LINGERING and tr.can_write_eof()):
                g.budget.lingering += 1
                self._lingering = True
                tr.write_eof()         # GOAWAY, then FIN; reading goes on (data dropped)
                if self._pause:
                    tr.resume_reading()
                self._loop.call_later(CLOSE_LINGER, tr.abort)
            else:
                tr.close()
                if tr.get_write_buffer_size():
                    # A peer that stopped reading must not keep the socket (and
                    # wait_closed) alive forever.
                    self._loop.call_later(CLOSE_LINGER, tr.abort)
        except Exception:  # noqa: BLE001, S110 - the socket is already gone
            pass
        w, self._pump_waiter = self._pump_waiter, None
        if w is not None and not w.done():
            w.set_result(None)
        self._closed_event.set()
        for cb in self._close_callbacks:
            cb(self)
        pump = self._pump
        if pump is not None and pump is not asyncio.current_task() and not pump.done():
            pump.cancel()

    async def _pump_reader(self, reader: asyncio.StreamReader) -> None:
        """Stream-pair connections: read into the same path the Protocol feeds."""
        try:
            while not self._closed:
                data = await reader.read(READ_CHUNK)
                if not data:
                    self._on_eof()
                    break
                self._on_data(data)
                while self._pause and not self._closed:
                    self._pump_waiter = self._loop.create_future()
                    await self._pump_waiter
        except (ConnectionError, OSError) as exc:
            self._shutdown(ConnectionLost(f"connection {self.name} lost: {exc}"))
        except asyncio.CancelledError:
            self._shutdown(ConnectionLost(f"connection {self.name} closed"))
            raise
        finally:
            self._transport_gone.set()


class AetherProtocol(asyncio.Protocol):
    """Feeds a :class:`Connection` straight from transport callbacks (no reader task)."""

    def __init__(self, *, router: Router | None, dialer: bool, max_frame: int, name: str,
                 on_connection: Callable[[Connection], None] | None = None,
                 guard: Guard | None = None) -> None:
        self._args = (router, dialer, max_frame, name)
        self._guard = guard
        self._on_connection = on_connection
        self.conn: Connection | None = None
        self._write_paused = False
        # The transport is paused only for Connection._watch_drain (its buffer is under
        # the high-water mark): writers and reading go on.
        self._watch_paused = False
        self._write_waiters: list[asyncio.Future[None]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        router, dialer, max_frame, name = self._args
        self.conn = Connection._over_transport(
            transport, self, router=router, dialer=dialer,  # type: ignore[arg-type]
            max_frame=max_frame, name=name, guard=self._guard)
        if self._on_connection is not None:
            self._on_connection(self.conn)

    def data_received(self, data: bytes) -> None:
        self.conn._on_data(data)  # type: ignore[union-attr]

    def eof_received(self) -> bool:
        self.conn._on_eof()  # type: ignore[union-attr]
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._write_paused = self._watch_paused = False
        self._wake_writers(exc)
        if self.conn is not None:
            self.conn._on_lost(exc)

    def pause_writing(self) -> None:
        conn = self.conn
        if conn is not None and conn._drain_watch and \
                conn._transport.get_write_buffer_size() <= conn._write_high:
            self._watch_paused = True
            return
        self._pause_for_real()

    def _pause_for_real(self) -> None:
        self._watch_paused = False
        self._write_paused = True
        if self.conn is not None:
            self.conn._on_write_paused()

    def resume_writing(self) -> None:
        self._write_paused = self._watch_paused = False
        self._wake_writers(None)
        if self.conn is not None:
            self.conn._on_write_resumed()

    def _wake_writers(self, exc: Exception | None) -> None:
        waiters, self._write_waiters = self._write_waiters, []
        for w in waiters:
            if not w.done():
                if exc is None:
                    w.set_result(None)
                else:
                    w.set_exception(ConnectionLost(f"connection lost while writing: {exc}"))

    async def _wait_writable(self) -> None:
        if not self._write_paused:
            return
        w = asyncio.get_running_loop().create_future()
        self._write_waiters.append(w)
        await w
