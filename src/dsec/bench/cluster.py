"""Suite ``cluster``: a cluster at scale (issue 16), then the other issue-16 streams' figures.

The scale bench: ``edges`` simulated edges (hosted ``edges_per_process`` to a process,
each edge on its own Unix socket, as ``dsec edge`` serves one) behind ``replicas``
``dsec apiserver`` processes that share one state store, filled to 10k, 50k and 100k
live sandboxes through the SDK's ``create_many`` over each replica's Aether gateway (one
load process per replica). At each level: list/paging latency, quota-check latency,
apiserver RSS and store size, so that "flat in the number of sandboxes" is a measured
curve, not a claim.

The store is a parameter (``store=sqlite|postgresql``): until the ``pg`` stream's
PostgreSQL store lands, the replicas share the SQLite file of one state dir
(``dsec apiserver`` over one ``--state-dir``); with it, :data:`STORE` flips to
``"postgresql"`` and the replicas get ``--store <dsn>`` of a throwaway server
(``dsec.cluster.pgserver.PgServer``). That is the one line to change.

After the scale bench, each module named in :data:`CLUSTER_MODULES` that exists
(``dsec.bench.cluster_<stream>``, written by the other streams) runs with
``run(quick) -> list[Result]``; a missing one is skipped (plan-16.md, "Figures").
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import multiprocessing as mp
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from dsec.bench import BenchContext, Result, suite

__all__ = ["CLUSTER_MODULES", "STORE", "ScaleConfig", "run_scale", "run_stream_modules",
           "scale_cluster"]

#: The other streams' figure modules (plan-16.md): run when present, skipped when not.
CLUSTER_MODULES: tuple[str, ...] = ("cluster_pg", "cluster_join", "cluster_hosts",
                                    "cluster_move")

#: The replicas' shared store. "sqlite" until the pg stream lands; then "postgresql".
STORE = "postgresql"


@dataclass(frozen=True, slots=True, kw_only=True)
class ScaleConfig:
    """One scale run. ``levels``: live-sandbox counts at which the flatness figures are
    taken (the last is the target population, ``edges * per_edge``)."""

    edges: int = 50
    per_edge: int = 2_000
    replicas: int = 2
    edges_per_process: int = 25        # 2 edge processes for 50 edges on a 2-core box
    levels: tuple[int, ...] = (10_000, 50_000, 100_000)
    batch: int = 256                   # create_many items per gateway call (as api bench)
    inflight: int = 4                  # create_many calls in flight per load process
    store: str = STORE
    samples: int = 40                  # calls per latency figure
    profile_s: float = 0.0             # >0: py-spy record replica 0 this long while filling
    # `dsec apiserver --sandbox-list-interval`: full edge lists at most this often
    # (PlaneConfig.sandbox_list_interval_s, whose default this is; 0 = at every poll)
    list_interval_s: float = 5.0


QUICK = ScaleConfig(edges=10, per_edge=300, edges_per_process=5, levels=(500, 1_500, 3_000),
                    samples=20, list_interval_s=2.0)


# ------------------------------------------------------------------ edge processes
def _edge_host(nodes: list[tuple[str, str]], ready: Any) -> None:
    """Serve the simulated edges ``nodes`` ((node id, socket path)) from one process:
    each a full EdgeNode with its own Aether listener, as ``dsec edge`` runs one."""
    import uvloop

    async def main() -> None:
        from dsec.edge.admission import Capacity
        from dsec.edge.backends import make_backend
        from dsec.edge.node import EdgeNode, NodeConfig
        from dsec.edge.service import serve_edge

        for node_id, sock in nodes:
            node = EdgeNode(NodeConfig(node_id=node_id, capacity=Capacity(
                cpu_milli=10**8, memory_bytes=1 << 52, max_sandboxes=10**6)),
                {"simulated": make_backend("simulated")})
            await node.start()
            await serve_edge(node, f"unix:{sock}")
        ready.set()
        await asyncio.Event().wait()

    uvloop.run(main())


# ------------------------------------------------------------------ load processes
async def _fill(t: Any, spec: Any, n: int, batch: int,
                inflight: int) -> tuple[int, int, list[str]]:
    """Create ``n`` sandboxes through transport ``t`` with create_many, ``inflight``
    calls at once: (created, failed, a sample of ids)."""
    from dsec.wire import ops
    from dsec.wire.calls import CreateMany

    left = n
    ok = failed = 0
    sample: list[str] = []

    async def worker() -> None:
        nonlocal left, ok, failed
        while left > 0:
            k = min(batch, left)
            left -= k
            try:
                res = await t.call(ops.CREATE_MANY, CreateMany(items=[spec] * k))
            except Exception:  # noqa: BLE001 - counted, reported as failed
                failed += k
                continue
            for o in res.items:
                if o.error is None:
                    ok += 1
                    if len(sample) < 64 and o.value is not None:
                        sample.append(o.value.id)
                else:
                    failed += 1
    await asyncio.gather(*(worker() for _ in range(inflight)))
    return ok, failed, sample


def _loader(url: str, gateway: str, key: str, batch: int, inflight: int, cmds: Any,
            out: Any) -> None:
    """One load process on one replica: for each ``n`` read from ``cmds``, create ``n``
    sandboxes with the SDK's create_many over the replica's gateway, ``inflight`` calls
    at once; answers (created, failed, seconds, sample ids). ``None`` ends it."""
    import uvloop

    async def main() -> None:
        from dsec.client.core import AsyncClient
        from dsec.wire.spec import SandboxSpec

        c = AsyncClient(url, key, gateway=gateway, protocol="aether", session_lease_s=None)
        t = await c._transport()
        spec = SandboxSpec(cpu_milli=100, memory_bytes=64 << 20)
        try:
            while (n := await asyncio.to_thread(cmds.get)) is not None:
                t0 = time.perf_counter()
                ok, failed, sample = await _fill(t, spec, n, batch, inflight)
                out.put((ok, failed, time.perf_counter() - t0, sample))
        finally:
            await c.close()

    uvloop.run(main())


# ------------------------------------------------------------------ apiserver replicas
@dataclass
class Replica:
    proc: subprocess.Popen[bytes]
    url: str
    gateway: str
    key: str
    log: str


def _start_replica(state_dir: str, edges: dict[str, str], store_url: str | None,
                   log: str, list_interval_s: float, timeout_s: float = 120.0) -> Replica:
    """``dsec apiserver`` over the edges, sharing ``state_dir`` (SQLite) or
    ``store_url`` (PostgreSQL) with the other replicas; its address and admin key from
    what it prints."""
    from dsec.cluster import DSEC_ARGV

    argv = [*DSEC_ARGV, "apiserver", "--state-dir", state_dir, "--listen", "127.0.0.1:0",
            "--gateway", "tcp:127.0.0.1:0", "--sandbox-list-interval", str(list_interval_s)]
    if store_url is not None:
        argv += ["--store", store_url]
    for node, addr in edges.items():
        argv += ["--edge", f"{node}={addr}"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=f)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(log, errors="replace") as f:
            text = f.read()
        m = re.search(r"REST (\S+)\s+gateway (\S+)", text)
        k = re.search(r"admin key: (\S+)", text)
        if m and k:
            return Replica(proc, m.group(1), m.group(2), k.group(1), log)
        if proc.poll() is not None:
            raise RuntimeError(f"dsec apiserver exited {proc.returncode}: {text[-2000:]}")
        time.sleep(0.1)
    proc.kill()
    raise TimeoutError(f"dsec apiserver did not start within {timeout_s:g}s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _store_mb(state_dir: str) -> float:
    """The store's size on disk: the SQLite file and its WAL, or, with PostgreSQL, its
    data directory (``<bench dir>/pg/data``, beside the state dir)."""
    pg = os.path.join(os.path.dirname(state_dir), "pg", "data")
    total = 0
    if os.path.isdir(pg):
        for root, _, files in os.walk(pg):
            for name in files:
                with contextlib.suppress(FileNotFoundError):
                    total += os.path.getsize(os.path.join(root, name))
        return total / 2**20
    for suffix in ("", "-wal"):
        with contextlib.suppress(FileNotFoundError):
            total += os.path.getsize(os.path.join(state_dir, "control.sqlite" + suffix))
    return total / 2**20


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pg_pids(state_dir: str) -> list[int]:
    """The PostgreSQL server's processes (postmaster and its backends)."""
    try:
        with open(os.path.join(os.path.dirname(state_dir), "pg", "data",
                               "postmaster.pid")) as f:
            root = int(f.readline())
    except (OSError, ValueError):
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if int(entry) == root or ppid == root:
            pids.append(int(entry))
    return pids


def _pg_rss_mb(state_dir: str) -> float:
    """RSS of the PostgreSQL server (postmaster and its backends); 0 without one."""
    total = 0.0
    for pid in _pg_pids(state_dir):
        with contextlib.suppress(OSError):
            total += _rss_mb(pid)
    return total


@contextlib.contextmanager
def _store(kind: str, d: str) -> Iterator[str | None]:
    """The replicas' store: None (the SQLite file of the shared state dir) or a
    PostgreSQL DSN of a throwaway server in ``d``."""
    if kind == "sqlite":
        yield None
        return
    if kind != "postgresql":
        raise ValueError(f"store must be sqlite or postgresql, not {kind!r}")
    from dsec.cluster.pgserver import PgServer  # type: ignore[import-not-found, unused-ignore]
    # fsync on (the server's default): the figure is the cluster's as deployed
    with PgServer(os.path.join(d, "pg")) as dsn:
        yield dsn


# ------------------------------------------------------------------ the run
@dataclass
class Level:
    live: int
    list_first_ms: float
    list_deep_ms: float
    list_next_ms: float
    quota_check_ms: float
    rss_mb: list[float]
    store_mb: float
    store_rss_mb: float = 0.0       # PostgreSQL's memory (0 with SQLite: in the replicas)
    live_reported: int = 0
    # CPU seconds each part of the cluster spent filling this level (what bounds the
    # rate on a machine they all share): replicas, edges, loaders, store
    cpu_s: dict[str, float] = field(default_factory=dict)


@dataclass
class ScaleRun:
    cfg: ScaleConfig
    created: int = 0
    failed: int = 0
    create_s: float = 0.0
    per_level_rate: list[float] = field(default_factory=list)
    levels: list[Level] = field(default_factory=list)
    base_rss_mb: list[float] = field(default_factory=list)
    base_store_mb: float = 0.0
    live_sandboxes: int = 0
    nodes_written_off: int = 0      # "node ... lost" lines in the replicas' logs
    profile: str = ""


def _p50_ms(fn: Any, n: int) -> float:
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t0)
    return statistics.median(lat) * 1000


def _measure(http: Any, live: int, sample: list[str], cfg: ScaleConfig,
             replicas: list[Replica], state_dir: str) -> Level:
    import base64

    def first() -> None:
        r = http.get("/v1/sandboxes", params={"limit": 100})
        r.raise_for_status()

    mid = sorted(sample)[len(sample) // 2] if sample else ""
    cur = base64.urlsafe_b64encode(mid.encode()).decode().rstrip("=")

    def deep() -> None:
        r = http.get("/v1/sandboxes", params={"limit": 100, "cursor": cur})
        r.raise_for_status()

    state = {"cursor": None}

    def walk() -> None:
        params: dict[str, Any] = {"limit": 100}
        if state["cursor"]:
            params["cursor"] = state["cursor"]
        r = http.get("/v1/sandboxes", params=params)
        r.raise_for_status()
        state["cursor"] = r.json().get("next_cursor")

    def quota() -> None:
        # refused by the quota chain (bench/q has max_sandboxes 0): auth + the O(depth)
        # check, no edge call; must stay flat in the number of live sandboxes
        r = http.post("/v1/sandboxes", json={"project": "bench/q/full/x"})
        if r.status_code != 429 or "quota" not in r.text:
            raise RuntimeError(f"quota probe answered {r.status_code}: {r.text[:300]}")

    return Level(live=live, list_first_ms=_p50_ms(first, cfg.samples),
                 list_deep_ms=_p50_ms(deep, cfg.samples) if mid else 0.0,
                 list_next_ms=_p50_ms(walk, cfg.samples),
                 quota_check_ms=_p50_ms(quota, cfg.samples),
                 rss_mb=[_rss_mb(r.proc.pid) for r in replicas],
                 store_mb=_store_mb(state_dir), store_rss_mb=_pg_rss_mb(state_dir))


def _live(http: Any) -> int:
    r = http.get("/v1/nodes")
    r.raise_for_status()
    return sum(int(n.get("sandboxes", 0)) for n in r.json()["items"])


def run_scale(cfg: ScaleConfig) -> ScaleRun:
    """Bring the cluster up, fill it level by level, measure, tear it all down."""
    import httpx

    out = ScaleRun(cfg)
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    replicas: list[Replica] = []
    d = tempfile.mkdtemp(prefix="dsec-bench-cluster-")
    # PgServer runs PostgreSQL as its own account, which must enter the directory
    os.chmod(d, 0o711)
    try:
        with _store(cfg.store, d) as store_url:
            state = os.path.join(d, "state")
            os.makedirs(os.path.join(d, "edges"))
            edges = {f"edge-{i}": os.path.join(d, "edges", f"edge-{i}.sock")
                     for i in range(cfg.edges)}
            names = list(edges)
            for start in range(0, cfg.edges, cfg.edges_per_process):
                ev = ctx.Event()
                p = ctx.Process(target=_edge_host, args=(
                    [(n, edges[n]) for n in names[start:start + cfg.edges_per_process]], ev),
                    daemon=True)
                p.start()
                procs.append(p)
                if not ev.wait(120):
                    raise TimeoutError("an edge host process did not start in 120 s")
            addrs = {n: f"unix:{s}" for n, s in edges.items()}
            for i in range(cfg.replicas):
                replicas.append(_start_replica(state, addrs, store_url,
                                               os.path.join(d, f"apiserver-{i}.log"),
                                               cfg.list_interval_s))
            key = replicas[0].key
            http = httpx.Client(base_url=replicas[0].url, timeout=120,
                                headers={"authorization": f"Bearer {key}"})
            r = http.put("/v1/quotas/bench/q", json={"max_sandboxes": 0})
            r.raise_for_status()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:     # every edge heard by replica 0
                r = http.get("/v1/nodes")
                if sum(n.get("healthy", True) for n in r.json()["items"]) == cfg.edges:
                    break
                time.sleep(0.5)
            out.base_rss_mb = [_rss_mb(r.proc.pid) for r in replicas]
            out.base_store_mb = _store_mb(state)
            cmds = [ctx.Queue() for _ in replicas]
            res = ctx.Queue()
            for rep, q in zip(replicas, cmds, strict=True):
                p = ctx.Process(target=_loader, args=(rep.url, rep.gateway, key, cfg.batch,
                                                      cfg.inflight, q, res), daemon=True)
                p.start()
                procs.append(p)
            have = 0
            sample: list[str] = []
            prof: subprocess.Popen[bytes] | None = None
            for level in cfg.levels:
                want = level - have
                share = [want // len(replicas)] * len(replicas)
                share[0] += want - sum(share)
                spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
                if cfg.profile_s > 0 and level == cfg.levels[-1] and os.path.exists(spy):
                    out.profile = os.path.join(tempfile.gettempdir(),
                                               f"dsec-cluster-profile-{os.getpid()}.txt")
                    prof = subprocess.Popen(
                        [spy, "record", "-p", str(replicas[0].proc.pid), "-d",
                         str(int(cfg.profile_s)), "-f", "raw", "-o", out.profile],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                parts = {"replicas": [r.proc.pid for r in replicas],
                         "edges": [p.pid for p in procs[:len(procs) - len(replicas)]],
                         "loaders": [p.pid for p in procs[len(procs) - len(replicas):]],
                         "store": _pg_pids(state)}
                cpu0 = {k: sum(_cpu_s(p) for p in v) for k, v in parts.items()}
                t0 = time.perf_counter()
                for q, n in zip(cmds, share, strict=True):
                    q.put(n)
                got = [res.get(timeout=3600) for _ in replicas]
                dt = time.perf_counter() - t0
                cpu = {k: sum(_cpu_s(p) for p in v) - cpu0[k] for k, v in parts.items()}
                made = sum(g[0] for g in got)
                out.created += made
                out.failed += sum(g[1] for g in got)
                out.create_s += dt
                out.per_level_rate.append(made / dt if dt else 0.0)
                for g in got:
                    sample += g[3]
                have += made
                if prof is not None:
                    prof.wait(timeout=cfg.profile_s + 60)
                    prof = None
                # let both replicas take a full edge list (their registries, node views)
                time.sleep(cfg.list_interval_s + 2.5)
                lv = _measure(http, have, sample, cfg, replicas, state)
                lv.live_reported = _live(http)
                lv.cpu_s = {**cpu, "wall": dt}
                out.levels.append(lv)
            out.live_sandboxes = _live(http)
            for q in cmds:
                q.put(None)
            http.close()
            for rep in replicas:
                with open(rep.log, errors="replace") as f:
                    out.nodes_written_off += sum(
                        1 for line in f if re.search(r"node \S+ lost \(no heartbeat", line))
    finally:
        for rep in replicas:
            _stop(rep.proc)
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(10)
            if p.is_alive():
                p.kill()
        shutil.rmtree(d, ignore_errors=True)
    return out


def scale_cluster(ctx: BenchContext) -> None:
    cfg = QUICK if ctx.quick else ScaleConfig()
    run = run_scale(cfg)
    common = {"edges": cfg.edges, "replicas": cfg.replicas, "store": cfg.store,
              "list_interval_s": cfg.list_interval_s}
    rate = run.created / run.create_s if run.create_s else 0.0
    ctx.record("cluster_create_e2e", rate, "sandboxes/s", **common, n=run.created,
               failed=run.failed, batch=cfg.batch, inflight=cfg.inflight,
               transport="aether", target=5000)
    ctx.record("cluster_live_sandboxes", run.live_sandboxes, "sandboxes", **common,
               per_edge=cfg.per_edge, created=run.created, target=cfg.edges * cfg.per_edge,
               seen_by="replica 0's GET /v1/nodes (edge heartbeats)")
    ctx.record("cluster_nodes_written_off", run.nodes_written_off, "count", **common,
               note="node TTL expiries logged by the replicas (their sandboxes evicted)")
    for lv, lrate in zip(run.levels, run.per_level_rate, strict=True):
        at = {"live": lv.live, **common}
        ctx.record("cluster_create_e2e_level", lrate, "sandboxes/s", **at)
        ctx.record("cluster_list_first_page_ms", lv.list_first_ms, "ms", limit=100, **at)
        ctx.record("cluster_list_deep_page_ms", lv.list_deep_ms, "ms", limit=100,
                   cursor="middle", **at)
        ctx.record("cluster_list_next_page_ms", lv.list_next_ms, "ms", limit=100,
                   walk="next_cursor", **at)
        ctx.record("cluster_quota_check_ms", lv.quota_check_ms, "ms", depth=4,
                   via="rest create refused by quota", **at)
        ctx.record("cluster_apiserver_rss_mb", max(lv.rss_mb), "MB", **at)
        ctx.record("cluster_live_seen", lv.live_reported, "sandboxes", **at)
        ctx.record("cluster_store_mb", lv.store_mb, "MB", **at)
        if lv.store_rss_mb:
            ctx.record("cluster_store_rss_mb", lv.store_rss_mb, "MB", **at)
        made = lv.live - (run.levels[run.levels.index(lv) - 1].live if run.levels.index(lv)
                          else 0)
        if made > 0 and lv.cpu_s:
            ctx.record("cluster_cpu_ms_per_create", 1000 * sum(
                v for k, v in lv.cpu_s.items() if k != "wall") / made, "ms",
                **at, **{f"cpu_ms_{k}": round(1000 * v / made, 3)
                         for k, v in lv.cpu_s.items() if k != "wall"},
                note="CPU of every part per sandbox created")
    last = run.levels[-1]
    per = last.live / 10_000
    if per > 0:
        rss_growth = [a - b for a, b in zip(last.rss_mb, run.base_rss_mb, strict=True)]
        ctx.record("cluster_apiserver_rss_per_10k_mb", max(rss_growth) / per, "MB",
                   live=last.live, **common)
        ctx.record("cluster_store_per_10k_mb", (last.store_mb - run.base_store_mb) / per,
                   "MB", live=last.live, **common)
    ctx.note(
        f"cluster: {cfg.edges} simulated edges ({cfg.edges_per_process} per process, each "
        f"on its own Unix socket) behind {cfg.replicas} `dsec apiserver` processes over one "
        f"{cfg.store} store; one load process per replica runs the SDK's create_many over "
        f"its Aether gateway ({cfg.batch} per call, {cfg.inflight} calls in flight). All "
        "of it shares the machine's cores. list/quota figures are p50 of "
        f"{cfg.samples} REST calls on replica 0 at each level; the quota probe is a create "
        "refused by a quota 3 levels up (auth + quota chain, no edge call).")
    if run.profile:
        ctx.note(f"cluster: py-spy profile of replica 0 while filling the last level: "
                 f"{run.profile}")


def run_stream_modules(ctx: BenchContext, names: tuple[str, ...] = CLUSTER_MODULES,
                       package: str = "dsec.bench") -> list[str]:
    """Run ``<package>.<name>.run(ctx.quick)`` for each of ``names`` that exists and
    record its figures under this suite; a module that does not exist is skipped (its
    stream has not landed), one that fails is noted. Returns the names that ran."""
    ran = []
    for name in names:
        try:
            mod = importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"{package}.{name}":
                continue                  # that stream has not landed: skipped silently
            raise
        ran.append(name)
        try:
            results: list[Result] = mod.run(ctx.quick)
        except Exception as exc:  # noqa: BLE001 - one broken part must not lose the others
            ctx.note(f"{name} failed: {type(exc).__name__}: {exc}")
            continue
        for r in results:
            ctx.record(r.name, r.value, r.unit, **r.params)
    return ran


@suite("cluster")
def cluster(ctx: BenchContext) -> None:
    """A cluster at scale: 50 edges x 2,000 sandboxes behind 2 replicas; then the other
    issue-16 streams' figures (cluster_pg, cluster_join, cluster_hosts, cluster_move)."""
    try:
        scale_cluster(ctx)
    except Exception as exc:  # noqa: BLE001 - one broken part must not lose the others
        ctx.note(f"scale_cluster failed: {type(exc).__name__}: {exc}")
    run_stream_modules(ctx)
