"""The apiserver's proxy to exposed ports: ``/v1/proxy/{id}/{port}/{path}``.

The REST form of the edge's duplex row ``port_connect`` (docs/networking.md, "Ports"):
each HTTP request (or WebSocket session) that arrives here is authenticated, then
carried over one Aether duplex stream to the sandbox's edge, which opens a socket
inside the sandbox's network namespace to ``127.0.0.1:port``. Nothing listens on any
node for a sandbox; the edge link (Unix socket locally, TCP + token across hosts) is
the only path, so this works for sandboxes on any edge.

- **Auth**: the URL token (``?dsec_token=``, then a cookie scoped to the port's path
  prefix so the page's relative links work; or the ``X-Dsec-Token`` header), checked in
  constant time by :class:`dsec.net.expose.TokenKey`, or ``Authorization: Bearer <key>``
  of a member of the sandbox's project. A bad token is charged to the client address's
  budget for failed authentication, like a bad key.
- **The sandbox never sees a caller's credentials**: a dsec ``Authorization`` header, the
  token parameter, header and cookie are removed before the request is forwarded;
  ``X-Forwarded-For/Proto/Host/Prefix`` are added.
- **HTTP** is spoken to the sandbox with h11 (sans-IO, already a dependency through
  uvicorn): the request is re-serialised (hop-by-hop headers dropped, ``Connection:
  close``: one tunnel per request), request and response bodies stream both ways under
  the stream's credit, so a slow client only ever stops its own tunnel.
- **WebSocket**: after auth the client's session is bridged to a tunnel; the upstream
  handshake and frames go through ``websockets``' sans-IO client protocol.
- **Limits**: tunnels open through this apiserver at once (``max_tunnels``, beyond:
  503 unavailable); per sandbox and idle ones are the edge's (dsec.wire.ports).
"""

from __future__ import annotations

import asyncio
import logging
import re
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import h11
import msgspec
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.protocol import State
from websockets.uri import parse_uri

from dsec.aether.connection import DuplexStream
from dsec.control.api.service import ApiService, Caller
from dsec.errors import (
    DsecError,
    InternalError,
    InvalidArgument,
    RateLimited,
    RemoteProtocolError,
    Unavailable,
)
from dsec.net.expose import PROXY_PREFIX, TOKEN_PARAM
from dsec.wire.api import ApiError

__all__ = ["PortProxy", "bridge_websocket"]

log = logging.getLogger("dsec.control.proxy")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_PREFIX = PROXY_PREFIX.encode()
_TOKEN_HEADER = b"x-dsec-token"
_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
                  b"proxy-authorization", b"te", b"trailer", b"transfer-encoding",
                  b"upgrade", b"host", _TOKEN_HEADER})
_json = msgspec.json.Encoder()
_TOKEN_IN_URL = re.compile(rb"(?<=[?&])dsec_token=[^&#]*&?")


class _Target:
    """What the path names: sandbox, port, the path inside, and the prefix it came under."""

    __slots__ = ("inner", "port", "prefix", "query", "sid")

    def __init__(self, scope: Scope) -> None:
        raw: bytes = scope.get("raw_path") or scope["path"].encode()
        rest = raw[len(_PREFIX):]
        parts = rest.split(b"/", 2)
        if len(parts) < 2 or not parts[0] or not parts[1].isdigit() or len(parts[1]) > 5:
            raise InvalidArgument(
                f"proxy paths are {PROXY_PREFIX}<sandbox id>/<port>/<path>; got "
                f"{raw[:200].decode('latin-1')!r}")
        self.sid = parts[0].decode("latin-1")
        self.port = int(parts[1])
        self.prefix = f"{PROXY_PREFIX}{self.sid}/{self.port}"
        self.inner = b"/" + (parts[2] if len(parts) > 2 else b"")
        self.query = [(k, v) for k, v in urllib.parse.parse_qsl(
            scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)]


def _strip_cookie(value: bytes) -> tuple[bytes, str | None]:
    """The Cookie header without ``dsec_token``, and that token if it was there."""
    keep: list[str] = []
    token = None
    for part in value.decode("latin-1").split(";"):
        name, _, v = part.strip().partition("=")
        if name == TOKEN_PARAM:
            token = v
        elif part.strip():
            keep.append(part.strip())
    return "; ".join(keep).encode("latin-1"), token


class PortProxy:
    """ASGI handler for ``/v1/proxy/...`` (http and websocket scopes)."""

    def __init__(self, service: ApiService, *, max_tunnels: int = 4096,
                 max_head_bytes: int = 64 * 1024) -> None:
        self.service = service
        self.max_tunnels = max_tunnels
        self.max_head_bytes = max_head_bytes
        self.open = 0          # tunnels open through this apiserver now

    # ------------------------------------------------------------------ auth
    async def _tunnel(self, scope: Scope, t: _Target) -> tuple[DuplexStream, list[
            tuple[bytes, bytes]], str | None]:
        """Authenticate and open the tunnel; the headers to forward and, when the token
        came in the query, the token (to set as a cookie)."""
        token: str | None = None
        from_query = None
        auth: str | None = None
        fwd: list[tuple[bytes, bytes]] = []
        for k, v in scope["headers"]:
            if k == _TOKEN_HEADER:
                token = v.decode("latin-1")
            elif k == b"authorization":
                auth = v.decode("latin-1")
                if not auth.lower().startswith("bearer dsk_"):
                    fwd.append((k, v))     # the sandbox's own auth scheme: pass it on
                    auth = None
            elif k == b"referer":
                # a page opened from the URL with ?dsec_token= sends it on as its Referer
                fwd.append((k, _TOKEN_IN_URL.sub(b"", v)))
            elif k == b"cookie":
                rest, cookie_token = _strip_cookie(v)
                if cookie_token and token is None:
                    token = cookie_token
                if rest:
                    fwd.append((k, rest))
            elif k not in _HOP:
                fwd.append((k, v))
        for k, v in t.query:
            if k == TOKEN_PARAM:
                token = from_query = v
        if self.open >= self.max_tunnels:
            # Unavailable, not Overloaded: that one is a TransportError, which the
            # apiserver's redaction takes for its own broken link to an edge.
            raise Unavailable(f"this apiserver has {self.open} proxy tunnels open (the "
                              f"limit is {self.max_tunnels}); retry later",
                              limit=self.max_tunnels)
        client = scope.get("client")
        peer = client[0] if client and isinstance(client[0], str) and client[0] else None
        svc = self.service
        caller: Caller | None = None
        if token is None and auth is not None:
            caller = svc.authenticate(auth, peer)
        stream = await svc.port_tunnel(t.sid, t.port, caller=caller, token=token,
                                       client=peer)
        host = next((v for k, v in scope["headers"] if k == b"host"), b"")
        fwd += [(b"x-forwarded-for", (peer or "").encode()),
                (b"x-forwarded-proto", scope.get("scheme", "http").encode()),
                (b"x-forwarded-host", host), (b"x-forwarded-prefix", t.prefix.encode())]
        return stream, fwd, from_query

    # ------------------------------------------------------------------ ASGI
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await bridge_websocket(self, scope, receive, send)
            return
        started = False
        stream: DuplexStream | None = None

        async def start(status: int, headers: list[tuple[bytes, bytes]]) -> None:
            nonlocal started
            started = True
            await send({"type": "http.response.start", "status": status,
                        "headers": headers})

        try:
            t = _Target(scope)
            stream, fwd, from_query = await self._tunnel(scope, t)
            self.open += 1
            try:
                await self._http(scope, receive, t, stream, fwd, from_query, start, send)
            finally:
                self.open -= 1
                stream.reset("ended by the proxy")
        except Exception as exc:  # noqa: BLE001 - every failure becomes an answer
            if stream is not None and not stream.done:
                stream.reset("ended by the proxy")
            if started:
                # Mid-response: the client's connection is all there is left to cut.
                log.info("proxy to %s ended mid-response: %s", scope.get("path"), exc)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            await self._error(send, exc)

    async def _error(self, send: Send, exc: BaseException) -> None:
        if not isinstance(exc, DsecError):
            log.exception("proxy request failed")
            exc = InternalError(f"proxy failed ({type(exc).__name__})")
        svc = self.service
        exc = svc.redact(exc)
        body = _json.encode(ApiError(code=exc.code, message=exc.message, request_id="",
                                     detail={}))
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        if isinstance(exc, RateLimited):
            headers.append((b"retry-after", b"1"))
        await send({"type": "http.response.start", "status": exc.http_status,
                    "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _http(self, scope: Scope, receive: Receive, t: _Target, stream: DuplexStream,
                    fwd: list[tuple[bytes, bytes]], from_query: str | None,
                    start: Callable[[int, list[tuple[bytes, bytes]]], Awaitable[None]],
                    send: Send) -> None:
        h = h11.Connection(our_role=h11.CLIENT)
        query = urllib.parse.urlencode([(k, v) for k, v in t.query if k != TOKEN_PARAM])
        target = t.inner + (b"?" + query.encode("latin-1") if query else b"")
        first = await receive()
        body = first.get("body", b"")
        more = first.get("more_body", False)
        has_length = any(k == b"content-length" for k, _ in fwd)
        headers = [(b"host", f"127.0.0.1:{t.port}".encode()), *fwd,
                   (b"connection", b"close")]
        if not has_length and (body or more):
            headers.append((b"transfer-encoding", b"chunked"))
        await stream.send(h.send(h11.Request(method=scope["method"], target=target,
                                             headers=headers)))

        async def upload() -> None:
            nonlocal body, more
            while True:
                if body:
                    await stream.send(h.send(h11.Data(data=body)))
                if not more:
                    break
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    stream.reset("the client went away")
                    return
                body, more = msg.get("body", b""), msg.get("more_body", False)
            await stream.send(h.send(h11.EndOfMessage()))

        up = asyncio.create_task(upload())
        try:
            await self._download(h, stream, t, from_query, start, send)
        finally:
            up.cancel()
            await asyncio.gather(up, return_exceptions=True)

    async def _download(self, h: h11.Connection, stream: DuplexStream, t: _Target,
                        from_query: str | None,
                        start: Callable[[int, list[tuple[bytes, bytes]]], Awaitable[None]],
                        send: Send) -> None:
        head = 0
        while True:
            try:
                ev = h.next_event()
            except h11.RemoteProtocolError as exc:
                raise RemoteProtocolError(
                    f"the server on port {t.port} of sandbox {t.sid} answered something "
                    f"that is not HTTP/1.1: {exc}") from exc
            if ev is h11.NEED_DATA:
                data = await stream.recv()
                if not data and h.their_state is h11.SEND_RESPONSE:
                    raise Unavailable(
                        f"the server on port {t.port} of sandbox {t.sid} closed the "
                        "connection without an answer", port=t.port)
                head += len(data)
                if h.their_state is h11.SEND_RESPONSE and head > self.max_head_bytes:
                    raise RemoteProtocolError(
                        f"the response head from port {t.port} of sandbox {t.sid} is over "
                        f"{self.max_head_bytes} bytes")
                h.receive_data(data)
                continue
            if isinstance(ev, h11.InformationalResponse):
                continue
            if isinstance(ev, h11.Response):
                # hop-by-hop headers are this hop's; date and server the ASGI server's
                out = [(k.lower(), v) for k, v in ev.headers
                       if k.lower() not in (b"connection", b"keep-alive", b"transfer-encoding",
                                            b"date", b"server")]
                if from_query is not None:
                    out.append((b"set-cookie", (
                        f"{TOKEN_PARAM}={from_query}; Path={t.prefix}/; HttpOnly; "
                        "SameSite=Lax").encode("latin-1")))
                await start(ev.status_code, out)
            elif isinstance(ev, h11.Data):
                await send({"type": "http.response.body", "body": bytes(ev.data),
                            "more_body": True})
            elif isinstance(ev, (h11.EndOfMessage, h11.ConnectionClosed)):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return


# ------------------------------------------------------------------ WebSocket
# The client's ASGI ``websocket`` scope bridged to a tunnel; the upstream handshake and
# frames through websockets' sans-IO client protocol (installed with uvicorn[standard];
# no thread, no socket of its own: its bytes ride the Aether duplex stream).
async def _close(scope: Scope, send: Send, exc: BaseException) -> None:
    """Refuse a WebSocket session: with the server's ``websocket.http.response``
    extension (uvicorn has it) the same JSON error and status as over HTTP; else a close
    frame (1008 for auth failures, 1011 for the rest) whose reason says why."""
    if not isinstance(exc, DsecError):
        exc = InternalError(f"proxy failed ({type(exc).__name__})")
    if "websocket.http.response" in scope.get("extensions", {}):
        body = _json.encode(ApiError(code=exc.code, message=exc.message, request_id="",
                                     detail={}))
        await send({"type": "websocket.http.response.start", "status": exc.http_status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "websocket.http.response.body", "body": body})
        return
    code = 1008 if exc.http_status in (401, 403, 404) else 1011
    await send({"type": "websocket.close", "code": code,
                "reason": f"{exc.code}: {exc.message}"[:120]})


async def bridge_websocket(proxy: PortProxy, scope: Scope, receive: Receive,
                           send: Send) -> None:
    first = await receive()        # websocket.connect
    if first["type"] != "websocket.connect":
        return
    try:
        t = _Target(scope)
        stream, fwd, _ = await proxy._tunnel(scope, t)
    except Exception as exc:  # noqa: BLE001 - refused: say why in the close frame
        await _close(scope, send, exc)
        return
    proxy.open += 1
    try:
        proto = ClientProtocol(parse_uri(f"ws://127.0.0.1:{t.port}{t.inner.decode('latin-1')}"))
        req = proto.connect()
        skip = {"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions"}
        for k, v in fwd:
            name = k.decode("latin-1")
            if name not in skip:
                req.headers[name] = v.decode("latin-1")
        proto.send_request(req)
        await stream.send(b"".join(proto.data_to_send()))
        # Handshake: until the upstream's response.
        response: Response | None = None
        pending: list[Frame] = []
        while response is None:
            data = await stream.recv()
            if not data:
                raise Unavailable(f"the server on port {t.port} of sandbox {t.sid} closed "
                                  "the connection during the WebSocket handshake")
            proto.receive_data(data)
            for ev in proto.events_received():
                if isinstance(ev, Response):
                    response = ev
                elif isinstance(ev, Frame):
                    pending.append(ev)
        if proto.state is not State.OPEN:
            raise Unavailable(f"the server on port {t.port} of sandbox {t.sid} refused the "
                              f"WebSocket handshake ({response.status_code})")
        await send({"type": "websocket.accept",
                    "subprotocol": response.headers.get("Sec-WebSocket-Protocol")})
    except Exception as exc:  # noqa: BLE001
        proxy.open -= 1
        stream.reset("ended by the proxy")
        await _close(scope, send, exc)
        return

    async def flush() -> None:
        out = proto.data_to_send()
        if out:
            data = b"".join(out)
            if data:
                await stream.send(data)

    async def from_client() -> None:
        while True:
            msg = await receive()
            if msg["type"] == "websocket.receive":
                if msg.get("text") is not None:
                    proto.send_text(msg["text"].encode())
                else:
                    proto.send_binary(msg.get("bytes") or b"")
                await flush()
            else:   # websocket.disconnect
                proto.send_close(msg.get("code", 1000))
                await flush()
                return

    async def from_sandbox() -> None:
        parts: list[bytes] = []
        text = False
        events: list[Frame] = pending
        while True:
            for ev in events:
                op = ev.opcode
                if op in (Opcode.TEXT, Opcode.BINARY):
                    text, parts = op is Opcode.TEXT, [bytes(ev.data)]
                elif op is Opcode.CONT:
                    parts.append(bytes(ev.data))
                elif op is Opcode.CLOSE:
                    await send({"type": "websocket.close", "code": 1000})
                    return
                else:
                    continue       # ping/pong: the protocol answers pings itself
                if ev.fin:
                    payload = b"".join(parts)
                    parts = []
                    await send({"type": "websocket.send", "text": payload.decode()}
                               if text else {"type": "websocket.send", "bytes": payload})
            await flush()          # pongs, close replies
            data = await stream.recv()
            if not data:
                await send({"type": "websocket.close", "code": 1001})
                return
            proto.receive_data(data)
            events = [ev for ev in proto.events_received() if isinstance(ev, Frame)]

    tasks = [asyncio.create_task(from_client()), asyncio.create_task(from_sandbox())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        proxy.open -= 1
        stream.reset("ended by the proxy")
