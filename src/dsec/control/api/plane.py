"""Wiring of the real control plane into the apiserver's seams.

:class:`ControlPlane` holds the state store (SQLite), IAM, the quota index, the registry,
placement and the edge directory, and implements what :class:`ApiService` asks of them
(:class:`Authority`, :class:`QuotaGate`, :class:`Placer`, :class:`NodeDirectory`) plus the
admin routes (:class:`AdminOps`) and the background loops: edge heartbeats (which feed
placement, the watcher and the ``/metrics`` gauges), the edge event feeds (which keep the
registry and quota usage in step with what edges reap on their own: TTL, idle, OOM), and
the leak sweeper (:mod:`dsec.control.api.sweeper`).

Keeping the registry in step with the edges (it answers ``GET /v1/sandboxes``):

- creates, destroys, pauses and resumes made through this apiserver are recorded at once;
- every poll reads the edge's event feed (TTL/idle reaps, backend deaths, auto-pauses);
- every poll also reconciles the registry with the heartbeat's full sandbox list, which
  repairs what a feed cannot tell: events that fell out of the edge's bounded feed
  (``EventFeed.lost``), a create whose edge-side death raced its registration, sandboxes
  created by another replica or adopted by a restarted edge;
- an edge whose feed sequence went backwards restarted: its feed is read from the start;
- an edge silent for ``node_ttl_s`` is expired by the watcher: its sandboxes are evicted
  (reason ``node_lost``, quota released) and remembered as tombstones, so ``GET`` and
  ``/events`` of such a sandbox say what happened while its edge is unreachable; when the
  edge comes back the watcher has them destroyed, never resurrected.

Durable state is in the store only: sessions (``sessions`` table) and idempotency keys
(``idempotency`` table, see :mod:`dsec.control.idempotency`) are shared by every replica
over the same store.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from dsec.control.api.service import ApiService, Caller, EdgeOps
from dsec.control.api.sweeper import SESSION_LABEL, Session, SweepCandidate, plan_sweep
from dsec.control.api.types import (
    CreateKeyRequest,
    CreateKeyResponse,
    ImageList,
    ImageView,
    NodeView,
    ProjectList,
    ProjectView,
    QuotaBody,
    SessionView,
)
from dsec.control.iam import Iam
from dsec.control.metrics import ApiMetrics
from dsec.control.placement import Decision, Placement, PlacementRequest
from dsec.control.quota import Quota, QuotaIndex
from dsec.control.records import SandboxRecord
from dsec.control.registry import Registry
from dsec.control.store import QuotaRow, SessionRow, StateStore
from dsec.control.watcher import (
    DestroySandboxes,
    EvictNode,
    LiveSandbox,
    NodeHeartbeat,
    PreemptSandboxes,
    Tick,
    UpdateNode,
    Watcher,
    WatcherConfig,
)
from dsec.edge.spec import SandboxEvent, SandboxInfo, SandboxSpec, SandboxState
from dsec.errors import (
    Conflict,
    DsecError,
    ImageError,
    ImageNotFound,
    InvalidArgument,
    NoCapacity,
    NotFound,
    SandboxNotFound,
)
from dsec.ids import NodeId, node_of, parse_project_path

__all__ = ["ControlPlane", "EdgeEntry", "IamAuthority", "LostSandbox", "PlaneConfig"]

log = logging.getLogger("dsec.control")

BACKEND_LABEL = "dsec.io/backend."


@dataclass(slots=True, frozen=True, kw_only=True)
class PlaneConfig:
    heartbeat_interval_s: float = 1.0      # how often the apiserver polls each edge
    node_ttl_s: float = 10.0               # silent this long -> unhealthy, not placed on
    sweep_interval_s: float = 5.0
    unknown_session_grace_s: float = 180.0
    min_lease_s: float = 5.0
    max_lease_s: float = 86_400.0
    lost_tombstones: int = 100_000         # evicted sandboxes remembered for GET/events
    reconnect_interval_s: float = 1.0      # retry an unreachable edge's connection


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
    heartbeat: Any = None           # dsec.edge.protocol.Heartbeat
    last_seen: float = 0.0
    feed_after: int = 0
    images: frozenset[str] = frozenset()    # image refs / snapshot ids the edge holds
    noted: set[str] = field(default_factory=set)  # snapshots taken since its heartbeat
    retry_at: float = 0.0                   # next reconnect attempt (link closed)
    token: bytes | str | None = None        # Aether token for reconnecting (tcp edges)


@dataclass(slots=True, frozen=True)
class LostSandbox:
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
    layer_dir: str | None = None
    placement: Placement = field(default_factory=lambda: Placement(rng=random.Random()))
    watcher: Watcher = field(default_factory=Watcher)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _pending: int = 0
    _started_at: float = 0.0
    _lost: OrderedDict[str, LostSandbox] = field(default_factory=OrderedDict)

    @classmethod
    def open(cls, store: StateStore, *, metrics: ApiMetrics, config: PlaneConfig | None = None,
             clock: Callable[[], float] = time.time) -> ControlPlane:
        iam = Iam(store, clock=clock)
        quota = QuotaIndex()
        for row in store.list_quotas():
            quota.set_quota(row.project, Quota(**row.quota))
        registry = Registry(store, clock=clock, quota=quota)
        cfg = config or PlaneConfig()
        plane = cls(store=store, iam=iam, quota=quota, registry=registry, metrics=metrics,
                    config=cfg, clock=clock,
                    watcher=Watcher(WatcherConfig(ttl_s=cfg.node_ttl_s)))
        metrics.on_scrape(plane._refresh_gauges)
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
                 token: bytes | str | None = None) -> None:
        """Register an edge; ``token`` is what :meth:`_link` reconnects with."""
        self.edges[node] = EdgeEntry(node=node, address=address, link=link, token=token)

    def edge(self, node: NodeId) -> EdgeOps | None:
        e = self.edges.get(node)
        return e.link if e is not None else None

    def _healthy(self, e: EdgeEntry, now: float) -> bool:
        return e.heartbeat is not None and now - e.last_seen <= self.config.node_ttl_s

    def nodes(self) -> list[NodeView]:
        now = self.clock()
        out = []
        for e in self.edges.values():
            hb = e.heartbeat
            if hb is None:
                out.append(NodeView(id=e.node, address=e.address, healthy=False))
                continue
            out.append(NodeView(
                id=e.node, address=e.address, healthy=self._healthy(e, now),
                backends=list(hb.backends), cpu_milli_total=hb.capacity.cpu_milli,
                cpu_milli_used=hb.usage.cpu_milli, memory_bytes_total=hb.capacity.memory_bytes,
                memory_bytes_used=hb.usage.memory_bytes, max_sandboxes=hb.capacity.sandboxes,
                sandboxes=hb.usage.sandboxes, by_state=dict(hb.counts), labels=dict(hb.labels),
                last_heartbeat=hb.time))
        return out

    # ----------------------------------------------------------- placement
    # dsec.control.placement decides; the edge's backends travel as node labels
    # ``dsec.io/backend.<name>=1`` so a create selects nodes offering its backend.
    def place(self, spec: SandboxSpec, exclude: frozenset[str]) -> Decision:
        offered = {b for e in self.edges.values() if e.heartbeat is not None
                   for b in e.heartbeat.backends}
        if offered and spec.backend not in offered:
            # Asking for a backend nobody runs is a request problem (400), not a lack of
            # capacity (503) that a retry could fix.
            raise InvalidArgument(
                f"backend {spec.backend!r} is not offered by any node of this cluster; "
                f"available: {', '.join(sorted(offered))}", field="backend")
        req = PlacementRequest(cpu_milli=spec.cpu_milli, memory_bytes=spec.memory_bytes,
                               selector={f"{BACKEND_LABEL}{spec.backend}": "1"},
                               group=spec.project)
        if spec.snapshot is not None:
            return self._place_on_holder(spec.snapshot, req, exclude)
        return self.placement.place(req, exclude=exclude)

    # Snapshots live in the layer store of the node that took them, so a sandbox started
    # from one must go to a node holding it: image affinity as a hard filter. The holders
    # are few (one node, or the edges sharing one machine's store), so they are scored
    # directly instead of going through k-choice sampling.
    def _place_on_holder(self, ref: str, req: PlacementRequest,
                         exclude: frozenset[str]) -> Decision:
        now = self.clock()
        holders = [n for n, e in self.edges.items()
                   if self._healthy(e, now) and _holds(e, ref)]
        if not holders:
            raise ImageNotFound(
                f"snapshot {ref[:80]!r} is on no healthy node of this cluster; snapshots live "
                "on the node that took them (GET /v1/snapshots lists them)", ref=ref[:80])
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
    def admit(self, project: str, spec: SandboxSpec) -> object:
        """Check the quota chain and hold a provisional charge until commit/abort."""
        self.quota.check(project, backend=spec.backend, cpu_milli=spec.cpu_milli,
                         memory_bytes=spec.memory_bytes)
        self._pending += 1
        token = f"pending:{self._pending}"
        self.quota.insert(SandboxRecord(id=token, node="", project=project,
                                        backend=spec.backend, cpu_milli=spec.cpu_milli,
                                        memory_bytes=spec.memory_bytes,
                                        priority=spec.priority))
        return token

    def commit(self, token: object, info: SandboxInfo) -> None:
        self.quota.remove(str(token))
        self._record(info)

    def _record(self, info: SandboxInfo, reason: str = "created") -> None:
        spec = info.spec
        try:
            self.registry.add_sandbox(SandboxRecord(
                id=info.id, node=info.node, project=spec.project, backend=spec.backend,
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
                       limit: int) -> tuple[list[SandboxInfo], bool]:
        """A page of live sandboxes from the registry, in id order after ``after``.

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
            if items:
                have = r.spec.labels if r.spec is not None else {}
                for k, v in items:
                    if have.get(k) != v:
                        return False
            return True
        recs, more = reg.page(after=after, limit=limit, projects=projects,
                              match=match if want_paused is not None or items else None)
        return [_info_of(r) for r in recs], more

    def lost(self, sandbox_id: str) -> LostSandbox | None:
        """The tombstone of a sandbox evicted with its lost node, if remembered."""
        return self._lost.get(sandbox_id)

    def _tombstone(self, rec: SandboxRecord, reason: str, now: float) -> None:
        info = _info_of(rec)
        info.state, info.reason = "destroyed", reason
        detail = (f"evicted by the control plane: node {rec.node} sent no heartbeat for "
                  f"more than {self.config.node_ttl_s:g}s")
        events = [SandboxEvent(time=rec.created_at, sandbox_id=rec.id, from_state=None,
                               to_state="running", reason="created"),
                  SandboxEvent(time=now, sandbox_id=rec.id,
                               from_state="paused" if rec.paused else "running",
                               to_state="destroyed", reason=reason, detail=detail)]
        self._lost[rec.id] = LostSandbox(info=info, events=events)
        while len(self._lost) > self.config.lost_tombstones:
            self._lost.popitem(last=False)

    # ----------------------------------------------------------------- admin
    def _admin(self, caller: Caller, project: str) -> None:
        ApiService.require(caller, project, "admin")

    def list_projects(self, caller: Caller) -> ProjectList:
        paths = set(self.quota.quotas()) | set(caller.roles)
        for r in self.registry.sandboxes():
            paths.add(r.project)
        items = [self._view(p) for p in sorted(paths) if caller.role_on(p) is not None]
        return ProjectList(items=items)

    def _view(self, path: str) -> ProjectView:
        q = self.quota.quota(path)
        u = self.quota.usage(path)
        return ProjectView(
            path=path,
            quota=None if q is None else QuotaBody(max_sandboxes=q.max_sandboxes,
                                                    cpu_milli=q.cpu_milli,
                                                    memory_bytes=q.memory_bytes),
            usage={"sandboxes": u.sandboxes, "cpu_milli": u.cpu_milli,
                   "memory_bytes": u.memory_bytes})

    def get_project(self, caller: Caller, path: str) -> ProjectView:
        parse_project_path(path)
        ApiService.require(caller, path, "reader")
        return self._view(path)

    def set_quota(self, caller: Caller, path: str, q: QuotaBody) -> ProjectView:
        parse_project_path(path)
        self._admin(caller, path)
        quota = Quota(max_sandboxes=q.max_sandboxes, cpu_milli=q.cpu_milli,
                      memory_bytes=q.memory_bytes)
        self.quota.set_quota(path, quota)
        self.store.put_quota(QuotaRow(project=path, quota=msgspec.to_builtins(quota)))
        return self._view(path)

    def create_key(self, caller: Caller, req: CreateKeyRequest) -> CreateKeyResponse:
        parse_project_path(req.project)
        self._admin(caller, req.project)
        try:
            self.iam.get_principal(req.name)
        except NotFound:
            self.iam.create_principal(req.name, name=req.name)
        self.iam.grant(req.name, req.project, req.role)
        key = self.iam.create_key(req.name)
        return CreateKeyResponse(name=req.name, project=req.project, role=req.role,
                                 api_key=key.token)

    # -------------------------------------------------------------- sessions
    def open_session(self, caller: Caller, lease_s: float) -> SessionView:
        c = self.config
        if not c.min_lease_s <= lease_s <= c.max_lease_s:
            raise InvalidArgument(f"lease_s={lease_s} must be within {c.min_lease_s:g}.."
                                  f"{c.max_lease_s:g} seconds", field="lease_s")
        sid = "ses-" + secrets.token_hex(8)
        row = SessionRow(id=sid, principal_id=caller.id, lease_s=lease_s,
                         expires_at=self.clock() + lease_s)
        self.store.put_session(row)
        return SessionView(id=row.id, lease_s=row.lease_s, expires_at=row.expires_at)

    def renew_session(self, caller: Caller, sid: str) -> SessionView:
        """Extend a lease (one atomic store update, so any replica may serve it); an
        unknown id (forgotten after its sandboxes were swept) is re-registered."""
        if not sid.startswith("ses-") or len(sid) > 64:
            raise NotFound(f"no session {sid[:64]!r}")
        now = self.clock()
        row = self.store.renew_session(sid, caller.id, now)
        if row is None:
            old = self.store.get_session(sid)
            if old is not None and old.principal_id != caller.id:
                raise NotFound(f"no session {sid!r}")
            if old is not None and old.closed:
                raise NotFound(f"session {sid} was closed; open a new one")
            row = SessionRow(id=sid, principal_id=caller.id, lease_s=60.0,
                             expires_at=now + 60.0)
            self.store.put_session(row)
        return SessionView(id=row.id, lease_s=row.lease_s, expires_at=row.expires_at)

    def close_session(self, caller: Caller, sid: str) -> None:
        s = self.store.get_session(sid) if len(sid) <= 64 else None
        if s is None or s.principal_id != caller.id:
            raise NotFound(f"no session {sid[:64]!r}")
        self.store.put_session(SessionRow(id=s.id, principal_id=s.principal_id,
                                          lease_s=s.lease_s, expires_at=self.clock(),
                                          closed=True))

    def sessions(self) -> dict[str, Session]:
        """Every session in the store (what the sweeper decides on)."""
        return {r.id: Session(r.id, r.principal_id, r.lease_s, r.expires_at, r.closed)
                for r in self.store.list_sessions()}

    # ---------------------------------------------------------------- images
    def _layers(self) -> Any:
        if self.layer_dir is None:
            raise Conflict("this apiserver has no layer store configured")
        from dsec.image import LayerStore
        return LayerStore(self.layer_dir)

    def list_images(self, caller: Caller) -> ImageList:
        ApiService.require(caller, caller.default_project, "reader")
        return ImageList(items=[_image_view(m) for m in self._layers().manifests()])

    async def build_image(self, caller: Caller, tar_path: str, *, name: str, kind: str,
                          tag: str, oci: bool) -> ImageList:
        """Build (or import) layers with dsec.image in a worker thread (mkfs.erofs).

        Layers and their names are shared by every project on the cluster, so a build
        (which may move a tag such as ``base:latest`` that others start from) needs the
        admin role; a member could otherwise plant a poisoned base under everyone."""
        ApiService.require(caller, caller.default_project, "admin")
        store = self._layers()

        def work() -> list[Any]:
            if oci:
                from dsec.image import import_oci
                return list(import_oci(store, tar_path, name=name, tag=tag,
                                       kind=kind))  # type: ignore[arg-type]
            with open(tar_path, "rb") as f:
                return [store.add_tar(f, kind=kind, name=name, tag=tag)]  # type: ignore[arg-type]
        try:
            made = await asyncio.to_thread(work)
        except DsecError:
            raise
        except Exception as exc:  # noqa: BLE001 - mkfs/tar failures on hostile uploads
            log.warning("image build %s:%s failed", name, tag, exc_info=exc)
            raise ImageError(f"could not build image {name}:{tag} from the upload: "
                             f"{type(exc).__name__}: {exc}") from exc
        return ImageList(items=[_image_view(m) for m in made])

    # ------------------------------------------------------------- loops
    async def start(self) -> None:
        self._started_at = self.clock()
        await self.poll_edges()
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="dsec-heartbeats"))
        self._tasks.append(asyncio.create_task(self._sweep_loop(), name="dsec-sweeper"))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        try:
            self.registry.flush()
        except Exception:
            log.exception("final registry flush failed")

    async def poll_edges(self) -> None:
        await asyncio.gather(*(self._poll(e) for e in list(self.edges.values())),
                             return_exceptions=True)
        self.registry.flush()

    async def _link(self, e: EdgeEntry) -> Any:
        """The edge's link, reconnected if its connection closed (the edge restarted or
        the network dropped): Aether connections do not reconnect on their own."""
        link: Any = e.link
        conn = getattr(link, "conn", None)
        if conn is None or not conn.closed:
            return link
        now = self.clock()
        if now < e.retry_at:
            return None
        e.retry_at = now + self.config.reconnect_interval_s
        from dsec.edge.service import EdgeClient
        try:
            fresh = await EdgeClient.connect(e.address, token=e.token)
        except DsecError as exc:
            log.debug("edge %s still unreachable at %s: %s", e.node, e.address, exc)
            return None
        e.link = fresh
        try:
            await link.close()
        except DsecError:
            pass
        log.info("reconnected to edge %s at %s", e.node, e.address)
        return fresh

    async def _poll(self, e: EdgeEntry) -> None:
        link = await self._link(e)
        if link is None:
            return
        try:
            hb = await link.heartbeat(include_sandboxes=True)
            if hb.feed_seq < e.feed_after:
                # The edge restarted: its feed numbering started over.
                e.feed_after = 0
            feed = await link.feed(e.feed_after, 10_000)
        except DsecError as exc:
            log.debug("edge %s unreachable: %s", e.node, exc)
            return
        e.heartbeat = hb
        e.last_seen = now = self.clock()
        e.images = frozenset(hb.images)
        if e.noted:
            e.noted -= e.images
        e.feed_after = feed.next
        labels = dict(hb.labels)
        labels.update({f"{BACKEND_LABEL}{b}": "1" for b in hb.backends})
        await self._carry_out(self.watcher.handle(NodeHeartbeat(
            node=e.node, time=now, cpu_milli_capacity=hb.capacity.cpu_milli,
            memory_bytes_capacity=hb.capacity.memory_bytes, cpu_milli_used=hb.usage.cpu_milli,
            memory_bytes_used=hb.usage.memory_bytes, max_sandboxes=hb.capacity.sandboxes,
            labels=labels,
            sandboxes=tuple(LiveSandbox(id=b.id, project=b.project, cpu_milli=b.cpu_milli,
                                        memory_bytes=b.memory_bytes, priority=b.priority,
                                        paused=b.state == "paused")
                            for b in hb.sandboxes or ()))))
        for ev in feed.events:
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
            await self._reconcile(e, link, hb)

    async def _reconcile(self, e: EdgeEntry, link: Any, hb: Any) -> None:
        """Make the registry's records of node ``e`` match the heartbeat's list."""
        reg = self.registry
        zombies = self.watcher.zombies(e.node)
        listed: dict[str, Any] = {}
        for b in hb.sandboxes:
            if b.state in _GONE or b.id in zombies or b.id in self._lost:
                continue
            listed[b.id] = b
        for sid in reg.ids_on(e.node) - listed.keys():
            # Created before the heartbeat was taken (same edge clock) yet not listed:
            # it is gone and its feed event was lost. Younger ones may just be racing.
            try:
                rec = reg.sandbox(sid)
            except SandboxNotFound:
                continue
            if rec.created_at < hb.time:
                self.forget(sid, "gone")
        for sid, b in listed.items():
            if sid in reg:
                rec = reg.sandbox(sid)
                if b.state in ("running", "paused") and rec.paused != (b.state == "paused"):
                    self.paused(sid, b.state == "paused")
                continue
            try:
                info = await link.get(sid)
            except DsecError:
                continue
            if info.state not in _GONE and sid not in self._lost:
                self._record(info, reason="discovered")

    async def _carry_out(self, instructions: list[Any]) -> None:
        """Execute what the watcher decided."""
        for ins in instructions:
            if isinstance(ins, UpdateNode):
                self.placement.update(ins.view)
            elif isinstance(ins, EvictNode):
                self.placement.remove(ins.node)
                # evict_node, not evict(ins.sandbox_ids) alone: the heartbeat's list misses
                # sandboxes created on the node after its last heartbeat.
                now = self.clock()
                for rec in (self.registry.evict(ins.sandbox_ids, reason=ins.reason)
                            + self.registry.evict_node(ins.node, reason=ins.reason)):
                    self._tombstone(rec, ins.reason, now)
                log.warning("node %s lost (no heartbeat for %.1fs): evicted its sandboxes",
                            ins.node, self.config.node_ttl_s)
            elif isinstance(ins, (DestroySandboxes, PreemptSandboxes)):
                link = self.edge(NodeId(ins.node))
                if link is not None and ins.sandbox_ids:
                    reason = "preempted" if isinstance(ins, PreemptSandboxes) else "node_lost"
                    try:
                        await link.destroy_many(list(ins.sandbox_ids), reason=reason)
                    except DsecError as exc:
                        log.warning("could not destroy %s on %s: %s", ins.sandbox_ids,
                                    ins.node, exc)
                self.registry.evict(ins.sandbox_ids, reason=ins.reason)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            try:
                await self.poll_edges()
                await self._carry_out(self.watcher.handle(Tick(self.clock())))
                self.registry.flush()
            except Exception:
                log.exception("edge poll failed")

    async def sweep(self) -> list[tuple[str, str]]:
        """One sweeper pass (also called by tests): returns what it destroyed."""
        cands: list[SweepCandidate] = []
        for e in list(self.edges.values()):
            try:
                infos = await e.link.list()
            except DsecError:
                continue
            for i in infos:
                s = i.spec.labels.get(SESSION_LABEL)
                if s is not None:
                    cands.append(SweepCandidate(i.id, s, i.state))
        now = self.clock()
        sessions = self.sessions()
        plan = plan_sweep(now, cands, sessions, started_at=self._started_at,
                          unknown_grace_s=self.config.unknown_session_grace_s)
        done: list[tuple[str, str]] = []
        for sid, why in plan:
            link = self.edge(node_of(sid))
            if link is None:
                continue
            try:
                await link.destroy(sid, reason="evicted", detail=f"swept by the apiserver: {why}")
            except DsecError as exc:
                log.warning("sweeper could not destroy %s: %s", sid, exc)
                continue
            self.forget(sid, why)
            self.metrics.swept.labels(why).inc()
            done.append((sid, why))
        # Closed or long-lapsed sessions whose sandboxes are all gone are forgotten (a
        # lapsed client that renews later is re-registered by the renew upsert).
        live = {c.session for c in cands}
        stale = [k for k, s in sessions.items() if k not in live and (
            s.closed or s.expires_at + self.config.unknown_session_grace_s <= now)]
        self.store.delete_sessions(stale)
        return done

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            try:
                await self.sweep()
            except Exception:
                log.exception("sweeper pass failed")

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
        m.registry_sandboxes.set(len(self.registry))


_GONE = frozenset({"destroying", "destroyed", "failed"})


def _info_of(rec: SandboxRecord) -> SandboxInfo:
    """Registry record -> the API's SandboxInfo (``last_active_at`` is not tracked by
    the control plane: it reads as the creation time; GET one sandbox for the live one)."""
    spec = rec.spec or SandboxSpec(project=rec.project, backend=rec.backend,  # type: ignore[arg-type]
                                   cpu_milli=rec.cpu_milli, memory_bytes=rec.memory_bytes,
                                   priority=rec.priority)
    return SandboxInfo(id=rec.id, node=rec.node, state="paused" if rec.paused else "running",
                       spec=spec, created_at=rec.created_at, last_active_at=rec.created_at)


def _holds(e: EdgeEntry, ref: str) -> bool:
    """Whether edge ``e`` reported (or just took) ``ref``; a digest prefix matches too."""
    if ref in e.images or ref in e.noted:
        return True
    if ref.startswith("sha256:") and len(ref) >= 19:
        return any(i.startswith(ref) for i in e.images) or any(
            i.startswith(ref) for i in e.noted)
    return False


def _image_view(m: Any) -> ImageView:
    ref = f"{m.name}:{m.tag}" if m.name else m.digest
    return ImageView(ref=ref, digest=m.digest, kind=m.kind, size_bytes=m.size_bytes,
                     created_at=m.created, labels=dict(m.labels))
