"""k-choice placement: filter, sample k with Floyd's algorithm, score, jitter, overlay.

Each decision costs O(k), independent of the node count:

* **Candidate pools are maintained on snapshot updates**, not built per decision. Healthy
  nodes live in pools keyed by ``(cloud?, tag)``: tag ``None`` holds every healthy node of
  that kind, ``"label:k=v"`` those carrying a label, ``"layer:<digest>"`` those with an
  image layer mounted. A request samples from the smallest pool that matches one of its
  hard constraints and checks the rest by rejection.
* **Floyd's algorithm** picks k distinct indices from a pool without materialising or
  shuffling it. Each draw ``x = u * (j + 1)`` gives the index ``int(x)`` and, from its
  fractional part, the tie-breaking jitter: sampling and jitter come from one injected
  ``random.Random`` in one step.
* **Capacity is checked by rejection.** If a round of k yields no feasible node, another
  round is drawn (``max_rounds``); only then does placement scan the pool, which happens
  when almost every node is full (O(n) there is the honest price of finding the last
  free slot).
* **Overlay**: every decision is added to the chosen node's usage at once (pending), so
  back-to-back decisions see their own load. :meth:`Placement.confirm` (the edge said
  yes) keeps the charge until the node's next snapshot, which then includes it;
  :meth:`Placement.forget` (the edge said no) takes it back. A snapshot update sets
  usage to ``snapshot + still-pending decisions``.
* **Cloud bursting**: cloud nodes are sampled only if the request allows it and on-prem
  utilisation (max of CPU and memory, overlay included) is above ``burst_threshold``;
  they pay ``cloud_penalty`` plus their ``cost`` in the score.

Score (higher is better), with ``fc``/``fm`` the node's CPU/memory fraction in use
*after* placing the request::

    packing * (fc + fm) / 2            prefer fuller nodes: keeps whole nodes free
  - fragmentation * |fc - fm|          avoid stranding CPU without memory or vice versa
  + locality * (layers present / layers wanted)
  - spread * (same-group sandboxes on node / (sandboxes on node + 1))
  - cost * node.cost - cloud_penalty [cloud]
  ± qos * (fc + fm) / 2                 + for best-effort (packs), - for LS (spreads)
  + jitter * u,  u uniform in [0, 1)   (seeded; breaks ties between equal nodes)
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import msgspec

from dsec.errors import InvalidArgument, NoCapacity

__all__ = [
    "Decision",
    "Placement",
    "PlacementAttempt",
    "PlacementConfig",
    "PlacementNode",
    "PlacementRequest",
    "ScoreWeights",
    "qos_term",
]


def qos_term(qos: str, fc: float, fm: float, weight: float) -> float:
    """The QoS class's part of a node's score (pure; ``fc``/``fm``: the node's CPU and
    memory fractions in use after placing). Best-effort work *packs*: it runs SCHED_IDLE
    at the lowest weight, so a busy node's spare cycles are exactly what it should soak
    up, and it keeps quiet nodes quiet. Latency-sensitive work *spreads*: with the
    default weight (1.5 against packing's 1.0) its net pull is toward emptier nodes,
    where its steps meet the fewest competitors."""
    load = 0.5 * (fc + fm)
    return weight * load if qos == "be" else -weight * load


class PlacementNode(msgspec.Struct, frozen=True, kw_only=True):
    """What placement knows about one edge node (from the watcher's last snapshot).

    Capacities and usage are reservations: ``cpu_milli_*`` in millicores,
    ``memory_bytes_*`` in bytes, ``sandboxes`` live sandboxes, ``max_sandboxes`` the
    edge's slot limit (``None``: no limit). ``layers`` are image-layer digests mounted on
    the node; ``groups`` counts its sandboxes per spread group (e.g. project). ``cloud``
    marks burst capacity, ``cost`` its relative price (0 for owned hardware).
    """

    node: str
    cpu_milli_capacity: int
    memory_bytes_capacity: int
    cpu_milli_used: int = 0
    memory_bytes_used: int = 0
    sandboxes: int = 0
    max_sandboxes: int | None = None
    healthy: bool = True
    cloud: bool = False
    cost: float = 0.0
    zone: str = ""
    labels: dict[str, str] = {}
    layers: frozenset[str] = frozenset()
    groups: dict[str, int] = {}


class PlacementRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One sandbox to place.

    ``layers``: digests of the image's layers (scored for locality; with
    ``require_layers`` only nodes holding all of them qualify). ``selector``: labels a node
    must carry exactly. ``allow_burst``: cloud nodes may be used. ``group``: spread key
    (e.g. the project); sandboxes of one group are spread over nodes.
    """

    cpu_milli: int
    memory_bytes: int
    layers: tuple[str, ...] = ()
    require_layers: bool = False
    selector: dict[str, str] = {}
    allow_burst: bool = False
    group: str = ""
    # QoS class (issue 22): "be" packs onto busy nodes, "ls" spreads (see qos_term);
    # None: no QoS term (callers that predate classes)
    qos: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ScoreWeights:
    """Weights of the score terms (see the module docstring). Unitless."""

    packing: float = 1.0
    fragmentation: float = 0.5
    locality: float = 0.5
    spread: float = 0.3
    cost: float = 0.5
    qos: float = 1.5


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementConfig:
    """Tuning. ``k``: candidates per decision (4 gives most of exhaustive search's
    benefit, see docs/control.md). ``jitter``: amplitude of the seeded tie-breaking noise,
    in score units (0 disables it: ties then go to the first candidate sampled - only for
    tests). ``burst_threshold``: on-prem utilisation above which bursting requests may use
    cloud nodes. ``cloud_penalty``: score subtracted from every cloud node.
    ``max_rounds``: sampling rounds before the scan fallback. ``max_attempts``: edge
    refusals tolerated per request by :class:`PlacementAttempt`. ``affinity_k``: how many
    of the k candidates are drawn from nodes that hold the request's rarest image layer
    (at most k - 1; 0 disables locality draws). ``memory``: also evaluate the node chosen
    last time for the same image (one of the k). ``fit_share``: the share of the k drawn
    from the tightest free-CPU band that can hold the request (best-fit draws; at least
    one when > 0, and always at least one uniform draw)."""

    k: int = 4
    jitter: float = 1e-3
    burst_threshold: float = 0.8
    cloud_penalty: float = 0.5
    max_rounds: int = 3
    max_attempts: int = 3
    affinity_k: int = 2
    fit_share: float = 0.5
    memory: bool = True
    weights: ScoreWeights = field(default_factory=ScoreWeights)

    def __post_init__(self) -> None:
        if self.k < 1:
            raise InvalidArgument(f"placement k={self.k} must be >= 1")
        if self.jitter < 0:
            raise InvalidArgument(f"placement jitter={self.jitter} must be >= 0")
        if not 0.0 <= self.burst_threshold <= 1.0:
            raise InvalidArgument(
                f"placement burst_threshold={self.burst_threshold} must be within 0..1")
        if self.affinity_k < 0 or not 0.0 <= self.fit_share <= 1.0:
            raise InvalidArgument(f"placement affinity_k={self.affinity_k} must be >= 0 "
                                  f"and fit_share={self.fit_share} within 0..1")
        if self.max_rounds < 1 or self.max_attempts < 1:
            raise InvalidArgument("placement max_rounds and max_attempts must be >= 1")


class _Slot:
    """Mutable per-node state: snapshot values plus the overlay of pending decisions."""

    __slots__ = (
        "alive",
        "band",
        "cap_cpu",
        "cap_mem",
        "cloud",
        "groups",
        "inv_cpu",
        "inv_mem",
        "labels",
        "layers",
        "max_n",
        "n",
        "node",
        "pen",
        "pending",
        "tags",
        "used_cpu",
        "used_mem",
        "view",
    )

    def __init__(self, view: PlacementNode) -> None:
        self.pending: set[Decision] = set()
        self.alive = True
        self.tags: tuple[str | None, ...] = ()
        self.view = view
        self.band = -1                       # free-CPU band (see Placement._reband)

    def load(self, v: PlacementNode, pen: float) -> None:
        self.view = v
        self.node = v.node
        self.cap_cpu = v.cpu_milli_capacity
        self.cap_mem = v.memory_bytes_capacity
        self.inv_cpu = 1.0 / v.cpu_milli_capacity if v.cpu_milli_capacity > 0 else 0.0
        self.inv_mem = 1.0 / v.memory_bytes_capacity if v.memory_bytes_capacity > 0 else 0.0
        self.max_n = v.max_sandboxes if v.max_sandboxes is not None else 1 << 62
        self.cloud = v.cloud
        self.pen = pen
        self.labels = v.labels
        self.layers = v.layers
        self.used_cpu = v.cpu_milli_used
        self.used_mem = v.memory_bytes_used
        self.n = v.sandboxes
        groups = dict(v.groups)
        for d in self.pending:
            self.used_cpu += d.cpu_milli
            self.used_mem += d.memory_bytes
            self.n += 1
            if d.group:
                groups[d.group] = groups.get(d.group, 0) + 1
        self.groups = groups


class Decision:
    """A placement answer: send the create to ``node``, then confirm or forget it."""

    __slots__ = ("_slot", "cpu_milli", "group", "memory_bytes", "node")

    def __init__(self, slot: _Slot, cpu: int, mem: int, group: str) -> None:
        self.node: str = slot.node
        self.cpu_milli = cpu
        self.memory_bytes = mem
        self.group = group
        self._slot = slot

    def __repr__(self) -> str:
        return (f"Decision(node={self.node!r}, cpu_milli={self.cpu_milli}, "
                f"memory_bytes={self.memory_bytes})")


class _Pool:
    """An indexable set of slots: O(1) add, remove (swap with last) and random access."""

    __slots__ = ("items", "pos")

    def __init__(self) -> None:
        self.items: list[_Slot] = []
        self.pos: dict[str, int] = {}

    def add(self, s: _Slot) -> None:
        if s.node not in self.pos:
            self.pos[s.node] = len(self.items)
            self.items.append(s)

    def discard(self, node: str) -> None:
        i = self.pos.pop(node, None)
        if i is None:
            return
        last = self.items.pop()
        if last.node != node:
            self.items[i] = last
            self.pos[last.node] = i


_EMPTY = _Pool()
_NO_SLOTS: list[_Slot] = []


class Placement:
    """One placement instance: a view of the nodes plus its own in-flight decisions.

    Feed it snapshots with :meth:`update` / :meth:`remove` (or :meth:`apply_snapshot`),
    ask with :meth:`place` (or :meth:`begin` for edge-refusal retries), answer with
    :meth:`confirm` / :meth:`forget`. ``rng`` is the single source of randomness.
    """

    def __init__(self, *, rng: random.Random, config: PlacementConfig | None = None) -> None:
        self.config = config or PlacementConfig()
        self._rng = rng
        cfg = self.config
        self._fit_k = max(1, round(cfg.k * cfg.fit_share)) if cfg.fit_share else 0
        self._slots: dict[str, _Slot] = {}
        self._pools: dict[tuple[bool, str | None], _Pool] = {}
        self._memo: dict[str, _Slot] = {}     # rarest layer ("" if none) -> last choice
        # digest -> (on-prem pool, cloud pool): the "layer:<digest>" pools of _pools,
        # found without building the key string per decision
        self._layer_pools: dict[str, tuple[_Pool, _Pool]] = {}
        self._bands: dict[bool, list[_Pool]] = {c: [_Pool() for _ in range(64)]
                                                for c in (False, True)}
        # on-prem totals over healthy nodes (overlay included), for the burst decision
        self._op_cap_cpu = 0
        self._op_cap_mem = 0
        self._op_used_cpu = 0
        self._op_used_mem = 0

    # --- snapshot maintenance ------------------------------------------------------------
    def _pool(self, key: tuple[bool, str | None]) -> _Pool:
        p = self._pools.get(key)
        if p is None:
            p = self._pools[key] = _Pool()
        return p

    def _reband(self, s: _Slot) -> None:
        """Keep ``s`` in the pool of its free-CPU band: band b holds nodes with
        2^(b-1) <= free millicores < 2^b (b = free.bit_length()), healthy only."""
        free = s.cap_cpu - s.used_cpu
        b = free.bit_length() if (s.alive and s.tags and free > 0) else -1
        if b != s.band:
            bands = self._bands[s.cloud]
            if s.band >= 0:
                bands[s.band].discard(s.node)
            if b >= 0:
                bands[b].add(s)
            s.band = b

    def _unband(self, s: _Slot) -> None:
        if s.band >= 0:
            self._bands[s.cloud][s.band].discard(s.node)
            s.band = -1

    def _totals(self, s: _Slot, sign: int) -> None:
        if s.alive and not s.cloud:
            self._op_cap_cpu += sign * s.cap_cpu
            self._op_cap_mem += sign * s.cap_mem
            self._op_used_cpu += sign * s.used_cpu
            self._op_used_mem += sign * s.used_mem

    def update(self, view: PlacementNode) -> None:
        """Replace what is known about one node (O(labels + layers) of that node)."""
        if view.cpu_milli_capacity < 0 or view.memory_bytes_capacity < 0:
            raise InvalidArgument(f"node {view.node!r} reports a negative capacity")
        pen = self.config.weights.cost * view.cost + (
            self.config.cloud_penalty if view.cloud else 0.0)
        s = self._slots.get(view.node)
        old_tags: tuple[str | None, ...] = ()
        if s is None:
            s = self._slots[view.node] = _Slot(view)
            old_cloud = view.cloud
        else:
            self._totals(s, -1)
            self._unband(s)
            old_cloud, old_tags = s.cloud, s.tags
        s.alive = view.healthy
        s.load(view, pen)
        self._totals(s, +1)
        tags: tuple[str | None, ...] = ()
        if view.healthy:
            tags = (None, *(f"label:{k}={v}" for k, v in view.labels.items()),
                    *(f"layer:{d}" for d in view.layers))
        if old_tags != tags or old_cloud != view.cloud:
            keep = set(tags) if old_cloud == view.cloud else set()
            for t in old_tags:
                if t not in keep:
                    self._pools[(old_cloud, t)].discard(view.node)
            for t in tags:
                self._pool((view.cloud, t)).add(s)
            for d in view.layers:
                if d not in self._layer_pools:
                    self._layer_pools[d] = (self._pool((False, f"layer:{d}")),
                                            self._pool((True, f"layer:{d}")))
            s.tags = tags
        self._reband(s)

    def remove(self, node: str) -> None:
        """Forget a node (expired or drained). Its pending decisions are dropped."""
        s = self._slots.pop(node, None)
        if s is None:
            return
        self._totals(s, -1)
        self._unband(s)
        for t in s.tags:
            self._pools[(s.cloud, t)].discard(node)
        s.alive = False
        s.pending.clear()

    def apply_snapshot(self, views: Iterable[PlacementNode]) -> None:
        """Make the node set exactly ``views`` (a full resync from the watcher)."""
        seen = set()
        for v in views:
            seen.add(v.node)
            self.update(v)
        for node in [n for n in self._slots if n not in seen]:
            self.remove(node)

    # --- decisions -----------------------------------------------------------------------
    def onprem_utilisation(self) -> float:
        """max(CPU, memory) fraction in use on healthy on-prem nodes, overlay included."""
        c = self._op_used_cpu / self._op_cap_cpu if self._op_cap_cpu else 1.0
        m = self._op_used_mem / self._op_cap_mem if self._op_cap_mem else 1.0
        return max(m, c)

    def _candidate_pools(self, req: PlacementRequest) -> tuple[_Pool, _Pool, bool]:
        cloud = req.allow_burst and self.onprem_utilisation() > self.config.burst_threshold
        pools = self._pools
        if not req.selector and not (req.require_layers and req.layers):
            return pools.get((False, None), _EMPTY), (
                pools.get((True, None), _EMPTY) if cloud else _EMPTY), cloud
        tags = [f"label:{k}={v}" for k, v in req.selector.items()]
        if req.require_layers:
            tags += [f"layer:{d}" for d in req.layers]
        # Sample from the smallest constrained pool; the others are checked by rejection.
        best = (_EMPTY, _EMPTY)
        size = -1
        for t in tags:
            a = pools.get((False, t), _EMPTY)
            b = pools.get((True, t), _EMPTY) if cloud else _EMPTY
            if size < 0 or len(a.items) + len(b.items) < size:
                best, size = (a, b), len(a.items) + len(b.items)
        return best[0], best[1], cloud

    def _rarest_layer_pool(self, layers: tuple[str, ...],
                           cloud: bool) -> tuple[str, list[_Slot]]:
        """The request's rarest layer held by some healthy node, and those nodes
        (on-prem only unless bursting is active)."""
        best: list[_Slot] = _NO_SLOTS
        digest = ""
        lp = self._layer_pools
        for d in layers:
            pp = lp.get(d)
            if pp is None:
                continue
            items = pp[0].items
            if cloud and not items:
                items = pp[1].items
            if items and (not best or len(items) < len(best)):
                best = items
                digest = d
        return digest, best

    def place(self, req: PlacementRequest, *, exclude: Collection[str] = ()) -> Decision:
        """Choose a node for ``req`` and add it to that node's overlay.

        Raises :class:`NoCapacity` when no healthy node can take it. ``exclude`` names
        nodes that already refused this request.
        """
        cpu = req.cpu_milli
        mem = req.memory_bytes
        if cpu < 0 or mem < 0:
            raise InvalidArgument(f"placement request asks for negative resources: {req}")
        pa, pb, cloud = self._candidate_pools(req)
        A = pa.items
        B = pb.items
        na = len(A)
        n = na + len(B)
        cfg = self.config
        k = min(n, cfg.k)
        # The k candidates: a share from the tightest free-CPU band (best fit), the
        # node chosen last time for this image (memory), some from the nodes holding
        # the image's rarest layer (locality), the rest uniformly from the pool. Each is
        # O(1) to find because the bands and layer pools are kept up to date on every
        # snapshot and decision. Measured effect at k=4: docs/control.md.
        phases = []
        kk = k
        memo_key = ""
        L = _NO_SLOTS
        if k < n and req.layers and not req.require_layers:
            memo_key, L = self._rarest_layer_pool(req.layers, cloud)
        if k < n and self._fit_k and kk > 1:
            bands = self._bands[False]
            for b in range(cpu.bit_length(), len(bands)):
                F = bands[b].items
                if F:
                    kf = min(self._fit_k, kk - 1, len(F))
                    phases.append((F, _NO_SLOTS, len(F), len(F), kf))
                    kk -= kf
                    break
        if k < n and cfg.memory and kk > 1:
            m = self._memo.get(memo_key)
            if m is not None and m.alive and m.tags and (cloud or not m.cloud):
                phases.append(([m], _NO_SLOTS, 1, 1, 1))
                kk -= 1
        if L and cfg.affinity_k and kk > 1:
            ka = min(cfg.affinity_k, kk - 1, len(L))
            phases.append((L, _NO_SLOTS, len(L), len(L), ka))
            kk -= ka
        phases.append((A, B, na, n, kk))
        rnd = self._rng.random
        w = cfg.weights
        wp = w.packing * 0.5
        wf = w.fragmentation
        jit = cfg.jitter
        layers = req.layers
        nl = len(layers)
        wl = w.locality / nl if nl else 0.0
        need_all = req.require_layers
        sel = tuple(req.selector.items()) if req.selector else ()
        group = req.group
        ws = w.spread
        best = None
        bscore = -1e300
        # The hot loop is inline on purpose: a method call per candidate cost ~40% of
        # the decision time at k=4 (bench suite "control", placement_throughput).
        for _ in range(cfg.max_rounds if n else 0):
            for PA, PB, pna, pn, pk in phases:
                chosen: list[int] = []
                for j in range(pn - pk, pn):
                    x = rnd() * (j + 1)
                    t = int(x)
                    if t in chosen:
                        t = j
                    chosen.append(t)
                    s = PA[t] if t < pna else PB[t - pna]
                    uc = s.used_cpu + cpu
                    if uc > s.cap_cpu:
                        continue
                    um = s.used_mem + mem
                    if um > s.cap_mem or s.n >= s.max_n:
                        continue
                    if exclude and s.node in exclude:
                        continue
                    fc = uc * s.inv_cpu
                    fm = um * s.inv_mem
                    d = fc - fm
                    score = wp * (fc + fm) - wf * (d if d > 0 else -d) - s.pen + jit * (x - int(x))
                    if nl:
                        sl = s.layers
                        hits = 0
                        for lay in layers:
                            if lay in sl:
                                hits += 1
                        if need_all and hits < nl:
                            continue
                        score += wl * hits
                    if sel:
                        lab = s.labels
                        ok = True
                        for key, val in sel:
                            if lab.get(key) != val:
                                ok = False
                                break
                        if not ok:
                            continue
                    if group:
                        score -= ws * s.groups.get(group, 0) / (s.n + 1)
                    if score > bscore:
                        bscore = score
                        best = s
            if best is not None or k == n:
                break
        if best is None and n > k:
            best = self._scan(req, A, B, exclude)
        if best is None:
            raise self._no_capacity(req, n, exclude)
        if cfg.memory:
            memo = self._memo
            if len(memo) >= 4096 and memo_key not in memo:
                memo.clear()            # bounded: one entry per recently used image
            memo[memo_key] = best
        return self._commit(best, cpu, mem, group)

    def _commit(self, s: _Slot, cpu: int, mem: int, group: str) -> Decision:
        dec = Decision(s, cpu, mem, group)
        s.pending.add(dec)
        s.used_cpu += cpu
        s.used_mem += mem
        s.n += 1
        if group:
            s.groups[group] = s.groups.get(group, 0) + 1
        if not s.cloud:
            self._op_used_cpu += cpu
            self._op_used_mem += mem
        if (s.cap_cpu - s.used_cpu).bit_length() != s.band:
            self._reband(s)
        return dec

    def score(self, node: str, req: PlacementRequest) -> float | None:
        """The score ``req`` would get on ``node`` without jitter (None: infeasible)."""
        s = self._slots.get(node)
        return None if s is None or not s.alive else self._score(s, req)

    def _score(self, s: _Slot, req: PlacementRequest) -> float | None:
        uc = s.used_cpu + req.cpu_milli
        um = s.used_mem + req.memory_bytes
        if uc > s.cap_cpu or um > s.cap_mem or s.n >= s.max_n:
            return None
        for key, val in req.selector.items():
            if s.labels.get(key) != val:
                return None
        w = self.config.weights
        fc = uc * s.inv_cpu
        fm = um * s.inv_mem
        score = w.packing * 0.5 * (fc + fm) - w.fragmentation * abs(fc - fm) - s.pen
        if req.layers:
            hits = sum(1 for lay in req.layers if lay in s.layers)
            if req.require_layers and hits < len(req.layers):
                return None
            score += w.locality / len(req.layers) * hits
        if req.group:
            score -= w.spread * s.groups.get(req.group, 0) / (s.n + 1)
        if req.qos is not None:
            score += qos_term(req.qos, fc, fm, w.qos)
        return score

    def _scan(self, req: PlacementRequest, A: list[_Slot], B: list[_Slot],
              exclude: Collection[str]) -> _Slot | None:
        """Fallback when sampling found nothing: score every node of the pools."""
        rnd = self._rng.random
        jit = self.config.jitter
        best = None
        bscore = -1e300
        for s in (*A, *B):
            if exclude and s.node in exclude:
                continue
            sc = self._score(s, req)
            if sc is None:
                continue
            sc += jit * rnd()
            if sc > bscore:
                bscore = sc
                best = s
        return best

    def best(self, req: PlacementRequest) -> str | None:
        """Exhaustive best node without jitter and without committing (for measurement)."""
        pa, pb, _ = self._candidate_pools(req)
        best = None
        bscore = -1e300
        for s in (*pa.items, *pb.items):
            sc = self._score(s, req)
            if sc is not None and sc > bscore:
                bscore, best = sc, s.node
        return best

    def feasible(self, req: PlacementRequest) -> list[str]:
        """Every node that could take ``req`` now (O(n); for tests and measurement)."""
        pa, pb, _ = self._candidate_pools(req)
        return [s.node for s in (*pa.items, *pb.items) if self._score(s, req) is not None]

    def commit_to(self, node: str, req: PlacementRequest) -> Decision:
        """Charge ``req`` to ``node`` as a decision (for baselines that choose themselves)."""
        return self._commit(self._slots[node], req.cpu_milli, req.memory_bytes, req.group)

    def _no_capacity(self, req: PlacementRequest, n: int,
                     exclude: Collection[str]) -> NoCapacity:
        util = self.onprem_utilisation()
        burst = "cloud bursting allowed" if req.allow_burst else "cloud bursting not allowed"
        if req.allow_burst and util <= self.config.burst_threshold:
            burst += (f" but on-prem utilisation {util:.0%} is not above the "
                      f"{self.config.burst_threshold:.0%} burst threshold")
        return NoCapacity(
            f"no node can take cpu_milli={req.cpu_milli}, memory_bytes={req.memory_bytes}"
            f"{' with selector ' + repr(req.selector) if req.selector else ''}"
            f"{' and all layers ' + repr(req.layers) if req.require_layers else ''}: "
            f"{n} candidate nodes, {len(exclude)} refused, on-prem utilisation {util:.0%}, "
            f"{burst}; ask for less, relax the selector, allow bursting or add nodes",
            cpu_milli=req.cpu_milli, memory_bytes=req.memory_bytes, candidates=n,
            refused=sorted(exclude), onprem_utilisation=util)

    def confirm(self, dec: Decision) -> None:
        """The edge accepted: keep the charge until the node's next snapshot has it."""
        dec._slot.pending.discard(dec)

    def forget(self, dec: Decision) -> None:
        """The edge refused or the create failed: take the charge back."""
        s = dec._slot
        if dec not in s.pending:
            return
        s.pending.remove(dec)
        s.used_cpu -= dec.cpu_milli
        s.used_mem -= dec.memory_bytes
        s.n -= 1
        if dec.group:
            s.groups[dec.group] -= 1
        if not s.cloud and s.alive:
            self._op_used_cpu -= dec.cpu_milli
            self._op_used_mem -= dec.memory_bytes
        if s.alive:
            self._reband(s)

    def begin(self, req: PlacementRequest) -> PlacementAttempt:
        """Start placing ``req`` with bounded retries on edge refusal."""
        return PlacementAttempt(self, req)

    # --- introspection -------------------------------------------------------------------
    def nodes(self) -> list[str]:
        return list(self._slots)

    def usage(self, node: str) -> tuple[int, int, int]:
        """``(cpu_milli, memory_bytes, sandboxes)`` in use on ``node``, overlay included."""
        s = self._slots[node]
        return s.used_cpu, s.used_mem, s.n

    def pending(self, node: str) -> int:
        return len(self._slots[node].pending)

    def __len__(self) -> int:
        return len(self._slots)


class PlacementAttempt:
    """Placing one request across edge refusals (sans-IO).

    ``d = attempt.next()``; send the create to ``d.node``; then ``attempt.accepted(d)`` or
    ``attempt.refused(d)``. After ``max_attempts`` refusals :meth:`next` raises
    :class:`NoCapacity` naming the nodes that refused.
    """

    __slots__ = ("_placement", "attempts", "refused_nodes", "request")

    def __init__(self, placement: Placement, request: PlacementRequest) -> None:
        self._placement = placement
        self.request = request
        self.refused_nodes: list[str] = []
        self.attempts = 0

    def next(self) -> Decision:
        limit = self._placement.config.max_attempts
        if self.attempts >= limit:
            r = self.request
            raise NoCapacity(
                f"placement gave up after {self.attempts} edge refusals for cpu_milli="
                f"{r.cpu_milli}, memory_bytes={r.memory_bytes} (refused by "
                f"{', '.join(self.refused_nodes)}); the cluster is fuller than the "
                "snapshot says - retry later or ask for less",
                refused=list(self.refused_nodes), attempts=self.attempts)
        self.attempts += 1
        return self._placement.place(self.request, exclude=self.refused_nodes)

    def accepted(self, dec: Decision) -> None:
        self._placement.confirm(dec)

    def refused(self, dec: Decision) -> None:
        self._placement.forget(dec)
        self.refused_nodes.append(dec.node)
