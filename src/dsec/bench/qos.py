"""Suite ``qos``: latency-sensitive step latency under best-effort CPU load, QoS on vs off
(issue 22, the shape of DSec's QoS experiment).

LS sandboxes (one per core, 1 core each) each run agent-like steps, measured two ways:
an *exec step* (one exec of a fixed shell computation, ~5 ms of CPU, timed end to end by
the caller: the edge's exec path plus the work - what an agent waiting on a command
sees) and an *in-sandbox step* (a long-lived process inside, ``dsec-stepper`` compiled
from :data:`STEPPER_C`, sleeps 2 ms then does ~5 ms of fixed arithmetic and times that
itself: the sandbox's own CPU latency, no edge in it). Beside them BE sandboxes (one per
core) each run a CPU-saturating spinner capped at ``be_load`` of a core
(``cpu_milli``), so the BE demand is ``be_load`` x the node's cores of *extra* load:
0, 10 %, 30 %, 50 %.

Per level, both BE sets - QoS off (ordinary "ls" sandboxes, the weight of their request)
and QoS on (class "be": SCHED_IDLE processes in a ``cpu.idle`` cgroup under one idle
parent beside the sandboxes' parent, dsec.edge.governor.be_cpu_parent) - are created
once and frozen, and short windows with no BE, off's BE or on's BE thawed interleave in
shuffled rounds (:func:`window_order`): the shared host's load swings land on every mode
alike, and the unloaded reference is measured between the loaded windows. Figures:

* ``qos_ls_p99_inflation`` (params ``be_load``, ``qos``): exec-step p99 with that BE
  load / exec-step p99 of the same level's unloaded windows;
* ``qos_ls_p99_inflation_inside``: the same for the in-sandbox step;
* ``qos_be_throughput_ratio``: BE work rate (CPU-seconds per second of its windows)
  with QoS on / off (per level, and the 0.5 level without a ``be_load`` param as the
  headline);
* ``qos_ls_step_p50_ms`` / ``qos_ls_step_p99_ms`` and ``qos_ls_inside_p50_ms`` /
  ``qos_ls_inside_p99_ms`` per level and mode, ``qos_be_cpu_cores``;
* ``qos_be_suppression``: the BE suppression threshold the run had (0.65, the node's
  default; ``DSEC_BENCH_QOS_SUPPRESS=0`` turns it off, dsec.edge.qos.CpuSuppressor);
* with ``DSEC_BENCH_QOS_BESIDE=1`` (v1; a diagnostic, off by default: a fourth window
  per round), ``qos_ls_p99_inflation_be_beside_ls``: QoS on but the BE sandboxes' cpu
  cgroups moved beside the LS ones under the sandboxes' parent, the placement before the
  idle parent - both placements measured in one run.

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

A plot of p99 vs BE load (on/off; exec steps solid, in-sandbox steps dashed) is written as SVG (no matplotlib in the venv: drawn by
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


STEPPER_C = r"""
/* dsec qos bench: an agent step inside a sandbox, timed by the sandbox itself. Each of
   N steps sleeps THINK_US (the agent thinking), then does WORK iterations of fixed
   arithmetic and prints the step's own wall time in microseconds. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}
int main(int argc, char **argv) {
    if (argc != 4) return 2;
    int n = atoi(argv[1]), think = atoi(argv[3]);
    long work = atol(argv[2]);
    volatile unsigned long x = 0;
    for (int i = 0; i < n; i++) {
        usleep(think);
        double t0 = now();
        for (long k = 0; k < work; k++) x += k * k;
        printf("%.0f\n", now() - t0);
    }
    return 0;
}
"""
#: the in-sandbox step: ~5 ms of arithmetic on this VM's CPUs after 2 ms of "thinking"
STEPPER_WORK, STEPPER_THINK_US = 10_000_000, 2000


def build_stepper(image_root: str) -> bool:
    """Compile :data:`STEPPER_C` statically into ``<image_root>/bin/dsec-stepper`` with
    the C compiler the native driver already needs (nsexec); False where none is
    found (the in-sandbox figures are then left out, with a note)."""
    import shutil
    import subprocess

    cc = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if cc is None:
        return False
    with tempfile.TemporaryDirectory(prefix="dsec-stepper-") as tmp:
        src = os.path.join(tmp, "stepper.c")
        with open(src, "w") as f:
            f.write(STEPPER_C)
        out = os.path.join(image_root, "bin", "dsec-stepper")
        r = subprocess.run([cc, "-O1", "-static", "-o", out, src], capture_output=True,
                           check=False)
    return r.returncode == 0


def window_order(modes: tuple[str, ...], rounds: int, seed: int) -> list[str]:
    """The measurement windows of one level: ``rounds`` rounds, each with one window per
    mode in a shuffled order (pure). Interleaving short windows spreads the shared
    host's load swings over every mode alike; one long window per mode (the earlier
    design) let a neighbour's burst land on one mode and read as its inflation."""
    import random

    rng = random.Random(seed)
    out: list[str] = []
    for _ in range(rounds):
        order = list(modes)
        rng.shuffle(order)
        out += order
    return out


class _Window:
    """What one mode's windows of a level collected."""

    def __init__(self) -> None:
        self.exec_s: list[float] = []     # exec round trips (one agent step each)
        self.inside_s: list[float] = []   # in-sandbox step times
        self.be_cpu_s = 0.0               # CPU the BE sandboxes used in these windows
        self.wall_s = 0.0


async def _level(b: object, ls: list[str], load: float, rounds: int, k: int,
                 cores: int, stepper: bool, seed: int) -> dict[str, _Window]:
    """One BE load level: BE spinners for QoS off (class "ls", the weight of their
    request) and on (class "be") are created once and frozen; then windows of no BE,
    off's BE and on's BE running (thawed) interleave (:func:`window_order`). In each
    window every LS sandbox runs ``k`` exec steps and then, where the stepper is
    built, one exec of ``2k`` in-sandbox steps."""
    from dsec.edge.backends.container import ContainerBackend
    assert isinstance(b, ContainerBackend)
    gov = b.governor
    sets: dict[str, list[SandboxId]] = {"none": [], "off": [], "on": []}
    loaded = ["off", "on"]
    beside: list[str] = []   # the diagnostic mode's cpu cgroups, removed at the end
    if os.environ.get("DSEC_BENCH_QOS_BESIDE") == "1" and gov.layout.be_cpu:
        sets["beside"] = []
        loaded.append("beside")
    try:
        for qos in (loaded if load > 0 else ()):
            for _ in range(cores):
                sid = new_sandbox_id(NodeId("qos"))
                await b.create(sid, SandboxSpec(
                    backend="container", memory_bytes=64 << 20, pids_max=64,
                    cpu_milli=round(load * 1000), qos="ls" if qos == "off" else "be"))
                sets[qos].append(sid)
                await b.exec(sid, ExecRequest(shell=SPIN, background=True))
                if qos == "beside":
                    beside.append(_move_beside_ls(gov.layout.bases["cpu"],
                                                  b.box(sid).cg.dirs["cpu"], sid))
                gov.freeze(b.box(sid).cg)
        got = {m: _Window() for m in sets}

        async def steps(sid: str, w: _Window) -> None:
            for _ in range(k):
                t0 = time.perf_counter()
                r = await b.exec(SandboxId(sid), ExecRequest(shell=STEP))
                w.exec_s.append(time.perf_counter() - t0)
                assert r.exit_code == 0, r

        async def inside(sid: str, w: _Window) -> None:
            r = await b.exec(SandboxId(sid), ExecRequest(argv=(
                "/bin/dsec-stepper", str(2 * k), str(STEPPER_WORK), str(STEPPER_THINK_US))))
            assert r.exit_code == 0, r
            w.inside_s += [int(x) / 1e6 for x in r.stdout.split()]

        modes = ("none", *loaded) if load > 0 else ("none",)
        for mode in window_order(modes, rounds, seed):
            w = got[mode]
            for s in sets[mode]:
                gov.thaw(b.box(s).cg)
            await asyncio.sleep(0.05)   # spinners back on the CPU
            cpu0 = sum([(await b.stats(s)).cpu_seconds for s in sets[mode]])
            t0 = time.perf_counter()
            await asyncio.gather(*(steps(s, w) for s in ls))
            if stepper:
                await asyncio.gather(*(inside(s, w) for s in ls))
            w.wall_s += time.perf_counter() - t0
            w.be_cpu_s += sum([(await b.stats(s)).cpu_seconds for s in sets[mode]]) - cpu0
            for s in sets[mode]:
                gov.freeze(b.box(s).cg)
        return got
    finally:
        for ss in sets.values():
            for s in ss:
                with contextlib.suppress(Exception):
                    gov.thaw(b.box(s).cg)
                await b.destroy(s)
        for d in beside:
            with contextlib.suppress(OSError):
                os.rmdir(d)


def _move_beside_ls(cpu_base: str, cpu_dir: str, sid: str) -> str:
    """Diagnostic (``DSEC_BENCH_QOS_BESIDE=1``, v1): move a BE sandbox's tasks (its
    spinner already running) from its cpu cgroup under the idle parent to one made
    beside the LS sandboxes under the base - the placement before the idle parent
    (dsec.edge.governor.be_cpu_parent) - with the same class writes (lowest weight,
    ``cpu.idle``, its quota), so both placements are measured in one run."""
    d = os.path.join(cpu_base, f"{sid}-beside")
    os.mkdir(d)
    for f in ("cpu.shares", "cpu.cfs_quota_us", "cpu.idle"):   # shares before idle
        src = os.path.join(cpu_dir, f)
        if os.path.exists(src):
            with open(src) as r:
                val = r.read().strip()
            with open(os.path.join(d, f), "w") as w:
                w.write("2" if f == "cpu.shares" else val)
    with open(os.path.join(cpu_dir, "cgroup.procs")) as r:
        pids = r.read().split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError), \
                open(os.path.join(d, "cgroup.procs"), "w") as w:
            w.write(pid)
    return d


async def _run(ctx: BenchContext, work: str) -> str:
    """Runs the experiment, records the figures, returns the plot (SVG text)."""
    from dsec.edge.backends.container import ContainerBackend, DirectoryImages
    from dsec.edge.backends.container.testimage import build_busybox_root
    from dsec.edge.qos import qos_features

    images = os.path.join(work, "images")
    build_busybox_root(os.path.join(images, "base"))
    stepper = build_stepper(os.path.join(images, "base"))
    psi_path = _own_psi_cgroup(work)   # before the backend: the zygote inherits it
    # the node's BE suppression (qos.CpuSuppressor) as the product ships it;
    # DSEC_BENCH_QOS_SUPPRESS=0 runs without it, =0.8 with another threshold
    env = os.environ.get("DSEC_BENCH_QOS_SUPPRESS")
    suppress = 0.65 if not env else float(env)
    b = ContainerBackend(root_dir=os.path.join(work, "root"), images=DirectoryImages(images),
                         be_cpu_threshold=suppress)
    cores = os.cpu_count() or 1
    rounds, k = ctx.scale(20, 5), 10
    steps = ctx.scale(200, 40)   # the memory half's LS window
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
        p99_in: dict[tuple[float, str], float] = {}
        ref: dict[float, tuple[float, float]] = {}
        for i, load in enumerate(LEVELS):
            la = _loadavg()
            got = await _level(b, ls, load, rounds, k, cores, stepper, seed=i)
            base = got["none"]
            ref[load] = (_pct(base.exec_s, 0.99),
                         _pct(base.inside_s, 0.99) if base.inside_s else 0.0)
            for qos in ("off", "on"):
                w = got[qos] if load > 0 else base
                p99[load, qos] = _pct(w.exec_s, 0.99)
                common = {"be_load": load, "qos": qos, "steps": len(w.exec_s),
                          "load_average": la}
                ctx.record("qos_ls_step_p50_ms", statistics.median(w.exec_s) * 1e3, "ms",
                           **common)
                ctx.record("qos_ls_step_p99_ms", p99[load, qos] * 1e3, "ms", **common)
                if w.inside_s:
                    p99_in[load, qos] = _pct(w.inside_s, 0.99)
                    common["steps"] = len(w.inside_s)
                    ctx.record("qos_ls_inside_p50_ms", statistics.median(w.inside_s) * 1e3,
                               "ms", **common)
                    ctx.record("qos_ls_inside_p99_ms", p99_in[load, qos] * 1e3, "ms",
                               **common)
                if load == 0:
                    continue
                ctx.record("qos_ls_p99_inflation", p99[load, qos] / ref[load][0], "x",
                           be_load=load, qos=qos, unloaded_p99_ms=round(ref[load][0] * 1e3, 2),
                           load_average=la)
                if w.inside_s and ref[load][1] > 0:
                    ctx.record("qos_ls_p99_inflation_inside", p99_in[load, qos] / ref[load][1],
                               "x", be_load=load, qos=qos,
                               unloaded_p99_ms=round(ref[load][1] * 1e3, 2))
                ctx.record("qos_be_cpu_cores", w.be_cpu_s / w.wall_s, "cores",
                           be_load=load, qos=qos)
            if load > 0 and "beside" in got:
                w = got["beside"]
                ctx.record("qos_ls_p99_inflation_be_beside_ls",
                           _pct(w.exec_s, 0.99) / ref[load][0], "x", be_load=load,
                           inside=round(_pct(w.inside_s, 0.99) / ref[load][1], 3)
                           if w.inside_s and ref[load][1] > 0 else None,
                           be_cpu_cores=round(w.be_cpu_s / w.wall_s, 3))
            if load > 0 and got["off"].be_cpu_s > 0:
                ratio = (got["on"].be_cpu_s / got["on"].wall_s) / (
                    got["off"].be_cpu_s / got["off"].wall_s)
                ctx.record("qos_be_throughput_ratio", ratio, "x", be_load=load)
                if load == LEVELS[-1]:
                    ctx.record("qos_be_throughput_ratio", ratio, "x")
        if not stepper:
            ctx.note("no C compiler: the in-sandbox step figures (qos_ls_inside_*) are "
                     "left out")
        await _memory_half(ctx, b, ls, steps, cores, psi_path)
        load1 = _loadavg()
        ctx.record("qos_load_average", (load0 + load1) / 2, "load", start=load0, end=load1,
                   cores=cores)
        feats = qos_features()
        ctx.record("qos_be_suppression", suppress, "threshold",
                   env="DSEC_BENCH_QOS_SUPPRESS")
        ctx.note(f"QoS bench: {cores} LS sandboxes; per BE level {rounds} rounds of "
                 f"interleaved windows (no BE / QoS off / QoS on), {k} exec steps per LS "
                 f"sandbox per window; {cores} BE spinners capped at be_load of a core "
                 f"each; host load average {load0:.1f} at start, {load1:.1f} at end (a "
                 f"shared machine: compare on/off within the run); kernel: {feats}")
        series = {q: [(lv, p99[lv, q] * 1e3) for lv in LEVELS] for q in ("off", "on")}
        if p99_in:
            series.update({f"{q}, in-sandbox": [(lv, p99_in[lv, q] * 1e3) for lv in LEVELS]
                           for q in ("off", "on")})
        return svg_plot(series)
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
    """A line chart of LS p99 (ms) against BE load, one line per series (pure): the
    QoS mode ("off"/"on", solid) or a mode's in-sandbox steps ("on, in-sandbox", dashed
    in the mode's colour)."""
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
        c = colors.get(name.split(",")[0], "#2ca02c")
        dash = ' stroke-dasharray="5,3"' if "," in name else ""   # "on, in-sandbox"
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2"{dash} '
                   f'points="{path}"/>')
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

