"""Suite ``qos``: latency-sensitive step latency under best-effort CPU load, QoS on vs off
(issue 22, the shape of DSec's QoS experiment).

LS sandboxes (one per core, 1 core each) each run a loop of agent-like steps: one exec of
a fixed shell computation per step, timed end to end (p50/p99). Beside them BE sandboxes
(one per core) each run a CPU-saturating spinner capped at ``be_load`` of a core
(``cpu_quota_milli``), so the BE demand is ``be_load`` x the node's cores of *extra*
load: 0, 10 %, 30 %, 50 %. Each level runs twice in the same run, interleaved: QoS off
(the BE sandboxes are ordinary "ls" sandboxes, the weight of their request) and QoS on
(class "be": SCHED_IDLE, cpu.shares=2 + cpu.idle). Figures:

* ``qos_ls_p99_inflation`` (params ``be_load``, ``qos``): loaded LS p99 / unloaded LS p99
  of the same mode;
* ``qos_be_throughput_ratio``: BE work rate (CPU-seconds per second of the LS window)
  with QoS on / off (per level, and the 0.5 level without a ``be_load`` param as the
  headline);
* ``qos_ls_step_p50_ms`` / ``qos_ls_step_p99_ms`` per level and mode.

**Memory half** (``qos_ls_p99_inflation_mem``, params ``qos``): the sandboxes' parent
memory cgroup is capped (``mem_limit``, 512 MiB) so the experiment presses this edge's
sandboxes, not the shared host; BE sandboxes (one per core) each hold a tmpfs file
(``be_mem``, 320 MiB each: together more than the cap) and re-read it every second, so
the parent cgroup reclaims into (zram) swap without pause. LS step p99 is measured after
a settle time, with the BE sandboxes ordinary "ls" ones (off) or class "be" with the
node's memory-pressure policy running (on: :class:`dsec.edge.qos.PressureDriver` with
its default thresholds, PSI read from a cgroup v2 directory holding only this bench's
processes when the host has one, else ``/proc/pressure/memory``), against the same LS
loop with no BE sandbox at all.

A plot of p99 vs BE load (on/off) is written as SVG (no matplotlib in the venv: drawn by
hand) to ``$DSEC_BENCH_QOS_PLOT`` (default ``bench-qos-p99.svg`` beside the results
JSON, ``dsec bench --json``). The machine is shared: ratios within one run
are what count; the load average at start and end is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from dsec.bench import BenchContext, suite
from dsec.edge.qos import Psi, read_psi
from dsec.ids import NodeId, SandboxId, new_sandbox_id
from dsec.rmtree import remove_tree
from dsec.wire.spec import ExecRequest, SandboxSpec

LEVELS = (0.0, 0.1, 0.3, 0.5)
#: one agent step: a fixed amount of shell arithmetic (~5-10 ms of CPU here)
STEP = "i=0; while [ $i -lt 4000 ]; do i=$((i+1)); done"
SPIN = "while :; do :; done"


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


async def _level(b: object, ls: list[str], load: float, qos: str, steps: int,
                 cores: int) -> tuple[list[float], float]:
    """LS step latencies (s) and the BE sandboxes' CPU rate (cores) while they ran."""
    from dsec.edge.backends.container import ContainerBackend
    assert isinstance(b, ContainerBackend)
    be: list[SandboxId] = []
    try:
        if load > 0:
            for _ in range(cores):
                sid = new_sandbox_id(NodeId("qos"))
                spec = SandboxSpec(backend="container", memory_bytes=64 << 20, pids_max=64,
                                   cpu_milli=round(load * 1000),
                                   qos="be" if qos == "on" else "ls")
                await b.create(sid, spec)
                be.append(sid)
                await b.exec(sid, ExecRequest(shell=SPIN, background=True))
            await asyncio.sleep(0.5)   # spinners up
        cpu0 = sum([(await b.stats(s)).cpu_seconds for s in be])
        t0 = time.perf_counter()
        lat: list[float] = []

        async def loop(sid: str) -> None:
            for _ in range(steps):
                t0 = time.perf_counter()
                r = await b.exec(SandboxId(sid), ExecRequest(shell=STEP))
                lat.append(time.perf_counter() - t0)
                assert r.exit_code == 0, r
        await asyncio.gather(*(loop(s) for s in ls))
        cpu1 = sum([(await b.stats(s)).cpu_seconds for s in be])
        return lat, (cpu1 - cpu0) / (time.perf_counter() - t0)
    finally:
        for s in be:
            await b.destroy(s)


async def _run(ctx: BenchContext, work: str) -> str:
    """Runs the experiment, records the figures, returns the plot (SVG text)."""
    from dsec.edge.backends.container import ContainerBackend, DirectoryImages
    from dsec.edge.backends.container.testimage import build_busybox_root
    from dsec.edge.qos import qos_features

    images = os.path.join(work, "images")
    build_busybox_root(os.path.join(images, "base"))
    psi_path = _own_psi_cgroup(work)   # before the backend: the zygote inherits it
    b = ContainerBackend(root_dir=os.path.join(work, "root"), images=DirectoryImages(images))
    cores = os.cpu_count() or 1
    steps = ctx.scale(200, 40)
    load0 = _loadavg()
    ls: list[str] = []
    try:
        for _ in range(cores):
            sid = new_sandbox_id(NodeId("qos"))
            await b.create(sid, SandboxSpec(backend="container", memory_bytes=64 << 20,
                                            pids_max=64, cpu_milli=1000, qos="ls"))
            ls.append(sid)
            for _ in range(5):   # warm: the exec helper up, the image's pages cached
                await b.exec(sid, ExecRequest(shell=STEP))
        p99: dict[tuple[float, str], float] = {}
        be_cpu: dict[tuple[float, str], float] = {}
        for load in LEVELS:
            for qos in ("off", "on"):
                lat, cpu = await _level(b, ls, load, qos, steps, cores)
                p99[load, qos] = _pct(lat, 0.99)
                be_cpu[load, qos] = cpu
                ctx.record("qos_ls_step_p50_ms", statistics.median(lat) * 1e3, "ms",
                           be_load=load, qos=qos, steps=len(lat))
                ctx.record("qos_ls_step_p99_ms", p99[load, qos] * 1e3, "ms",
                           be_load=load, qos=qos, steps=len(lat))
                if load > 0:
                    ctx.record("qos_be_cpu_cores", cpu, "cores", be_load=load, qos=qos)
        for load in LEVELS[1:]:
            for qos in ("off", "on"):
                ctx.record("qos_ls_p99_inflation", p99[load, qos] / p99[0.0, qos], "x",
                           be_load=load, qos=qos)
            if be_cpu[load, "off"] > 0:
                ctx.record("qos_be_throughput_ratio", be_cpu[load, "on"] / be_cpu[load, "off"],
                           "x", be_load=load)
        if be_cpu[0.5, "off"] > 0:
            ctx.record("qos_be_throughput_ratio", be_cpu[0.5, "on"] / be_cpu[0.5, "off"], "x")
        await _memory_half(ctx, b, ls, steps, cores, psi_path)
        load1 = _loadavg()
        ctx.record("qos_load_average", (load0 + load1) / 2, "load", start=load0, end=load1,
                   cores=cores)
        feats = qos_features()
        ctx.note(f"QoS bench: {cores} LS sandboxes x {steps} steps per level, {cores} BE "
                 f"spinners capped at be_load of a core each; host load average {load0:.1f} "
                 f"at start, {load1:.1f} at end (a shared machine: compare on/off within the "
                 f"run); kernel: {feats}")
        return svg_plot({q: [(lv, p99[lv, q] * 1e3) for lv in LEVELS]
                         for q in ("off", "on")})
    finally:
        for s in list(b.sandbox_ids()):
            await b.destroy(SandboxId(s))
        gov = b.governor
        await b.close()
        gov.remove_base()
        _leave_psi_cgroup(psi_path)


#: memory half: the cap on all the bench's sandboxes together, each BE sandbox's
#: working set (a tmpfs file re-read every second), and how long the node gets to react
MEM_LIMIT = 512 << 20
BE_MEM = 320 << 20
MEM_SETTLE_S = 14.0
FILL = ("head -c {mib}m /dev/zero > /tmp/ws; "
        "while :; do cat /tmp/ws > /dev/null; sleep 1; done")


async def _mem_cell(ctx: BenchContext, b: object, ls: list[str], steps: int, cores: int,
                    qos: str, psi: Callable[[], Psi | None]) -> float:
    """One memory-pressure cell: BE fillers up, ``MEM_SETTLE_S`` for the node to react
    (QoS on: the pressure driver ticking every second), then the LS window; returns its
    p99 (s). The BE sandboxes are destroyed whatever happens."""
    from dsec.edge.backends.container import ContainerBackend
    from dsec.edge.qos import PressureDriver, QosView
    assert isinstance(b, ContainerBackend)
    be: list[SandboxId] = []
    started: dict[str, float] = {}
    notes: list[str] = []
    driver_task = None

    def views() -> list[QosView]:
        return [QosView(s, "be", "paused" if b.box(s).paused else "running", started[s],
                        BE_MEM) for s in be]

    async def pause(sid: str) -> None:
        await b.pause(SandboxId(sid))

    async def ticking(driver: PressureDriver) -> None:
        while True:
            await driver.tick()
            await asyncio.sleep(1.0)
    try:
        for _ in range(cores):
            sid = new_sandbox_id(NodeId("qos"))
            await b.create(sid, SandboxSpec(
                backend="container", memory_bytes=BE_MEM + (64 << 20), pids_max=64,
                cpu_milli=500, qos="be" if qos == "on" else "ls"))
            be.append(sid)
            await b.exec(sid, ExecRequest(shell=FILL.format(mib=BE_MEM >> 20),
                                          background=True))
            started[sid] = time.monotonic()
        if qos == "on":
            driver_task = asyncio.create_task(ticking(PressureDriver(
                read=psi, views=views, pause=pause,
                notify=lambda s, why: notes.append(f"{s}: {why}"), clock=time.monotonic)))
        await asyncio.sleep(MEM_SETTLE_S)
        psi0 = psi()
        lat = await _ls_window(b, ls, steps)
        psi1 = psi()
        paused = sum(b.box(s).paused for s in be)
        used = sum([(await b.stats(s)).memory_bytes for s in be])
        ctx.record("qos_ls_step_p99_mem_ms", _pct(lat, 0.99) * 1e3, "ms", qos=qos,
                   be_mem_mib=len(be) * (BE_MEM >> 20), mem_limit_mib=MEM_LIMIT >> 20,
                   steps=len(lat), p50_ms=round(statistics.median(lat) * 1e3, 2),
                   psi_some_avg10_before=psi0.some_avg10 if psi0 else None,
                   psi_some_avg10_after=psi1.some_avg10 if psi1 else None,
                   psi_full_avg10_after=psi1.full_avg10 if psi1 else None,
                   be_paused=paused, be_resident_mib=round(used / 2**20, 1))
        if notes:
            ctx.note(f"memory half, QoS on: {notes[0]}")
        return _pct(lat, 0.99)
    finally:
        if driver_task is not None:
            driver_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await driver_task
        for s in be:
            await b.destroy(s)


def _own_psi_cgroup(work: str) -> str | None:
    """Move this process into a cgroup v2 directory of its own (hybrid hosts: the v2
    mount holds no controller, only PSI accounting) and return its ``memory.pressure``:
    the sandboxes (children of our zygote) inherit it, so the pressure read there is the
    bench's and not the shared host's. None where there is no such v2 mount."""
    try:
        with open("/proc/self/mountinfo") as f:
            v2 = next((line.split(" - ")[0].split()[4] for line in f
                       if " - cgroup2 " in line), None)
        with open("/proc/self/cgroup") as f:
            own = next((line.strip().split(":", 2)[2] for line in f
                        if line.startswith("0::")), None)
    except OSError:
        return None
    if v2 is None or own is None:
        return None
    parent = os.path.join(v2, own.lstrip("/"))
    try:
        with open(os.path.join(parent, "cgroup.controllers")) as f:
            if "memory" in f.read().split():
                return None   # a real v2 host: the governor owns this tree
        d = os.path.join(parent, f"dsec-bench-qos-{os.getpid()}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    except OSError:
        return None
    path = os.path.join(d, "memory.pressure")
    return path if os.path.exists(path) else None


def _leave_psi_cgroup(psi_path: str | None) -> None:
    if psi_path is None:
        return
    d = os.path.dirname(psi_path)
    try:
        with open(os.path.join(os.path.dirname(d), "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        os.rmdir(d)
    except OSError:
        pass


async def _ls_window(b: object, ls: list[str], steps: int) -> list[float]:
    from dsec.edge.backends.container import ContainerBackend
    assert isinstance(b, ContainerBackend)
    lat: list[float] = []

    async def loop(sid: str) -> None:
        for _ in range(steps):
            t0 = time.perf_counter()
            r = await b.exec(SandboxId(sid), ExecRequest(shell=STEP))
            lat.append(time.perf_counter() - t0)
            assert r.exit_code == 0, r
    await asyncio.gather(*(loop(s) for s in ls))
    return lat


async def _memory_half(ctx: BenchContext, b: object, ls: list[str], steps: int,
                       cores: int, psi_path: str | None) -> None:
    """LS step p99 while BE sandboxes keep the sandboxes' (capped) memory under pressure,
    QoS off and on (see the module docstring)."""
    from dsec.edge.backends.container import ContainerBackend
    from dsec.edge.qos import parse_psi
    assert isinstance(b, ContainerBackend)

    def psi() -> Psi | None:
        if psi_path is None:
            return read_psi()
        with open(psi_path) as f:
            return parse_psi(f.read())
    ctx.note("memory half: PSI read from " + (
        f"{psi_path} (this bench's processes only)" if psi_path else
        "/proc/pressure/memory (the whole host: no cgroup v2 directory of its own)"))
    b.governor.limit_total_memory(MEM_LIMIT)
    try:
        # unloaded: before and after the loaded cells (the machine is shared; the mean
        # of the two is the reference)
        base = [await _ls_window(b, ls, steps)]
        p99: dict[str, float] = {}
        for qos in ("off", "on"):
            p99[qos] = await _mem_cell(ctx, b, ls, steps, cores, qos, psi)
        base.append(await _ls_window(b, ls, steps))
        ref = sum(_pct(w, 0.99) for w in base) / 2
        ctx.record("qos_ls_step_p99_mem_ms", ref * 1e3, "ms", be_mem_mib=0,
                   steps=sum(map(len, base)),
                   p99_before_ms=round(_pct(base[0], 0.99) * 1e3, 2),
                   p99_after_ms=round(_pct(base[1], 0.99) * 1e3, 2),
                   p50_ms=round(statistics.median(base[0] + base[1]) * 1e3, 2))
        for qos in ("off", "on"):
            ctx.record("qos_ls_p99_inflation_mem", p99[qos] / ref, "x", qos=qos,
                       be_mem_mib=cores * (BE_MEM >> 20), mem_limit_mib=MEM_LIMIT >> 20)
    finally:
        b.governor.limit_total_memory(None)


def svg_plot(series: dict[str, list[tuple[float, float]]], *, width: int = 480,
             height: int = 300) -> str:
    """A line chart of LS p99 (ms) against BE load, one line per QoS mode (pure)."""
    left, right, top, bottom = 60, 20, 30, 45
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts]
    xmax = max(xs) or 1.0
    ymax = max(ys) * 1.1 or 1.0
    w, h = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + x / xmax * w

    def py(y: float) -> float:
        return top + h - y / ymax * h
    colors = {"off": "#d62728", "on": "#1f77b4"}
    out = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            'font-family="sans-serif" font-size="11">'),
           (f'<text x="{width / 2}" y="16" text-anchor="middle" font-size="13">'
            'LS step p99 vs best-effort load</text>'),
           f'<line x1="{left}" y1="{top + h}" x2="{left + w}" y2="{top + h}" stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + h}" stroke="black"/>',
           (f'<text x="{left + w / 2}" y="{height - 8}" text-anchor="middle">'
            'BE load (fraction of node cores)</text>'),
           (f'<text x="14" y="{top + h / 2}" text-anchor="middle" '
            f'transform="rotate(-90 14 {top + h / 2})">p99 step latency (ms)</text>')]
    for x in sorted(set(xs)):
        out.append(f'<text x="{px(x):.1f}" y="{top + h + 15}" text-anchor="middle">{x:g}</text>')
    for i in range(5):
        y = ymax * i / 4
        out.append(f'<text x="{left - 5}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.0f}</text>')
    for k, (name, pts) in enumerate(sorted(series.items())):
        c = colors.get(name, "#2ca02c")
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="{path}"/>')
        for x, y in pts:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{c}"/>')
        out.append(f'<text x="{left + 10}" y="{top + 12 + 14 * k}" fill="{c}">QoS {name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


@suite("qos")
def qos_suite(ctx: BenchContext) -> None:
    """QoS classes: LS step p99 under 0/10/30/50% best-effort CPU load, QoS on vs off."""
    if os.geteuid() != 0:
        ctx.note("skipped: needs root")
        return
    base = os.environ.get("DSEC_BENCH_CONTAINER_DIR") or "/var/tmp"
    work = tempfile.mkdtemp(prefix="dsec-bench-qos-", dir=base)
    try:
        svg = asyncio.run(_run(ctx, work))
    finally:
        remove_tree(work)
    path = os.environ.get("DSEC_BENCH_QOS_PLOT") or os.path.join(
        os.environ.get("DSEC_BENCH_OUT_DIR", "."), "bench-qos-p99.svg")
    with open(path, "w") as f:
        f.write(svg)
    ctx.note(f"plot of LS p99 vs BE load: {path}")

