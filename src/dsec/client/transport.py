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

import builtins
from collections.abc import AsyncIterator, Mapping, Sequence
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
    CreateSandboxRequest,
    EventList,
    ExecOutput,
    ExecStreamLine,
    FileList,
    Info,
    NodeList,
    SandboxList,
    SessionView,
    SnapshotList,
    SnapshotView,
)
from dsec.wire.calls import (
    CreateMany,
    CreateSandbox,
    Empty,
    ExecCall,
    ExecMany,
    FileRef,
    ListSandboxes,
    Mkdir,
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
from dsec.wire.jsonform import exec_body, exec_result, stream_item
from dsec.wire.ops import USE_CLIENT_DEFAULT, Deadline, Op, UseClientDefault
from dsec.wire.outcome import Batch
from dsec.wire.spec import (
    ExecChunk,
    ExecRequest,
    ExecResult,
    FileInfo,
    PauseStats,
    SandboxEvent,
    SandboxInfo,
    SandboxSpec,
    SandboxStats,
)

__all__ = ["AetherTransport", "HttpTransport", "Transport"]

_json = msgspec.json.Encoder()
Req = TypeVar("Req")
Rep = TypeVar("Rep")


class Transport(Protocol):
    """What the SDK core needs from a connection to an apiserver."""

    name: str

    async def info(self) -> Info: ...
    async def create(self, req: CreateSandboxRequest, idempotency_key: str | None) -> SandboxInfo: ...
    async def create_many(self, reqs: Sequence[CreateSandboxRequest],
                          keys: Sequence[str] | None = None) -> list[SandboxInfo | DsecError]: ...
    async def get(self, sid: str) -> SandboxInfo: ...
    async def list(self, *, project: str | None, labels: Mapping[str, str], state: str | None,
                   limit: int, cursor: str | None) -> SandboxList: ...
    async def destroy(self, sid: str) -> None: ...
    async def exec(self, sid: str, req: ExecRequest, timeout: float | None) -> ExecResult: ...
    async def exec_many(self, calls: Sequence[tuple[str, ExecRequest]],
                        timeout: float | None) -> builtins.list[ExecResult | DsecError]: ...
    def exec_stream(self, sid: str, req: ExecRequest,
                    timeout: float | None) -> AsyncIterator[ExecChunk | ExecResult]: ...
    async def read_file(self, sid: str, path: str, offset: int, length: int | None) -> bytes: ...
    async def write_file(self, sid: str, path: str, data: bytes, mode: int, append: bool) -> None: ...
    async def list_dir(self, sid: str, path: str) -> builtins.list[FileInfo]: ...
    async def stat(self, sid: str, path: str) -> FileInfo: ...
    async def mkdir(self, sid: str, path: str, parents: bool) -> None: ...
    async def remove(self, sid: str, path: str, recursive: bool) -> None: ...
    async def pause(self, sid: str) -> PauseStats: ...
    async def resume(self, sid: str) -> SandboxInfo: ...
    async def snapshot(self, sid: str, strip: Sequence[str]) -> SnapshotView: ...
    async def snapshots(self, project: str | None, sandbox_id: str | None) -> SnapshotList: ...
    async def snapshot_get(self, ref: str) -> SnapshotView: ...
    async def snapshot_delete(self, ref: str) -> None: ...
    async def events(self, sid: str) -> builtins.list[SandboxEvent]: ...
    async def stats(self, sid: str) -> SandboxStats: ...
    async def nodes(self) -> NodeList: ...
    async def session_open(self, lease_s: float) -> SessionView: ...
    async def session_renew(self, session_id: str) -> SessionView: ...
    async def session_close(self, session_id: str) -> None: ...
    async def close(self) -> None: ...


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
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=256))

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

    async def _json(self, tp: Any, method: str, path: str, **kw: Any) -> Any:
        resp = await self._req(method, path, **kw)
        try:
            return msgspec.json.decode(resp.content, type=tp)
        except msgspec.DecodeError as exc:
            raise RemoteProtocolError(f"{method} {path}: undecodable {tp} reply: {exc}") from exc

    async def info(self) -> Info:
        return await self._json(Info, "GET", "/v1/info")  # type: ignore[no-any-return]

    async def create(self, req: CreateSandboxRequest, idempotency_key: str | None) -> SandboxInfo:
        headers = {"idempotency-key": idempotency_key} if idempotency_key else {}
        return await self._json(SandboxInfo, "POST", "/v1/sandboxes",  # type: ignore[no-any-return]
                                content=_json.encode(req), headers={
                                    **headers, "content-type": "application/json"})

    async def create_many(self, reqs: Sequence[CreateSandboxRequest],
                          keys: Sequence[str] | None = None) -> list[SandboxInfo | DsecError]:
        """One ``POST /v1/batch/create`` (each item succeeds or fails alone)."""
        if self._info is None:
            self._info = await self.info()
        body = CreateMany(items=[spec_of(r, self._info) for r in reqs],
                          session=reqs[0].session if reqs else None,
                          idempotency_keys=None if keys is None else list(keys))
        batch: Batch[SandboxInfo] = await self._json(
            ops.CREATE_MANY.reply, "POST", "/v1/batch/create", content=_json.encode(body),
            headers={"content-type": "application/json"})
        return batch.results()

    async def get(self, sid: str) -> SandboxInfo:
        return await self._json(SandboxInfo, "GET", f"/v1/sandboxes/{sid}")  # type: ignore[no-any-return]

    async def list(self, *, project: str | None, labels: Mapping[str, str], state: str | None,
                   limit: int, cursor: str | None) -> SandboxList:
        params: list[tuple[str, str]] = [("limit", str(limit))]
        if project:
            params.append(("project", project))
        if state:
            params.append(("state", state))
        if cursor:
            params.append(("cursor", cursor))
        params += [("label", f"{k}={v}") for k, v in labels.items()]
        return await self._json(SandboxList, "GET", "/v1/sandboxes", params=params)  # type: ignore[no-any-return]

    async def destroy(self, sid: str) -> None:
        await self._req("DELETE", f"/v1/sandboxes/{sid}")

    async def exec(self, sid: str, req: ExecRequest, timeout: float | None) -> ExecResult:
        out = await self._json(ExecOutput, "POST", f"/v1/sandboxes/{sid}/exec",
                               content=_json.encode(exec_body(req)), timeout=timeout,
                               effect=_COMMAND, headers={"content-type": "application/json"})
        return exec_result(out)

    async def exec_many(self, calls: Sequence[tuple[str, ExecRequest]],
                        timeout: float | None) -> builtins.list[ExecResult | DsecError]:
        """One ``POST /v1/batch/exec``, grouped per edge by the apiserver."""
        body = ExecMany(calls=[ExecCall(id=s, req=r) for s, r in calls])
        batch: Batch[ExecResult] = await self._json(
            ops.EXEC_MANY.reply, "POST", "/v1/batch/exec", content=_json.encode(body),
            timeout=timeout, effect=_COMMAND, headers={"content-type": "application/json"})
        return batch.results()

    async def exec_stream(self, sid: str, req: ExecRequest,
                          timeout: float | None) -> AsyncIterator[ExecChunk | ExecResult]:
        path = f"/v1/sandboxes/{sid}/exec/stream"
        dec = msgspec.json.Decoder(ExecStreamLine)
        try:
            async with self._http.stream("POST", path, content=_json.encode(exec_body(req)),
                                         timeout=timeout,
                                         headers={"content-type": "application/json"}) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    raise _http_error(resp)
                async for line in resp.aiter_lines():
                    if not line:
                        continue
                    item = stream_item(dec.decode(line))
                    yield item
                    if isinstance(item, ExecResult):
                        return
        except httpx.HTTPError as exc:
            raise _http_failure(exc, f"exec stream on {sid}", timeout, _COMMAND) from exc

    async def read_file(self, sid: str, path: str, offset: int, length: int | None) -> bytes:
        params: dict[str, Any] = {"path": path}
        if offset:
            params["offset"] = offset
        if length is not None:
            params["length"] = length
        return (await self._req("GET", f"/v1/sandboxes/{sid}/files", params=params)).content

    async def write_file(self, sid: str, path: str, data: bytes, mode: int, append: bool) -> None:
        params: dict[str, Any] = {"path": path, "mode": mode}
        if append:
            params["append"] = "true"
        await self._req("PUT", f"/v1/sandboxes/{sid}/files", params=params, content=data,
                        headers={"content-type": "application/octet-stream"})

    async def list_dir(self, sid: str, path: str) -> builtins.list[FileInfo]:
        r: FileList = await self._json(FileList, "GET", f"/v1/sandboxes/{sid}/files/list",
                                       params={"path": path})
        return r.items

    async def stat(self, sid: str, path: str) -> FileInfo:
        return await self._json(FileInfo, "GET", f"/v1/sandboxes/{sid}/files/stat",  # type: ignore[no-any-return]
                                params={"path": path})

    async def mkdir(self, sid: str, path: str, parents: bool) -> None:
        await self._req("POST", f"/v1/sandboxes/{sid}/files/mkdir",
                        params={"path": path, "parents": "true" if parents else "false"})

    async def remove(self, sid: str, path: str, recursive: bool) -> None:
        params = {"path": path, "recursive": "true" if recursive else "false"}
        await self._req("DELETE", f"/v1/sandboxes/{sid}/files", params=params)

    async def pause(self, sid: str) -> PauseStats:
        return await self._json(PauseStats, "POST", f"/v1/sandboxes/{sid}/pause")  # type: ignore[no-any-return]

    async def resume(self, sid: str) -> SandboxInfo:
        return await self._json(SandboxInfo, "POST", f"/v1/sandboxes/{sid}/resume")  # type: ignore[no-any-return]

    async def snapshot(self, sid: str, strip: Sequence[str]) -> SnapshotView:
        return await self._json(SnapshotView, "POST", f"/v1/sandboxes/{sid}/snapshot",  # type: ignore[no-any-return]
                                params=[("strip", p) for p in strip])

    async def snapshots(self, project: str | None, sandbox_id: str | None) -> SnapshotList:
        params = {k: v for k, v in (("project", project), ("sandbox_id", sandbox_id))
                  if v is not None}
        return await self._json(SnapshotList, "GET", "/v1/snapshots", params=params)  # type: ignore[no-any-return]

    async def snapshot_get(self, ref: str) -> SnapshotView:
        return await self._json(SnapshotView, "GET", f"/v1/snapshots/{ref}")  # type: ignore[no-any-return]

    async def snapshot_delete(self, ref: str) -> None:
        await self._req("DELETE", f"/v1/snapshots/{ref}")

    async def events(self, sid: str) -> builtins.list[SandboxEvent]:
        r: EventList = await self._json(EventList, "GET", f"/v1/sandboxes/{sid}/events")
        return r.items

    async def stats(self, sid: str) -> SandboxStats:
        r: SandboxStats = await self._json(SandboxStats, "GET", f"/v1/sandboxes/{sid}/stats")
        return r

    async def nodes(self) -> NodeList:
        return await self._json(NodeList, "GET", "/v1/nodes")  # type: ignore[no-any-return]

    async def session_open(self, lease_s: float) -> SessionView:
        return await self._json(SessionView, "POST", "/v1/sessions",  # type: ignore[no-any-return]
                                params={"lease_s": lease_s})

    async def session_renew(self, session_id: str) -> SessionView:
        return await self._json(SessionView, "POST", f"/v1/sessions/{session_id}/renew")  # type: ignore[no-any-return]

    async def session_close(self, session_id: str) -> None:
        await self._req("DELETE", f"/v1/sessions/{session_id}")

    async def close(self) -> None:
        await self._http.aclose()


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

    async def info(self) -> Info:
        self._info = await self.call(ops.INFO, Empty())
        return self._info

    async def _spec(self, req: CreateSandboxRequest) -> SandboxSpec:
        """The spec a create asks for (:func:`spec_of`; ``api.info`` asked once)."""
        return spec_of(req, self._info if self._info is not None else await self.info())

    async def create(self, req: CreateSandboxRequest, idempotency_key: str | None) -> SandboxInfo:
        return await self.call(ops.CREATE, CreateSandbox(
            spec=await self._spec(req), session=req.session, idempotency_key=idempotency_key))

    async def create_many(self, reqs: Sequence[CreateSandboxRequest],
                          keys: Sequence[str] | None = None) -> list[SandboxInfo | DsecError]:
        specs = [await self._spec(r) for r in reqs]
        session = reqs[0].session if reqs else None
        batch = await self.call(ops.CREATE_MANY, CreateMany(
            items=specs, session=session, idempotency_keys=None if keys is None else list(keys)))
        return batch.results()

    async def get(self, sid: str) -> SandboxInfo:
        return await self.call(ops.GET, SandboxRef(id=sid))

    async def list(self, *, project: str | None, labels: Mapping[str, str], state: str | None,
                   limit: int, cursor: str | None) -> SandboxList:
        return await self.call(ops.LIST, ListSandboxes(
            project=project, labels=dict(labels), state=state,  # type: ignore[arg-type]
            limit=limit, cursor=cursor))

    async def destroy(self, sid: str) -> None:
        await self.call(ops.DESTROY, SandboxRef(id=sid))

    async def exec(self, sid: str, req: ExecRequest, timeout: float | None) -> ExecResult:
        return await self.call(ops.EXEC, ExecCall(id=sid, req=req), timeout=timeout)

    async def exec_many(self, calls: Sequence[tuple[str, ExecRequest]],
                        timeout: float | None) -> builtins.list[ExecResult | DsecError]:
        batch = await self.call(ops.EXEC_MANY, ExecMany(
            calls=[ExecCall(id=s, req=r) for s, r in calls]), timeout=timeout)
        return batch.results()

    async def exec_stream(self, sid: str, req: ExecRequest,
                          timeout: float | None) -> AsyncIterator[ExecChunk | ExecResult]:
        conn = await self._c()
        op = ops.EXEC_STREAM
        stream = conn.stream(op.api_method, ExecCall(id=sid, req=req), timeout=timeout,
                             item_type=op.item, response_type=op.reply)
        try:
            async with stream:
                async for chunk in stream:
                    yield chunk
                yield stream.result
        except ConnectionLost as exc:
            if exc.detail.get("retryable"):
                raise
            raise _aether_lost(exc, op.api_method, self.address, _COMMAND) from exc

    async def read_file(self, sid: str, path: str, offset: int, length: int | None) -> bytes:
        return await self.call(ops.READ_FILE, ReadFile(id=sid, path=path, offset=offset,
                                                       length=length))

    async def write_file(self, sid: str, path: str, data: bytes, mode: int, append: bool) -> None:
        await self.call(ops.WRITE_FILE, WriteFile(id=sid, path=path, data=data, mode=mode,
                                                  append=append))

    async def list_dir(self, sid: str, path: str) -> builtins.list[FileInfo]:
        return (await self.call(ops.LIST_DIR, FileRef(id=sid, path=path))).items

    async def stat(self, sid: str, path: str) -> FileInfo:
        return await self.call(ops.STAT, FileRef(id=sid, path=path))

    async def mkdir(self, sid: str, path: str, parents: bool) -> None:
        await self.call(ops.MKDIR, Mkdir(id=sid, path=path, parents=parents))

    async def remove(self, sid: str, path: str, recursive: bool) -> None:
        await self.call(ops.REMOVE, Remove(id=sid, path=path, recursive=recursive))

    async def pause(self, sid: str) -> PauseStats:
        return await self.call(ops.PAUSE, SandboxRef(id=sid))

    async def resume(self, sid: str) -> SandboxInfo:
        return await self.call(ops.RESUME, SandboxRef(id=sid))

    async def snapshot(self, sid: str, strip: Sequence[str]) -> SnapshotView:
        return await self.call(ops.SNAPSHOT, SnapshotCall(id=sid, strip=list(strip)))

    async def snapshots(self, project: str | None, sandbox_id: str | None) -> SnapshotList:
        return await self.call(ops.SNAPSHOTS, SnapshotQuery(project=project,
                                                            sandbox_id=sandbox_id))

    async def snapshot_get(self, ref: str) -> SnapshotView:
        return await self.call(ops.SNAPSHOT_GET, SnapshotRef(id=ref))

    async def snapshot_delete(self, ref: str) -> None:
        await self.call(ops.SNAPSHOT_DELETE, SnapshotRef(id=ref))

    async def events(self, sid: str) -> builtins.list[SandboxEvent]:
        return (await self.call(ops.EVENTS, SandboxRef(id=sid))).items

    async def stats(self, sid: str) -> SandboxStats:
        return await self.call(ops.STATS, SandboxRef(id=sid))

    async def nodes(self) -> NodeList:
        return await self.call(ops.NODES, Empty())

    async def session_open(self, lease_s: float) -> SessionView:
        return await self.call(ops.SESSION_OPEN, SessionOpen(lease_s=lease_s))

    async def session_renew(self, session_id: str) -> SessionView:
        return await self.call(ops.SESSION_RENEW, SessionRef(id=session_id))

    async def session_close(self, session_id: str) -> None:
        await self.call(ops.SESSION_CLOSE, SessionRef(id=session_id))

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None


def spec_of(req: CreateSandboxRequest, info: Info) -> SandboxSpec:
    """The spec a create asks for, with what the request leaves to the server filled in
    from its ``info`` (the default backend, the key's default project): until a spec can
    leave them unset (issue 13's spec passthrough) the catalogue's create rows take both
    as given."""
    return SandboxSpec(
        image=req.image, workspace=req.workspace, toolkits=tuple(req.toolkits),
        snapshot=req.snapshot,
        backend=req.backend or info.default_backend or "simulated",  # type: ignore[arg-type]
        cpu_milli=req.cpu_milli, memory_bytes=req.memory_bytes, disk_bytes=req.disk_bytes,
        pids_max=req.pids_max, priority=req.priority, labels=dict(req.labels),
        project=req.project or info.project or "default", ttl_s=req.ttl_s,
        idle_timeout_s=req.idle_timeout_s, idle_action=req.idle_action, env=dict(req.env),
        network=req.network, allow_nested=req.allow_nested,
        user_namespace=req.user_namespace)


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
