"""The edge service: every :class:`~dsec.edge.node.EdgeNode` operation over Aether.

One method per row of the operation catalogue with the edge door
(:data:`dsec.wire.ops.EDGE_OPS`), named as the row and typed with its edge request and
reply; :class:`EdgeService` registers them in one loop, so an operation the table names
is served and nothing else is. Queries (get, list, events, feed, heartbeat, node_info)
are synchronous handlers, which Aether runs inline in its read loop; operations that
await a backend are async handlers (one task each). Batched create/destroy/exec are
single requests whose items run concurrently on the node; ``edge.exec_stream`` streams
output chunks as STREAM frames.

Errors cross the wire as their own class (``CapacityExceeded`` on the edge is
``CapacityExceeded`` in the client), batch items carry their error in place. The client
is :class:`~dsec.edge.client.EdgeClient` (re-exported here).
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
from typing import Any

from dsec.aether import Router, Server, StreamSender, serve
from dsec.aether.connection import DuplexStream
from dsec.aether.limits import DEFAULT_LIMITS, ServerLimits
from dsec.edge.client import EdgeClient
from dsec.edge.node import EdgeNode
from dsec.edge.qos import qos_features
from dsec.errors import InvalidArgument, RemoteProtocolError
from dsec.wire.api import EventList, FileList
from dsec.wire.calls import (
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
    SandboxRef,
    SnapshotOnNode,
    SnapshotQuery,
    SnapshotRef,
    WriteFile,
)
from dsec.wire.files import ReadStream, Rename, Watch, WatchEnd, WriteStream
from dsec.wire.layers import (
    LayerChain,
    LayerGrant,
    LayerGranted,
    LayerPut,
    LayerRef,
    LayerStored,
    PinSet,
)
from dsec.wire.lifetime import SetTimeout
from dsec.wire.node import EDGE_PROTOCOL, EventFeed, Heartbeat, NodeInfo
from dsec.wire.ops import EDGE_OPS, StreamOp, TunnelOp
from dsec.wire.outcome import Batch
from dsec.wire.ports import PortConnect, PortExpose, PortRecord, PortRecordList, PortRef
from dsec.wire.process import (
    ProcessInfo,
    ProcessInput,
    ProcessList,
    ProcessRef,
    ProcessRunItem,
    ProcessSignal,
    PtyResize,
)
from dsec.wire.spec import (
    ExecChunk,
    ExecResult,
    FileInfo,
    NetworkView,
    PauseStats,
    SandboxInfo,
    SandboxStats,
    SnapshotInfo,
)

__all__ = ["EdgeClient", "EdgeHandlers", "EdgeService", "serve_edge"]


class EdgeHandlers:
    """The edge's side of each edge row: ``handlers.<op.name>(body)``, typed with
    ``op.edge_type`` and ``op.edge_reply_type`` (a test holds them to the rows). Each is
    one call into the node: behaviour lives in :class:`EdgeNode`, not here."""

    def __init__(self, node: EdgeNode) -> None:
        self.node = node
        self._methods = [op.edge_method for op in EDGE_OPS]

    # ---------------------------------------------------------------- node
    def node_info(self, b: Empty) -> NodeInfo:
        n = self.node
        return NodeInfo(node=n.node_id, backends=sorted(n.backends),
                        capacity=n.pool.capacity.as_resources(), labels=dict(n.config.labels),
                        methods=list(self._methods), physical=n.pool.capacity.physical,
                        protocol=EDGE_PROTOCOL, qos=qos_features(),
                        qos_policy=n.qos_policy())

    def heartbeat(self, b: HeartbeatRequest) -> Heartbeat:
        return self.node.heartbeat(include_sandboxes=b.include_sandboxes,
                                   images_gen=b.images_gen, list_after=b.list_after,
                                   list_limit=b.list_limit)

    def feed(self, b: FeedRequest) -> EventFeed:
        return self.node.feed(b.after, b.limit)

    # ---------------------------------------------------------------- lifecycle
    async def create(self, b: CreateOnNode) -> SandboxInfo:
        return await self.node.create(b.spec, sandbox_id=b.sandbox_id,
                                      ceiling_deny=b.ceiling_deny)

    async def create_many(self, b: CreateManyOnNode) -> Batch[SandboxInfo]:
        return Batch.of(await self.node.create_many(b.specs))

    def get(self, b: SandboxRef) -> SandboxInfo:
        return self.node.get(b.id)

    def list(self, b: ListRequest) -> builtins.list[SandboxInfo]:
        return self.node.list(state=b.state, project=b.project, labels=b.labels)

    def events(self, b: SandboxRef) -> EventList:
        return EventList(items=self.node.events(b.id))

    async def pause(self, b: SandboxRef) -> PauseStats:
        return await self.node.pause(b.id)

    async def resume(self, b: ResumeOnNode) -> SandboxInfo:
        return await self.node.resume(b.id, reason=b.reason)

    async def destroy(self, b: DestroyOnNode) -> SandboxInfo:
        return await self.node.destroy(b.id, reason=b.reason, detail=b.detail)

    async def destroy_many(self, b: DestroyMany) -> Batch[SandboxInfo]:
        return Batch.of(await self.node.destroy_many(b.ids, reason=b.reason))

    async def node_pins(self, b: PinSet) -> Empty:
        await self.node.apply_pins(b.images, b.gen)
        return Empty()

    async def layer_grant(self, b: LayerGrant) -> LayerGranted:
        return LayerGranted(digests=await self.node.grant_layers(b.manifests))

    async def stats(self, b: SandboxRef) -> SandboxStats:
        return await self.node.stats(b.id)

    async def set_timeout(self, b: SetTimeout) -> SandboxInfo:   # issue 19, lifetimes
        return await self.node.set_timeout(b.id, b.timeout_s, extend=b.extend)

    # ---------------------------------------------------------------- exec
    async def exec(self, b: ExecCall) -> ExecResult:
        return await self.node.exec(b.id, b.req)

    async def exec_many(self, b: ExecMany) -> Batch[ExecResult]:
        return Batch.of(await self.node.exec_many([(c.id, c.req) for c in b.calls]))

    async def exec_stream(self, b: ExecCall, out: StreamSender) -> ExecResult:
        final: ExecResult | None = None
        async for item in self.node.exec_stream(b.id, b.req):
            if isinstance(item, ExecResult):
                final = item
            else:
                await out.send(item)
        if final is None:
            raise RemoteProtocolError(f"backend stream for {b.id} ended without a result")
        return final

    # ---------------------------------------------------------------- processes (19)
    async def process_start(self, b: ExecCall) -> ProcessInfo:
        return await self.node.processes.start(b.id, b.req)

    def process_list(self, b: SandboxRef) -> ProcessList:
        return ProcessList(items=self.node.processes.list(b.id))

    async def process_connect(self, b: ProcessRef, out: StreamSender) -> ExecResult:
        async for item in self.node.processes.connect(b.id, b.pid):
            if isinstance(item, ExecResult):
                return item
            await out.send(item)
        raise RemoteProtocolError(f"process {b.pid} of {b.id} ended without a result")

    async def process_run(self, b: ExecCall, out: StreamSender) -> ExecResult:
        """``process_start`` + ``process_connect`` in one call (issue 20): the entry, its
        output as :class:`ProcessRunItem` s, then its end. The caller going away closes
        the generator (the reader leaves), never the process."""
        it = self.node.processes.run(b.id, b.req)
        try:
            async for item in it:
                if isinstance(item, ExecResult):
                    return item
                if isinstance(item, ExecChunk):
                    await out.send(ProcessRunItem(stream=item.stream, data=item.data))
                else:
                    await out.send(ProcessRunItem(started=item))
        finally:
            await it.aclose()
        raise RemoteProtocolError(f"process_run in {b.id} ended without a result")

    async def process_input(self, b: ProcessInput) -> None:
        await self.node.processes.input(b.id, b.pid, b.data)

    def process_close_stdin(self, b: ProcessRef) -> None:
        self.node.processes.close_stdin(b.id, b.pid)

    def process_signal(self, b: ProcessSignal) -> None:
        self.node.processes.signal(b.id, b.pid, b.signal)

    def pty_resize(self, b: PtyResize) -> None:
        self.node.processes.resize(b.id, b.pid, b.cols, b.rows)

    # ---------------------------------------------------------------- files
    async def read_file(self, b: ReadFile) -> bytes:
        return await self.node.read_file(b.id, b.path, offset=b.offset, length=b.length,
                                         user=b.user)

    async def write_file(self, b: WriteFile) -> None:
        await self.node.write_file(b.id, b.path, b.data, mode=b.mode, append=b.append,
                                   user=b.user)

    async def list_dir(self, b: FileRef) -> FileList:
        return FileList(items=await self.node.list_dir(b.id, b.path, user=b.user))

    async def stat(self, b: FileRef) -> FileInfo:
        return await self.node.stat(b.id, b.path, user=b.user)

    async def mkdir(self, b: Mkdir) -> None:
        await self.node.mkdir(b.id, b.path, parents=b.parents, user=b.user)

    async def remove(self, b: Remove) -> None:
        await self.node.remove(b.id, b.path, recursive=b.recursive, user=b.user)

    # ---------------------------------------------------- streams, rename, watch (issue 19)
    async def file_read_stream(self, b: ReadStream, stream: DuplexStream) -> FileInfo:
        return await self.node.file_read_stream(b, stream)

    async def file_write_stream(self, b: WriteStream, stream: DuplexStream) -> FileInfo:
        return await self.node.file_write_stream(b, stream)

    async def file_rename(self, b: Rename) -> FileInfo:
        return await self.node.file_rename(b)

    async def file_watch(self, b: Watch, out: StreamSender) -> WatchEnd:
        return WatchEnd(reason=await self.node.file_watch(b, out.send))

    # ---------------------------------------------------------------- ports
    async def port_expose(self, b: PortExpose) -> PortRecord:
        return await self.node.port_expose(b.id, b.port)

    def port_list(self, b: SandboxRef) -> PortRecordList:
        return PortRecordList(items=self.node.port_list(b.id))

    async def port_close(self, b: PortRef) -> None:
        await self.node.port_close(b.id, b.port)

    async def port_connect(self, b: PortConnect, stream: DuplexStream) -> None:
        await self.node.port_connect(b.id, b.port, b.generation, stream)

    # ---------------------------------------------------------------- snapshots
    async def snapshot(self, b: SnapshotOnNode) -> SnapshotInfo:
        return await self.node.snapshot(b.id, strip=b.strip, max_bytes=b.max_bytes)

    async def snapshots(self, b: SnapshotQuery) -> builtins.list[SnapshotInfo]:
        return await self.node.snapshots(project=b.project, sandbox_id=b.sandbox_id)

    async def snapshot_get(self, b: SnapshotRef) -> SnapshotInfo:
        return await self.node.get_snapshot(b.id)

    async def snapshot_delete(self, b: SnapshotRef) -> SnapshotInfo:
        return await self.node.delete_snapshot(b.id)

    # ---------------------------------------------------------------- network
    def network_get(self, b: SandboxRef) -> NetworkView:
        return self.node.network_get(b.id)

    async def network_update(self, b: NetworkUpdateOnNode) -> NetworkView:
        return await self.node.network_update(b.id, b.policy,
                                              expect_generation=b.expect_generation,
                                              ceiling_deny=b.ceiling_deny)

    # ---------------------------------------------------------------- layers (issue 16)
    async def layer_chain(self, b: LayerRef) -> LayerChain:
        return await asyncio.to_thread(self.node.layers.chain, b.digest)

    async def layer_get(self, b: LayerRef, stream: DuplexStream) -> None:
        await self.node.layers.send(b.digest, stream)

    async def layer_put(self, b: LayerPut, stream: DuplexStream) -> LayerStored:
        return await self.node.layers.receive(b.manifest, stream)


class EdgeService:
    """Binds an :class:`EdgeNode` to an Aether :class:`Router` (``service.router``): one
    route per edge row, each the bound handler itself (no wrapper: a sync query still
    runs inline in the read path)."""

    def __init__(self, node: EdgeNode, *, token: bytes | str | None = None) -> None:
        self.node = node
        self.handlers = h = EdgeHandlers(node)
        self.router = r = Router(token=token)
        for op in EDGE_OPS:
            r.add(op.edge_method, getattr(h, op.name), request_type=op.edge_type,
                  streaming=isinstance(op, StreamOp), duplex=isinstance(op, TunnelOp))


async def serve_edge(node: EdgeNode, address: str, *, token: bytes | str | None = None,
                     insecure: bool = False, limits: ServerLimits | None = None,
                     ssl: Any = None) -> Server:
    """Serve ``node`` on ``address`` (``unix:PATH`` or ``tcp:HOST:PORT``).

    Whoever reaches an edge can run code as root in its sandboxes, so a TCP listener needs
    a ``token`` that every connection must present first (``insecure=True`` waives it, for
    a private test network only), or ``ssl`` (mutual TLS with the cluster CA). A Unix socket is created 0600 (root only); a token
    there is optional.

    ``limits`` bound what peers may hold (connections, unauthenticated ones per address,
    deadlines, frame sizes; :data:`dsec.aether.limits.DEFAULT_LIMITS` by default), and
    accepted connections of every listener in the process share the process's fd
    budget, so a flood on the edge's socket cannot take the fds its sandboxes' exec
    pipes and its journal need."""
    if address.startswith("tcp:") and token is None and ssl is None and not insecure:
        raise InvalidArgument(
            f"refusing to serve edge {node.node_id} on {address} without a token: anyone who "
            "can connect could run commands in its sandboxes; pass a token (dsec edge "
            "--token-file FILE) or listen on a unix: socket")
    # No max_calls_in_flight here: the edge's peer is the apiserver, whose one link
    # carries every tenant's calls and its own polls; pausing it at a cap would let long
    # execs hold up the heartbeat. Tenants are capped at the gateway, per connection.
    # Nor unread_replies_max, nor a buffer-budget cut (shared_link): an authenticated
    # peer here is the apiserver (or holds its credential: root in every sandbox anyway),
    # and one tenant's big replies on that shared link wait their turn (the connection
    # parks them); they never close it for every tenant (redteam-19 A1).
    lim = dataclasses.replace(limits or DEFAULT_LIMITS, max_calls_in_flight=None,
                              unread_replies_max=None, shared_link=True)
    # ``ssl``: mutual TLS (a joined edge, dsec.cluster.ca.server_context): only a client
    # certificate of the cluster CA with clientAuth (the apiserver's) gets through the
    # handshake, so no token is needed on top.
    return await serve(EdgeService(node, token=token).router, address, limits=lim, ssl=ssl)
