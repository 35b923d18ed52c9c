"""How the SDK reaches an apiserver: REST over httpx, or the Aether gateway.

Both transports expose the same async methods with the same types, so the SDK core
(:mod:`dsec.client.core`) does not know which one it talks through. Every failure leaves
here as a :class:`~dsec.errors.DsecError`: HTTP error bodies and Aether error frames are
rebuilt as the class the server raised, and httpx/OS errors become
:class:`~dsec.errors.TransportError` / :class:`~dsec.errors.RequestTimeout` naming the
*request* timeout (never confused with a command timeout, which is a result).

A failed connection says whether the request got out: :class:`~dsec.errors.ConnectFailed`
when it could not connect (nothing was sent, nothing happened) and
:class:`~dsec.errors.ConnectionLost` when the connection died with the request on it
(it may have been carried out: for an exec, ``detail["may_have_run"]`` is True and the
message says to check before running the command again).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import EllipsisType
from typing import Any, Protocol, TypeVar

import httpx
import msgspec

from dsec.errors import (
    ConnectFailed,
    ConnectionLost,
    DsecError,
    RemoteProtocolError,
    RequestTimeout,
    error_from_wire,
)
from dsec.wire import ops
from dsec.wire.api import (
    ExecStreamLine,
    Info,
)
from dsec.wire.calls import (
    Empty,
)
from dsec.wire.files import FileEvent, WatchEnd
from dsec.wire.jsonform import run_item, stream_item
from dsec.wire.ops import (
    USE_CLIENT_DEFAULT,
    Deadline,
    Op,
    StreamOp,
    TunnelOp,
    UploadOp,
    UseClientDefault,
)
from dsec.wire.process import ProcessRunLine
from dsec.wire.rest import decode_reply, encode_request
from dsec.wire.spec import FileInfo

__all__ = ["AetherTransport", "HttpTransport", "OpCaller", "Transport"]

_json = msgspec.json.Encoder()

#: Seconds an idle pooled REST connection is kept (below uvicorn's 5 s keep-alive).
KEEPALIVE_EXPIRY_S = 4.0
Req = TypeVar("Req")
Rep = TypeVar("Rep")
Item = TypeVar("Item")


class Transport(Protocol):
    """How the SDK reaches an apiserver: one typed call per operation of the catalogue
    (:mod:`dsec.wire.ops`), and a stream for streaming rows. Two implementations
    (REST and the Aether gateway) and, for tests, :class:`dsec.client.testing.MockTransport`."""

    name: str

    async def call(self, op: Op[Req, Rep], body: Req, *,
                   timeout: Deadline = USE_CLIENT_DEFAULT) -> Rep: ...
    def stream(self, op: StreamOp[Req, Item, Rep], body: Req, *,
               timeout: Deadline = USE_CLIENT_DEFAULT) -> AsyncIterator[Item | Rep]: ...
    def read_stream(self, op: TunnelOp[Req, FileInfo], body: Req
                    ) -> AsyncIterator[bytes | FileInfo]: ...
    async def write_stream(self, op: TunnelOp[Req, FileInfo], body: Req,
                           chunks: AsyncIterator[bytes]) -> FileInfo: ...
    async def close(self) -> None: ...


class OpCaller(Protocol):
    """What a part of the SDK needs of its client (``client.images`` takes one): a typed
    call of a catalogue row, and an upload row with its body as a stream of bytes. The
    client (:class:`~dsec.client.core.AsyncClient`) is one; so can a test double be."""

    async def call(self, op: Op[Req, Rep], body: Req, *, idempotent: bool | None = None,
                   timeout: Deadline = USE_CLIENT_DEFAULT) -> Rep: ...
    async def upload(self, op: UploadOp[Req, Rep], body: Req,
                     chunks: AsyncIterator[bytes]) -> Rep: ...


class HttpTransport:
    """REST over httpx (HTTP/1.1 keep-alive, one pooled client)."""

    name = "http"

    def __init__(self, url: str, api_key: str, *, timeout: float | None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._info: Info | None = None
        self._http = httpx.AsyncClient(
            base_url=self.url, headers={"authorization": f"Bearer {api_key}"},
            timeout=timeout, transport=transport,
            # keepalive_expiry under the server's keep-alive timeout (uvicorn's 5 s):
            # a pooled connection is dropped here before the server closes it, so a
            # request is never sent on a connection being closed (its answer would be
            # lost, and a non-idempotent call such as exec cannot be retried). Also what
            # makes a stopping apiserver's drain safe (GuardedHttpProtocol.shutdown).
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=256,
                                keepalive_expiry=KEEPALIVE_EXPIRY_S))

    async def call(self, op: Op[Req, Rep], body: Req, *,
                   timeout: Deadline = USE_CLIENT_DEFAULT) -> Rep:
        """``op`` over REST (:func:`dsec.wire.rest.encode_request`): its reply, typed by
        the row (a row answering 204 on REST gives None)."""
        r = encode_request(op, body)
        t = self.timeout if isinstance(timeout, UseClientDefault) else timeout
        effect = _COMMAND if op.name in _COMMANDS else "the operation"
        resp = await self._req(r.method, r.path, timeout=t, effect=effect,
                               params=r.params, headers=r.headers, content=r.content)
        reply: Rep = decode_reply(op, resp.content)
        return reply

    async def _req(self, method: str, path: str, *, timeout: float | None | EllipsisType = ...,
                   effect: str = "the operation", **kw: Any) -> httpx.Response:
        t = self.timeout if timeout is ... else timeout
        try:
            resp = await self._http.request(method, path, timeout=t, **kw)
        except httpx.HTTPError as exc:
            raise _http_failure(exc, f"{method} {self.url}{path}", t, effect) from exc
        if resp.status_code >= 400:
            raise _http_error(resp)
        return resp

    async def upload(self, op: UploadOp[Req, Rep], body: Req,
                     chunks: AsyncIterator[bytes]) -> Rep:
        """An upload row over REST: the request laid out by the row, ``chunks`` as the
        raw body (streamed, no request timeout: it may be gigabytes)."""
        r = encode_request(op, body)
        resp = await self._req(r.method, r.path, timeout=None, params=r.params,
                               headers=r.headers, content=chunks)
        reply: Rep = decode_reply(op, resp.content)
        return reply

    async def stream(self, op: StreamOp[Req, Item, Rep], body: Req, *,
                     timeout: Deadline = USE_CLIENT_DEFAULT) -> AsyncIterator[Item | Rep]:
        """A streaming row over REST: NDJSON lines (:mod:`dsec.wire.jsonform`), the
        items, then the final reply."""
        r = encode_request(op, body)
        t = self.timeout if isinstance(timeout, UseClientDefault) else timeout
        if op is ops.FILE_WATCH:
            item_of: Any = _watch_item
        elif op is ops.PROCESS_RUN:
            run_dec = msgspec.json.Decoder(ProcessRunLine)

            def item_of(line: str) -> Any:
                return run_item(run_dec.decode(line))
        else:
            dec = msgspec.json.Decoder(ExecStreamLine)

            def item_of(line: str) -> Any:
                return stream_item(dec.decode(line))
        try:
            async with self._http.stream(r.method, r.path, params=tuple(r.params),
                                         content=r.content,
                                         timeout=t, headers=r.headers) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    raise _http_error(resp)
                async for line in resp.aiter_lines():
                    if not line:
                        continue
                    item: Any = item_of(line)
                    yield item
                    if isinstance(item, op.reply):
                        return
        except httpx.HTTPError as exc:
            raise _http_failure(exc, f"{op.name} {r.path}", t, _COMMAND) from exc

    async def read_stream(self, op: TunnelOp[Req, FileInfo], body: Req
                          ) -> AsyncIterator[bytes | FileInfo]:
        """A streamed file read over REST: the raw body as it arrives (httpx reads the
        socket as the caller iterates: TCP's window is the flow control), then the
        file's FileInfo (from the response headers; the body's own length is checked
        against it, so a truncated body is an error, never a short file)."""
        r = encode_request(op, body)
        try:
            async with self._http.stream(r.method, r.path, params=tuple(r.params),
                                         headers=r.headers, timeout=self.timeout) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    raise _http_error(resp)
                async for chunk in resp.aiter_raw():
                    if chunk:
                        yield chunk
                yield _file_info_of(resp.headers)
        except httpx.HTTPError as exc:
            raise _http_failure(exc, f"{op.name} {r.path}", self.timeout,
                                "the operation") from exc

    async def write_stream(self, op: TunnelOp[Req, FileInfo], body: Req,
                           chunks: AsyncIterator[bytes]) -> FileInfo:
        """A streamed file write over REST: ``chunks`` as the raw body (no request
        timeout: it may be gigabytes); the file as written."""
        r = encode_request(op, body)
        resp = await self._req(r.method, r.path, timeout=None, params=r.params,
                               headers=r.headers, content=chunks)
        info: FileInfo = msgspec.json.decode(resp.content, type=FileInfo)
        return info

    async def info(self) -> Info:
        self._info = await self.call(ops.INFO, Empty())
        return self._info

    async def close(self) -> None:
        await self._http.aclose()


_WATCH_LINE = msgspec.json.Decoder(dict[str, Any])


def _watch_item(line: str) -> FileEvent | WatchEnd:
    """One NDJSON line of REST's watch (dsec.control.filedoors.watch_line)."""
    d = _WATCH_LINE.decode(line)
    if "event" in d:
        return msgspec.convert(d["event"], FileEvent)
    if "end" in d:
        return msgspec.convert(d["end"], WatchEnd)
    err = d.get("error") or {}
    raise error_from_wire(str(err.get("code", "internal_error")),
                          str(err.get("message", f"bad watch line {line[:200]!r}")),
                          {"request_id": err.get("request_id")})


def _file_info_of(headers: httpx.Headers) -> FileInfo:
    """REST's streamed read says what it read in trailing headers-as-JSON:
    ``x-dsec-file`` (sent before the body, from the file as opened)."""
    raw = headers.get("x-dsec-file")
    if raw is None:
        raise RemoteProtocolError("the streamed read's answer has no x-dsec-file header "
                                  "(an apiserver of an older release?)")
    info: FileInfo = msgspec.json.decode(raw.encode(), type=FileInfo)
    return info


_COMMAND = "the command"


def _http_failure(exc: httpx.HTTPError, what: str, timeout: float | None,
                  effect: str) -> DsecError:
    """An httpx failure as a dsec error saying whether the request may have happened:
    a failed connect sent nothing; a timeout or a dropped connection may have."""
    may = effect == _COMMAND
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
        return RequestTimeout(
            f"{what} got no answer within the request timeout of {timeout}s "
            f"(Client(timeout=...)); {effect} may still have happened"
            + ("; check its effects before running it again" if may else ""),
            timeout_s=timeout, **({"may_have_run": True} if may else {}))
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return ConnectFailed(
            f"{what} failed: could not connect ({exc!s}; {type(exc).__name__}); nothing "
            f"was sent, so {effect} did not happen; is the apiserver running?",
            **({"may_have_run": False} if may else {}))
    return ConnectionLost(
        f"{what} failed: the connection dropped with the request on it ({exc!s}; "
        f"{type(exc).__name__}); {effect} may have happened"
        + (": check its effects before running it again" if may else "")
        + "; is the apiserver running?", **({"may_have_run": True} if may else {}))


def _http_error(resp: httpx.Response) -> DsecError:
    try:
        body = msgspec.json.decode(resp.content)
        code, message = body["code"], body["message"]
        detail = body.get("detail") or {}
        rid = body.get("request_id")
        if rid:
            detail = {**detail, "request_id": rid}
        return error_from_wire(str(code), str(message), detail)
    except (msgspec.DecodeError, KeyError, TypeError):
        return RemoteProtocolError(f"HTTP {resp.status_code} from {resp.request.url} without a "
                                   f"dsec error body: {resp.text[:200]!r}")


class AetherTransport:
    """The gateway fast path: msgpack over one multiplexed Aether connection, which
    presents the API key once (``aether.auth``); every call is one row of the catalogue,
    :meth:`call` (``api.<op>`` with the row's request and reply types)."""

    name = "aether"

    def __init__(self, address: str, api_key: str, *, timeout: float | None) -> None:
        self.address = address
        self.key = api_key
        self.timeout = timeout
        self._conn: Any = None
        self._lock: Any = None
        self._info: Info | None = None

    async def _c(self) -> Any:
        import asyncio

        from dsec.aether import connect
        if self._conn is not None and not self._conn.closed:
            return self._conn
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._conn is None or self._conn.closed:
                # The gateway admits a connection once it presents an API key.
                self._conn = await connect(self.address, timeout=self.timeout,
                                           token=self.key)
        return self._conn

    async def call(self, op: Op[Req, Rep], body: Req, *,
                   timeout: Deadline = USE_CLIENT_DEFAULT) -> Rep:
        """``op`` through the gateway: its reply, typed by the row. A connection lost
        with the request on it says whether it may have happened (``op.effect``)."""
        conn = await self._c()
        t = self.timeout if isinstance(timeout, UseClientDefault) else timeout
        effect = _COMMAND if op.name in _COMMANDS else "the operation"
        try:
            reply: Rep = await conn.call(op.api_method, body, timeout=t,
                                         response_type=op.reply)
        except ConnectionLost as exc:
            if exc.detail.get("retryable"):
                raise  # the peer never processed it (GOAWAY): nothing happened
            raise _aether_lost(exc, op.api_method, self.address, effect) from exc
        except RequestTimeout as exc:
            if effect != _COMMAND:
                raise
            raise RequestTimeout(f"{exc.message}; the command may still have run: check "
                                 "its effects before running it again",
                                 **{**exc.detail, "may_have_run": True}) from exc
        return reply

    async def stream(self, op: StreamOp[Req, Item, Rep], body: Req, *,
                     timeout: Deadline = USE_CLIENT_DEFAULT) -> AsyncIterator[Item | Rep]:
        """A streaming row through the gateway: STREAM frames, then the final reply."""
        conn = await self._c()
        t = self.timeout if isinstance(timeout, UseClientDefault) else timeout
        s = conn.stream(op.api_method, body, timeout=t, item_type=op.item,
                        response_type=op.reply)
        try:
            async with s:
                async for item in s:
                    yield item
                yield s.result
        except ConnectionLost as exc:
            if exc.detail.get("retryable"):
                raise
            raise _aether_lost(exc, op.api_method, self.address, _COMMAND) from exc

    async def read_stream(self, op: TunnelOp[Req, FileInfo], body: Req
                          ) -> AsyncIterator[bytes | FileInfo]:
        """A streamed file read through the gateway: a duplex stream whose bytes arrive
        under this side's credit (at most one 256 KiB window is buffered here, however
        slowly the caller iterates), then the file's FileInfo."""
        conn = await self._c()
        s = conn.duplex(op.api_method, body, response_type=op.reply)
        try:
            s.close_write()
            while chunk := await s.recv():
                yield chunk
            yield await s.result()
        except ConnectionLost as exc:
            raise _aether_lost(exc, op.api_method, self.address, "the operation") from exc
        finally:
            s.reset("the reader stopped")   # a no-op once the call is over

    async def write_stream(self, op: TunnelOp[Req, FileInfo], body: Req,
                           chunks: AsyncIterator[bytes]) -> FileInfo:
        """A streamed file write through the gateway: ``chunks`` as a duplex stream
        (each ``send`` waits for the gateway's credit), FIN, then the file as written."""
        conn = await self._c()
        s = conn.duplex(op.api_method, body, response_type=op.reply)
        try:
            async for chunk in chunks:
                if chunk:
                    await s.send(chunk)
            s.close_write()
            info: FileInfo = await s.result()
            return info
        except ConnectionLost as exc:
            raise _aether_lost(exc, op.api_method, self.address, "the operation") from exc
        finally:
            s.reset("the writer stopped")

    async def info(self) -> Info:
        self._info = await self.call(ops.INFO, Empty())
        return self._info

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None


# Operations whose lost answer means "the command may have run" (the wording says so).
_COMMANDS = frozenset({"exec", "exec_many", "exec_stream"})


def _aether_lost(exc: ConnectionLost, method: str, address: str, effect: str) -> ConnectionLost:
    """The gateway connection died with ``method`` on it: say it may have happened."""
    may = effect == _COMMAND
    return ConnectionLost(
        f"{method} via the gateway at {address}: the connection dropped with the request "
        f"on it ({exc.message}); {effect} may have happened"
        + (": check its effects before running it again" if may else ""),
        **({"may_have_run": True} if may else {}))
