"""Suite ``rl``: env stepping, GAE, replay-buffer enqueue and sandbox-env step rates."""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dsec.bench import BenchContext, suite
from dsec.bench.rl_agent import agent_figures


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and every descendant: the live ones' own time plus what each
    collected from children it reaped (no double count). Linux /proc only."""
    tck = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                st = f.read().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in st[11:15]) / tck
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def _rate(fn: Callable[[], int], budget_s: float) -> float:
    """Units per second of ``fn`` (which returns the units it did) over ``budget_s``."""
    fn()  # warm-up (JIT, caches)
    done, t0 = 0, time.perf_counter()
    while True:
        done += fn()
        dt = time.perf_counter() - t0
        if dt >= budget_s:
            return done / dt


def env_steps(ctx: BenchContext) -> None:
    from dsec.rl.envpool import EnvPool
    from dsec.rl.trivial import TrivialBatchEnv, TrivialEnv

    budget = 0.3 if ctx.quick else 2.0
    n_envs, shards = 64, 4
    acts = np.zeros(n_envs, dtype=np.int64)

    def run(pool: EnvPool, ticks: int) -> Callable[[], int]:
        pool.reset(seed=0)

        def go() -> int:
            for _ in range(ticks):
                pool.step_async(acts)
                pool.step_wait()
            return ticks * n_envs
        return go

    for workers in (None, shards):
        with EnvPool([TrivialBatchEnv(n_envs // shards) for _ in range(shards)],
                     workers=workers) as pool:
            ctx.record("rl_env_steps_fast", _rate(run(pool, 200), budget), "steps/s",
                       envs=n_envs, shards=shards, workers=workers or "inline",
                       path="vectorised numpy")
    with EnvPool([TrivialBatchEnv(n_envs)]) as pool:
        ctx.record("rl_env_steps_fast", _rate(run(pool, 200), budget), "steps/s",
                   envs=n_envs, shards=1, workers="inline", path="vectorised numpy")
    with EnvPool.from_envs([TrivialEnv] * n_envs, workers=shards) as pool:
        ctx.record("rl_env_steps_per_env", _rate(run(pool, 20), budget), "steps/s",
                   envs=n_envs, shards=shards, workers=shards, path="gymnasium.Env loop")
    ctx.note("rl_env_steps_fast: 64 trivial envs in 4 shards. Threads cannot run numpy "
             "ufuncs on 16-element arrays in parallel (GIL-bound per-call overhead), so "
             "the inline path is the fast one; workers pay off for I/O-bound shards.")


def gae_rate(ctx: BenchContext) -> None:
    from dsec.rl.gae import gae, numba_available

    t_len, n = (1024, 64) if ctx.quick else (8192, 64)
    rng = np.random.default_rng(0)
    r = rng.normal(size=(t_len, n)).astype(np.float32)
    v = rng.normal(size=(t_len, n)).astype(np.float32)
    d = rng.random((t_len, n)) < 0.01
    lv = np.zeros(n, np.float32)
    out = np.empty_like(r)
    budget = 0.3 if ctx.quick else 1.5
    backends = ["numba", "numpy"] if numba_available() else ["numpy"]
    for b in backends:
        def go(b: str = b) -> int:
            gae(r, v, d, lv, 0.99, 0.95, backend=b, out=out)  # type: ignore[arg-type]
            return t_len * n
        ctx.record("rl_gae", _rate(go, budget), "transitions/s", T=t_len, N=n, backend=b,
                   dtype="float32")


def buffer_enqueue(ctx: BenchContext) -> None:
    from dsec.rl.buffer import ReplayBuffer

    n, cap = 64, 512
    budget = 0.3 if ctx.quick else 1.5
    obs = np.ones((n, 16), np.float32)
    act = np.ones(n, np.int64)
    rew = np.ones(n, np.float32)
    done = np.zeros(n, bool)
    done[::17] = True
    lp = np.ones(n, np.float32)
    val = np.ones(n, np.float32)
    runs: list[tuple[int | None, int, Any]] = [
        (None, 1, np.float32), (32, 1, np.float32), (128, 1, np.float32),
        (128, 16, np.float32), (128, 1, np.float16)]
    for hidden, interval, sdt in runs:
        buf = ReplayBuffer(num_envs=n, capacity=cap, obs_shape=(16,), hidden_size=hidden,
                           state_interval=interval, state_dtype=sdt)
        h = np.ones((n, hidden or 1), np.float32)
        states = (h, h, h, h) if hidden else ()
        for _ in range(cap):        # steady state: every ring page already faulted in
            buf.add(obs, act, rew, done, lp, val, *states)

        def go(buf: ReplayBuffer = buf, states: tuple[Any, ...] = states) -> int:
            for _ in range(256):
                buf.add(obs, act, rew, done, lp, val, *states)
            return 256 * n

        ctx.record("rl_buffer_enqueue", _rate(go, budget), "transitions/s", envs=n,
                   obs_dim=16, lstm_hidden=hidden or 0, lstm_states=4 if hidden else 0,
                   capacity=cap, state_dtype=np.dtype(sdt).name,
                   state_storage=("every step" if interval == 1 else
                                  f"sequence starts only (R2D2), every {interval} steps"))
    ctx.note("rl_buffer_enqueue: one add() per tick of 64 envs. With LSTM state stored "
             "every step a row carries 4 x hidden float32 per env (2 KiB at hidden=128), so "
             "that figure is bounded by memory bandwidth; storing it at sequence starts "
             "only (state_interval=16; the trainer recomputes the rest with its LSTM, "
             "bit-identical) removes 15/16 of those bytes; float16 halves them but rounds "
             "the state and pays a conversion.")


def _serve_sim_edge(path: str, node_id: str, ready: Any) -> None:
    import uvloop

    from dsec.edge.admission import Capacity
    from dsec.edge.backends.simulated import SimulatedBackend
    from dsec.edge.node import EdgeNode, NodeConfig
    from dsec.edge.service import serve_edge

    async def main() -> None:
        node = EdgeNode(NodeConfig(node_id=node_id, capacity=Capacity(
            cpu_milli=10**7, memory_bytes=1 << 44, max_sandboxes=100_000)), SimulatedBackend())
        await node.start()
        srv = await serve_edge(node, f"unix:{path}")
        ready.set()
        await asyncio.Event().wait()
        await srv.close()

    uvloop.run(main())


def _sandbox_rates(ctx: BenchContext, access: Any, backend: str, transport: str,
                   n_envs: int, budget: float, tasks: list[Any] | None = None,
                   batch_only: bool = False, cpu: Callable[[], float] | None = None,
                   **extra: Any) -> float:
    from dsec.rl.sandbox import SandboxEnv, SandboxEnvPool, Task

    tasks = tasks or [Task(prompt="bench", max_turns=1_000_000)]
    with SandboxEnvPool(access, tasks, n_envs) as pool:
        t0 = time.perf_counter()
        pool.reset(seed=0)
        ctx.record("rl_sandbox_env_reset", n_envs / (time.perf_counter() - t0), "episodes/s",
                   envs=n_envs, mode="pool.reset: batched create + mkdir", backend=backend,
                   transport=transport)
        t0 = time.perf_counter()
        pool.pause()
        t1 = time.perf_counter()
        pool.resume()
        ctx.record("rl_sandbox_env_preempt", (t1 - t0) * 1000, "ms", envs=n_envs,
                   op="pause every sandbox", backend=backend, transport=transport)
        ctx.record("rl_sandbox_env_preempt", (time.perf_counter() - t1) * 1000, "ms",
                   envs=n_envs, op="resume every sandbox", backend=backend,
                   transport=transport)
        acts = np.empty(n_envs, dtype=object)
        acts[:] = "echo hi"

        def batched() -> int:
            for _ in range(5):
                pool.step(acts)
            return 5 * n_envs

        batched()
        c0, n = (cpu() if cpu else 0.0), 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < budget:
            n += batched()
        rate = n / (time.perf_counter() - t0)
        ctx.record("rl_sandbox_env", rate, "steps/s", envs=n_envs,
                   mode="pool: 1 exec batch per tick", backend=backend, transport=transport,
                   **extra)
        if cpu is not None:
            # CPU per step is what a loaded machine cannot blur: steps/s on 2 shared
            # cores is the share of them we got as much as what a step costs
            ctx.record("rl_sandbox_env_cpu_per_step", (cpu() - c0) / n * 1e3, "ms",
                       envs=n_envs, mode="pool: 1 exec batch per tick", backend=backend,
                       transport=transport, **extra)
    if batch_only:
        return rate
    envs = [SandboxEnv(access, tasks) for _ in range(n_envs)]
    try:
        for e in envs:
            e.reset(seed=0)

        def one_by_one() -> int:
            for e in envs:
                e.step("echo hi")
            return n_envs

        ctx.record("rl_sandbox_env", _rate(one_by_one, budget), "steps/s", envs=n_envs,
                   mode="one exec call per env", backend=backend, transport=transport,
                   **extra)
    finally:
        for e in envs:
            e.close()
    return rate


def sandbox_env(ctx: BenchContext) -> None:
    import multiprocessing as mp
    import os
    import tempfile

    from dsec.edge.admission import Capacity
    from dsec.edge.backends.simulated import SimulatedBackend
    from dsec.edge.node import EdgeNode, NodeConfig
    from dsec.edge.service import EdgeClient
    from dsec.rl.access import EdgeAccess, LoopThread

    n_envs = 64
    budget = 0.5 if ctx.quick else 2.0
    lt = LoopThread()
    try:
        async def start() -> EdgeNode:
            node = EdgeNode(NodeConfig(node_id="bench-rl", capacity=Capacity(
                cpu_milli=10**7, memory_bytes=1 << 44, max_sandboxes=100_000)),
                SimulatedBackend())
            return await node.start()

        node = lt.run(start())
        try:
            _sandbox_rates(ctx, EdgeAccess({"bench-rl": node}, lt), "simulated",
                           "in-process EdgeNode", n_envs, budget)
        finally:
            lt.run(node.close())

        with tempfile.TemporaryDirectory(prefix="dsec-bench-rl-") as d:
            path = os.path.join(d, "edge.sock")
            mpctx = mp.get_context("spawn")
            ready = mpctx.Event()
            proc = mpctx.Process(target=_serve_sim_edge, args=(path, "bench-rl2", ready),
                                 daemon=True)
            proc.start()
            try:
                if not ready.wait(60):
                    raise RuntimeError("edge server for the rl bench did not start in 60 s")
                client = lt.run(EdgeClient.connect(f"unix:{path}"))
                try:
                    _sandbox_rates(ctx, EdgeAccess({"bench-rl2": client}, lt), "simulated",
                                   "EdgeClient over Aether UDS (edge in another process)",
                                   n_envs, budget)
                finally:
                    lt.run(client.close())
            finally:
                proc.terminate()
                proc.join(5)
    finally:
        lt.close()
    container_env(ctx, n_envs, budget)
    sdk_env(ctx, n_envs, budget)
    ctx.note("rl_sandbox_env: 64 envs, one `echo hi` shell call per env per step, simulated "
             "backend (no process per exec). 'pool' sends every env's call of a tick in one "
             "exec_many round trip; 'one exec call per env' pays a thread hop and a round "
             "trip per step.")


def container_env(ctx: BenchContext, n_envs: int, budget: float) -> None:
    """The same measurement on real container sandboxes (root only)."""
    import os
    import tempfile

    if os.geteuid() != 0:
        ctx.note("rl_sandbox_env container figures skipped: needs root")
        return
    from dsec.edge.admission import Capacity
    from dsec.edge.backends.container import ContainerBackend, DirectoryImages
    from dsec.edge.backends.container.testimage import build_busybox_root
    from dsec.edge.node import EdgeNode, NodeConfig
    from dsec.rl.access import LoopThread
    from dsec.wire.spec import SandboxSpec

    spec = SandboxSpec(backend="container", image="base", memory_bytes=128 << 20,
                       pids_max=128)
    with tempfile.TemporaryDirectory(prefix="dsec-bench-rl-ct-") as d:
        build_busybox_root(os.path.join(d, "images", "base"))
        lt = LoopThread()
        holder: dict[str, Any] = {}

        async def start(helper: bool) -> EdgeNode:
            b = ContainerBackend(root_dir=os.path.join(d, f"root{int(helper)}"),
                                 images=DirectoryImages(os.path.join(d, "images")),
                                 exec_helper=helper, disk_pool_bytes=2 << 30)
            holder["b"] = b
            node = EdgeNode(NodeConfig(node_id="bench-ct", capacity=Capacity(
                cpu_milli=10**7, memory_bytes=1 << 44, max_sandboxes=10_000)),
                {"container": b})
            return await node.start()

        rates: dict[bool, list[float]] = {False: [], True: []}
        try:
            _container_runs(ctx, lt, start, holder, rates, n_envs, budget, spec)
        finally:
            lt.close()
        ctx.record("rl_sandbox_env_exec_helper_speedup",
                   sum(rates[True]) / max(sum(rates[False]), 1e-9), "x", envs=n_envs,
                   backend="container", transport="in-process EdgeNode",
                   mode="pool: 1 exec batch per tick, helper / per-exec, 2 runs each "
                        "interleaved")


def _container_runs(ctx: BenchContext, lt: Any, start: Any, holder: dict[str, Any],
                    rates: dict[bool, list[float]], n_envs: int, budget: float,
                    spec: Any) -> None:
    from dsec.rl.access import EdgeAccess
    from dsec.rl.sandbox import Task

    for helper in (False, True, False, True):   # interleaved: the same load for both
        try:
            node = lt.run(start(helper))
            try:
                b = holder["b"]
                rates[helper].append(_sandbox_rates(
                    ctx, EdgeAccess({"bench-ct": node}, lt), "container",
                    "in-process EdgeNode", n_envs, budget,
                    tasks=[Task(prompt="bench", spec=spec, max_turns=1_000_000)],
                    batch_only=len(rates[helper]) > 0, exec_path=_EXEC_PATH[helper],
                    cpu=functools.partial(_cpu_with_zygote, b)))
            finally:
                lt.run(node.close())
        finally:
            b = holder.pop("b", None)
            if b is not None:
                for sid in b.sandbox_ids():
                    try:
                        lt.run(b.destroy(sid))
                    except Exception:  # noqa: BLE001, S110 - keep cleaning up the rest
                        pass
                lt.run(b.close())
                b.governor.remove_base()


def _cpu_with_zygote(b: Any) -> float:
    """CPU seconds of this process (trainer, in-process edge) and the backend's zygote
    tree (execs' processes, exec helpers)."""
    return _cpu_with(b._zygote.pid) if b._zygote.pid is not None else _cpu_with(None)


def _cpu_with(pid: int | None) -> float:
    """CPU seconds of this process (trainer side, in-process edge) and ``pid``'s tree."""
    import resource
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime + (tree_cpu_s(pid) if pid is not None else 0.0)


_EXEC_PATH = {False: "per-exec intermediate (old)",
              True: "per-sandbox exec helper (new)"}


def sdk_env(ctx: BenchContext, n_envs: int, budget: float) -> None:
    """The same measurement through the public SDK (``ClientAccess``) against ``dsec up``
    in a child process: trainer -> apiserver/gateway -> edge, as a user runs it."""
    import os

    from dsec.cluster.local import LocalCluster
    from dsec.rl.access import ClientAccess
    from dsec.rl.sandbox import Task
    from dsec.wire.spec import SandboxSpec

    runs: list[tuple[str, list[str], str | None]] = [
        ("simulated", ["aether", "http"], None)]
    if os.geteuid() == 0:
        # the old exec path and the new one, interleaved, each in its own `dsec up`
        runs += [("container", ["aether"], h) for h in ("0", "1", "0", "1")]
    else:
        ctx.note("rl_sandbox_env SDK container figures skipped: needs root")
    rates: dict[str, list[float]] = {"0": [], "1": []}
    for backend, transports, helper in runs:
        spec = SandboxSpec(backend=backend, memory_bytes=128 << 20, pids_max=128)  # type: ignore[arg-type]
        tasks = [Task(prompt="bench", spec=spec, max_turns=1_000_000)]
        extra = {} if helper is None else {"exec_path": _EXEC_PATH[helper == "1"]}
        before = os.environ.get("DSEC_EXEC_HELPER")
        if helper is not None:
            os.environ["DSEC_EXEC_HELPER"] = helper   # read by the edge in `dsec up`
        try:
            with LocalCluster(edges=1, backend=backend, subprocess=True,
                              start_timeout_s=60.0,
                              # a 2 GiB sandbox disk pool: the default (90% of free
                              # space) fails when other clusters share the disk
                              disk_pool_bytes=(2 << 30) if backend == "container"
                              else None) as cluster:
                for transport in transports:
                    with cluster.client(protocol=transport) as client:
                        up = cluster._proc.pid
                        r = _sandbox_rates(
                            ctx, ClientAccess(client), backend,
                            f"SDK ClientAccess, {transport}, dsec up in a subprocess",
                            n_envs, budget, tasks=tasks,
                            batch_only=helper is not None and len(rates[helper]) > 0,
                            cpu=functools.partial(_cpu_with, up), **extra)
                        if helper is not None:
                            rates[helper].append(r)
        finally:
            if helper is not None:
                if before is None:
                    os.environ.pop("DSEC_EXEC_HELPER", None)
                else:
                    os.environ["DSEC_EXEC_HELPER"] = before
    if rates["0"] and rates["1"]:
        ctx.record("rl_sandbox_env_exec_helper_speedup", sum(rates["1"]) / sum(rates["0"]),
                   "x", envs=n_envs, backend="container",
                   transport="SDK ClientAccess, aether, dsec up in a subprocess",
                   mode="pool: 1 exec batch per tick, helper / per-exec, 2 runs each "
                        "interleaved")
    ctx.note("rl_sandbox_env SDK rows: the trainer process holds the pool and a sync "
             "Client; `dsec up` (apiserver, gateway, one edge) runs in a child process on "
             "the same 2 cores. 'aether' sends a tick as one api.exec_many that the "
             "apiserver forwards as one edge.exec_many; 'http' has no batch route, so a "
             "tick is one REST call per env issued concurrently.")


@suite("rl", "RL toolkit: env steps/s, GAE transitions/s, buffer enqueue, sandbox env steps/s")
def run(ctx: BenchContext) -> None:
    env_steps(ctx)
    gae_rate(ctx)
    buffer_enqueue(ctx)
    sandbox_env(ctx)
    agent_figures(ctx)
