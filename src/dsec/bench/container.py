"""Benchmark suite ``container``: the native driver next to runc, in one run.

Figures: container_create p50/p99 (create -> exec-ready) and throughput at concurrency 16;
exec_roundtrip p50/p99 of ``true``; exec_throughput (``sh -c 'echo hi'`` with 64 execs in
flight over 8 sandboxes, the RL batched-exec pattern); density (N idle sandboxes, host
memory per sandbox, all answering an exec); pause_resume latency and reclaimed/resident.
Needs root.

Environment: ``DSEC_BENCH_CONTAINER_DIR`` is where backend roots go (default
``/var/tmp``: on disk, like a node's state dir - this VM's ``/tmp`` directory measured 5x
slower per mkdir than ``/var/tmp`` on the same ext4); ``DSEC_BENCH_DENSITY_N`` overrides
the density count (default 3,200 full, 100 quick).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time

from dsec import ownership
from dsec.bench import BenchContext, suite
from dsec.ids import NodeId, SandboxId, new_sandbox_id
from dsec.rmtree import remove_tree
from dsec.wire.spec import ExecRequest, SandboxSpec

__all__ = ["container_suite"]


def _pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def _meminfo_used() -> int:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            info[k] = int(v.split()[0]) * 1024
    return info["MemTotal"] - info["MemFree"] - info.get("Buffers", 0) - info.get("Cached", 0) \
        + info.get("Shmem", 0)


async def _run(ctx: BenchContext, work: str) -> None:
    from dsec.edge.backends.container import ContainerBackend, DirectoryImages
    from dsec.edge.backends.container.testimage import build_busybox_root

    images = os.path.join(work, "images")
    os.makedirs(images)
    build_busybox_root(os.path.join(images, "base"))
    spec = SandboxSpec(backend="container", memory_bytes=256 << 20, pids_max=256)
    node = NodeId("bench")
    n_create = ctx.scale(200, 30)
    n_exec = ctx.scale(300, 50)
    n_burst = ctx.scale(3000, 300)
    for runtime in ("native", "runc"):
        b = ContainerBackend(root_dir=os.path.join(work, runtime), runtime=runtime,
                             images=DirectoryImages(images),
                             # density: helpers of idle sandboxes go within the run
                             helper_idle_s=20.0,
                             # DSEC_BENCH_DENSITY_LAZY_DEVPTS=1: the opt-in third cut
                             # (docs/container.md, Density): no devpts until a pty exec
                             lazy_devpts=os.environ.get("DSEC_BENCH_DENSITY_LAZY_DEVPTS",
                                                        "0") == "1",
                             # DSEC_BENCH_DENSITY_MEMORY_GROUP=k: the opt-in isolation
                             # trade (docs/container.md, Memory groups): k sandboxes of
                             # a project per memory cgroup (the native driver only)
                             memory_group_size=int(os.environ.get(
                                 "DSEC_BENCH_DENSITY_MEMORY_GROUP") or 1)
                             if runtime == "native" else 1)
        try:
            warm = new_sandbox_id(node)
            await b.create(warm, spec)
            await b.exec(warm, ExecRequest(argv=("true",)))
            await b.destroy(warm)
            n = n_create if runtime == "native" else max(10, n_create // 4)
            lat = []
            for _ in range(n):
                sid = new_sandbox_id(node)
                t0 = time.perf_counter()
                await b.create(sid, spec)
                lat.append(time.perf_counter() - t0)
                await b.destroy(sid)
            ctx.record("container_create_p50", _pct(lat, 50) * 1e3, "ms", runtime=runtime, n=n)
            ctx.record("container_create_p99", _pct(lat, 99) * 1e3, "ms", runtime=runtime, n=n)
            # throughput at concurrency 16
            total = n if runtime == "native" else max(16, n)
            sids = [new_sandbox_id(node) for _ in range(total)]
            sem = asyncio.Semaphore(16)

            async def one(sid: SandboxId, sem: asyncio.Semaphore,
                          b: ContainerBackend) -> None:
                async with sem:
                    await b.create(sid, spec)
            t0 = time.perf_counter()
            await asyncio.gather(*(one(s, sem, b) for s in sids))
            dt = time.perf_counter() - t0
            ctx.record("container_create_throughput", total / dt, "creates/s", runtime=runtime,
                       concurrency=16, n=total)
            for s in sids:
                await b.destroy(s)
            # exec roundtrip of `true`
            sid = new_sandbox_id(node)
            await b.create(sid, spec)
            ne = n_exec if runtime == "native" else max(10, n_exec // 5)
            lat = []
            for _ in range(ne):
                t0 = time.perf_counter()
                await b.exec(sid, ExecRequest(argv=("true",)))
                lat.append(time.perf_counter() - t0)
            ctx.record("exec_roundtrip_p50", _pct(lat, 50) * 1e3, "ms", runtime=runtime, n=ne)
            ctx.record("exec_roundtrip_p99", _pct(lat, 99) * 1e3, "ms", runtime=runtime, n=ne)
            if runtime == "native":
                await _exec_burst(ctx, b, spec, node, n_burst)
            # pause / resume
            await b.exec(sid, ExecRequest(shell="head -c 32m /dev/urandom > /tmp/blob; "
                                                "sleep 1000", background=True))
            await asyncio.sleep(1.0)
            t0 = time.perf_counter()
            st = await b.pause(sid)
            t_pause = time.perf_counter() - t0
            t0 = time.perf_counter()
            await b.resume(sid)
            t_resume = time.perf_counter() - t0
            ctx.record("pause_latency", t_pause * 1e3, "ms", runtime=runtime)
            ctx.record("resume_latency", t_resume * 1e3, "ms", runtime=runtime)
            ctx.record("pause_reclaimed_fraction",
                       st.reclaimed_bytes / max(1, st.resident_before_bytes), "ratio",
                       runtime=runtime, resident_before_mib=round(st.resident_before_bytes / 2**20, 1))
            await b.destroy(sid)
            if runtime == "native":
                await _density(ctx, b, spec, node)
        finally:
            # Every sandbox goes, whatever failed above: one failed destroy must not stop
            # the others (it used to end the loop and leave the rest running), and
            # reconcile removes what a failed destroy left.
            for left in b.sandbox_ids():
                try:
                    await b.destroy(SandboxId(left))
                except Exception as exc:  # noqa: BLE001 - reconcile below takes it
                    ctx.note(f"destroy of {left} failed: {exc}")
            try:
                await b.reconcile(set())
            finally:
                gov = b.governor
                await b.close()
                gov.remove_base()


def _cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def _exec_burst(ctx: BenchContext, b: object, spec: SandboxSpec, node: NodeId,
                      n: int) -> None:
    """64 execs in flight over 8 sandboxes: the batched-exec pattern of RL rollouts."""
    import resource

    from dsec.edge.backends.container import ContainerBackend

    assert isinstance(b, ContainerBackend)
    sids = [new_sandbox_id(node) for _ in range(8)]
    for s in sids:
        await b.create(s, spec)
    sem = asyncio.Semaphore(64)
    bad = 0

    async def one(k: int) -> None:
        nonlocal bad
        async with sem:
            r = await b.exec(sids[k % len(sids)], ExecRequest(shell="echo hi"))
            bad += r.stdout != b"hi\n"
    zpid = b._zygote.pid
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    z0 = _cpu_s(zpid) if zpid else 0.0
    t0 = time.perf_counter()
    await asyncio.gather(*(one(k) for k in range(n)))
    dt = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    edge_us = ((ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)) / n * 1e6
    zyg_us = ((_cpu_s(zpid) if zpid else 0.0) - z0) / n * 1e6
    ctx.record("exec_throughput", n / dt, "execs/s", runtime="native", in_flight=64,
               sandboxes=len(sids), n=n, failed=bad, edge_cpu_us=round(edge_us),
               zygote_cpu_us=round(zyg_us))
    for s in sids:
        await b.destroy(s)


def _kernel_sum(k1: dict[str, int], k0: dict[str, int], m: int) -> float:
    """Unreclaimable kernel memory per sandbox between two readings (KiB): SUnreclaim +
    Percpu + KernelStack + PageTables - what other work on a shared machine moves least
    (MemUsed swings by hundreds of KiB per sandbox between runs there)."""
    return round(sum(k1[k] - k0[k] for k in ("SUnreclaim", "Percpu", "KernelStack",
                                              "PageTables")) / m, 1)


def _kernel_kib() -> dict[str, int]:
    """The /proc/meminfo fields of kernel memory no cgroup of a sandbox is charged for in
    full (KiB): slab (SUnreclaim: namespaces, cgroups, superblocks, ...), per-cpu
    allocations, kernel stacks and page tables."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            info[k] = int(v.split()[0])
    return {k: info.get(k, 0) for k in ("Slab", "SUnreclaim", "Percpu", "KernelStack",
                                          "PageTables", "MemAvailable")}


def _superblocks(b: object) -> int:
    """Superblocks each (loopback-only, no user namespace) sandbox of ``b`` adds to the
    host: what the per-memcg shrinker map grows with (docs/container.md, Density)."""
    from dsec.edge.backends.container.density import SUPERBLOCKS_PER_SANDBOX
    # a memory group's member has a tmpfs of its own (its cap), not the shared scratch
    grouped = getattr(b, "memory_group_size", 1) > 1
    return SUPERBLOCKS_PER_SANDBOX - sum(bool(getattr(b, k, False)) for k in (
        "shared_sysfs", "shared_scratch", "lazy_devpts")) + int(
        grouped and bool(getattr(b, "shared_scratch", False)))


async def _density(ctx: BenchContext, b: object, spec: SandboxSpec, node: NodeId) -> None:
    """N idle sandboxes, each answering an exec; host memory per sandbox (MemUsed delta,
    which includes the kernel's: slab, per-cpu, stacks, page tables) next to what their
    cgroups are charged; create and destroy rates; 0 errors expected. Whatever happens,
    every sandbox it made is destroyed (then reconcile removes anything a failed destroy
    left): a failed 10,000 run once left 9,997 running."""
    from dsec.edge.backends.container import ContainerBackend

    assert isinstance(b, ContainerBackend)
    n = int(os.environ.get("DSEC_BENCH_DENSITY_N") or ctx.scale(3200, 100))
    zpid = b._zygote.pid
    rss0 = _rss(os.getpid()) + (_rss(zpid) if zpid else 0)
    before = _meminfo_used()
    k0 = _kernel_kib()
    sids = [new_sandbox_id(node) for _ in range(n)]
    made: list[SandboxId] = []
    errors: dict[str, int] = {"create": 0, "exec": 0, "destroy": 0}
    first: dict[str, str] = {}

    def fail(what: str, exc: BaseException) -> None:
        errors[what] += 1
        first.setdefault(what, f"{type(exc).__name__}: {exc}")

    sem = asyncio.Semaphore(16)
    load0 = os.getloadavg()

    # A guard for the shared machine: stop creating (and say so) before the host runs
    # short of memory - this is kernel memory, nothing reclaims it, and the OOM killer
    # would pick other people's processes.
    floor_kib = int(os.environ.get("DSEC_BENCH_DENSITY_MIN_AVAILABLE_MIB") or 2048) * 1024
    low: list[int] = []

    async def one(sid: SandboxId) -> None:
        async with sem:
            if low or (len(made) % 64 == 0 and _kernel_kib()["MemAvailable"] < floor_kib):
                low.append(len(made))
                return
            try:
                await b.create(sid, spec)
                made.append(sid)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                fail("create", exc)
    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(s) for s in sids))
        t_create = time.perf_counter() - t0
        # Idle first: what N sandboxes that have done nothing yet cost the host. An exec
        # starts the sandbox's exec helper (a process that stays for the next execs, up
        # to max_exec_helpers of them), so the memory after the exec pass is recorded
        # apart (density_host_memory_after_exec_per_sandbox).
        await asyncio.sleep(1.0)
        used = _meminfo_used() - before
        k1 = _kernel_kib()
        rss = _rss(os.getpid()) + (_rss(zpid) if zpid else 0) - rss0
        cg = est = 0
        for s in made:
            st = await b.stats(s)
            # (a memory group's figures are the group's: a member's share counted once)
            cg += st.memory_bytes // max(1, st.memory_group_members)
            est += st.memory_host_bytes
        m = max(1, len(made))
        kern = {k: (k1[k] - k0[k]) / m for k in k1}
        # ... then every sandbox answers an exec, 16 in flight (the "all answering")
        lat: list[float] = []
        ok = 0

        async def answer(sid: SandboxId) -> None:
            nonlocal ok
            async with sem:
                t = time.perf_counter()
                try:
                    r = await b.exec(sid, ExecRequest(argv=("true",)))
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    fail("exec", exc)
                    return
                lat.append(time.perf_counter() - t)
                ok += r.exit_code == 0
        t0 = time.perf_counter()
        await asyncio.gather(*(answer(s) for s in made))
        t_exec = time.perf_counter() - t0
        await asyncio.sleep(1.0)
        used_x = _meminfo_used() - before
        k2 = _kernel_kib()
        ctx.record("density_sandboxes", len(made), "sandboxes", n=n, answering=ok,
                   superblocks_per_sandbox=_superblocks(b),
                   memory_group_size=b.memory_group_size,
                   create_errors=errors["create"], exec_errors=errors["exec"],
                   create_s=round(t_create, 2), creates_per_s=round(len(made) / t_create, 1),
                   stopped_at_low_memory=low[0] if low else None,
                   load_avg_1m=round(os.getloadavg()[0], 2), load_avg_1m_before=round(load0[0], 2))
        ctx.record("density_answering", ok, "sandboxes", n=n, made=len(made),
                   exec_errors=errors["exec"], concurrency=16,
                   execs_per_s=round(len(made) / max(t_exec, 1e-9), 1),
                   exec_p50_ms=round(_pct(lat, 50) * 1e3, 2) if lat else None,
                   exec_p99_ms=round(_pct(lat, 99) * 1e3, 2) if lat else None)
        ctx.record("density_host_memory_per_sandbox", used / m / 1024, "KiB", n=n,
                   memory_group_size=b.memory_group_size,
                   slab_kib=round(kern["Slab"], 1), unreclaimable_slab_kib=round(kern["SUnreclaim"], 1),
                   percpu_kib=round(kern["Percpu"], 1),
                   kernel_stack_kib=round(kern["KernelStack"], 1),
                   page_tables_kib=round(kern["PageTables"], 1),
                   mem_available_drop_kib=round(-kern["MemAvailable"], 1),
                   kernel_kib=_kernel_sum(k1, k0, m),
                   cgroup_charged_kib=round(cg / m / 1024, 1),
                   stats_memory_host_kib=round(est / m / 1024, 1),
                   edge_and_zygote_rss_kib=round(rss / m / 1024, 1),
                   how="host MemUsed delta with every sandbox created and idle, before the "
                       "exec pass (includes kernel memory: slab, per-cpu, stacks, page "
                       "tables; noisy: other work on the machine counts); the kernel parts "
                       "are broken out")
        ctx.record("density_host_memory_after_exec_per_sandbox", used_x / m / 1024, "KiB",
                   n=n, helpers=len(b._helpers), kernel_kib=_kernel_sum(k2, k0, m),
                   unreclaimable_slab_kib=round((k2["SUnreclaim"] - k0["SUnreclaim"]) / m, 1),
                   how="as density_host_memory_per_sandbox, after every sandbox answered an "
                       "exec: includes the exec helpers that exec started (at most "
                       "max_exec_helpers)")
        idle_s = b.helper_idle_s
        if idle_s is not None and idle_s <= 120 and b.limits_poll_s is not None:
            # ... and once the exec helpers are retired (idle sandboxes again)
            deadline = time.perf_counter() + idle_s + b.limits_poll_s * 2 + 30
            await asyncio.sleep(idle_s + b.limits_poll_s)
            while b._helpers and time.perf_counter() < deadline:
                await asyncio.sleep(0.5)
            await asyncio.sleep(1.0)
            k3 = _kernel_kib()
            ctx.record("density_host_memory_after_idle_per_sandbox",
                       (_meminfo_used() - before) / m / 1024, "KiB", n=n,
                       helpers_left=len(b._helpers), helper_idle_s=idle_s,
                       kernel_kib=_kernel_sum(k3, k0, m),
                       unreclaimable_slab_kib=round((k3["SUnreclaim"] - k0["SUnreclaim"]) / m, 1),
                       how="as density_host_memory_per_sandbox, after the exec pass and "
                           "helper_idle_s: the exec helpers retired")
        ctx.record("density_accounted_memory_per_sandbox", (cg + rss) / m / 1024, "KiB", n=n,
                   cgroup_kib=round(cg / m / 1024), edge_and_zygote_rss_kib=round(rss / m / 1024),
                   how="sandbox cgroup usage (what the memcg is charged) + edge/zygote RSS "
                       "growth; the kernel's memory outside the memcg is not in it")
    finally:
        t0 = time.perf_counter()
        dsem = asyncio.Semaphore(8)   # the kill waits and the kernel's teardown overlap

        async def gone(sid: SandboxId) -> None:
            async with dsem:
                try:
                    await b.destroy(sid)
                except Exception as exc:  # noqa: BLE001 - counted, and reconcile below
                    fail("destroy", exc)
        await asyncio.gather(*(gone(s) for s in made))
        dt = time.perf_counter() - t0
        left = await b.reconcile(set())    # whatever a failed destroy left (processes first)
        census = b.census()
        ctx.record("density_destroy_rate", len(made) / max(dt, 1e-9), "destroys/s", n=n,
                   concurrency=8,
                   destroyed=len(made), destroy_errors=errors["destroy"],
                   leftovers_reconciled=len(left), host_traces_after=len(census.sandboxes()),
                   **{f"first_{k}_error": v[:300] for k, v in first.items()})
    if any(errors.values()):
        raise RuntimeError(f"density run: {errors} errors (first: {first})")


async def _sweep_dead_runs(ctx: BenchContext, base: str) -> None:
    """A run killed with -9 leaves its sandboxes running (nothing of it runs to clean
    up): the next run removes every sandbox of a run whose owner process is gone (its
    ``.owner`` record, dsec.ownership), through the backend's reconcile (processes
    first), then the directory."""
    from dsec.edge.backends.container import ContainerBackend, DirectoryImages

    for name in sorted(os.listdir(base)):
        work = os.path.join(base, name)
        if not name.startswith("dsec-bench-container-") or name.endswith(ownership.SUFFIX) \
                or ownership.owner_alive(work) is not False:
            continue
        for runtime in ("native", "runc"):
            root = os.path.join(work, runtime)
            if not os.path.isdir(root):
                continue
            b = ContainerBackend(root_dir=root, runtime=runtime,
                                 images=DirectoryImages(os.path.join(work, "images")))
            try:
                left = await b.reconcile(set())
                ctx.note(f"removed {len(left)} sandboxes a killed run left in {root}")
            finally:
                gov = b.governor
                await b.close()
                gov.remove_base()
        remove_tree(work)
        ownership.disown(work)


@suite("container")
def container_suite(ctx: BenchContext) -> None:
    """Container backend: native vs runc create/exec, density, pause/resume."""
    if os.geteuid() != 0:
        ctx.note("skipped: needs root")
        return
    base = os.environ.get("DSEC_BENCH_CONTAINER_DIR") or "/var/tmp"
    asyncio.run(_sweep_dead_runs(ctx, base))
    work = tempfile.mkdtemp(prefix="dsec-bench-container-", dir=base)
    ownership.claim(work)
    try:
        asyncio.run(_run(ctx, work))
    finally:
        remove_tree(work)
        ownership.disown(work)
    ctx.note("Native create/exec: the edge sends one SEQPACKET message to dsec-nsexec serve "
             "(a static C zygote), which switches its pid namespace for children, fork()s, and "
             "the child joins cgroups, enters/creates namespaces, builds the root, drops caps, "
             "loads the precompiled seccomp BPF and execs. On this PVM-virtualised 2-core VM "
             "one execve+exit of a static binary costs ~350-450 us of CPU (page-table work), "
             "which bounds exec_throughput together with ~160 us of edge Python per exec. "
             "exec_throughput CPU params are per exec (edge = this process, zygote = the C "
             "server incl. its forks). Density memory: host MemUsed delta is noisy (other "
             "work on the shared VM); 'accounted' sums the sandbox cgroups' usage (kernel "
             "memory of the netns, mounts, page tables and the init) and the edge/zygote RSS "
             "growth.")
