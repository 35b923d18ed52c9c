"""Wiring of the real control plane into the apiserver's seams.

:class:`ControlPlane` holds the state store (SQLite), IAM, the quota index, the registry,
placement and the edge directory, and implements what :class:`ApiService` asks of them
(:class:`Authority`, :class:`QuotaGate`, :class:`Placer`, :class:`NodeDirectory`) and the
background loops. Administration (projects, quotas, keys, sessions) is
:class:`~dsec.control.api.admin.Admin` and the image routes
:class:`~dsec.control.api.images.ImageAdmin`, built over the plane's parts
(``plane.admin``, ``plane.images``). The loops: edge heartbeats (which feed
placement, the watcher and the ``/metrics`` gauges), the edge event feeds (which keep the
registry and quota usage in step with what edges reap on their own: TTL, idle, OOM), and
the leak sweeper (:mod:`dsec.control.sweeper`).

Keeping the registry in step with the edges (it answers ``GET /v1/sandboxes``):

- creates, destroys, pauses and resumes made through this apiserver are recorded at once;
- every poll reads the edge's event feed (TTL/idle reaps, backend deaths, auto-pauses);
- every ``sandbox_list_interval_s`` (5 s) a poll also reconciles the registry with the
  edge's full sandbox list (read in pages, bounded: see ``_whole_list``), which repairs
  what a feed cannot tell: events that fell out of the edge's bounded feed
  (``EventFeed.lost``), a create whose edge-side death raced its registration, sandboxes
  adopted by a restarted edge or created by another replica whose commit this one has
  not read yet (adopted from the store's row, not written again); a list whose digest
  equals the registry's for the node (``Registry.node_digest``) is in step and skipped;
- other replicas' creates, pauses and removals arrive through the store watch
  (``Registry.catch_up``), not through the lists;
- an edge whose feed sequence went backwards restarted: its feed is read from the start;
- an edge *silent* for ``node_ttl_s`` (refused or reset connections, no reply in time)
  is expired by the watcher: its sandboxes are evicted (reason ``node_lost``, quota
  released) and remembered as tombstones (in memory and in the store's
  ``lost_sandboxes`` table), so ``GET`` and ``/events`` of such a sandbox say what
  happened while its edge is unreachable; when the edge comes back they are destroyed
  there, never resurrected: by the watcher, or, after an apiserver restart (the watcher
  starts empty), by the reconcile step, which finds them in the tombstones loaded from
  the store;
- an edge this apiserver *failed to use* is not silent: when the poll fails on this
  side (out of file descriptors or ports: ``blind``) or the edge answers with an error or
  an overload refusal (``answered``), the node is held ``unreachable`` (out of
  placement, reported by ``GET /v1/nodes`` with the reason, sandboxes kept) and its TTL
  counts from that poll (see :mod:`dsec.control.watcher`).

Durable state is in the store only: sessions (``sessions`` table), idempotency keys
(``idempotency`` table, see :mod:`dsec.control.idempotency`) and lost-node tombstones
(``lost_sandboxes``) are shared by every replica over the same store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from dsec.control.api.admin import Admin
from dsec.control.api.images import ImageAdmin
from dsec.control.api.service import ApiService, Caller, EdgeOps
from dsec.control.ceiling import Ceiling, NodeSize
from dsec.control.claims import clamp_capacity, trusted_layers
from dsec.control.drain import Drains
from dsec.control.iam import Iam
from dsec.control.layers import LayerMeaning, LayerMover
from dsec.control.metrics import ApiMetrics
from dsec.control.placement import Decision, Placement, PlacementNode, PlacementRequest
from dsec.control.quota import Quota, QuotaIndex, ResumeHold
from dsec.control.reconcile import (
    Forget,
    Probe,
    ProbeResult,
    Quarantine,
    Record,
    RecordBrief,
    SetPaused,
    Settled,
    WriteOff,
    plan_reconcile,
    settle_probe,
    settle_unknown,
    split_listing,
)
from dsec.control.records import SandboxRecord
from dsec.control.registry import Registry, brief_hash
from dsec.control.retention import RetentionConfig, RetentionReport, retain
from dsec.control.store import (
    ImagePinRow,
    LostSandboxRow,
    SnapshotChargeRow,
    StateStore,
)
from dsec.control.sweeper import SESSION_LABEL, Session, SweepCandidate, plan_sweep
from dsec.control.watcher import (
    DestroySandboxes,
    EvictNode,
    LinkFailed,
    LiveSandbox,
    NodeHeartbeat,
    PreemptSandboxes,
    StallMeter,
    Tick,
    UpdateNode,
    Watcher,
    WatcherConfig,
    link_failure_cause,
)
from dsec.errors import (
    ConnectionLost,
    DsecError,
    ImageNotFound,
    InternalError,
    InvalidArgument,
    NoCapacity,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
    RemoteProtocolError,
    SandboxNotFound,
    Timeout,
    Unavailable,
)
from dsec.ids import NodeId, node_of
from dsec.image.manifest import PROJECT_LABEL, LayerManifest, layer_namespace, parse_ref
from dsec.wire import ops
from dsec.wire.api import (
    CreateKeyRequest,
    CreateKeyResponse,
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
    KeyList,
    NodeView,
    ProjectList,
    ProjectView,
    QuotaBody,
    SessionView,
)
from dsec.wire.cluster import NodeMigration
from dsec.wire.layers import (
    ImagePin,
    ImagePinRef,
    LayerFetch,
    LayerFetched,
    NodePins,
    PinSet,
    pins_fingerprint,
)
from dsec.wire.netpolicy import NetworkPolicy
from dsec.wire.node import MAX_FEED_EVENTS, MAX_LIST_PAGE
from dsec.wire.spec import (
    BACKEND_ISOLATION,
    SandboxEvent,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    backend_of,
    not_offered,
    project_of,
    resolve,
    stored,
)

__all__ = ["ControlPlane", "EdgeEntry", "IamAuthority", "LostSandbox", "PlaneConfig"]

log = logging.getLogger("dsec.control")

BACKEND_LABEL = "dsec.io/backend."


@dataclass(slots=True, frozen=True, kw_only=True)
class PlaneConfig:
    heartbeat_interval_s: float = 1.0      # how often the apiserver polls each edge
    # [lazy2] Image pins another replica stored reach a node within this long (this
    # replica's own pin/unpin at its next heartbeat): the stored set is read again per
    # edge this often (one small query), not on every heartbeat.
    pins_refresh_s: float = 5.0
    # Silent this long -> the node is lost: its sandboxes are evicted (node_lost) and
    # destroyed if it returns. An edge restarted (upgraded) within this grace keeps them;
    # `dsec up --node-ttl` sets it. Only silence counts (see the module docstring).
    node_ttl_s: float = 10.0
    # Deadline of one poll (connect, heartbeat, feed): a hung edge must not hold up the
    # polling of the others, nor delay its own expiry.
    poll_timeout_s: float = 5.0
    # How often a poll asks an edge for its whole sandbox list (what reconciles the
    # registry with the edge: feed events it lost, deaths racing their create, sandboxes
    # nobody recorded, which the sweeper then finds in quarantine). In between, a poll
    # takes the light heartbeat (usage, counts) and the event feed, and keeps the last
    # list minus what the feed says ended: O(changes), not O(sandboxes). Another
    # replica's sandboxes do not wait for it: the store watch applies them
    # (Registry.catch_up: at once with PostgreSQL's push, within store_poll_s on SQLite).
    # 0: at every poll. Measured (bench suite cluster, 50 edges, 2 replicas): listing
    # at every 1 s poll made polling 34% of a replica's CPU at 100k live sandboxes and
    # the create rate fell from ~1,300/s (10k-50k live) to ~300/s (50k-100k); with 5 s
    # a full list is one poll in five and its share a fifth (py-spy, 10k-50k live,
    # 20 edges: _reconcile 10% -> see docs/benchmarks.md "cluster").
    # `dsec apiserver --sandbox-list-interval`.
    sandbox_list_interval_s: float = 5.0
    sweep_interval_s: float = 5.0
    # A sandbox an edge lists with no record in the store is quarantined (not charged,
    # not listed); still without a record this long after it was first seen, it is an
    # orphan (a create cut off after the edge made it: its caller gone, a create that
    # outlived the edge link's 60 s call deadline and was placed elsewhere) and is
    # destroyed (reason ``orphaned``). Well past any create still in flight (2x the
    # link's 60 s call deadline, plus a slow image fetch). None: never destroyed.
    quarantine_grace_s: float | None = 300.0
    unknown_session_grace_s: float = 180.0
    session_retention_s: float = 86_400.0  # a lapsed session's row is kept (renewable) this long
    min_lease_s: float = 5.0
    max_lease_s: float = 86_400.0
    lost_tombstones: int = 100_000         # evicted sandboxes remembered for GET/events
    reconnect_interval_s: float = 1.0      # retry an unreachable edge's connection
    # Session rows one principal may hold (open, lapsed ones kept for renewal, closed ones
    # not yet swept). Without a cap a key with the least role filled the store: 20,000
    # sessions took 3.3 s to open here, and every sweeper pass reads all of them (0.15 s
    # per 20,000, on the event loop), so a few minutes of it stalled the apiserver for
    # every tenant. None: no cap.
    max_sessions_per_principal: int | None = 10_000
    # API keys (revoked ones included: their rows stay) one principal may have; without
    # a cap any principal minted extra keys of its own without limit (the store grows
    # ~20,000 rows a second per key holder). None: no cap.
    max_keys_per_principal: int | None = 1_000
    # How much history the state store keeps (events, idempotency keys, tombstones,
    # process leases), trimmed every retention.interval_s: see dsec.control.retention.
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    # How often the apiserver checks that its own event loop runs (StallMeter): a poll
    # that timed out while the loop was stalled for half its deadline is this side's
    # blindness, not the edge's silence.
    stall_tick_s: float = 0.1
    # How stale this replica's copy of the quotas (network ceilings included) may get:
    # another apiserver replica over the same store may have set one. Re-read from the
    # store at most this often, when a create is admitted or a ceiling checked (a
    # ceiling narrowed on one replica used to bind the others only after their restart).
    quota_refresh_s: float = 2.0
    # Learning other replicas' writes (Registry.catch_up): a store that pushes
    # (PostgreSQL LISTEN/NOTIFY) wakes the reader at once and is also read every
    # store_push_poll_s in case a notification was lost; one that cannot (SQLite) is
    # polled every store_poll_s.
    store_poll_s: float = 1.0
    store_push_poll_s: float = 5.0
    # A mutation is committed this long after it was queued (more that come meanwhile
    # ride in the same transaction), so other replicas see it within milliseconds rather
    # than at the next heartbeat tick. None: only at ticks (and full batches). Each flush
    # is one store round trip on the event loop: 10 ms bounds it to 100 a second.
    flush_delay_s: float | None = 0.01
    # The most sandboxes one edge's list may hold (read a page of MAX_LIST_PAGE at a
    # time): an edge is a network peer, and one that claims more is refused (held as
    # answering wrongly, see ControlPlane._whole_list) instead of costing every
    # replica unbounded work. None: no cap.
    max_listed_per_node: int | None = 500_000
    list_page: int = MAX_LIST_PAGE         # sandboxes per page of an edge's list (1..max)


class IamAuthority:
    """API key -> :class:`Caller` with the principal's role bindings resolved once."""

    def __init__(self, iam: Iam, store: StateStore) -> None:
        self.iam = iam
        self.store = store

    def authenticate(self, api_key: str) -> Caller:
        p = self.iam.authenticate(api_key)
        bindings = self.store.list_role_bindings(p.id)
        roles = {b.project: b.role for b in bindings}
        default = min(roles, key=lambda s: (s.count("/"), s)) if roles else "default"
        return Caller(id=p.id, name=p.name, roles=roles, superuser=p.superuser,
                      default_project=default)


@dataclass(slots=True)
class EdgeEntry:
    """One edge as the apiserver knows it: how to reach it and what it last said."""

    node: str
    address: str
    link: EdgeOps
    heartbeat: Any = None           # dsec.wire.node.Heartbeat
    last_seen: float = 0.0
    feed_after: int = 0
    images: frozenset[str] = frozenset()    # image refs / snapshot ids the edge holds
    images_gen: int = 0                     # their fingerprint (Heartbeat.images_gen)
    # layers this apiserver copied onto the node: there by digest only (a name of this
    # apiserver's store means nothing to the node's store); bounded by the node's layers
    fetched: set[str] = field(default_factory=set)
    noted: set[str] = field(default_factory=set)  # snapshots taken since its heartbeat
    retry_at: float = 0.0                   # next reconnect attempt (link closed)
    token: bytes | str | None = None        # Aether token for reconnecting (tcp edges)
    tls: Any = None                         # a joined edge's EdgeTls (dsec.cluster.membership)
    revoked: str = ""                       # why it was revoked ("": it is not; revoke_edge)
    # How the last poll failed ("" = it worked): "answered" / "blind" hold the node
    # (unreachable, not lost), "silent" counts toward node_ttl_s; and what happened.
    failure: str = ""
    problem: str = ""
    # Held by whoever runs the edge (``dsec up``'s supervisor restarting it) until this
    # time: its silence does not count toward node_ttl_s meanwhile (see hold_edge).
    held_until: float = 0.0
    held_why: str = ""
    # The sandboxes of its last full list (LiveSandbox), kept up to date from the feed
    # between lists, and when that list was taken (PlaneConfig.sandbox_list_interval_s).
    live: tuple[Any, ...] = ()
    listed_at: float = float("-inf")
    # Whether its heartbeat's claims are taken as they are (an edge of this host or the
    # operator's --edge list) or checked (a joined node: dsec.control.claims), and the
    # capacity it registered with (the first this apiserver heard) for the check.
    trusted: bool = True
    registered: Any = None
    clamp_noted: bool = False
    # [lazy2] The images pinned on it as last read from the store (None: read at the
    # next heartbeat), when, and the node_pins call in flight (see _deliver_pins).
    pins: tuple[str, ...] | None = None
    pins_read_at: float = float("-inf")
    pins_task: Any = None


class LostSandbox(msgspec.Struct, frozen=True, kw_only=True):
    """A sandbox the control plane evicted because its node was lost: what ``GET`` and
    ``/events`` answer while the edge is unreachable (the edge destroys it on return)."""

    info: SandboxInfo
    events: list[SandboxEvent]


@dataclass
class ControlPlane:
    """See the module docstring. Build with :meth:`open`, then ``await start()``."""

    store: StateStore
    iam: Iam
    quota: QuotaIndex
    registry: Registry
    metrics: ApiMetrics
    config: PlaneConfig = field(default_factory=PlaneConfig)
    clock: Callable[[], float] = time.time
    edges: dict[str, EdgeEntry] = field(default_factory=dict)
    service: ApiService | None = None
    placement: Placement = field(default_factory=lambda: Placement(rng=random.Random()))
    ceiling: Ceiling = field(default_factory=Ceiling)   # refuses what no node could hold
    watcher: Watcher = field(default_factory=Watcher)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    # each edge's poll in flight (the heartbeat loop), and when it started (loop time)
    _polling: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _group_commit: asyncio.Future[None] | None = None    # the next shared flush (durable)
    _poll_started: dict[str, float] = field(default_factory=dict)
    _pending: int = 0
    _started_at: float = 0.0     # since when the sweeper has watched without a break
    _last_sweep: float = 0.0
    _lost: OrderedDict[str, LostSandbox] = field(default_factory=OrderedDict)
    _stalls: StallMeter | None = None
    _quotas_read: float = float("-inf")   # when the quota index was last read from the store
    # Live sandboxes an edge lists that the control plane has no record of (node -> id ->
    # when first seen): held aside, not charged nor listed (dsec.control.reconcile).
    _quarantined: dict[str, dict[str, float]] = field(default_factory=dict)
    # The session label of each quarantined sandbox, as its edge answered (the sweeper
    # sweeps those whose session lapsed: see _quarantined_candidates).
    _quarantine_sessions: dict[str, str | None] = field(default_factory=dict)
    # When each node was last logged for reporting ids that are not its own.
    _foreign_logged: dict[str, float] = field(default_factory=dict)
    # Tombstones not yet in the store (it was down when their sandboxes were written
    # off): written before the registry's next batch (Registry.before_flush), which
    # holds their removals, so a removal is never durable without its tombstone.
    _unsaved_lost: dict[str, LostSandboxRow] = field(default_factory=dict)
    # The store's snapshot charge rows by id, as last read (see snapshot_record).
    _snapshot_rows: dict[str, SnapshotChargeRow] = field(default_factory=dict)
    # each node's last view from the watcher (drain/undrain re-place it at once)
    _views: dict[str, PlacementNode] = field(default_factory=dict)
    # Administration (projects, quotas, keys, sessions) and the image routes, over this
    # plane's parts: see dsec.control.api.admin and dsec.control.api.images.
    admin: Admin = field(init=False)
    images: ImageAdmin = field(init=False)
    # Nodes drained by an administrator (dsec.control.drain): no new placements there.
    drains: Drains = field(init=False)
    mover: LayerMover = field(init=False)     # layers between nodes (dsec.control.layers)

    def __post_init__(self) -> None:
        self.drains = Drains(self.store, clock=self.clock,
                             refresh_s=self.config.quota_refresh_s)
        self.admin = Admin(store=self.store, iam=self.iam, quota=self.quota,
                           registry=self.registry, limits=self.config, clock=self.clock,
                           sync_snapshots=self._sync_snapshots, caches=lambda: self.service,
                           image_bytes=lambda project: self.images.image_bytes(project))
        self.images = ImageAdmin(self, state=self.store)
        self.mover = LayerMover(link=lambda n: self.edge(NodeId(n)),
                                holders=self._holders, holds=self._node_has,
                                nodes=self._healthy_nodes, copied=self._copied_layer,
                                note=self._note_layer, meaning=self._layer_meaning,
                                lazy=self._node_lazy, pushed=self._pushed_manifest)

    @property
    def layer_dir(self) -> str | None:
        """The shared layer store's directory (None: no layer store; see ImageAdmin)."""
        return self.images.layer_dir

    @layer_dir.setter
    def layer_dir(self, path: str | None) -> None:
        self.images.layer_dir = path

    @classmethod
    def open(cls, store: StateStore, *, metrics: ApiMetrics, config: PlaneConfig | None = None,
             clock: Callable[[], float] = time.time) -> ControlPlane:
        iam = Iam(store, clock=clock)
        quota = QuotaIndex()
        for row in store.list_quotas():
            quota.set_quota(row.project, msgspec.convert(row.quota, Quota))
        for charge in store.list_snapshot_charges():
            quota.add_snapshot(charge.id, charge.project, charge.size_bytes)
        registry = Registry(store, clock=clock, quota=quota)
        cfg = config or PlaneConfig()
        plane = cls(store=store, iam=iam, quota=quota, registry=registry, metrics=metrics,
                    config=cfg, clock=clock,
                    watcher=Watcher(WatcherConfig(ttl_s=cfg.node_ttl_s)))
        plane._quotas_read = clock()
        registry.before_flush.append(plane._save_lost)
        metrics.on_scrape(plane._refresh_gauges)
        for lost in store.list_lost(cfg.lost_tombstones):
            try:
                tomb = plane._lost[lost.id] = msgspec.convert(lost.record, LostSandbox)
                # written by an older release: an omitted backend/project meant the old
                # defaults (wire.spec.stored); readers take a tombstone's spec as resolved
                tomb.info.spec = stored(tomb.info.spec)
            except msgspec.ValidationError:
                log.warning("unreadable lost-node tombstone %s ignored", lost.id)
        return plane

    # ------------------------------------------------------------ bootstrap
    def bootstrap_admin(self, principal_id: str = "admin") -> str:
        """Create the superuser (if absent) and return a fresh API key for it."""
        try:
            self.iam.get_principal(principal_id)
        except NotFound:
            self.iam.create_principal(principal_id, name=principal_id, superuser=True)
            self.iam.grant(principal_id, "default", "admin")
        return self.iam.create_key(principal_id).token

    # -------------------------------------------------------------- edges
    def add_edge(self, node: str, address: str, link: EdgeOps, *,
                 token: bytes | str | None = None, tls: Any = None,
                 trusted: bool | None = None) -> None:
        """Register an edge; ``token`` and ``tls`` are what :meth:`_link` reconnects with.
        ``trusted``: take its heartbeat's capacity and held-layer claims as they are
        (default: unless it is a joined node, ``tls``; see dsec.control.claims)."""
        self.edges[node] = EdgeEntry(node=node, address=address, link=link, token=token,
                                     tls=tls, trusted=tls is None if trusted is None
                                     else trusted)

    async def revoke_edge(self, node: str, *, reason: str, detail: str) -> int:
        """Stop using edge ``node`` for good (a revoked joined node): out of placement,
        its link cut and never redialled, and every sandbox recorded on it written off
        with ``reason`` (an event each, and a tombstone: GET and /events answer it as
        lost). The entry stays, status ``revoked``, so its sandbox ids still route to
        their tombstones. Returns how many sandboxes were written off."""
        e = self.edges.get(node)
        again = e is not None and bool(e.revoked)
        if e is not None:
            # first: no new poll uses the link, and placement and health see it gone
            e.revoked, e.heartbeat = detail, None
        self.placement.remove(node)
        # The records are written off (tombstones durable) before the edge is asked to
        # destroy anything: a poll in flight that brings its destroy events back finds
        # them already gone, and GET answers node_revoked either way.
        now = self.clock()
        rows = [self._tombstone(rec, reason, now, detail=detail)
                for rec in self.registry.evict_node(node, reason=reason)]
        if rows:
            self.store.put_lost(rows, keep=self.config.lost_tombstones)
        self.registry.flush()
        if e is not None and rows and not again:
            # Ask it to destroy them while the link is still up: a decommissioned edge
            # cleans up; one that does not answer (or is hostile) is cut off anyway.
            try:
                got = await e.link.destroy_many([r.id for r in rows], reason=reason,
                                                timeout=self.config.poll_timeout_s)
                failed = [str(r) for r in got if isinstance(r, DsecError)]
                if failed:
                    log.warning("revoked edge %s did not destroy %d sandbox(es): %s", node,
                                len(failed), "; ".join(failed[:3]))
            except DsecError as exc:
                log.warning("revoked edge %s did not destroy its sandboxes: %s", node, exc)
        if e is not None:
            try:
                await e.link.close()
            except DsecError:
                pass
        log.warning("edge %s revoked (%s): %d sandbox(es) written off", node, detail,
                    len(rows))
        return len(rows)

    def edge(self, node: NodeId) -> EdgeOps | None:
        e = self.edges.get(node)
        return e.link if e is not None else None

    def _healthy(self, e: EdgeEntry, now: float) -> bool:
        return (e.heartbeat is not None and now - e.last_seen <= self.config.node_ttl_s
                and e.failure in ("", "silent"))

    def _status(self, e: EdgeEntry, now: float) -> tuple[str, str]:
        """(status, problem) of one edge for ``GET /v1/nodes``: ``healthy``;
        ``unreachable`` (this apiserver failed to use its link, or it answered with an
        error: held, sandboxes kept); ``silent`` (no answer: lost after node_ttl_s);
        ``lost`` (expired: its sandboxes were evicted)."""
        if e.revoked:
            return "revoked", e.revoked
        if self.watcher.is_expired(e.node):
            return "lost", e.problem or f"no heartbeat for more than {self.config.node_ttl_s:g}s"
        if e.failure in ("answered", "blind"):
            return "unreachable", e.problem
        if e.failure == "silent" or e.heartbeat is None:
            left = self.config.node_ttl_s - (now - e.last_seen)
            why = e.problem or "no heartbeat yet"
            if e.heartbeat is not None:
                why += f"; written off as lost in {max(left, 0.0):.1f}s unless it answers"
            return "silent", why
        return "healthy", ""

    def nodes(self) -> list[NodeView]:
        return [self._view(e, self.clock()) for e in self.edges.values()]

    def _view(self, e: EdgeEntry, now: float) -> NodeView:
        hb = e.heartbeat
        status, problem = self._status(e, now)
        drain = self.drains.get(e.node)
        drained, drained_at = drain is not None, 0.0 if drain is None else drain.drained_at
        if hb is None:
            return NodeView(id=e.node, address=e.address, healthy=False, status=status,
                            problem=problem, drained=drained, drained_at=drained_at)
        return NodeView(
            id=e.node, address=e.address, healthy=self._healthy(e, now),
            status=status, problem=problem,
            backends=list(hb.backends), cpu_milli_total=hb.capacity.cpu_milli,
            cpu_milli_used=hb.usage.cpu_milli, memory_bytes_total=hb.capacity.memory_bytes,
            memory_bytes_used=hb.usage.memory_bytes, max_sandboxes=hb.capacity.sandboxes,
            sandboxes=hb.usage.sandboxes, by_state=dict(hb.counts), labels=dict(hb.labels),
            last_heartbeat=hb.time, drained=drained, drained_at=drained_at)

    def _place_view(self, view: PlacementNode) -> None:
        """Hand a node's view to placement; a drained node as unhealthy, so it is out of
        the candidate pools (place() also excludes drains made on other replicas since)."""
        if view.healthy and view.node in self.drains.nodes():
            view = msgspec.structs.replace(view, healthy=False)
        self.placement.update(view)

    def drain_node(self, caller: Caller, node: str, *, drained: bool) -> NodeView:
        """Drain (``drained``) or undrain an edge node: a superuser's, since a node
        serves every project. Durable before answered (the store row)."""
        verb = "drain" if drained else "undrain"
        if not caller.superuser:
            raise PermissionDenied(
                f"cannot {verb} node {node!r}: a node serves every project, so only a "
                f"superuser may (principal {caller.name!r} is not one)")
        e = self.edges.get(node)
        if e is None:
            raise NotFound(f"no edge node {node!r} in this cluster; known: "
                           f"{', '.join(sorted(self.edges)) or 'none'} (dsec node ls)",
                           node=node)
        if drained:
            self.drains.drain(node, by=caller.id)
            log.warning("node %s drained by %s: no new placements", node, caller.name)
        else:
            self.drains.undrain(node)
            log.warning("node %s undrained by %s", node, caller.name)
        view = self._views.get(node)
        if view is not None and not self.watcher.is_expired(node):
            self._place_view(view)     # now, not at its next heartbeat
        return self._view(e, self.clock())

    # ------------------------------------------------------------- image pins
    # Issue 17: an operator keeps an image fully cached on chosen nodes (the node's lazy
    # layers fetch it whole and never evict it). Stored (image_pins), so every replica
    # and a restarted apiserver answer the same pins; the node reads its own
    # (pins_for), the lazy layers act on them.
    def _pin_node(self, caller: Caller, node: str, verb: str) -> None:
        if not caller.superuser:
            raise PermissionDenied(
                f"cannot {verb} an image on node {node!r}: a node's cache serves every "
                f"project, so only a superuser may (principal {caller.name!r} is not one)")
        if node not in self.edges:
            raise NotFound(f"no edge node {node!r} in this cluster; known: "
                           f"{', '.join(sorted(self.edges)) or 'none'} (dsec node ls)",
                           node=node)

    @staticmethod
    def _pin_view(r: ImagePinRow) -> ImagePinView:
        return ImagePinView(node=r.node, image=r.image, ref=r.ref, layers=list(r.layers),
                            pinned_at=r.pinned_at, by=r.by)

    async def pin_image(self, caller: Caller, req: ImagePin) -> ImagePinView:
        """Pin the image ``req.ref`` on ``req.node`` (again: unchanged). The image must be
        in the blob store whole (every layer: ``dsec image push`` first), since that is
        where the node fetches it from. Durable before answered."""
        self._pin_node(caller, req.node, "pin")
        top, chain = await self.images.pushed_chain(caller, req.ref)
        self.store.put_pin(ImagePinRow(node=req.node, image=top, ref=req.ref,
                                       layers=tuple(chain), pinned_at=self.clock(),
                                       by=caller.id))
        log.warning("image %s (%s) pinned on node %s by %s", req.ref, top, req.node,
                    caller.name)
        self.edges[req.node].pins = None        # sent with its next heartbeat
        for r in self.store.list_pins(req.node):
            if r.image == top:
                return self._pin_view(r)
        raise InternalError(f"pin of {top} on {req.node} was written but not read back")

    async def unpin_image(self, caller: Caller, req: ImagePinRef) -> None:
        self._pin_node(caller, req.node, "unpin")
        if not self.store.delete_pin(req.node, req.image):
            raise NotFound(f"image {req.image} is not pinned on node {req.node} "
                           "(dsec image pins NODE)", node=req.node, image=req.image)
        log.warning("image %s unpinned on node %s by %s", req.image, req.node, caller.name)
        self.edges[req.node].pins = None

    def list_pins(self, caller: Caller, req: NodePins) -> ImagePinList:
        self._pin_node(caller, req.node, "list the pinned images of")
        return ImagePinList(items=[self._pin_view(r) for r in self.store.list_pins(req.node)])

    def pins_for(self, node: str) -> list[ImagePinRow]:
        """The images pinned on ``node`` (what its lazy layers keep whole)."""
        return self.store.list_pins(node)

    def _deliver_pins(self, e: EdgeEntry, link: Any, pins_gen: int) -> None:
        """After a heartbeat: when the pin set the node reports applied (``pins_gen``)
        is not the stored one - a pin or unpin on any replica, or the edge restarted
        (it reports 0) - send it the whole set (``node_pins``), in the background (the
        edge resolves the images from the blob store), one call per edge at a time."""
        now = self.clock()
        if e.pins is None or now - e.pins_read_at >= self.config.pins_refresh_s:
            e.pins = tuple(sorted({r.image for r in self.store.list_pins(e.node)}))
            e.pins_read_at = now
        gen = pins_fingerprint(e.pins)
        if pins_gen == gen or (e.pins_task is not None and not e.pins_task.done()):
            return
        body = PinSet(images=list(e.pins), gen=gen)

        async def send() -> None:
            if self._node_lazy(e.node):
                # [lazy3] the node resolves pinned images only from the control plane's
                # manifests (red team 17 F1): grant each image's layers first
                for image in body.images:
                    try:
                        await self.mover.fetch(e.node, image, kind="image")
                    except DsecError as exc:
                        log.warning("pinned image %s not granted to node %s: %s", image,
                                    e.node, exc)
            try:
                await link.call(ops.NODE_PINS, body, timeout=60.0)
            except DsecError as exc:
                log.warning("image pins not delivered to node %s (retried at its next "
                            "heartbeat): %s", e.node, exc)
        e.pins_task = task = asyncio.create_task(send(), name=f"dsec-pins-{e.node}")
        self._tasks.append(task)            # cancelled by close()

        def done(t: asyncio.Task[None]) -> None:
            with contextlib.suppress(ValueError):
                self._tasks.remove(t)
        task.add_done_callback(done)

    async def migrate_node(self, caller: Caller, node: str, service: Any) -> NodeMigration:
        """``node_migrate``: move the sandboxes off a drained node (dsec.control.migrate)."""
        from dsec.control.migrate import migrate_node
        if node not in self.edges:
            raise NotFound(f"no node {node!r} in this cluster; GET /v1/nodes lists them",
                           node=node)
        return await migrate_node(service, caller, node,
                                  records=self.registry.sandboxes_on(node), store=self.store,
                                  drained=node in self.drains.nodes(), clock=self.clock)

    # ----------------------------------------------------------- placement
    # dsec.control.placement decides; the edge's backends travel as node labels
    # ``dsec.io/backend.<name>=1`` so a create selects nodes offering its backend.
    def place(self, spec: SandboxSpec, exclude: frozenset[str]) -> Decision:
        offered = {b for e in self.edges.values() if e.heartbeat is not None
                   for b in e.heartbeat.backends}
        if offered and spec.backend not in offered:
            # Asking for a backend nobody runs is a request problem (400), not a lack of
            # capacity (503) that a retry could fix.
            raise not_offered(spec, offered, "any node of this cluster")
        self.ceiling.check(backend=backend_of(spec), cpu_milli=spec.cpu_milli,
                           memory_bytes=spec.memory_bytes, disk_bytes=spec.disk_bytes)
        # Image refs as the edges report them (Heartbeat.images): placement scores nodes
        # that already hold the image's layers higher (locality, no first-mount cost).
        refs = (spec.image, *((spec.workspace,) if spec.workspace else ()), *spec.toolkits)
        if spec.backend in LAYERED_BACKENDS:
            refs = tuple(self._digest_of(r) for r in refs)
        req = PlacementRequest(cpu_milli=spec.cpu_milli, memory_bytes=spec.memory_bytes,
                               selector={f"{BACKEND_LABEL}{spec.backend}": "1"},
                               group=project_of(spec), layers=refs, qos=spec.qos)
        drained = self.drains.nodes()
        if drained:
            exclude = exclude | drained
        if spec.snapshot is not None:
            return self._place_on_holder(spec.snapshot, req, exclude,
                                         movable=spec.backend in LAYERED_BACKENDS)
        return self.placement.place(req, exclude=exclude)

    # Snapshots live in the layer store of the node that took them. A sandbox started
    # from one goes preferably to a node holding it (the snapshot's digest is the
    # request's layer: k-choice's locality draw and score), and to any other node with
    # room otherwise, which fetches the chain from a holder first (ensure_layers, issue
    # 16). A snapshot on no healthy node cannot start anywhere.
    # Backends whose snapshots are not layers (simulated, fncall) cannot move them: there
    # the holders are a hard filter, scored directly (they are few).
    def _place_on_holder(self, ref: str, req: PlacementRequest, exclude: frozenset[str],
                         *, movable: bool) -> Decision:
        holders = self._holders(ref)
        if not holders:
            raise ImageNotFound(
                f"snapshot {ref[:80]!r} is on no healthy node of this cluster; snapshots live "
                "on the node that took them (GET /v1/snapshots lists them)", ref=ref[:80])
        if movable:
            return self.placement.place(msgspec.structs.replace(req, layers=(ref,)),
                                        exclude=exclude)
        best: tuple[float, str] | None = None
        for n in holders:
            if n in exclude:
                continue
            sc = self.placement.score(n, req)
            if sc is not None and (best is None or sc > best[0]):
                best = (sc, n)
        if best is None:
            raise NoCapacity(
                f"no node holding snapshot {ref[:80]} can take cpu_milli={req.cpu_milli}, "
                f"memory_bytes={req.memory_bytes} (holders {sorted(holders)}, refused "
                f"{sorted(exclude)}); free capacity there or snapshot elsewhere",
                candidates=len(holders), refused=sorted(exclude))
        return self.placement.commit_to(best[1], req)

    # ------------------------------------------------------ layers between nodes
    def _digest_of(self, ref: str) -> str:
        """The digest this apiserver's store names ``ref`` by (names are per store,
        digests the same on every node: placement's locality compares digests), or
        ``ref`` itself (a digest, or a name of no store here)."""
        if _is_digest(ref) or self.images.layer_dir is None:
            return ref
        index = self.images._index()
        if index is None:
            return ref
        try:
            return index.digest_of(parse_ref(ref).key) or ref
        except InvalidArgument:
            return ref

    def _holders(self, ref: str) -> list[str]:
        """Healthy nodes holding ``ref`` (as they reported, or were given since)."""
        now = self.clock()
        return [n for n, e in self.edges.items() if self._healthy(e, now) and _holds(e, ref)]

    def _healthy_nodes(self) -> list[str]:
        now = self.clock()
        return [n for n, e in self.edges.items() if self._healthy(e, now)]

    def _node_holds(self, node: str, ref: str) -> bool:
        e = self.edges.get(node)
        return e is not None and _holds(e, ref)

    def _node_has(self, node: str, digest: str) -> bool:
        """Whether ``node`` holds ``digest`` (reported) or was given it by digest (a copy,
        or a grant to read it lazily): nothing to move there. Only reported layers make
        a node a holder others copy from (``_holders``)."""
        e = self.edges.get(node)
        return e is not None and (_holds(e, digest) or digest in e.fetched)

    def _node_lazy(self, node: str) -> bool:
        """[lazy3] Whether ``node`` reads layers lazily from the blob store (its last
        heartbeat says so): it is granted pushed layers instead of their bytes."""
        e = self.edges.get(node)
        return e is not None and bool(getattr(e.heartbeat, "lazy", False))

    def _pushed_manifest(self, digest: str) -> LayerManifest | None:
        """[lazy3] This control plane's own manifest of a layer pushed to the blob store
        (the push recorded its chunk table's sha256: ``LayerStore.record_chunk_table``),
        or None. What a lazy node is granted comes from here, never from the blob
        store's ``.manifest`` (red team 17 F1)."""
        if self.images.layer_dir is None:
            return None
        try:
            store = self.images._layers()
            if not store.has(digest):
                return None
            m = store.get(digest)
        except DsecError:
            return None
        return m if m.chunk_table is not None else None

    def _note_layer(self, node: str, digest: str) -> None:
        e = self.edges.get(node)
        if e is not None:
            e.noted.add(digest)

    def _layer_meaning(self, digest: str) -> LayerMeaning | None:
        """What ``digest`` is, by this control plane's own word (red team 16 F1): the
        record written when the snapshot was taken or the image layer built/pulled
        through it (``snapshot_charges``), else this apiserver's own store's manifest of
        an image layer (built, pulled or imported here). A snapshot is never taken on
        an edge's word: one without a record does not move."""
        # one indexed row would do; the table is small next to a layer's bytes
        for row in self.store.list_snapshot_charges():
            if row.id == digest and row.kind is not None:
                labels = {PROJECT_LABEL: row.project} if row.kind == "snapshot" else {}
                return LayerMeaning(kind=row.kind, parent=row.parent, stack=row.stack,
                                    namespace=row.project, labels=labels)
        if self.images.layer_dir is None:
            return None
        try:
            store = self.images._layers()
            if not store.has(digest):
                return None
            m = store.get(digest)
        except DsecError:
            return None
        if m.kind == "snapshot":
            return None
        return LayerMeaning(kind=m.kind, parent=m.parent, stack=m.stack,
                            namespace=m.namespace, labels=dict(m.labels))

    def _copied_layer(self, node: str, digest: str) -> None:
        e = self.edges.get(node)
        if e is not None:
            e.fetched.add(digest)

    async def ensure_layers(self, node: str, spec: SandboxSpec) -> SandboxSpec:
        """Before ``spec`` is created on ``node``: copy onto it, from healthy holders,
        the layers it lacks (the snapshot's chain, or the image's, workspace's and
        toolkits' layers); the spec the edge should get. A name the node does not
        hold (its store is not the cluster's, on another host) is sent as the digest
        this apiserver's store names (a node's store resolves digests exactly; names
        are per store). Refs that are neither digests nor names of this apiserver's
        store are the backend's own (plain image directories, simulated) and left as
        they are."""
        if spec.backend not in LAYERED_BACKENDS:
            return spec     # its images are the backend's own names, its snapshots no layers
        if spec.snapshot is not None:
            if _is_digest(spec.snapshot) and not self._node_holds(node, spec.snapshot):
                await self.mover.fetch(node, spec.snapshot, kind="snapshot")
            return spec
        index = self.images._index()
        changed: dict[str, Any] = {}

        e = self.edges.get(node)
        fetched = e.fetched if e is not None else set()

        async def one(ref: str) -> str:
            if self._node_holds(node, ref):
                return ref
            digest = ref if _is_digest(ref) else None
            if digest is None and index is not None:
                with contextlib.suppress(InvalidArgument):
                    digest = index.digest_of(parse_ref(ref).key)
            if digest is None:
                return ref
            if digest in fetched:
                return digest   # the node has it by digest only: copied there by us
            if self._node_holds(node, digest):
                return ref      # its store has the layer, and the name with it
            got = await self.mover.fetch(node, digest, kind="image")
            # Copied, or granted to read lazily: the node has the layer by digest only.
            # Found there by asking (a layer made since its last heartbeat: a store it
            # shares, which has the name too): the name stays, as the caller wrote it.
            return digest if digest in got.copied or digest in got.remote else ref

        image = await one(spec.image)
        if image != spec.image:
            changed["image"] = image
        if spec.workspace:
            ws = await one(spec.workspace)
            if ws != spec.workspace:
                changed["workspace"] = ws
        toolkits = tuple([await one(t) for t in spec.toolkits])
        if toolkits != spec.toolkits:
            changed["toolkits"] = toolkits
        return msgspec.structs.replace(spec, **changed) if changed else spec

    async def fetch_layer(self, caller: Caller, req: LayerFetch) -> LayerFetched:
        """``layer_fetch``: a superuser copies a layer (and its chain) onto a node, e.g.
        to warm a node before a burst or before draining another. Tenants cannot: a
        fetch fills a node's disk and its store is every project's."""
        if not caller.superuser:
            raise PermissionDenied(
                "layer_fetch is a superuser's: a node's layer store holds every project's "
                "layers and fetching fills its disk; ask an operator", field="node")
        if req.node not in self.edges:
            raise NotFound(f"no node {req.node!r} in this cluster; GET /v1/nodes lists them",
                           node=req.node)
        if req.source is not None and req.source not in self.edges:
            raise NotFound(f"no node {req.source!r} in this cluster; GET /v1/nodes lists "
                           "them", node=req.source)
        return await self.mover.fetch(req.node, req.digest, source=req.source)

    def note_snapshot(self, node: str, snapshot_id: str) -> None:
        """A snapshot was just taken on ``node``: route creates from it there before the
        edge's next heartbeat lists it."""
        e = self.edges.get(node)
        if e is not None:
            e.noted.add(snapshot_id)

    def forget_snapshot(self, snapshot_id: str) -> None:
        for e in self.edges.values():
            e.noted.discard(snapshot_id)
            if snapshot_id in e.images:
                e.images = e.images - {snapshot_id}

    def accepted(self, decision: Decision) -> None:
        self.placement.confirm(decision)

    def refused(self, decision: Decision) -> None:
        self.placement.forget(decision)

    # --------------------------------------------------------------- quotas
    def network_ceilings(self, project: str) -> list[tuple[str, NetworkPolicy]]:
        """The network ceilings binding ``project`` (its own and its ancestors')."""
        self._fresh_quotas()
        return self.quota.network_ceilings(project)

    def qos_ls(self, project: str) -> tuple[bool, str | None]:
        """May ``project``'s sandboxes be qos "ls" (nearest quota's ``qos_ls``)."""
        self._fresh_quotas()
        return self.quota.qos_ls(project)

    def _fresh_quotas(self) -> None:
        """Re-read the quotas from the store when this copy is older than
        ``quota_refresh_s`` (one query of the quota rows; see PlaneConfig)."""
        now = self.clock()
        if now - self._quotas_read < self.config.quota_refresh_s:
            return
        self._quotas_read = now
        for row in self.store.list_quotas():
            try:
                q = msgspec.convert(row.quota, Quota)
                if self.quota.quota(row.project) != q:
                    self.quota.set_quota(row.project, q)
            except (msgspec.ValidationError, DsecError) as exc:
                log.warning("quota of %s in the store is unreadable, kept the one held: %s",
                            row.project, exc)

    def admit(self, project: str, spec: SandboxSpec) -> object:
        """Check the quota chain and hold a provisional charge until commit/abort."""
        self._fresh_quotas()
        self.quota.check(project, backend=backend_of(spec), cpu_milli=spec.cpu_milli,
                         memory_bytes=spec.memory_bytes)
        self._pending += 1
        token = f"pending:{self._pending}"
        self.quota.insert(SandboxRecord(id=token, node="", project=project,
                                        backend=backend_of(spec), cpu_milli=spec.cpu_milli,
                                        memory_bytes=spec.memory_bytes,
                                        priority=spec.priority))
        return token

    # Snapshot charges: the store is the arbiter, since every replica charges and
    # releases snapshots; the quota index is a cache reloaded from it (one query of the
    # charges table) before a room or usage is answered. Before this, each replica knew
    # only its own charges: two replicas each let a project fill its whole quota, and a
    # snapshot deleted through one stayed charged on the other.
    def _sync_snapshots(self) -> None:
        rows = self.store.list_snapshot_charges()
        self._snapshot_rows = {r.id: r for r in rows}
        # built layers a prune removed behind the control plane's back (the host CLI, the
        # store budget): their charges go, or usage would keep counting them
        gone = self.images.gone_build_charges(rows)
        for cid in gone:
            self.store.delete_snapshot_charge(cid)
        self.quota.replace_snapshots((c.id, c.project, c.size_bytes)
                                     for c in rows if c.id not in gone)

    def snapshot_record(self, snapshot_id: str) -> SnapshotChargeRow | None:
        """The control plane's own record of snapshot ``snapshot_id`` (its charge row:
        project, node that took it), or None: the authority on whose a snapshot is, never
        an edge's answer (red team 16, F2). Built/pulled layers (node ``""``) are not
        snapshots. A miss re-reads the store once (another replica may have taken it)."""
        row = self._snapshot_rows.get(snapshot_id)
        if row is None:
            self._sync_snapshots()
            row = self._snapshot_rows.get(snapshot_id)
        return row if row is not None and row.node else None

    def snapshot_room(self, project: str) -> int | None:
        """Bytes a new snapshot of ``project`` may store (None: no snapshot quota)."""
        if not self.quota.snapshot_limits(project):
            return None
        self._sync_snapshots()
        return self.quota.snapshot_room(project)

    def image_limits(self, project: str) -> list[tuple[str, int]]:
        """``(ancestor, image_bytes)`` limits on ``project``'s chain."""
        return self.quota.image_limits(project)

    def check_snapshot(self, project: str, size_bytes: int) -> None:
        self._sync_snapshots()
        self.quota.check_snapshot(project, size_bytes)

    def charge_snapshot(self, snapshot_id: str, project: str, node: str,
                        size_bytes: int, *, kind: str | None = None,
                        parent: str | None = None, stack: tuple[str, ...] = ()) -> None:
        """Record a snapshot's stored bytes against its project's quota chain, durably
        and atomically with the check (:meth:`StateStore.charge_snapshot`);
        ``QuotaExceeded`` if it no longer fits (a concurrent snapshot, maybe through
        another replica, took the room)."""
        over = self.store.charge_snapshot(
            SnapshotChargeRow(id=snapshot_id, project=project, node=node,
                              size_bytes=size_bytes, kind=kind, parent=parent,
                              stack=tuple(stack)),
            self.quota.snapshot_limits(project))
        self._sync_snapshots()
        if over is not None:
            self.quota.check_snapshot(project, size_bytes)   # raises, naming the quota
            where, used = over                               # (released meanwhile)
            raise QuotaExceeded(
                f"snapshot of {size_bytes} bytes does not fit the snapshot_bytes quota of "
                f"project {where!r} ({used} bytes used); delete snapshots or raise the "
                "quota", resource="snapshot_bytes", project=where, used=used,
                requested=size_bytes)

    def release_snapshot(self, snapshot_id: str) -> None:
        """A snapshot was deleted: its bytes leave the quota usage."""
        self.store.delete_snapshot_charge(snapshot_id)
        self.quota.remove_snapshot(snapshot_id)
        self._snapshot_rows.pop(snapshot_id, None)

    def commit(self, token: object, info: SandboxInfo) -> None:
        self.quota.remove(str(token))
        self._record(info)

    async def durable(self, timeout_s: float = 5.0) -> None:
        """What was recorded before this call is committed when it returns
        (Registry.flush_async waits for a batch in flight, then commits the rest).
        Bounded: a store that neither answers nor fails within ``timeout_s`` (a frozen
        server on a Unix socket) raises Unavailable rather than hold the create; the
        flush goes on in the background (never cancelled mid-commit) and the batch
        stays queued until it lands.

        Group commit: every caller that arrives before the next flush has taken its
        batch shares that one flush (one task, one transaction), so the work per
        create does not grow with the creates in flight. Measured (bench suite
        cluster, create_many of 256, 2 replicas, PostgreSQL): a flush task and a wait
        per create were 19% of a replica's py-spy samples; shared, the durable wait is
        4-8% (the next runs of the same bench, loaded machine)."""
        group = self._group_commit
        if group is None or group.done():
            group = self._group_commit = asyncio.ensure_future(self._group_flush(timeout_s))
            group.add_done_callback(lambda f: f.cancelled() or f.exception())
        # Each caller awaits the shared future (shielded: a caller cancelled leaves the
        # flush to the others); the timeout is the group's, once. asyncio.wait with a
        # timeout per caller (a timer, a callback added to and scanned out of the shared
        # future's list) was 24% of a replica's py-spy samples at 100k live; measured in
        # one run with 4,096 callers: 11-12 us per caller that way, 5 us shielded.
        await asyncio.shield(group)

    async def _group_flush(self, timeout_s: float) -> None:
        await asyncio.sleep(0)     # the callers of this loop pass join this flush
        self._group_commit = None  # later callers wait for the next one
        flush = asyncio.ensure_future(self.registry.flush_async())
        # never cancelled mid-commit: an abandoned group still lands its batch
        flush.add_done_callback(lambda f: f.cancelled() or f.exception())
        done, _ = await asyncio.wait({flush}, timeout=timeout_s)
        if not done:
            raise Unavailable(f"the state store did not commit within {timeout_s:g} s; "
                              "the record is kept and retried")
        flush.result()

    def _record(self, info: SandboxInfo, reason: str = "created") -> None:
        spec = stored(info.spec)
        try:
            self.registry.add_sandbox(SandboxRecord(
                id=info.id, node=info.node, project=project_of(spec),
                backend=backend_of(spec),
                cpu_milli=spec.cpu_milli, memory_bytes=spec.memory_bytes,
                priority=spec.priority, created_at=info.created_at,
                paused=info.state == "paused", spec=spec), reason=reason)
        except InvalidArgument:
            pass  # already recorded (a heartbeat reconcile or replay got there first)

    def paused(self, sandbox_id: str, paused: bool) -> None:
        """A pause/resume through this apiserver succeeded: list it at once."""
        try:
            self.registry.set_paused(sandbox_id, paused)
        except SandboxNotFound:
            pass

    def admit_resume(self, sandbox_id: str) -> object | None:
        """Check that resuming paused ``sandbox_id`` fits its project's quota chain and
        hold the charge it adds, in one step with the check (no await between: a create
        or another resume admitted meanwhile sees it). ``resumed``/``abort_resume``
        settle the hold. None: this plane does not know it as paused (nothing to hold).
        ``QuotaExceeded`` names the project and what to free (red team 19, B3)."""
        self._fresh_quotas()
        try:
            return self.quota.hold_resume(sandbox_id)
        except QuotaExceeded as exc:
            raise QuotaExceeded(
                f"cannot resume sandbox {sandbox_id}: {exc.message} (a paused sandbox "
                "holds no CPU; running it again needs its CPU back); pause or destroy "
                f"another sandbox of project {exc.detail.get('project')!r} first",
                sandbox_id=sandbox_id, **exc.detail) from None

    def resumed(self, token: object) -> None:
        """The resume ``token`` held succeeded: count the sandbox as running (its held
        charge becomes the running charge in the same step)."""
        assert isinstance(token, ResumeHold)
        self.quota.release_hold(token)
        self.paused(token.sandbox_id, False)

    def abort_resume(self, token: object) -> None:
        assert isinstance(token, ResumeHold)
        self.quota.release_hold(token)

    def abort(self, token: object) -> None:
        try:
            self.quota.remove(str(token))
        except SandboxNotFound:
            pass

    def forget(self, sandbox_id: str, reason: str) -> None:
        """The sandbox is gone: drop it from the registry (and so from quota usage)."""
        try:
            self.registry.remove_sandbox(sandbox_id, reason=reason)
        except SandboxNotFound:
            pass

    # ------------------------------------------------------------ listing
    def list_sandboxes(self, caller: Caller, *, project: str | None,
                       labels: Mapping[str, str], state: SandboxState | None, after: str,
                       limit: int, node: str | None = None, isolation: str | None = None,
                       ) -> tuple[list[SandboxInfo], bool]:
        """A page of live sandboxes from the registry, in id order after ``after``
        (``node``: only those the registry places there, from its per-node index;
        ``isolation``: only those whose backend gives that tier).

        Only projects the caller holds a role on are walked (a per-project sorted index),
        so a call costs O(projects + page + rows the label/state filter skips), not a
        question to every edge. The registry tracks running and paused sandboxes; a
        sandbox in a transition (creating, pausing, ...) lists under the state it is
        leaving, a failed or destroyed one is gone from the list (``GET`` of one sandbox
        asks its edge, the source of truth, and shows every state)."""
        reg = self.registry
        if project is not None:
            sub = project + "/"
            projects: list[str] | None = [p for p in reg.projects()
                                          if p == project or p.startswith(sub)]
        elif caller.superuser:
            projects = None
        else:
            projects = [p for p in reg.projects() if caller.role_on(p) is not None]
        if state is not None and state not in ("running", "paused"):
            return [], False
        want_paused = None if state is None else state == "paused"
        items = list(labels.items())

        def match(r: SandboxRecord) -> bool:
            if want_paused is not None and r.paused != want_paused:
                return False
            if isolation is not None and BACKEND_ISOLATION.get(r.backend) != isolation:  # type: ignore[call-overload]
                return False
            if items:
                have = r.spec.labels if r.spec is not None else {}
                for k, v in items:
                    if have.get(k) != v:
                        return False
            return True
        recs, more = reg.page(after=after, limit=limit, projects=projects, node=node,
                              match=match if want_paused is not None or items
                              or isolation is not None else None)
        return [_info_of(r) for r in recs], more

    def recorded_project(self, sandbox_id: str) -> str | None:
        """The project the registry records for ``sandbox_id`` (None: no record): what
        access checks go by before an edge's answer."""
        try:
            return self.registry.sandbox(sandbox_id).project
        except SandboxNotFound:
            return None

    def lost(self, sandbox_id: str) -> LostSandbox | None:
        """The tombstone of a sandbox evicted with its lost node, if remembered."""
        return self._lost.get(sandbox_id)

    def vanished(self, sandbox_id: str) -> LostSandbox | None:
        """The sandbox's edge does not know ``sandbox_id``: if the registry has it live,
        the node lost it (it restarted without it): write it off as ``node_lost`` (an
        event, quota released, a tombstone in the store) and return the tombstone."""
        lost = self._lost.get(sandbox_id)
        if lost is not None:
            return lost
        try:
            rec = self.registry.sandbox(sandbox_id)
        except SandboxNotFound:
            return None
        self._write_off(rec, f"node {rec.node} no longer has it: the node restarted "
                             "without it (it was not in the node's journal)")
        return self._lost.get(sandbox_id)

    def abandon_intent(self, sandbox_id: str, spec: SandboxSpec) -> bool:
        """A keyed create noted ``sandbox_id`` on a node, and its attempt was cut off
        (the retry finds the intent). If that node is lost (the watcher expired it), the
        intent is given up: the id is written off like the node's other sandboxes (a
        tombstone, so it is destroyed wherever the node shows it, also when it returns
        with the create carried out after all) and True tells the retry to place the
        create anew. Without this the retries stayed pinned to the lost node (every one
        a 503) until the caller gave up, and the node's return let the last one make the
        sandbox for nobody (tests/cluster/test_hosts_partition.py). False while the node
        is not lost: the sandbox may still come into being there, and a second one
        elsewhere would make two."""
        try:
            node = node_of(sandbox_id)
        except InvalidArgument:
            return False
        if not self.watcher.is_expired(node):
            return False
        if sandbox_id in self._lost:
            return True
        now = self.clock()
        detail = (f"the create that asked node {node} for it was cut off, and the node was "
                  f"lost (no heartbeat for more than {self.config.node_ttl_s:g}s): written "
                  "off, the create placed anew")
        info = SandboxInfo(id=sandbox_id, node=node, state="destroyed", spec=spec,
                           created_at=now, last_active_at=now, reason="node_lost")
        lost = self._lost[sandbox_id] = LostSandbox(info=info, events=[SandboxEvent(
            time=now, sandbox_id=sandbox_id, from_state=None, to_state="destroyed",
            reason="node_lost", detail=detail)])
        while len(self._lost) > self.config.lost_tombstones:
            self._lost.popitem(last=False)
        # kept until stored, like every tombstone (red team 16, F12)
        self._keep_lost([LostSandboxRow(id=sandbox_id, node=node, lost_at=now,
                                        record=msgspec.to_builtins(lost))])
        log.warning("sandbox %s written off: %s", sandbox_id, detail)
        return True

    def _write_off(self, rec: SandboxRecord, detail: str) -> None:
        now = self.clock()
        row = self._tombstone(rec, "node_lost", now, detail=detail)
        self._keep_lost([row])
        self.registry.evict([rec.id], reason="node_lost")
        log.warning("sandbox %s written off: %s", rec.id, detail)

    def _keep_lost(self, rows: list[LostSandboxRow]) -> bool:
        """Make tombstones durable: written now if the store answers, else kept and
        written before the registry's next batch (which carries their removals; see
        :meth:`_save_lost`). True when they are in the store."""
        for row in rows:
            self._unsaved_lost[row.id] = row
        try:
            self._save_lost()
        except Exception as exc:  # noqa: BLE001 - the store's outage (Unavailable), a full disk
            log.warning("%d tombstone(s) of written-off sandboxes could not be stored (%s): "
                        "kept, and written before their removal from the registry is",
                        len(self._unsaved_lost), exc)
            return False
        return True

    def _save_lost(self) -> None:
        """Write the tombstones not yet stored (a registry batch waits for this: it
        raises while the store is down, and the batch stays queued)."""
        if not self._unsaved_lost:
            return
        rows = list(self._unsaved_lost.values())
        self.store.put_lost(rows, keep=self.config.lost_tombstones)
        for row in rows:
            if self._unsaved_lost.get(row.id) is row:
                del self._unsaved_lost[row.id]

    def _tombstone(self, rec: SandboxRecord, reason: str, now: float,
                   detail: str | None = None) -> LostSandboxRow:
        info = _info_of(rec)
        info.state, info.reason = "destroyed", reason
        detail = detail or (f"evicted by the control plane: node {rec.node} sent no "
                            f"heartbeat for more than {self.config.node_ttl_s:g}s")
        events = [SandboxEvent(time=rec.created_at, sandbox_id=rec.id, from_state=None,
                               to_state="running", reason="created"),
                  SandboxEvent(time=now, sandbox_id=rec.id,
                               from_state="paused" if rec.paused else "running",
                               to_state="destroyed", reason=reason, detail=detail)]
        lost = self._lost[rec.id] = LostSandbox(info=info, events=events)
        while len(self._lost) > self.config.lost_tombstones:
            self._lost.popitem(last=False)
        return LostSandboxRow(id=rec.id, node=rec.node, lost_at=now,
                              record=msgspec.to_builtins(lost))

    # ---------------------------------------------- the doors' admin face (AdminOps)
    # The REST and gateway doors are handed this plane as their AdminOps until they are
    # built from the operation catalogue (issue 13, B3) and reach plane.admin and
    # plane.images directly; until then each route forwards here, one line each.
    def list_projects(self, caller: Caller) -> ProjectList:
        return self.admin.list_projects(caller)

    def get_project(self, caller: Caller, path: str) -> ProjectView:
        return self.admin.get_project(caller, path)

    def set_quota(self, caller: Caller, path: str, q: QuotaBody) -> ProjectView:
        return self.admin.set_quota(caller, path, q)

    def create_key(self, caller: Caller, req: CreateKeyRequest) -> CreateKeyResponse:
        return self.admin.create_key(caller, req)

    def revoke_key(self, caller: Caller, key_id: str) -> None:
        self.admin.revoke_key(caller, key_id)

    def list_keys(self, caller: Caller, principal: str | None) -> KeyList:
        return self.admin.list_keys(caller, principal)

    def open_session(self, caller: Caller, lease_s: float) -> SessionView:
        return self.admin.open_session(caller, lease_s)

    def renew_session(self, caller: Caller, sid: str) -> SessionView:
        return self.admin.renew_session(caller, sid)

    def close_session(self, caller: Caller, sid: str) -> None:
        self.admin.close_session(caller, sid)

    def check_session(self, caller: Caller, sid: str) -> None:
        self.admin.check_session(caller, sid)

    def sessions(self) -> dict[str, Session]:
        return self.admin.sessions()

    def resolve_layers(self, caller: Caller, spec: SandboxSpec) -> SandboxSpec:
        return self.images.resolve_layers(caller, spec)

    async def pull_on_create(self, caller: Caller, spec: SandboxSpec) -> SandboxSpec:
        return await self.images.pull_on_create(caller, spec)

    def registry_pull(self, project: str) -> tuple[bool, str | None]:
        return self.quota.registry_pull(project)

    def list_images(self, caller: Caller) -> ImageList:
        return self.images.list_images(caller)

    def get_image(self, caller: Caller, ref: str) -> ImageView:
        return self.images.get_image(caller, ref)

    def delete_image(self, caller: Caller, ref: str) -> None:
        self.images.delete_image(caller, ref)

    def tag_image(self, caller: Caller, req: ImageTagRequest) -> ImageView:
        return self.images.tag_image(caller, req)

    async def promote_image(self, caller: Caller, req: ImagePromoteRequest) -> ImageView:
        return await self.images.promote_image(caller, req)

    async def build_image(self, caller: Caller, tar_path: str, *, name: str, kind: str,
                          tag: str, oci: bool) -> ImageList:
        return await self.images.build_image(caller, tar_path, name=name, kind=kind, tag=tag,
                                             oci=oci)

    async def prune_images(self, caller: Caller, *, dry_run: bool) -> ImagePruned:
        return await self.images.prune_images(caller, dry_run=dry_run)

    async def pull_image(self, caller: Caller, req: ImagePullRequest) -> ImageList:
        return await self.images.pull_image(caller, req)

    async def push_image(self, caller: Caller, req: ImagePushRequest) -> ImagePushed:
        return await self.images.push_image(caller, req)

    # ------------------------------------------------------------- loops
    async def start(self) -> None:
        self._started_at = self._last_sweep = self.clock()
        self._tasks.append(asyncio.create_task(self._stall_loop(), name="dsec-stall-meter"))
        self._tasks.append(asyncio.create_task(self._watch_store_loop(),
                                               name="dsec-store-watch"))
        if self.config.flush_delay_s is not None:
            self._tasks.append(asyncio.create_task(self._flush_loop(), name="dsec-flush"))
        await self.poll_edges()
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="dsec-heartbeats"))
        self._tasks.append(asyncio.create_task(self._expiry_loop(), name="dsec-expiry"))
        self._tasks.append(asyncio.create_task(self._sweep_loop(), name="dsec-sweeper"))
        self._tasks.append(asyncio.create_task(self._retention_loop(), name="dsec-retention"))

    async def close(self) -> None:
        polls = list(self._polling.values())
        for t in [*self._tasks, *polls]:
            t.cancel()
        await asyncio.gather(*self._tasks, *polls, return_exceptions=True)
        self._tasks.clear()
        self._polling.clear()
        try:
            self.registry.flush()
        except Exception:
            log.exception("final registry flush failed")

    async def _watch_store_loop(self) -> None:
        """Apply what other replicas commit to the shared store (Registry.catch_up): woken
        by the store's push where it has one, else polled (see PlaneConfig)."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        heard = [0]
        registry = self.registry

        def pushed(version: int) -> None:     # on the store's listener thread
            heard[0] = max(heard[0], version) if version >= 0 else -1
            if not loop.is_closed():
                loop.call_soon_threadsafe(wake.set)

        push = self.store.listen_versions(pushed)
        behind = False    # the last catch_up failed: what it missed is still unread
        while True:
            # While the store's LISTEN connection is down (a restart, or LISTEN refused,
            # as behind a transaction-pooling proxy), poll as SQLite is polled. So too
            # after a failed read: the listener's "you missed something" (-1) after its
            # reconnect can meet a pool that has not reconnected yet, and no push comes
            # for what was missed (another replica listed nothing for store_push_poll_s).
            listening = push and getattr(self.store, "listening", True)
            every = (self.config.store_push_poll_s if listening and not behind
                     else self.config.store_poll_s)
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the result of
            # a wait that finished as the task was being cancelled and drops the
            # cancellation (gh-86296); a push arriving during close() did that, and the
            # loop then waited store_push_poll_s again with close() gathering it (a
            # replica's close hung for the whole 300 s test timeout).
            try:
                async with asyncio.timeout(every):
                    await wake.wait()
            except TimeoutError:
                pass
            wake.clear()
            newest, heard[0] = heard[0], 0
            if not behind and 0 < newest <= registry.applied_version:
                continue      # our own commit's notification: nothing new to read
            try:
                registry.catch_up()
                behind = False
            except DsecError as exc:
                if not behind:
                    log.warning("reading other replicas' changes from the store failed "
                                "(retried every %.2f s): %s", self.config.store_poll_s, exc)
                behind = True

    async def _flush_loop(self) -> None:
        """Commit queued registry mutations ``flush_delay_s`` after the first of them."""
        due = asyncio.Event()
        self.registry.on_pending.append(due.set)
        delay = self.config.flush_delay_s or 0.0
        try:
            while True:
                await due.wait()
                await asyncio.sleep(delay)
                due.clear()
                try:
                    await self.registry.flush_async()
                except DsecError as exc:
                    # The batch stays queued (Registry.flush): try again shortly.
                    log.warning("committing registry changes failed (kept, retried): %s",
                                exc)
                    due.set()
                    await asyncio.sleep(max(delay, 0.5))
        finally:
            self.registry.on_pending.remove(due.set)

    async def poll_edges(self) -> None:
        """Poll every edge now and wait for the polls: each one started like the
        heartbeat loop's (registered in ``_polling``), so expiry sees it in flight and
        holds the node while it is not silence. A poll run outside ``_polling`` was
        invisible to :meth:`_expire`: a loop stall mid-poll let the expiry timer, due
        during the stall, write the node off before the poll's own timeout was
        classified (CI, under load)."""
        self._start_polls()
        polls = [t for n, t in self._polling.items() if n in self.edges]
        await asyncio.gather(*polls, return_exceptions=True)
        self.registry.flush()

    async def _link(self, e: EdgeEntry) -> Any:
        """The edge's link, reconnected if its connection closed (the edge restarted or
        the network dropped): Aether connections do not reconnect on their own. None
        while waiting to retry; a failed reconnect raises (its cause matters)."""
        link: Any = e.link
        if e.revoked:
            return None          # never redialled (revoke_edge)
        conn = getattr(link, "conn", None)
        if conn is None or not conn.closed:
            return link
        now = self.clock()
        if now < e.retry_at:
            return None
        e.retry_at = now + self.config.reconnect_interval_s
        from dsec.edge.client import EdgeClient
        try:
            async with asyncio.timeout(self.config.poll_timeout_s):
                fresh = await EdgeClient.connect(e.address, token=e.token, tls=e.tls)
        except TimeoutError as exc:
            raise ConnectionLost(f"could not connect to edge {e.node} at {e.address} within "
                                 f"{self.config.poll_timeout_s:g}s") from exc
        e.link = fresh
        try:
            await link.close()
        except DsecError:
            pass
        log.info("reconnected to edge %s at %s", e.node, e.address)
        return fresh

    async def _stall_loop(self) -> None:
        """Tick the stall meter: how late this loop wakes is how long it could not run."""
        loop = asyncio.get_running_loop()
        meter = self._stalls = StallMeter(self.config.stall_tick_s)
        while True:
            meter.tick(loop.time())
            await asyncio.sleep(meter.interval_s)

    def _checked_capacity(self, e: EdgeEntry, hb: Any) -> Any:
        """A joined node's heartbeat with its capacity clamped to what it registered
        with (dsec.control.claims)."""
        if e.registered is None:
            # the size is recorded where every replica (and this one after a restart)
            # reads it: the first heartbeat any replica heard since the node joined
            got = self.store.register_capacity(
                e.node, msgspec.json.encode(hb.capacity).decode(), self.clock())
            e.registered = msgspec.json.decode(got, type=type(hb.capacity))
        capacity = clamp_capacity(hb.capacity, e.registered)
        if capacity == hb.capacity:
            return hb
        if not e.clamp_noted:
            e.clamp_noted = True
            log.warning("edge %s claims capacity %s above the %s it registered with: "
                        "clamped (revoke it and join again if the machine grew)", e.node,
                        hb.capacity, e.registered)
        return msgspec.structs.replace(hb, capacity=capacity)

    def _checked_layers(self, e: EdgeEntry, claimed: Any) -> frozenset[str]:
        """The layers a joined node holds as far as placement believes it: a project's
        layer only where this control plane put it (dsec.control.claims)."""
        charges = {r.id: r for r in self.store.list_snapshot_charges()}
        index = self.images._index()

        def project_of(digest: str) -> str | None:
            row = charges.get(digest)
            if row is not None:
                return row.project
            m = index.manifest(digest.removeprefix("sha256:")) if index else None
            return layer_namespace(m) if m is not None else None

        def granted(digest: str) -> bool:
            row = charges.get(digest)
            return (digest in e.fetched or digest in e.noted
                    or (row is not None and row.node == e.node))
        trusted = trusted_layers(claimed, granted=granted, project_of=project_of)
        if len(trusted) != len(set(claimed)):
            log.warning("edge %s claims %d layer(s) of projects it was never given: not "
                        "believed", e.node, len(set(claimed)) - len(trusted))
        return trusted

    async def _poll(self, e: EdgeEntry) -> None:
        t = self.config.poll_timeout_s
        loop = asyncio.get_running_loop()
        started = loop.time()
        link: Any = None
        try:
            link = await self._link(e)
            if link is None:
                return
            full = self.clock() - e.listed_at >= self.config.sandbox_list_interval_s
            hb = await link.heartbeat(include_sandboxes=full, timeout=t,
                                      images_gen=e.images_gen if e.heartbeat else None,
                                      **self._first_page)
            if hb.feed_seq < e.feed_after:
                # The edge restarted: its feed numbering started over, and what it holds
                # now is only known from a full list.
                e.feed_after = 0
                if not full:
                    full = True
                    hb = await link.heartbeat(include_sandboxes=True, timeout=t,
                                              **self._first_page)
            if full:
                hb = await self._whole_list(e.node, link, hb, t)
            feed = await link.feed(e.feed_after, MAX_FEED_EVENTS, timeout=t)
        except DsecError as exc:
            now = loop.time()
            conn = getattr(link, "conn", None)
            heard = conn is not None and conn.last_received > started
            stalls = self._stalls
            stalled = (stalls is not None
                       and stalls.stalled(started, now) >= min(t, now - started) / 2)
            await self._poll_failed(e, exc, heard=heard, stalled=stalled)
            return
        if e.failure:
            log.warning("edge %s reachable again (it was %s: %s)", e.node,
                        "silent" if e.failure == "silent" else "unreachable", e.problem)
        e.failure = e.problem = e.held_why = ""
        e.held_until = 0.0
        if not e.trusted:
            hb = self._checked_capacity(e, hb)
        e.heartbeat = hb
        e.last_seen = now = self.clock()
        self._deliver_pins(e, link, hb.pins_gen)
        self.ceiling.update(NodeSize(e.node, frozenset(hb.backends), hb.capacity, hb.physical))
        if not hb.images_same:
            e.images = (frozenset(hb.images) if e.trusted
                        else self._checked_layers(e, hb.images))
            e.images_gen = hb.images_gen
        if e.noted:
            e.noted -= e.images
        e.feed_after = feed.next
        labels = dict(hb.labels)
        labels.update({f"{BACKEND_LABEL}{b}": "1" for b in hb.backends})
        digest: tuple[int, int] | None = None
        if hb.sandboxes is not None:
            # Digest and diff: a list whose digest is the registry's for this node holds
            # exactly its records (so only this node's ids) and needs no reconciling.
            digest = _list_digest(hb.sandboxes)
            listed = (hb.sandboxes if digest == self.registry.node_digest(e.node)
                      else self._own(e.node, hb.sandboxes, "heartbeat"))
            e.live = tuple(LiveSandbox(id=b.id, project=b.project, cpu_milli=b.cpu_milli,
                                       memory_bytes=b.memory_bytes, priority=b.priority,
                                       paused=b.state == "paused") for b in listed)
            e.listed_at = now
        else:
            listed = []
            self._follow_feed(e, feed)
        await self._carry_out(self.watcher.handle(NodeHeartbeat(
            time=now, view=PlacementNode(
                node=e.node, cpu_milli_capacity=hb.capacity.cpu_milli,
                memory_bytes_capacity=hb.capacity.memory_bytes,
                cpu_milli_used=hb.usage.cpu_milli, memory_bytes_used=hb.usage.memory_bytes,
                max_sandboxes=hb.capacity.sandboxes, labels=labels, layers=e.images),
            sandboxes=e.live)))
        own_events = self._own(e.node, feed.events, "event feed",
                               key=lambda ev: ev.sandbox_id)
        for ev in own_events:
            if ev.to_state in ("destroyed", "failed"):
                self.forget(ev.sandbox_id, ev.reason)
            elif ev.to_state == "paused" or (ev.to_state == "running" and
                                             ev.from_state == "resuming"):
                try:
                    self.registry.set_paused(ev.sandbox_id, ev.to_state == "paused",
                                             reason=ev.reason)
                except SandboxNotFound:
                    pass
        if hb.sandboxes is not None:
            if digest is not None and digest == self.registry.node_digest(e.node):
                # In step (after the feed's events): nothing to probe, record or write
                # off, and nothing it lists is unknown. Measured (one full-list poll of
                # 2,000 sandboxes, same run, loaded machine): 17.7 ms reconciled in full,
                # 1.0-1.3 ms in step (x13-17). At 50 edges x 2,000 with lists every 5 s
                # that is ~35% of a core per replica against ~2.5% (py-spy of the bench
                # suite cluster at 50k-100k live: _reconcile 30% of a replica).
                self._quarantined.pop(e.node, None)
            else:
                await self._reconcile(e, link, hb, listed)

    async def _whole_list(self, node: str, link: Any, hb: Any, t: float) -> Any:
        """``hb`` with the node's whole sandbox list: the first page is ``hb``'s, the
        others are asked for (ids after the last one seen, MAX_LIST_PAGE at a time).
        Bounded whatever the edge says: a page is at most MAX_LIST_PAGE (refused at
        its array header otherwise: wire.node), strictly ascending after its cursor,
        and a list longer than ``max_listed_per_node`` is refused; each refusal is a
        RemoteProtocolError, which holds the node as one that answers wrongly
        (unreachable, its sandboxes kept) rather than silent."""
        page_size = max(1, min(self.config.list_page, MAX_LIST_PAGE))
        briefs = list(hb.sandboxes or ())
        _check_page(node, briefs, "", page_size)
        more = hb.list_more
        cap = self.config.max_listed_per_node
        while more:
            if cap is not None and len(briefs) >= cap:
                raise RemoteProtocolError(
                    f"edge {node} lists more than {cap} sandboxes (max_listed_per_node); "
                    "refused: raise PlaneConfig.max_listed_per_node if a node really "
                    "holds that many", node=node, limit=cap)
            after = briefs[-1].id if briefs else ""
            page = await link.heartbeat(include_sandboxes=True, list_after=after,
                                        list_limit=page_size, images_gen=hb.images_gen,
                                        timeout=t)
            got = list(page.sandboxes or ())
            if not got:
                raise RemoteProtocolError(f"edge {node} said more sandboxes follow "
                                          f"{after!r} and listed none", node=node)
            _check_page(node, got, after, page_size)
            briefs += got
            more = page.list_more
        return msgspec.structs.replace(hb, sandboxes=briefs, list_more=False)

    @property
    def _first_page(self) -> dict[str, int]:
        # the edge's default page is MAX_LIST_PAGE: only a smaller one is asked for (so
        # links that predate paging, and test doubles of them, are called as before)
        size = self.config.list_page
        return {} if size >= MAX_LIST_PAGE else {"list_limit": max(1, size)}

    def _follow_feed(self, e: EdgeEntry, feed: Any) -> None:
        """Between full lists: the last list minus the sandboxes the feed says ended,
        with pauses and resumes applied (a new tuple only when something changed, so
        the watcher's per-list index is reused otherwise). Events fell out of the
        bounded feed: the next poll takes a full list."""
        if feed.lost:
            e.listed_at = float("-inf")
        gone: set[str] = set()
        paused: dict[str, bool] = {}
        for ev in feed.events:
            if ev.to_state in ("destroyed", "failed"):
                gone.add(ev.sandbox_id)
            elif ev.to_state == "paused" or (ev.to_state == "running"
                                             and ev.from_state == "resuming"):
                paused[ev.sandbox_id] = ev.to_state == "paused"
        if gone or paused:
            e.live = tuple(
                s if s.id not in paused or s.paused == paused[s.id]
                else msgspec.structs.replace(s, paused=paused[s.id])
                for s in e.live if s.id not in gone)

    async def hold_edge(self, node: str, why: str, for_s: float) -> None:
        """Whoever runs edge ``node`` says it is coming back (``dsec up``'s supervisor
        restarting its process): for ``for_s`` its silence is not a lost node (held,
        sandboxes kept, out of placement), however long the restart takes; the holder
        renews the hold while the restart lasts. A crash loop that gives up stops
        renewing, and the TTL counts again."""
        e = self.edges.get(node)
        if e is None:
            return
        now = self.clock()
        e.held_until, e.held_why = now + for_s, why
        if e.failure in ("", "silent"):
            # not healthy for placement, for the nodes list and for a create's answer
            # ("unreachable", 503), as the watcher's hold makes it for placement
            e.failure, e.problem = "blind", f"blind: {why}"
        await self._carry_out(self.watcher.handle(
            LinkFailed(node=node, time=now, cause="blind", detail=why)))

    def _sever(self, node: str) -> None:
        """Abort a lost node's link: calls still waiting on it fail now (a keyed create
        then answers 503 and its retry places the create anew, see
        :meth:`abandon_intent`), and nothing queued behind the dead link reaches the node
        when the network heals (``Connection.abort``). The next poll redials."""
        e = self.edges.get(node)
        conn = getattr(getattr(e, "link", None), "conn", None)
        abort = getattr(conn, "abort", None)
        if abort is not None:
            abort(f"node {node} was declared lost")

    async def _poll_failed(self, e: EdgeEntry, exc: DsecError, *, heard: bool = False,
                           stalled: bool = False) -> None:
        """A poll failed: only the edge's silence counts toward its TTL; this side's own
        failure, or an edge that answered with an error, holds it unreachable. A poll
        that timed out while the link carried other replies (``heard``: the edge is
        busy) or while this loop was stalled (``stalled``: we were not listening) is
        not silence either; nor is one while whoever runs the edge holds it
        (:meth:`hold_edge`)."""
        cause = link_failure_cause(exc, heard=heard, stalled=stalled)
        why = exc.message
        if cause != "silent" and isinstance(exc, Timeout):
            why += ("; the edge kept sending other replies meanwhile (busy, not silent)"
                    if heard else "; this apiserver's event loop was stalled for most of "
                    "that time (it could not listen)")
        if cause == "silent" and self.clock() < e.held_until:
            cause, why = "blind", f"{e.held_why} ({why})"
        if cause != e.failure:
            how = {"silent": "silent (counts toward node_ttl_s)",
                   "answered": "unreachable: it answers, with an error or late (held, "
                               "not lost)",
                   "blind": "unreachable from this apiserver (held, not lost)"}[cause]
            log.warning("edge %s %s: %s", e.node, how, why)
        e.failure = cause
        e.problem = f"{cause}: {why}"
        if cause != "silent":
            await self._carry_out(self.watcher.handle(
                LinkFailed(node=e.node, time=self.clock(), cause=cause, detail=why)))

    def _own(self, node: str, items: Any, what: str,
             key: Callable[[Any], str] = lambda b: str(b.id)) -> list[Any]:
        """The items of an edge's report (heartbeat listing, feed events) about sandboxes
        of its own node. What it says of other ids is not its to say (another node's
        sandbox written off, destroyed or forgotten on its word: red team 16, F3): it is
        dropped, and logged at most once a minute per node."""
        report: list[Any] = list(items)
        own, foreign = split_listing(node, [key(i) for i in report])
        if not foreign:
            return report
        now = self.clock()
        if now - self._foreign_logged.get(node, float("-inf")) >= _FOREIGN_LOG_S:
            self._foreign_logged[node] = now
            log.warning("edge %s reported %d sandbox id(s) that are not its node's in its "
                        "%s (e.g. %s): ignored; a sandbox's id names the node that holds "
                        "it, and no edge speaks for another (is this edge compromised?)",
                        node, len(foreign), what, ", ".join(repr(f[:80]) for f in foreign[:3]))
        mine = set(own)
        return [i for i in report if key(i) in mine]

    async def _reconcile(self, e: EdgeEntry, link: Any, hb: Any,
                         listing: list[Any] | None = None) -> None:
        """Make the registry's records of node ``e`` match the heartbeat's list: the plan
        is :func:`dsec.control.reconcile.plan_reconcile` (pure); this carries it out, asks
        the edge about every sandbox missing from it at once, settles each answer, and
        settles the sandboxes it lists that the registry does not hold from the store's
        records (never from the edge's word: they are quarantined without one).
        ``listing``: the heartbeat's sandboxes of ``e``'s own node (filtered here if
        not given)."""
        reg = self.registry
        briefs = self._own(e.node, hb.sandboxes, "heartbeat") if listing is None else listing
        listed = [(b.id, b.state) for b in briefs]
        on_node = reg.ids_on(e.node)
        records: dict[str, RecordBrief] = {}
        for sid in on_node.union(b.id for b in briefs):
            if sid in reg:
                rec = reg.sandbox(sid)
                records[sid] = RecordBrief(created_at=rec.created_at, paused=rec.paused)
        steps = plan_reconcile(hb_time=hb.time, listed=listed, on_node=on_node,
                               records=records, zombies=self.watcher.zombies(e.node),
                               lost=self._lost.keys())
        probes: list[Probe] = []
        unknown: list[str] = []
        for step in steps:
            if isinstance(step, Probe):
                if step.why == "unknown":
                    unknown.append(step.sandbox_id)
                else:
                    probes.append(step)
            elif isinstance(step, SetPaused):
                self.paused(step.sandbox_id, step.paused)
            else:
                try:
                    await link.destroy_many(list(step.sandbox_ids), reason="node_lost")
                except DsecError as exc:
                    log.warning("could not destroy written-off %s on %s: %s",
                                step.sandbox_ids, e.node, exc)
        for i in range(0, len(probes), _PROBES_AT_ONCE):
            chunk = probes[i : i + _PROBES_AT_ONCE]
            answers = await asyncio.gather(*(self._probe(link, p.sandbox_id) for p in chunk))
            for probe, answer in zip(chunk, answers, strict=True):
                self._settle(settle_probe(probe, answer, node=e.node, lost=self._lost.keys()))
        self._settle_unknown(e.node, unknown, dict(listed))
        await self._end_quarantine(e.node, link)

    async def _end_quarantine(self, node: str, link: Any) -> None:
        """Destroy the sandboxes of ``node`` quarantined longer than the grace: the store
        was read for each of them at this very poll and had no record."""
        grace = self.config.quarantine_grace_s
        held = self._quarantined.get(node)
        if grace is None or not held:
            return
        now = self.clock()
        old = sorted(sid for sid, since in held.items() if now - since >= grace)
        if not old:
            return
        log.warning("edge %s: destroying %d sandbox(es) with no record in the store after "
                    "%g s of quarantine (e.g. %s): orphans of creates cut off after the "
                    "edge made them", node, len(old), grace, ", ".join(old[:3]))
        detail = (f"no record of this sandbox in the control plane's store {grace:g} s "
                  "after it was first listed: its create never completed (the caller went "
                  "away, or it was given up on and placed elsewhere); nothing was charged")
        for sid in old:
            try:
                await link.destroy(sid, reason="orphaned", detail=detail,
                                   timeout=self.config.poll_timeout_s)
            except SandboxNotFound:
                pass
            except DsecError as exc:
                log.warning("could not destroy orphaned %s on %s: %s", sid, node, exc)
                continue
            held.pop(sid, None)
        if not held:
            self._quarantined.pop(node, None)

    def _settle_unknown(self, node: str, unknown: list[str], states: dict[str, str]) -> None:
        """Live sandboxes ``node`` lists that the registry does not hold: recorded from the
        store's rows (another replica created them, or this one before a restart), the
        others quarantined (see dsec.control.reconcile); quarantined ones no longer
        listed, or recorded meanwhile, leave the quarantine."""
        held = self._quarantined.get(node, {})
        for sid in [s for s in held if s not in states or s in self.registry]:
            del held[sid]
        if len(unknown) > _UNKNOWN_PER_LIST:
            # An honest edge lists few (a replica's creates not yet read from the store,
            # orphans of a replica that died): a list of many is bounded work per pass,
            # the rest settled at the next lists.
            log.warning("edge %s lists %d sandboxes this control plane has no record "
                        "of; %d are looked up now, the others at its next lists", node,
                        len(unknown), _UNKNOWN_PER_LIST)
            unknown = unknown[:_UNKNOWN_PER_LIST]
        rows: dict[str, SandboxRecord] = {}
        if unknown:
            for row in self.store.read_sandboxes(unknown):
                try:
                    rows[row.id] = SandboxRecord.from_dict(row.record)
                except (msgspec.ValidationError, TypeError, ValueError):
                    log.warning("unreadable sandbox row %s in the store ignored", row.id)
        now = self.clock()
        fresh: list[str] = []
        for sid in unknown:
            step = settle_unknown(sid, rows.get(sid), node=node,
                                  paused=states.get(sid) == "paused", lost=self._lost.keys())
            if isinstance(step, Quarantine):
                q = self._quarantined.setdefault(node, {})
                if sid not in q:
                    q[sid] = now
                    fresh.append(sid)
            else:
                self._settle(step)
        if fresh:
            log.warning("edge %s lists %d live sandbox(es) this control plane has no record "
                        "of (e.g. %s): quarantined: not charged to any project nor listed "
                        "(the project an edge claims is not evidence), recorded if a record "
                        "appears in the store", node, len(fresh),
                        ", ".join(fresh[:3]))
        if not self._quarantined.get(node, True):
            del self._quarantined[node]

    def quarantined(self, node: str | None = None) -> list[str]:
        """Ids of live sandboxes held aside because the control plane has no record of
        them (see :meth:`_settle_unknown`), on ``node`` or on every node."""
        nodes = [node] if node is not None else list(self._quarantined)
        return sorted(s for n in nodes for s in self._quarantined.get(n, {}))

    @staticmethod
    async def _probe(link: Any, sandbox_id: str) -> ProbeResult:
        try:
            info: SandboxInfo = await link.get(sandbox_id)
        except DsecError as exc:
            return exc
        return info

    def _settle(self, step: Settled | None) -> None:
        if isinstance(step, WriteOff):
            try:
                rec = self.registry.sandbox(step.sandbox_id)
            except SandboxNotFound:
                return   # forgotten meanwhile (its destroy came through the feed)
            self._write_off(rec, step.detail)
        elif isinstance(step, Forget):
            self.forget(step.sandbox_id, step.reason)
        elif isinstance(step, Record):
            # The store's row is the record (another replica wrote it): held, not
            # written again; a pause state the edge reports otherwise is a change.
            listed = step.record
            try:
                self.registry.adopt(msgspec.structs.replace(listed, paused=step.stored_paused))
            except InvalidArgument:
                return  # recorded meanwhile
            if listed.paused != step.stored_paused:
                self.paused(listed.id, listed.paused)

    async def _carry_out(self, instructions: list[Any]) -> None:
        """Execute what the watcher decided."""
        for ins in instructions:
            if isinstance(ins, UpdateNode):
                self._views[ins.view.node] = ins.view
                self._place_view(ins.view)
            elif isinstance(ins, EvictNode):
                self.placement.remove(ins.node)
                self._views.pop(ins.node, None)
                # evict_node, not evict(ins.sandbox_ids) alone: the heartbeat's list misses
                # sandboxes created on the node after its last heartbeat.
                now = self.clock()
                ids, _ = split_listing(ins.node, ins.sandbox_ids)   # its own only (F3)
                rows = [self._tombstone(rec, ins.reason, now)
                        for rec in (self.registry.evict(ids, reason=ins.reason)
                                    + self.registry.evict_node(ins.node, reason=ins.reason))]
                # Durable before the registry's removal is flushed: an apiserver restarted
                # in between still knows the node's returning sandboxes are written off.
                # A store outage keeps them queued, written before the removals are.
                saved = self._keep_lost(rows)
                log.warning("node %s lost (no heartbeat for %.1fs; stimulus %s): evicted its "
                            "%d sandbox(es)%s", ins.node, self.config.node_ttl_s,
                            ins.stimulus_id, len(rows), "" if saved else
                            " (their tombstones are not stored yet: retried before the "
                            "evictions are committed)")
                self._sever(ins.node)
            elif isinstance(ins, (DestroySandboxes, PreemptSandboxes)):
                link = self.edge(NodeId(ins.node))
                if link is not None and ins.sandbox_ids:
                    reason = "preempted" if isinstance(ins, PreemptSandboxes) else "node_lost"
                    log.info("destroying %s on %s (%s; stimulus %s)", ins.sandbox_ids,
                             ins.node, reason, ins.stimulus_id)
                    try:
                        await link.destroy_many(list(ins.sandbox_ids), reason=reason)
                    except DsecError as exc:
                        log.warning("could not destroy %s on %s (stimulus %s): %s",
                                    ins.sandbox_ids, ins.node, ins.stimulus_id, exc)
                self.registry.evict(ins.sandbox_ids, reason=ins.reason)

    async def tick(self) -> None:
        """One round of the heartbeat loop (also called by tests): poll every edge, let
        the watcher expire silent nodes, carry out what it decided, flush the registry."""
        await self.poll_edges()
        await self._carry_out(self.watcher.handle(Tick(self.clock())))
        self.registry.flush()

    async def _heartbeat_loop(self) -> None:
        """Every ``heartbeat_interval_s``, poll each edge whose previous poll is over.
        Each edge on its own: one that hangs (a partition: no reset, no answer) holds
        up only its own next poll, not the others' (as one gather of every poll did,
        for up to ``poll_timeout_s``), and expiry has its own timer
        (:meth:`_expiry_loop`)."""
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            try:
                self._start_polls()
                if self.config.flush_delay_s is None:
                    self.registry.flush()
            except Exception:
                log.exception("edge poll failed")

    def _start_polls(self) -> None:
        loop = asyncio.get_running_loop()
        for e in list(self.edges.values()):
            task = self._polling.get(e.node)
            if task is None or task.done():
                self._poll_started[e.node] = loop.time()
                self._polling[e.node] = asyncio.create_task(
                    self._poll_logged(e), name=f"dsec-poll-{e.node}")

    async def _poll_logged(self, e: EdgeEntry) -> None:
        try:
            await self._poll(e)
        except Exception:
            log.exception("poll of edge %s failed", e.node)

    async def _expiry_loop(self) -> None:
        """Expire silent nodes when they are due (the watcher's next deadline), not at
        the next poll round. Measured (a partitioned edge whose polls time out after
        ``poll_timeout_s`` 5 s; node_ttl_s 3 s; heartbeat_interval_s 1 s; 5 trials
        each, same machine, same run): node loss was declared 5.71 s after the cut
        when expiry waited for every poll of the round (5.3 s in the bench's
        cluster_partition_resurrected loss_s), 2.71 s with this timer: at most
        ``node_ttl_s`` after the edge's last answer (tests/control/test_expiry_timer.py)."""
        interval = self.config.heartbeat_interval_s
        while True:
            due = self.watcher.next_expiry()
            delay = interval if due is None else min(max(due - self.clock(), 0.0), interval)
            await asyncio.sleep(delay + 0.001)
            try:
                await self._expire()
            except Exception:
                log.exception("expiring silent nodes failed")

    async def _expire(self) -> None:
        """One expiry round: a node past its TTL whose poll is still in flight is held
        instead when that poll is not silence (its link carried other replies, or this
        loop was stalled, or whoever runs it holds it: see :meth:`_poll_failed`); the
        others are expired."""
        now = self.clock()
        loop = asyncio.get_running_loop()
        for node in self.watcher.expiring(now):
            task = self._polling.get(node)
            e = self.edges.get(node)
            if e is None or task is None or task.done():
                continue
            started = self._poll_started.get(node, loop.time())
            conn = getattr(e.link, "conn", None)
            heard = conn is not None and getattr(conn, "last_received", 0.0) > started
            t = loop.time()
            stalls = self._stalls
            stalled = (stalls is not None and stalls.stalled(started, t)
                       >= min(self.config.poll_timeout_s, t - started) / 2)
            cause: Any = ("answered" if heard else "blind" if stalled or now < e.held_until
                          else None)
            if cause is not None:
                await self._carry_out(self.watcher.handle(LinkFailed(
                    node=node, time=now, cause=cause,
                    detail="its poll is still in flight (busy, held)")))
        await self._carry_out(self.watcher.handle(Tick(now)))

    async def sweep(self) -> list[tuple[str, str]]:
        """One sweeper pass (also called by tests): returns what it destroyed.

        Driven by the sessions, not by listing sandboxes: the candidates are the
        registry's sandboxes of sessions that lapsed, closed or are unknown (its session
        index), plus the quarantined sandboxes (live on an edge, no record: a create
        whose replica died before its record was committed), whose session label is
        asked of their edge once. O(sessions + quarantined + swept) per pass. Measured
        (bench suite cluster, 50 edges x 2,000, 2 replicas, PostgreSQL, py-spy of
        replica 0 while filling 50k -> 100k live): listing every edge's sandboxes every
        5 s was 4-12% of the replica's samples (15% in the previous session's run;
        it grows with the sandboxes); this pass is 0.3%."""
        now = self.clock()
        sessions = self.sessions()
        reg = self.registry
        cands: list[SweepCandidate] = []
        for sess in reg.sessions():
            s = sessions.get(sess)
            if s is not None and not s.closed and s.expires_at > now:
                continue            # alive: none of its sandboxes is a candidate
            for sid in reg.ids_of_session(sess):
                rec = reg.sandbox(sid)
                cands.append(SweepCandidate(sid, sess, "paused" if rec.paused else "running"))
        cands += await self._quarantined_candidates()
        plan = plan_sweep(now, cands, sessions, started_at=self._started_at,
                          unknown_grace_s=self.config.unknown_session_grace_s)
        done: list[tuple[str, str]] = []

        async def destroy(sid: str, why: str) -> tuple[str, str] | None:
            link = self.edge(node_of(sid))
            if link is None:
                return None
            try:
                await link.destroy(sid, reason="evicted",
                                   detail=f"swept by the apiserver: {why}")
            except DsecError as exc:
                log.warning("sweeper could not destroy %s: %s", sid, exc)
                return None
            self.forget(sid, why)
            self._quarantine_sessions.pop(sid, None)
            self.metrics.swept.labels(why).inc()
            return sid, why
        for i in range(0, len(plan), _PROBES_AT_ONCE):
            got = await asyncio.gather(*(destroy(sid, why)
                                         for sid, why in plan[i:i + _PROBES_AT_ONCE]))
            done += [d for d in got if d is not None]
        live = set(reg.sessions()) | {c.session for c in cands}
        # Closed sessions whose sandboxes are all gone are forgotten; lapsed ones are kept
        # for session_retention_s (their owner may still renew them: a suspended client)
        # and then forgotten too (a renew is then a 404: open a new session).
        keep_s = max(self.config.session_retention_s, self.config.unknown_session_grace_s)
        stale = [k for k, s in sessions.items() if k not in live and (
            s.closed or s.expires_at + keep_s <= now)]
        self.store.delete_sessions(stale)
        return done

    async def _quarantined_candidates(self) -> list[SweepCandidate]:
        """Quarantined sandboxes (see :meth:`_settle_unknown`) that carry a session
        label, as sweep candidates. The label is asked of the sandbox's own edge once
        (the heartbeat's brief does not carry labels) and remembered while it stays
        quarantined; an edge that does not answer is asked again next pass."""
        held = {sid: node for node, q in self._quarantined.items() for sid in q}
        known = self._quarantine_sessions
        for sid in [s for s in known if s not in held]:
            del known[sid]
        # bounded per pass (a node may list many it has no record of); the rest next pass
        ask = [(sid, node) for sid, node in held.items() if sid not in known][:_LABELS_PER_SWEEP]

        async def label(sid: str, node: str) -> None:
            link = self.edge(NodeId(node))
            if link is None:
                return
            try:
                info = await link.get(sid)
            except DsecError:
                return
            if info.state in ("destroying", "destroyed", "failed"):
                return
            known[sid] = info.spec.labels.get(SESSION_LABEL)
        for i in range(0, len(ask), _PROBES_AT_ONCE):
            await asyncio.gather(*(label(sid, node) for sid, node in ask[i:i + _PROBES_AT_ONCE]))
        return [SweepCandidate(sid, sess, "running") for sid in held
                if (sess := known.get(sid)) is not None]

    async def retain(self) -> RetentionReport:
        """One retention pass (also called by tests): trim every growing table of the
        store (see :mod:`dsec.control.retention`), off the event loop."""
        cfg = self.config.retention
        now = self.clock()
        report = await asyncio.to_thread(retain, self.store, cfg.plan(now))
        self.registry.trim_ring()
        if cfg.lost_max_age_s is not None:
            cutoff = now - cfg.lost_max_age_s
            while self._lost:
                sid, lost = next(iter(self._lost.items()))
                if lost.events and lost.events[-1].time >= cutoff:
                    break
                del self._lost[sid]
        if report.total:
            log.info("retention removed %d events, %d idempotency keys, %d tombstones, "
                     "%d process leases", report.events, report.idempotency,
                     report.lost_sandboxes, report.process_leases)
        return report

    async def _retention_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.retention.interval_s)
            try:
                await self.retain()
            except Exception:
                log.exception("retention pass failed; the next one tries again")

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            try:
                await self.sweep_tick()
            except Exception:
                log.exception("sweeper pass failed")

    async def sweep_tick(self) -> list[tuple[str, str]]:
        """One round of the sweeper loop: a pass, after noticing a stall. A round that
        comes much later than asked (this process was stopped or starved, or the wall
        clock jumped) restarts the sweeper's watch: no client could renew its session
        meanwhile, so each gets a full lease again (see dsec.control.sweeper)."""
        now = self.clock()
        interval = self.config.sweep_interval_s
        if self._last_sweep and now - self._last_sweep > 2 * interval + 1.0:
            log.warning("sweeper woke %.1fs after its last pass (expected %.1fs): this "
                        "apiserver was stalled or its clock jumped; sessions get a full "
                        "lease to renew before any is swept", now - self._last_sweep,
                        interval)
            self._started_at = now
        self._last_sweep = now
        return await self.sweep()

    def _refresh_gauges(self, m: ApiMetrics) -> None:
        totals: dict[str, int] = {}
        healthy = 0
        now = self.clock()
        for e in self.edges.values():
            hb = e.heartbeat
            if hb is not None:
                for st, n in hb.counts.items():
                    totals[st] = totals.get(st, 0) + n
                hits = sum(p.hits for p in hb.pools.values())
                misses = sum(p.misses for p in hb.pools.values())
                if hb.pools:
                    # No handouts yet reads as 1.0 (nothing was served cold).
                    m.warm_pool_hit_rate.labels(e.node).set(
                        hits / (hits + misses) if hits + misses else 1.0)
                    m.warm_pool_handouts.labels(e.node, "hit").set(hits)
                    m.warm_pool_handouts.labels(e.node, "miss").set(misses)
                    m.warm_pool_ready.labels(e.node).set(sum(p.ready for p in
                                                             hb.pools.values()))
            healthy += self._healthy(e, now)
        for st in ("creating", "running", "pausing", "paused", "resuming", "destroying",
                   "failed"):
            m.sandboxes.labels(st).set(totals.get(st, 0))
        m.nodes.labels("healthy").set(healthy)
        m.nodes.labels("unhealthy").set(len(self.edges) - healthy)
        # of the unhealthy: held because this apiserver cannot use their link (not lost)
        m.nodes.labels("unreachable").set(
            sum(e.failure in ("answered", "blind") for e in self.edges.values()))
        m.registry_sandboxes.set(len(self.registry))


# How often a node reporting ids that are not its own is logged (one line per node).
_FOREIGN_LOG_S = 60.0

# Listed sandboxes without a record looked up in the store per node per full list, and
# quarantined sandboxes whose session label the sweeper asks of their edge per pass.
_UNKNOWN_PER_LIST = 10_000
_LABELS_PER_SWEEP = 1_024

# Edge lookups a reconcile sends at once (each is one pipelined Aether call; a restarted
# apiserver may discover thousands of sandboxes in its first poll of an edge).
_PROBES_AT_ONCE = 256


def _list_digest(briefs: list[Any]) -> tuple[int, int] | None:
    """(count, XOR of brief_hash) of an edge's list, as Registry.node_digest counts its
    records. Sandboxes still ``creating`` are left out: no record can hold them yet, and
    the next list shows them running (a node always has some while creates go on, so
    counting them would make every list under load a full reconcile). None when one is
    in another transition (pausing, resuming, destroying): such a list is reconciled in
    full."""
    x = n = 0
    for b in briefs:
        st = b.state
        if st == "running":
            x ^= brief_hash(b.id, False)
        elif st == "paused":
            x ^= brief_hash(b.id, True)
        elif st == "creating":
            continue
        else:
            return None
        n += 1
    return n, x


def _check_page(node: str, briefs: list[Any], after: str, limit: int) -> None:
    """A page of an edge's sandbox list holds at most ``limit`` sandboxes, in strictly ascending id order after its
    cursor (else paging could loop, or a list repeat ids): RemoteProtocolError."""
    if len(briefs) > limit:
        raise RemoteProtocolError(f"edge {node} sent a page of {len(briefs)} sandboxes "
                                  f"when asked for {limit}", node=node, limit=limit)
    prev = after
    for b in briefs:
        if not b.id > prev:
            raise RemoteProtocolError(
                f"edge {node} listed sandbox {b.id[:80]!r} after {prev[:80]!r}: a page "
                "of its sandbox list must be in ascending id order after its cursor",
                node=node)
        prev = b.id


def _info_of(rec: SandboxRecord) -> SandboxInfo:
    """Registry record -> the API's SandboxInfo (``last_active_at`` is not tracked by
    the control plane: it reads as the creation time; GET one sandbox for the live one)."""
    spec = rec.spec or SandboxSpec(cpu_milli=rec.cpu_milli, memory_bytes=rec.memory_bytes,
                                   priority=rec.priority)
    # a record stored before a spec could leave backend/project unset omitted them at
    # their old defaults: the record's own columns say what they were
    spec = resolve(spec, backend=rec.backend, project=rec.project)  # type: ignore[arg-type]
    return SandboxInfo(id=rec.id, node=rec.node, state="paused" if rec.paused else "running",
                       spec=spec, created_at=rec.created_at, last_active_at=rec.created_at)


LAYERED_BACKENDS = frozenset({"container", "runc", "gvisor", "vm"})
"""Backends whose sandboxes mount layers of the node's store (and whose snapshots are
layers): the ones a create may fetch layers for."""


def _is_digest(ref: str) -> bool:
    return len(ref) == 71 and ref.startswith("sha256:")


def _holds(e: EdgeEntry, ref: str) -> bool:
    """Whether edge ``e`` reported (or just took) ``ref``; a digest prefix matches too."""
    if ref in e.images or ref in e.noted:
        return True
    if ref.startswith("sha256:") and len(ref) >= 19:
        return any(i.startswith(ref) for i in e.images) or any(
            i.startswith(ref) for i in e.noted)
    return False
