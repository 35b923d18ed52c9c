"""Suite ``control``: placement throughput and quality, quota checks, registry events.

Workloads are defined in docs/control.md; everything here is deterministic (seeded).
"""

from __future__ import annotations

import random
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from dsec.bench import BenchContext, suite
from dsec.control.placement import Placement, PlacementConfig, PlacementNode, PlacementRequest
from dsec.control.quota import Quota, QuotaIndex
from dsec.control.records import SandboxRecord
from dsec.control.registry import Registry
from dsec.control.store.sqlite import SqliteStore

GiB = 1 << 30

# Node shapes (cpu millicores, memory bytes, share): general, large, memory-heavy.
SHAPES = [(32_000, 128 * GiB, 0.5), (64_000, 256 * GiB, 0.3), (16_000, 128 * GiB, 0.2)]
N_IMAGES = 40
IMAGE_SLOTS = 6        # images whose layers a node keeps mounted (LRU)


def _images() -> tuple[list[tuple[str, str, str]], list[float]]:
    """40 images: 3 bases, one workspace each, 5 toolkits; Zipf(1) popularity."""
    imgs = [(f"base-{i % 3}", f"ws-{i}", f"tk-{i % 5}") for i in range(N_IMAGES)]
    return imgs, [1.0 / (i + 1) for i in range(N_IMAGES)]


def _request(rng: random.Random, imgs: list[tuple[str, str, str]],
             pop: list[float]) -> PlacementRequest:
    """RL sandbox mix: 70% small (0.5-1 core, 1-2 GiB), 25% medium (2 cores, 4-8 GiB),
    5% large (8 cores, 32 GiB); image by popularity; one of 10 projects as spread group."""
    r = rng.random()
    if r < 0.70:
        cpu, mem = rng.choice((500, 1000)), rng.choice((1, 2)) * GiB
    elif r < 0.95:
        cpu, mem = 2000, rng.choice((4, 8)) * GiB
    else:
        cpu, mem = 8000, 32 * GiB
    return PlacementRequest(cpu_milli=cpu, memory_bytes=mem, layers=rng.choices(imgs, pop)[0],
                            group=f"p{rng.randrange(10)}")


class _Sim:
    """A cluster whose heartbeats arrive instantly: each event re-snapshots the node,
    so the placement overlay is always empty and every policy sees the true state."""

    def __init__(self, n: int, seed: int, cfg: PlacementConfig) -> None:
        rng = random.Random(seed)
        self.imgs, self.pop = _images()
        self.p = Placement(rng=random.Random(seed + 1), config=cfg)
        self.cap: dict[str, tuple[int, int]] = {}
        self.used: dict[str, list[int]] = {}
        self.groups: dict[str, dict[str, int]] = {}
        self.cache: dict[str, OrderedDict[tuple[str, str, str], None]] = {}
        shapes = [s[:2] for s in SHAPES]
        weights = [s[2] for s in SHAPES]
        for i in range(n):
            name = f"n{i}"
            self.cap[name] = rng.choices(shapes, weights)[0]
            self.used[name] = [0, 0, 0]
            self.groups[name] = {}
            c: OrderedDict[tuple[str, str, str], None] = OrderedDict()
            for im in rng.choices(self.imgs, self.pop, k=rng.randint(1, IMAGE_SLOTS)):
                c[im] = None
            self.cache[name] = c
            self._snap(name)

    def _snap(self, name: str) -> None:
        u = self.used[name]
        self.p.update(PlacementNode(
            node=name, cpu_milli_capacity=self.cap[name][0],
            memory_bytes_capacity=self.cap[name][1], cpu_milli_used=u[0],
            memory_bytes_used=u[1], sandboxes=u[2], groups=dict(self.groups[name]),
            layers=frozenset(d for im in self.cache[name] for d in im)))

    def add(self, name: str, req: PlacementRequest) -> None:
        u = self.used[name]
        u[0] += req.cpu_milli
        u[1] += req.memory_bytes
        u[2] += 1
        g = self.groups[name]
        g[req.group] = g.get(req.group, 0) + 1
        c = self.cache[name]
        im = req.layers
        c[im] = None                        # type: ignore[index]
        c.move_to_end(im)                   # type: ignore[arg-type]
        while len(c) > IMAGE_SLOTS:
            c.popitem(last=False)
        self._snap(name)

    def remove(self, name: str, req: PlacementRequest) -> None:
        u = self.used[name]
        u[0] -= req.cpu_milli
        u[1] -= req.memory_bytes
        u[2] -= 1
        self.groups[name][req.group] -= 1
        self._snap(name)


def kchoice_quality_run(k: int, *, n: int = 1000, steps: int = 3000, seed: int = 7,
                        utilisation: float = 0.7) -> float:
    """Score gain of k-choice over random as a % of exhaustive search's gain.

    At each arrival, on the same cluster state: the mean score over feasible nodes (the
    expected score of random placement), the best score over all nodes (exhaustive) and
    the score of the k-choice pick. Returns ``100 * sum(k - random) / sum(best - random)``.
    The state evolves under k-choice; departures keep utilisation near ``utilisation``.
    """
    sim = _Sim(n, seed, PlacementConfig(k=k))
    p = sim.p
    rng = random.Random(seed + 2)
    live: list[tuple[str, PlacementRequest]] = []
    while p.onprem_utilisation() < utilisation:
        r = _request(rng, sim.imgs, sim.pop)
        d = p.place(r)
        p.forget(d)
        sim.add(d.node, r)
        live.append((d.node, r))
    gain = span = 0.0
    nodes = p.nodes()
    for _ in range(steps):
        r = _request(rng, sim.imgs, sim.pop)
        scores = [sc for sc in (p.score(x, r) for x in nodes) if sc is not None]
        mean = sum(scores) / len(scores)
        d = p.place(r)
        p.forget(d)
        picked = p.score(d.node, r)
        assert picked is not None
        gain += picked - mean
        span += max(scores) - mean
        sim.add(d.node, r)
        live.append((d.node, r))
        j = rng.randrange(len(live))
        live[j], live[-1] = live[-1], live[j]
        sim.remove(*live.pop())
    return 100.0 * gain / span


def placement_throughput(ctx: BenchContext) -> None:
    decisions = ctx.scale(200_000, 20_000)
    for n in (1000, 10_000):
        sim = _Sim(n, 11, PlacementConfig(k=4))
        rng = random.Random(5)
        reqs = [_request(rng, sim.imgs, sim.pop) for _ in range(1024)]
        for k in (2, 4, 8):
            p = Placement(rng=random.Random(k), config=PlacementConfig(k=k))
            p.apply_snapshot(sim.p._slots[x].view for x in sim.p.nodes())
            place, forget = p.place, p.forget
            rates = []
            for _ in range(3):
                t0 = time.perf_counter()
                for i in range(decisions // 3):
                    forget(place(reqs[i & 1023]))
                rates.append(decisions // 3 / (time.perf_counter() - t0))
            ctx.record("placement_throughput", max(rates), "decisions/s", nodes=n, k=k)
    ctx.note("placement_throughput: one decision = place() + forget() (the edge's answer), "
             "heterogeneous nodes, the kchoice_quality request mix (image locality, spread "
             "group), single thread, best of 3 runs (the 2-core machine is shared).")


def kchoice_outcome_run(policy: str, k: int = 4, *, n: int = 1000, steps: int = 3000,
                        seed: int = 7, utilisation: float = 0.7) -> float:
    """Mean score of one policy run alone over the whole workload (its own states).

    ``policy``: ``"k"`` (k-choice), ``"random"`` (uniform over feasible nodes) or
    ``"best"`` (exhaustive). Same arrivals and departures for every policy.
    """
    sim = _Sim(n, seed, PlacementConfig(k=k))
    p = sim.p
    rng = random.Random(seed + 2)
    pick = random.Random(seed + 3)
    live: list[tuple[str, PlacementRequest]] = []
    while p.onprem_utilisation() < utilisation:
        r = _request(rng, sim.imgs, sim.pop)
        d = p.place(r)
        p.forget(d)
        sim.add(d.node, r)
        live.append((d.node, r))
    total = 0.0
    for _ in range(steps):
        r = _request(rng, sim.imgs, sim.pop)
        if policy == "k":
            d = p.place(r)
            p.forget(d)
            node = d.node
        elif policy == "best":
            node = p.best(r) or ""
        else:
            node = pick.choice(p.feasible(r))
        sc = p.score(node, r)
        assert sc is not None
        total += sc
        sim.add(node, r)
        live.append((node, r))
        j = rng.randrange(len(live))
        live[j], live[-1] = live[-1], live[j]
        sim.remove(*live.pop())
    return total / steps


def kchoice_quality(ctx: BenchContext) -> None:
    steps = ctx.scale(3000, 400)
    for k in (2, 4, 8):
        ctx.record("kchoice_quality", kchoice_quality_run(k, steps=steps), "%", k=k,
                   nodes=1000, steps=steps, metric="same-state", target=">=67.65 at k=4")
    rand = kchoice_outcome_run("random", steps=steps)
    best = kchoice_outcome_run("best", steps=steps)
    for k in (2, 4, 8):
        got = kchoice_outcome_run("k", k, steps=steps)
        ctx.record("kchoice_quality", 100.0 * (got - rand) / (best - rand), "%", k=k,
                   nodes=1000, steps=steps, metric="whole-run")
    ctx.note("kchoice_quality: 'same-state' compares, at every arrival on one cluster state, "
             "the k-choice pick with the mean feasible score (random) and the best score "
             "(exhaustive); 'whole-run' runs each policy alone over the same arrivals and "
             "compares mean scores. Workload and score: docs/control.md.")


def quota_check(ctx: BenchContext) -> None:
    checks = ctx.scale(200_000, 20_000)
    for live in (100, 100_000):
        for depth in (1, 5):
            project = "/".join(f"l{i}" for i in range(depth))
            q = QuotaIndex()
            path = ""
            for part in project.split("/"):
                path = f"{path}/{part}" if path else part
                q.set_quota(path, Quota(max_sandboxes=10**9, cpu_milli=10**12,
                                        memory_bytes=1 << 60))
            for i in range(live):
                q.insert(SandboxRecord(id=f"sb-{i:012x}-n{i % 100}", node=f"n{i % 100}",
                                       project=project, cpu_milli=500, memory_bytes=GiB))
            check = q.check
            best = float("inf")
            for _ in range(3):      # best of 3: the 2-core machine is shared
                t0 = time.perf_counter()
                for _ in range(checks // 3):
                    check(project, backend="simulated", cpu_milli=1000, memory_bytes=GiB)
                best = min(best, (time.perf_counter() - t0) / (checks // 3))
            ctx.record("quota_check", best * 1e9, "ns/check", live_sandboxes=live,
                       depth=depth)


def registry_events(ctx: BenchContext) -> None:
    total = ctx.scale(200_000, 20_000)
    for batch in (1, 64, 512):
        n = total if batch > 1 else total // 20
        with tempfile.TemporaryDirectory() as d:
            store = SqliteStore(Path(d) / "state.db")
            try:
                clock: Callable[[], float] = time.time
                reg = Registry(store, clock=clock, batch_size=batch, memory_events=1024)
                t0 = time.perf_counter()
                for i in range(n):
                    reg.emit("sandbox_added", sandbox_id=f"sb-{i:012x}-n1", node_id="n1",
                             payload={"reason": "created"})
                reg.flush()
                dt = time.perf_counter() - t0
                ctx.record("registry_events_write", n / dt, "events/s", batch=batch)
                if batch == 512:
                    # A watcher that fell behind reads everything from SQLite.
                    w = Registry(store, clock=clock).watch(0)
                    t0 = time.perf_counter()
                    got = 0
                    while True:
                        evs = w.poll(1000)
                        if not evs:
                            break
                        got += len(evs)
                    dt = time.perf_counter() - t0
                    ctx.record("registry_events_read", got / dt, "events/s", source="sqlite")
                    # A watcher that keeps up reads from the in-memory ring.
                    w = reg.watch(reg.committed_version - 1000)
                    t0 = time.perf_counter()
                    for _ in range(100):
                        w.position = reg.committed_version - 1000
                        w.poll(1000)
                    dt = time.perf_counter() - t0
                    ctx.record("registry_events_read", 100_000 / dt, "events/s", source="ring")
            finally:
                store.close()


@suite("control")
def control(ctx: BenchContext) -> None:
    """Control plane: placement throughput/quality, quota checks, registry events."""
    placement_throughput(ctx)
    kchoice_quality(ctx)
    quota_check(ctx)
    registry_events(ctx)
