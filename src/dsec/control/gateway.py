"""The Aether gateway: the apiserver's operations over Aether for the SDK fast path.

Same :class:`~dsec.control.api.service.ApiService` as REST, so the same auth, roles,
rate limits, idempotency and forwarding apply; only the encoding differs (msgpack with
raw bytes, no base64, no HTTP parsing) and calls multiplex and pipeline on one
connection. ``api.create_many`` and ``api.exec_many`` are single requests carrying many
items, grouped per edge into one batched edge call each.

A connection first authenticates with an API key (``aether.auth``, i.e.
``connect(address, token=api_key)``): until then it may send nothing else, frames over
4 KiB, or stay longer than the listener's ``auth_timeout_s``, so a stranger holding
connections costs the node a bounded number of file descriptors and bytes (see
:mod:`dsec.aether.limits`). Every request body still carries the key it acts with
(``key``): authorization is per call, and the service's principal cache makes a repeated
key a dict lookup, not a hash. Methods are ``api.<op>``; bodies are the structs below.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import msgspec

from dsec.aether import Router, Server, StreamSender, current_peer, serve
from dsec.aether.limits import ServerLimits
from dsec.aether.messages import ErrorBody, error_body
from dsec.control.api.service import ApiService
from dsec.control.api.types import (
    CreateKeyRequest,
    CreateKeyResponse,
    CreateSandboxRequest,
    EventList,
    FileList,
    Info,
    NodeList,
    SandboxList,
    SessionView,
    SnapshotList,
    SnapshotView,
)
from dsec.edge.spec import (
    ExecRequest,
    ExecResult,
    FileInfo,
    PauseStats,
    SandboxInfo,
    SandboxState,
    SandboxStats,
)
from dsec.errors import DsecError, InvalidArgument

__all__ = [
    "GwCreate",
    "GwCreateMany",
    "GwExec",
    "GwExecMany",
    "GwFile",
    "GwList",
    "GwRead",
    "GwRef",
    "GwSession",
    "GwSnapshot",
    "GwSnapshots",
    "GwWrite",
    "Outcome",
    "gateway_router",
    "serve_gateway",
]


class _Keyed(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    key: str


class GwRef(_Keyed, kw_only=True):
    id: str


class GwCreate(_Keyed, kw_only=True):
    req: CreateSandboxRequest
    idempotency_key: str | None = None


class GwCreateMany(_Keyed, kw_only=True):
    reqs: list[CreateSandboxRequest]
    # One Idempotency-Key per item (the SDK's): a retried batch makes nothing twice.
    idempotency_keys: list[str] | None = None


class GwList(_Keyed, kw_only=True):
    project: str | None = None
    labels: dict[str, str] = {}
    state: SandboxState | None = None
    limit: int = 100
    cursor: str | None = None


class GwExec(_Keyed, kw_only=True):
    id: str
    req: ExecRequest


class GwExecCall(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    id: str
    req: ExecRequest


class GwExecMany(_Keyed, kw_only=True):
    calls: list[GwExecCall]


class GwRead(_Keyed, kw_only=True):
    id: str
    path: str
    offset: int = 0
    length: int | None = None


class GwWrite(_Keyed, kw_only=True):
    id: str
    path: str
    data: bytes
    mode: int = 0o644
    append: bool = False


class GwFile(_Keyed, kw_only=True):
    id: str
    path: str
    recursive: bool = False
    parents: bool = True


class GwSession(_Keyed, kw_only=True):
    id: str | None = None
    lease_s: float = 60.0


class GwSnapshot(_Keyed, kw_only=True):
    id: str
    strip: list[str] = []


class GwSnapshots(_Keyed, kw_only=True):
    project: str | None = None
    sandbox_id: str | None = None


class GwKey(_Keyed, kw_only=True):
    req: CreateKeyRequest


class Outcome(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One item of a batch reply: ``error`` or exactly one value field."""

    error: ErrorBody | None = None
    info: SandboxInfo | None = None
    result: ExecResult | None = None


def _outcome_of(x: Any) -> Outcome:
    if isinstance(x, DsecError):
        return Outcome(error=error_body(x))
    if isinstance(x, SandboxInfo):
        return Outcome(info=x)
    return Outcome(result=x)


def gateway_router(service: ApiService, admin: Any = None) -> Router:
    """The ``api.*`` methods bound to ``service`` (and ``admin`` for sessions/keys)."""
    auth = service.authenticate

    def admit(credential: bytes, peer: str) -> None:
        # The connection's key: failures charge the peer address's anonymous budget
        # (429 once it is spent), like REST does per client address.
        auth(credential.decode("utf-8", "replace"), peer or "gateway")

    r = Router(authenticate=admit, credential="API key")
    redact = service.redact

    def caller(body: _Keyed) -> Any:
        # A call's own key: failures are charged to the peer's address too (uid:<n> over
        # a Unix socket), like the connection's key. They used to share one budget
        # ("gateway", still the fallback when no listener names the peer): a peer could
        # spend it with bad per-call keys and lock every key not yet in the principal
        # cache out of the gateway's calls.
        return auth(body.key, current_peer() or "gateway")

    def add(method: str, fn: Callable[..., Any], **kw: Any) -> None:
        """``r.add`` with errors passed through ``service.redact`` (no host paths)."""
        if inspect.iscoroutinefunction(fn):
            async def run_async(*args: Any) -> Any:
                try:
                    return await fn(*args)
                except DsecError as exc:
                    raise redact(exc) from None
            r.add(method, run_async, **kw)
        else:
            def run(*args: Any) -> Any:
                try:
                    return fn(*args)
                except DsecError as exc:
                    raise redact(exc) from None
            r.add(method, run, **kw)

    def _outcome(x: Any) -> Outcome:
        return _outcome_of(redact(x) if isinstance(x, DsecError) else x)

    def info(b: _Keyed) -> Info:
        return service.info(caller(b))

    add("api.info", info, request_type=_Keyed)

    async def create(b: GwCreate) -> SandboxInfo:
        return await service.create(caller(b), b.req, idempotency_key=b.idempotency_key)

    add("api.create", create, request_type=GwCreate)

    async def create_many(b: GwCreateMany) -> list[Outcome]:
        return [_outcome(x) for x in await service.create_many(caller(b), b.reqs,
                                                               b.idempotency_keys)]

    add("api.create_many", create_many, request_type=GwCreateMany)

    async def get(b: GwRef) -> SandboxInfo:
        return await service.get(caller(b), b.id)

    add("api.get", get, request_type=GwRef)

    async def list_(b: GwList) -> SandboxList:
        items, nxt = await service.list(caller(b), project=b.project, labels=b.labels,
                                        state=b.state, limit=b.limit, cursor=b.cursor)
        return SandboxList(items=items, next_cursor=nxt)

    add("api.list", list_, request_type=GwList)

    async def destroy(b: GwRef) -> None:
        await service.destroy(caller(b), b.id)

    add("api.destroy", destroy, request_type=GwRef)

    async def exec_(b: GwExec) -> ExecResult:
        return await service.exec(caller(b), b.id, b.req.validate())

    add("api.exec", exec_, request_type=GwExec)

    async def exec_many(b: GwExecMany) -> list[Outcome]:
        items = [(c.id, c.req.validate()) for c in b.calls]
        return [_outcome(x) for x in await service.exec_many(caller(b), items)]

    add("api.exec_many", exec_many, request_type=GwExecMany)

    async def exec_stream(b: GwExec, out: StreamSender) -> ExecResult:
        stream = await service.exec_stream(caller(b), b.id, b.req.validate())
        final: ExecResult | None = None
        async for item in stream:
            if isinstance(item, ExecResult):
                final = item
            else:
                await out.send(item)
        if final is None:
            raise InvalidArgument("exec stream ended without a result")
        return final

    add("api.exec_stream", exec_stream, request_type=GwExec, streaming=True)

    async def read_file(b: GwRead) -> bytes:
        return await service.read_file(caller(b), b.id, b.path, b.offset, b.length)

    add("api.read_file", read_file, request_type=GwRead)

    async def write_file(b: GwWrite) -> None:
        await service.write_file(caller(b), b.id, b.path, b.data, b.mode, b.append)

    add("api.write_file", write_file, request_type=GwWrite)

    async def list_dir(b: GwFile) -> FileList:
        return FileList(items=await service.list_dir(caller(b), b.id, b.path))

    add("api.list_dir", list_dir, request_type=GwFile)

    async def stat(b: GwFile) -> FileInfo:
        return await service.stat(caller(b), b.id, b.path)

    add("api.stat", stat, request_type=GwFile)

    async def mkdir(b: GwFile) -> None:
        await service.mkdir(caller(b), b.id, b.path, b.parents)

    add("api.mkdir", mkdir, request_type=GwFile)

    async def remove(b: GwFile) -> None:
        await service.remove(caller(b), b.id, b.path, b.recursive)

    add("api.remove", remove, request_type=GwFile)

    async def pause(b: GwRef) -> PauseStats:
        return await service.pause(caller(b), b.id)

    add("api.pause", pause, request_type=GwRef)

    async def resume(b: GwRef) -> SandboxInfo:
        c = caller(b)
        await service.resume(c, b.id)
        return await service.get(c, b.id)

    add("api.resume", resume, request_type=GwRef)

    async def snapshot(b: GwSnapshot) -> SnapshotView:
        return await service.snapshot(caller(b), b.id, b.strip)

    add("api.snapshot", snapshot, request_type=GwSnapshot)

    async def snapshots(b: GwSnapshots) -> SnapshotList:
        return SnapshotList(items=await service.list_snapshots(
            caller(b), project=b.project, sandbox_id=b.sandbox_id))

    add("api.snapshots", snapshots, request_type=GwSnapshots)

    async def snapshot_get(b: GwRef) -> SnapshotView:
        return await service.get_snapshot(caller(b), b.id)

    add("api.snapshot_get", snapshot_get, request_type=GwRef)

    async def snapshot_delete(b: GwRef) -> SnapshotView:
        return await service.delete_snapshot(caller(b), b.id)

    add("api.snapshot_delete", snapshot_delete, request_type=GwRef)

    async def events(b: GwRef) -> EventList:
        return EventList(items=await service.events(caller(b), b.id))

    add("api.events", events, request_type=GwRef)

    async def stats(b: GwRef) -> SandboxStats:
        return await service.stats(caller(b), b.id)

    add("api.stats", stats, request_type=GwRef)

    def nodes(b: _Keyed) -> NodeList:
        return NodeList(items=service.nodes(caller(b)))

    add("api.nodes", nodes, request_type=_Keyed)

    if admin is not None:
        def session_open(b: GwSession) -> SessionView:
            v: SessionView = admin.open_session(caller(b), b.lease_s)
            return v

        def session_renew(b: GwSession) -> SessionView:
            v: SessionView = admin.renew_session(caller(b), b.id or "")
            return v

        def session_close(b: GwSession) -> None:
            admin.close_session(caller(b), b.id or "")

        def create_key(b: GwKey) -> CreateKeyResponse:
            v: CreateKeyResponse = admin.create_key(caller(b), b.req)
            return v

        add("api.session_open", session_open, request_type=GwSession)
        add("api.session_renew", session_renew, request_type=GwSession)
        add("api.session_close", session_close, request_type=GwSession)
        add("api.create_key", create_key, request_type=GwKey)

        def revoke_key(b: GwRef) -> None:
            admin.revoke_key(caller(b), b.id)

        add("api.revoke_key", revoke_key, request_type=GwRef)
    return r


async def serve_gateway(service: ApiService, admin: Any, address: str, *,
                        limits: ServerLimits | None = None) -> Server:
    """Listen on ``address`` (``tcp:HOST:PORT`` or ``unix:PATH``) for gateway calls, under
    ``limits`` (default :data:`dsec.aether.limits.DEFAULT_LIMITS`)."""
    return await serve(gateway_router(service, admin), address, limits=limits)
