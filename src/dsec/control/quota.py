"""Nested quotas over the project tree, checked against an incremental usage index.

Projects form a tree (``org/team/exp1``). A :class:`Quota` may sit at any node; a create
is admitted only if it fits the quota of its project *and* of every ancestor. Usage is
kept per tree node and updated on every insert/remove/pause/resume/node-lost, so a check
walks the project's ancestor chain (O(depth), a cached tuple) and never looks at
sandboxes. It allocates nothing (no per-sandbox work, no intermediate collections).

Paused sandboxes still count as sandboxes; whether they count for CPU and memory is
:class:`QuotaPolicy` (default: a paused sandbox holds no CPU but keeps its memory
reservation, since resuming must not fail for lack of memory the project gave away).

Snapshot storage (``snapshot_bytes``) is a dimension of its own: the stored bytes of the
project subtree's snapshot layers. It rises when a snapshot is recorded
(:meth:`QuotaIndex.add_snapshot`) and falls when one is deleted; before a snapshot is
taken, :meth:`QuotaIndex.snapshot_room` tells how many bytes the new layer may take
(the least room over the ancestor chain), which the edge enforces before anything
enters its layer store.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from dsec.control.records import SandboxRecord
from dsec.errors import InvalidArgument, QuotaExceeded, SandboxNotFound
from dsec.ids import ProjectPath, parse_project_path, project_ancestors
from dsec.wire.netpolicy import NetworkPolicy
from dsec.wire.spec import BACKEND_ISOLATION, TIER_BACKENDS, quota_tier

__all__ = ["Limits", "Quota", "QuotaIndex", "QuotaPolicy", "Usage"]


class Limits(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Resource ceilings; ``None`` means no limit on that resource."""

    max_sandboxes: int | None = None
    cpu_milli: int | None = None
    memory_bytes: int | None = None
    snapshot_bytes: int | None = None       # stored bytes of the subtree's snapshots
    # bytes of the layers the subtree's image names reach (dsec.image.gc.
    # project_image_bytes: computed from the layer store, checked when a name is set)
    image_bytes: int | None = None

    def validate(self, where: str) -> None:
        for name in ("max_sandboxes", "cpu_milli", "memory_bytes", "snapshot_bytes",
                     "image_bytes"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise InvalidArgument(f"quota {where}.{name}={v!r} must be a non-negative "
                                      "integer or null (no limit)", field=name)


class Quota(Limits, frozen=True, kw_only=True, omit_defaults=True):
    """A project's quota: overall :class:`Limits` plus optional per-backend limits, and
    its network ceiling: the most open egress policy a sandbox of the project (or of a
    subproject) may ask for (None: no ceiling of its own; every ancestor's binds too)."""

    backends: dict[str, Limits] = {}
    # per isolation tier (issue 21): the tier's sandboxes whatever backend runs them
    # (container: native, runc, simulated and fncall together: fncall gives no tier and
    # is counted in the weakest, spec.quota_tier); max_sandboxes=0 forbids a tier
    tiers: dict[str, Limits] = {}
    network: NetworkPolicy | None = None
    # create(image=<registry ref>) pulls on first use (None: as the parent says; see
    # QuotaIndex.registry_pull)
    registry_pull: bool | None = None
    # may sandboxes here be qos "ls" (None: as the parent says; see QuotaIndex.qos_ls)
    qos_ls: bool | None = None

    def validate(self, where: str = "quota") -> None:
        Limits.validate(self, where)
        for b, lim in self.backends.items():
            lim.validate(f"{where}.backends[{b}]")
        for t, lim in self.tiers.items():
            if t not in TIER_BACKENDS:
                raise InvalidArgument(f"quota {where}.tiers[{t[:40]!r}]: no such isolation "
                                      f"tier; use {', '.join(TIER_BACKENDS)}", field="tiers")
            lim.validate(f"{where}.tiers[{t}]")
        if self.network is not None:
            self.network.validate("quota.network")


@dataclass(frozen=True, slots=True, kw_only=True)
class QuotaPolicy:
    """How paused sandboxes are charged. Sandbox count always includes them."""

    paused_counts_cpu: bool = False      # frozen: uses no CPU
    paused_counts_memory: bool = True    # keep room so a resume cannot be refused


@dataclass(frozen=True, slots=True)
class Usage:
    """A copy of one tree node's usage (subtree totals)."""

    sandboxes: int = 0
    cpu_milli: int = 0
    memory_bytes: int = 0
    backends: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    snapshot_bytes: int = 0


@dataclass(slots=True)
class ResumeHold:
    """CPU/memory charged for a resume in flight (:meth:`QuotaIndex.hold_resume`)."""

    sandbox_id: str
    project: str
    backend: str
    cpu_milli: int
    memory_bytes: int
    released: bool = False


class _Node:
    """Usage of one project-tree node. ``b`` maps backend -> [count, cpu, memory]."""

    __slots__ = ("b", "cpu", "mem", "n", "path", "quota", "snap")

    def __init__(self, path: str) -> None:
        self.path = path
        self.n = 0
        self.cpu = 0
        self.mem = 0
        self.snap = 0
        self.b: dict[str, list[int]] = {}
        self.quota: Quota | None = None


class QuotaIndex:
    """Quotas plus the live usage index. Pure logic: the caller feeds it changes."""

    def __init__(self, policy: QuotaPolicy | None = None) -> None:
        self.policy = policy or QuotaPolicy()
        self._nodes: dict[str, _Node] = {}
        self._chains: dict[str, tuple[_Node, ...]] = {}
        self._live: dict[str, SandboxRecord] = {}
        self._by_node: dict[str, set[str]] = {}
        self._snaps: dict[str, tuple[str, int]] = {}    # snapshot id -> (project, bytes)

    # --- tree -------------------------------------------------------------------------
    def _chain(self, project: str) -> tuple[_Node, ...]:
        chain = self._chains.get(project)
        if chain is None:
            path = parse_project_path(project)
            nodes = []
            for p in project_ancestors(ProjectPath(path)):
                n = self._nodes.get(p)
                if n is None:
                    n = self._nodes[p] = _Node(p)
                nodes.append(n)
            chain = self._chains[project] = tuple(nodes)
        return chain

    def set_quota(self, project: str, quota: Quota | None) -> None:
        """Put (or with ``None`` remove) the quota at ``project``. Existing usage above a
        new, lower quota is kept; only new admissions are refused."""
        if quota is not None:
            quota.validate(f"quota of {project!r}")
        self._chain(project)[-1].quota = quota

    def quota(self, project: str) -> Quota | None:
        return self._chain(project)[-1].quota

    def quotas(self) -> dict[str, Quota]:
        return {p: n.quota for p, n in self._nodes.items() if n.quota is not None}

    def registry_pull(self, project: str) -> tuple[bool, str | None]:
        """Whether a create in ``project`` may pull a registry image on first use, and
        the project whose quota said so (nearest first; None: nobody did, default yes)."""
        for n in reversed(self._chain(project)):
            if n.quota is not None and n.quota.registry_pull is not None:
                return n.quota.registry_pull, n.path
        return True, None

    def qos_ls(self, project: str) -> tuple[bool, str | None]:
        """Whether sandboxes of ``project`` may be latency-sensitive, and the project whose
        quota said so (nearest first; None: nobody did, default yes)."""
        for n in reversed(self._chain(project)):
            if n.quota is not None and n.quota.qos_ls is not None:
                return n.quota.qos_ls, n.path
        return True, None

    def network_ceilings(self, project: str) -> list[tuple[str, NetworkPolicy]]:
        """The network ceilings that bind ``project``: its own and every ancestor's,
        root first, as ``(project, ceiling)`` (O(depth), the cached chain)."""
        return [(n.path, n.quota.network) for n in self._chain(project)
                if n.quota is not None and n.quota.network is not None]

    # --- usage updates ------------------------------------------------------------------
    def _charge(self, rec: SandboxRecord, paused: bool) -> tuple[int, int]:
        p = self.policy
        cpu = rec.cpu_milli if (not paused or p.paused_counts_cpu) else 0
        mem = rec.memory_bytes if (not paused or p.paused_counts_memory) else 0
        return cpu, mem

    def _apply(self, rec: SandboxRecord, paused: bool, sign: int, count: int) -> None:
        cpu, mem = self._charge(rec, paused)
        cpu *= sign
        mem *= sign
        n = count * sign
        backend = rec.backend
        for node in self._chain(rec.project):
            node.n += n
            node.cpu += cpu
            node.mem += mem
            u = node.b.get(backend)
            if u is None:
                u = node.b[backend] = [0, 0, 0]
            u[0] += n
            u[1] += cpu
            u[2] += mem

    def insert(self, rec: SandboxRecord) -> None:
        """Count a new live sandbox (already admitted; this does not check)."""
        if rec.id in self._live:
            raise InvalidArgument(f"sandbox {rec.id} is already counted in the quota index")
        self._apply(rec, rec.paused, +1, 1)
        self._live[rec.id] = rec
        self._by_node.setdefault(rec.node, set()).add(rec.id)

    def remove(self, sandbox_id: str) -> SandboxRecord:
        rec = self._live.pop(sandbox_id, None)
        if rec is None:
            raise SandboxNotFound(f"sandbox {sandbox_id} is not in the quota index",
                                  sandbox_id=sandbox_id)
        self._apply(rec, rec.paused, -1, 1)
        ids = self._by_node.get(rec.node)
        if ids is not None:
            ids.discard(sandbox_id)
            if not ids:
                del self._by_node[rec.node]
        return rec

    def set_paused(self, sandbox_id: str, paused: bool) -> None:
        rec = self._live.get(sandbox_id)
        if rec is None:
            raise SandboxNotFound(f"sandbox {sandbox_id} is not in the quota index",
                                  sandbox_id=sandbox_id)
        if rec.paused == paused:
            return
        self._apply(rec, rec.paused, -1, 0)
        rec = msgspec.structs.replace(rec, paused=paused)
        self._apply(rec, paused, +1, 0)
        self._live[sandbox_id] = rec

    def node_lost(self, node: str) -> list[SandboxRecord]:
        """Uncount every sandbox on ``node``; returns them (e.g. for eviction events)."""
        ids = sorted(self._by_node.get(node, ()))
        return [self.remove(i) for i in ids]

    # --- snapshot storage -----------------------------------------------------------------
    def add_snapshot(self, snapshot_id: str, project: str, size_bytes: int) -> bool:
        """Charge a recorded snapshot to ``project`` and its ancestors (already checked;
        this does not check). False if it was charged already (an unchanged snapshot)."""
        if snapshot_id in self._snaps:
            return False
        if size_bytes < 0:
            raise InvalidArgument(f"snapshot {snapshot_id} size {size_bytes} is negative")
        for node in self._chain(project):
            node.snap += size_bytes
        self._snaps[snapshot_id] = (project, size_bytes)
        return True

    def remove_snapshot(self, snapshot_id: str) -> int:
        """Release a deleted snapshot's charge; returns the bytes freed (0 if unknown)."""
        hit = self._snaps.pop(snapshot_id, None)
        if hit is None:
            return 0
        project, size = hit
        for node in self._chain(project):
            node.snap -= size
        return size

    def snapshot_charge(self, snapshot_id: str) -> tuple[str, int] | None:
        return self._snaps.get(snapshot_id)

    def replace_snapshots(self, charges: Iterable[tuple[str, str, int]]) -> None:
        """Make the snapshot charges exactly ``(id, project, bytes)`` (the store's rows:
        other apiserver replicas charge and release snapshots too)."""
        for sid in list(self._snaps):
            self.remove_snapshot(sid)
        for sid, project, size in charges:
            self.add_snapshot(sid, project, size)

    def snapshot_limits(self, project: str) -> list[tuple[str, int]]:
        """``(ancestor, snapshot_bytes)`` for every node of ``project``'s chain that limits
        snapshot storage (pure; what :meth:`StateStore.charge_snapshot` checks)."""
        return [(node.path, node.quota.snapshot_bytes) for node in self._chain(project)
                if node.quota is not None and node.quota.snapshot_bytes is not None]

    def image_limits(self, project: str) -> list[tuple[str, int]]:
        """``(ancestor, image_bytes)`` for every node of ``project``'s chain that limits
        the bytes its image names reach (pure)."""
        return [(node.path, node.quota.image_bytes) for node in self._chain(project)
                if node.quota is not None and node.quota.image_bytes is not None]

    def snapshot_room(self, project: str) -> int | None:
        """Bytes a new snapshot in ``project`` may take: the least room left under a
        ``snapshot_bytes`` quota on the project and its ancestors (0 when one is used
        up); None when no node of the chain limits snapshot storage."""
        room: int | None = None
        for node in self._chain(project):
            q = node.quota
            if q is None or q.snapshot_bytes is None:
                continue
            left = max(0, q.snapshot_bytes - node.snap)
            room = left if room is None else min(room, left)
        return room

    def check_snapshot(self, project: str, size_bytes: int) -> None:
        """Raise :class:`QuotaExceeded` unless ``size_bytes`` more snapshot storage fits
        ``project`` and every ancestor."""
        for node in self._chain(project):
            q = node.quota
            if q is not None and q.snapshot_bytes is not None \
                    and node.snap + size_bytes > q.snapshot_bytes:
                self._exceeded(node, project, "snapshot_bytes", node.snap, q.snapshot_bytes,
                               size_bytes, None)

    # --- queries ------------------------------------------------------------------------
    def check(self, project: str, *, backend: str, cpu_milli: int, memory_bytes: int,
              count: int = 1) -> None:
        """Raise :class:`QuotaExceeded` unless adding ``count`` sandboxes using
        ``cpu_milli``/``memory_bytes`` in total fits ``project`` and every ancestor.
        ``count=0`` checks a resume (resources come back, the sandbox already counts)."""
        for node in self._chain(project):
            q = node.quota
            if q is None:
                continue
            if q.max_sandboxes is not None and node.n + count > q.max_sandboxes:
                self._exceeded(node, project, "sandboxes", node.n, q.max_sandboxes, count, None)
            if q.cpu_milli is not None and node.cpu + cpu_milli > q.cpu_milli:
                self._exceeded(node, project, "cpu_milli", node.cpu, q.cpu_milli, cpu_milli,
                               None)
            if q.memory_bytes is not None and node.mem + memory_bytes > q.memory_bytes:
                self._exceeded(node, project, "memory_bytes", node.mem, q.memory_bytes,
                               memory_bytes, None)
            if q.tiers:
                self._check_tier(node, project, q, backend, cpu_milli, memory_bytes, count)
            if q.backends:
                lim = q.backends.get(backend)
                if lim is not None:
                    u = node.b.get(backend) or (0, 0, 0)
                    if lim.max_sandboxes is not None and u[0] + count > lim.max_sandboxes:
                        self._exceeded(node, project, "sandboxes", u[0], lim.max_sandboxes,
                                       count, backend)
                    if lim.cpu_milli is not None and u[1] + cpu_milli > lim.cpu_milli:
                        self._exceeded(node, project, "cpu_milli", u[1], lim.cpu_milli,
                                       cpu_milli, backend)
                    if lim.memory_bytes is not None and u[2] + memory_bytes > lim.memory_bytes:
                        self._exceeded(node, project, "memory_bytes", u[2], lim.memory_bytes,
                                       memory_bytes, backend)

    def _check_tier(self, node: _Node, project: str, q: Quota, backend: str, cpu_milli: int,
                    memory_bytes: int, count: int) -> None:
        """The limits of the isolation tier ``backend`` is counted in (Quota.tiers;
        :func:`dsec.wire.spec.quota_tier`: its own tier, the container tier for fncall,
        which gives none): its usage is the sum over the backends counted in that tier
        (a handful), computed only where a tier quota is set."""
        tier = quota_tier(backend)
        lim = q.tiers.get(tier)
        if lim is None:
            return
        used = [0, 0, 0]
        for b, u in node.b.items():
            if quota_tier(b) == tier:
                used = [used[0] + u[0], used[1] + u[1], used[2] + u[2]]
        what = f"isolation {tier}"
        if lim.max_sandboxes is not None and used[0] + count > lim.max_sandboxes:
            if lim.max_sandboxes == 0:
                counted = ("" if backend in BACKEND_ISOLATION else f", in which backend {backend[:40]!r} counts "
                    "(it gives no tier of its own and runs on the host kernel)")
                raise QuotaExceeded(
                    f"project {node.path!r} does not allow isolation tier {tier!r} (its quota "
                    f"gives the tier 0 sandboxes{counted}); use another tier or ask an "
                    "admin of its parent project to allow it", project=node.path, requested_in=project,
                    resource="sandboxes", backend=what, used=used[0], limit=0,
                    requested=count)
            self._exceeded(node, project, "sandboxes", used[0], lim.max_sandboxes, count, what)
        if lim.cpu_milli is not None and used[1] + cpu_milli > lim.cpu_milli:
            self._exceeded(node, project, "cpu_milli", used[1], lim.cpu_milli, cpu_milli, what)
        if lim.memory_bytes is not None and used[2] + memory_bytes > lim.memory_bytes:
            self._exceeded(node, project, "memory_bytes", used[2], lim.memory_bytes,
                           memory_bytes, what)

    def check_record(self, rec: SandboxRecord) -> None:
        """:meth:`check` for the charge ``rec`` would add if inserted."""
        cpu, mem = self._charge(rec, rec.paused)
        self.check(rec.project, backend=rec.backend, cpu_milli=cpu, memory_bytes=mem)

    def check_resume(self, sandbox_id: str) -> None:
        """Would resuming this paused sandbox fit? (Its paused charge is already counted.)"""
        rec = self._live.get(sandbox_id)
        if rec is None:
            raise SandboxNotFound(f"sandbox {sandbox_id} is not in the quota index",
                                  sandbox_id=sandbox_id)
        if not rec.paused:
            return
        pc, pm = self._charge(rec, True)
        rc, rm = self._charge(rec, False)
        self.check(rec.project, backend=rec.backend, cpu_milli=rc - pc, memory_bytes=rm - pm,
                   count=0)

    def hold_resume(self, sandbox_id: str) -> ResumeHold | None:
        """Check that resuming paused ``sandbox_id`` fits its project's quota chain and
        charge the difference (what a running sandbox holds that a paused one does not)
        at once, in the same step, so a concurrent create or resume sees it (red team 19,
        B3: a resume was never checked, so pause, create, resume ran a project past its
        CPU quota). Returns the hold, to :meth:`release_hold` when the resume failed or
        when :meth:`set_paused` (False) takes it over; None when nothing is to hold (not
        paused here, or unknown to this index: the edge is the judge of existence)."""
        rec = self._live.get(sandbox_id)
        if rec is None or not rec.paused:
            return None
        pc, pm = self._charge(rec, True)
        rc, rm = self._charge(rec, False)
        cpu, mem = rc - pc, rm - pm
        self.check(rec.project, backend=rec.backend, cpu_milli=cpu, memory_bytes=mem,
                   count=0)
        hold = ResumeHold(sandbox_id, rec.project, rec.backend, cpu, mem)
        self._apply_delta(hold, +1)
        return hold

    def release_hold(self, hold: ResumeHold) -> None:
        """Give back a :meth:`hold_resume` charge (the resume failed, or it is now
        counted as running by :meth:`set_paused`). Idempotent per hold."""
        if hold.released:
            return
        hold.released = True
        self._apply_delta(hold, -1)

    def _apply_delta(self, hold: ResumeHold, sign: int) -> None:
        cpu, mem = hold.cpu_milli * sign, hold.memory_bytes * sign
        for node in self._chain(hold.project):
            node.cpu += cpu
            node.mem += mem
            u = node.b.get(hold.backend)
            if u is None:
                u = node.b[hold.backend] = [0, 0, 0]
            u[1] += cpu
            u[2] += mem

    @staticmethod
    def _exceeded(node: _Node, project: str, resource: str, used: int, limit: int,
                  requested: int, backend: str | None) -> None:
        what = (resource if backend is None else f"{resource} for {backend}"
                if backend.startswith("isolation ") else f"{resource} for backend {backend!r}")
        where = (f"project {node.path!r}" if node.path == project
                 else f"project {node.path!r} (an ancestor of {project!r})")
        raise QuotaExceeded(
            f"quota of {where} exceeded on {what}: used {used} + requested {requested} > "
            f"limit {limit}; free resources in {node.path!r} or raise its quota",
            project=node.path, requested_in=project, resource=resource, backend=backend,
            used=used, limit=limit, requested=requested)

    def usage(self, project: str) -> Usage:
        """Subtree usage of ``project`` (a copy)."""
        n = self._nodes.get(project)
        if n is None:
            parse_project_path(project)
            return Usage()
        return Usage(n.n, n.cpu, n.mem, {b: (u[0], u[1], u[2]) for b, u in n.b.items()
                                         if u[0] or u[1] or u[2]}, n.snap)

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        return self._live.get(sandbox_id)

    def __len__(self) -> int:
        return len(self._live)
