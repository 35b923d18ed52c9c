"""The SDK, async: :class:`AsyncClient`, :class:`AsyncSandbox` and friends.

All SDK logic lives here; the sync :class:`~dsec.client.sync.Client` runs these same
coroutines on a private event-loop thread, so the two can never disagree.

Three timeouts, kept apart and named in errors:

- the **request timeout** (``AsyncClient(timeout=30.0)``): how long one API call may take
  on the wire; exceeding it raises :class:`~dsec.errors.RequestTimeout`;
- the **command timeout** (``exec(..., timeout=60.0)``): how long a command may run in the
  sandbox; exceeding it kills the process group and returns ``ExecResult(timed_out=True)``
  (a result, not an error). The request deadline of an exec is the command timeout plus
  the request timeout, so the wire never gives up first;
- the **sandbox lifetime** (``create(ttl=...)``): after it the edge destroys the sandbox
  (event reason ``ttl``).

Idempotent calls (get, list, events, destroy, file reads/stat/list) retry on connection
errors with exponential backoff (``retries`` times). ``create`` sends one
``Idempotency-Key`` (its own, or the caller's ``idempotency_key=``) on every attempt and
keeps retrying through lost connections, request timeouts and ``503``s (the apiserver
restarting, an edge it cannot reach) until ``create_retry_s`` has passed: long enough to
span an apiserver restart. The server answers a retry with the sandbox the first attempt
made, also across an apiserver crash (docs/sdk.md "Retries"). On a lost gateway
connection the client asks the REST endpoint for the gateway's address again (a
restarted ``dsec up`` may listen elsewhere).
"""

from __future__ import annotations

import asyncio
import builtins
import functools
import os
import random
import re
import uuid
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
    Sequence,
)
from typing import TYPE_CHECKING, Any, Literal, Self, TypeVar, overload

import msgspec

from dsec.client.files import AsyncFiles
from dsec.client.images import AsyncImages
from dsec.client.network import AsyncNetwork
from dsec.client.parts import closing
from dsec.client.processes import (
    AsyncProcesses,
    AsyncProcessHandle,
    AsyncPty,
    OutputCallback,
    start_process,
)
from dsec.errors import (
    ConnectFailed,
    ConnectionLost,
    DsecError,
    EdgeUnreachable,
    InvalidArgument,
    NotFound,
    Overloaded,
    RateLimited,
    RemoteProtocolError,
    RequestTimeout,
    TransportError,
    Unauthenticated,
    Unavailable,
)
from dsec.wire import ops
from dsec.wire.api import (
    GATEWAY_PROTOCOL,
    Info,
    NodeView,
    SandboxList,
    SnapshotView,
)
from dsec.wire.calls import (
    CreateMany,
    CreateSandbox,
    Empty,
    ExecMany,
    ListSandboxes,
    NodeRef,
    SandboxRef,
    SessionOpen,
    SessionRef,
    SnapshotCall,
    SnapshotQuery,
    SnapshotRef,
)
from dsec.wire.calls import ExecCall as WireExecCall
from dsec.wire.cluster import (
    JoinedNode,
    JoinTokenCreate,
    JoinTokenRevoke,
    JoinTokenView,
    NodeMigration,
)
from dsec.wire.layers import LayerFetch, LayerFetched
from dsec.wire.lifetime import SetTimeout
from dsec.wire.netpolicy import NetMode
from dsec.wire.ops import USE_CLIENT_DEFAULT, Deadline, Op, UploadOp
from dsec.wire.ports import ExposedPort, PortExpose, PortRef
from dsec.wire.spec import (
    BackendName,
    ExecChunk,
    ExecRequest,
    ExecResult,
    IdleAction,
    Isolation,
    NetworkPolicy,
    PauseStats,
    QosClass,
    SandboxEvent,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    SandboxStats,
    check_idempotency_key,
    isolation_of,
)

__all__ = ["AsyncClient", "AsyncFiles", "AsyncPorts", "AsyncSandbox", "AsyncSandboxes",
           "AsyncSnapshots", "ExecCall", "Snapshot", "WireProtocol",
           "parse_memory", "resolve_target"]

if TYPE_CHECKING:
    from dsec.client.code import Execution
    from dsec.client.transport import Transport

T = TypeVar("T")
#: How a client reaches the server (AsyncClient(protocol=...)).
WireProtocol = Literal["auto", "http", "aether"]
Req = TypeVar("Req")
Rep = TypeVar("Rep")

_MEM_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024, "m": 10**6,
          "mb": 10**6, "mi": 2**20, "mib": 2**20, "g": 10**9, "gb": 10**9, "gi": 2**30,
          "gib": 2**30, "t": 10**12, "tb": 10**12, "ti": 2**40, "tib": 2**40}


def parse_memory(value: int | str) -> int:
    """``"1GiB"`` -> 1073741824; ints are bytes."""
    if isinstance(value, bool):
        raise InvalidArgument(f"memory={value!r} must be bytes (int) or a string like '1GiB'")
    if isinstance(value, int):
        return value
    m = _MEM_RE.fullmatch(value) if isinstance(value, str) else None
    unit = (m.group(2) or "").lower() if m else None
    if m is None or unit not in _UNITS:
        raise InvalidArgument(f"memory={value!r} is not a size: use bytes or e.g. '512MiB', "
                              "'1GiB'", field="memory")
    return int(float(m.group(1)) * _UNITS[unit])


def resolve_target(url: str | None, api_key: str | None) -> tuple[str, str, str | None]:
    """(url, api_key, gateway) from arguments, then DSEC_URL/DSEC_API_KEY, then the local
    ``dsec up`` cluster's ``local.json`` (``$DSEC_STATE_DIR`` or ``~/.dsec``)."""
    from dsec.statedir import default_state_dir, read_local

    url = url or os.environ.get("DSEC_URL")
    api_key = api_key or os.environ.get("DSEC_API_KEY")
    gateway = os.environ.get("DSEC_GATEWAY")
    if url is None or api_key is None:
        local = read_local()
        if local is not None and (url is None or url == local.get("url")):
            url = url or local.get("url")
            api_key = api_key or local.get("api_key")
            gateway = gateway or local.get("gateway")
    if not url:
        raise TransportError(
            "no dsec cluster given: pass Client(url=..., api_key=...), set DSEC_URL and "
            "DSEC_API_KEY, or start a local one with `dsec up` (found no "
            f"{os.path.join(default_state_dir(), 'local.json')}: a `dsec up` with another "
            "state dir is found with DSEC_STATE_DIR=<its --state-dir>, now "
            f"{os.environ.get('DSEC_STATE_DIR', 'unset')})")
    if not api_key:
        raise Unauthenticated(f"no API key for {url}: pass api_key=... or set DSEC_API_KEY")
    return url, api_key, gateway


class Snapshot:
    """A pack_diff snapshot of a sandbox; pass it to ``create(snapshot=...)``.

    ``id`` (``sha256:<hex>``), ``parent`` (the snapshot it builds on, or None),
    ``created`` (unix seconds), ``size`` (bytes of this layer), ``unchanged`` (nothing
    changed since the previous snapshot, which this is), ``nodes`` (edges holding it)."""

    def __init__(self, view: SnapshotView) -> None:
        self.view = view
        self.id: str = view.id
        self.parent: str | None = view.parent
        self.created: float = view.created_at
        self.size: int = view.size_bytes
        self.sandbox_id: str = view.sandbox_id
        self.project: str = view.project
        self.unchanged: bool = view.unchanged
        self.nodes: list[str] = list(view.nodes)

    @property
    def data(self) -> dict[str, Any]:
        """The snapshot as plain JSON-able data."""
        data: dict[str, Any] = msgspec.to_builtins(self.view)
        return data

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Snapshot) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return (f"Snapshot({self.id[:19]}..., sandbox={self.sandbox_id!r}, "
                f"parent={(self.parent or '')[:19] or None!r}, size={self.size})")


class AsyncSnapshots:
    """``client.snapshots``: list, get, delete (create them with ``sandbox.snapshot()``)."""

    def __init__(self, client: AsyncClient) -> None:
        self._c = client

    async def list(self, *, project: str | None = None,
                   sandbox_id: str | None = None) -> builtins.list[Snapshot]:
        page = await self._c.call(ops.SNAPSHOTS, SnapshotQuery(project=project,
                                                                sandbox_id=sandbox_id))
        return [Snapshot(v) for v in page.items]

    async def get(self, snapshot: Snapshot | str) -> Snapshot:
        return Snapshot(await self._c.call(ops.SNAPSHOT_GET, SnapshotRef(id=_snap_id(snapshot))))

    async def delete(self, snapshot: Snapshot | str) -> None:
        """Delete it; ``InUse`` while a sandbox runs from it or a snapshot builds on it."""
        await self._c.call(ops.SNAPSHOT_DELETE, SnapshotRef(id=_snap_id(snapshot)))


def _snap_id(snapshot: Snapshot | str) -> str:
    if isinstance(snapshot, Snapshot):
        return snapshot.id
    if not isinstance(snapshot, str) or not snapshot:
        raise InvalidArgument(f"snapshot={snapshot!r} must be a Snapshot or its id "
                              "('sha256:...')", field="snapshot")
    return snapshot


# What a create (one key per sandbox) is retried on: its own connection, the request
# timeout, 503s (an apiserver restarting, an edge it cannot reach) and rate limits.
_CREATE_RETRYABLE = (TransportError, RequestTimeout, Unavailable, RateLimited)
_EDGE_RELINK_S = 0.5  # half the apiserver's default reconnect_interval_s


class AsyncClient:
    """Entry point: ``async with AsyncClient() as client: sb = await client.sandboxes.create()``.

    ``protocol``: how to reach the server: ``"auto"`` (the Aether gateway when the server
    advertises one it speaks, else REST), ``"http"`` or ``"aether"``. ``transport``: a
    :class:`~dsec.client.transport.Transport` object to go through instead
    (``url``/``api_key`` are then not needed, ``protocol`` is unused), e.g. an in-memory
    :class:`dsec.client.testing.MockTransport` in tests. Sandboxes outlive the client
    that made them, until their timeout (``ttl``, else the server's default; E2B and Modal
    semantics; issue 19). ``session=True`` opts in to session-bound cleanup: the
    sandboxes this client creates are bound to a session it renews in the background
    every ``session_lease_s``/3; when the client closes they are destroyed at once, and
    if it dies the server's sweeper destroys them after the lease (``session=`` on one
    create overrides the client's choice, ``detached=True`` opts one sandbox out).
    ``retries``: attempts after a connection error for
    idempotent calls. ``create_retry_s``: how long one ``create()`` keeps retrying (same
    Idempotency-Key) through connection errors, request timeouts and 503s (default 120 s,
    enough to span an apiserver restart; ``None``: ``retries`` attempts only).
    """

    def __init__(
        self, url: str | None = None, api_key: str | None = None, *, timeout: float | None = 30.0,
        protocol: WireProtocol = "auto", transport: Transport | None = None,
        gateway: str | None = None, retries: int = 3,
        session_lease_s: float | None = 60.0, create_retry_s: float | None = 120.0,
        session: bool = False, _http_transport: Any = None,
    ) -> None:
        if isinstance(transport, str):
            raise InvalidArgument(f"transport={transport!r}: transport= takes a Transport "
                                  "object; the protocol is chosen with protocol='http', "
                                  "'aether' or 'auto'", field="transport")
        if protocol not in ("auto", "http", "aether"):
            raise InvalidArgument(f"protocol={protocol!r}: use 'auto', 'http' or 'aether'",
                                  field="protocol")
        injected = transport
        if injected is None:
            self.url, self._key, found_gw = resolve_target(url, api_key)
        else:
            self.url, self._key, found_gw = url or "", api_key or "", None
        self.gateway = gateway or found_gw
        if timeout is not None and timeout <= 0:
            raise InvalidArgument(f"request timeout={timeout} must be positive seconds or None")
        if create_retry_s is not None and create_retry_s < 0:
            raise InvalidArgument(f"create_retry_s={create_retry_s} must be >= 0 seconds or "
                                  "None")
        self.timeout = timeout
        self.retries = retries
        self.create_retry_s = create_retry_s
        self._rediscover = False
        self.session_lease_s = session_lease_s
        if session and session_lease_s is None:
            raise InvalidArgument("session=True binds sandboxes to a session lease: pass a "
                                  "session_lease_s (seconds), not None", field="session")
        self.session = session           # bind creates to a session (opt-in, issue 19)
        self.protocol: WireProtocol = protocol
        self._mode = protocol if injected is None else "injected"
        self._http_transport = _http_transport
        self._t: Transport | None = injected
        self._info: Info | None = None
        self._session: str | None = None
        self._renewer: asyncio.Task[None] | None = None
        self._session_lock: asyncio.Lock | None = None
        self.sandboxes = AsyncSandboxes(self)
        self.snapshots = AsyncSnapshots(self)
        self.images = AsyncImages(self)

    # ------------------------------------------------------------------ plumbing
    async def _transport(self) -> Transport:
        if self._t is not None:
            return self._t
        from dsec.client.transport import AetherTransport, HttpTransport
        http = HttpTransport(self.url, self._key, timeout=self.timeout,
                             transport=self._http_transport)
        if self._mode == "http":
            self._t = http
            return http
        gw = None if self._rediscover else self.gateway
        if gw is None:
            try:
                self._info = await self._retry(http.info)
            except BaseException:
                await http.close()
                raise
            gw = self._info.gateway
            spoken = self._info.gateway_protocol
            if gw is not None and spoken != GATEWAY_PROTOCOL:
                # A gateway of another release: its bodies would not decode. REST works.
                if self._mode == "aether":
                    await http.close()
                    raise TransportError(
                        f"the gateway at {gw} speaks protocol {spoken}, this SDK "
                        f"{GATEWAY_PROTOCOL}; use protocol 'http' or a matching SDK")
                gw = None
            if self._rediscover and gw is not None:
                self.gateway = gw
            self._rediscover = False
        if gw is None:
            if self._mode == "aether":
                await http.close()
                raise TransportError(f"{self.url} offers no Aether gateway; use protocol='http'")
            self._t = http
            return http
        await http.close()
        self._t = AetherTransport(gw, self._key, timeout=self.timeout)
        return self._t

    async def _retry(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Call ``fn`` again on connection errors (not on answers), with backoff; and on
        :class:`EdgeUnreachable` (the apiserver's link to the sandbox's edge is being
        re-established, e.g. the edge just restarted: the apiserver reconnects at most
        once per ``reconnect_interval_s``, 1 s by default), at least that long apart. Only
        idempotent calls come here, so repeating one the link may have carried is safe."""
        return await self._retry_if(fn, lambda exc: isinstance(
            exc, (TransportError, EdgeUnreachable)))

    async def _retry_if(self, fn: Callable[[], Awaitable[T]],
                        retryable: Callable[[DsecError], bool]) -> T:
        """:meth:`_retry` for the errors ``retryable`` accepts."""
        delay = 0.05
        for attempt in range(self.retries + 1):
            try:
                return await fn()
            except DsecError as exc:
                if attempt >= self.retries or not retryable(exc):
                    raise
                wait = delay * (0.5 + random.random())
                if isinstance(exc, EdgeUnreachable):
                    wait = max(wait, _EDGE_RELINK_S)
                await asyncio.sleep(wait)
                delay *= 4
        raise AssertionError("unreachable")

    async def _retry_until(self, fn: Callable[[], Awaitable[T]], deadline_s: float | None) -> T:
        """Call ``fn`` until it succeeds, a non-retryable error comes back, or
        ``deadline_s`` passed (then the last error is raised). Retryable: the connection
        (``TransportError``), ``RequestTimeout``, ``Unavailable`` (503: the apiserver
        cannot reach an edge, or handed the request over) and ``RateLimited`` (after its
        ``retry_after``). Only for calls that are safe to repeat (create with one key)."""
        if deadline_s is None:
            return await self._retry(fn)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        delay = 0.05
        while True:
            try:
                return await fn()
            except _CREATE_RETRYABLE as exc:
                wait = delay * (0.5 + random.random())
                if isinstance(exc, RateLimited):
                    wait = max(wait, float(exc.detail.get("retry_after") or 0.0))
                if loop.time() + wait >= deadline:
                    raise
                if isinstance(exc, TransportError):
                    await self._reset_transport()
                await asyncio.sleep(wait)
                delay = min(delay * 2, 1.0)

    async def _reset_transport(self) -> None:
        """After a lost gateway connection: close it, and find the gateway's address
        again through REST on the next call (a restarted apiserver may listen on another
        port). REST connections need nothing: httpx reconnects."""
        t = self._t
        if t is None or t.name != "aether":
            return
        self._t = None
        self._rediscover = True
        try:
            await t.close()
        except DsecError:
            pass

    async def call(self, op: Op[Req, Rep], body: Req, *, idempotent: bool | None = None,
                   timeout: Deadline = USE_CLIENT_DEFAULT) -> Rep:
        """Call one operation of the catalogue (:mod:`dsec.wire.ops`) with its request
        object, through this client's transport: its reply, typed by the row. Retried
        on connection errors when repeating it is safe (``op.idempotent``, or
        ``idempotent``); ``timeout``: the request deadline (the client's by default).
        The typed escape hatch under every method of the SDK."""
        t = await self._transport()
        if op.idempotent if idempotent is None else idempotent:
            return await self._retry(lambda: t.call(op, body, timeout=timeout))
        # Not safe to repeat (exec): again only when the server provably never read it.
        return await self._retry_if(lambda: t.call(op, body, timeout=timeout),
                                    never_processed)

    async def upload(self, op: UploadOp[Req, Rep], body: Req,
                     chunks: AsyncIterator[bytes]) -> Rep:
        """An upload row (its body a stream of bytes: an image tar) over REST, whatever
        this client's protocol (the gateway carries no such streams yet). Not retried:
        the stream is consumed by the first attempt."""
        t = await self._transport()
        # a transport that serves uploads (REST, a test's MockTransport) takes it; the
        # gateway's does not (no upload row lists it), so REST is asked directly
        upload = getattr(t, "upload", None)
        if upload is not None:
            reply: Rep = await upload(op, body, chunks)
            return reply
        from dsec.client.transport import HttpTransport
        http = HttpTransport(self.url, self._key, timeout=self.timeout,
                             transport=self._http_transport)
        try:
            return await http.upload(op, body, chunks)
        finally:
            await http.close()

    async def _bound_session(self, detached: bool, session: bool | None) -> str | None:
        """The session a create binds its sandboxes to: none unless this client was made
        with ``session=True`` or the create asks (``session=True``); never ``detached``."""
        if detached and session:
            raise InvalidArgument("detached=True and session=True contradict each other: a "
                                  "detached sandbox outlives this client's session",
                                  field="detached")
        if detached or not (self.session if session is None else session):
            return None
        if self.session_lease_s is None:
            raise InvalidArgument("session=True needs a session lease: this client was "
                                  "made with session_lease_s=None", field="session")
        return await self._retry_until(self._ensure_session, self.create_retry_s)

    async def _ensure_session(self) -> str | None:
        if self.session_lease_s is None:
            return None
        if self._session is not None:
            return self._session
        if self._session_lock is None:
            self._session_lock = asyncio.Lock()
        async with self._session_lock:
            if self._session is None:
                view = await self.call(ops.SESSION_OPEN,
                                       SessionOpen(lease_s=self.session_lease_s),
                                       idempotent=True)
                self._session = view.id
                self._renewer = asyncio.create_task(self._renew_loop(view.id, view.lease_s))
        return self._session

    async def _renew_loop(self, session_id: str, lease_s: float) -> None:
        while True:
            await asyncio.sleep(lease_s / 3)
            try:
                await self.call(ops.SESSION_RENEW, SessionRef(id=session_id))
            except NotFound:
                # The server forgot the session (it lapsed long ago): its sandboxes are
                # gone; the next create opens a fresh session instead of reusing this id.
                if self._session == session_id:
                    self._session = None
                    self._renewer = None
                return
            except DsecError:
                pass  # next round tries again; the lease is 3x the interval

    # ------------------------------------------------------------------- public
    async def info(self) -> Info:
        return await self.call(ops.INFO, Empty())

    async def fetch_layer(self, node_id: str, digest: str, *,
                          source: str | None = None) -> LayerFetched:
        """Copy a layer and every layer below it onto edge ``node_id`` from a node holding
        them (superuser; docs/layers.md): to warm a node ahead of creates, which fetch
        what their node lacks by themselves."""
        return await self.call(ops.LAYER_FETCH,
                               LayerFetch(node=node_id, digest=digest, source=source))

    async def nodes(self) -> list[NodeView]:
        return (await self.call(ops.NODES, Empty())).items

    async def drain_node(self, node_id: str) -> NodeView:
        """Drain an edge node (superuser): no new sandboxes go there; those it holds run
        until they end. Stored: survives apiserver restarts, binds every replica."""
        return await self.call(ops.NODE_DRAIN, NodeRef(id=node_id))

    async def migrate_node(self, node_id: str) -> NodeMigration:
        """Move every sandbox off a drained node (superuser): each is snapshotted,
        started from it on another node and ended with reason ``migrated`` naming its new
        id. Safe to repeat: a run cut short is carried on, never doubled."""
        return await self.call(ops.NODE_MIGRATE, NodeRef(id=node_id))

    async def undrain_node(self, node_id: str) -> NodeView:
        """Undrain an edge node (superuser): placement may use it again."""
        return await self.call(ops.NODE_UNDRAIN, NodeRef(id=node_id))

    # cluster membership (superuser; docs/cluster.md): join tokens and joined edges
    async def create_join_token(self, *, ttl_s: float = 86400.0, uses: int = 1,
                                description: str = "") -> JoinTokenView:
        """A join token for ``dsec edge --join`` (its ``token`` is shown this once)."""
        return await self.call(ops.CLUSTER_TOKEN_CREATE, JoinTokenCreate(
            ttl_s=ttl_s, uses=uses, description=description))

    async def join_tokens(self) -> list[JoinTokenView]:
        return (await self.call(ops.CLUSTER_TOKENS, Empty())).items

    async def revoke_join_token(self, token_id: str, *, nodes: bool = False) -> None:
        """No more joins with the token; ``nodes``: also revoke every node that joined
        with it (their sandboxes are written off)."""
        await self.call(ops.CLUSTER_TOKEN_REVOKE, JoinTokenRevoke(id=token_id, nodes=nodes))

    async def joined_nodes(self) -> list[JoinedNode]:
        return (await self.call(ops.CLUSTER_NODES, Empty())).items

    async def revoke_joined_node(self, node_id: str) -> None:
        """Revoke a joined node: its certificate is refused at every replica and its
        sandboxes are written off (reason ``node_revoked``)."""
        await self.call(ops.CLUSTER_NODE_REVOKE, NodeRef(id=node_id))

    async def close(self) -> None:
        """Stop renewing the session and close it: session-bound sandboxes are swept."""
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
            self._renewer = None
        if self._session is not None and self._t is not None:
            try:
                await self._t.call(ops.SESSION_CLOSE, SessionRef(id=self._session))
            except DsecError:
                pass
            self._session = None
        if self._t is not None:
            await self._t.close()
            self._t = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def transport_name(self) -> str | None:
        return None if self._t is None else str(self._t.name)


class AsyncSandboxes:
    """``client.sandboxes``: create, get, list, create_many, exec_many."""

    def __init__(self, client: AsyncClient) -> None:
        self._c = client

    @staticmethod
    def _spec(
        *, image: str = "base", workspace: str | None = None,
        toolkits: Sequence[str] = (), backend: BackendName | None = None, cpu: float = 1,
        memory: int | str = "512MiB", ttl: float | None = None,
        idle_timeout: float | None = None, idle_action: IdleAction = "destroy",
        ttl_action: IdleAction = "destroy",
        labels: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None,
        project: str | None = None, snapshot: Snapshot | str | None = None,
        priority: int = 0, disk: int | str | None = None,
        pids_max: int | None = 1024, network: NetworkPolicy | NetMode | None = None,
        allow_nested: bool = False, user_namespace: bool = False,
        cwd: str | None = None, user: str | None = None,
        build_step: str | None = None, qos: QosClass | None = None,
        cpu_quota: float | None = None, isolation: Isolation | None = None,
    ) -> SandboxSpec:
        """The spec the create keywords ask for (what they leave out, None, is the
        server's to decide: backend, project, lifetime)."""
        if isinstance(cpu, bool) or not isinstance(cpu, (int, float)) or cpu <= 0:
            raise InvalidArgument(f"cpu={cpu!r} must be a positive number of cores", field="cpu")
        return SandboxSpec(
            image=image, workspace=workspace, toolkits=tuple(toolkits),
            snapshot=None if snapshot is None else _snap_id(snapshot),
            backend=backend, isolation=isolation, cpu_milli=round(cpu * 1000),
            memory_bytes=parse_memory(memory),
            disk_bytes=None if disk is None else parse_memory(disk), priority=priority,
            labels=dict(labels or {}), project=project, ttl_s=ttl,
            idle_timeout_s=idle_timeout, idle_action=idle_action, ttl_action=ttl_action,
            env=dict(env or {}),
            pids_max=pids_max, network=NetworkPolicy.of(network), allow_nested=allow_nested,
            user_namespace=user_namespace, cwd=cwd, user=user, build_step=build_step,
            qos=qos, cpu_quota_milli=None if cpu_quota is None else round(cpu_quota * 1000))

    def _given_spec(self, spec: SandboxSpec | None, kw: Mapping[str, Any]) -> SandboxSpec:
        """``spec`` as it is, or the one the keywords build; both at once only when the
        keywords say nothing (a keyword beside ``spec=`` would be silently ignored)."""
        built = self._spec(**kw)
        if spec is None:
            return built
        if not isinstance(spec, SandboxSpec):
            raise InvalidArgument(f"spec= takes a SandboxSpec, not {type(spec).__name__}",
                                  field="spec")
        if built != _NO_KEYWORDS:
            said = sorted(f for f in SandboxSpec.__struct_fields__
                          if getattr(built, f) != getattr(_NO_KEYWORDS, f))
            raise InvalidArgument(f"create got spec= and keywords that set {', '.join(said)}: "
                                  "put every field in the spec (msgspec.structs.replace)",
                                  field="spec")
        return spec.validate()

    async def create(
        self, *, spec: SandboxSpec | None = None, image: str = "base",
        workspace: str | None = None,
        toolkits: Sequence[str] = (), snapshot: Snapshot | str | None = None,
        backend: BackendName | None = None, cpu: float = 1, memory: int | str = "512MiB",
        disk: int | str | None = None, pids_max: int | None = 1024, priority: int = 0,
        labels: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None,
        project: str | None = None, ttl: float | None = None,
        idle_timeout: float | None = None, idle_action: IdleAction = "destroy",
        ttl_action: IdleAction = "destroy",
        network: NetworkPolicy | NetMode | None = None, allow_nested: bool = False,
        user_namespace: bool = False, detached: bool = False,
        idempotency_key: str | None = None, cwd: str | None = None, user: str | None = None,
        build_step: str | None = None, session: bool | None = None,
        qos: QosClass | None = None, cpu_quota: float | None = None,
        isolation: Isolation | None = None,
    ) -> AsyncSandbox:
        """Create one sandbox from ``image`` (plus an optional ``workspace`` layer and
        ``toolkits``), or from ``snapshot``. ``cpu`` in cores, ``memory``/``disk`` in
        bytes or as "1GiB"; ``ttl``/``idle_timeout`` in seconds (``idle_action``,
        ``ttl_action``: "destroy" or "pause" when it runs out); ``project``: the key's
        default project when None;
        ``session``: bind it to this client's session (destroyed when the client closes
        or dies; None: the client's ``session`` choice, False by default: it lives until
        its timeout); ``detached=True``: never bound (as ``session=False``);
        ``env``/``cwd``/``user``: every exec's defaults, over the image config's (its
        ``Env``, ``WorkingDir``, ``User``; an exec's own win over both).
        ``qos``: "ls" (latency-sensitive) or "be" (best-effort: SCHED_IDLE, lowest CPU
        weight, paused first under memory pressure); None: "ls" unless the project's
        quota restricts it (docs/container.md "QoS classes"). ``cpu_quota``: the CPU cap
        in cores (None: capped at ``cpu``).
        ``isolation``: the isolation tier, "container" (namespaces on the host kernel),
        "gvisor" (gVisor's user-space kernel) or "vm" (a microVM with its own kernel; see
        docs/isolation.md); it picks the backend when ``backend`` is None (with both,
        they must agree). None: the server's default backend and its tier. A tier no
        node of the cluster offers is refused (InvalidArgument naming what is offered).
        ``build_step``: an image build step's cache key (the builder sets it: the edge
        records it in this sandbox's snapshots with the stack it ran on).

        ``spec``: a whole :class:`~dsec.wire.spec.SandboxSpec`, sent unchanged (every
        field; ``backend``/``project``/``ttl_s`` left None are the server's), instead of
        the keywords.

        Every attempt carries one ``Idempotency-Key``: ``idempotency_key`` (to make a
        create idempotent across client processes too), else a fresh random one. Lost
        connections, request timeouts and 503s are retried with it for
        ``create_retry_s``; the server answers a retry with the sandbox the first attempt
        made, never a second one."""
        asked = self._given_spec(spec, {
            "image": image, "workspace": workspace, "toolkits": toolkits, "snapshot": snapshot,
            "backend": backend, "cpu": cpu, "memory": memory, "disk": disk, "pids_max": pids_max,
            "priority": priority, "labels": labels, "env": env, "project": project, "ttl": ttl,
            "idle_timeout": idle_timeout, "idle_action": idle_action, "network": network,
            "ttl_action": ttl_action,
            "allow_nested": allow_nested, "user_namespace": user_namespace, "cwd": cwd,
            "user": user, "build_step": build_step, "qos": qos, "cpu_quota": cpu_quota,
            "isolation": isolation})
        c = self._c
        if idempotency_key is not None and not isinstance(idempotency_key, str):
            raise InvalidArgument("idempotency_key must be 1..255 printable ASCII characters",
                                  field="idempotency_key")
        check_idempotency_key(idempotency_key)
        key = idempotency_key or "sdk-" + uuid.uuid4().hex  # one key for every retry
        # the session it is bound to is opened first: retried as a create
        bound = await c._bound_session(detached, session)
        body = CreateSandbox(spec=asked, session=bound, idempotency_key=key)
        info = await c._retry_until(lambda: c.call(ops.CREATE, body, idempotent=False),
                                    c.create_retry_s)
        return AsyncSandbox(c, info)

    async def create_many(
        self, n: int | Sequence[Mapping[str, Any] | SandboxSpec], *, image: str = "base",
        workspace: str | None = None, toolkits: Sequence[str] = (),
        snapshot: Snapshot | str | None = None, backend: BackendName | None = None, cpu: float = 1,
        memory: int | str = "512MiB", disk: int | str | None = None,
        pids_max: int | None = 1024, priority: int = 0,
        labels: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None,
        project: str | None = None, ttl: float | None = None,
        idle_timeout: float | None = None, idle_action: IdleAction = "destroy",
        ttl_action: IdleAction = "destroy",
        network: NetworkPolicy | NetMode | None = None, allow_nested: bool = False,
        user_namespace: bool = False, detached: bool = False,
        cwd: str | None = None, user: str | None = None, session: bool | None = None,
        qos: QosClass | None = None, cpu_quota: float | None = None,
        isolation: Isolation | None = None,
    ) -> list[AsyncSandbox]:
        """Many sandboxes in batched calls: ``n`` identical ones (the keywords as for
        :meth:`create`), or one per item of a list: a keyword dict laid over the keywords
        (``create_many([{"image": "a"}, {"image": "b"}], memory="1GiB")``) or a whole
        :class:`~dsec.wire.spec.SandboxSpec`, sent unchanged.
        All or nothing: if any fails, the ones that were created are destroyed and the
        first error is raised. Each item carries an Idempotency-Key of its own and the
        batch is retried like :meth:`create` (``create_retry_s``), so a batch whose
        reply was lost (an apiserver crash) makes each sandbox exactly once."""
        kw: dict[str, Any] = {
            "image": image, "workspace": workspace, "toolkits": toolkits, "snapshot": snapshot,
            "backend": backend, "cpu": cpu, "memory": memory, "disk": disk, "pids_max": pids_max,
            "priority": priority, "labels": labels, "env": env, "project": project, "ttl": ttl,
            "idle_timeout": idle_timeout, "idle_action": idle_action, "network": network,
            "ttl_action": ttl_action,
            "allow_nested": allow_nested, "user_namespace": user_namespace, "cwd": cwd,
            "user": user, "qos": qos, "cpu_quota": cpu_quota, "isolation": isolation}
        c = self._c
        specs: list[SandboxSpec]
        if isinstance(n, int) and not isinstance(n, bool):
            if not 0 < n <= 100_000:
                raise InvalidArgument(f"create_many n={n} must be within 1..100000")
            specs = [self._spec(**kw)] * n
        elif isinstance(n, Sequence) and not isinstance(n, (str, bytes)) and \
                all(isinstance(item, (Mapping, SandboxSpec)) for item in n) and \
                0 < len(n) <= 100_000:
            specs = [item.validate() if isinstance(item, SandboxSpec)
                     else self._spec(**{**kw, **item}) for item in n]
        else:
            raise InvalidArgument(f"create_many takes a count (1..100000) or a list of up to "
                                  f"100000 keyword dicts or SandboxSpecs, not "
                                  f"{type(n).__name__}")
        bound = await c._bound_session(detached, session)
        keys = ["sdk-" + uuid.uuid4().hex for _ in specs]   # one per item, for every retry
        results: list[SandboxInfo | DsecError] = []
        for start in range(0, len(specs), 1024):
            results += await self._create_batch(specs[start:start + 1024],
                                                keys[start:start + 1024], bound)
        ok = [AsyncSandbox(self._c, r) for r in results if isinstance(r, SandboxInfo)]
        errors = [r for r in results if not isinstance(r, SandboxInfo)]
        if errors:
            await asyncio.gather(*(s.kill() for s in ok), return_exceptions=True)
            raise errors[0]
        return ok

    async def _create_batch(self, specs: Sequence[SandboxSpec], keys: Sequence[str],
                            session: str | None) -> list[SandboxInfo | DsecError]:
        """One batched call, retried as :meth:`create` retries (same keys, so nothing is
        made twice): the whole call on a lost connection, a timeout or a 503, then the
        items that failed retryably, until ``create_retry_s`` has passed."""
        c = self._c
        loop = asyncio.get_running_loop()
        deadline = None if c.create_retry_s is None else loop.time() + c.create_retry_s
        out: list[SandboxInfo | DsecError] = [InvalidArgument("not attempted")] * len(specs)
        todo = list(range(len(specs)))
        delay = 0.05
        while True:
            left = None if deadline is None else max(0.0, deadline - loop.time())

            async def attempt(todo: list[int] = todo) -> list[SandboxInfo | DsecError]:
                batch = await c.call(ops.CREATE_MANY, CreateMany(
                    items=[specs[i] for i in todo], session=session,
                    idempotency_keys=[keys[i] for i in todo]), idempotent=False)
                return batch.results()
            got = await c._retry_until(attempt, left)
            again = []
            for i, r in zip(todo, got):
                out[i] = r
                if isinstance(r, _CREATE_RETRYABLE):
                    again.append(i)
            wait = delay * (0.5 + random.random())
            if not again or deadline is None or loop.time() + wait >= deadline:
                return out
            todo = again
            await asyncio.sleep(wait)
            delay = min(delay * 2, 1.0)

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        return AsyncSandbox(self._c, await self._c.call(ops.GET, SandboxRef(id=sandbox_id)))

    async def list(self, *, project: str | None = None, labels: Mapping[str, str] | None = None,
                   state: SandboxState | None = None, limit: int | None = None,
                   node: str | None = None,
                   isolation: Isolation | None = None) -> list[AsyncSandbox]:
        """Every matching sandbox (pages through the server's cursor); ``node``: only
        those on that node; ``isolation``: only those of that tier."""
        out: list[AsyncSandbox] = []
        cursor: str | None = None
        while True:
            page = await self._c._retry(
                functools.partial(self._list_page, project, labels or {}, state, cursor,
                                  node, isolation))
            out += [AsyncSandbox(self._c, i) for i in page.items]
            cursor = page.next_cursor
            if cursor is None or (limit is not None and len(out) >= limit):
                return out[:limit] if limit is not None else out

    async def _list_page(self, project: str | None, labels: Mapping[str, str],
                         state: SandboxState | None, cursor: str | None,
                         node: str | None = None,
                         isolation: Isolation | None = None) -> SandboxList:
        return await self._c.call(ops.LIST, ListSandboxes(
            project=project, labels=dict(labels), state=state,
            limit=1000, cursor=cursor, node=node, isolation=isolation))

    async def exec_many(
        self, calls: Sequence[ExecCall], *, timeout: float | None = 60.0,
        env: Mapping[str, str] | None = None, cwd: str | None = None,
        stdin: bytes | str | None = None, user: str | None = None,
        output_cap: int | None = None, return_exceptions: bool = False,
    ) -> builtins.list[ExecResult | DsecError]:
        """Many commands in one batched call (the server groups them per edge: one edge
        round trip per node). Each call is ``(sandbox, command)`` or ``(sandbox, command,
        overrides)``; ``command`` is a shell string, an argv list, or a complete
        :class:`~dsec.wire.spec.ExecRequest`. The keywords (as for :meth:`AsyncSandbox.exec`)
        are defaults for string/argv commands; an ``ExecRequest`` is sent as it is;
        ``overrides`` (a dict of the same keywords) change one call:
        ``(sb, "make", {"cwd": "/src", "timeout": 600})``.

        ``return_exceptions=True`` returns a failed item (sandbox gone, ...) as its
        :class:`DsecError` in place; otherwise the first one is raised."""
        defaults: dict[str, Any] = {"timeout": timeout, "env": env, "cwd": cwd,
                                    "stdin": stdin, "user": user, "output_cap": output_cap}
        items = [_exec_item(call, defaults) for call in calls]
        if not items:
            return []
        longest: float | None = 0.0
        for _, req in items:
            longest = None if longest is None or req.timeout_s is None \
                else max(longest, req.timeout_s)
        batch = await self._c.call(ops.EXEC_MANY, ExecMany(
            calls=[WireExecCall(id=sid, req=req) for sid, req in items]),
            timeout=_deadline(self._c.timeout, longest))
        res = batch.results()
        if not return_exceptions:
            for r in res:
                if isinstance(r, DsecError):
                    raise r
        return res


# What the create keywords build when none is given: beside spec=, any other is refused.
_NO_KEYWORDS = AsyncSandboxes._spec()


def _deadline(request_timeout: float | None, command_timeout: float | None) -> float | None:
    if request_timeout is None or command_timeout is None:
        return None
    return request_timeout + command_timeout


# One exec_many item: (sandbox, command) or (sandbox, command, {keyword: override}).
ExecCall = (tuple["AsyncSandbox | str", "str | Sequence[str] | ExecRequest"]
            | tuple["AsyncSandbox | str", "str | Sequence[str] | ExecRequest", Mapping[str, Any]])
_EXEC_KEYWORDS = frozenset({"timeout", "env", "cwd", "stdin", "user", "background",
                            "output_cap"})


def _exec_item(call: Any, defaults: Mapping[str, Any]) -> tuple[str, ExecRequest]:
    """``(sandbox id, validated ExecRequest)`` for one :meth:`AsyncSandboxes.exec_many` item."""
    if not isinstance(call, tuple) or len(call) not in (2, 3):
        raise InvalidArgument(f"an exec_many call is (sandbox, command) or (sandbox, command, "
                              f"{{overrides}}), not {call!r:.80}")
    sb, cmd = call[0], call[1]
    over = call[2] if len(call) == 3 else {}
    if not isinstance(over, Mapping) or not set(over) <= _EXEC_KEYWORDS:
        bad = sorted(set(over) - _EXEC_KEYWORDS) if isinstance(over, Mapping) else over
        raise InvalidArgument(f"exec_many overrides {bad!r} are not exec keywords; use "
                              f"{sorted(_EXEC_KEYWORDS)}")
    sid = sb.id if isinstance(sb, AsyncSandbox) else sb
    if not isinstance(sid, str):
        raise InvalidArgument(f"an exec_many call names a sandbox (object or id), not "
                              f"{type(sid).__name__}")
    if isinstance(cmd, ExecRequest):
        if not over:
            return sid, cmd.validate()
        changes: dict[str, Any] = {}
        for k, v in over.items():
            if k == "timeout":
                changes["timeout_s"] = v
            elif k == "output_cap":
                if v is not None:
                    changes["output_cap_bytes"] = v
            elif k == "stdin":
                changes["stdin"] = v.encode() if isinstance(v, str) else (v or b"")
            elif k == "env":
                changes["env"] = dict(v or {})
            else:
                changes[k] = v
        return sid, msgspec.structs.replace(cmd, **changes).validate()
    return sid, _exec_req(cmd, **{**defaults, **over})


def _exec_req(cmd: str | Sequence[str], *, timeout: float | None = 60.0,
              env: Mapping[str, str] | None = None, cwd: str | None = None,
              stdin: bytes | str | None = None, user: str | None = None,
              background: bool = False, output_cap: int | None = None) -> ExecRequest:
    if isinstance(cmd, str):
        argv: tuple[str, ...] = ()
        shell: str | None = cmd
    elif isinstance(cmd, Sequence) and cmd and all(isinstance(a, str) for a in cmd):
        argv, shell = tuple(cmd), None
    else:
        raise InvalidArgument("a command is a shell string or a non-empty list of strings, "
                              f"not {type(cmd).__name__}")
    data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
    req = ExecRequest(argv=argv, shell=shell, env=dict(env or {}), cwd=cwd, user=user,
                      stdin=data, timeout_s=timeout, background=background)
    if output_cap is not None:      # left out otherwise: the default stays the default
        req = msgspec.structs.replace(req, output_cap_bytes=output_cap)
    return req.validate()


class AsyncPorts:
    """``sandbox.ports``: reach a server inside the sandbox through the apiserver (HTTP
    and WebSocket; docs/networking.md). A URL carries a token: whoever holds it reaches
    that port until it expires or the port is closed (members may also send their API
    key instead)."""

    def __init__(self, sb: AsyncSandbox) -> None:
        self._sb = sb

    def _absolute(self, p: ExposedPort) -> ExposedPort:
        if p.url.startswith("/") and self._sb._c.url:
            return msgspec.structs.replace(p, url=self._sb._c.url.rstrip("/") + p.url)
        return p

    async def expose(self, port: int, *, token_ttl_s: float | None = None) -> str:
        """Expose ``port`` (idempotent) and return its URL (token included)."""
        return (await self.expose_info(port, token_ttl_s=token_ttl_s)).url

    async def expose_info(self, port: int, *, token_ttl_s: float | None = None
                          ) -> ExposedPort:
        """As :meth:`expose`, with the token and its expiry apart."""
        return self._absolute(await self._sb._c.call(ops.PORT_EXPOSE, PortExpose(
            id=self._sb.id, port=port, token_ttl_s=token_ttl_s)))

    async def list(self) -> list[ExposedPort]:
        got = await self._sb._c.call(ops.PORT_LIST, SandboxRef(id=self._sb.id))
        return [self._absolute(p) for p in got.items]

    async def close(self, port: int) -> None:
        """Close ``port``: its URLs stop working and open connections through it end."""
        await self._sb._c.call(ops.PORT_CLOSE, PortRef(id=self._sb.id, port=port))


class AsyncSandbox:
    """One sandbox. ``async with`` kills it on exit."""

    def __init__(self, client: AsyncClient, info: SandboxInfo) -> None:
        self._c = client
        self.info = info
        self.id: str = info.id
        self.files = AsyncFiles(self)
        self.ports = AsyncPorts(self)
        self.network = AsyncNetwork(self)
        self.processes = AsyncProcesses(self)
        self.pty = AsyncPty(self)

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r}, state={self.info.state!r})"

    @property
    def state(self) -> str:
        return self.info.state

    @property
    def isolation(self) -> Isolation | None:
        """The isolation tier it runs in ("container", "gvisor", "vm"; None for a backend
        in no tier, fncall), from its spec: what was asked, else its backend's tier."""
        return isolation_of(self.info.spec)

    async def refresh(self) -> SandboxInfo:
        self.info = await self._c.call(ops.GET, SandboxRef(id=self.id))
        return self.info

    @overload
    async def exec(self, cmd: str | Sequence[str], *, timeout: float | None = 60.0,
                   env: Mapping[str, str] | None = None, cwd: str | None = None,
                   stdin: bytes | str | None = None, user: str | None = None,
                   background: Literal[False] = False, output_cap: int | None = None,
                   on_stdout: OutputCallback | None = None,
                   on_stderr: OutputCallback | None = None) -> ExecResult: ...

    @overload
    async def exec(self, cmd: str | Sequence[str], *, timeout: float | None = 60.0,
                   env: Mapping[str, str] | None = None, cwd: str | None = None,
                   stdin: bytes | str | None = None, user: str | None = None,
                   background: Literal[True], output_cap: int | None = None,
                   on_stdout: OutputCallback | None = None,
                   on_stderr: OutputCallback | None = None) -> AsyncProcessHandle: ...

    @overload
    async def exec(self, cmd: str | Sequence[str], *, timeout: float | None = 60.0,
                   env: Mapping[str, str] | None = None, cwd: str | None = None,
                   stdin: bytes | str | None = None, user: str | None = None,
                   background: bool = False, output_cap: int | None = None,
                   on_stdout: OutputCallback | None = None,
                   on_stderr: OutputCallback | None = None,
                   ) -> ExecResult | AsyncProcessHandle: ...

    async def exec(self, cmd: str | Sequence[str], *, timeout: float | None = 60.0,
                   env: Mapping[str, str] | None = None, cwd: str | None = None,
                   stdin: bytes | str | None = None, user: str | None = None,
                   background: bool = False, output_cap: int | None = None,
                   on_stdout: OutputCallback | None = None,
                   on_stderr: OutputCallback | None = None,
                   ) -> ExecResult | AsyncProcessHandle:
        """Run ``cmd`` (a string runs in a shell, a list is an argv). ``timeout`` is the
        *command* timeout: when it fires the result has ``timed_out=True``.

        ``on_stdout``/``on_stderr``: called with each piece of output as it arrives (the
        command streams, as ``exec_stream``); the result still holds all of it.
        ``background=True``: start it and return a :class:`AsyncProcessHandle` at once
        (``.pid``, ``wait``, ``kill``, output; ``sb.processes.start`` with a command
        timeout); ``stdin`` is then its first input."""
        if background:
            # as before: a background command has no command timeout (processes.start
            # takes one)
            req = _exec_req(cmd, timeout=None, env=env, cwd=cwd, stdin=stdin, user=user,
                            output_cap=output_cap)
            return await start_process(self, req, on_stdout=on_stdout, on_stderr=on_stderr)
        req = _exec_req(cmd, timeout=timeout, env=env, cwd=cwd, stdin=stdin, user=user,
                        output_cap=output_cap)
        if on_stdout is not None or on_stderr is not None:
            return await _streamed_exec(self, req, on_stdout, on_stderr)
        return await self._c.call(ops.EXEC, WireExecCall(id=self.id, req=req),
                                  timeout=_deadline(self._c.timeout, timeout))

    async def exec_stream(self, cmd: str | Sequence[str], *, timeout: float | None = 60.0,
                          env: Mapping[str, str] | None = None, cwd: str | None = None,
                          stdin: bytes | str | None = None
                          ) -> AsyncGenerator[ExecChunk | ExecResult, None]:
        """Yield output chunks as they come, then the final :class:`ExecResult`."""
        req = _exec_req(cmd, timeout=timeout, env=env, cwd=cwd, stdin=stdin)
        t = await self._c._transport()
        stream = t.stream(ops.EXEC_STREAM, WireExecCall(id=self.id, req=req),
                          timeout=_deadline(self._c.timeout, timeout))
        async with closing(stream) as items:
            async for item in items:
                yield item

    async def pause(self) -> PauseStats:
        stats = await self._c.call(ops.PAUSE, SandboxRef(id=self.id))
        self.info.state = "paused"
        return stats

    async def resume(self) -> None:
        self.info = await self._c.call(ops.RESUME, SandboxRef(id=self.id))

    async def snapshot(self, *, strip: Sequence[str] = ()) -> Snapshot:
        """pack_diff what changed since the last snapshot (or since the image) into a new
        snapshot; unchanged -> the previous one (``unchanged=True``). ``strip``: path
        patterns left out for reuse safety (e.g. ``dsec.image.DEFAULT_RESIDUE``)."""
        if isinstance(strip, str):
            raise InvalidArgument("strip must be a list of patterns, not one string",
                                  field="strip")
        return Snapshot(await self._c.call(ops.SNAPSHOT, SnapshotCall(id=self.id,
                                                                      strip=list(strip))))

    async def events(self) -> list[SandboxEvent]:
        return (await self._c.call(ops.EVENTS, SandboxRef(id=self.id))).items

    async def stats(self) -> SandboxStats:
        """Resource use now: memory (and how much of it tmpfs holds), cpu seconds,
        processes, disk use against its cap (``disk_full`` when writes fail)."""
        return await self._c.call(ops.STATS, SandboxRef(id=self.id))

    # issue 19, lifetimes (docs/sdk.md "Lifetimes")
    async def set_timeout(self, seconds: float) -> SandboxInfo:
        """End the sandbox ``seconds`` from now (E2B's ``set_timeout``); paused, its
        clock is stopped and this is what it will have left when it resumes. The answer
        has ``expires_at`` (running) or ``ttl_left_s`` (paused)."""
        return await self._c.call(ops.SET_TIMEOUT, SetTimeout(id=self.id, timeout_s=seconds))

    async def extend(self, seconds: float) -> SandboxInfo:
        """Give the sandbox ``seconds`` more than it has left (from now if it has no
        timeout), in one call on its edge (no read-then-write race)."""
        return await self._c.call(ops.SET_TIMEOUT,
                                  SetTimeout(id=self.id, timeout_s=seconds, extend=True))

    async def run_code(self, code: str, *, timeout: float | None = 60.0) -> Execution:
        """Run Python ``code`` in this sandbox's stateful interpreter (a kernel process
        inside the sandbox, started on first use): ``run_code("x = 41")`` then
        ``run_code("x + 1").text == "42"``. ``timeout``: the code is interrupted after
        this long (``KeyboardInterrupt`` in it; ``timed_out=True``). Needs python3 in the
        image. See :mod:`dsec.client.code`."""
        from dsec.client.code import run_code
        return await run_code(self, code, timeout=timeout)

    async def restart_code(self) -> None:
        """Restart the interpreter of :meth:`run_code`: its variables are gone."""
        from dsec.client.code import restart
        await restart(self)

    async def kill(self) -> None:
        """Destroy the sandbox; killing a gone sandbox is not an error."""
        try:
            await self._c.call(ops.DESTROY, SandboxRef(id=self.id))
        except NotFound:
            pass
        self.info.state = "destroyed"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.kill()


async def _streamed_exec(sb: AsyncSandbox, req: ExecRequest,
                         on_stdout: OutputCallback | None,
                         on_stderr: OutputCallback | None) -> ExecResult:
    """An exec through ``exec_stream``, each chunk handed to its callback as it comes;
    the result carries the whole output, as a plain exec's does (capped alike)."""
    t = await sb._c._transport()
    out, err = bytearray(), bytearray()
    stream = t.stream(ops.EXEC_STREAM, WireExecCall(id=sb.id, req=req),
                      timeout=_deadline(sb._c.timeout, req.timeout_s))
    async with closing(stream) as items:
        async for item in items:
            if isinstance(item, ExecResult):
                return msgspec.structs.replace(item, stdout=bytes(out), stderr=bytes(err))
            if item.stream == "stdout":
                out += item.data
                if on_stdout is not None:
                    on_stdout(item.data)
            else:
                err += item.data
                if on_stderr is not None:
                    on_stderr(item.data)
    raise RemoteProtocolError(f"exec_stream of sandbox {sb.id} ended without a result")


def never_processed(exc: DsecError) -> bool:
    """Whether a failed call provably never reached the server's handler, so repeating
    even a non-idempotent one (exec) cannot run it twice: the connection could not be
    opened (:class:`ConnectFailed`: nothing was sent), a listener refused it at a limit
    before reading it (:class:`Overloaded`), or the peer said it did not process it (an
    Aether GOAWAY: ``retryable``). A connection that dropped with the request written on
    it (a plain :class:`ConnectionLost`) proves nothing: the server may have read and run
    it, so that is raised to the caller, who checks before running the command again."""
    return (isinstance(exc, (ConnectFailed, Overloaded))
            or (isinstance(exc, ConnectionLost) and exc.detail.get("retryable") is True))
