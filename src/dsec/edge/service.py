"""The edge service: every :class:`~dsec.edge.node.EdgeNode` operation over Aether, and
:class:`EdgeClient`, the typed async client the apiserver, SDK and RL toolkit use.

Methods are ``edge.<op>`` with bodies from :mod:`dsec.edge.protocol`. Queries (get,
list, events, feed, heartbeat, info) are synchronous handlers, which Aether runs inline
in its read loop; operations that await a backend are async handlers (one task each).
Batched create/destroy/exec are single requests whose items run concurrently on the
node, and ``edge.exec_stream`` streams output chunks as STREAM frames.

Errors cross the wire as their own class (``CapacityExceeded`` on the edge is
``CapacityExceeded`` in the client), batch items carry their error in place.
"""

from __future__ import annotations

import builtins
import dataclasses
from collections.abc import AsyncIterator, Mapping, Sequence
from types import EllipsisType
from typing import Any, Self

from dsec.aether import Connection, Router, Server, StreamSender, connect, serve
from dsec.aether.limits import DEFAULT_LIMITS, ServerLimits
from dsec.edge.node import EdgeNode
from dsec.edge.protocol import (
    METHODS,
    Command,
    CreateManyOnNode,
    CreateManyReply,
    CreateRequest,
    DestroyMany,
    DestroyRequest,
    EventFeed,
    ExecCall,
    ExecMany,
    ExecManyReply,
    ExecOutcome,
    FeedRequest,
    FileRequest,
    Heartbeat,
    HeartbeatRequest,
    InfoOutcome,
    ListRequest,
    NodeInfo,
    ReadFileRequest,
    SandboxRef,
    SnapshotQuery,
    SnapshotRef,
    SnapshotRequest,
    WriteFileRequest,
    exec_request,
    outcome_error,
    outcome_value,
)
from dsec.edge.spec import (
    ExecChunk,
    ExecResult,
    FileInfo,
    PauseStats,
    SandboxEvent,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    SandboxStats,
    SnapshotInfo,
)
from dsec.errors import DsecError, InvalidArgument, RemoteProtocolError

__all__ = ["EdgeClient", "EdgeService", "serve_edge"]

# A call's request deadline in seconds; None waits forever; ... means the client default.
_Deadline = float | None | EllipsisType


class EdgeService:
    """Binds an :class:`EdgeNode` to an Aether :class:`Router` (``service.router``)."""

    def __init__(self, node: EdgeNode, *, token: bytes | str | None = None) -> None:
        self.node = node
        r = self.router = Router(token=token)
        n = node
        r.add("edge.info", self._info)
        r.add("edge.create", self._create, request_type=CreateRequest)
        r.add("edge.create_many", self._create_many, request_type=CreateManyOnNode)
        r.add("edge.get", lambda b: n.get(b.id), request_type=SandboxRef)
        r.add("edge.list", lambda b: n.list(state=b.state, project=b.project, labels=b.labels),
              request_type=ListRequest)
        r.add("edge.events", lambda b: n.events(b.id), request_type=SandboxRef)
        r.add("edge.feed", lambda b: n.feed(b.after, b.limit), request_type=FeedRequest)
        r.add("edge.heartbeat", lambda b: n.heartbeat(include_sandboxes=b.include_sandboxes),
              request_type=HeartbeatRequest)
        r.add("edge.exec", self._exec, request_type=ExecCall)
        r.add("edge.exec_many", self._exec_many, request_type=ExecMany)
        r.add("edge.exec_stream", self._exec_stream, request_type=ExecCall, streaming=True)
        r.add("edge.read_file", self._read_file, request_type=ReadFileRequest)
        r.add("edge.write_file", self._write_file, request_type=WriteFileRequest)
        r.add("edge.list_dir", self._list_dir, request_type=FileRequest)
        r.add("edge.stat", self._stat, request_type=FileRequest)
        r.add("edge.mkdir", self._mkdir, request_type=FileRequest)
        r.add("edge.remove", self._remove, request_type=FileRequest)
        r.add("edge.pause", self._pause, request_type=SandboxRef)
        r.add("edge.resume", self._resume, request_type=SandboxRef)
        r.add("edge.destroy", self._destroy, request_type=DestroyRequest)
        r.add("edge.destroy_many", self._destroy_many, request_type=DestroyMany)
        r.add("edge.stats", self._stats, request_type=SandboxRef)
        r.add("edge.snapshot", self._snapshot, request_type=SnapshotRequest)
        r.add("edge.snapshots", self._snapshots, request_type=SnapshotQuery)
        r.add("edge.snapshot_get", self._snapshot_get, request_type=SnapshotRef)
        r.add("edge.snapshot_delete", self._snapshot_delete, request_type=SnapshotRef)
        assert set(r.methods) == set(METHODS), set(r.methods) ^ set(METHODS)

    def _info(self, _: Any) -> NodeInfo:
        n = self.node
        return NodeInfo(node=n.node_id, backends=sorted(n.backends),
                        capacity=n.pool.capacity.as_resources(), labels=dict(n.config.labels),
                        methods=list(METHODS), physical=n.pool.capacity.physical)

    async def _create(self, b: CreateRequest) -> SandboxInfo:
        return await self.node.create(b.spec, sandbox_id=b.sandbox_id)

    async def _create_many(self, b: CreateManyOnNode) -> CreateManyReply:
        res = await self.node.create_many(b.specs)
        return CreateManyReply(items=[
            InfoOutcome(error=outcome_error(r)) if isinstance(r, BaseException)
            else InfoOutcome(info=r) for r in res])

    async def _exec(self, b: ExecCall) -> ExecResult:
        return await self.node.exec(b.id, b.req)

    async def _exec_many(self, b: ExecMany) -> ExecManyReply:
        res = await self.node.exec_many([(c.id, c.req) for c in b.calls])
        return ExecManyReply(items=[
            ExecOutcome(error=outcome_error(r)) if isinstance(r, BaseException)
            else ExecOutcome(result=r) for r in res])

    async def _exec_stream(self, b: ExecCall, out: StreamSender) -> ExecResult:
        final: ExecResult | None = None
        async for item in self.node.exec_stream(b.id, b.req):
            if isinstance(item, ExecResult):
                final = item
            else:
                await out.send(item)
        if final is None:
            raise RemoteProtocolError(f"backend stream for {b.id} ended without a result")
        return final

    async def _read_file(self, b: ReadFileRequest) -> bytes:
        return await self.node.read_file(b.id, b.path, offset=b.offset, length=b.length)

    async def _write_file(self, b: WriteFileRequest) -> None:
        await self.node.write_file(b.id, b.path, b.data, mode=b.mode, append=b.append)

    async def _list_dir(self, b: FileRequest) -> builtins.list[FileInfo]:
        return await self.node.list_dir(b.id, b.path)

    async def _stat(self, b: FileRequest) -> FileInfo:
        return await self.node.stat(b.id, b.path)

    async def _mkdir(self, b: FileRequest) -> None:
        await self.node.mkdir(b.id, b.path, parents=b.parents)

    async def _remove(self, b: FileRequest) -> None:
        await self.node.remove(b.id, b.path, recursive=b.recursive)

    async def _pause(self, b: SandboxRef) -> PauseStats:
        return await self.node.pause(b.id)

    async def _resume(self, b: SandboxRef) -> SandboxInfo:
        return await self.node.resume(b.id)

    async def _destroy(self, b: DestroyRequest) -> SandboxInfo:
        return await self.node.destroy(b.id, reason=b.reason, detail=b.detail)

    async def _destroy_many(self, b: DestroyMany) -> CreateManyReply:
        res = await self.node.destroy_many(b.ids, reason=b.reason)
        return CreateManyReply(items=[
            InfoOutcome(error=outcome_error(r)) if isinstance(r, BaseException)
            else InfoOutcome(info=r) for r in res])

    async def _stats(self, b: SandboxRef) -> SandboxStats:
        return await self.node.stats(b.id)

    async def _snapshot(self, b: SnapshotRequest) -> SnapshotInfo:
        return await self.node.snapshot(b.id, strip=b.strip, max_bytes=b.max_bytes)

    async def _snapshots(self, b: SnapshotQuery) -> builtins.list[SnapshotInfo]:
        return await self.node.snapshots(project=b.project, sandbox_id=b.sandbox_id)

    async def _snapshot_get(self, b: SnapshotRef) -> SnapshotInfo:
        return await self.node.get_snapshot(b.id)

    async def _snapshot_delete(self, b: SnapshotRef) -> SnapshotInfo:
        return await self.node.delete_snapshot(b.id)


async def serve_edge(node: EdgeNode, address: str, *, token: bytes | str | None = None,
                     insecure: bool = False, limits: ServerLimits | None = None) -> Server:
    """Serve ``node`` on ``address`` (``unix:PATH`` or ``tcp:HOST:PORT``).

    Whoever reaches an edge can run code as root in its sandboxes, so a TCP listener needs
    a ``token`` that every connection must present first (``insecure=True`` waives it, for
    a private test network only). A Unix socket is created 0600 (root only); a token
    there is optional.

    ``limits`` bound what peers may hold (connections, unauthenticated ones per address,
    deadlines, frame sizes; :data:`dsec.aether.limits.DEFAULT_LIMITS` by default), and
    accepted connections of every listener in the process share the process's fd
    budget, so a flood on the edge's socket cannot take the fds its sandboxes' exec
    pipes and its journal need."""
    if address.startswith("tcp:") and token is None and not insecure:
        raise InvalidArgument(
            f"refusing to serve edge {node.node_id} on {address} without a token: anyone who "
            "can connect could run commands in its sandboxes; pass a token (dsec edge "
            "--token-file FILE) or listen on a unix: socket")
    # No max_calls_in_flight here: the edge's peer is the apiserver, whose one link
    # carries every tenant's calls and its own polls; pausing it at a cap would let long
    # execs hold up the heartbeat. Tenants are capped at the gateway, per connection.
    lim = dataclasses.replace(limits or DEFAULT_LIMITS, max_calls_in_flight=None)
    return await serve(EdgeService(node, token=token).router, address, limits=lim)


class EdgeClient:
    """Typed async client for one edge. Mirrors :class:`EdgeNode`'s methods.

    ``async with await EdgeClient.connect("unix:/run/dsec/edge.sock") as edge: ...``
    or wrap an existing :class:`~dsec.aether.Connection` (which it then does not own).
    Every call takes ``timeout`` (request deadline in seconds; None = wait forever).
    """

    def __init__(self, conn: Connection, *, timeout: float | None = 60.0,
                 owns_connection: bool = False) -> None:
        self.conn = conn
        self.timeout = timeout
        self._owns = owns_connection

    @classmethod
    async def connect(cls, address: str, *, timeout: float | None = 60.0,
                      token: bytes | str | None = None) -> EdgeClient:
        return cls(await connect(address, token=token), timeout=timeout, owns_connection=True)

    async def close(self) -> None:
        if self._owns:
            await self.conn.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _t(self, timeout: _Deadline) -> float | None:
        return self.timeout if isinstance(timeout, EllipsisType) else timeout

    async def _call(self, method: str, body: Any, rtype: Any, timeout: _Deadline = ...) -> Any:
        return await self.conn.call(method, body, timeout=self._t(timeout), response_type=rtype)

    # ---------------------------------------------------------------- node
    async def info(self, *, timeout: _Deadline = ...) -> NodeInfo:
        return await self._call("edge.info", None, NodeInfo, timeout)  # type: ignore[no-any-return]

    async def heartbeat(self, *, include_sandboxes: bool = True, timeout: _Deadline = ...) -> Heartbeat:
        return await self._call("edge.heartbeat",  # type: ignore[no-any-return]
                                HeartbeatRequest(include_sandboxes=include_sandboxes),
                                Heartbeat, timeout)

    async def feed(self, after: int = 0, limit: int = 1000, *, timeout: _Deadline = ...) -> EventFeed:
        return await self._call("edge.feed", FeedRequest(after=after, limit=limit),  # type: ignore[no-any-return]
                                EventFeed, timeout)

    # ---------------------------------------------------------------- lifecycle
    async def create(self, spec: SandboxSpec | None = None, *, sandbox_id: str | None = None,
                     timeout: _Deadline = ..., **spec_fields: Any) -> SandboxInfo:
        """Create one sandbox: pass a spec, or spec fields as keywords
        (``create(image="python", cpu_milli=500)``)."""
        spec = _spec(spec, spec_fields)
        return await self._call("edge.create",  # type: ignore[no-any-return]
                                CreateRequest(spec=spec, sandbox_id=sandbox_id),
                                SandboxInfo, timeout)

    async def create_many(self, specs: Sequence[SandboxSpec], *,
                          timeout: _Deadline = ...) -> builtins.list[SandboxInfo | DsecError]:
        reply = await self._call("edge.create_many", CreateManyOnNode(specs=list(specs)),
                                 CreateManyReply, timeout)
        return [outcome_value(o, o.info) for o in reply.items]  # type: ignore[misc]

    async def get(self, sandbox_id: str, *, timeout: _Deadline = ...) -> SandboxInfo:
        return await self._call("edge.get", SandboxRef(id=sandbox_id), SandboxInfo, timeout)  # type: ignore[no-any-return]

    async def list(self, *, state: SandboxState | None = None, project: str | None = None,
                   labels: Mapping[str, str] | None = None,
                   timeout: _Deadline = ...) -> builtins.list[SandboxInfo]:
        body = ListRequest(state=state, project=project, labels=dict(labels or {}))
        return await self._call("edge.list", body, list[SandboxInfo], timeout)  # type: ignore[no-any-return]

    async def events(self, sandbox_id: str, *, timeout: _Deadline = ...) -> builtins.list[SandboxEvent]:
        return await self._call("edge.events", SandboxRef(id=sandbox_id),  # type: ignore[no-any-return]
                                list[SandboxEvent], timeout)

    async def pause(self, sandbox_id: str, *, timeout: _Deadline = ...) -> PauseStats:
        return await self._call("edge.pause", SandboxRef(id=sandbox_id), PauseStats, timeout)  # type: ignore[no-any-return]

    async def resume(self, sandbox_id: str, *, timeout: _Deadline = ...) -> SandboxInfo:
        return await self._call("edge.resume", SandboxRef(id=sandbox_id), SandboxInfo, timeout)  # type: ignore[no-any-return]

    async def destroy(self, sandbox_id: str, *, reason: str = "requested", detail: str = "",
                      timeout: _Deadline = ...) -> SandboxInfo:
        return await self._call("edge.destroy",  # type: ignore[no-any-return]
                                DestroyRequest(id=sandbox_id, reason=reason, detail=detail),
                                SandboxInfo, timeout)

    async def destroy_many(self, sandbox_ids: Sequence[str], *, reason: str = "requested",
                           timeout: _Deadline = ...) -> builtins.list[SandboxInfo | DsecError]:
        reply = await self._call("edge.destroy_many",
                                 DestroyMany(ids=list(sandbox_ids), reason=reason),
                                 CreateManyReply, timeout)
        return [outcome_value(o, o.info) for o in reply.items]  # type: ignore[misc]

    async def stats(self, sandbox_id: str, *, timeout: _Deadline = ...) -> SandboxStats:
        return await self._call("edge.stats", SandboxRef(id=sandbox_id), SandboxStats, timeout)  # type: ignore[no-any-return]

    # ---------------------------------------------------------------- snapshots
    async def snapshot(self, sandbox_id: str, *, strip: Sequence[str] = (),
                       max_bytes: int | None = None,
                       timeout: _Deadline = ...) -> SnapshotInfo:
        """pack_diff the sandbox's changes into a snapshot (see EdgeNode.snapshot)."""
        return await self._call("edge.snapshot",  # type: ignore[no-any-return]
                                SnapshotRequest(id=sandbox_id, strip=list(strip),
                                                max_bytes=max_bytes),
                                SnapshotInfo, timeout)

    async def snapshots(self, *, project: str | None = None, sandbox_id: str | None = None,
                        timeout: _Deadline = ...) -> builtins.list[SnapshotInfo]:
        return await self._call("edge.snapshots",  # type: ignore[no-any-return]
                                SnapshotQuery(project=project, sandbox_id=sandbox_id),
                                list[SnapshotInfo], timeout)

    async def get_snapshot(self, ref: str, *, timeout: _Deadline = ...) -> SnapshotInfo:
        return await self._call("edge.snapshot_get", SnapshotRef(id=ref),  # type: ignore[no-any-return]
                                SnapshotInfo, timeout)

    async def delete_snapshot(self, ref: str, *, timeout: _Deadline = ...) -> SnapshotInfo:
        return await self._call("edge.snapshot_delete", SnapshotRef(id=ref),  # type: ignore[no-any-return]
                                SnapshotInfo, timeout)

    # ---------------------------------------------------------------- exec
    async def exec(self, sandbox_id: str, cmd: Command, *, timeout: _Deadline = ...,
                   **opts: Any) -> ExecResult:
        """Run ``cmd`` (shell string, argv list or ExecRequest); ``opts`` are ExecRequest
        fields (``env``, ``cwd``, ``stdin``, ``timeout_s``, ``output_cap_bytes``)."""
        req = exec_request(cmd, **opts)
        return await self._call("edge.exec", ExecCall(id=sandbox_id, req=req),  # type: ignore[no-any-return]
                                ExecResult, timeout)

    async def exec_many(self, calls: Sequence[tuple[str, Command]], *,
                        timeout: _Deadline = ...) -> builtins.list[ExecResult | DsecError]:
        """Many commands in one request, run concurrently on the edge; in order."""
        body = ExecMany(calls=[ExecCall(id=sid, req=exec_request(c)) for sid, c in calls])
        reply = await self._call("edge.exec_many", body, ExecManyReply, timeout)
        return [outcome_value(o, o.result) for o in reply.items]  # type: ignore[misc]

    async def exec_stream(self, sandbox_id: str, cmd: Command, *, timeout: _Deadline = ...,
                          **opts: Any) -> AsyncIterator[ExecChunk | ExecResult]:
        """Yield :class:`ExecChunk` as output arrives, then the final :class:`ExecResult`."""
        req = exec_request(cmd, **opts)
        stream = self.conn.stream("edge.exec_stream", ExecCall(id=sandbox_id, req=req),
                                  timeout=self._t(timeout), item_type=ExecChunk,
                                  response_type=ExecResult)
        async with stream:
            async for chunk in stream:
                yield chunk
            yield stream.result

    # ---------------------------------------------------------------- files
    async def read_file(self, sandbox_id: str, path: str, *, offset: int = 0,
                        length: int | None = None, timeout: _Deadline = ...) -> bytes:
        body = ReadFileRequest(id=sandbox_id, path=path, offset=offset, length=length)
        return await self._call("edge.read_file", body, bytes, timeout)  # type: ignore[no-any-return]

    async def write_file(self, sandbox_id: str, path: str, data: bytes | str, *,
                         mode: int = 0o644, append: bool = False, timeout: _Deadline = ...) -> None:
        raw = data.encode() if isinstance(data, str) else bytes(data)
        body = WriteFileRequest(id=sandbox_id, path=path, data=raw, mode=mode, append=append)
        await self._call("edge.write_file", body, None, timeout)

    async def list_dir(self, sandbox_id: str, path: str, *, timeout: _Deadline = ...) -> builtins.list[FileInfo]:
        return await self._call("edge.list_dir", FileRequest(id=sandbox_id, path=path),  # type: ignore[no-any-return]
                                list[FileInfo], timeout)

    async def stat(self, sandbox_id: str, path: str, *, timeout: _Deadline = ...) -> FileInfo:
        return await self._call("edge.stat", FileRequest(id=sandbox_id, path=path),  # type: ignore[no-any-return]
                                FileInfo, timeout)

    async def mkdir(self, sandbox_id: str, path: str, *, parents: bool = True,
                    timeout: _Deadline = ...) -> None:
        await self._call("edge.mkdir", FileRequest(id=sandbox_id, path=path, parents=parents),
                         None, timeout)

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool = False,
                     timeout: _Deadline = ...) -> None:
        await self._call("edge.remove",
                         FileRequest(id=sandbox_id, path=path, recursive=recursive), None, timeout)


def _spec(spec: SandboxSpec | None, fields: dict[str, Any]) -> SandboxSpec:
    if spec is not None and fields:
        from dsec.errors import InvalidArgument

        raise InvalidArgument("pass either a SandboxSpec or spec fields as keywords, not both")
    if spec is None:
        import msgspec

        from dsec.errors import InvalidArgument

        try:
            spec = msgspec.convert(fields, SandboxSpec)
        except msgspec.ValidationError as exc:
            raise InvalidArgument(f"invalid sandbox spec: {exc}") from exc
    return spec
