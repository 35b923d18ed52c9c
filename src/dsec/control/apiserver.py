"""The REST apiserver: Starlette routes over :class:`~dsec.control.api.service.ApiService`.

Each route is one row of the operation catalogue (:mod:`dsec.wire.ops`): it decodes the
row's request object from the path, query, headers and body as the row's ``Rest``
binding places them, calls the row's policy (``ApiService.handler(op)``, the same the
Aether gateway calls) and takes its operation id, status, summary and tag from the row;
a route without a row, or one that disagrees with it, fails when the app is built.

Pure ASGI (served by uvicorn with httptools + uvloop). Bodies are decoded strictly with
msgspec (an unknown or mistyped field is a 400 naming it), the body size is capped while
it is read (413 before the whole body is buffered), and every error is JSON
``{code, message, request_id}`` with the stable code of the ``dsec.errors`` class —
never a stack trace, never a 500 for bad input. ``/openapi.json`` is generated from the
same msgspec types (see :mod:`dsec.control.api.openapi`).

Measured trade-off: Starlette's middleware stack, router and ``Request``/``Response``
objects cost about a third of a worker's CPU per ``GET /v1/sandboxes/{id}`` (py-spy on a
bench worker under wrk: 58% of samples inside Starlette's call chain, 17% in the
endpoint). That one route, the hot path of polling clients, is therefore served by
:class:`FastPaths`, a raw ASGI front that reads the scope and sends the response
messages itself, with the same auth, metrics, request ids and error bodies; every other
route (I/O bound on edge work that takes far longer) stays on Starlette.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from dsec.control.api.openapi import (
    IDEMPOTENCY_KEY,
    Op,
    Param,
    build_openapi,
    doc_of,
)
from dsec.control.api.service import AdminOps, ApiService, Caller
from dsec.control.proxy import PortProxy
from dsec.control.replybudget import ReplyLease, SentThenReleased, hold_replies
from dsec.errors import (
    DsecError,
    InternalError,
    InvalidArgument,
    MethodNotAllowed,
    PayloadTooLarge,
    RateLimited,
    Unavailable,
)
from dsec.logs import access, access_enabled
from dsec.net.expose import PROXY_PREFIX
from dsec.wire import ops
from dsec.wire.api import (
    ApiError,
    CreateSandboxRequest,
    ExecBody,
    ExecOutput,
    ExecStreamLine,
    ImageList,
)
from dsec.wire.calls import (
    ExecCall,
    ImageUpload,
)
from dsec.wire.jsonform import (
    carries_exec,
    exec_output,
    exec_request,
    json_form,
    run_line,
    stream_line,
)
from dsec.wire.ops import Op as CatalogueOp
from dsec.wire.outcome import undecodable
from dsec.wire.process import ProcessRunLine
from dsec.wire.rest import decode_json, decode_request

__all__ = ["AdminOps", "FastPaths", "RestConfig", "build_app"]

log = logging.getLogger("dsec.apiserver")

_json = msgspec.json.Encoder()


@dataclass(slots=True, frozen=True, kw_only=True)
class RestConfig:
    """Limits of the REST front door (bytes)."""

    max_json_body: int = 4 << 20        # JSON bodies; a 10 MB create is refused with 413
    # An exec body carries what the shared exec limits allow (8 MiB of stdin, 10.7 MiB as
    # base64, plus 1 MiB of argv+env), as one Aether gateway frame (16 MiB) can: the
    # limits, not the door, decide. Beyond it: 413.
    max_exec_body: int = 16 << 20
    max_file_body: int = 256 << 20      # raw bytes of PUT .../files
    max_image_body: int = 4 << 30       # image uploads, streamed to a temp file
    # /metrics: with a token, it needs 'Authorization: Bearer <metrics_token>' from
    # anywhere; without one it answers loopback (and Unix socket) clients only, unless
    # metrics_loopback_only is turned off (an explicit choice to publish it).
    metrics_token: str | None = None
    metrics_loopback_only: bool = True
    # Exposed ports: proxy tunnels open through this apiserver at once (beyond: 503),
    # and the share one sandbox / project / client address may hold of them (beyond:
    # 429 naming the share; None: an eighth per sandbox, at most the edge's 256, a
    # quarter per project and per address), so one tenant cannot starve the others.
    max_proxy_tunnels: int = 4096
    proxy_tunnels_per_sandbox: int | None = None
    proxy_tunnels_per_project: int | None = None
    proxy_tunnels_per_client: int | None = None
    # An HTTP tunnel with no byte either way this long is reclaimed (504).
    proxy_idle_s: float = 30.0
    # Routes of other floors served beside the catalogue's (the cluster join and
    # membership routes, dsec.cluster.join.join_routes): (Starlette Route, its openapi Op).
    extra_routes: tuple[tuple[Any, Op], ...] = ()


# ----------------------------------------------------------------- request plumbing
class _Ctx:
    __slots__ = ("request_id",)

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


_rid_prefix = secrets.token_hex(3)
_rid_counter = 0


#: a client's own ``x-request-id`` is echoed and logged only when it is 1-128 of these
#: (no space, ``=``, quote or control character: it cannot add a field or a line to a
#: log, red team 19 B7); anything else gets a request id of ours
_RID_OK = re.compile(r"[A-Za-z0-9._:@/+-]{1,128}")


def _sane_rid(rid: str | None) -> bool:
    return rid is not None and _RID_OK.fullmatch(rid) is not None


def _request_id(request: Request) -> str:
    rid = request.headers.get("x-request-id")
    if rid is not None and _sane_rid(rid):
        return rid
    global _rid_counter
    _rid_counter += 1
    return f"req-{_rid_prefix}-{_rid_counter:x}"


def _error_response(exc: DsecError, rid: str) -> Response:
    detail = {k: v for k, v in exc.detail.items()
              if isinstance(v, (str, int, float, bool)) or v is None}
    body = _json.encode(ApiError(code=exc.code, message=exc.message, request_id=rid,
                                 detail=detail))
    headers = {"x-request-id": rid}
    if isinstance(exc, RateLimited) or (isinstance(exc, Unavailable)
                                        and "retry_after" in exc.detail):
        # rate limits, and an unreachable state store (dsec.control.store.postgres): the
        # client is told when to come back
        from dsec.control.ratelimit import RateLimiter
        headers["retry-after"] = RateLimiter.retry_after_header(
            float(exc.detail.get("retry_after", 1.0)))
    return Response(body, status_code=exc.http_status, media_type="application/json",
                    headers=headers)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise InvalidArgument(f"bad Content-Length header {declared[:20]!r}") from None
        if n > limit:
            raise PayloadTooLarge(f"request body of {n} bytes exceeds the {limit}-byte limit "
                                  "of this route", limit=limit, size=n)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the {limit}-byte limit of this route",
                                  limit=limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _decode(tp: type, raw: bytes, op: CatalogueOp[Any, Any]) -> Any:
    """The JSON body of ``op``'s route as ``tp``. A refusal is worded as at every other
    door: the type's own check (``__post_init__``) answers unchanged; msgspec's (a
    wrong type, a bound on the type, an unknown field) through
    :func:`dsec.wire.outcome.undecodable`, its path as the whole request's (the row's
    body field first: ``$.spec.cpu_milli``)."""
    if not raw:
        raise InvalidArgument(f"empty request body: send a JSON {tp.__name__} object")
    try:
        return decode_json(raw, tp, what="body")
    except msgspec.ValidationError as exc:
        if isinstance(exc.__cause__, DsecError):
            raise exc.__cause__ from None
        body = op.rest.body if op.rest is not None else None
        raise undecodable(op.name, exc, at="" if body in (None, "*") else str(body)) from None


class _Released(Response):
    """``inner``, with the reply budget's leases of its body (dsec.control.replybudget)
    charged the body's size and given back once it has been sent
    (:func:`~dsec.control.replybudget.releasing_send`): a client that does not read
    keeps it charged."""

    def __init__(self, inner: Response, leases: list[ReplyLease]) -> None:
        # no Response.__init__: everything is the inner response's
        self.inner, self.leases = inner, leases
        self.status_code = inner.status_code

    def __getattr__(self, name: str) -> Any:    # headers, body, ...: the inner response's
        return getattr(self.inner, name)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await SentThenReleased(self.inner, self.leases)(scope, receive, send)


def _json_response(obj: Any, rid: str, status: int = 200) -> Response:
    return Response(_json.encode(obj), status_code=status, media_type="application/json",
                    headers={"x-request-id": rid})


# ------------------------------------------------------------------------- app
Handler = Callable[[Request, Caller, str], Awaitable[Response]]


def build_app(service: ApiService, admin: AdminOps | None = None,
              config: RestConfig | None = None) -> FastPaths:
    """The ASGI app. ``admin`` adds the project/quota/key/session routes."""
    cfg = config or RestConfig()
    metrics = service.metrics
    documented: list[Op] = []
    routes: list[Route] = []
    latency = metrics.latency
    requests = metrics.requests

    def route(op: Op, handler: Handler) -> None:
        op = _from_row(op)
        documented.append(op)
        template = op.path
        lat = latency.labels(template, op.method)
        counters: dict[int, Any] = {}
        row = _ROWS[(op.method, op.path)]
        assert row.rest is not None
        known = frozenset(row.rest.query.values())

        async def endpoint(request: Request) -> Response:
            t0 = time.perf_counter()
            rid = _request_id(request)
            caller = None
            leases: list[ReplyLease] = []
            try:
                caller = (service.authenticate(request.headers.get("authorization"),
                                               _client_host(request.scope))
                          if op.auth else _ANON)
                if request.scope.get("query_string"):
                    _known_query(request, known, row)
                with hold_replies() as leases:
                    resp = await handler(request, caller, rid)
            except DsecError as exc:
                resp = _error_response(service.redact(exc), rid)
            except Exception as exc:  # a bug: say so, log it, never leak the trace
                log.exception("request %s %s failed (request id %s)", op.method, template, rid)
                resp = _error_response(InternalError(
                    f"internal error ({type(exc).__name__}); quote request id {rid} when "
                    "reporting it"), rid)
            c = counters.get(resp.status_code)
            if c is None:
                c = counters[resp.status_code] = requests.labels(template, op.method,
                                                                  str(resp.status_code))
            c.inc()
            dt = time.perf_counter() - t0
            lat.observe(dt)
            if access_enabled():    # issue 19: --access-log
                request.scope["dsec.logged"] = True
                _access_line(op.method, template, request.url.path, resp.status_code, dt,
                             _client_host(request.scope), rid, caller)
            if leases:      # the reply's bytes count against its tenant until sent
                return _Released(resp, leases)
            return resp

        routes.append(Route(op.path, endpoint, methods=[op.method]))

    sid_of = _sid
    # Every operation's policy, resolved now: a row without one fails here, at start.
    h = service.handler
    exec_policy, stream_policy = h(ops.EXEC), service.stream_handler(ops.EXEC_STREAM)
    limits = {"json": cfg.max_json_body, "exec": cfg.max_exec_body,
              "file": cfg.max_file_body, "image": cfg.max_image_body}

    def serve(row: CatalogueOp[Any, Any]) -> None:
        """The route of ``row``, from the row alone: its request decoded as its
        :class:`~dsec.wire.ops.Rest` binding says (:func:`dsec.wire.rest.decode_request`:
        path, query, headers, body, with the type's own checks), its policy, and its
        reply written as the binding says (JSON, raw bytes or nothing)."""
        rest = row.rest
        assert rest is not None
        policy = h(row)
        limit = limits[rest.body_limit]
        has_body, status, reply = rest.body is not None, rest.status, rest.reply
        # exec results inside the reply (a batch's) are written as /exec writes one
        exec_form = json_form if reply == "json" and carries_exec(row.reply) else None

        async def handler(request: Request, caller: Caller, rid: str) -> Response:
            body = await _read_body(request, limit) if has_body else None
            req = decode_request(row, request.path_params, request.query_params.multi_items(),
                                 request.headers, body)
            rep = await policy(caller, req)
            if reply == "json":
                return _json_response(rep if exec_form is None else exec_form(rep), rid,
                                      status)
            if reply == "raw":
                return Response(rep, status_code=status, media_type="application/octet-stream",
                                headers={"x-request-id": rid})
            return Response(status_code=status, headers={"x-request-id": rid})
        route(doc_of(row), handler)


    # ------------------------------------------------------------- sandboxes
    async def create(request: Request, caller: Caller, rid: str) -> Response:
        raw = await _read_body(request, cfg.max_json_body)
        body = _decode(CreateSandboxRequest, raw, ops.CREATE)
        session = request.query_params.get("session")
        if session is not None:
            if body.session is not None:
                # one request field in two places: refused, never settled silently
                raise InvalidArgument(
                    "session is given twice, as the query parameter ?session= and in the "
                    "JSON body: give it once (the query parameter is the catalogue's form)",
                    field="session")
            # the catalogue's form (the row: the spec as the body, the session a query
            # parameter); the body's own `session` stays for older clients
            body = msgspec.structs.replace(body, session=session)
        key = request.headers.get("idempotency-key")
        info = await service.create(caller, body, idempotency_key=key, raw=raw)
        return _json_response(info, rid, 201)

    # By hand: REST's create body is the flat CreateSandboxRequest (the spec's fields
    # and, for older clients, `session`), not the row's bare spec.
    route(doc_of(ops.CREATE, request=CreateSandboxRequest,
                 headers=(Param("Idempotency-Key", IDEMPOTENCY_KEY,
                                description="same key within 5 min -> same sandbox"),)),
          create)

    async def exec_(request: Request, caller: Caller, rid: str) -> Response:
        body = _decode(ExecBody, await _read_body(request, cfg.max_exec_body), ops.EXEC)
        res = await exec_policy(caller, ExecCall(id=sid_of(request), req=exec_request(body)))
        return _json_response(exec_output(res), rid)

    # By hand: exec's JSON forms (base64 or text stdin and output, wire.jsonform).
    route(doc_of(ops.EXEC, request=ExecBody, response=ExecOutput), exec_)

    def exec_lines(stream: AsyncIterator[Any], rid: str,
                   line: Callable[[Any], Any] = stream_line) -> StreamingResponse:
        """exec_stream's and process_connect's NDJSON answer: an output line per item,
        then the final line; an error mid-stream is one last line, redacted and with its
        detail (may_have_run), as every other answer."""
        async def lines() -> AsyncIterator[bytes]:
            try:
                async for item in stream:
                    yield _json.encode(line(item)) + b"\n"
            except DsecError as exc:
                exc = service.redact(exc)
                detail = {k: v for k, v in exc.detail.items()
                          if isinstance(v, (str, int, float, bool)) or v is None}
                yield _json.encode(ExecStreamLine(error=ApiError(
                    code=exc.code, message=exc.message, request_id=rid,
                    detail=detail))) + b"\n"
        return StreamingResponse(lines(), media_type="application/x-ndjson",
                                 headers={"x-request-id": rid})

    async def exec_stream(request: Request, caller: Caller, rid: str) -> Response:
        body = _decode(ExecBody, await _read_body(request, cfg.max_exec_body),
                       ops.EXEC_STREAM)
        stream = await stream_policy(caller, ExecCall(id=sid_of(request),
                                                      req=exec_request(body)))

        return exec_lines(stream, rid)

    route(doc_of(ops.EXEC_STREAM, request=ExecBody, response=ExecStreamLine,
                 media="application/x-ndjson"), exec_stream)

    # Issue 19: process_connect's NDJSON lines (as exec_stream's) and the processes'
    # WebSocket attach route (dsec.control.api.process_ws).
    connect_policy = service.stream_handler(ops.PROCESS_CONNECT)

    async def process_connect(request: Request, caller: Caller, rid: str) -> Response:
        req = decode_request(ops.PROCESS_CONNECT, request.path_params,
                             request.query_params.multi_items(), request.headers, None)
        stream = await connect_policy(caller, req)

        return exec_lines(stream, rid)

    route(doc_of(ops.PROCESS_CONNECT, response=ExecStreamLine,
                 media="application/x-ndjson"), process_connect)
    # Issue 20: process_run, process_start's request answered with process_connect's
    # lines after a first line with the process's entry (``started``).
    run_policy = service.stream_handler(ops.PROCESS_RUN)

    async def process_run(request: Request, caller: Caller, rid: str) -> Response:
        body = await _read_body(request, cfg.max_exec_body)
        req = decode_request(ops.PROCESS_RUN, request.path_params,
                             request.query_params.multi_items(), request.headers, body)
        items = aiter(await run_policy(caller, req))
        # the entry read before the answer starts: a refused start answers its own
        # status (429, 503, ...) as POST .../processes does, not a 200 with an error line
        first = await anext(items)

        async def lines() -> AsyncIterator[Any]:
            yield first
            async for item in items:
                yield item
        return exec_lines(lines(), rid, run_line)

    route(doc_of(ops.PROCESS_RUN, response=ProcessRunLine,
                 media="application/x-ndjson"), process_run)
    from dsec.control.api.process_ws import attach_route
    routes.append(attach_route(service))  # type: ignore[arg-type]  # a WebSocketRoute


    # By hand (issue 19): streamed file content both ways (a raw body streamed in or
    # out, no body cap: the sandbox's disk cap is the limit) and the watch's NDJSON.
    from dsec.control import filedoors
    file_rows = (ops.FILE_READ_STREAM, ops.FILE_WRITE_STREAM, ops.FILE_WATCH)

    async def file_read(request: Request, caller: Caller, rid: str) -> Response:
        req = decode_request(ops.FILE_READ_STREAM, request.path_params,
                             request.query_params.multi_items(), request.headers, None)
        req, info = await filedoors.sized_read(service, caller, req)
        first, more = await filedoors.read_chunks(service, caller, req)

        async def body() -> AsyncIterator[bytes]:
            if first:
                yield first
            async for chunk in more:
                yield chunk
        # Content-Length: a body cut short (the sandbox ended, the file shrank) is an
        # error at the client, never a short file
        assert req.length is not None
        return StreamingResponse(body(), media_type="application/octet-stream",
                                 headers={"x-request-id": rid,
                                          "content-length": str(req.length),
                                          "x-dsec-file": _json.encode(info).decode()})

    async def file_write(request: Request, caller: Caller, rid: str) -> Response:
        req = decode_request(ops.FILE_WRITE_STREAM, request.path_params,
                             request.query_params.multi_items(), request.headers, None)
        info = await filedoors.write_chunks(service, caller, req, request.stream())
        return _json_response(info, rid)

    watch_policy = service.stream_handler(ops.FILE_WATCH)

    async def file_watch(request: Request, caller: Caller, rid: str) -> Response:
        req = decode_request(ops.FILE_WATCH, request.path_params,
                             request.query_params.multi_items(), request.headers, None)
        stream = await watch_policy(caller, req)

        async def lines() -> AsyncIterator[bytes]:
            try:
                async for item in stream:
                    yield _json.encode(filedoors.watch_line(item)) + b"\n"
            except DsecError as exc:
                exc = service.redact(exc)
                yield _json.encode({"error": {"code": exc.code, "message": exc.message,
                                              "request_id": rid}}) + b"\n"
        return StreamingResponse(lines(), media_type="application/x-ndjson",
                                 headers={"x-request-id": rid})

    route(doc_of(ops.FILE_READ_STREAM, response="binary"), file_read)
    route(doc_of(ops.FILE_WRITE_STREAM, request="binary"), file_write)
    route(doc_of(ops.FILE_WATCH, media="application/x-ndjson"), file_watch)

    # Every other row is served from the row alone (admin rows when admin is given).
    by_hand = {ops.CREATE, ops.EXEC, ops.EXEC_STREAM, ops.IMAGE_BUILD, ops.IMAGE_IMPORT,
               ops.PROCESS_CONNECT, ops.PROCESS_RUN, *file_rows}
    for row in ops.REST_OPS:
        if row not in by_hand and (admin is not None or row not in _ADMIN_ROWS):
            serve(row)

    # ------------------------------------------------------------------ admin
    if admin is not None:
        if service.admin is None:
            service.admin = admin
        _admin_routes(route, service, cfg)

    # ------------------------------------------------------------------- meta
    async def healthz(request: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    async def metrics_ep(request: Request) -> Response:
        from dsec.control.metrics import CONTENT_TYPE_LATEST
        client = _client_host(request.scope)
        try:
            if client is not None:
                service.check_anonymous(client, charge=False)
            try:
                _metrics_access(cfg, request.headers.get("authorization"), client)
            except DsecError:
                if client is not None:
                    service.check_anonymous(client, charge=True)
                raise
        except DsecError as exc:
            return _error_response(exc, _request_id(request))
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    documented.append(Op("GET", "/healthz", "healthz", "Liveness", None, None, tag="meta",
                  auth=False))
    documented.append(Op("GET", "/metrics", "metrics", "Prometheus metrics", None, "text",
                         tag="meta", auth=False, token_scheme="metricsToken",
                         response_media="text/plain"))
    for extra_route, extra_op in cfg.extra_routes:
        routes.append(extra_route)
        documented.append(extra_op)
    doc = _json.encode(build_openapi(documented, version=service.config.version))

    async def openapi(request: Request) -> Response:
        return Response(doc, media_type="application/json")

    routes += [Route("/healthz", healthz), Route("/metrics", metrics_ep),
               Route("/openapi.json", openapi)]

    async def not_found(request: Request, exc: Exception) -> Response:
        from dsec.errors import NotFound
        rid = _request_id(request)
        return _error_response(NotFound(f"no route {request.method} {request.url.path}; "
                                        "see /openapi.json"), rid)

    async def not_allowed(request: Request, exc: Exception) -> Response:
        rid = _request_id(request)
        allow = _allowed_methods(routes, request.scope)
        resp = _error_response(MethodNotAllowed(
            f"method {request.method[:16]} is not allowed on {request.url.path[:200]}; it "
            f"allows {', '.join(allow) or 'nothing'} (see /openapi.json)",
            allow=", ".join(allow)), rid)
        resp.headers["allow"] = ", ".join(allow)
        return resp

    # The web dashboard (/ui, dsec.control.ui): pages over the same policies; its
    # terminal WebSocket is handed on to the REST process WebSocket through the front.
    from dsec.control.ui import Dashboard
    dashboard = Dashboard(service)
    routes += dashboard.routes()  # type: ignore[arg-type]  # a Mount

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed})
    app.state.openapi = doc
    front = FastPaths(app, service, PortProxy(
        service, max_tunnels=cfg.max_proxy_tunnels, per_sandbox=cfg.proxy_tunnels_per_sandbox,
        per_project=cfg.proxy_tunnels_per_project, per_client=cfg.proxy_tunnels_per_client,
        idle_s=cfg.proxy_idle_s))
    dashboard.root = front
    return front


_JSON_CT = (b"content-type", b"application/json")


def _new_rid(scope: Any) -> str:
    """The request's own ``x-request-id`` (when ``scope`` is given and it sent a sane
    one), else a new one."""
    global _rid_counter
    if scope is not None:
        for k, v in scope["headers"]:
            if k == b"x-request-id":
                r: str = v.decode("latin-1")
                if _sane_rid(r):
                    return r
    _rid_counter += 1
    return f"req-{_rid_prefix}-{_rid_counter:x}"


class FastPaths:
    """ASGI front: the hot row (``GET /v1/sandboxes/{id}``, :data:`dsec.wire.ops.GET`)
    straight to its policy, all else to the Starlette app. Built from the row (its
    method, its path: a prefix and one ``{id}`` segment, its request type); same
    behaviour as the Starlette route (auth, role check, error JSON, ``x-request-id``,
    per-route metrics), minus the middleware stack and the Request/Response objects (see
    the module docstring for the measurement)."""

    __slots__ = ("_counters", "_lat", "_method", "_n", "_policy", "_prefix", "_request",
                 "_service", "_slash_ok", "_template", "app", "proxy")

    def __init__(self, app: Starlette, service: ApiService,
                 proxy: PortProxy | None = None,
                 fast: CatalogueOp[Any, Any] = ops.GET) -> None:
        rest = fast.rest
        if rest is None or not rest.path.endswith("/{id}") or rest.path.count("{") != 1:
            raise InternalError(f"FastPaths serves a row whose path is a prefix and one "
                                f"{{id}} segment, not {fast.name}")
        self.app = app
        self.proxy = proxy
        self._service = service
        self._method, self._template = rest.method, rest.path
        self._prefix = rest.path[:-len("{id}")]
        self._n = len(self._prefix)
        self._policy = service.handler(fast)
        self._request = fast.request
        self._lat = service.metrics.latency.labels(rest.path, rest.method)
        self._counters: dict[int, Any] = {}
        # Starlette routes on the percent-decoded path: an {id} sent as "sid%2Fevents"
        # landed on another row (the events of sid; a DELETE of it, a 405 naming that
        # route). Only a ``{name:path}`` parameter may hold '/' (ids never do:
        # wire.spec.check_id), so a %2F anywhere else is refused before routing.
        self._slash_ok = tuple(sorted({
            op.rest.path.partition("{")[0] for op in ops.ALL_OPS
            if op.rest is not None and ":path}" in op.rest.path}))

    @property
    def state(self) -> Any:
        return self.app.state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (scope["type"] == "http" and b"%2" in scope.get("raw_path", b"")
                and b"%2f" in scope["raw_path"].lower()
                and not scope["path"].startswith(self._slash_ok)):
            err = InvalidArgument(f"a path parameter of {scope['method']} "
                                  f"{scope['path'][:120]} holds '/' (sent as %2F): ids "
                                  "never contain '/'", field="id")
            await _error_response(err, _new_rid(scope))(scope, receive, send)
            return
        if scope["type"] == "http" and scope["method"] == self._method:
            path: str = scope["path"]
            n = self._n
            # a query string goes the general way: GET one sandbox takes no parameter,
            # and the route refuses one it does not know by name
            if (path.startswith(self._prefix) and len(path) > n
                    and path.find("/", n) < 0 and not scope.get("query_string")):
                await self._get(scope, send, path[n:])
                return
        if self.proxy is not None and scope["type"] in ("http", "websocket") and \
                scope["path"].startswith(PROXY_PREFIX):
            # Exposed ports (every method, and WebSocket): dsec.control.proxy.
            if access_enabled():
                await _logged(self.proxy, "proxy", scope, receive, send)
            else:
                await self.proxy(scope, receive, send)
            return
        if access_enabled() and scope["type"] in ("http", "websocket"):
            # the routes that log their own line mark the scope; the others (WebSocket
            # routes, /ui, /metrics, /healthz, a 404) get one here (red team 19 B9)
            await _logged(self.app, "rest", scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _get(self, scope: Any, send: Any, sid: str) -> None:
        t0 = time.perf_counter()
        auth: str | None = None
        rid: str | None = None
        for k, v in scope["headers"]:
            if k == b"authorization":
                auth = v.decode("latin-1")
            elif k == b"x-request-id":
                r = v.decode("latin-1")
                if _sane_rid(r):
                    rid = r
        if rid is None:
            rid = _new_rid(None)
        svc = self._service
        caller = None
        try:
            caller = svc.authenticate(auth, _client_host(scope))
            info = await self._policy(caller, self._request(id=sid))
            status, body = 200, _json.encode(info)
            headers = [_JSON_CT, (b"content-length", str(len(body)).encode()),
                       (b"x-request-id", rid.encode())]
        except Exception as exc:  # mapped exactly as the Starlette routes do
            if not isinstance(exc, DsecError):
                log.exception("request %s %s failed (request id %s)", self._method,
                              self._template, rid)
                exc = InternalError(f"internal error ({type(exc).__name__}); quote request "
                                    f"id {rid} when reporting it")
            resp = _error_response(svc.redact(exc), rid)
            status, body = resp.status_code, bytes(resp.body)
            headers = resp.raw_headers
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        c = self._counters.get(status)
        if c is None:
            c = self._counters[status] = self._service.metrics.requests.labels(
                self._template, self._method, str(status))
        c.inc()
        dt = time.perf_counter() - t0
        self._lat.observe(dt)
        if access_enabled():    # issue 19: --access-log
            _access_line(self._method, self._template, scope.get("path", ""), status, dt,
                         _client_host(scope), rid, caller)


async def _logged(app: Any, door: str, scope: Any, receive: Any, send: Any) -> None:
    """``app`` serving ``scope``, with one access-log line for it unless the route wrote
    its own (``scope["dsec.logged"]``): the status sent (a WebSocket: 101 once accepted,
    else the close code or the HTTP status it was refused with)."""
    t0 = time.perf_counter()
    status = 0

    async def sent(message: Any) -> None:
        nonlocal status
        kind = message["type"]
        if kind in ("http.response.start", "websocket.http.response.start"):
            status = message["status"]
        elif kind == "websocket.accept":
            status = 101
        elif kind == "websocket.close" and not status:
            status = message.get("code", 1000)
        await send(message)
    try:
        await app(scope, receive, sent)
    finally:
        if not scope.get("dsec.logged"):
            method = scope.get("method", "WS") if scope["type"] == "http" else "WS"
            path = scope.get("path", "")
            client = _client_host(scope)
            access(f"{method} {path} {status}", door=door, method=method, path=path,
                   status=status, duration_ms=round((time.perf_counter() - t0) * 1000, 3),
                   client=client or "-", request_id="-", principal="-")


def _access_line(method: str, route: str, path: str, status: int, seconds: float,
                 client: str | None, rid: str, caller: Caller | None) -> None:
    """One REST access-log line (dsec.logs.access): the concrete path is logged, the
    metrics keep the template."""
    access(f"{method} {path} {status}", door="rest", method=method, route=route,
           path=path, status=status, duration_ms=round(seconds * 1000, 3),
           client=client or "-", request_id=rid,
           principal=caller.name if caller is not None else "-")


def _admin_routes(route: Callable[[Op, Handler], None], service: ApiService,
                  cfg: RestConfig) -> None:
    """The image uploads: a raw body streamed to a file, not a request to decode."""
    build_p = service.upload_handler(ops.IMAGE_BUILD)
    import_p = service.upload_handler(ops.IMAGE_IMPORT)

    def upload(policy: Callable[[Caller, ImageUpload, str], Awaitable[ImageList]]
               ) -> Handler:
        async def handler(request: Request, caller: Caller, rid: str) -> Response:
            import tempfile
            name = request.query_params.get("name")
            if not name:
                raise InvalidArgument("query parameter 'name' (the image name) is required",
                                      field="name")
            kind = request.query_params.get("kind", "base")
            tag = request.query_params.get("tag", "latest")
            with tempfile.NamedTemporaryFile(prefix="dsec-upload-", suffix=".tar") as f:
                size = 0
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > cfg.max_image_body:
                        raise PayloadTooLarge(f"image upload exceeds {cfg.max_image_body} "
                                              "bytes", limit=cfg.max_image_body)
                    f.write(chunk)
                f.flush()
                if size == 0:
                    raise InvalidArgument("empty upload: send a tar archive as the body")
                out = await policy(caller, ImageUpload(name=name, kind=kind, tag=tag),  # type: ignore[arg-type]
                                   f.name)
            return _json_response(out, rid, 201)
        return handler

    route(doc_of(ops.IMAGE_BUILD, request="binary"), upload(build_p))
    route(doc_of(ops.IMAGE_IMPORT, request="binary"), upload(import_p))



_ANON = Caller(id="anonymous", name="anonymous", roles={})

# Rows served only when build_app is given the admin operations.
_ADMIN_ROWS = frozenset({
    ops.PROJECTS, ops.PROJECT_GET, ops.QUOTA_SET, ops.CREATE_KEY, ops.REVOKE_KEY,
    ops.SESSION_OPEN, ops.SESSION_RENEW, ops.SESSION_CLOSE, ops.IMAGES, ops.IMAGE_GET,
    ops.IMAGE_TAG, ops.IMAGE_DELETE, ops.IMAGE_BUILD, ops.IMAGE_IMPORT, ops.IMAGE_PRUNE,
    ops.IMAGE_PULL, ops.IMAGE_PROMOTE, ops.NODE_DRAIN, ops.NODE_UNDRAIN, ops.IMAGE_PUSH,
    ops.IMAGE_PIN, ops.IMAGE_UNPIN, ops.IMAGE_PINS, ops.CLUSTER_TOKENS,
    ops.CLUSTER_TOKEN_CREATE, ops.CLUSTER_TOKEN_REVOKE, ops.CLUSTER_NODES,
    ops.CLUSTER_NODE_REVOKE, ops.NODE_MIGRATE})

_ROWS: dict[tuple[str, str], CatalogueOp[Any, Any]] = {
    (op.rest.method, op.rest.path): op for op in ops.REST_OPS if op.rest is not None}


def _from_row(route: Op) -> Op:
    """A route as its catalogue row says (operation id, status, summary, tag): a route
    without a row, or one that disagrees with it, is a wiring bug raised at start."""
    row = _ROWS.get((route.method, route.path))
    if row is None or row.rest is None:
        raise InternalError(f"REST route {route.method} {route.path} has no row in "
                            "dsec.wire.ops")
    rest = row.rest
    if (route.operation_id, route.status) != (rest.operation_id, rest.status):
        raise InternalError(f"REST route {route.method} {route.path} says "
                            f"{route.operation_id}/{route.status}, its row "
                            f"{rest.operation_id}/{rest.status}")
    return dataclasses.replace(route, summary=row.summary, tag=rest.tag)


def _known_query(request: Request, known: frozenset[str],
                 row: CatalogueOp[Any, Any]) -> None:
    """Refuse a query parameter the row does not name, by name (as the Aether doors
    refuse an unknown field): ``mkdir?parnets=false`` silently made the parents."""
    for name in request.query_params:
        if name not in known:
            takes = ", ".join(sorted(known)) or "none"
            raise InvalidArgument(f"unknown query parameter {name[:60]!r} for the {row.name} "
                                  f"request (it takes: {takes})", field=name[:60])


def _client_host(scope: Any) -> str | None:
    """The peer address of an ASGI request (None over a Unix socket or in-process)."""
    client = scope.get("client")
    if client and isinstance(client[0], str) and client[0]:
        return client[0]
    return None


def _metrics_access(cfg: RestConfig, authorization: str | None, client: str | None) -> None:
    """Raise unless this request may read ``/metrics`` (see ``RestConfig.metrics_token``)."""
    import hmac
    import ipaddress

    from dsec.errors import PermissionDenied, Unauthenticated
    if cfg.metrics_token is not None:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), cfg.metrics_token.encode()):
            raise Unauthenticated("/metrics needs 'Authorization: Bearer <metrics token>' "
                                  "(the apiserver's metrics_token)")
        return
    if not cfg.metrics_loopback_only or client is None:
        return
    try:
        local = ipaddress.ip_address(client.split("%")[0]).is_loopback
    except ValueError:
        local = False
    if not local:
        raise PermissionDenied(f"/metrics answers loopback clients only (request from "
                               f"{client[:64]}); configure a metrics_token to scrape it "
                               "from elsewhere")


def _allowed_methods(routes: list[Route], scope: Any) -> list[str]:
    """Every method some route declares for the request's path (the ``Allow`` header of
    a 405): each method is a Route of its own here, so Starlette's partial match names
    only the first."""
    from starlette.routing import Match

    allow: set[str] = set()
    for r in routes:
        match, _ = r.matches(scope)
        if match in (Match.FULL, Match.PARTIAL) and r.methods:
            allow.update(r.methods)
    return sorted(allow)


def _sid(request: Request) -> str:
    return str(request.path_params["id"])


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0", "false")
