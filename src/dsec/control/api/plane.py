"""Wiring of the real control plane into the apiserver's seams.

:class:`ControlPlane` holds the state store (SQLite), IAM, the quota index, the registry,
placement and the edge directory, and implements what :class:`ApiService` asks of them
(:class:`Authority`, :class:`QuotaGate`, :class:`Placer`, :class:`NodeDirectory`) plus the
admin routes (:class:`AdminOps`) and the background loops: edge heartbeats (which feed
placement and the ``/metrics`` gauges), the edge event feeds (which keep the registry and
quota usage in step with what edges reap on their own: TTL, idle, OOM), and the leak
sweeper (:mod:`dsec.control.api.sweeper`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from collections.abc import Callable
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
from dsec.control.store import QuotaRow, StateStore
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
from dsec.edge.spec import SandboxInfo, SandboxSpec
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

__all__ = ["ControlPlane", "EdgeEntry", "IamAuthority", "PlaneConfig"]

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
    sessions: dict[str, Session] = field(default_factory=dict)
    service: ApiService | None = None
    layer_dir: str | None = None
    placement: Placement = field(default_factory=lambda: Placement(rng=random.Random()))
    watcher: Watcher = field(default_factory=Watcher)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _pending: int = 0
    _started_at: float = 0.0

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
    def add_edge(self, node: str, address: str, link: EdgeOps) -> None:
        self.edges[node] = EdgeEntry(node=node, address=address, link=link)

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
        spec = info.spec
        try:
            self.registry.add_sandbox(SandboxRecord(
                id=info.id, node=info.node, project=spec.project, backend=spec.backend,
                cpu_milli=spec.cpu_milli, memory_bytes=spec.memory_bytes,
                priority=spec.priority, created_at=info.created_at))
        except InvalidArgument:
            pass  # already recorded (an idempotent replay raced the feed)

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
        s = self.sessions[sid] = Session(sid, caller.id, lease_s, self.clock() + lease_s)
        return SessionView(id=s.id, lease_s=s.lease_s, expires_at=s.expires_at)

    def renew_session(self, caller: Caller, sid: str) -> SessionView:
        """Extend a lease; an unknown id (apiserver restarted) is re-registered."""
        if not sid.startswith("ses-") or len(sid) > 64:
            raise NotFound(f"no session {sid[:64]!r}")
        s = self.sessions.get(sid)
        if s is None:
            s = self.sessions[sid] = Session(sid, caller.id, 60.0, 0.0)
        elif s.principal_id != caller.id:
            raise NotFound(f"no session {sid!r}")
        if s.closed:
            raise NotFound(f"session {sid} was closed; open a new one")
        s.expires_at = self.clock() + s.lease_s
        return SessionView(id=s.id, lease_s=s.lease_s, expires_at=s.expires_at)

    def close_session(self, caller: Caller, sid: str) -> None:
        s = self.sessions.get(sid)
        if s is None or s.principal_id != caller.id:
            raise NotFound(f"no session {sid[:64]!r}")
        s.closed = True
        s.expires_at = self.clock()

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

    async def _poll(self, e: EdgeEntry) -> None:
        link: Any = e.link
        try:
            hb = await link.heartbeat(include_sandboxes=True)
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

    async def _carry_out(self, instructions: list[Any]) -> None:
        """Execute what the watcher decided."""
        for ins in instructions:
            if isinstance(ins, UpdateNode):
                self.placement.update(ins.view)
            elif isinstance(ins, EvictNode):
                self.placement.remove(ins.node)
                # evict_node, not evict(ins.sandbox_ids): the heartbeat's list misses
                # sandboxes created on the node after its last heartbeat.
                self.registry.evict(ins.sandbox_ids, reason=ins.reason)
                self.registry.evict_node(ins.node, reason=ins.reason)
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
        plan = plan_sweep(self.clock(), cands, self.sessions, started_at=self._started_at,
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
        # Closed sessions whose sandboxes are all gone can be forgotten.
        live = {c.session for c in cands}
        for k in [k for k, s in self.sessions.items() if s.closed and k not in live]:
            del self.sessions[k]
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
            if e.heartbeat is not None:
                for st, n in e.heartbeat.counts.items():
                    totals[st] = totals.get(st, 0) + n
            healthy += self._healthy(e, now)
        for st in ("creating", "running", "pausing", "paused", "resuming", "destroying",
                   "failed"):
            m.sandboxes.labels(st).set(totals.get(st, 0))
        m.nodes.labels("healthy").set(healthy)
        m.nodes.labels("unhealthy").set(len(self.edges) - healthy)



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
