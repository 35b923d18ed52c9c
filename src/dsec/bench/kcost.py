"""What each kernel object of a sandbox costs in host memory (issue 22).

``python -m dsec.bench.kcost [--n 500] [--json FILE]`` (root) creates N of one kind of
object alone, waits, reads ``/proc/meminfo``, removes them, and prints the delta per
object, kind by kind: the namespaces (each held by a ``sleep`` made with util-linux
``unshare``, a plain ``sleep`` subtracted), an empty cgroup in each v1 hierarchy the
governor uses, and the per-sandbox mounts (tmpfs, devpts, proc, overlay) made in one
private mount namespace (so the host mount table never sees them). The table in
docs/container.md ("Density: what a sandbox costs the kernel") comes from this.

Columns (KiB per object): ``kernel`` = SUnreclaim + Percpu + KernelStack + PageTables
delta (unreclaimable kernel memory: the part that does not come back under pressure,
and the least noisy: other work on the machine moves page cache, not these), ``slab`` =
Slab delta, ``avail`` = MemAvailable delta (what the host really lost, noisy).

Memory cgroups are special: the kernel keeps, per memory cgroup, a bitmap and a counter
per memcg-aware shrinker - and every superblock (each tmpfs, proc, sysfs, devpts,
overlay mount of every sandbox) registers one. So a memcg's cost grows with the number
of superblocks on the host, and a sandbox's with the number of sandboxes (the
quadratic term the 10,000 run met); ``--superblocks K`` adds K tmpfs superblocks first to
show it.

``--sandboxes N`` measures real sandboxes instead: N idle native-container sandboxes
(``ContainerBackend`` defaults; ``--lazy-devpts``, ``--own-scratch`` to compare), and
prints per sandbox which slab caches grew (``/proc/slabinfo`` diff: kmalloc-1k is the
memcg shrinker map, 1 KiB per 64 shrinker ids), the /proc/meminfo kernel parts, the
init's page tables and how many superblocks of its own a sandbox holds (mount ids in its
mountinfo that no other sandbox shares; + the unmounted mqueue of its ipc namespace).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

__all__ = ["main", "measure_all"]

_FIELDS = ("MemAvailable", "Slab", "SUnreclaim", "Percpu", "KernelStack", "PageTables")


def meminfo() -> dict[str, int]:
    """/proc/meminfo in KiB."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            out[k] = int(v.split()[0])
    return out


def _delta(a: dict[str, int], b: dict[str, int], n: int) -> dict[str, float]:
    d = {k: (b.get(k, 0) - a.get(k, 0)) / n for k in _FIELDS}
    return {"kernel": round(d["SUnreclaim"] + d["Percpu"] + d["KernelStack"] + d["PageTables"], 1),
            "slab": round(d["Slab"], 1), "avail": round(-d["MemAvailable"], 1),
            "percpu": round(d["Percpu"], 1), "stack+pt": round(d["KernelStack"] + d["PageTables"], 1)}


def _settle() -> None:
    time.sleep(1.0)


def _spawn_many(argv: list[str], n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL) for _ in range(n)]


def _reap(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def _processes(argv: list[str], n: int) -> dict[str, float]:
    a = meminfo()
    procs = _spawn_many(argv, n)
    try:
        time.sleep(0.5 + n / 2000)
        _settle()
        b = meminfo()
    finally:
        _reap(procs)
    _settle()
    return _delta(a, b, n)


def _minus(x: dict[str, float], y: dict[str, float]) -> dict[str, float]:
    return {k: round(x[k] - y[k], 1) for k in x}


def _own_cgroup(ctrl: str) -> str:
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            if ctrl in ctrls.split(","):
                return f"/sys/fs/cgroup/{ctrl}{path}"
    raise RuntimeError(f"no v1 {ctrl} hierarchy")


def _cgroups(ctrl: str, n: int) -> dict[str, float]:
    base = os.path.join(_own_cgroup(ctrl), f"dsec-kcost-{os.getpid()}")
    os.mkdir(base)
    made = []
    try:
        a = meminfo()
        for i in range(n):
            p = os.path.join(base, str(i))
            os.mkdir(p)
            made.append(p)
        _settle()
        b = meminfo()
    finally:
        for p in reversed(made):
            os.rmdir(p)
        os.rmdir(base)
    _settle()
    return _delta(a, b, n)


_HOLDER = r"""
set -e
cd "$1"; n=$2; kind=$3
mount --make-rprivate /
i=0
while [ $i -lt $n ]; do
  mkdir -p m$i
  case $kind in
    tmpfs) mount -t tmpfs -o size=1m t m$i ;;
    proc) mount -t proc proc m$i ;;
    devpts) mount -t devpts -o newinstance devpts m$i ;;
    overlay) mkdir -p u$i w$i; mount -t overlay -o lowerdir=lower,upperdir=u$i,workdir=w$i o m$i ;;
    bind) mount --bind lower m$i ;;
  esac
  i=$((i+1))
done
echo ready
exec sleep 3600
"""


def _mounts(kind: str, n: int, work: str) -> dict[str, float]:
    d = tempfile.mkdtemp(prefix=f"kcost-{kind}-", dir=work)
    os.makedirs(os.path.join(d, "lower", "etc"))
    a = meminfo()
    p = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          _HOLDER, "holder", d, str(n), kind],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(f"{kind} holder failed: {p.stderr.read().decode() if p.stderr else ''}")
        _settle()
        b = meminfo()
    finally:
        p.kill()
        p.wait()
        shutil.rmtree(d, ignore_errors=True)
    _settle()
    return _delta(a, b, n)


def measure_all(n: int, work: str, *, superblocks: int = 0,
                log: Callable[[str], None] = print) -> dict[str, dict[str, float]]:
    """Every kind, N each; KiB per object (see the module docstring)."""
    out: dict[str, dict[str, float]] = {}
    sleep = shutil.which("sleep") or "/bin/sleep"
    base = _processes([sleep, "3600"], n)
    out["process (sleep, baseline)"] = base
    log(f"process baseline: {base}")
    for name, flags in (("network namespace (+lo up)", None), ("network namespace", ["--net"]),
                        ("mount namespace", ["--mount"]), ("ipc namespace", ["--ipc"]),
                        ("uts namespace", ["--uts"]), ("cgroup namespace", ["--cgroup"])):
        if flags is None:
            argv = ["unshare", "--net", "sh", "-c", "ip link set lo up && exec sleep 3600"]
        else:
            argv = ["unshare", *flags, sleep, "3600"]
        out[name] = _minus(_processes(argv, n), base)
        log(f"{name}: {out[name]}")
    two = _processes(["unshare", "--fork", sleep, "3600"], n)
    out["pid namespace"] = _minus(_processes(["unshare", "--pid", "--fork", sleep, "3600"], n), two)
    log(f"pid namespace: {out['pid namespace']}")
    for ctrl in ("memory", "cpu", "cpuacct", "pids", "freezer"):
        out[f"cgroup v1 {ctrl}"] = _cgroups(ctrl, n)
        log(f"cgroup v1 {ctrl}: {out[f'cgroup v1 {ctrl}']}")
    for kind in ("tmpfs", "devpts", "proc", "overlay", "bind"):
        out[f"mount {kind}"] = _mounts(kind, n, work)
        log(f"mount {kind}: {out[f'mount {kind}']}")
    if superblocks:
        holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                   _HOLDER, "holder", tempfile.mkdtemp(dir=work),
                                   str(superblocks), "tmpfs"], stdout=subprocess.PIPE)
        try:
            assert holder.stdout is not None
            holder.stdout.readline()
            out[f"cgroup v1 memory, {superblocks} more superblocks"] = _cgroups("memory", n)
            log(f"memory cgroup with {superblocks} more superblocks: "
                f"{out[f'cgroup v1 memory, {superblocks} more superblocks']}")
        finally:
            holder.kill()
            holder.wait()
    return out


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def slabinfo(text: str) -> dict[str, tuple[int, int]]:
    """/proc/slabinfo text -> {cache: (active objects, object size)} (pure)."""
    out: dict[str, tuple[int, int]] = {}
    for line in text.splitlines():
        p = line.split()
        if len(p) < 4 or line.startswith(("slabinfo", "#")):
            continue
        out[p[0]] = (int(p[1]), int(p[3]))
    return out


def slab_growth(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]],
                n: int, top: int = 20) -> list[tuple[str, float, float]]:
    """The caches that grew most from ``before`` to ``after``, per object of ``n``:
    (cache, objects each, KiB each), biggest first (pure)."""
    rows = []
    for k, (objs, size) in after.items():
        grew = objs - before.get(k, (0, size))[0]
        if grew > 0:
            rows.append((k, grew / n, grew * size / n / 1024))
    rows.sort(key=lambda r: -r[2])
    return [(k, round(o, 2), round(kib, 2)) for k, o, kib in rows[:top]]


def own_superblocks(mountinfos: list[str]) -> list[str]:
    """The filesystem types of the superblocks the FIRST mountinfo holds that none of the
    others does (two sandboxes' mountinfo in: what one sandbox adds) (pure)."""
    def devs(text: str) -> set[tuple[str, str]]:
        return {(ln.split()[2], ln.split(" - ", 1)[1].split()[0])
                for ln in text.splitlines() if " - " in ln}
    mine = devs(mountinfos[0])
    for other in mountinfos[1:]:
        mine -= devs(other)
    return sorted(t for _, t in mine)


async def _sandboxes(n: int, work: str, *, lazy_devpts: bool, own_scratch: bool,
                     log: Callable[[str], None] = print) -> None:
    import asyncio

    from dsec.edge.backends.container import ContainerBackend, DirectoryImages
    from dsec.edge.backends.container.testimage import build_busybox_root
    from dsec.ids import NodeId, new_sandbox_id
    from dsec.nofile import raise_nofile
    from dsec.wire.spec import SandboxSpec

    raise_nofile()
    images = os.path.join(work, "images")
    build_busybox_root(os.path.join(images, "base"))
    b = ContainerBackend(root_dir=os.path.join(work, "native"), images=DirectoryImages(images),
                         lazy_devpts=lazy_devpts, shared_scratch=not own_scratch)
    spec = SandboxSpec(backend="container", memory_bytes=256 << 20, pids_max=256)
    node = NodeId("kcost")
    sids = [new_sandbox_id(node) for _ in range(n)]
    made: list[str] = []
    sem = asyncio.Semaphore(8)

    async def one(sid: str) -> None:
        async with sem:
            await b.create(sid, spec)   # type: ignore[arg-type]
            made.append(sid)
    try:
        warm = new_sandbox_id(node)
        await b.create(warm, spec)
        await b.destroy(warm)
        _settle()
        s0 = slabinfo(_read("/proc/slabinfo"))
        m0 = meminfo()
        await asyncio.gather(*(one(s) for s in sids))
        _settle()
        s1 = slabinfo(_read("/proc/slabinfo"))
        m1 = meminfo()
        log(f"{n} idle sandboxes, load average {os.getloadavg()[0]:.1f}; per sandbox:")
        for k, objs, kib in slab_growth(s0, s1, n):
            log(f"  {k:28} {objs:8.2f} objects {kib:8.2f} KiB")
        log(f"  meminfo: {_delta(m0, m1, n)}")
        inits = [b._boxes[s].init_pid for s in made[:2]]
        texts = [_read(f"/proc/{pid}/mountinfo") for pid in inits]
        pte = next((ln.split(":", 1)[1].strip() for ln in
                    _read(f"/proc/{inits[0]}/status").splitlines()
                    if ln.startswith("VmPTE")), "?")
        log(f"  the init's page tables: {pte}; mounts: {len(texts[0].splitlines())}; own "
            f"superblocks: {own_superblocks(texts)} + mqueue (its ipc namespace's)")
    finally:
        for s in made:
            try:
                await b.destroy(s)   # type: ignore[arg-type]
            except Exception as exc:  # noqa: BLE001 - reconcile below
                log(f"destroy {s}: {exc}")
        await b.reconcile(set())
        await b.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=500, help="objects of each kind (500)")
    ap.add_argument("--superblocks", type=int, default=0,
                    help="also measure a memory cgroup with this many extra superblocks")
    ap.add_argument("--json", help="write the table here too")
    ap.add_argument("--sandboxes", type=int, default=0,
                    help="measure N real idle sandboxes by slab cache instead")
    ap.add_argument("--lazy-devpts", action="store_true", help="with --sandboxes")
    ap.add_argument("--own-scratch", action="store_true",
                    help="with --sandboxes: a tmpfs per sandbox (shared_scratch=False)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root", file=sys.stderr)
        return 2
    if args.sandboxes:
        import asyncio

        work = tempfile.mkdtemp(prefix="dsec-kcost-", dir="/var/tmp")
        try:
            asyncio.run(_sandboxes(args.sandboxes, work, lazy_devpts=args.lazy_devpts,
                                   own_scratch=args.own_scratch))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return 0
    work = tempfile.mkdtemp(prefix="dsec-kcost-", dir="/var/tmp")
    try:
        table = measure_all(args.n, work, superblocks=args.superblocks)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nKiB per object, n={args.n}  (kernel = SUnreclaim+Percpu+KernelStack+PageTables)")
    print(f"{'object':42} {'kernel':>8} {'slab':>8} {'percpu':>8} {'avail':>8}")
    for k, v in table.items():
        print(f"{k:42} {v['kernel']:8.1f} {v['slab']:8.1f} {v['percpu']:8.1f} {v['avail']:8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"n": args.n, "kib_per_object": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
