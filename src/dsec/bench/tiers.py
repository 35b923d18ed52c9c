"""Benchmark suite ``tiers``: the isolation tiers (issue 21) side by side, same image, same
workloads, one run.

For each tier (``container`` = the native container backend, ``gvisor``, ``vm``) that this
node can run: ``tier_create_p50_ms`` (create -> exec-ready, each destroyed after),
``tier_exec_p50_ms`` (``true``), ``tier_idle_memory_kib`` (host memory per idle sandbox:
the host's MemUsed delta over a few idle sandboxes after a settle time, next to what the
backend's stats charge them), ``tier_density_4gib`` (4 GiB / that figure: how many idle
sandboxes 4 GiB holds, computed, not filled), ``tier_syscall_heavy_s`` (``find /usr -type
f | wc -l`` over a copy of the host's Python stdlib in the image: path walks and stats),
``tier_cpu_bound_s`` (``sha256sum`` of zeros from a pipe), ``tier_pause_ms`` /
``tier_resume_ms``. A tier this node cannot run is recorded as ``tier_available`` 0 with
the reason and measured no further: never a figure from something else. Needs root.

Environment: ``DSEC_BENCH_TIERS`` (comma list, default all three), ``DSEC_BENCH_CONTAINER_DIR``
(where backend roots go, default /var/tmp), ``DSEC_BENCH_TIER_IDLE_S`` (settle time before
the idle memory reading; default 40 s full, 10 s quick: a VM returns its boot-time memory
to the host over ~30 s, see vm/density.py), ``DSEC_BENCH_VM_WARM_POOL`` (0/1: the vm
backend's warm pool; default: the backend's own default, on).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dsec import ownership
from dsec.bench import BenchContext, suite
from dsec.ids import NodeId, SandboxId, new_sandbox_id
from dsec.rmtree import remove_tree
from dsec.wire.spec import TIER_BACKENDS, ExecRequest, Isolation, SandboxSpec

__all__ = ["TIERS", "TierPlan", "density_in", "pct", "plan", "tiers_suite"]

TIERS: tuple[Isolation, ...] = ("container", "gvisor", "vm")
_GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class TierPlan:
    """How much of each measurement a tier gets (a VM under TCG is ~100x slower to boot
    than a container, so it gets fewer creates)."""

    n_create: int
    n_exec: int
    n_idle: int
    cpu_bytes: int
    idle_s: float


def plan(tier: str, *, quick: bool, idle_s: float | None = None) -> TierPlan:
    """The measurement sizes for ``tier``. Pure."""
    vm = tier == "vm"
    if quick:
        return TierPlan(n_create=2 if vm else 10, n_exec=10 if vm else 30,
                        n_idle=2 if vm else 5, cpu_bytes=10 << 20,
                        idle_s=10.0 if idle_s is None else idle_s)
    return TierPlan(n_create=5 if vm else 40, n_exec=50 if vm else 200,
                    n_idle=4 if vm else 20, cpu_bytes=100 << 20,
                    idle_s=40.0 if idle_s is None else idle_s)


def pct(xs: list[float], p: float) -> float:
    """The ``p``-th percentile (nearest rank) of ``xs``. Pure."""
    if not xs:
        raise ValueError("percentile of no samples")
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def density_in(budget_bytes: int, per_sandbox_bytes: float) -> int:
    """Idle sandboxes that fit in ``budget_bytes`` at ``per_sandbox_bytes`` each. Pure."""
    if per_sandbox_bytes <= 0:
        raise ValueError(f"per-sandbox memory {per_sandbox_bytes} is not positive: the "
                         "measurement was noise (other work freed memory meanwhile)")
    return int(budget_bytes // per_sandbox_bytes)


def _meminfo() -> dict[str, int]:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            info[k] = int(v.split()[0]) * 1024
    return info


def _used() -> int:
    """Host memory in use that a sandbox can own: not free, not reclaimable page cache
    (a VM's shared read-only layer pages count as cache, which is the point of DAX), but
    shmem (tmpfs) counted."""
    i = _meminfo()
    return i["MemTotal"] - i["MemFree"] - i.get("Buffers", 0) - i.get("Cached", 0) \
        + i.get("Shmem", 0)


def _build_image(images: str) -> int:
    """A busybox root plus a copy of the host's Python stdlib under /usr/lib (the
    syscall-heavy workload walks it); returns the number of regular files under /usr."""
    from dsec.edge.backends.container.testimage import build_busybox_root

    root = build_busybox_root(os.path.join(images, "base"))
    src = os.path.dirname(os.__file__)
    dst = os.path.join(root, "usr", "lib", os.path.basename(src))
    if not os.path.exists(dst):
        shutil.copytree(src, dst, symlinks=True, ignore_dangling_symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "site-packages"))
    n = 0
    for top, _, files in os.walk(os.path.join(root, "usr")):
        n += sum(1 for f in files if stat.S_ISREG(os.lstat(os.path.join(top, f)).st_mode))
    return n


def _qemu_memory(marker: str) -> tuple[float, float] | None:
    """(private, shared file) bytes per QEMU process whose command line holds ``marker``
    (the vm backend's ``-name guest=dsec-vm.<key>.<sid>``, excluding warm-pool template
    builders), or None when there is none."""
    anon: list[int] = []
    shared: list[int] = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read()
            if b"qemu-system" not in argv.split(b"\0", 1)[0] or marker.encode() not in argv \
                    or f"{marker}pool-".encode() in argv:
                continue
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        anon.append(int(status["RssAnon"].split()[0]) * 1024)
        shared.append(int(status["RssFile"].split()[0]) * 1024)
    if not anon:
        return None
    return sum(anon) / len(anon), sum(shared) / len(shared)


def _backend(tier: str, work: str, images: str) -> tuple[Any, str]:
    """(backend, "") or (None, why this node cannot run ``tier``)."""
    from dsec.edge.backends import make_backend
    from dsec.edge.backends.container import DirectoryImages

    root = os.path.join(work, tier)
    opts: dict[str, Any] = {"root_dir": root, "images": DirectoryImages(images)}
    name: str = TIER_BACKENDS.get(tier, tier)  # type: ignore[call-overload]
    if name == "container":
        opts["runtime"] = "native"
    pool = os.environ.get("DSEC_BENCH_VM_WARM_POOL")
    if name == "vm" and pool:
        opts["warm_pool"] = pool not in ("0", "false", "no")
    try:
        return make_backend(name, **opts), ""
    except Exception as exc:  # noqa: BLE001 - the reason is the figure
        return None, f"{type(exc).__name__}: {exc}"[:300]


async def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


async def _measure(ctx: BenchContext, tier: Isolation, b: Any, p: TierPlan,
                   usr_files: int) -> None:
    node = NodeId("bench")
    spec = SandboxSpec(backend=TIER_BACKENDS[tier], isolation=tier, memory_bytes=512 << 20,
                       pids_max=256)
    made: list[SandboxId] = []

    async def create() -> SandboxId:
        sid = new_sandbox_id(node)
        await b.create(sid, spec)
        made.append(sid)
        return sid

    async def destroy(sid: SandboxId) -> None:
        await b.destroy(sid)
        made.remove(sid)

    try:
        warm = await create()                       # first create pays one-time costs
        await b.exec(warm, ExecRequest(argv=("true",)))
        lat = []
        for _ in range(p.n_create):
            t0 = time.perf_counter()
            sid = await create()
            lat.append(time.perf_counter() - t0)
            await destroy(sid)
        ctx.record("tier_create_p50_ms", pct(lat, 50) * 1e3, "ms", isolation=tier,
                   n=p.n_create, max_ms=round(max(lat) * 1e3, 1))
        lat = []
        for _ in range(p.n_exec):
            t0 = time.perf_counter()
            r = await b.exec(warm, ExecRequest(argv=("true",)))
            lat.append(time.perf_counter() - t0)
            if r.exit_code != 0:
                raise RuntimeError(f"{tier}: `true` exited {r.exit_code}")
        ctx.record("tier_exec_p50_ms", pct(lat, 50) * 1e3, "ms", isolation=tier, n=p.n_exec,
                   p99_ms=round(pct(lat, 99) * 1e3, 2))

        t0 = time.perf_counter()
        r = await b.exec(warm, ExecRequest(shell="find /usr -type f | wc -l", timeout_s=600))
        dt = time.perf_counter() - t0
        got = r.stdout.decode(errors="replace").strip()
        if r.exit_code != 0 or got != str(usr_files):
            raise RuntimeError(f"{tier}: find counted {got!r} files under /usr (exit "
                               f"{r.exit_code}), the image has {usr_files}")
        ctx.record("tier_syscall_heavy_s", dt, "s", isolation=tier, files=usr_files,
                   workload="find /usr -type f | wc -l")
        mib = p.cpu_bytes >> 20
        t0 = time.perf_counter()
        r = await b.exec(warm, ExecRequest(
            shell=f"head -c {mib}m /dev/zero | sha256sum", timeout_s=1200))
        dt = time.perf_counter() - t0
        if r.exit_code != 0 or len(r.stdout.split()[0]) != 64:
            raise RuntimeError(f"{tier}: sha256sum failed: exit {r.exit_code} {r.stderr[:200]!r}")
        ctx.record("tier_cpu_bound_s", dt, "s", isolation=tier, mib=mib,
                   workload=f"head -c {mib}m /dev/zero | sha256sum")

        await b.exec(warm, ExecRequest(shell="sleep 100000", background=True))
        try:
            t_pause = await _timed(lambda: b.pause(warm))
            t_resume = await _timed(lambda: b.resume(warm))
            r = await b.exec(warm, ExecRequest(argv=("true",)))
            ctx.record("tier_pause_ms", t_pause * 1e3, "ms", isolation=tier)
            ctx.record("tier_resume_ms", t_resume * 1e3, "ms", isolation=tier,
                       exec_after_resume_exit=r.exit_code)
        except Exception as exc:  # noqa: BLE001 - a tier may not pause; say so
            ctx.note(f"{tier}: pause/resume failed: {type(exc).__name__}: {exc}"[:300])
        await destroy(warm)

        await asyncio.sleep(2.0)
        before = _used()
        for _ in range(p.n_idle):
            sid = await create()
            await b.exec(sid, ExecRequest(argv=("true",)))
        await asyncio.sleep(p.idle_s)
        delta = (_used() - before) / p.n_idle
        st = [await b.stats(s) for s in made]
        charged = sum(x.memory_host_bytes or x.memory_bytes for x in st) / len(st)
        key = getattr(b, "key", None)
        qemu = _qemu_memory(f"guest=dsec-vm.{key}.") if tier == "vm" and key else None
        # What one sandbox is answerable for: its cgroup charge (plus the kernel memory the
        # backend knows it spends outside it); for a VM, QEMU's private memory (guest RAM
        # it touched, its heap, the translation cache): the layer pages it maps are the
        # host's page cache, shared by every VM of the image. The host-wide MemUsed delta
        # is kept as a cross-check (on a shared machine other work moves it by 100s of MiB).
        per = qemu[0] if qemu else charged
        ctx.record("tier_idle_memory_kib", per / 1024, "KiB", isolation=tier, n=p.n_idle,
                   settle_s=p.idle_s, stats_kib=round(charged / 1024),
                   memused_delta_kib=round(delta / 1024),
                   **({"qemu_private_kib": round(qemu[0] / 1024),
                       "qemu_shared_file_kib": round(qemu[1] / 1024)} if qemu else {}),
                   how=("QEMU private memory (RssAnon) per VM" if qemu else
                        "backend stats per sandbox (memory_host_bytes, else the cgroup "
                        "charge)") + " after the settle time")
        try:
            ctx.record("tier_density_4gib", density_in(4 * _GIB, per), "sandboxes",
                       isolation=tier, how="4 GiB / tier_idle_memory_kib (computed)")
        except ValueError as exc:
            ctx.note(f"{tier}: no density figure: {exc}")
    finally:
        for sid in made:
            try:
                await b.destroy(sid)
            except Exception as exc:  # noqa: BLE001 - reconcile below takes it
                ctx.note(f"{tier}: destroy of {sid} failed: {exc}")
        reconcile = getattr(b, "reconcile", None)
        if reconcile is not None:
            await reconcile(set())
        await b.close()
        gov = getattr(b, "governor", None)
        if gov is not None and hasattr(gov, "remove_base"):
            gov.remove_base()


async def _run(ctx: BenchContext, work: str, tiers: list[Isolation]) -> None:
    images = os.path.join(work, "images")
    os.makedirs(images)
    usr_files = _build_image(images)
    idle_env = os.environ.get("DSEC_BENCH_TIER_IDLE_S")
    for tier in tiers:
        b, why = _backend(tier, work, images)
        extra: dict[str, Any] = {"reason": why} if why else {}
        if b is not None and hasattr(b, "pool"):
            extra["warm_pool"] = b.pool is not None
        ctx.record("tier_available", 0 if b is None else 1, "bool", isolation=tier, **extra)
        if b is None:
            ctx.note(f"{tier}: not available on this node ({why}); not measured")
            continue
        p = plan(tier, quick=ctx.quick, idle_s=float(idle_env) if idle_env else None)
        try:
            await _measure(ctx, tier, b, p, usr_files)
        except Exception as exc:  # noqa: BLE001 - one tier failing keeps the others
            ctx.note(f"{tier}: measurement failed: {type(exc).__name__}: {exc}"[:400])


@suite("tiers")
def tiers_suite(ctx: BenchContext) -> None:
    """Isolation tiers side by side: create/exec p50, idle memory, density, workloads."""
    if os.geteuid() != 0:
        ctx.note("skipped: needs root")
        return
    tiers = [t.strip() for t in (os.environ.get("DSEC_BENCH_TIERS") or ",".join(TIERS))
             .split(",") if t.strip()]
    unknown = [t for t in tiers if t not in TIERS]
    if unknown:
        raise ValueError(f"DSEC_BENCH_TIERS names {unknown}: known tiers are {list(TIERS)}")
    chosen = [t for t in TIERS if t in tiers]
    base = os.environ.get("DSEC_BENCH_CONTAINER_DIR") or "/var/tmp"
    work = tempfile.mkdtemp(prefix="dsec-bench-tiers-", dir=base)
    ownership.claim(work)
    try:
        asyncio.run(_run(ctx, work, chosen))
    finally:
        remove_tree(work)
        ownership.disown(work)
    ctx.note("Same busybox image (+ the host's Python stdlib under /usr/lib) for every tier; "
             "each tier's figures come from its own backend on this node. vm runs under "
             "QEMU TCG (software CPU emulation: this host's /dev/kvm is PVM-only), so its "
             "CPU-bound and boot figures are 10-50x what KVM would give.")
