"""EdgeClient: the typed async client of one edge, built on the operation catalogue.

Everything goes through one method, :meth:`EdgeClient.call` (``call(op, body) ->
reply``, the row's types: mypy knows ``call(EXEC, ExecCall(...))`` is an
:class:`~dsec.wire.spec.ExecResult`); :meth:`EdgeClient.stream` for streaming rows. The
named methods (``exec``, ``create``, ...) are one-line sugar for people and tests.

This module imports only :mod:`dsec.aether` and :mod:`dsec.wire`: it is the one module
of :mod:`dsec.edge` the control plane may import (the edge's own code stays out of the
apiserver's process image and import graph).
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Self, TypeVar

import msgspec

from dsec.aether import Connection, DuplexStream, connect
from dsec.errors import (
    DsecError,
    InvalidArgument,
    PermissionDenied,
    RemoteProtocolError,
    UnknownMethod,
)
from dsec.wire import ops
from dsec.wire.calls import (
    Command,
    CreateManyOnNode,
    CreateOnNode,
    DestroyMany,
    DestroyOnNode,
    Empty,
    ExecCall,
    ExecMany,
    FeedRequest,
    FileRef,
    HeartbeatRequest,
    ListRequest,
    Mkdir,
    NetworkUpdateOnNode,
    ReadFile,
    Remove,
    ResumeOnNode,
    ResumeReason,
    SandboxRef,
    SnapshotOnNode,
    SnapshotQuery,
    SnapshotRef,
    WriteFile,
    exec_request,
)
from dsec.wire.node import EDGE_PROTOCOL, MAX_LIST_PAGE, EventFeed, Heartbeat, NodeInfo
from dsec.wire.ops import (
    USE_CLIENT_DEFAULT,
    Deadline,
    Op,
    StreamOp,
    TunnelOp,
    UseClientDefault,
)
from dsec.wire.outcome import Batch
from dsec.wire.ports import PortExpose, PortRecord, PortRecordList
from dsec.wire.spec import (
    ExecChunk,
    ExecResult,
    FileInfo,
    NetworkView,
    PauseStats,
    SandboxEvent,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    SandboxStats,
    SnapshotInfo,
)

__all__ = ["EdgeClient"]

Req = TypeVar("Req")
Rep = TypeVar("Rep")
Item = TypeVar("Item")


class EdgeClient:
    """Typed async client for one edge.

    ``async with await EdgeClient.connect("unix:/run/dsec/edge.sock") as edge: ...``
    or wrap an existing :class:`~dsec.aether.Connection` (which it then does not own).
    Every call takes ``timeout`` (request deadline in seconds; None = wait forever;
    unsaid: the client's ``timeout``).
    """

    def __init__(self, conn: Connection, *, timeout: float | None = 60.0,
                 owns_connection: bool = False) -> None:
        self.conn = conn
        self.timeout = timeout
        self._owns = owns_connection

    @classmethod
    async def connect(cls, address: str, *, timeout: float | None = 60.0,
                      token: bytes | str | None = None, tls: Any = None) -> EdgeClient:
        """Connect and check the edge speaks this release's edge protocol (one round
        trip): an edge of another release is refused here, with both versions named,
        instead of failing later on the first body it cannot decode."""
        if tls is not None:
            # tls: an EdgeTls (dsec.cluster.membership): context, expected node id, and the
            # denylist check of the edge's certificate
            conn = await connect(address, token=token, ssl=tls.context,
                                 server_hostname=tls.node_id, peer_check=tls.check_peer)
        else:
            conn = await connect(address, token=token)
        client = cls(conn, timeout=timeout, owns_connection=True)
        try:
            info = await client.check_protocol(address)
            if tls is not None and info.node != tls.node_id:
                # its hello must name the node its certificate names
                raise PermissionDenied(f"the edge at {address} says it is node "
                                       f"{info.node!r}, its certificate says "
                                       f"{tls.node_id!r}: refused")
        except BaseException:
            await client.close()
            raise
        return client

    async def check_protocol(self, address: str = "") -> NodeInfo:
        """The edge's :class:`NodeInfo`, or :class:`RemoteProtocolError` when it speaks
        another edge protocol than :data:`~dsec.wire.node.EDGE_PROTOCOL`."""
        where = f" at {address}" if address else ""
        try:
            info = await self.call(ops.NODE_INFO, Empty())
        except UnknownMethod as exc:
            raise RemoteProtocolError(
                f"the edge{where} speaks an older edge protocol (it has no "
                f"{ops.NODE_INFO.edge_method}; this dsec speaks edge protocol "
                f"{EDGE_PROTOCOL}): run the same dsec release on the edge and the control "
                "plane", protocol=EDGE_PROTOCOL) from exc
        if info.protocol != EDGE_PROTOCOL:
            raise RemoteProtocolError(
                f"edge {info.node}{where} speaks edge protocol {info.protocol}, this dsec "
                f"speaks {EDGE_PROTOCOL}: run the same dsec release on the edge and the "
                "control plane", node=info.node, protocol=info.protocol,
                expected=EDGE_PROTOCOL)
        return info

    async def close(self) -> None:
        if self._owns:
            await self.conn.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _t(self, timeout: Deadline) -> float | None:
        return self.timeout if isinstance(timeout, UseClientDefault) else timeout

    # ---------------------------------------------------------------- the one door
    async def call(self, op: Op[Req, Rep], body: Req, *,
                   timeout: Deadline = USE_CLIENT_DEFAULT) -> Rep:
        """Call ``op`` on the edge with ``body``; its reply, typed by the row. For rows
        the edge serves with its own types (``op.edge_request``/``edge_reply``, which
        the control plane fills in) use the named methods below."""
        if not op.edge_plain:
            raise InvalidArgument(
                f"{op.name} takes {_name(op.edge_type)} and answers "
                f"{_name(op.edge_reply_type)} at the edge: call EdgeClient.{op.name}()")
        reply: Rep = await self.conn.call(
            op.edge_method, body, response_type=op.reply,
            timeout=self.timeout if timeout is USE_CLIENT_DEFAULT else timeout)
        return reply

    async def stream(self, op: StreamOp[Req, Item, Rep], body: Req, *,
                     timeout: Deadline = USE_CLIENT_DEFAULT) -> AsyncIterator[Item | Rep]:
        """Yield ``op.item`` bodies as they arrive, then the final reply."""
        s = self.conn.stream(op.edge_method, body, timeout=self._t(timeout),
                             item_type=op.item, response_type=op.reply)
        async with s:
            async for item in s:
                yield item
            yield s.result

    async def port_expose(self, body: PortExpose, *,
                          timeout: Deadline = USE_CLIENT_DEFAULT) -> PortRecord:
        rec: PortRecord = await self._edge(ops.PORT_EXPOSE, body, timeout)
        return rec

    async def port_list(self, sandbox_id: str, *,
                        timeout: Deadline = USE_CLIENT_DEFAULT) -> PortRecordList:
        recs: PortRecordList = await self._edge(ops.PORT_LIST, SandboxRef(id=sandbox_id),
                                                timeout)
        return recs

    def tunnel(self, op: TunnelOp[Req, Rep], body: Req) -> DuplexStream:
        """Open ``op``'s duplex stream (raw bytes both ways under per-stream credit; no
        deadline: a tunnel lives as long as its bytes move, the edge cuts idle ones)."""
        return self.conn.duplex(op.edge_method, body, response_type=op.reply)

    async def _edge(self, op: Op[Any, Any], body: Any, timeout: Deadline) -> Any:
        """A row the edge serves with its own request/reply types."""
        return await self.conn.call(op.edge_method, body, timeout=self._t(timeout),
                                    response_type=op.edge_reply_type)

    # ---------------------------------------------------------------- node
    async def info(self, *, timeout: Deadline = USE_CLIENT_DEFAULT) -> NodeInfo:
        return await self.call(ops.NODE_INFO, Empty(), timeout=timeout)

    async def heartbeat(self, *, include_sandboxes: bool = True,
                        images_gen: int | None = None, list_after: str = "",
                        list_limit: int = MAX_LIST_PAGE,
                        timeout: Deadline = USE_CLIENT_DEFAULT) -> Heartbeat:
        return await self.call(ops.HEARTBEAT,
                               HeartbeatRequest(include_sandboxes=include_sandboxes,
                                                images_gen=images_gen, list_after=list_after,
                                                list_limit=list_limit),
                               timeout=timeout)

    async def feed(self, after: int = 0, limit: int = 1000, *,
                   timeout: Deadline = USE_CLIENT_DEFAULT) -> EventFeed:
        return await self.call(ops.FEED, FeedRequest(after=after, limit=limit),
                               timeout=timeout)

    # ---------------------------------------------------------------- lifecycle
    async def create(self, spec: SandboxSpec | None = None, *, sandbox_id: str | None = None,
                     ceiling_deny: tuple[str, ...] = (),
                     timeout: Deadline = USE_CLIENT_DEFAULT,
                     **spec_fields: Any) -> SandboxInfo:
        """Create one sandbox: pass a spec, or spec fields as keywords
        (``create(image="python", cpu_milli=500)``); ``ceiling_deny``: the deny entries
        of the project's network ceilings (the control plane's)."""
        body = CreateOnNode(spec=_spec(spec, spec_fields), sandbox_id=sandbox_id,
                            ceiling_deny=ceiling_deny)
        info: SandboxInfo = await self._edge(ops.CREATE, body, timeout)
        return info

    async def create_many(self, specs: Sequence[SandboxSpec], *,
                          timeout: Deadline = USE_CLIENT_DEFAULT,
                          ) -> builtins.list[SandboxInfo | DsecError]:
        body = CreateManyOnNode(specs=list(specs))
        reply: Batch[SandboxInfo] = await self._edge(ops.CREATE_MANY, body, timeout)
        return reply.results()

    async def get(self, sandbox_id: str, *,
                  timeout: Deadline = USE_CLIENT_DEFAULT) -> SandboxInfo:
        return await self.call(ops.GET, SandboxRef(id=sandbox_id), timeout=timeout)

    async def list(self, *, state: SandboxState | None = None, project: str | None = None,
                   labels: Mapping[str, str] | None = None,
                   timeout: Deadline = USE_CLIENT_DEFAULT) -> builtins.list[SandboxInfo]:
        body = ListRequest(state=state, project=project, labels=dict(labels or {}))
        infos: builtins.list[SandboxInfo] = await self._edge(ops.LIST, body, timeout)
        return infos

    async def events(self, sandbox_id: str, *,
                     timeout: Deadline = USE_CLIENT_DEFAULT) -> builtins.list[SandboxEvent]:
        return (await self.call(ops.EVENTS, SandboxRef(id=sandbox_id), timeout=timeout)).items

    async def pause(self, sandbox_id: str, *,
                    timeout: Deadline = USE_CLIENT_DEFAULT) -> PauseStats:
        return await self.call(ops.PAUSE, SandboxRef(id=sandbox_id), timeout=timeout)

    async def resume(self, sandbox_id: str, *, reason: ResumeReason = "requested",
                     timeout: Deadline = USE_CLIENT_DEFAULT) -> SandboxInfo:
        info: SandboxInfo = await self._edge(
            ops.RESUME, ResumeOnNode(id=sandbox_id, reason=reason), timeout)
        return info

    async def destroy(self, sandbox_id: str, *, reason: str = "requested", detail: str = "",
                      timeout: Deadline = USE_CLIENT_DEFAULT) -> SandboxInfo:
        body = DestroyOnNode(id=sandbox_id, reason=reason, detail=detail)
        info: SandboxInfo = await self._edge(ops.DESTROY, body, timeout)
        return info

    async def destroy_many(self, sandbox_ids: Sequence[str], *, reason: str = "requested",
                           timeout: Deadline = USE_CLIENT_DEFAULT,
                           ) -> builtins.list[SandboxInfo | DsecError]:
        reply = await self.call(ops.DESTROY_MANY,
                                DestroyMany(ids=list(sandbox_ids), reason=reason),
                                timeout=timeout)
        return reply.results()

    async def stats(self, sandbox_id: str, *,
                    timeout: Deadline = USE_CLIENT_DEFAULT) -> SandboxStats:
        return await self.call(ops.STATS, SandboxRef(id=sandbox_id), timeout=timeout)

    # ---------------------------------------------------------------- snapshots
    async def network_update(self, body: NetworkUpdateOnNode, *,
                             timeout: Deadline = USE_CLIENT_DEFAULT) -> NetworkView:
        """Replace a sandbox's egress policy (with the project ceilings' denies)."""
        view: NetworkView = await self._edge(ops.NETWORK_UPDATE, body, timeout)
        return view

    async def snapshot(self, sandbox_id: str, *, strip: Sequence[str] = (),
                       max_bytes: int | None = None,
                       timeout: Deadline = USE_CLIENT_DEFAULT) -> SnapshotInfo:
        """pack_diff the sandbox's changes into a snapshot (see EdgeNode.snapshot)."""
        body = SnapshotOnNode(id=sandbox_id, strip=list(strip), max_bytes=max_bytes)
        snap: SnapshotInfo = await self._edge(ops.SNAPSHOT, body, timeout)
        return snap

    async def snapshots(self, *, project: str | None = None, sandbox_id: str | None = None,
                        timeout: Deadline = USE_CLIENT_DEFAULT,
                        ) -> builtins.list[SnapshotInfo]:
        body = SnapshotQuery(project=project, sandbox_id=sandbox_id)
        snaps: builtins.list[SnapshotInfo] = await self._edge(ops.SNAPSHOTS, body, timeout)
        return snaps

    async def get_snapshot(self, ref: str, *,
                           timeout: Deadline = USE_CLIENT_DEFAULT) -> SnapshotInfo:
        snap: SnapshotInfo = await self._edge(ops.SNAPSHOT_GET, SnapshotRef(id=ref), timeout)
        return snap

    async def delete_snapshot(self, ref: str, *,
                              timeout: Deadline = USE_CLIENT_DEFAULT) -> SnapshotInfo:
        snap: SnapshotInfo = await self._edge(ops.SNAPSHOT_DELETE, SnapshotRef(id=ref),
                                              timeout)
        return snap

    # ---------------------------------------------------------------- exec
    async def exec(self, sandbox_id: str, cmd: Command, *,
                   timeout: Deadline = USE_CLIENT_DEFAULT, **opts: Any) -> ExecResult:
        """Run ``cmd`` (shell string, argv list or ExecRequest); ``opts`` are ExecRequest
        fields (``env``, ``cwd``, ``stdin``, ``timeout_s``, ``output_cap_bytes``)."""
        return await self.call(ops.EXEC, ExecCall(id=sandbox_id, req=exec_request(cmd, **opts)),
                               timeout=timeout)

    async def exec_many(self, calls: Sequence[tuple[str, Command]], *,
                        timeout: Deadline = USE_CLIENT_DEFAULT,
                        ) -> builtins.list[ExecResult | DsecError]:
        """Many commands in one request, run concurrently on the edge; in order."""
        body = ExecMany(calls=[ExecCall(id=sid, req=exec_request(c)) for sid, c in calls])
        return (await self.call(ops.EXEC_MANY, body, timeout=timeout)).results()

    def exec_stream(self, sandbox_id: str, cmd: Command, *,
                    timeout: Deadline = USE_CLIENT_DEFAULT,
                    **opts: Any) -> AsyncIterator[ExecChunk | ExecResult]:
        """Yield :class:`ExecChunk` as output arrives, then the final :class:`ExecResult`."""
        return self.stream(ops.EXEC_STREAM,
                           ExecCall(id=sandbox_id, req=exec_request(cmd, **opts)),
                           timeout=timeout)

    # ---------------------------------------------------------------- files
    async def read_file(self, sandbox_id: str, path: str, *, offset: int = 0,
                        length: int | None = None, user: str | None = None,
                        timeout: Deadline = USE_CLIENT_DEFAULT) -> bytes:
        return await self.call(ops.READ_FILE, ReadFile(id=sandbox_id, path=path, offset=offset,
                                                       length=length, user=user),
                               timeout=timeout)

    async def write_file(self, sandbox_id: str, path: str, data: bytes | str, *,
                         mode: int = 0o644, append: bool = False, user: str | None = None,
                         timeout: Deadline = USE_CLIENT_DEFAULT) -> None:
        raw = data.encode() if isinstance(data, str) else bytes(data)
        await self.call(ops.WRITE_FILE, WriteFile(id=sandbox_id, path=path, data=raw, mode=mode,
                                                  append=append, user=user), timeout=timeout)

    async def list_dir(self, sandbox_id: str, path: str, *, user: str | None = None,
                       timeout: Deadline = USE_CLIENT_DEFAULT) -> builtins.list[FileInfo]:
        return (await self.call(ops.LIST_DIR, FileRef(id=sandbox_id, path=path, user=user),
                                timeout=timeout)).items

    async def stat(self, sandbox_id: str, path: str, *, user: str | None = None,
                   timeout: Deadline = USE_CLIENT_DEFAULT) -> FileInfo:
        return await self.call(ops.STAT, FileRef(id=sandbox_id, path=path, user=user),
                               timeout=timeout)

    async def mkdir(self, sandbox_id: str, path: str, *, parents: bool = True,
                    user: str | None = None,
                    timeout: Deadline = USE_CLIENT_DEFAULT) -> None:
        await self.call(ops.MKDIR, Mkdir(id=sandbox_id, path=path, parents=parents, user=user),
                        timeout=timeout)

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool = False,
                     user: str | None = None,
                     timeout: Deadline = USE_CLIENT_DEFAULT) -> None:
        await self.call(ops.REMOVE, Remove(id=sandbox_id, path=path, recursive=recursive,
                                           user=user), timeout=timeout)


def _name(tp: Any) -> str:
    return getattr(tp, "__name__", repr(tp))


def _spec(spec: SandboxSpec | None, fields: dict[str, Any]) -> SandboxSpec:
    if spec is not None and fields:
        raise InvalidArgument("pass either a SandboxSpec or spec fields as keywords, not both")
    if spec is None:
        try:
            spec = msgspec.convert(fields, SandboxSpec)
        except msgspec.ValidationError as exc:
            raise InvalidArgument(f"invalid sandbox spec: {exc}") from exc
    return spec
