"""The transport-agnostic core of the apiserver: who may do what, and where to forward it.

Both front doors — REST (:mod:`dsec.control.apiserver`) and the Aether gateway
(:mod:`dsec.control.gateway`) — decode their wire format into the request object of an
operation of the catalogue (:mod:`dsec.wire.ops`) and call that operation's policy,
:meth:`ApiService.handler`; it authenticates, authorizes, rate-limits, and forwards every
sandbox operation over Aether to the edge encoded in the sandbox id. It keeps no per-sandbox state: the only
per-sandbox memory is :class:`_ProjectCache`, a bounded cache of the immutable fact
"sandbox X belongs to project P" that any replica rebuilds with one edge ``get``.

Access rule: a principal that holds no role on a sandbox's project gets
``SandboxNotFound`` exactly as for an id that never existed, so ids never leak across
projects. A principal that can see the sandbox but lacks the role for the operation
(a reader trying exec) gets ``PermissionDenied``.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import functools
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast, get_args

import msgspec

from dsec.aether.connection import DuplexStream
from dsec.control.audit import AUDITED, audited
from dsec.control.idempotency import (
    Claim,
    ClaimLost,
    IdempotencyCache,
    Retry,
    request_fingerprint,
)
from dsec.control.metrics import ApiMetrics
from dsec.control.ratelimit import RateLimiter
from dsec.control.replybudget import ReplyGate, ReplyLease, keep_or_release, tenant_of
from dsec.control.sweeper import SESSION_LABEL
from dsec.edge.client import EdgeClient
from dsec.errors import (
    CapacityExceeded,
    Conflict,
    ConnectFailed,
    DsecError,
    EdgeUnreachable,
    ImageNotFound,
    InternalError,
    InUse,
    InvalidArgument,
    InvalidTransition,
    NoCapacity,
    NotFound,
    PermissionDenied,
    ProtocolError,
    QuotaExceeded,
    RateLimited,
    RemoteProtocolError,
    RequestTimeout,
    SandboxLost,
    SandboxNotFound,
    TransportError,
    Unauthenticated,
    Unavailable,
    error_from_wire,
)
from dsec.ids import NodeId, node_of, parse_project_path, parse_sandbox_id
from dsec.image.catalog import image_not_found
from dsec.net.expose import TOKEN_PARAM, TokenKey, proxy_path
from dsec.wire import ops
from dsec.wire.api import (
    GATEWAY_PROTOCOL,
    ROLE_RANK,
    CreateKeyRequest,
    CreateKeyResponse,
    CreateSandboxRequest,
    EventList,
    ImageList,
    ImagePinList,
    ImagePinView,
    ImagePromoteRequest,
    ImagePruned,
    ImagePullRequest,
    ImagePushed,
    ImagePushRequest,
    ImageTagRequest,
    ImageView,
    Info,
    KeyList,
    NodeList,
    NodeView,
    ProjectList,
    ProjectView,
    QuotaBody,
    Role,
    SandboxList,
    SessionView,
    SnapshotList,
    SnapshotView,
    role_on,
)
from dsec.wire.calls import (
    CreateMany,
    CreateSandbox,
    Empty,
    ExecCall,
    ExecMany,
    ImagePrune,
    ImageRef,
    ImageUpload,
    KeyQuery,
    KeyRef,
    ListSandboxes,
    NetworkUpdate,
    NetworkUpdateOnNode,
    NodeRef,
    ProjectRef,
    QuotaSet,
    ReadFile,
    ResumeReason,
    SandboxRef,
    SessionOpen,
    SessionRef,
    SnapshotCall,
    SnapshotQuery,
    SnapshotRef,
    WriteFile,
    create_of,
    rest_form,
)
from dsec.wire.cluster import (
    JoinedNode,
    JoinedNodeList,
    JoinTokenCreate,
    JoinTokenList,
    JoinTokenRevoke,
    JoinTokenView,
    NodeMigration,
)
from dsec.wire.files import FileEvent, ReadStream, Watch, WatchEnd, WriteStream
from dsec.wire.layers import ImagePin, ImagePinRef, LayerFetch, LayerFetched, NodePins
from dsec.wire.netpolicy import NetworkPolicy, ceiling_deny, check_within
from dsec.wire.ops import USE_CLIENT_DEFAULT, Deadline, Op, StreamOp, TunnelOp, UploadOp
from dsec.wire.outcome import Batch
from dsec.wire.ports import (
    MAX_TOKEN_TTL_S,
    ExposedPort,
    ExposedPortList,
    PortConnect,
    PortExpose,
    PortRecord,
)
from dsec.wire.process import ProcessRef, ProcessRunItem
from dsec.wire.spec import (
    FILE_CHUNK_BYTES,
    MAX_FILE_READ_BYTES,
    BackendName,
    ExecChunk,
    ExecRequest,
    ExecResult,
    FileInfo,
    NetworkView,
    PauseStats,
    SandboxEvent,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    SnapshotInfo,
    check_path,
    check_snapshot_ref,
    project_of,
    read_in_chunks,
    resolve,
    stored,
)

__all__ = [
    "AdminOps",
    "ApiConfig",
    "ApiService",
    "Authority",
    "Caller",
    "EdgeOps",
    "ImageResolver",
    "NamesOnly",
    "NodeDirectory",
    "Placer",
    "Policy",
    "api_key_of",
    "snapshot_view",
]

log = logging.getLogger("dsec.apiserver")

T = TypeVar("T")
Req = TypeVar("Req")
Rep = TypeVar("Rep")
Item = TypeVar("Item")

# --------------------------------------------------------------------------- seams
@dataclass(slots=True, frozen=True)
class Caller:
    """Who is calling: ``roles`` maps a project path to the role held on that subtree."""

    id: str
    name: str
    roles: Mapping[str, Role]
    superuser: bool = False
    default_project: str = "default"

    def role_on(self, project: str) -> Role | None:
        """The strongest role on ``project`` or any ancestor (roles inherit downward)."""
        return role_on(self.roles, project, superuser=self.superuser)


class Authority(Protocol):
    """Turns an API key into a principal (IAM). Raises ``Unauthenticated``."""

    def authenticate(self, api_key: str) -> Caller: ...


# The apiserver talks to edges through the edge team's typed Aether client.
EdgeOps = EdgeClient


class Lost(Protocol):
    """A sandbox written off with its lost node (see ``ControlPlane.lost``)."""

    @property
    def info(self) -> SandboxInfo: ...
    @property
    def events(self) -> list[SandboxEvent]: ...


class NodeDirectory(Protocol):
    """Which edges exist, how to reach them, and what they last reported; the registry
    of live sandboxes (``list_sandboxes``) and the sandboxes evicted with a lost node."""

    def edge(self, node: NodeId) -> EdgeOps | None: ...
    def nodes(self) -> list[NodeView]: ...
    def list_sandboxes(self, caller: Caller, *, project: str | None,
                       labels: Mapping[str, str], state: SandboxState | None, after: str,
                       limit: int, node: str | None = None, isolation: str | None = None,
                       ) -> tuple[list[SandboxInfo], bool]: ...
    def lost(self, sandbox_id: str) -> Lost | None: ...
    def vanished(self, sandbox_id: str) -> Lost | None:
        """The sandbox's edge answered that it does not know ``sandbox_id``. If the
        control plane had recorded it as live, the node lost it (restarted without it):
        write it off like a sandbox of a lost node and return its tombstone; else None."""
        ...
    def abandon_intent(self, sandbox_id: str, spec: SandboxSpec) -> bool:
        """A keyed create's noted sandbox whose node is lost: written off (destroyed
        wherever it shows up) and True (place the create anew); False while the node is
        not lost (see ``ControlPlane.abandon_intent``)."""
        ...


class Placer(Protocol):
    """Control-plane placement: a decision (with ``.node``) for ``spec`` avoiding
    ``exclude``; then ``accepted`` or ``refused`` by the edge. Raises ``NoCapacity``."""

    def place(self, spec: SandboxSpec, exclude: frozenset[str]) -> Any: ...
    def accepted(self, decision: Any) -> None: ...
    def refused(self, decision: Any) -> None: ...


class ImageResolver(Protocol):
    """What a create's image refs name for this caller (``ControlPlane.resolve_layers``):
    ``spec`` with ``image``/``workspace``/``toolkits`` replaced by what the edge should
    resolve (full digests of layers the caller may see). Raises ``ImageNotFound`` for a
    ref naming nothing the caller may see, worded exactly as for one naming nothing."""

    def resolve_layers(self, caller: Caller, spec: SandboxSpec) -> SandboxSpec: ...

    async def pull_on_create(self, caller: Caller, spec: SandboxSpec) -> SandboxSpec:
        """``spec`` with a registry ``image`` ref pulled on first use (when the project
        allows it) and replaced by the store name it was pulled as."""
        ...


class NamesOnly:
    """The :class:`ImageResolver` of an apiserver without a layer store: bare names go
    on to the edge (which has only cluster-wide names under bare keys, or resolves names
    its own way); a digest or a project name cannot be checked, so it is refused."""

    def resolve_layers(self, caller: Caller, spec: SandboxSpec) -> SandboxSpec:
        for ref in (spec.image, spec.workspace, *spec.toolkits):
            if ref and (ref.startswith("sha256:") or "/" in ref) and spec.snapshot is None:
                raise image_not_found(ref)
        return spec

    async def pull_on_create(self, caller: Caller, spec: SandboxSpec) -> SandboxSpec:
        return spec   # without a layer store there is nowhere to pull into


class QuotaGate(Protocol):
    """Control-plane quotas and the registry of what exists.

    ``admit`` checks the project's quota chain (raising ``QuotaExceeded``) and holds a
    provisional charge, returned as a token; ``commit`` turns it into the real record once
    the edge created the sandbox, ``abort`` drops it. ``forget`` records a destroy,
    ``paused`` a pause (True) or resume (False)."""

    def network_ceilings(self, project: str) -> Sequence[tuple[str, NetworkPolicy]]:
        """The network ceilings binding ``project``: its own and every ancestor's."""
        ...
    def qos_ls(self, project: str) -> tuple[bool, str | None]:
        """May ``project``'s sandboxes be qos "ls", and whose quota said so."""
        ...
    def admit(self, project: str, spec: SandboxSpec) -> object: ...
    def commit(self, token: object, info: SandboxInfo) -> None: ...
    def abort(self, token: object) -> None: ...
    def forget(self, sandbox_id: str, reason: str) -> None: ...
    def paused(self, sandbox_id: str, paused: bool) -> None: ...
    def admit_resume(self, sandbox_id: str) -> object | None:
        """Check and hold a paused sandbox's resume charge (``QuotaExceeded``); None
        when it is not known paused. Settled by ``resumed`` or ``abort_resume``."""
        ...
    def resumed(self, token: object) -> None: ...
    def abort_resume(self, token: object) -> None: ...
    def snapshot_room(self, project: str) -> int | None: ...
    def check_snapshot(self, project: str, size_bytes: int) -> None: ...
    def charge_snapshot(self, snapshot_id: str, project: str, node: str,
                        size_bytes: int, *, kind: str | None = None,
                        parent: str | None = None, stack: tuple[str, ...] = ()) -> None: ...
    def release_snapshot(self, snapshot_id: str) -> None: ...
    async def durable(self) -> None:
        """Return once what was recorded before the call is in the store (an answered
        create must survive a kill -9 of this apiserver the next instant)."""
        ...


class AdminOps(Protocol):
    """Projects, quotas, keys, sessions and images: the control plane's administration
    (:class:`~dsec.control.api.plane.ControlPlane`), which :meth:`ApiService.handler`
    hands those operations to. A Protocol, so the plane satisfies it structurally."""

    def list_projects(self, caller: Caller) -> ProjectList: raise NotImplementedError
    def get_project(self, caller: Caller, path: str) -> ProjectView: raise NotImplementedError
    def set_quota(self, caller: Caller, path: str, q: QuotaBody) -> ProjectView:
        raise NotImplementedError
    def create_key(self, caller: Caller, req: CreateKeyRequest) -> CreateKeyResponse:
        raise NotImplementedError
    def revoke_key(self, caller: Caller, key_id: str) -> None: raise NotImplementedError
    def list_keys(self, caller: Caller, principal: str | None) -> KeyList:
        raise NotImplementedError
    def open_session(self, caller: Caller, lease_s: float) -> SessionView:
        raise NotImplementedError
    def renew_session(self, caller: Caller, sid: str) -> SessionView: raise NotImplementedError
    def close_session(self, caller: Caller, sid: str) -> None: raise NotImplementedError
    def check_session(self, caller: Caller, sid: str) -> None: raise NotImplementedError
    def list_images(self, caller: Caller) -> ImageList: raise NotImplementedError
    def get_image(self, caller: Caller, ref: str) -> ImageView: raise NotImplementedError
    def delete_image(self, caller: Caller, ref: str) -> None: raise NotImplementedError
    def tag_image(self, caller: Caller, req: ImageTagRequest) -> ImageView:
        raise NotImplementedError
    async def promote_image(self, caller: Caller, req: ImagePromoteRequest) -> ImageView:
        raise NotImplementedError
    async def build_image(self, caller: Caller, tar_path: str, *, name: str, kind: str,
                          tag: str, oci: bool) -> ImageList:
        raise NotImplementedError
    async def prune_images(self, caller: Caller, *, dry_run: bool) -> ImagePruned:
        raise NotImplementedError
    async def pull_image(self, caller: Caller, req: ImagePullRequest) -> ImageList:
        raise NotImplementedError
    async def push_image(self, caller: Caller, req: ImagePushRequest) -> ImagePushed:
        raise NotImplementedError
    async def pin_image(self, caller: Caller, req: ImagePin) -> ImagePinView:
        raise NotImplementedError
    async def unpin_image(self, caller: Caller, req: ImagePinRef) -> None:
        raise NotImplementedError
    def list_pins(self, caller: Caller, req: NodePins) -> ImagePinList:
        raise NotImplementedError
    def drain_node(self, caller: Caller, node: str, *, drained: bool) -> NodeView:
        raise NotImplementedError
    async def fetch_layer(self, caller: Caller, req: LayerFetch) -> LayerFetched:
        raise NotImplementedError
    async def migrate_node(self, caller: Caller, node: str, service: Any) -> NodeMigration:
        raise NotImplementedError


class JoinAdmin(Protocol):
    """Join tokens and joined nodes (:class:`dsec.cluster.join.JoinAuthority`), behind
    the catalogue's ``cluster_*`` rows."""

    def create_token(self, *, ttl_s: float = ..., uses: int = ...,
                     description: str = ...) -> tuple[Any, Any]: ...
    def list_tokens(self) -> list[Any]: ...
    def revoke_token(self, token_id: str, *, nodes: bool = False) -> list[str]: ...
    def list_nodes(self) -> list[Any]: ...
    def revoke_node(self, node_id: str) -> None: ...


#: What a door calls for one operation: the policy of :meth:`ApiService.handler`.
Policy = Callable[[Caller, Any], Awaitable[Any]]


# ---------------------------------------------------------------------- the core
@dataclass(slots=True, frozen=True, kw_only=True)
class ApiConfig:
    """Policy knobs of the apiserver (units in names)."""

    default_ttl_s: float | None = 6 * 3600.0   # a sandbox created without ttl dies after 6 h
    default_backend: str = "simulated"         # used when a create names no backend
    max_create_batch: int = 1024               # create_many / gateway batch cap
    max_exec_batch: int = 1024                 # exec_many: the same cap (was none)
    placement_retries: int = 3                 # re-picks after an edge refuses (CapacityExceeded)
    project_cache_entries: int = 200_000       # sandbox -> project cache (~100 B each)
    principal_cache_s: float = 5.0             # how long an authenticated key is trusted
    principal_cache_entries: int = 10_000
    snapshot_cache_entries: int = 10_000       # snapshot ref -> (id, project) for creates
    # Host paths (the state dir) never shown to API clients: error messages from deeper
    # layers (image store, backends) name files under them; see ApiService.redact.
    redact_paths: tuple[str, ...] = ()
    list_page_max: int = 1000
    # Per-sandbox pids ceiling: a create may ask for up to this many, never for none
    # ("pids_max": null), so one fork bomb cannot take every pid of its node
    # (kernel.pid_max is 32768 on a default kernel). None lets clients opt out.
    pids_max_ceiling: int | None = 16_384
    # A create that took over a dead apiserver's idempotency claim waits this long for
    # the sandbox that one was creating to leave `creating` before giving up on it.
    recover_wait_s: float = 30.0
    # The server version every door reports (/v1/info, api.info, the OpenAPI document).
    version: str = "0.1.0"
    # Exposed ports: the key of URL tokens (None: random per process, so tokens work on
    # this apiserver only; replicas behind one address need the same key) and the
    # apiserver's public base URL put in front of /v1/proxy/... ("": relative URLs,
    # which the SDK completes with its own base URL).
    port_token_key: bytes | None = None
    public_url: str = ""
    # The egress policy of a create that names none (``dsec up|apiserver --net-default``):
    # "none", loopback only, unless the operator opens it. A project's ceiling still binds.
    net_default: NetworkPolicy = field(default_factory=NetworkPolicy)
    # Bytes of large unary replies (exec output, list_dir, events) one tenant (top-level
    # project) holds in this apiserver at once, from the edge's answer until its client
    # has read it (dsec.control.replybudget); None: no budget. Calls reserve their reply's
    # worst case (an exec: 2 x min(output_cap_bytes, reply_output_bytes) + 4 KiB), so
    # this bounds what a tenant's unread replies hold. 4 GiB: 2,044 unary execs of one
    # tenant in flight at the default 1 MiB cap (16,131 at a 128 KiB cap); the bytes are
    # reserved, not allocated, so an apiserver with many tenants is not sized for all
    # of them at once (docs/api.md).
    reply_budget_bytes: int | None = 4 << 30
    # How long a call waits for room in its tenant's budget before RateLimited.
    reply_budget_wait_s: float = 30.0
    # What a list_dir, process_list or events call reserves before its reply arrives
    # (then its size): their replies have no cap of their own but the edge link's frame
    # size (dsec.aether DEFAULT_MAX_FRAME, 16 MiB), so that is their worst case: 256 of
    # them of one tenant in flight at the default budget. (1 MiB, an estimate, let each
    # hold 16x what it reserved: red team 21, B3.)
    reply_reserve_bytes: int = 16 << 20
    reply_output_bytes: int = 4 << 20


class _ProjectCache:
    """Bounded LRU of sandbox id -> project. Immutable facts only, so it never goes stale."""

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._d: OrderedDict[str, str] = OrderedDict()

    def get(self, sid: str) -> str | None:
        p = self._d.get(sid)
        if p is not None:
            self._d.move_to_end(sid)
        return p

    def put(self, sid: str, project: str) -> None:
        self._d[sid] = project
        if len(self._d) > self._cap:
            self._d.popitem(last=False)

    def drop(self, sid: str) -> None:
        self._d.pop(sid, None)


_msgpack = msgspec.msgpack.Encoder()
# How often one create asks its key again after losing its claim to another apiserver.
_RETAKES = 3
# read_file pieces (up to 16 MiB each) of one top-level project in flight at once through
# this apiserver, per node; the next wait their turn. A node's edge parks finished
# replies behind the link's write buffer (it never cuts the shared link for them), so
# this is what bounds the reply bytes one tenant keeps on a node at once (4 x 16 MiB),
# and other tenants' reads interleave with a reader that asks for 300 at once
# (redteam-19 A1: 24 concurrent 8 MiB reads made the edge close the apiserver's link).
READS_PER_TENANT = 4


@dataclass(slots=True)
class _Gate:
    """One tenant's read_file pieces on one node: the semaphore, and how many calls hold
    or wait for it (the entry goes when that is 0)."""

    sem: asyncio.Semaphore
    users: int = 0
_info_dec = msgspec.msgpack.Decoder(SandboxInfo)


@dataclass(slots=True)
class ApiService:
    """See the module docstring. One per apiserver process; shared by REST and gateway."""

    authority: Authority
    directory: NodeDirectory
    placer: Placer
    quotas: QuotaGate | None
    limiter: RateLimiter
    idempotency: IdempotencyCache
    metrics: ApiMetrics
    config: ApiConfig = field(default_factory=ApiConfig)
    clock: Callable[[], float] = time.monotonic
    project_defaults: Callable[[str], float | None] = lambda project: None
    anon_limiter: RateLimiter | None = None     # per client address, failed auth only
    images: ImageResolver = field(default_factory=NamesOnly)
    wall: Callable[[], float] = time.time      # wall clock: URL token expiry
    # The Aether gateway's address, advertised by ``info`` at every door (set once the
    # gateway listens; None: no gateway, the SDK uses REST).
    gateway_address: str | None = None
    # Projects, quotas, keys, sessions, images (the control plane); None: those
    # operations answer Unavailable (an apiserver wired without them, as in some tests).
    admin: AdminOps | None = None
    # Join tokens and joined nodes (dsec.cluster.join.JoinAuthority); None: this
    # apiserver has no cluster CA, the cluster_* operations answer Conflict.
    joins: JoinAdmin | None = None
    # issue 19: the audit log of admin actions (dsec.logs.AuditLog; None: not kept)
    audit: Any = None
    _policies: dict[str, Policy] = field(init=False)
    _projects: _ProjectCache = field(init=False)
    _principals: OrderedDict[str, tuple[float, Caller]] = field(init=False)
    _snapshots: OrderedDict[str, tuple[str, str]] = field(init=False)  # ref -> (id, project)
    _keyed: set[asyncio.Future[SandboxInfo | None]] = field(init=False)  # claims at work
    port_tokens: TokenKey = field(init=False)
    # (node, top-level project) -> its read_file pieces in flight (READS_PER_TENANT)
    _reads: dict[tuple[str, str], _Gate] = field(init=False)
    # Per-tenant bytes of large unary replies held until written (ApiConfig.reply_budget_*)
    replies: ReplyGate = field(init=False)

    def __post_init__(self) -> None:
        self._keyed = set()
        self._reads = {}
        self.replies = ReplyGate(self.config.reply_budget_bytes,
                                 wait_s=self.config.reply_budget_wait_s,
                                 on_refused=self.metrics.reply_budget_refused.inc)
        self.metrics.reply_budget_bytes.set_function(lambda: self.replies.budget.total())
        self._projects = _ProjectCache(self.config.project_cache_entries)
        self._principals = OrderedDict()
        self._snapshots = OrderedDict()
        self.port_tokens = TokenKey(self.config.port_token_key or secrets.token_bytes(32))
        self._policies = {name: audited(name, p, lambda: self.audit) if name in AUDITED
                          else p for name, p in self._policy_table().items()}

    async def close(self) -> None:
        """Stop keyed creates still at work (their claims are released, with the sandbox
        id they noted, for whoever retries next: another apiserver, or this one again)."""
        work = list(self._keyed)
        for w in work:
            w.cancel()
        await asyncio.gather(*work, return_exceptions=True)

    # ------------------------------------------------------------ auth / limits
    def authenticate(self, authorization: str | None, client: str | None = None) -> Caller:
        """From an ``Authorization: Bearer <key>`` header (or a bare key) to a principal,
        charging one token of the key's rate limit.

        ``client`` (the peer address; None where the transport gives none) is charged a
        token of ``anon_limiter`` for every request that fails to authenticate, and once
        its bucket is empty a key not already known good (in the principal cache, even
        if that entry is due for re-checking) is refused with ``429`` *before* it is
        checked: a flood of guessed keys costs the store nothing and learns nothing,
        while callers with working keys behind the same address carry on."""
        now = self.clock()
        key = ""
        hit: tuple[float, Caller] | None = None
        try:
            key = api_key_of(authorization)
            hit = self._principals.get(key)
            if hit is not None and hit[0] > now:
                principal = hit[1]
            else:
                if hit is None and client is not None:
                    self.check_anonymous(client, charge=False)
                principal = self.authority.authenticate(key)
                self._principals[key] = (now + self.config.principal_cache_s, principal)
                self._principals.move_to_end(key)
                while len(self._principals) > self.config.principal_cache_entries:
                    self._principals.popitem(last=False)
        except Unauthenticated:
            if hit is not None:
                self._principals.pop(key, None)   # revoked meanwhile
            if client is not None:
                self.check_anonymous(client, charge=True)
            raise
        wait = self.limiter.acquire(principal.id)
        if wait is not None:
            self.metrics.rate_limited.inc()
            raise RateLimited(
                f"rate limit of {self.limiter.config.rate_per_s:g} requests/s for principal "
                f"{principal.name!r} exceeded; retry after {wait:.2f}s",
                retry_after=wait)
        return principal

    def charge_batch(self, principal: Caller, n: int, field: str) -> None:
        """A batch of ``n`` items costs ``n`` tokens of the principal's rate limit, like
        ``n`` requests (:meth:`authenticate` took the first): one request of 5,000 execs
        used to cost one token. A batch costing more than the bucket holds could never
        run: it is refused naming the largest that can (split it)."""
        extra = n - 1
        if extra <= 0 or self.limiter.config.rate_per_s is None:
            return
        burst = self.limiter.config.burst
        if n > burst:
            raise InvalidArgument(
                f"a batch of {n} {field} costs {n} requests of the rate limit of principal "
                f"{principal.name!r}, whose burst is {burst:g}: split it into batches of at "
                f"most {int(burst)}", field=field, size=n, limit=int(burst))
        wait = self.limiter.acquire(principal.id, float(extra))
        if wait is not None:
            self.metrics.rate_limited.inc()
            raise RateLimited(
                f"rate limit of {self.limiter.config.rate_per_s:g} requests/s for principal "
                f"{principal.name!r} exceeded by a batch of {n} {field} (each item counts "
                f"as a request); retry after {wait:.2f}s", retry_after=wait)

    def check_anonymous(self, client: str, *, charge: bool) -> None:
        """Charge (or, without ``charge``, only test) ``client``'s budget for requests
        that fail to authenticate; ``RateLimited`` when it is spent."""
        lim = self.anon_limiter
        if lim is None:
            return
        wait = lim.acquire(client) if charge else lim.peek(client)
        if wait is not None:
            self.metrics.rate_limited.inc()
            raise RateLimited(
                f"too many requests without a valid API key from {client[:64]} (limit "
                f"{lim.config.rate_per_s:g}/s); retry after {wait:.2f}s with a valid key",
                retry_after=wait)

    def forget_key(self, key_id: str) -> None:
        """A key was revoked: drop its cached authentication so it stops working on this
        replica at once (other replicas re-check within ``principal_cache_s``)."""
        prefix = f"dsk_{key_id}_"
        for k in [k for k in self._principals if k.startswith(prefix)]:
            del self._principals[k]

    def forget_principal(self, principal_id: str) -> None:
        """A principal's roles changed: re-read them on its next request."""
        for k in [k for k, (_, c) in self._principals.items() if c.id == principal_id]:
            del self._principals[k]

    def redact(self, exc: DsecError) -> DsecError:
        """``exc`` as API clients may see it: every ``config.redact_paths`` prefix in its
        message and string details replaced by ``<state-dir>`` (a copy of the same class;
        ``exc`` itself when nothing needed replacing). A ``TransportError`` here is the
        failure of one of the apiserver's own links inside the cluster (the caller's
        connection is the one carrying this answer): it goes out as ``Unavailable``
        (503, retry), never as the caller's ``ConnectionLost``/``ConnectFailed``, which
        would tell the caller *its* connection broke. The operations map their own link
        errors more precisely (``EdgeUnreachable``); this is the net under all of them."""
        if isinstance(exc, TransportError):
            exc = Unavailable(
                f"the apiserver could not finish the request: one of its links inside the "
                f"cluster failed ({exc.code}: {exc.message}); retry in a few seconds",
                cause=exc.code)
        paths = self.config.redact_paths
        if not paths:
            return exc

        def scrub(text: str) -> str:
            for p in paths:
                if p in text:
                    text = text.replace(p, "<state-dir>")
            return text
        msg = scrub(exc.message)
        detail = {k: scrub(v) if isinstance(v, str) else v for k, v in exc.detail.items()}
        if msg == exc.message and detail == exc.detail:
            return exc
        return error_from_wire(exc.code, msg, detail)

    @staticmethod
    def require(principal: Caller, project: str, need: Role) -> None:
        have = principal.role_on(project)
        if have is None or ROLE_RANK[have] < ROLE_RANK[need]:
            raise PermissionDenied(
                f"principal {principal.name!r} needs role {need!r} on project {project!r} "
                f"(has {have or 'none'}); ask an admin of the project for a role binding")

    async def _edge_for(self, principal: Caller, sid: str, need: Role, *,
                        wake: bool = False) -> tuple[EdgeOps, str]:
        """Route ``sid`` to its edge after checking ``principal`` may ``need`` it.
        ``wake``: the operation needs it running (the edge would resume a paused sandbox
        for it): resume it first here, within its project's quota (red team 19, B3)."""
        edge, lost, project = await self._route(principal, sid, need)
        if lost is not None:
            raise _lost_error(lost)
        if wake:
            await self._resume_admitted(edge, sid)
        return edge, project

    def _vanished(self, sid: str) -> Lost | None:
        fn = getattr(self.directory, "vanished", None)
        return None if fn is None else fn(sid)

    def _healthy(self, node: str) -> bool:
        return any(n.id == node and n.healthy for n in self.directory.nodes())

    async def _via(self, edge: EdgeOps, sid: str, op: str,
                   call: Callable[[], Awaitable[T]], *, effect: bool = False) -> T:
        """Run one edge call for sandbox ``sid`` and turn what went wrong on the way into
        the caller's terms: the edge no longer knowing a sandbox the control plane
        recorded is :class:`SandboxLost` (written off with its node), and a failure of
        the apiserver's own link to the edge is :class:`EdgeUnreachable` (503, retry),
        never the caller's ``ConnectionLost``. ``effect``: the operation changes the
        sandbox (exec, write...), so the error says whether it may have happened."""
        sent = not getattr(getattr(edge, "conn", None), "closed", False)
        try:
            return await call()
        except SandboxNotFound:
            lost = self._vanished(sid)
            if lost is not None:
                raise _lost_error(lost) from None
            raise _not_found(sid) from None
        except _LINK_ERRORS as exc:
            raise _unreachable(node_of(sid), op, sid, exc, effect=effect, sent=sent) from exc

    async def _route(self, principal: Caller, sid: str,
                     need: Role) -> tuple[EdgeOps, Lost | None, str]:
        """The edge of ``sid`` (or its tombstone, if it was evicted with a lost node)
        after the access check. On the hot path (GET one sandbox) this is one id parse
        and three dict lookups; the node is the id's tail (``sb-<12 hex>-<node>``)."""
        try:
            parse_sandbox_id(sid)
        except InvalidArgument:
            raise _not_found(sid) from None
        edge = self.directory.edge(NodeId(sid[16:]))
        if edge is None:
            raise _not_found(sid)
        lost = self.directory.lost(sid)
        if lost is not None:
            self._check_lost(principal, lost, need)
            return edge, lost, project_of(lost.info.spec)
        project = self._projects.get(sid)
        if project is None:
            # the control plane's own record first: an edge's answer names a project
            # only for a sandbox the control plane has no record of (red team 16, F10)
            recorded = getattr(self.directory, "recorded_project", None)
            project = None if recorded is None else recorded(sid)
            if project is not None:
                self._projects.put(sid, project)
        if project is None:
            try:
                info = await self._via(edge, sid, "get", lambda: edge.get(sid))
            except SandboxLost:
                lost = self.directory.lost(sid)
                if lost is None:
                    raise
                self._check_lost(principal, lost, need)
                return edge, lost, project_of(lost.info.spec)
            project = project_of(info.spec)
            self._projects.put(sid, project)
        if not principal.superuser:
            if principal.role_on(project) is None:
                raise _not_found(sid)
            self.require(principal, project, need)
        return edge, None, project

    def _check_lost(self, principal: Caller, lost: Lost, need: Role) -> None:
        """The access rule for a tombstone: same answers as for a live sandbox."""
        project = project_of(lost.info.spec)
        if principal.role_on(project) is None:
            raise _not_found(lost.info.id)
        self.require(principal, project, need)

    def _lost(self, principal: Caller, sid: str, need: Role) -> Lost | None:
        lost = self.directory.lost(sid)
        if lost is not None:
            self._check_lost(principal, lost, need)
        return lost

    # ---------------------------------------------------------------- create
    def build_spec(self, principal: Caller,
                   req: CreateSandbox | CreateSandboxRequest) -> SandboxSpec:
        """The caller's spec resolved by this apiserver's policy (:func:`resolve`): what
        it leaves unset is the server's (the key's default project, the default backend,
        the project's or the server's default TTL); every other field is the caller's,
        unchanged. The session lease rides along as a label."""
        req = create_of(req)
        asked = req.spec
        project = principal.default_project if asked.project is None else asked.project
        parse_project_path(project)
        self.require(principal, project, "member")
        ttl = asked.ttl_s
        if ttl is None:
            ttl = self.project_defaults(project)
            if ttl is None:
                ttl = self.config.default_ttl_s
        spec = resolve(asked, backend=_backend_name(self.config.default_backend),
                       project=project, ttl_s=ttl, network=self.config.net_default)
        # A sandbox is bound to a session (swept with it) by its session label: the
        # request's session, or the label given by hand; either must be a live session
        # of the caller's principal (another's would decide when this sandbox dies).
        labelled = asked.labels.get(SESSION_LABEL)
        if self.admin is not None:   # without a control plane no session exists
            for sid in {s for s in (req.session, labelled) if s is not None}:
                self.admin.check_session(principal, sid)
        if req.session is not None:
            spec = msgspec.structs.replace(
                spec, labels={**spec.labels, SESSION_LABEL: req.session})
        # the spec's own limits first (the type's words, as the gateway's decode gives
        # them), then this apiserver's tighter pids cap, then the project's network ceiling
        spec = spec.validate()
        cap = self.config.pids_max_ceiling
        if cap is not None and (spec.pids_max is None or spec.pids_max > cap):
            raise InvalidArgument(
                f"pids_max={spec.pids_max if spec.pids_max is not None else 'null'} is "
                f"refused: this apiserver caps processes per sandbox at {cap} (a fork-bomb "
                f"guard for the node); ask for 1..{cap}", field="pids_max", limit=cap)
        assert spec.network is not None
        check_within(spec.network, self.network_ceilings(project))
        return self._resolve_qos(spec, project)

    def _resolve_qos(self, spec: SandboxSpec, project: str) -> SandboxSpec:
        """The QoS class by the project's ``qos_ls`` (issue 22): unset -> "ls" where the
        project allows it, else "be"; "ls" asked where it does not -> refused. Every door
        that creates (REST, the gateway, the SDK, create_many) builds its spec here."""
        allowed, said_by = (True, None) if self.quotas is None else self.quotas.qos_ls(project)
        if spec.qos is None:
            return msgspec.structs.replace(spec, qos="ls" if allowed else "be")
        if spec.qos == "ls" and not allowed:
            raise PermissionDenied(
                f"qos='ls' is refused for project {project!r}: its quota (set on project "
                f"{said_by!r}) says qos_ls=false, so its sandboxes run best-effort; ask "
                "for qos='be' (or leave qos unset), or ask an admin of the parent project "
                "to set qos_ls", field="qos")
        return spec

    def network_ceilings(self, project: str) -> Sequence[tuple[str, NetworkPolicy]]:
        """The network ceilings binding ``project`` (none without a control plane)."""
        return () if self.quotas is None else self.quotas.network_ceilings(project)

    async def create(
        self, principal: Caller, req: CreateSandbox | CreateSandboxRequest, *,
        idempotency_key: str | None = None, raw: bytes = b"",
    ) -> SandboxInfo:
        """Create the sandbox ``req`` asks for. ``req``: the catalogue's request (the
        gateway, the SDK) or REST's flat body, one request whichever (:func:`create_of`);
        ``idempotency_key``: REST's header (the catalogue's request carries its own)."""
        req = create_of(req, idempotency_key=idempotency_key)
        idempotency_key = req.idempotency_key
        spec = self.build_spec(principal, req)
        if spec.snapshot is not None:
            # Only a caller that may read the snapshot's project may boot it (its files
            # are that project's data); the edge would start from any id it holds.
            snap_id = await self._visible_snapshot(principal, spec.snapshot)
            if snap_id != spec.snapshot:
                spec = msgspec.structs.replace(spec, snapshot=snap_id)
        # A registry image is pulled on first use (when the project allows it), then
        # image refs resolve among the layers this caller may see; the edge gets digests.
        spec = await self.images.pull_on_create(principal, spec)
        spec = self.images.resolve_layers(principal, spec)
        if idempotency_key is None:
            # Shielded like a keyed create's work: a caller that goes away (an HTTP client
            # killed, a gateway handler cancelled) after the edge was asked must not cut
            # the create between the edge's "created" and its record; cancelled there, the
            # sandbox lived on the edge with no record (quarantined, never charged).
            work = asyncio.ensure_future(self._create_unkeyed(spec))
            self._keyed.add(work)
            work.add_done_callback(_settle_keyed(self._keyed))
            info = await asyncio.shield(work)
            assert info is not None
            return info
        scoped = IdempotencyCache.scoped(principal.id, idempotency_key)
        # Of the decoded request, not of its bytes (``raw`` is unused): one request is
        # one key whichever door and encoding it came through.
        fp = request_fingerprint(rest_form(req))
        for _ in range(_RETAKES):
            keyed = await self._create_keyed(spec, scoped, fp)
            if keyed is not None:
                await self._durable()
                return keyed
            # Our claim was taken over while we worked (this apiserver stalled past its
            # lease): the new owner answers for the key. Ask the key again: its answer
            # is (or will be) there, so the caller gets that sandbox, not an error about
            # ids it never saw, and no second sandbox.
        raise ClaimLost(
            f"the Idempotency-Key was taken over by other apiservers {_RETAKES} times while "
            "this one worked on it; retry the request to get their answer",
            field="Idempotency-Key")

    async def _create_unkeyed(self, spec: SandboxSpec) -> SandboxInfo | None:
        """A create without an Idempotency-Key, to its end: placed, recorded, durable."""
        info = await self._create_placed(spec)
        await self._durable()
        return info

    async def _create_keyed(self, spec: SandboxSpec, scoped: str,
                            fp: str) -> SandboxInfo | None:
        """One go at a create under ``scoped``: the answer, or None when the claim was
        lost to another apiserver before this one could answer (ask the key again)."""
        while True:
            begin = self.idempotency.begin(scoped, fp)
            if begin.replay is not None:
                self.metrics.idempotent_replays.inc()
                return _replayed(begin.replay)
            if begin.wait is not None:
                try:
                    data = await asyncio.shield(begin.wait)
                except Retry:
                    continue  # the holder went away (died, or gave up): claim it ourselves
                self.metrics.idempotent_replays.inc()
                return _replayed(data)
            break
        claim = begin.claim
        assert claim is not None
        # The key's work, not this request's: it runs to its end even if the request is
        # cancelled (the gateway cancels a handler whose caller timed out or hung up),
        # so the caller's retry, waiting on the key, gets its sandbox. Cancelled with it,
        # a create slower than the caller's timeout was cut off on every attempt and
        # never happened (and took the edge's create down with it).
        work = asyncio.ensure_future(self._claimed(spec, scoped, claim))
        self._keyed.add(work)
        work.add_done_callback(_settle_keyed(self._keyed))
        return await asyncio.shield(work)

    async def _claimed(self, spec: SandboxSpec, scoped: str,
                       claim: Claim) -> SandboxInfo | None:
        """The work of a claim (see :meth:`_create_keyed`)."""
        try:
            info = await self._create_claimed(spec, claim)
        except Exception as exc:
            try:
                lost = isinstance(exc, ClaimLost) or not self.idempotency.holds(claim)
            except Exception:  # noqa: BLE001 - the store cannot say (down)
                lost = False   # answer this request's own error
            self.idempotency.abort(scoped, exc)
            if lost:
                return None   # e.g. the edge said our noted id is in use: the new owner made it
            raise
        except BaseException as exc:
            self.idempotency.abort(scoped, exc)
            raise
        answer = _msgpack.encode(info)
        try:
            self.idempotency.finish(scoped, answer)
        except ClaimLost:
            await self._drop_duplicate(scoped, info)
            return None
        except Exception as exc:
            # The sandbox exists (its id is the claim's intent) but the answer could not
            # be stored: kept and retried until it lands; the retries of the key are
            # answered "retry" meanwhile, then with this sandbox (red team 16, F11).
            self.idempotency.finish_later(scoped, answer, exc,
                                          lambda: self._drop_duplicate(scoped, info))
            raise Unavailable(
                f"sandbox {info.id} was created but this create's answer could not be "
                f"stored ({exc}); retry with the same Idempotency-Key to get it",
                sandbox_id=info.id, retry_after=1) from exc
        return info

    async def _drop_duplicate(self, scoped: str, info: SandboxInfo) -> None:
        """Our claim was taken over while we created ``info`` (this apiserver stalled past
        its lease). The new owner answers for the key; unless it answers (or will answer,
        through the intent) with this very sandbox, ours is a duplicate: destroy it."""
        row = self.idempotency.peek(scoped)
        if row is not None and (row.intent == info.id or (
                row.response is not None and _info_dec.decode(row.response).id == info.id)):
            return
        edge = self.directory.edge(NodeId(info.node))
        if edge is None:
            return
        try:
            await edge.destroy(info.id, reason="requested",
                               detail="duplicate of an idempotent create that another "
                                      "apiserver answered")
        except DsecError as exc:
            log.warning("could not destroy duplicate %s: %s", info.id, exc)
            return
        if self.quotas is not None:
            self.quotas.forget(info.id, "requested")

    async def _create_claimed(self, spec: SandboxSpec, claim: Claim) -> SandboxInfo:
        """A create under an idempotency claim. A claim taken over from a dead apiserver
        names the sandbox that one was creating (``claim.intent``): find it first and
        answer with it, so a retry after a crash never makes a second sandbox."""
        if claim.intent is not None:
            info = await self._recover(spec, claim)
            if info is not None:
                return info
        return await self._create_placed(spec, claim)

    async def _settled(self, edge: EdgeOps, sid: str) -> SandboxInfo | None:
        """``sid`` on its edge once it is out of a transition, or when
        ``recover_wait_s`` ran out (None: the edge does not have it). A link error is
        :class:`EdgeUnreachable` (retry later), whatever the node's health: the sandbox
        may be there, and making another one elsewhere would make two."""
        deadline = self.clock() + self.config.recover_wait_s
        while True:
            try:
                info = await edge.get(sid)
            except SandboxNotFound:
                return None
            except _LINK_ERRORS as exc:
                raise _unreachable(node_of(sid), "create", sid, exc, effect=True,
                                   sent=True) from exc
            if info.state not in ("creating", "pausing", "resuming") or \
                    self.clock() >= deadline:
                return info
            await asyncio.sleep(0.05)

    async def _recover(self, spec: SandboxSpec, claim: Claim) -> SandboxInfo | None:
        """Find (or make, under the very same id) the sandbox a previous owner of
        ``claim`` was creating. None: it is gone for good; create a new one. While it
        may still come into being (its edge cannot be reached, or it is still
        ``creating``) the answer is a retryable 503, never a second sandbox."""
        sid = claim.intent
        assert sid is not None
        try:
            node = node_of(sid)
        except InvalidArgument:
            return None
        edge = self.directory.edge(node)
        if edge is None or self.directory.abandon_intent(sid, spec):
            return None   # its node is lost: written off there, place the create anew
        info = await self._settled(edge, sid)
        if info is None:
            # Not on its edge: create it there under the same id, so that a first attempt
            # still on its way to the edge can only be refused (ids are unique per edge).
            try:
                return await self._create_on(spec, edge, sid)
            except CapacityExceeded:
                return None  # the node is full now: place it anew (under a new intent)
            except _IdInUse:
                info = await self._settled(edge, sid)
                if info is None:
                    return None
            except _LINK_ERRORS as exc:
                raise _unreachable(node, "create", sid, exc, effect=True,
                                   sent=True) from exc
        if info.state == "creating":
            raise Unavailable(
                f"sandbox {sid}, which an earlier attempt of this create asked node {node} "
                f"for, is still being created after {self.config.recover_wait_s:g}s; retry "
                "(same Idempotency-Key) to get it", node=node, sandbox_id=sid)
        if info.state not in ("running", "paused", "pausing", "resuming"):
            return None  # the first attempt's sandbox failed or was destroyed
        if info.id != sid:
            raise _edge_lied(node, f"asked for sandbox {sid}, it answered {info.id!r}")
        # Recorded as this key's request asks (the claim's fingerprint binds it), not as
        # the edge describes it: an edge's word charges no project.
        info = msgspec.structs.replace(info, node=node, spec=spec)
        self._adopted(info)
        return info

    def _adopted(self, info: SandboxInfo) -> None:
        """Record a sandbox an earlier create made (found through its intent), as the
        key's request describes it."""
        if self.quotas is not None:
            try:
                token = self.quotas.admit(project_of(info.spec), info.spec)
            except DsecError:
                pass  # over quota now: the next heartbeat reconcile records it anyway
            else:
                self.quotas.commit(token, info)
        self._projects.put(info.id, project_of(info.spec))

    async def _create_on(self, spec: SandboxSpec, edge: EdgeOps, sid: str) -> SandboxInfo:
        """Create ``sid`` on ``edge`` with quota admission, outside placement (the edge
        has the final say on capacity). ``_IdInUse`` when the edge already has ``sid``."""
        token = self.quotas.admit(project_of(spec), spec) if self.quotas is not None else None
        try:
            info = await self._edge_create(edge, spec, sid, node_of(sid))
        except BaseException:
            if self.quotas is not None:
                self.quotas.abort(token)
            raise
        if self.quotas is not None:
            self.quotas.commit(token, info)
        self._projects.put(info.id, project_of(spec))
        self.metrics.creations.labels(spec.backend).inc()
        return info

    async def _edge_create(self, edge: EdgeOps, spec: SandboxSpec,
                           sid: str | None, node: str) -> SandboxInfo:
        # the project's network ceilings' deny entries, enforced with the sandbox's own
        deny = ceiling_deny(self.network_ceilings(project_of(spec)))
        kw: dict[str, Any] = {"ceiling_deny": deny} if deny else {}
        if sid is None:
            return _answer_of(node, None, spec, await edge.create(spec, **kw))
        try:
            return _answer_of(node, sid, spec,
                              await edge.create(spec, sandbox_id=sid, **kw))
        except InvalidArgument as exc:
            if exc.detail.get("sandbox_id") == sid and "already in use" in exc.message:
                raise _IdInUse(sid) from exc
            raise

    async def _create_placed(self, spec: SandboxSpec,
                             claim: Claim | None = None) -> SandboxInfo:
        token = self.quotas.admit(project_of(spec), spec) if self.quotas is not None else None
        try:
            info = await self._place_and_create(spec, claim)
        except BaseException as exc:
            if self.quotas is not None:
                self.quotas.abort(token)
            code = exc.code if isinstance(exc, DsecError) else "internal_error"
            self.metrics.create_failures.labels(code).inc()
            raise
        if self.quotas is not None:
            self.quotas.commit(token, info)
        self._projects.put(info.id, project_of(spec))
        self.metrics.creations.labels(spec.backend).inc()
        return info

    async def _place_and_create(self, spec: SandboxSpec,
                                claim: Claim | None = None) -> SandboxInfo:
        """Place and create, re-placing after a refusal. Under an idempotency ``claim``
        the sandbox id is chosen here and noted in the claim before the edge is asked,
        and a link failure after the request may have reached the edge ends the attempt
        (:class:`EdgeUnreachable`, retryable): a second node must not get a second
        sandbox while the first may have made one; the retry looks for it first."""
        exclude: set[str] = set()
        unreachable: dict[str, DsecError] = {}
        last: DsecError | None = None
        for attempt in range(self.config.placement_retries + 1):
            try:
                dec = self.placer.place(spec, frozenset(exclude))
            except NoCapacity as exc:
                raise self._no_node(spec, exc, unreachable) from exc
            node = dec.node
            edge = self.directory.edge(NodeId(node))
            if edge is None:
                self.placer.refused(dec)
                exclude.add(node)
                continue
            # Layers the node lacks come first, from a node holding them (issue 16,
            # dsec.control.layers): a node without room for them, or unreachable for the
            # copy, is refused like one without room for the sandbox (nothing was created)
            here = spec
            ensure = getattr(self.directory, "ensure_layers", None)
            if ensure is not None:
                try:
                    here = await ensure(node, spec)
                except (CapacityExceeded, *_LINK_ERRORS) as exc:
                    self.placer.refused(dec)
                    exclude.add(node)
                    last = exc
                    if attempt < self.config.placement_retries:
                        self.metrics.placement_retries.inc()
                    continue
                except BaseException:
                    self.placer.refused(dec)
                    raise
            sid: str | None = None
            sent = not getattr(getattr(edge, "conn", None), "closed", False)
            try:
                if claim is not None:
                    sid = _new_sandbox_id(node)
                    claim.note(sid)
                info = await self._edge_create(edge, here, sid, node)
            except CapacityExceeded as exc:
                # The edge's own view said no: exclude it, pick again.
                self.placer.refused(dec)
                exclude.add(node)
                last = exc
                if attempt < self.config.placement_retries:
                    self.metrics.placement_retries.inc()
                continue
            except _LINK_ERRORS as exc:
                self.placer.refused(dec)
                if claim is not None and sent and not isinstance(exc, ConnectFailed) \
                        and not exc.detail.get("retryable"):
                    raise _unreachable(node, "create", sid or "", exc, effect=True,
                                       sent=True) from exc
                exclude.add(node)
                unreachable[node] = exc
                last = exc
                if attempt < self.config.placement_retries:
                    self.metrics.placement_retries.inc()
                continue
            except ImageNotFound as exc:
                self.placer.refused(dec)
                # The image store's message names its directory on the node: say the ref,
                # in the words every other "no such image" answer uses.
                raise image_not_found(str(exc.detail.get("ref") or spec.image)) from None
            except BaseException:
                self.placer.refused(dec)
                raise
            self.placer.accepted(dec)
            return info
        if unreachable and len(unreachable) == len(exclude):
            raise self._no_node(spec, None, unreachable)
        raise NoCapacity(
            f"no node could take a {spec.backend} sandbox with {spec.cpu_milli} millicores and "
            f"{spec.memory_bytes} bytes after {self.config.placement_retries + 1} attempts "
            f"(tried {sorted(exclude)}); last refusal: {last}", tried=sorted(exclude),
            unreachable=sorted(unreachable))

    def _no_node(self, spec: SandboxSpec, exc: NoCapacity | None,
                 unreachable: Mapping[str, DsecError]) -> DsecError:
        """What to answer when placement has no node left: an outage (nodes it could not
        reach, or no healthy node at all) is :class:`Unavailable`, not a lack of
        capacity that asking for less would fix."""
        if unreachable:
            nodes = ", ".join(f"{n} ({type(e).__name__})" for n, e in sorted(unreachable.items()))
            return EdgeUnreachable(
                f"could not reach node(s) {nodes} to create the sandbox, and no other node "
                "could take it; the apiserver keeps reconnecting: retry in a few seconds",
                nodes=sorted(unreachable), node=min(unreachable))
        views = self.directory.nodes()
        if views and not any(v.healthy for v in views):
            said = "; ".join(f"{v.id}: {v.status}" + (f" ({v.problem[:120]})" if v.problem
                                                       else "")
                             for v in sorted(views, key=lambda v: v.id)[:8])
            cut = sorted(v.id for v in views if v.status == "unreachable")
            cls = EdgeUnreachable if cut else Unavailable   # its link, or the nodes' silence
            return cls(
                f"no healthy node: the cluster's {len(views)} node(s) cannot take sandboxes "
                f"now ({said}); retry once a node is back", nodes=len(views),
                **({"node": cut[0]} if cut else {}))
        assert exc is not None
        return exc

    async def _durable(self) -> None:
        """Durable before acknowledged: the record of a sandbox this apiserver is about to
        answer for is committed first (group commit: concurrent creates share one
        transaction). Without it, a kill -9 right after a 201 lost the record, and the
        re-adopted sandbox was never listed again (an edge's own report makes no record:
        red team 16 F10). A store that cannot take it keeps the batch queued and retried;
        the answer goes out (the sandbox exists) and the failure is logged."""
        if self.quotas is None:
            return
        try:
            await self.quotas.durable()
        except DsecError as exc:
            log.warning("a created sandbox's record is not yet in the store (kept, "
                        "retried): %s", exc)

    async def create_many(
        self, principal: Caller,
        reqs: Sequence[CreateSandbox | CreateSandboxRequest | SandboxSpec],
        keys: Sequence[str] | None = None, *, session: str | None = None,
    ) -> list[SandboxInfo | DsecError]:
        """Batched create: each item succeeds or fails on its own (errors are returned),
        a bare spec (the catalogue's batch) too: its checks run with the item's create
        (under ``session``), not for the whole batch at once.
        ``keys``: one Idempotency-Key per item, so a retried batch (its reply lost to a
        crash) answers each item with the sandbox its first attempt made."""
        self._check_batch_cap(len(reqs), self.config.max_create_batch, "items")
        if keys is not None and len(keys) != len(reqs):
            raise InvalidArgument(f"{len(keys)} idempotency keys for {len(reqs)} requests: "
                                  "give one key per request, or none",
                                  field="idempotency_keys")
        out: list[SandboxInfo | DsecError] = [
            InvalidArgument("not attempted")] * len(reqs)

        async def one(i: int, r: CreateSandbox | CreateSandboxRequest | SandboxSpec) -> None:
            try:
                if isinstance(r, SandboxSpec):
                    r = CreateSandbox(spec=r, session=session)
                out[i] = await self.create(principal, r, idempotency_key=None if keys is None
                                           else keys[i])
            except DsecError as exc:
                out[i] = exc
        await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
        await self._durable()
        return out

    # ------------------------------------------------------------- read / list
    async def get(self, principal: Caller, sid: str) -> SandboxInfo:
        edge, lost, _ = await self._route(principal, sid, "reader")
        if lost is not None:
            return lost.info
        try:
            return await self._via(edge, sid, "get", lambda: edge.get(sid))
        except SandboxLost:
            lost = self.directory.lost(sid)
            if lost is None:
                raise
            return lost.info

    async def list(
        self, principal: Caller, *, project: str | None, labels: Mapping[str, str],
        state: SandboxState | None, limit: int, cursor: str | None,
        node: str | None = None, isolation: str | None = None,
    ) -> tuple[list[SandboxInfo], str | None]:
        """Live sandboxes the principal may see, from the control plane's registry (no
        edge is asked), ordered by id and paged with an opaque cursor (the last id of the
        previous page). Filters: project subtree, labels (all must match), state, node
        (the registry's per-node index: O(page) too), isolation tier."""
        if not (1 <= limit <= self.config.list_page_max):
            raise InvalidArgument(f"limit={limit} must be within 1..{self.config.list_page_max}",
                                  field="limit")
        if project is not None:
            parse_project_path(project)
            self.require(principal, project, "reader")
        after = _decode_cursor(cursor) if cursor else ""
        page, more = self.directory.list_sandboxes(principal, project=project, labels=labels,
                                                   state=state, after=after, limit=limit,
                                                   node=node, isolation=isolation)
        return page, (_encode_cursor(page[-1].id) if more and page else None)

    # ------------------------------------------------------------- mutate
    async def destroy(self, principal: Caller, sid: str) -> None:
        """Idempotent: destroying a destroyed (or destroying, or lost) sandbox succeeds."""
        if self._lost(principal, sid, "member") is not None:
            return  # written off with its node; the watcher destroys it if the node returns
        try:
            edge, _ = await self._edge_for(principal, sid, "member")
            info = await self._via(edge, sid, "get", lambda: edge.get(sid))
            if info.state in ("destroyed", "destroying"):
                return
            await self._via(edge, sid, "destroy", lambda: edge.destroy(
                sid, reason="requested", detail=f"deleted via the API by {principal.name}"),
                effect=True)
        except SandboxLost:
            return  # its node lost it: nothing is left to destroy
        except InvalidTransition:
            return  # a concurrent destroy won the race: the outcome is the same
        if self.quotas is not None:
            self.quotas.forget(sid, "requested")

    async def exec_stream(
        self, principal: Caller, sid: str, req: ExecRequest,
    ) -> AsyncIterator[ExecChunk | ExecResult]:
        edge, _ = await self._edge_for(principal, sid, "member", wake=True)
        return self._stream(edge, sid, req)

    async def _stream(self, edge: EdgeOps, sid: str,
                      req: ExecRequest) -> AsyncIterator[ExecChunk | ExecResult]:
        """``edge.exec_stream`` with its errors mapped as :meth:`_via` maps them."""
        sent = not getattr(getattr(edge, "conn", None), "closed", False)
        try:
            async for item in edge.exec_stream(sid, req, timeout=ops.exec_deadline(req)):
                yield item
        except SandboxNotFound:
            lost = self._vanished(sid)
            if lost is not None:
                raise _lost_error(lost) from None
            raise _not_found(sid) from None
        except _LINK_ERRORS as exc:
            raise _unreachable(node_of(sid), "exec", sid, exc, effect=True,
                               sent=sent) from exc

    async def exec_many(
        self, principal: Caller, items: Sequence[tuple[str, ExecRequest]],
    ) -> builtins.list[ExecResult | DsecError]:
        """Batched exec: grouped per edge into one batched Aether call each."""
        self._check_batch_cap(len(items), self.config.max_exec_batch, "calls")
        groups: dict[int, tuple[EdgeOps, list[int]]] = {}
        out: list[ExecResult | DsecError] = [InvalidArgument("not attempted")] * len(items)
        tenants: dict[str, list[int]] = {}
        for i, (sid, _) in enumerate(items):
            try:
                edge, project = await self._edge_for(principal, sid, "member", wake=True)
            except DsecError as exc:
                out[i] = exc
                continue
            groups.setdefault(id(edge), (edge, []))[1].append(i)
            tenants.setdefault(tenant_of(project), []).append(i)
        # the reply within each tenant's reply budget: its items' worst cases before,
        # what its results hold after (red team 21, B3: a 1 MiB estimate per batch let
        # 1,024 results of up to 8 MiB each through uncounted)
        leases: list[tuple[ReplyLease, list[int]]] = []
        try:
            for tenant in sorted(tenants):
                idx = tenants[tenant]
                leases.append((await self.replies.acquire(tenant, sum(
                    self._exec_worst_case(items[i][1]) for i in idx)), idx))
        except BaseException:
            for lease, _ in leases:
                lease.release()
            raise

        async def run(edge: EdgeOps, idx: list[int]) -> None:
            deadlines = [ops.exec_deadline(items[i][1]) for i in idx]
            deadline = None if None in deadlines else max(d for d in deadlines if d)
            sent = not getattr(getattr(edge, "conn", None), "closed", False)
            res: list[ExecResult | DsecError]
            try:
                res = await edge.exec_many([(items[i][0], items[i][1]) for i in idx],
                                           timeout=deadline)
            except _LINK_ERRORS as exc:
                res = [_unreachable(node_of(items[i][0]), "exec", items[i][0], exc,
                                    effect=True, sent=sent) for i in idx]
            except DsecError as exc:
                res = [exc] * len(idx)
            for i, r in zip(idx, res):
                if isinstance(r, SandboxNotFound):
                    lost = self._vanished(items[i][0])
                    r = _not_found(items[i][0]) if lost is None else _lost_error(lost)
                out[i] = r
        try:
            await asyncio.gather(*(run(e, idx) for e, idx in groups.values()))
            for lease, idx in leases:
                lease.resize(sum(_reply_size(out[i]) for i in idx
                                 if isinstance(out[i], ExecResult)))
        except BaseException:
            for lease, _ in leases:
                lease.release()
            raise
        for lease, _ in leases:
            keep_or_release(lease)
        return out

    async def read_file(self, principal: Caller, sid: str, path: str, offset: int,
                        length: int | None, user: str | None = None) -> bytes:
        check_path(path)
        edge, project = await self._edge_for(principal, sid, "reader")
        key = (str(node_of(sid)), project.partition("/")[0])

        async def piece(at: int, n: int) -> bytes:
            gate = self._reads.get(key)
            if gate is None:
                gate = self._reads[key] = _Gate(asyncio.Semaphore(READS_PER_TENANT))
            gate.users += 1
            try:
                async with gate.sem:
                    return await self._via(edge, sid, "read_file", lambda: edge.read_file(
                        sid, path, offset=at, length=n, user=user))
            finally:
                gate.users -= 1
                if not gate.users:
                    del self._reads[key]      # idle: the table holds busy tenants only
        # in pieces that fit an Aether frame, up to the one-read limit (dsec.wire.spec);
        # the whole answer within the tenant's reply budget: its length if it says one,
        # else each piece's room is taken (waiting) before the piece is asked for: a
        # read to the end may be 64 MiB, and an estimate for it let a tenant hold 64x
        # what it reserved (red team 21, B3)
        if length is not None:
            return await self._budgeted(project, min(length, MAX_FILE_READ_BYTES),
                                        lambda: read_in_chunks(piece, offset, length))
        tenant = tenant_of(project)
        more: list[ReplyLease] = []

        async def room_then_piece(at: int, n: int) -> bytes:
            more.append(await self.replies.acquire(
                tenant, n, own=sum(lease.bytes for lease in more)))
            return await piece(at, n)
        try:
            data = await self._budgeted(project, 0, lambda: read_in_chunks(
                room_then_piece, offset, None))
        finally:
            for lease in more:      # the kept lease holds the answer's size by now
                lease.release()
        return data

    async def write_file(self, principal: Caller, sid: str, path: str, data: bytes,
                         mode: int, append: bool, user: str | None = None) -> None:
        check_path(path)
        edge, _ = await self._edge_for(principal, sid, "member", wake=True)
        # in pieces that fit an Aether frame (the first one truncates unless appending):
        # not atomic, a failure midway leaves the pieces written so far
        for at in range(0, max(1, len(data)), FILE_CHUNK_BYTES):
            chunk = data[at:at + FILE_CHUNK_BYTES]
            more = append or at > 0
            await self._via(edge, sid, "write_file", functools.partial(
                edge.write_file, sid, path, chunk, mode=mode, append=more, user=user),
                effect=True)

    async def pause(self, principal: Caller, sid: str) -> PauseStats:
        edge, _ = await self._edge_for(principal, sid, "member")
        stats = await self._via(edge, sid, "pause", lambda: edge.pause(sid), effect=True)
        if self.quotas is not None:
            self.quotas.paused(sid, True)
        return stats

    async def resume(self, principal: Caller, sid: str) -> None:
        edge, _ = await self._edge_for(principal, sid, "member")
        if not await self._resume_admitted(edge, sid, "requested"):
            # not known paused here (already running, or paused behind this plane's
            # back and not reported yet: its running charge is still counted)
            await self._via(edge, sid, "resume", lambda: edge.resume(sid), effect=True)
            if self.quotas is not None:
                self.quotas.paused(sid, False)

    async def _resume_admitted(self, edge: EdgeOps, sid: str,
                               reason: ResumeReason = "auto_resume") -> bool:
        """Resume ``sid`` if the control plane knows it paused, within its project's
        quota: check and hold the charge (one step), resume at the edge, then count it
        running, or give the hold back if the resume failed. False when it is not known
        paused (nothing was done). Every door that makes a paused sandbox run goes
        through here: resume (REST, gateway, E2B, dashboard) and every operation the
        edge would otherwise resume it for transparently (exec, files, processes,
        ports: :data:`_WAKES`), which the edge's own auto-resume never checked
        (red team 19, B3). ``reason`` goes on the sandbox's events: ``auto_resume``
        for a wake (as if the edge had resumed it itself), ``requested`` for resume."""
        if self.quotas is None:
            return False
        hold = self.quotas.admit_resume(sid)
        if hold is None:
            return False
        try:
            await self._via(edge, sid, "resume", lambda: edge.resume(sid, reason=reason),
                            effect=True)
        except BaseException:
            self.quotas.abort_resume(hold)
            raise
        self.quotas.resumed(hold)
        return True

    async def snapshot(self, principal: Caller, sid: str,
                       strip: Sequence[str] = ()) -> SnapshotView:
        """pack_diff the sandbox into a snapshot on its edge (member role).

        Bounded by the project's ``snapshot_bytes`` quota (and every ancestor's): the
        edge is told the room left and refuses a bigger layer before it enters its
        store; a snapshot that fit then but not now (a concurrent one took the room) is
        deleted again. Either way ``QuotaExceeded`` and no layer is left behind."""
        edge, project = await self._edge_for(principal, sid, "member")
        room = self.quotas.snapshot_room(project) if self.quotas is not None else None
        if room == 0 and self.quotas is not None:
            self.quotas.check_snapshot(project, 1)   # raises, naming the full quota
        info = await self._via(edge, sid, "snapshot",
                               lambda: edge.snapshot(sid, strip=strip, max_bytes=room),
                               effect=True)
        if self.quotas is not None and not info.unchanged:
            try:
                # the sandbox's project and node as the control plane knows them, not as
                # the edge's answer says (they become the snapshot's owner record: F2);
                # what it stands on, recorded now: a fetch onto another node takes the
                # layer's meaning from here, never from a later holder (F1)
                self.quotas.charge_snapshot(info.id, project, node_of(sid), info.size_bytes,
                                            kind="snapshot", parent=info.parent,
                                            stack=info.stack)
            except QuotaExceeded:
                with contextlib.suppress(DsecError):
                    await edge.delete_snapshot(info.id)
                raise
        info = msgspec.structs.replace(info, project=project, node=node_of(sid))
        note = getattr(self.directory, "note_snapshot", None)
        if note is not None:
            note(info.node, info.id)  # placement can route to it at once
        return snapshot_view(info, [info.node])

    def _edges(self) -> builtins.list[tuple[str, EdgeOps]]:
        return [(n.id, e) for n in self.directory.nodes()
                if (e := self.directory.edge(NodeId(n.id))) is not None]

    async def list_snapshots(self, principal: Caller, *, project: str | None = None,
                             sandbox_id: str | None = None) -> builtins.list[SnapshotView]:
        """Snapshots on every edge that the principal may see (reader on their project,
        or on ``project``'s subtree), merged by id, oldest first."""
        if project is not None:
            parse_project_path(project)
            self.require(principal, project, "reader")
        if sandbox_id is not None:
            parse_sandbox_id(sandbox_id)
        edges = self._edges()
        results = await asyncio.gather(*(e.snapshots(sandbox_id=sandbox_id)
                                         for _, e in edges), return_exceptions=True)
        merged: dict[str, SnapshotView] = {}
        for (node, _), res in zip(edges, results):
            if isinstance(res, BaseException):
                continue  # an unreachable edge: its snapshots are missing from the answer
            for info in res:
                owned = self._snapshot_owner(info, node, principal)
                if owned is None:
                    continue
                info = owned
                p = info.project
                if project is not None and p != project and not p.startswith(project + "/"):
                    continue
                if principal.role_on(p) is None:
                    continue
                have = merged.get(info.id)
                if have is None:
                    merged[info.id] = snapshot_view(info, [node])
                elif node not in have.nodes:
                    have.nodes.append(node)
        return sorted(merged.values(), key=lambda v: v.created_at)  # stable on ties

    def _snapshot_record(self, snapshot_id: str) -> Any:
        """The control plane's record of a snapshot (a charge row: id, project, node), or
        None; ``...`` when there is no control plane (no records to go by)."""
        fn = getattr(self.quotas, "snapshot_record", None)
        return ... if fn is None else fn(snapshot_id)

    def _snapshot_owner(self, info: SnapshotInfo, node: str,
                        principal: Caller | None) -> SnapshotInfo | None:
        """An edge's ``info`` of a snapshot as the control plane's record says it is: its
        project is the record's, and only the recorded node's answer counts. A snapshot
        without a record is shown to a superuser only (as the edge says: to clean up),
        never to a tenant; an edge claiming another node's snapshot is not heard."""
        rec = self._snapshot_record(info.id)
        if rec is ...:
            return info
        if rec is None:
            return info if principal is not None and principal.superuser else None
        if rec.node != node:
            return None
        if info.project != rec.project:
            log.warning("edge %s says snapshot %s is project %r's; the control plane's "
                        "record says %r: the record holds", node, info.id[:19],
                        info.project, rec.project)
            info = msgspec.structs.replace(info, project=rec.project)
        return info

    async def _visible_snapshot(self, principal: Caller, ref: str) -> str:
        """The full id of snapshot ``ref`` if ``principal`` holds a role on its project,
        else ``ImageNotFound`` worded exactly as for a snapshot that does not exist.
        Snapshot -> project is an immutable fact, cached so repeated creates from one
        snapshot do not ask every edge each time (full ids only)."""
        check_snapshot_ref(ref, field="snapshot")
        hit = self._snapshots.get(ref)
        if hit is None:
            view = await self._resolve_snapshot(principal, ref)
            hit = (view.id, view.project)
            self._remember_snapshot(view)
        else:
            self._snapshots.move_to_end(ref)
        if principal.role_on(hit[1]) is None:
            raise _snapshot_not_found(ref)
        return hit[0]

    def _remember_snapshot(self, view: SnapshotView) -> None:
        if self._snapshot_record(view.id) is None:
            return   # unrecorded (seen by a superuser): its project is only an edge's word
        self._snapshots[view.id] = (view.id, view.project)
        while len(self._snapshots) > self.config.snapshot_cache_entries:
            self._snapshots.popitem(last=False)

    async def _resolve_snapshot(self, principal: Caller, ref: str) -> SnapshotView:
        """Snapshot ``ref`` as ``principal`` may see it, with every edge holding it.

        A full id is asked of every edge and then checked against the caller's roles. A
        prefix is matched against the snapshots the caller may see *only* (never handed
        to an edge, whose store would expand it across projects): another project's
        snapshot sharing the prefix neither makes it ambiguous nor shows up in the
        error."""
        check_snapshot_ref(ref, field="snapshot")
        if len(ref) == 71:
            view = await self._find_snapshot(ref, principal)
            if principal.role_on(view.project) is None:
                raise _snapshot_not_found(ref)
            return view
        hits = [v for v in await self.list_snapshots(principal) if v.id.startswith(ref)]
        if len(hits) > 1:
            raise InvalidArgument(f"snapshot id prefix {ref!r} is ambiguous: it matches "
                                  f"{len(hits)} snapshots visible to this API key "
                                  f"({', '.join(v.id[:19] for v in hits[:4])}"
                                  f"{' ...' if len(hits) > 4 else ''}); give more digits",
                                  field="snapshot")
        if not hits:
            raise _snapshot_not_found(ref)
        return hits[0]

    async def _find_snapshot(self, full_id: str, principal: Caller) -> SnapshotView:
        """Snapshot ``full_id`` (``sha256:`` + 64 hex) as the control plane's record says
        (project, node), asked of the recorded node only (no access check: callers check
        the project). Without a control plane, every edge is asked."""
        rec = self._snapshot_record(full_id)
        if rec is None and not principal.superuser:
            raise _snapshot_not_found(full_id)
        edges = self._edges()
        if rec is not None and rec is not ...:
            edges = [(n, e) for n, e in edges if n == rec.node]
        results = await asyncio.gather(*(e.get_snapshot(full_id) for _, e in edges),
                                       return_exceptions=True)
        view: SnapshotView | None = None
        for (node, _), res in zip(edges, results):
            if isinstance(res, BaseException):
                continue   # not there (or unreachable, or not a snapshot on that edge)
            if res.id != full_id:
                continue   # an edge expanding the id differently: not this snapshot
            owned = self._snapshot_owner(res, node, principal)
            if owned is None:
                continue
            res = owned
            if view is None:
                view = snapshot_view(res, [node])
            elif node not in view.nodes:
                view.nodes.append(node)
        if view is None:
            raise _snapshot_not_found(full_id)
        return view

    async def get_snapshot(self, principal: Caller, ref: str) -> SnapshotView:
        """One snapshot by id (or a unique prefix >= 12 hex digits among the snapshots the
        key may see), with its holders."""
        view = await self._resolve_snapshot(principal, ref)
        self._remember_snapshot(view)
        return view

    async def delete_snapshot(self, principal: Caller, ref: str) -> SnapshotView:
        """Delete a snapshot on every edge holding it (member role on its project).
        ``InUse`` (409) while a sandbox runs from it or a snapshot builds on it."""
        view = await self._resolve_snapshot(principal, ref)
        self.require(principal, view.project, "member")
        for node in view.nodes:
            edge = self.directory.edge(NodeId(node))
            if edge is None:
                continue
            try:
                await edge.delete_snapshot(view.id)
            except ImageNotFound:
                pass  # a shared layer store: an earlier holder's delete removed it
            except InUse:
                # The edge names what uses it: sandbox ids and snapshots, possibly of
                # other projects (a caller with roles on several may have started them).
                raise InUse(f"snapshot {view.id} is in use by sandboxes started from it "
                            "or by a snapshot that builds on it; destroy those sandboxes and "
                            "delete those snapshots first (GET /v1/snapshots lists the "
                            "ones you may see)", ref=view.id) from None
            except _LINK_ERRORS as exc:
                # the apiserver's link, not the caller's: say which node, and retry
                raise _unreachable(node, "snapshot delete", "", exc, effect=True,
                                   sent=True) from exc
        for k in [k for k, (sid, _) in self._snapshots.items() if sid == view.id]:
            del self._snapshots[k]
        forget = getattr(self.directory, "forget_snapshot", None)
        if forget is not None:
            forget(view.id)
        if self.quotas is not None:
            self.quotas.release_snapshot(view.id)
        return view

    async def events(self, principal: Caller, sid: str) -> builtins.list[SandboxEvent]:
        lost = self._lost(principal, sid, "reader")
        if lost is not None:
            return list(lost.events)
        try:
            edge, project = await self._edge_for(principal, sid, "reader")
            return await self._budgeted(
                project, self.config.reply_reserve_bytes,
                lambda: self._via(edge, sid, "events", lambda: edge.events(sid)))
        except SandboxLost:
            lost = self.directory.lost(sid)
            if lost is None:
                raise
            return list(lost.events)

    def info(self, principal: Caller) -> Info:
        """Who is calling and what this apiserver offers: one answer at every door."""
        gw = self.gateway_address
        return Info(version=self.config.version, gateway=gw,
                    gateway_protocol=None if gw is None else GATEWAY_PROTOCOL,
                    principal=principal.id, project=principal.default_project,
                    role=principal.role_on(principal.default_project),
                    default_ttl_s=self.config.default_ttl_s,
                    default_backend=self.config.default_backend)

    def nodes(self, principal: Caller) -> builtins.list[NodeView]:
        if principal.role_on("default") is None and not principal.roles and not principal.superuser:
            raise PermissionDenied(f"principal {principal.name!r} holds no role on any project")
        return self.directory.nodes()

    # ------------------------------------------------------------- the catalogue
    def handler(self, op: Op[Req, Rep]) -> Callable[[Caller, Req], Awaitable[Rep]]:
        """The policy of ``op`` (a row of :mod:`dsec.wire.ops`): what every door (REST,
        the Aether gateway) calls with the caller and the request object it decoded.
        Sandbox operations that only check the row's role and forward to the sandbox's
        edge share one policy (:meth:`_forward`); the others have their own (tombstones,
        quota bookkeeping, fan-out over edges, chunking, administration). A row without
        one is a wiring bug, raised when a door is built, not at the first call."""
        policy = self._policies.get(op.name)
        if policy is None:
            raise InternalError(f"operation {op.name!r} has no apiserver policy (doors: "
                                f"{sorted(op.doors)}); add one to ApiService._policy_table")
        return policy

    def stream_handler(self, op: StreamOp[Req, Item, Rep],
                       ) -> Callable[[Caller, Req], Awaitable[AsyncIterator[Item | Rep]]]:
        """The policy of a streaming row: its items, then the final reply, in order."""
        policy = self._policies.get(op.name)
        if policy is None:
            raise InternalError(f"streaming operation {op.name!r} has no apiserver policy")
        return policy

    def upload_handler(self, op: UploadOp[Req, Rep],
                       ) -> Callable[[Caller, Req, str], Awaitable[Rep]]:
        """The policy of an upload row: the request and the path of the uploaded file."""
        oci = op is ops.IMAGE_IMPORT

        async def upload(caller: Caller, b: ImageUpload, tar_path: str) -> ImageList:
            return await self._admin().build_image(caller, tar_path, name=b.name,
                                                   kind=b.kind, tag=b.tag, oci=oci)
        return cast(Callable[[Caller, Req, str], Awaitable[Rep]],
                    audited(op.name, upload, lambda: self.audit))

    def _admin(self) -> AdminOps:
        if self.admin is None:
            raise Unavailable("this apiserver serves no administration (projects, keys, "
                              "sessions, images): it was started without a control plane")
        return self.admin

    def _policy_table(self) -> dict[str, Policy]:
        """One entry per operation of the gateway and REST rows; see :meth:`handler`."""
        fwd = self._forward
        return {
            "create": self._create_op, "create_many": self._create_many_op,
            "get": self._get_op, "list": self._list_op, "destroy": self._destroy_op,
            "exec": functools.partial(fwd, ops.EXEC), "exec_many": self._exec_many_op,
            "exec_stream": self._exec_stream_op,
            "read_file": self._read_file_op, "write_file": self._write_file_op,
            "list_dir": functools.partial(fwd, ops.LIST_DIR),
            "stat": functools.partial(fwd, ops.STAT),
            "mkdir": functools.partial(fwd, ops.MKDIR),
            "remove": functools.partial(fwd, ops.REMOVE),
            "pause": self._pause_op, "resume": self._resume_op,
            "stats": functools.partial(fwd, ops.STATS), "events": self._events_op,
            "snapshot": self._snapshot_op, "snapshots": self._snapshots_op,
            "snapshot_get": self._snapshot_get_op,
            "snapshot_delete": self._snapshot_delete_op,
            "info": self._info_op, "nodes": self._nodes_op,
            "session_open": self._session_open_op, "session_renew": self._session_renew_op,
            "session_close": self._session_close_op, "create_key": self._create_key_op,
            "revoke_key": self._revoke_key_op, "keys": self._keys_op,
            "projects": self._projects_op,
            "project_get": self._project_get_op, "quota_set": self._quota_set_op,
            "images": self._images_op, "image_get": self._image_get_op,
            "image_tag": self._image_tag_op, "image_delete": self._image_delete_op,
            "image_promote": self._image_promote_op,
            "image_build": self._upload_refused, "image_import": self._upload_refused,
            "port_expose": self._port_expose_op, "port_list": self._port_list_op,
            "port_close": functools.partial(fwd, ops.PORT_CLOSE),
            "network_get": functools.partial(fwd, ops.NETWORK_GET),
            "network_update": self._network_update_op,
            "image_prune": self._image_prune_op,
            "image_pull": self._image_pull_op,
            "node_drain": self._node_drain_op, "node_undrain": self._node_undrain_op,
            "layer_fetch": self._layer_fetch_op,
            "image_push": self._image_push_op,
            "image_pin": self._image_pin_op, "image_unpin": self._image_unpin_op,
            "image_pins": self._image_pins_op,
            "cluster_tokens": self._cluster_tokens_op,
            "cluster_token_create": self._cluster_token_create_op,
            "cluster_token_revoke": self._cluster_token_revoke_op,
            "cluster_nodes": self._cluster_nodes_op,
            "cluster_node_revoke": self._cluster_node_revoke_op,
            "node_migrate": self._node_migrate_op,
            # issue 19: streamed files (the duplex rows' doors: dsec.control.filedoors)
            "file_read_stream": self._file_read_refused,
            "file_write_stream": self._file_write_refused,
            "file_rename": functools.partial(fwd, ops.FILE_RENAME),
            "file_watch": self._file_watch_op,
            "set_timeout": functools.partial(fwd, ops.SET_TIMEOUT),   # issue 19 (life)
            # issue 19: processes, each by the row's role on the sandbox's project
            "process_start": functools.partial(fwd, ops.PROCESS_START),
            "process_list": functools.partial(fwd, ops.PROCESS_LIST),
            "process_connect": self._process_connect_op,
            "process_run": self._process_run_op,
            "process_input": functools.partial(fwd, ops.PROCESS_INPUT),
            "process_close_stdin": functools.partial(fwd, ops.PROCESS_CLOSE_STDIN),
            "process_signal": functools.partial(fwd, ops.PROCESS_SIGNAL),
            "pty_resize": functools.partial(fwd, ops.PTY_RESIZE),
        }

    # ------------------------------------------------------- streamed files (issue 19)
    async def open_file_stream(self, caller: Caller, op: TunnelOp[Any, FileInfo], body: Any,
                               ) -> tuple[DuplexStream, Callable[[], Awaitable[FileInfo]]]:
        """Check ``caller`` may ``op`` (the row's role on the sandbox's project) and open
        the edge's duplex stream for it: (the stream, its answer with errors mapped as
        :meth:`_via` maps them). The doors move the bytes (dsec.control.filedoors)."""
        assert op.role is not None
        # a streamed read of a paused sandbox reads it paused (the edge never resumes for
        # reads: docs/sdk.md's paused rule); a write resumes it, within the quota
        edge, _ = await self._edge_for(caller, body.id, op.role,
                                       wake=op.name in _WAKES)
        stream = edge.tunnel(op, body)

        async def done() -> FileInfo:
            info: FileInfo = await self._via(edge, body.id, op.name, stream.result,
                                             effect=op.effect)
            return info
        return stream, done

    # The duplex rows' bytes do not fit a request-reply policy: every door calls
    # open_file_stream instead (a door that called these would be a wiring bug).
    async def _file_read_refused(self, caller: Caller, b: ReadStream) -> FileInfo:
        raise InvalidArgument("file_read_stream is a duplex call: open it with "
                              "open_file_stream (the gateway and REST doors do)")

    async def _file_write_refused(self, caller: Caller, b: WriteStream) -> FileInfo:
        raise InvalidArgument("file_write_stream is a duplex call: open it with "
                              "open_file_stream (the gateway and REST doors do)")

    async def _file_watch_op(self, caller: Caller, b: Watch
                             ) -> AsyncIterator[FileEvent | WatchEnd]:
        edge, _ = await self._edge_for(caller, b.id, "reader")   # reads: no resume
        return self._watch(edge, b)

    def _watch(self, edge: EdgeOps, b: Watch) -> AsyncIterator[FileEvent | WatchEnd]:
        return self._edge_stream(edge, ops.FILE_WATCH, "file_watch", b)

    async def _edge_stream(self, edge: EdgeOps, op: Any, name: str, b: Any, *,
                           effect: bool = False, sent: bool = True) -> AsyncIterator[Any]:
        """One edge stream of sandbox ``b.id``, its errors mapped as every door expects:
        the sandbox gone (lost, with its reason, or not found), or its edge unreachable
        (``effect``: the call may have acted; ``sent``: it reached the link)."""
        try:
            async for item in edge.stream(op, b, timeout=None):
                yield item
        except SandboxNotFound:
            lost = self._vanished(b.id)
            if lost is not None:
                raise _lost_error(lost) from None
            raise _not_found(b.id) from None
        except _LINK_ERRORS as exc:
            raise _unreachable(node_of(b.id), name, b.id, exc, effect=effect,
                               sent=sent) from exc

    # ------------------------------------------------------------------ ports
    def _exposed(self, sid: str, rec: PortRecord, ttl: float | None) -> ExposedPort:
        """The API's view of an exposed port: its URL with a fresh token."""
        expiry = int(self.wall() + min(ttl or MAX_TOKEN_TTL_S, MAX_TOKEN_TTL_S))
        token = self.port_tokens.mint(sid, rec.port, rec.generation, expiry)
        url = f"{self.config.public_url}{proxy_path(sid, rec.port)}?{TOKEN_PARAM}={token}"
        return ExposedPort(port=rec.port, url=url, token=token, expires_at=float(expiry))

    def _ports_within_ceilings(self, project: str, sid: str) -> None:
        """Exposing a port opens a path from outside into the sandbox: refused (and
        every URL of it stops working) under a project whose network ceiling, or an
        ancestor's, is ``none``. The apiserver's check for every door (REST, gateway and
        the proxy route); the edge, reached directly, knows no project ceilings."""
        for owner, ceiling in self.network_ceilings(project):
            if ceiling.net_mode == "none":
                raise PermissionDenied(
                    f"sandbox {sid} is in project {project!r}, under the network ceiling "
                    f"'none' of project {owner!r}: no network reaches its sandboxes, so "
                    f"none of their ports may be exposed; ask an admin of the parent of "
                    f"{owner!r} to widen that ceiling", project=owner, ceiling="none",
                    sandbox_id=sid)

    async def _port_expose_op(self, caller: Caller, b: PortExpose) -> ExposedPort:
        edge, project = await self._edge_for(caller, b.id, "member")
        self._ports_within_ceilings(project, b.id)
        rec = await self._via(edge, b.id, "port_expose", lambda: edge.port_expose(b))
        return self._exposed(b.id, rec, b.token_ttl_s)

    async def _port_list_op(self, caller: Caller, b: SandboxRef) -> ExposedPortList:
        edge, _ = await self._edge_for(caller, b.id, "member")
        recs = await self._via(edge, b.id, "port_list", lambda: edge.port_list(b.id))
        return ExposedPortList(items=[self._exposed(b.id, r, None) for r in recs.items])

    async def port_tunnel(self, sid: str, port: int, *, caller: Caller | None = None,
                          token: str | None = None, client: str | None = None,
                          admit: Callable[[str], None] | None = None,
                          ) -> DuplexStream:
        """A duplex stream to ``port`` of sandbox ``sid`` for the proxy route: with a URL
        ``token`` (checked here, in constant time; its generation checked by the edge)
        or a ``caller`` with member on the sandbox's project. A bad token is charged to
        ``client``'s budget for failed authentication, like a bad API key. ``admit`` is
        called with the sandbox's project once the caller is known good and before the
        tunnel opens (the proxy's per-project share; it raises to refuse)."""
        if not 1 <= port <= 65535:
            raise InvalidArgument(f"port={port} must be within 1..65535", field="port")
        if token is not None:
            try:
                gen = self.port_tokens.verify(token, sid, port, self.wall())
            except Unauthenticated:
                if client is not None:
                    self.check_anonymous(client, charge=True)
                raise
            try:
                edge = self.directory.edge(NodeId(node_of(sid)))
            except InvalidArgument:
                edge = None
            if edge is None:
                raise _not_found(sid)
            project = self._projects.get(sid)
            if project is None:
                found_edge = edge
                info = await self._via(edge, sid, "get", lambda: found_edge.get(sid))
                project = project_of(info.spec)
                self._projects.put(sid, project)
        elif caller is not None:
            edge, project = await self._edge_for(caller, sid, "member", wake=True)
            recs = await self._via(edge, sid, "port_list", lambda: edge.port_list(sid))
            found = [r.generation for r in recs.items if r.port == port]
            if not found:
                raise NotFound(f"port {port} of sandbox {sid} is not exposed; expose it "
                               "first (sb.ports.expose)", sandbox_id=sid, port=port)
            gen = found[0]
        else:
            raise Unauthenticated(
                f"reaching an exposed port needs its URL token (?{TOKEN_PARAM}= or "
                "X-Dsec-Token) or an API key of a member of the sandbox's project")
        self._ports_within_ceilings(project, sid)
        if token is not None:   # the URL-token door wakes it too (caller's done above)
            await self._resume_admitted(edge, sid)
        if admit is not None:
            admit(project)
        return edge.tunnel(ops.PORT_CONNECT, PortConnect(id=sid, port=port, generation=gen))

    async def _forward(self, op: Op[Any, Any], caller: Caller, body: Any) -> Any:
        """A sandbox operation whose only rule is the row's role on the sandbox's
        project: route by id, check, call its edge, map link errors (``op.effect``: the
        error says whether it may have happened)."""
        sid: str = body.id
        assert op.role is not None
        edge, project = await self._edge_for(caller, sid, op.role, wake=op.name in _WAKES)
        deadline: Deadline = USE_CLIENT_DEFAULT if op.deadline is None else op.deadline(body)

        def call() -> Awaitable[Any]:
            return self._via(edge, sid, op.name,
                             lambda: edge.call(op, body, timeout=deadline), effect=op.effect)
        if op.name in _BIG_REPLIES:
            return await self._budgeted(project, self._reply_reserve(op, body), call)
        return await call()

    def _reply_reserve(self, op: Op[Any, Any], body: Any) -> int:
        """What ``op``'s call reserves before its reply arrives (an exec: its worst case;
        the others: an estimate)."""
        if op is ops.EXEC:
            return self._exec_worst_case(body.req)
        return self.config.reply_reserve_bytes

    def _exec_worst_case(self, req: ExecRequest) -> int:
        """The most an exec's reply holds: both streams at min(its cap, the edge's
        reply cap), and its other fields (red team 21, B3: reserving less let a tenant
        that does not read hold 15x its budget)."""
        if req.background:
            return _REPLY_OVERHEAD
        return 2 * min(req.output_cap_bytes, self.config.reply_output_bytes) + _REPLY_OVERHEAD

    async def _budgeted(self, project: str, reserve: int,
                        call: Callable[[], Awaitable[T]]) -> T:
        """Run ``call`` (one edge call with a large unary reply) within its tenant's budget
        of reply bytes: reserve, charge the real size, and leave the lease to the door
        that writes the reply out (dsec.control.replybudget)."""
        lease = await self.replies.acquire(tenant_of(project), reserve)
        try:
            rep = await call()
            lease.resize(_reply_size(rep))
        except BaseException:
            lease.release()
            raise
        keep_or_release(lease)
        return rep

    async def _network_update_op(self, caller: Caller, b: NetworkUpdate) -> NetworkView:
        """Member on the sandbox's project, and the new policy within every network
        ceiling of the project (its own and its ancestors'), checked before the edge is
        asked; the ceilings' deny entries go with it (``NetworkUpdateOnNode``)."""
        edge, project = await self._edge_for(caller, b.id, "member")
        ceilings = self.network_ceilings(project)
        check_within(b.policy, ceilings, where="policy")
        body = NetworkUpdateOnNode(id=b.id, policy=b.policy,
                                   expect_generation=b.expect_generation,
                                   ceiling_deny=ceiling_deny(ceilings))
        return await self._via(edge, b.id, "network_update",
                               lambda: edge.network_update(body))

    async def _create_op(self, caller: Caller, b: CreateSandbox) -> SandboxInfo:
        return await self.create(caller, b)

    async def _create_many_op(self, caller: Caller, b: CreateMany) -> Batch[SandboxInfo]:
        self._check_batch_cap(len(b.items), self.config.max_create_batch, "items")
        self.charge_batch(caller, len(b.items), "items")
        return Batch.of(self._redacted(await self.create_many(
            caller, b.items, b.idempotency_keys, session=b.session)))

    async def _get_op(self, caller: Caller, b: SandboxRef) -> SandboxInfo:
        return await self.get(caller, b.id)

    async def _list_op(self, caller: Caller, b: ListSandboxes) -> SandboxList:
        items, nxt = await self.list(caller, project=b.project, labels=b.labels,
                                     state=b.state, limit=b.limit, cursor=b.cursor,
                                     node=b.node, isolation=b.isolation)
        return SandboxList(items=items, next_cursor=nxt)

    async def _destroy_op(self, caller: Caller, b: SandboxRef) -> None:
        await self.destroy(caller, b.id)

    async def _exec_many_op(self, caller: Caller, b: ExecMany) -> Batch[ExecResult]:
        self._check_batch_cap(len(b.calls), self.config.max_exec_batch, "calls")
        self.charge_batch(caller, len(b.calls), "calls")
        return Batch.of(self._redacted(await self.exec_many(
            caller, [(c.id, c.req) for c in b.calls])))

    @staticmethod
    def _check_batch_cap(n: int, cap: int, field: str) -> None:
        """This apiserver's cap on the items of one batch (policy, below the wire's
        MAX_BATCH_ITEMS), checked before the batch is charged or run."""
        if n > cap:
            raise InvalidArgument(f"a batch of {n} {field} exceeds this apiserver's limit "
                                  f"of {cap} per request; split it", field=field, size=n,
                                  limit=cap)

    def _redacted(self, items: Sequence[T | DsecError]) -> builtins.list[T | DsecError]:
        """A batch's failed items as the caller may see them (:meth:`redact`)."""
        return [self.redact(x) if isinstance(x, DsecError) else x for x in items]

    async def _exec_stream_op(self, caller: Caller,
                              b: ExecCall) -> AsyncIterator[ExecChunk | ExecResult]:
        return await self.exec_stream(caller, b.id, b.req)

    async def _process_connect_op(self, caller: Caller, b: ProcessRef,
                                  ) -> AsyncIterator[ExecChunk | ExecResult]:
        """Reader on the sandbox's project, checked before the stream starts; the edge's
        errors mapped as :meth:`_stream` maps an exec's."""
        edge, _ = await self._edge_for(caller, b.id, "reader")
        return self._process_stream(edge, b)

    def _process_stream(self, edge: EdgeOps,
                        b: ProcessRef) -> AsyncIterator[ExecChunk | ExecResult]:
        return self._edge_stream(edge, ops.PROCESS_CONNECT, "process_connect", b)

    async def _process_run_op(self, caller: Caller, b: ExecCall,
                              ) -> AsyncIterator[ProcessRunItem | ExecResult]:
        """process_start's rule (member on the sandbox's project, waking a paused
        sandbox within its quota), checked before the stream starts; then one edge
        stream: the entry, the output, the end (issue 20)."""
        edge, _ = await self._edge_for(caller, b.id, "member", wake=True)
        return self._process_run_stream(edge, b)

    def _process_run_stream(self, edge: EdgeOps, b: ExecCall,
                            ) -> AsyncIterator[ProcessRunItem | ExecResult]:
        sent = not getattr(getattr(edge, "conn", None), "closed", False)
        # the process may have started (after the first item it has, and runs on:
        # process_list / process_connect by its pid reach it)
        return self._edge_stream(edge, ops.PROCESS_RUN, "process_run", b, effect=True,
                                 sent=sent)

    async def _read_file_op(self, caller: Caller, b: ReadFile) -> bytes:
        return await self.read_file(caller, b.id, b.path, b.offset, b.length, b.user)

    async def _write_file_op(self, caller: Caller, b: WriteFile) -> None:
        await self.write_file(caller, b.id, b.path, b.data, b.mode, b.append, b.user)

    async def _pause_op(self, caller: Caller, b: SandboxRef) -> PauseStats:
        return await self.pause(caller, b.id)

    async def _resume_op(self, caller: Caller, b: SandboxRef) -> SandboxInfo:
        await self.resume(caller, b.id)
        return await self.get(caller, b.id)

    async def _events_op(self, caller: Caller, b: SandboxRef) -> EventList:
        return EventList(items=await self.events(caller, b.id))

    async def _snapshot_op(self, caller: Caller, b: SnapshotCall) -> SnapshotView:
        return await self.snapshot(caller, b.id, b.strip)

    async def _snapshots_op(self, caller: Caller, b: SnapshotQuery) -> SnapshotList:
        return SnapshotList(items=await self.list_snapshots(
            caller, project=b.project, sandbox_id=b.sandbox_id))

    async def _snapshot_get_op(self, caller: Caller, b: SnapshotRef) -> SnapshotView:
        return await self.get_snapshot(caller, b.id)

    async def _snapshot_delete_op(self, caller: Caller, b: SnapshotRef) -> None:
        # The row answers nothing: REST's 204 had no body while the gateway answered the
        # view, so Client.call(SNAPSHOT_DELETE) was None over http, a view over aether.
        await self.delete_snapshot(caller, b.id)

    async def _info_op(self, caller: Caller, b: Empty) -> Info:
        return self.info(caller)

    async def _nodes_op(self, caller: Caller, b: Empty) -> NodeList:
        return NodeList(items=self.nodes(caller))

    async def _session_open_op(self, caller: Caller, b: SessionOpen) -> SessionView:
        return self._admin().open_session(caller, b.lease_s)

    async def _session_renew_op(self, caller: Caller, b: SessionRef) -> SessionView:
        return self._admin().renew_session(caller, b.id)

    async def _session_close_op(self, caller: Caller, b: SessionRef) -> None:
        self._admin().close_session(caller, b.id)

    async def _create_key_op(self, caller: Caller, b: CreateKeyRequest) -> CreateKeyResponse:
        return self._admin().create_key(caller, b)

    async def _revoke_key_op(self, caller: Caller, b: KeyRef) -> None:
        self._admin().revoke_key(caller, b.id)

    async def _keys_op(self, caller: Caller, b: KeyQuery) -> KeyList:
        return self._admin().list_keys(caller, b.principal)

    async def _projects_op(self, caller: Caller, b: Empty) -> ProjectList:
        return self._admin().list_projects(caller)

    async def _project_get_op(self, caller: Caller, b: ProjectRef) -> ProjectView:
        return self._admin().get_project(caller, b.path)

    async def _quota_set_op(self, caller: Caller, b: QuotaSet) -> ProjectView:
        return self._admin().set_quota(caller, b.path, b.quota)

    async def _images_op(self, caller: Caller, b: Empty) -> ImageList:
        return self._admin().list_images(caller)

    async def _image_get_op(self, caller: Caller, b: ImageRef) -> ImageView:
        return self._admin().get_image(caller, b.ref)

    async def _image_tag_op(self, caller: Caller, b: ImageTagRequest) -> ImageView:
        return self._admin().tag_image(caller, b)

    async def _image_promote_op(self, caller: Caller, b: ImagePromoteRequest) -> ImageView:
        return await self._admin().promote_image(caller, b)

    async def _image_delete_op(self, caller: Caller, b: ImageRef) -> None:
        self._admin().delete_image(caller, b.ref)

    async def _image_prune_op(self, caller: Caller, b: ImagePrune) -> ImagePruned:
        return await self._admin().prune_images(caller, dry_run=b.dry_run)

    async def _image_pull_op(self, caller: Caller, b: ImagePullRequest) -> ImageList:
        return await self._admin().pull_image(caller, b)

    async def _image_push_op(self, caller: Caller, b: ImagePushRequest) -> ImagePushed:
        return await self._admin().push_image(caller, b)

    async def _image_pin_op(self, caller: Caller, b: ImagePin) -> ImagePinView:
        return await self._admin().pin_image(caller, b)

    async def _image_unpin_op(self, caller: Caller, b: ImagePinRef) -> None:
        await self._admin().unpin_image(caller, b)

    async def _image_pins_op(self, caller: Caller, b: NodePins) -> ImagePinList:
        return self._admin().list_pins(caller, b)

    async def _node_drain_op(self, caller: Caller, b: NodeRef) -> NodeView:
        return self._admin().drain_node(caller, b.id, drained=True)

    async def _node_undrain_op(self, caller: Caller, b: NodeRef) -> NodeView:
        return self._admin().drain_node(caller, b.id, drained=False)

    async def _node_migrate_op(self, caller: Caller, b: NodeRef) -> NodeMigration:
        return await self._admin().migrate_node(caller, b.id, self)

    async def _layer_fetch_op(self, caller: Caller, b: LayerFetch) -> LayerFetched:
        return await self._admin().fetch_layer(caller, b)

    # -------------------------------------------------------- cluster membership
    def _joins(self, caller: Caller) -> JoinAdmin:
        if not caller.superuser:
            raise PermissionDenied("cluster administration (join tokens, joined nodes) is "
                                   "a superuser's: a token admits a machine into every "
                                   "project's placement; ask an operator")
        if self.joins is None:
            raise Conflict("this apiserver takes no joined edges: it has no cluster CA "
                           "(`dsec cluster init`, or `dsec up --hosts`)")
        return self.joins

    async def _cluster_tokens_op(self, caller: Caller, b: Empty) -> JoinTokenList:
        return JoinTokenList(items=[_token_view(r) for r in self._joins(caller).list_tokens()])

    async def _cluster_token_create_op(self, caller: Caller,
                                       b: JoinTokenCreate) -> JoinTokenView:
        tok, row = self._joins(caller).create_token(ttl_s=b.ttl_s, uses=b.uses,
                                                    description=b.description)
        return _token_view(row, str(tok))

    async def _cluster_token_revoke_op(self, caller: Caller, b: JoinTokenRevoke) -> None:
        self._joins(caller).revoke_token(b.id, nodes=b.nodes)

    async def _cluster_nodes_op(self, caller: Caller, b: Empty) -> JoinedNodeList:
        return JoinedNodeList(items=[_joined_node(r) for r in self._joins(caller).list_nodes()])

    async def _cluster_node_revoke_op(self, caller: Caller, b: NodeRef) -> None:
        self._joins(caller).revoke_node(b.id)

    async def _upload_refused(self, caller: Caller, b: Any) -> Any:
        raise InvalidArgument("an image upload streams its tar as the request body: use "
                              "REST (POST /v1/images or /v1/images/import)")


# Failures of the apiserver's own link to an edge (never the caller's connection).
_LINK_ERRORS = (TransportError, ProtocolError, RequestTimeout)

# Operations the edge resumes a paused sandbox for (its transparent resume, ``_ready``;
# ``processes.start``): the control plane resumes it first, within the project's quota
# (red team 19, B3). Pause, get, stats, destroy, snapshot, ports listing do not wake.
# Sandbox rows forwarded as they are whose unary replies can be large: held within their
# tenant's reply budget (events and read_file too, in ApiService.events/read_file).
_BIG_REPLIES = frozenset(o.name for o in (ops.EXEC, ops.LIST_DIR, ops.PROCESS_LIST))
_REPLY_OVERHEAD = 4096    # an exec reply's fields besides its output (msgpack or JSON)


def _reply_size(rep: object) -> int:
    """Bytes a reply holds: an exec's output (and its fields), else its msgpack size."""
    if isinstance(rep, ExecResult):
        return len(rep.stdout) + len(rep.stderr) + _REPLY_OVERHEAD
    if isinstance(rep, bytes):
        return len(rep)
    return len(_msgpack.encode(rep))


_WAKES = frozenset(o.name for o in (
    ops.EXEC, ops.EXEC_MANY, ops.EXEC_STREAM, ops.WRITE_FILE, ops.MKDIR, ops.REMOVE,
    ops.FILE_WRITE_STREAM, ops.FILE_RENAME, ops.PROCESS_START, ops.PORT_CONNECT))


def _edge_lied(node: str, what: str) -> RemoteProtocolError:
    log.warning("edge %s answered about a sandbox that is not what it was asked for "
                "(%s): refused (is this edge compromised?)", node, what)
    return RemoteProtocolError(
        f"node {node} answered a create with another sandbox than it was asked for "
        f"({what}); the create is refused there", node=node)


def _answer_of(node: str, sid: str | None, spec: SandboxSpec,
               info: SandboxInfo) -> SandboxInfo:
    """An edge's answer to a create, as the control plane records it: the sandbox must
    be ``sid`` (when one was asked for) or at least one of ``node``'s ids (an id names
    its node: red team 16, F3), and it is the sandbox ``spec`` asked for (the edge's
    echo of the spec, its project above all, is not taken as the record's)."""
    try:
        own = node_of(info.id) == node
    except InvalidArgument:
        own = False
    if not own or (sid is not None and info.id != sid):
        raise _edge_lied(node, f"it answered {info.id[:80]!r}")
    if info.node != node or project_of(info.spec) != project_of(spec):
        info = msgspec.structs.replace(info, node=node, spec=msgspec.structs.replace(
            info.spec, project=project_of(spec)))
    return info


class _IdInUse(InvalidTransition):
    """The edge already has the sandbox id a create under a claim asked for."""

    def __init__(self, sid: str) -> None:
        super().__init__(f"sandbox id {sid} is already in use on its node", sandbox_id=sid)


def api_key_of(authorization: str | None) -> str:
    """The API key an ``Authorization`` header value carries, in every spelling the
    apiserver accepts (``Bearer <key>`` with any case and any run of spaces, or a bare
    key); raises Unauthenticated for none or another scheme. The one parser: the port
    proxy strips what this accepts before a request reaches a sandbox."""
    if not authorization:
        raise Unauthenticated(
            "no API key: send 'Authorization: Bearer <key>' (dsec up prints the "
            "admin key and writes it to its state dir's local.json)")
    scheme, _, key = authorization.partition(" ")
    if not key:
        key = scheme
    elif scheme.lower() != "bearer":
        raise Unauthenticated(
            f"unsupported authorization scheme {scheme[:20]!r}: use 'Bearer <key>'")
    return key.strip()


def _replayed(data: bytes) -> SandboxInfo:
    """A keyed create's stored answer (its spec resolved: an answer an older release
    stored omitted backend/project at their old defaults)."""
    info = _info_dec.decode(data)
    info.spec = stored(info.spec)
    return info


def _backend_name(name: str) -> BackendName:
    """The configured default backend as a :data:`BackendName`."""
    for known in get_args(BackendName):
        if name == known:
            return cast(BackendName, known)
    raise InvalidArgument(f"the apiserver's default backend {name!r} is not a backend "
                          f"({', '.join(get_args(BackendName))}); name one in the "
                          "create", field="backend")


def _settle_keyed(keyed: set[asyncio.Future[SandboxInfo | None]],
                  ) -> Callable[[asyncio.Future[SandboxInfo | None]], None]:
    """Done callback of a keyed create's work: forget it, and mark its error retrieved
    (its caller may have gone; the error went to the key's waiters already)."""
    def done(work: asyncio.Future[SandboxInfo | None]) -> None:
        keyed.discard(work)
        if not work.cancelled():
            work.exception()
    return done


def _new_sandbox_id(node: str) -> str:
    """A fresh sandbox id on ``node`` (for creates whose id must be noted before the edge
    is asked); 48 random bits, as the edge's own ids."""
    return f"sb-{secrets.token_hex(6)}-{node}"


def _unreachable(node: str, op: str, sid: str, exc: BaseException, *, effect: bool,
                 sent: bool) -> EdgeUnreachable:
    """The caller-facing error for a failure of the apiserver's link to ``node``."""
    if isinstance(exc, ConnectFailed) or (isinstance(exc, DsecError)
                                          and exc.detail.get("retryable")):
        sent = False  # could not connect, or the edge said it did not process it
    why = f"{type(exc).__name__}: {getattr(exc, 'message', exc)}"[:300]
    what = f"{op} of sandbox {sid}" if sid else op
    if not effect:
        outcome = "retry in a few seconds"
    elif not sent:
        outcome = f"the {op} was not carried out; retry in a few seconds"
    elif op == "exec":
        outcome = ("the command may have run (the request reached the link before it "
                   "failed): check its effects before running it again")
    else:
        outcome = f"the {op} may have happened; check before repeating it"
    return EdgeUnreachable(
        f"the apiserver lost its link to node {node} during {what} ({why}); {outcome}",
        node=node, sandbox_id=sid or None, may_have_run=effect and sent)


def _lost_error(lost: Lost) -> SandboxLost:
    """The error for an operation on a sandbox written off with its node."""
    sid = lost.info.id
    detail = lost.events[-1].detail if lost.events else ""
    return SandboxLost(
        f"sandbox {sid} was lost with its node ({lost.info.reason}: {detail}); it will not "
        "come back: create a new one", sandbox_id=sid, state="destroyed",
        reason=lost.info.reason)


def _snapshot_not_found(ref: str) -> ImageNotFound:
    """One message for a snapshot that does not exist and one of another project."""
    return ImageNotFound(f"no snapshot {ref[:80]!r} visible to this API key (check the id "
                         "and that your key has a role on its project)", ref=ref[:80])


def _not_found(sid: str) -> SandboxNotFound:
    """One message for "never existed", "wrong node" and "another project's": ids must
    not leak across projects, so all three read exactly alike."""
    return SandboxNotFound(f"no sandbox {sid[:80]!r} visible to this API key (check the id "
                           "and that your key has a role on its project)", sandbox_id=sid[:80])


# ------------------------------------------------------------------ conversions
def _encode_cursor(last_id: str) -> str:
    return base64.urlsafe_b64encode(last_id.encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> str:
    try:
        pad = "=" * (-len(cursor) % 4)
        text = base64.urlsafe_b64decode(cursor + pad).decode()
        parse_sandbox_id(text)
        return text
    except (ValueError, UnicodeDecodeError, InvalidArgument):
        raise InvalidArgument(f"invalid cursor {cursor[:40]!r}: pass next_cursor from the "
                              "previous page unchanged", field="cursor") from None


def snapshot_view(info: SnapshotInfo, nodes: list[str]) -> SnapshotView:
    """Edge SnapshotInfo -> API form."""
    return SnapshotView(id=info.id, sandbox_id=info.sandbox_id, node=info.node or nodes[0],
                        nodes=list(nodes), project=info.project, parent=info.parent,
                        image=info.image, workspace=info.workspace,
                        toolkits=list(info.toolkits), backend=info.backend,
                        size_bytes=info.size_bytes, created_at=info.created,
                        unchanged=info.unchanged, build_step=info.build_step,
                        stack=list(info.stack))


def _token_view(row: Any, token: str | None = None) -> JoinTokenView:
    """A stored join token (``JoinTokenRow``) as the API shows it."""
    return JoinTokenView(id=row.id, uses=row.uses, used=row.used, created_at=row.created_at,
                         expires_at=row.expires_at, revoked=row.revoked,
                         description=row.description, token=token)


def _joined_node(row: Any) -> JoinedNode:
    """A joined node's row (``NodeRow``) as the API shows it."""
    return JoinedNode(node_id=row.node_id, address=row.address,
                      cert_fingerprint=row.cert_fingerprint, token_id=row.token_id,
                      joined_at=row.joined_at, revoked=row.revoked)
