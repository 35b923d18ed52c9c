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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=500, help="objects of each kind (500)")
    ap.add_argument("--superblocks", type=int, default=0,
                    help="also measure a memory cgroup with this many extra superblocks")
    ap.add_argument("--json", help="write the table here too")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root", file=sys.stderr)
        return 2
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
