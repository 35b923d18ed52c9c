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
- **The sandbox never sees a caller's credentials**: ``Authorization`` (whatever its
  scheme: :func:`~dsec.control.api.service.api_key_of` takes a bare key too, so no
  prefix test can tell a key from the sandbox's own auth) and ``Proxy-Authorization``,
  the token parameter and header, and the ``Cookie`` header (every cookie of the
  apiserver's origin is dsec's: a sandbox cannot set any, below) are removed before
  the request is forwarded; ``X-Forwarded-For/Proto/Host/Prefix`` are replaced by ours.
- **A sandbox's page cannot act on the apiserver's origin**: every port is served from
  that one origin, so the response headers that act on the whole origin (cookies,
  ``Clear-Site-Data``, HSTS, ``Alt-Svc``, NEL/reporting, service-worker scope, CORS
  grants) are dropped, and every response carries ``Content-Security-Policy: sandbox``
  without ``allow-same-origin``: the page runs in an opaque origin, so its script
  cannot read another port's answers, the user's cookies or the origin's storage.
  A browser's service-worker script fetch (``Service-Worker: script``) is refused.
- **HTTP** is spoken to the sandbox with h11 (sans-IO, already a dependency through
  uvicorn): the request is re-serialised (hop-by-hop headers dropped, ``Connection:
  close``: one tunnel per request), request and response bodies stream both ways under
  the stream's credit, so a slow client only ever stops its own tunnel.
- **WebSocket**: after auth the client's session is bridged to a tunnel; the upstream
  handshake and frames go through ``websockets``' sans-IO client protocol.
- **Limits**: tunnels open through this apiserver at once (``max_tunnels``, beyond:
  503 unavailable), and each sandbox's, project's and client address's share of them
  (:class:`TunnelShares`, beyond: 429 naming the share), so one tenant holding idle
  tunnels cannot make every other tenant's ports answer 503; an HTTP tunnel with no
  byte either way for ``idle_s`` (30 s) is reclaimed (504). Per sandbox and idle ones
  at the edge too (dsec.wire.ports).
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import h11
import msgspec
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.protocol import State
from websockets.uri import parse_uri

from dsec.aether.connection import DuplexStream
from dsec.control.api.service import ApiService, Caller, api_key_of
from dsec.errors import (
    DsecError,
    InternalError,
    InvalidArgument,
    PermissionDenied,
    RateLimited,
    RemoteProtocolError,
    Timeout,
    Unauthenticated,
    Unavailable,
)
from dsec.net.expose import PROXY_PREFIX, TOKEN_PARAM
from dsec.wire.api import ApiError
from dsec.wire.ports import MAX_TUNNELS_PER_SANDBOX

__all__ = ["PortProxy", "TunnelShares", "bridge_websocket", "inbound_headers",
           "outbound_headers"]

log = logging.getLogger("dsec.control.proxy")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_PREFIX = PROXY_PREFIX.encode()
_TOKEN_HEADER = b"x-dsec-token"
# Request headers never forwarded: this hop's, the caller's credentials (Authorization
# in any scheme, Proxy-Authorization, our token header, every cookie of the apiserver's
# origin), and forwarding headers a client could forge (ours replace them).
_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
                  b"proxy-authorization", b"te", b"trailer", b"transfer-encoding",
                  b"upgrade", b"host", _TOKEN_HEADER, b"authorization", b"cookie",
                  b"forwarded", b"x-forwarded-for", b"x-forwarded-proto",
                  b"x-forwarded-host", b"x-forwarded-prefix", b"x-real-ip"})
# Response headers a sandbox must not send: hop-by-hop ones (this hop's), date and
# server (the ASGI server's), and every header that acts on the apiserver's whole
# origin rather than on the answered path, which all exposed ports share: cookies (a
# sandbox would plant or overwrite another port's token cookie), Clear-Site-Data
# (wipes the origin), HSTS and Alt-Svc (where the origin is reached), NEL/Report-To
# (the origin's error reports, URLs with tokens included, sent to the sandbox's
# collector), Accept-CH/Critical-CH (persisted per origin), Service-Worker-Allowed
# (widens a worker's scope to the origin) and the credentialed CORS grant.
_RESPONSE_DROP = frozenset({
    b"connection", b"keep-alive", b"transfer-encoding", b"proxy-connection", b"upgrade",
    b"trailer", b"date", b"server",
    b"set-cookie", b"set-cookie2", b"clear-site-data", b"strict-transport-security",
    b"alt-svc", b"nel", b"report-to", b"reporting-endpoints", b"accept-ch",
    b"critical-ch", b"service-worker-allowed", b"access-control-allow-credentials",
    b"access-control-allow-private-network", b"origin-agent-cluster"})
#: Sent with every proxied answer. ``sandbox`` without ``allow-same-origin``: the page
#: runs in an opaque origin (its script and forms work; it cannot read the apiserver's
#: cookies or storage, nor, same-origin, another port's answers). Browsers enforce each
#: CSP header a response carries, so a sandbox's own CSP can only narrow this one.
CSP_SANDBOX = (b"sandbox allow-scripts allow-forms allow-popups allow-modals "
               b"allow-downloads")
_json = msgspec.json.Encoder()


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


def _cookie_token(value: bytes) -> str | None:
    """The ``dsec_token`` of a Cookie header, if it holds one."""
    for part in value.decode("latin-1").split(";"):
        name, _, v = part.strip().partition("=")
        if name == TOKEN_PARAM:
            return v
    return None


def _without_token(url: bytes) -> bytes:
    """``url`` without any ``dsec_token`` query parameter (names compared decoded, as
    the proxy reads them: ``dsec%5Ftoken`` too)."""
    text = url.decode("latin-1")
    parts = urllib.parse.urlsplit(text)
    if not parts.query:
        return url
    keep = [(k, v) for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
            if k != TOKEN_PARAM]
    return parts._replace(query=urllib.parse.urlencode(keep)).geturl().encode("latin-1")


@dataclass(slots=True)
class Inbound:
    """A request's headers sorted: what is forwarded, the URL token and the API key's
    ``Authorization`` value (None when absent or not a dsec credential)."""

    fwd: list[tuple[bytes, bytes]]
    token: str | None
    authorization: str | None


def inbound_headers(headers: Iterable[tuple[bytes, bytes]]) -> Inbound:
    """Pure: split a client's request headers (lower-case names, as ASGI gives them).
    ``Authorization`` is never forwarded whatever its scheme or spelling; it is the
    caller's credential when :func:`api_key_of` (the apiserver's own parser) accepts it.
    A browser fetching a service-worker script is refused: a worker registered on the
    apiserver's origin would intercept every port's traffic."""
    token: str | None = None
    authorization: str | None = None
    fwd: list[tuple[bytes, bytes]] = []
    for k, v in headers:
        if k == _TOKEN_HEADER:
            token = v.decode("latin-1")
        elif k == b"authorization":
            text = v.decode("latin-1")
            try:
                api_key_of(text)
            except Unauthenticated:
                continue            # another scheme: not ours, and not forwarded either
            authorization = text
        elif k == b"cookie":
            cookie_token = _cookie_token(v)
            if cookie_token is not None and token is None:
                token = cookie_token
        elif k == b"referer":
            # a page opened from the URL with ?dsec_token= sends it on as its Referer
            fwd.append((k, _without_token(v)))
        elif k == b"service-worker":
            raise PermissionDenied(
                "service workers cannot be registered through an exposed port: every "
                "port shares the apiserver's origin (serve the page without one)")
        elif k not in _HOP:
            fwd.append((k, v))
    return Inbound(fwd, token, authorization)


def outbound_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Pure: a sandbox's response headers as the client gets them: the origin-wide and
    hop-by-hop ones dropped (``_RESPONSE_DROP``; ``Access-Control-Allow-Origin`` kept
    only as ``*``, which never grants a credentialed read; a ``Link`` naming a service
    worker dropped) and ``Content-Security-Policy: sandbox`` added."""
    out: list[tuple[bytes, bytes]] = []
    for k, v in headers:
        k = k.lower()
        if k in _RESPONSE_DROP:
            continue
        if k == b"access-control-allow-origin" and v.strip() != b"*":
            continue
        if k == b"link" and b"serviceworker" in v.lower():
            continue
        out.append((k, v))
    out.append((b"content-security-policy", CSP_SANDBOX))
    return out


@dataclass(slots=True)
class Lease:
    """One tunnel's place in the shares, given back once (``TunnelShares.release``)."""

    sandbox: str
    project: str
    client: str
    released: bool = False


@dataclass(slots=True)
class TunnelShares:
    """The apiserver's tunnels: ``total`` at once, and the share one sandbox, one
    project and one client address may hold of them (None: derived from ``total``:
    an eighth per sandbox, a quarter per project and per client address; never more
    per sandbox than its edge takes, ``MAX_TUNNELS_PER_SANDBOX``). Pure counting; the
    refusal names the share that was hit and its value."""

    total: int
    per_sandbox: int | None = None
    per_project: int | None = None
    per_client: int | None = None
    open: int = 0
    by_sandbox: Counter[str] = field(default_factory=Counter)
    by_project: Counter[str] = field(default_factory=Counter)
    by_client: Counter[str] = field(default_factory=Counter)

    def limits(self) -> tuple[int, int, int]:
        """(per sandbox, per project, per client address), as now in force."""
        sb = self.per_sandbox if self.per_sandbox is not None else min(
            MAX_TUNNELS_PER_SANDBOX, max(1, self.total // 8))
        pj = self.per_project if self.per_project is not None else max(1, self.total // 4)
        cl = self.per_client if self.per_client is not None else max(1, self.total // 4)
        return sb, pj, cl

    def check_total(self) -> None:
        if self.open >= self.total:
            # Unavailable, not Overloaded: that one is a TransportError, which the
            # apiserver's redaction takes for its own broken link to an edge.
            raise Unavailable(f"this apiserver has {self.open} proxy tunnels open (the "
                              f"limit is {self.total}, RestConfig.max_proxy_tunnels); "
                              "retry later", limit=self.total)

    def take(self, sandbox: str, project: str, client: str) -> Lease:
        self.check_total()
        sb, pj, cl = self.limits()
        for what, name, counter, cap, knob in (
                ("sandbox", sandbox, self.by_sandbox, sb, "proxy_tunnels_per_sandbox"),
                ("project", project, self.by_project, pj, "proxy_tunnels_per_project"),
                ("client address", client, self.by_client, cl, "proxy_tunnels_per_client")):
            if counter[name] >= cap:
                raise RateLimited(
                    f"{what} {name[:64]!r} holds {counter[name]} proxy tunnels through this "
                    f"apiserver: its share is {cap} of {self.total} (RestConfig.{knob}); "
                    "close some, or retry later", limit=cap, share=what, retry_after=1.0)
        self.open += 1
        self.by_sandbox[sandbox] += 1
        self.by_project[project] += 1
        self.by_client[client] += 1
        return Lease(sandbox, project, client)

    def release(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        self.open -= 1
        for counter, name in ((self.by_sandbox, lease.sandbox),
                              (self.by_project, lease.project),
                              (self.by_client, lease.client)):
            counter[name] -= 1
            if counter[name] <= 0:
                del counter[name]


class PortProxy:
    """ASGI handler for ``/v1/proxy/...`` (http and websocket scopes)."""

    def __init__(self, service: ApiService, *, max_tunnels: int = 4096,
                 per_sandbox: int | None = None, per_project: int | None = None,
                 per_client: int | None = None, idle_s: float = 30.0,
                 max_head_bytes: int = 64 * 1024,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.service = service
        self.shares = TunnelShares(max_tunnels, per_sandbox, per_project, per_client)
        self.idle_s = idle_s
        self.max_head_bytes = max_head_bytes
        self.clock = clock

    @property
    def max_tunnels(self) -> int:
        return self.shares.total

    @max_tunnels.setter
    def max_tunnels(self, value: int) -> None:
        self.shares.total = value

    @property
    def open(self) -> int:
        """Tunnels open through this apiserver now."""
        return self.shares.open

    # ------------------------------------------------------------------ auth
    async def _tunnel(self, scope: Scope, t: _Target) -> tuple[
            DuplexStream, list[tuple[bytes, bytes]], str | None, Lease]:
        """Authenticate, take a place in the shares and open the tunnel; the headers to
        forward, the token when it came in the query (to set as a cookie), and the lease
        (the caller releases it when the tunnel ends)."""
        inb = inbound_headers(scope["headers"])
        token, from_query = inb.token, None
        for k, v in t.query:
            if k == TOKEN_PARAM:
                token = from_query = v
        self.shares.check_total()
        client = scope.get("client")
        peer = client[0] if client and isinstance(client[0], str) and client[0] else None
        svc = self.service
        caller: Caller | None = None
        if token is None and inb.authorization is not None:
            caller = svc.authenticate(inb.authorization, peer)
        lease: list[Lease] = []

        def admit(project: str) -> None:
            lease.append(self.shares.take(t.sid, project, peer or "-"))

        try:
            stream = await svc.port_tunnel(t.sid, t.port, caller=caller, token=token,
                                           client=peer, admit=admit)
        except BaseException:
            for one in lease:
                self.shares.release(one)
            raise
        host = next((v for k, v in scope["headers"] if k == b"host"), b"")
        fwd = [*inb.fwd, (b"x-forwarded-for", (peer or "").encode()),
               (b"x-forwarded-proto", scope.get("scheme", "http").encode()),
               (b"x-forwarded-host", host), (b"x-forwarded-prefix", t.prefix.encode())]
        return stream, fwd, from_query, lease[0]

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
            stream, fwd, from_query, lease = await self._tunnel(scope, t)
            try:
                await self._http(scope, receive, t, stream, fwd, from_query, start, send)
            finally:
                self.shares.release(lease)
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
        # the proxy's own answers carry the same CSP (their message may quote what a
        # sandbox sent) and are never sniffed into a page
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()),
                   (b"content-security-policy", CSP_SANDBOX),
                   (b"x-content-type-options", b"nosniff")]
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
        try:
            # (a client announcing a body and sending none holds its place only so long)
            async with asyncio.timeout(self.idle_s):
                first = await receive()
        except TimeoutError:
            raise self._idle(t) from None
        body = first.get("body", b"")
        more = first.get("more_body", False)
        has_length = any(k == b"content-length" for k, _ in fwd)
        headers = [(b"host", f"127.0.0.1:{t.port}".encode()), *fwd,
                   (b"connection", b"close")]
        if not has_length and (body or more):
            headers.append((b"transfer-encoding", b"chunked"))
        await stream.send(h.send(h11.Request(method=scope["method"], target=target,
                                             headers=headers)))

        last = [self.clock()]

        def touch() -> None:
            last[0] = self.clock()

        async def upload() -> None:
            nonlocal body, more
            while True:
                if body:
                    await stream.send(h.send(h11.Data(data=body)))
                    touch()
                if not more:
                    break
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    stream.reset("the client went away")
                    return
                body, more = msg.get("body", b""), msg.get("more_body", False)
            await stream.send(h.send(h11.EndOfMessage()))

        async def idle() -> None:
            # No byte either way for idle_s: the tunnel is reclaimed (a client that
            # announces a body and never sends it, a server that never answers).
            while (left := last[0] + self.idle_s - self.clock()) > 0:
                await asyncio.sleep(left)

        up = asyncio.create_task(upload())
        down = asyncio.create_task(self._download(h, stream, t, from_query, start, send,
                                                  touch, scope.get("scheme") == "https"))
        dog = asyncio.create_task(idle())
        try:
            await asyncio.wait({down, dog}, return_when=asyncio.FIRST_COMPLETED)
            if not down.done():
                raise self._idle(t)
            down.result()
        finally:
            for task in (up, down, dog):
                task.cancel()
            await asyncio.gather(up, down, dog, return_exceptions=True)

    def _idle(self, t: _Target) -> Timeout:
        return Timeout(f"the tunnel to port {t.port} of sandbox {t.sid} moved no byte "
                       f"either way for {self.idle_s:g}s (the proxy's idle limit, "
                       "RestConfig.proxy_idle_s): closed", port=t.port)

    async def _download(self, h: h11.Connection, stream: DuplexStream, t: _Target,
                        from_query: str | None,
                        start: Callable[[int, list[tuple[bytes, bytes]]], Awaitable[None]],
                        send: Send, touch: Callable[[], None], secure: bool) -> None:
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
                touch()
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
                out = outbound_headers(ev.headers)
                if from_query is not None:
                    # exactly this port's path (not /v1/proxy/): no other port's page
                    # is sent it; the token was verified, so it is [A-Za-z0-9._-] only
                    out.append((b"set-cookie", (
                        f"{TOKEN_PARAM}={from_query}; Path={t.prefix}/; HttpOnly; "
                        f"SameSite=Lax{'; Secure' if secure else ''}").encode("latin-1")))
                await start(ev.status_code, out)
            elif isinstance(ev, h11.Data):
                await send({"type": "http.response.body", "body": bytes(ev.data),
                            "more_body": True})
                touch()
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
        stream, fwd, _, lease = await proxy._tunnel(scope, t)
    except Exception as exc:  # noqa: BLE001 - refused: say why in the close frame
        await _close(scope, send, exc)
        return
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
        proxy.shares.release(lease)
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
        proxy.shares.release(lease)
        stream.reset("ended by the proxy")
