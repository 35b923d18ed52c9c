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
    FILE_PATH,
    IDEMPOTENCY_KEY,
    PROJECT_PATH,
    SANDBOX_ID,
    Op,
    Param,
    build_openapi,
)
from dsec.control.api.service import AdminOps, ApiService, Caller
from dsec.errors import (
    DsecError,
    InternalError,
    InvalidArgument,
    MethodNotAllowed,
    PayloadTooLarge,
    RateLimited,
)
from dsec.wire import ops
from dsec.wire.api import (
    ApiError,
    CreateKeyRequest,
    CreateKeyResponse,
    CreateSandboxRequest,
    EventList,
    ExecBody,
    ExecOutput,
    ExecStreamLine,
    FileList,
    ImageList,
    ImageTagRequest,
    ImageView,
    Info,
    NodeList,
    ProjectList,
    ProjectView,
    QuotaBody,
    SandboxList,
    SessionView,
    SnapshotList,
    SnapshotView,
)
from dsec.wire.calls import (
    Empty,
    ExecCall,
    FileRef,
    ImageRef,
    ImageUpload,
    KeyRef,
    ListSandboxes,
    Mkdir,
    NetworkUpdate,
    ProjectRef,
    QuotaSet,
    ReadFile,
    Remove,
    SandboxRef,
    SessionOpen,
    SessionRef,
    SnapshotCall,
    SnapshotQuery,
    SnapshotRef,
    WriteFile,
)
from dsec.wire.jsonform import exec_output, exec_request, stream_line
from dsec.wire.netpolicy import NetworkPolicy
from dsec.wire.ops import Op as CatalogueOp
from dsec.wire.spec import (
    FileInfo,
    NetworkView,
    PauseStats,
    SandboxInfo,
    SandboxStats,
    check_path,
)

__all__ = ["AdminOps", "FastPaths", "RestConfig", "build_app"]

log = logging.getLogger("dsec.apiserver")

_json = msgspec.json.Encoder()
_decoders: dict[type, msgspec.json.Decoder[Any]] = {}


def _decoder(tp: type) -> msgspec.json.Decoder[Any]:
    d = _decoders.get(tp)
    if d is None:
        d = _decoders[tp] = msgspec.json.Decoder(tp)
    return d


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


# ----------------------------------------------------------------- request plumbing
class _Ctx:
    __slots__ = ("request_id",)

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


_rid_prefix = secrets.token_hex(3)
_rid_counter = 0


def _request_id(request: Request) -> str:
    rid = request.headers.get("x-request-id")
    if rid and len(rid) <= 128 and rid.isprintable():
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
    if isinstance(exc, RateLimited):
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


def _decode(tp: type, raw: bytes) -> Any:
    if not raw:
        raise InvalidArgument(f"empty request body: send a JSON {tp.__name__} object")
    try:
        return _decoder(tp).decode(raw)
    except msgspec.ValidationError as exc:
        if isinstance(exc.__cause__, DsecError):
            # refused by the type's own check (__post_init__): the same class, words
            # and detail as at every other door
            raise exc.__cause__ from None
        # msgspec names the field: "Object contains unknown field `foo`", "Expected `int`,
        # got `str` - at `$.cpu_milli`".
        name = getattr(tp, "__name__", str(tp))
        raise InvalidArgument(f"invalid {name}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidArgument(f"malformed JSON body: {exc}") from None


def _json_response(obj: Any, rid: str, status: int = 200) -> Response:
    return Response(_json.encode(obj), status_code=status, media_type="application/json",
                    headers={"x-request-id": rid})


def _q_int(request: Request, name: str, default: int | None, lo: int = -(1 << 62),
           hi: int = 1 << 62) -> int | None:
    """An integer query parameter. Its range is the request type's or the policy's to
    check (the same words at every door); the bounds here only keep it a 64-bit int."""
    v = request.query_params.get(name)
    if v is None:
        return default
    try:
        n = int(v)
    except ValueError:
        raise InvalidArgument(f"query parameter {name}={v[:40]!r} must be an integer",
                              field=name) from None
    if not lo <= n <= hi:
        raise InvalidArgument(f"query parameter {name}={n} must be within {lo}..{hi}",
                              field=name)
    return n


def _q_bool(request: Request, name: str, default: bool = False) -> bool:
    v = request.query_params.get(name)
    if v is None:
        return default
    v = v.lower()
    if v in ("1", "true", "yes"):
        return True
    if v in ("0", "false", "no", ""):
        return False
    raise InvalidArgument(f"query parameter {name}={v[:20]!r} must be true or false",
                          field=name)


def _q_path(request: Request) -> str:
    p = request.query_params.get("path")
    if not p:
        raise InvalidArgument("query parameter 'path' (a path inside the sandbox) is required",
                              field="path")
    return check_path(p)


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

        async def endpoint(request: Request) -> Response:
            t0 = time.perf_counter()
            rid = _request_id(request)
            try:
                caller = (service.authenticate(request.headers.get("authorization"),
                                               _client_host(request.scope))
                          if op.auth else _ANON)
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
            lat.observe(time.perf_counter() - t0)
            return resp

        routes.append(Route(op.path, endpoint, methods=[op.method]))

    sid_of = _sid
    # Every operation's policy, resolved now: a row without one fails here, at start.
    h = service.handler
    list_policy, get_policy, destroy_policy = h(ops.LIST), h(ops.GET), h(ops.DESTROY)
    exec_policy, stream_policy = h(ops.EXEC), service.stream_handler(ops.EXEC_STREAM)
    read_policy, write_policy = h(ops.READ_FILE), h(ops.WRITE_FILE)
    remove_policy, list_dir_policy = h(ops.REMOVE), h(ops.LIST_DIR)
    stat_policy, mkdir_policy = h(ops.STAT), h(ops.MKDIR)
    pause_policy, resume_policy, stats_policy = h(ops.PAUSE), h(ops.RESUME), h(ops.STATS)
    events_policy, snapshot_policy = h(ops.EVENTS), h(ops.SNAPSHOT)
    snapshots_policy, snapshot_get_policy = h(ops.SNAPSHOTS), h(ops.SNAPSHOT_GET)
    snapshot_delete_policy = h(ops.SNAPSHOT_DELETE)
    nodes_policy, info_policy = h(ops.NODES), h(ops.INFO)
    create_many_policy, exec_many_policy = h(ops.CREATE_MANY), h(ops.EXEC_MANY)

    # ------------------------------------------------------------- sandboxes
    async def create(request: Request, caller: Caller, rid: str) -> Response:
        raw = await _read_body(request, cfg.max_json_body)
        body = _decode(CreateSandboxRequest, raw)
        session = request.query_params.get("session")
        if session is not None and body.session is None:
            # the catalogue's form (the row: the spec as the body, the session a query
            # parameter); the body's own `session` stays for older clients
            body = msgspec.structs.replace(body, session=session)
        key = request.headers.get("idempotency-key")
        info = await service.create(caller, body, idempotency_key=key, raw=raw)
        return _json_response(info, rid, 201)

    route(Op("POST", "/v1/sandboxes", "createSandbox", "Create a sandbox",
             CreateSandboxRequest, SandboxInfo, 201,
             headers=(Param("Idempotency-Key", IDEMPOTENCY_KEY,
                            description="same key within 5 min -> same sandbox"),)), create)

    async def list_(request: Request, caller: Caller, rid: str) -> Response:
        labels: dict[str, str] = {}
        for item in request.query_params.getlist("label"):
            k, sep, v = item.partition("=")
            if not sep or not k:
                raise InvalidArgument(f"label filter {item[:60]!r} must be key=value",
                                      field="label")
            labels[k] = v
        state = request.query_params.get("state")
        if state is not None and state not in _STATES:
            raise InvalidArgument(f"state={state[:20]!r} is not one of {sorted(_STATES)}",
                                  field="state")
        limit = _q_int(request, "limit", 100)      # 1..list_page_max: the policy's words
        assert limit is not None
        page = await list_policy(caller, ListSandboxes(
            project=request.query_params.get("project"), labels=labels,
            state=state, limit=limit, cursor=request.query_params.get("cursor")))  # type: ignore[arg-type]
        return _json_response(page, rid)

    route(Op("GET", "/v1/sandboxes", "listSandboxes", "List sandboxes", None, SandboxList,
             params=(Param("project", PROJECT_PATH),
                     Param("label", {"type": "string", "pattern": "^[^=]+=.*$"},
                           description="key=value, repeatable"),
                     Param("state", {"enum": sorted(_STATES)}),
                     Param("limit", {"type": "integer", "minimum": 1, "maximum": 1000}),
                     Param("cursor", {"type": "string"}))), list_)

    async def get(request: Request, caller: Caller, rid: str) -> Response:
        return _json_response(await get_policy(caller, SandboxRef(id=sid_of(request))), rid)

    route(Op("GET", "/v1/sandboxes/{id}", "getSandbox", "Get a sandbox", None, SandboxInfo),
          get)

    async def delete(request: Request, caller: Caller, rid: str) -> Response:
        await destroy_policy(caller, SandboxRef(id=sid_of(request)))
        return Response(status_code=204, headers={"x-request-id": rid})

    route(Op("DELETE", "/v1/sandboxes/{id}", "deleteSandbox",
             "Destroy a sandbox (idempotent)", status=204), delete)

    async def exec_(request: Request, caller: Caller, rid: str) -> Response:
        body = _decode(ExecBody, await _read_body(request, cfg.max_exec_body))
        res = await exec_policy(caller, ExecCall(id=sid_of(request), req=exec_request(body)))
        return _json_response(exec_output(res), rid)

    route(Op("POST", "/v1/sandboxes/{id}/exec", "execSandbox", "Run a command",
             ExecBody, ExecOutput), exec_)

    async def exec_stream(request: Request, caller: Caller, rid: str) -> Response:
        body = _decode(ExecBody, await _read_body(request, cfg.max_exec_body))
        stream = await stream_policy(caller, ExecCall(id=sid_of(request),
                                                      req=exec_request(body)))

        async def lines() -> AsyncIterator[bytes]:
            try:
                async for item in stream:
                    yield _json.encode(stream_line(item)) + b"\n"
            except DsecError as exc:
                # as every other answer: redacted, and with its detail (may_have_run)
                exc = service.redact(exc)
                detail = {k: v for k, v in exc.detail.items()
                          if isinstance(v, (str, int, float, bool)) or v is None}
                yield _json.encode(ExecStreamLine(error=ApiError(
                    code=exc.code, message=exc.message, request_id=rid,
                    detail=detail))) + b"\n"
        return StreamingResponse(lines(), media_type="application/x-ndjson",
                                 headers={"x-request-id": rid})

    route(Op("POST", "/v1/sandboxes/{id}/exec/stream", "execSandboxStream",
             "Run a command, streaming NDJSON lines", ExecBody, ExecStreamLine,
             response_media="application/x-ndjson"), exec_stream)

    # ------------------------------------------------------------------ batches
    def batch(op: CatalogueOp[Any, Any], policy: Callable[[Caller, Any], Awaitable[Any]],
              limit: int) -> None:
        """A batched row: its request as one JSON object, its ``Batch`` reply."""
        assert op.rest is not None
        request_type = op.request

        async def handler(request: Request, caller: Caller, rid: str) -> Response:
            body = _decode(request_type, await _read_body(request, limit))
            return _json_response(await policy(caller, body), rid)
        route(Op(op.rest.method, op.rest.path, op.rest.operation_id, op.summary,
                 op.request, op.reply, op.rest.status, tag=op.rest.tag), handler)

    batch(ops.CREATE_MANY, create_many_policy, cfg.max_json_body)
    batch(ops.EXEC_MANY, exec_many_policy, cfg.max_exec_body)

    # ------------------------------------------------------------------ files
    async def read(request: Request, caller: Caller, rid: str) -> Response:
        data = await read_policy(caller, ReadFile(
            id=sid_of(request), path=_q_path(request),
            offset=_q_int(request, "offset", 0) or 0, length=_q_int(request, "length", None)))
        return Response(data, media_type="application/octet-stream",
                        headers={"x-request-id": rid})

    route(Op("GET", "/v1/sandboxes/{id}/files", "readFile", "Read a file (raw bytes)",
             None, "binary", params=(Param("path", FILE_PATH, True),
                                     Param("offset", {"type": "integer", "minimum": 0}),
                                     Param("length", {"type": "integer", "minimum": 0}))),
          read)

    async def write(request: Request, caller: Caller, rid: str) -> Response:
        path = _q_path(request)
        mode = _q_int(request, "mode", 0o644)      # 0..0o7777: WriteFile's words
        data = await _read_body(request, cfg.max_file_body)
        await write_policy(caller, WriteFile(id=sid_of(request), path=path, data=data,
                                             mode=mode or 0, append=_q_bool(request, "append")))
        return Response(status_code=204, headers={"x-request-id": rid})

    route(Op("PUT", "/v1/sandboxes/{id}/files", "writeFile", "Write a file (raw bytes "
             "body; empty: an empty file)", "binary", None, 204, body_required=False,
             params=(Param("path", FILE_PATH, True),
                     Param("mode", {"type": "integer", "minimum": 0, "maximum": 4095}),
                     Param("append", {"type": "boolean"}))), write)

    async def remove(request: Request, caller: Caller, rid: str) -> Response:
        await remove_policy(caller, Remove(id=sid_of(request), path=_q_path(request),
                                           recursive=_q_bool(request, "recursive")))
        return Response(status_code=204, headers={"x-request-id": rid})

    route(Op("DELETE", "/v1/sandboxes/{id}/files", "removeFile", "Remove a file or directory",
             None, None, 204, params=(Param("path", FILE_PATH, True),
                                      Param("recursive", {"type": "boolean"}))), remove)

    async def listdir(request: Request, caller: Caller, rid: str) -> Response:
        return _json_response(await list_dir_policy(
            caller, FileRef(id=sid_of(request), path=_q_path(request))), rid)

    route(Op("GET", "/v1/sandboxes/{id}/files/list", "listFiles", "List a directory",
             None, FileList, params=(Param("path", FILE_PATH, True),)),
          listdir)

    async def stat(request: Request, caller: Caller, rid: str) -> Response:
        return _json_response(await stat_policy(
            caller, FileRef(id=sid_of(request), path=_q_path(request))), rid)

    route(Op("GET", "/v1/sandboxes/{id}/files/stat", "statFile", "Stat a path", None,
             FileInfo, params=(Param("path", FILE_PATH, True),)),
          stat)

    async def mkdir(request: Request, caller: Caller, rid: str) -> Response:
        await mkdir_policy(caller, Mkdir(id=sid_of(request), path=_q_path(request),
                                         parents=_q_bool(request, "parents", True)))
        return Response(status_code=204, headers={"x-request-id": rid})

    route(Op("POST", "/v1/sandboxes/{id}/files/mkdir", "mkdir", "Create a directory",
             None, None, 204, params=(Param("path", FILE_PATH, True),
                                      Param("parents", {"type": "boolean", "default": True},
                                            description="create missing parents too "
                                            "(false: 404 when the parent is missing)"))),
          mkdir)

    # -------------------------------------------------------------- lifecycle
    async def pause(request: Request, caller: Caller, rid: str) -> Response:
        return _json_response(await pause_policy(caller, SandboxRef(id=sid_of(request))), rid)

    route(Op("POST", "/v1/sandboxes/{id}/pause", "pauseSandbox", "Pause (freeze, give "
             "memory back)", None, PauseStats), pause)

    async def resume(request: Request, caller: Caller, rid: str) -> Response:
        return _json_response(await resume_policy(caller, SandboxRef(id=sid_of(request))),
                              rid)

    route(Op("POST", "/v1/sandboxes/{id}/resume", "resumeSandbox", "Resume", None,
             SandboxInfo), resume)

    async def snapshot(request: Request, caller: Caller, rid: str) -> Response:
        snap = await snapshot_policy(caller, SnapshotCall(
            id=sid_of(request), strip=request.query_params.getlist("strip")))
        return _json_response(snap, rid, 201)

    route(Op("POST", "/v1/sandboxes/{id}/snapshot", "snapshotSandbox",
             "Snapshot the sandbox's changes since its last snapshot (pack_diff); "
             "unchanged -> that snapshot", None, SnapshotView, 201,
             params=(Param("strip", {"type": "array", "items": {"type": "string",
                                                                 "minLength": 1}},
                           description="path patterns left out (reuse safety), repeatable"),
                     )), snapshot)

    async def snapshots(request: Request, caller: Caller, rid: str) -> Response:
        q = request.query_params
        return _json_response(await snapshots_policy(caller, SnapshotQuery(
            project=q.get("project"), sandbox_id=q.get("sandbox_id"))), rid)

    route(Op("GET", "/v1/snapshots", "listSnapshots", "Snapshots visible to this key",
             None, SnapshotList, tag="snapshots",
             params=(Param("project", PROJECT_PATH),
                     Param("sandbox_id", SANDBOX_ID))), snapshots)

    async def get_snapshot(request: Request, caller: Caller, rid: str) -> Response:
        return _json_response(await snapshot_get_policy(
            caller, SnapshotRef(id=sid_of(request))), rid)

    route(Op("GET", "/v1/snapshots/{id}", "getSnapshot", "One snapshot and the nodes "
             "holding it", None, SnapshotView, tag="snapshots"), get_snapshot)

    async def delete_snapshot(request: Request, caller: Caller, rid: str) -> Response:
        await snapshot_delete_policy(caller, SnapshotRef(id=sid_of(request)))
        return Response(status_code=204, headers={"x-request-id": rid})

    route(Op("DELETE", "/v1/snapshots/{id}", "deleteSnapshot", "Delete a snapshot (409 "
             "in_use while a sandbox runs from it or a snapshot builds on it)", None, None,
             204, tag="snapshots"), delete_snapshot)

    async def events(request: Request, caller: Caller, rid: str) -> Response:
        return _json_response(await events_policy(caller, SandboxRef(id=sid_of(request))),
                              rid)

    route(Op("GET", "/v1/sandboxes/{id}/events", "sandboxEvents", "Lifecycle events",
             None, EventList), events)

    async def stats(request: Request, caller: Caller, rid: str) -> Response:
        return _json_response(await stats_policy(caller, SandboxRef(id=sid_of(request))), rid)

    route(Op("GET", "/v1/sandboxes/{id}/stats", "sandboxStats", "Resource use now "
             "(memory, cpu, pids, disk)", None, SandboxStats), stats)

    # ---------------------------------------------------------------- network
    network_get_policy = h(ops.NETWORK_GET)
    network_update_policy = h(ops.NETWORK_UPDATE)

    async def network_get(request: Request, caller: Caller, rid: str) -> Response:
        return _json_response(await network_get_policy(caller, SandboxRef(
            id=sid_of(request))), rid)

    route(Op("GET", "/v1/sandboxes/{id}/network", "getSandboxNetwork",
             ops.NETWORK_GET.summary, None, NetworkView, tag="network"), network_get)

    async def network_update(request: Request, caller: Caller, rid: str) -> Response:
        policy = _decode(NetworkPolicy, await _read_body(request, cfg.max_json_body))
        body = NetworkUpdate(id=sid_of(request), policy=policy,
                             expect_generation=_q_int(request, "expect_generation", None))
        return _json_response(await network_update_policy(caller, body), rid)

    route(Op("PUT", "/v1/sandboxes/{id}/network", "updateSandboxNetwork",
             ops.NETWORK_UPDATE.summary, NetworkPolicy, NetworkView, tag="network",
             params=(Param("expect_generation", {"type": "integer", "minimum": 0},
                           description="update only if the policy is at this generation "
                                       "(409 otherwise)"),)), network_update)

    # ------------------------------------------------------------------ nodes
    async def nodes(request: Request, caller: Caller, rid: str) -> Response:
        return _json_response(await nodes_policy(caller, Empty()), rid)

    route(Op("GET", "/v1/nodes", "listNodes", "Edge nodes with usage", None, NodeList,
             tag="nodes"), nodes)

    async def info(request: Request, caller: Caller, rid: str) -> Response:
        return _json_response(await info_policy(caller, Empty()), rid)

    route(Op("GET", "/v1/info", "info", "Who am I, server version, gateway address",
             None, Info, tag="meta"), info)

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
    documented.append(Op("GET", "/metrics", "metrics", "Prometheus metrics", None, None, tag="meta",
                  auth=False))
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

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed})
    app.state.openapi = doc
    return FastPaths(app, service)


_JSON_CT = (b"content-type", b"application/json")


class FastPaths:
    """ASGI front: ``GET /v1/sandboxes/{id}`` straight to :meth:`ApiService.get`, all
    else to the Starlette app. Same behaviour as the Starlette route (auth, role check,
    error JSON, ``x-request-id``, per-route metrics), minus the middleware stack and the
    Request/Response objects (see the module docstring for the measurement)."""

    __slots__ = ("_counters", "_lat", "_service", "app")

    def __init__(self, app: Starlette, service: ApiService) -> None:
        self.app = app
        self._service = service
        self._lat = service.metrics.latency.labels("/v1/sandboxes/{id}", "GET")
        self._counters: dict[int, Any] = {}

    @property
    def state(self) -> Any:
        return self.app.state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "GET":
            path: str = scope["path"]
            if (path.startswith("/v1/sandboxes/") and len(path) > 14
                    and path.find("/", 14) < 0):
                await self._get(scope, send, path[14:])
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
                if len(r) <= 128 and r.isprintable():
                    rid = r
        if rid is None:
            global _rid_counter
            _rid_counter += 1
            rid = f"req-{_rid_prefix}-{_rid_counter:x}"
        svc = self._service
        try:
            info = await svc.get(svc.authenticate(auth, _client_host(scope)), sid)
            status, body = 200, _json.encode(info)
            headers = [_JSON_CT, (b"content-length", str(len(body)).encode()),
                       (b"x-request-id", rid.encode())]
        except Exception as exc:  # mapped exactly as the Starlette routes do
            if not isinstance(exc, DsecError):
                log.exception("request GET /v1/sandboxes/{id} failed (request id %s)", rid)
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
                "/v1/sandboxes/{id}", "GET", str(status))
        c.inc()
        self._lat.observe(time.perf_counter() - t0)


def _admin_routes(route: Callable[[Op, Handler], None], service: ApiService,
                  cfg: RestConfig) -> None:
    h = service.handler
    projects_p, project_p, quota_p = h(ops.PROJECTS), h(ops.PROJECT_GET), h(ops.QUOTA_SET)
    key_p, revoke_p = h(ops.CREATE_KEY), h(ops.REVOKE_KEY)
    open_p, renew_p, close_p = h(ops.SESSION_OPEN), h(ops.SESSION_RENEW), h(ops.SESSION_CLOSE)
    images_p, tag_p, image_p = h(ops.IMAGES), h(ops.IMAGE_TAG), h(ops.IMAGE_GET)
    delete_image_p = h(ops.IMAGE_DELETE)
    build_p = service.upload_handler(ops.IMAGE_BUILD)
    import_p = service.upload_handler(ops.IMAGE_IMPORT)

    async def projects(request: Request, caller: Caller, rid: str) -> Response:
        return _json_response(await projects_p(caller, Empty()), rid)

    route(Op("GET", "/v1/projects", "listProjects", "Projects with quotas and usage",
             None, ProjectList, tag="admin"), projects)

    async def project(request: Request, caller: Caller, rid: str) -> Response:
        return _json_response(await project_p(caller, ProjectRef(
            path=request.path_params["path"])), rid)

    route(Op("GET", "/v1/projects/{path:path}", "getProject", "A project's quota and usage",
             None, ProjectView, tag="admin"), project)

    async def quota(request: Request, caller: Caller, rid: str) -> Response:
        body = _decode(QuotaBody, await _read_body(request, cfg.max_json_body))
        path = request.path_params["path"]
        return _json_response(await quota_p(caller, QuotaSet(path=path, quota=body)), rid)

    route(Op("PUT", "/v1/quotas/{path:path}", "setQuota", "Set a project's quota (admin)",
             QuotaBody, ProjectView, tag="admin"), quota)

    async def key(request: Request, caller: Caller, rid: str) -> Response:
        body = _decode(CreateKeyRequest, await _read_body(request, cfg.max_json_body))
        return _json_response(await key_p(caller, body), rid, 201)

    route(Op("POST", "/v1/keys", "createKey", "Create an API key: for a new principal with "
             "a role on a project (admin of that project), or an extra key of the caller's "
             "own; keys of other existing principals only by a superuser",
             CreateKeyRequest, CreateKeyResponse, 201, tag="admin"), key)

    async def revoke_key(request: Request, caller: Caller, rid: str) -> Response:
        await revoke_p(caller, KeyRef(id=request.path_params["id"]))
        return Response(status_code=204, headers={"x-request-id": rid})

    route(Op("DELETE", "/v1/keys/{id}", "revokeKey", "Revoke an API key by its id (your own "
             "keys; a superuser: any non-superuser's)", None, None, 204, tag="admin"),
          revoke_key)

    async def open_session(request: Request, caller: Caller, rid: str) -> Response:
        lease = request.query_params.get("lease_s", "60")
        try:
            lease_s = float(lease)
        except ValueError:
            raise InvalidArgument(f"lease_s={lease[:20]!r} must be a number of seconds",
                                  field="lease_s") from None
        return _json_response(await open_p(caller, SessionOpen(lease_s=lease_s)), rid, 201)

    route(Op("POST", "/v1/sessions", "openSession",
             "Open a client session lease (crash-safe sandboxes)", None, SessionView, 201,
             params=(Param("lease_s", {"type": "number", "minimum": 5, "maximum": 86400}),),
             tag="sessions"), open_session)

    async def renew(request: Request, caller: Caller, rid: str) -> Response:
        return _json_response(await renew_p(caller, SessionRef(
            id=request.path_params["id"])), rid)

    route(Op("POST", "/v1/sessions/{id}/renew", "renewSession", "Renew a session lease",
             None, SessionView, tag="sessions"), renew)

    async def close(request: Request, caller: Caller, rid: str) -> Response:
        await close_p(caller, SessionRef(id=request.path_params["id"]))
        return Response(status_code=204, headers={"x-request-id": rid})

    async def images(request: Request, caller: Caller, rid: str) -> Response:
        return _json_response(await images_p(caller, Empty()), rid)

    route(Op("GET", "/v1/images", "listImages", "Image layers of the cluster's layer store "
             "visible to this key (cluster-wide ones and those of its projects)",
             None, ImageList, tag="images"), images)

    async def tag_image(request: Request, caller: Caller, rid: str) -> Response:
        body = _decode(ImageTagRequest, await _read_body(request, cfg.max_json_body))
        return _json_response(await tag_p(caller, body), rid)

    route(Op("POST", "/v1/images/tag", "tagImage", "Point a name ([project/]name[:tag]) at "
             "a layer (write right on the name's namespace; the layer must belong to it, an "
             "ancestor project or be cluster-wide)", ImageTagRequest, ImageView,
             tag="images"), tag_image)

    async def get_image(request: Request, caller: Caller, rid: str) -> Response:
        return _json_response(await image_p(caller, ImageRef(ref=request.path_params["ref"])),
                              rid)

    route(Op("GET", "/v1/images/{ref:path}", "getImage", "One image by [project/]name[:tag] "
             "or digest (a bare name: the key's project first, then cluster-wide)", None,
             ImageView, tag="images"), get_image)

    async def delete_image(request: Request, caller: Caller, rid: str) -> Response:
        await delete_image_p(caller, ImageRef(ref=request.path_params["ref"]))
        return Response(status_code=204, headers={"x-request-id": rid})

    route(Op("DELETE", "/v1/images/{ref:path}", "deleteImage", "Delete a name (and its layer "
             "when nothing else names or uses it), or by digest a layer and all its names "
             "(write right on the namespaces; 409 in_use while a sandbox or snapshot uses "
             "it)", None, None, 204, tag="images"), delete_image)

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

    params = (Param("name", {"type": "string", "minLength": 1}, True,
                    "[project/]name: a project's name needs member there, a bare "
                    "(cluster-wide) name a superuser"),
              Param("kind", {"enum": ["base", "workspace", "toolkit"]}),
              Param("tag", {"type": "string", "pattern": r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$"}))
    route(Op("POST", "/v1/images", "buildImage", "Build a layer from an uploaded tar (raw "
             "body)", "binary", ImageList, 201, params=params, tag="images"), upload(build_p))
    route(Op("POST", "/v1/images/import", "importImage", "Import an OCI image (docker save "
             "tarball or OCI layout tar, raw body)", "binary", ImageList, 201, params=params,
             tag="images"), upload(import_p))

    route(Op("DELETE", "/v1/sessions/{id}", "closeSession",
             "End a session now: its sandboxes are destroyed", None, None, 204,
             tag="sessions"), close)


_STATES = frozenset({"creating", "running", "pausing", "paused", "resuming", "destroying",
                     "destroyed", "failed"})
_ANON = Caller(id="anonymous", name="anonymous", roles={})


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
