"""cgroups for sandboxes, on cgroup v2 or the v1 hierarchies, detected at start.

One cgroup per sandbox, nested under the edge's *own* cgroup (``<own>/dsec-<node>/<sid>``
per controller), so whatever limits the edge also bounds its sandboxes (on the dev/CI
machines the edge starts inside a nested memory cgroup, not the root; runc nests the same
way). The pure part - reading ``/proc/self/mountinfo`` and ``/proc/self/cgroup`` into a
:class:`CgroupLayout` and turning :class:`Limits` into file writes - takes text and returns
plans; :class:`Governor` carries them out on the real cgroupfs.

Measured here (MACHINE-NOTES.md): mkdir in 4 v1 controllers ~0.13 ms; moving a task into a
cgroup costs one RCU grace period (8-17 ms) unless the ``favordynmods`` mount option is
on, which :func:`enable_favordynmods` sets (it is global and sticks until reboot; with it a
migration measured 0.2 ms).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from dsec.edge.memgroups import is_group_name
from dsec.edge.qos import IoLimits, io_writes
from dsec.errors import BackendError, InvalidArgument
from dsec.rmtree import unescape_mountinfo

__all__ = [
    "DEFAULT_MAX_SANDBOX_PIDS",
    "DEFAULT_PIDS_HEADROOM",
    "TIER_PIDS_WEIGHTS",
    "CgroupLayout",
    "ExecCgroup",
    "Governor",
    "Limits",
    "Remount",
    "SandboxCgroup",
    "all_leaf_dirs",
    "be_cpu_parent",
    "detect_layout",
    "enable_favordynmods",
    "ensure_compressed_swap",
    "kernel_pid_max",
    "kill_verified",
    "limit_writes",
    "parse_keyed",
    "parse_mountinfo",
    "parse_proc_cgroup",
    "pids_budget",
    "pids_share",
    "pids_split",
    "sandbox_pids",
    "v1_base",
]

CgroupVersion = Literal[1, 2]
V1_CONTROLLERS: tuple[str, ...] = ("memory", "cpu", "cpuacct", "pids", "freezer")
V1_REQUIRED: tuple[str, ...] = ("memory", "cpu", "pids", "freezer")
V2_REQUIRED: tuple[str, ...] = ("memory", "cpu", "pids")
CFS_PERIOD_US = 100_000
CFS_PERIOD_MAX_US = 1_000_000   # the kernel's longest CFS period
# The task caps every backend that governs real processes (container, runc, fncall)
# applies: the most tasks one sandbox may have (a spec asking for more is refused;
# pids_max=None, "no cap", gets this), and the pids kept free for the edge and the host
# below kernel.pid_max (Governor.limit_total_pids: on the dev VM's 32,768, all sandboxes
# together get 28,672).
DEFAULT_MAX_SANDBOX_PIDS = 8192
DEFAULT_PIDS_HEADROOM = 4096


def kernel_pid_max() -> int:
    """``kernel.pid_max``: the most pids the host has."""
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read())


#: Each tier's weight in the node's pid budget (``kernel.pid_max - headroom``, which ALL
#: sandboxes of the host together must stay within: the headroom is the edge's and the
#: host's). Every backend caps its own sandboxes on its own parent cgroup, so the
#: budget is split between them, not given whole to each (red team 21, A5: container +
#: gvisor held 2 x 28,672 pids on a 32,768 host): a backend made alone takes its
#: weight's share of all tiers' weights (:func:`pids_share`; any set of backends on one
#: host then sums to at most the budget), an edge splits it between the tiers it runs
#: (``dsec edge``; a single-tier edge gets it all) and ``dsec up`` between its edges.
#: The weights follow what a sandbox of the tier spends: gvisor's Sentry threads and
#: ptrace stub tasks, a QEMU's threads, fncall's one process per call.
TIER_PIDS_WEIGHTS: dict[str, int] = {"container": 8, "gvisor": 4, "runc": 2, "fncall": 1,
                                     "vm": 1}


def pids_share(tier: str, tiers: Iterable[str] | None = None) -> float:
    """The share of the node's pid budget the backend of ``tier`` takes when the node
    runs the backends ``tiers`` (None: every tier, what a backend made on its own must
    assume); ``tier`` must be one of them (pure)."""
    names = set(TIER_PIDS_WEIGHTS if tiers is None else tiers) | {tier}
    weight = TIER_PIDS_WEIGHTS.get(tier, 1)
    return weight / sum(TIER_PIDS_WEIGHTS.get(t, 1) for t in names)


def pids_split(backends: Iterable[str], share: float = 1.0) -> dict[str, float]:
    """Each backend's ``pids_share`` on an edge running ``backends`` that may use
    ``share`` of the host's pid budget: split by the tiers' weights between the backends
    that cap pids (pure; others, e.g. simulated, are left out)."""
    capped = [n for n in dict.fromkeys(backends) if n in TIER_PIDS_WEIGHTS]
    return {n: share * pids_share(n, capped) for n in capped}


def pids_budget(pid_max: int, *, headroom: int, max_sandbox: int,
                share: float = 1.0) -> tuple[int, int]:
    """``(total, per_sandbox)`` for a backend's sandboxes on a host of ``pid_max`` pids:
    together they may hold ``share`` of ``pid_max - headroom`` (the rest of the budget is
    the other backends'; the headroom is the edge's and the host's), one of them at most
    ``max_sandbox`` of those. Refuses settings that leave nothing."""
    if not 0 <= headroom < pid_max:
        raise InvalidArgument(f"pids_headroom={headroom} must be >= 0 and below "
                              f"kernel.pid_max={pid_max}", field="pids_headroom")
    if max_sandbox < 1:
        raise InvalidArgument(f"max_sandbox_pids={max_sandbox} must be >= 1",
                              field="max_sandbox_pids")
    if not 0 < share <= 1:
        raise InvalidArgument(f"pids_share={share} must be in (0, 1]: the fraction of the "
                              "node's pid budget this backend's sandboxes may hold",
                              field="pids_share")
    total = int((pid_max - headroom) * share)
    if total < 1:
        raise InvalidArgument(f"pids_share={share} of kernel.pid_max={pid_max} minus "
                              f"pids_headroom={headroom} leaves no task; give a larger share",
                              field="pids_share")
    return total, min(max_sandbox, total)


def sandbox_pids(asked: int | None, per_sandbox: int) -> int:
    """The task limit a sandbox gets: what its spec asked (``pids_max``), or the node's
    per-sandbox maximum when it asked for no cap (None); more than that is refused."""
    if asked is None:
        return per_sandbox
    if asked > per_sandbox:
        raise InvalidArgument(
            f"pids_max={asked} is above this node's per-sandbox maximum of {per_sandbox} "
            "tasks; ask for at most that (or null for the maximum)", field="pids_max")
    return asked


@dataclass(frozen=True, slots=True)
class Limits:
    """What a sandbox may use: millicores, bytes of memory (no swap beyond it), tasks."""

    cpu_milli: int
    memory_bytes: int
    pids_max: int | None
    # QoS (issue 22, dsec.edge.qos.qos_writes): the class and an optional CPU cap
    qos: Literal["ls", "be"] = "ls"
    cpu_quota_milli: int | None = None
    # the CPUs it may run on (a kernel CPU list; None: not pinned - dsec.edge.qos.ClassCpus)
    cpus: str | None = None
    # block I/O throttle: (device "major:minor", IoLimits); None: none
    io: tuple[str, IoLimits] | None = None
    # v1: the memory group (a memory cgroup shared with other sandboxes of its project
    # and class, dsec.edge.memgroups) instead of a memcg of its own;
    # its memory limits are then the group's (set_group_memory), not written here
    memory_group: str | None = None


@dataclass(frozen=True, slots=True)
class Mount:
    root: str
    mountpoint: str
    fstype: str
    super_options: frozenset[str]


@dataclass(frozen=True, slots=True)
class CgroupLayout:
    """Where sandbox cgroups go. ``bases`` maps controller -> the edge's parent dir for
    its sandboxes (v2: the single key ``"unified"``)."""

    version: CgroupVersion
    bases: dict[str, str]
    memsw: bool = False
    # v2 only: the edge's own cgroup, and whether its processes must first move to a leaf
    # (the v2 "no internal processes" rule) before controllers can be delegated below it.
    v2_own: str = ""
    # v1 only: the one parent of every best-effort sandbox's cpu cgroup, a sibling of
    # ``bases["cpu"]`` (``<own>/dsec-<name>+be``, cpu.shares=2, cpu.idle=1); "" where BE
    # sandboxes' cpu cgroups stay under the base (v2, where one hierarchy holds every
    # controller and the node's totals are on the base). See :func:`be_cpu_parent`.
    be_cpu: str = ""


@dataclass(frozen=True, slots=True)
class SandboxCgroup:
    """The cgroup directories of one sandbox (controller -> absolute path)."""

    version: CgroupVersion
    dirs: dict[str, str] = field(default_factory=dict)
    #: controllers whose dir other sandboxes share (v1 "memory" in a memory group): never
    #: removed with the sandbox, never limited as the sandbox's own
    shared: tuple[str, ...] = ()

    @property
    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files a new task of this sandbox is written into, the
        freezer first: a task is then frozen with the sandbox (and found by a kill that
        freezes it) before it is counted anywhere else."""
        return [os.path.join(self.dirs[c], "cgroup.procs") for c in self._order]

    @property
    def _order(self) -> list[str]:
        return sorted(self.dirs, key=lambda c: c != "freezer")

    @property
    def pids_index(self) -> int:
        """Index in :attr:`procs_files` of the cgroup the task limit applies to."""
        key = "unified" if self.version == 2 else "pids"
        return self._order.index(key) if key in self.dirs else -1


@dataclass(frozen=True, slots=True)
class ExecCgroup:
    """The cgroup of one foreground exec: a child of the sandbox's freezer cgroup (v1) or
    of its v2 cgroup, holding every process the exec starts (setsid and double forks
    included), so a timeout can kill exactly those. Limits stay the sandbox's: the other
    v1 controllers keep the task in the sandbox's own cgroup, and v2 charges children to
    their parent."""

    version: CgroupVersion
    dir: str
    sandbox: SandboxCgroup

    @property
    def procs_files(self) -> list[str]:
        """Where the exec's first task goes: this cgroup first, then the sandbox's
        cgroups in the other v1 hierarchies."""
        own = os.path.join(self.dir, "cgroup.procs")
        if self.version == 2:
            return [own]
        return [own] + [os.path.join(self.sandbox.dirs[c], "cgroup.procs") for c in self._rest]

    @property
    def _rest(self) -> list[str]:
        return [c for c in self.sandbox.dirs if c != "freezer"]

    @property
    def pids_index(self) -> int:
        """Index in :attr:`procs_files` of the cgroup the task limit applies to (v2: this
        one, below the limited sandbox cgroup)."""
        if self.version == 2:
            return 0
        return 1 + self._rest.index("pids") if "pids" in self._rest else -1


def parse_mountinfo(text: str) -> list[Mount]:
    """The cgroup/cgroup2 mounts listed in a ``/proc/self/mountinfo`` text."""
    out = []
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 3 or rfields[0] not in ("cgroup", "cgroup2"):
            continue
        out.append(Mount(root=fields[3], mountpoint=unescape_mountinfo(fields[4]),
                         fstype=rfields[0], super_options=frozenset(rfields[2].split(","))))
    return out


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """``/proc/self/cgroup`` -> controller -> path (the v2 entry under key ``"unified"``)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, ctrls, path = parts
        if ctrls == "":
            out["unified"] = path
        for c in ctrls.split(","):
            if c and not c.startswith("name="):
                out[c] = path
    return out


def parse_keyed(text: str) -> dict[str, int]:
    """``key value`` lines (memory.stat, pids.events, memory.events) -> {key: value};
    lines that do not parse are skipped (pure)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        try:
            out[k] = int(v)
        except ValueError:
            continue
    return out


def _join(mount: Mount, path: str) -> str:
    rel = path
    if mount.root != "/" and (path == mount.root or path.startswith(mount.root + "/")):
        rel = path[len(mount.root):]
    return os.path.normpath(mount.mountpoint + "/" + rel.lstrip("/"))


def detect_layout(mountinfo: str, proc_cgroup: str, *, name: str,
                  v2_controllers: Callable[[str], set[str]]) -> CgroupLayout:
    """Pick v2 if the unified hierarchy offers memory, cpu and pids at the edge's cgroup,
    else the v1 hierarchies; raise :class:`BackendError` if neither is usable.

    ``v2_controllers(dir)`` reads ``cgroup.controllers`` (injected so this stays pure).
    """
    mounts = parse_mountinfo(mountinfo)
    paths = parse_proc_cgroup(proc_cgroup)
    leaf = f"dsec-{name}"
    v2 = next((m for m in mounts if m.fstype == "cgroup2"), None)
    if v2 is not None and "unified" in paths:
        own = _join(v2, paths["unified"])
        if set(V2_REQUIRED) <= v2_controllers(own):
            return CgroupLayout(version=2, bases={"unified": os.path.join(own, leaf)},
                                v2_own=own)
    bases: dict[str, str] = {}
    for ctrl in V1_CONTROLLERS:
        m = next((m for m in mounts if m.fstype == "cgroup" and ctrl in m.super_options), None)
        if m is not None and ctrl in paths:
            bases[ctrl] = os.path.join(_join(m, paths[ctrl]), leaf)
    missing = [c for c in V1_REQUIRED if c not in bases]
    if missing:
        raise BackendError(
            f"no usable cgroup hierarchy: cgroup v2 lacks {'/'.join(V2_REQUIRED)} at the edge's "
            f"cgroup and cgroup v1 lacks {', '.join(missing)}; mount the controllers (v1) or "
            "delegate them to the edge's cgroup (v2)")
    memsw = os.path.exists(os.path.join(os.path.dirname(bases["memory"]),
                                        "memory.memsw.limit_in_bytes"))
    return CgroupLayout(version=1, bases=bases, memsw=memsw,
                        be_cpu=be_cpu_parent(bases["cpu"]))


#: The v1 best-effort cpu parent is ``dsec-<name>`` + this. ``+`` is a character no
#: cgroup name may hold (:func:`valid_cgroup_name`), so that parent is never another
#: backend's base: with ``.be`` the parent of backend ``x`` was backend ``x.be``'s base,
#: and one's census and orphan reaper killed the other's sandboxes (red team 22, B2).
BE_SUFFIX = "+be"
#: v2: the leaf the edge's own processes move into ("no internal processes"); not a
#: ``dsec-<name>`` either, for the same reason (a backend named ``edge`` had its base -
#: and its reaper - there).
EDGE_LEAF = "dsec+edge"
CGROUP_NAME_MAX = 64


def valid_cgroup_name(name: str) -> bool:
    """A backend's cgroup name (its sandboxes' parent is ``dsec-<name>``): 1-64 letters,
    digits, ``-``, ``_`` or ``.``, not starting with ``.`` (pure). Every other dir dsec
    makes beside those parents (:data:`BE_SUFFIX`, :data:`EDGE_LEAF`) holds a character
    outside that set, so a dir names at most one backend."""
    return (0 < len(name) <= CGROUP_NAME_MAX and not name.startswith(".")
            and all(c.isalnum() or c in "-_." for c in name))


def cgroup_leaf_names(name: str) -> tuple[str, str]:
    """The dir names backend ``name`` owns at the edge's cgroup level: its base and its
    v1 best-effort cpu parent (pure)."""
    return f"dsec-{name}", f"dsec-{name}{BE_SUFFIX}"


def cgroup_owner(leaf: str) -> str | None:
    """The backend name a ``dsec-<name>`` or ``dsec-<name>+be`` dir name belongs to,
    exactly (None: not a backend's: ``dsec+edge``, a malformed name) (pure)."""
    if not leaf.startswith("dsec-"):
        return None
    name = leaf[len("dsec-"):]
    name = name.removesuffix(BE_SUFFIX)
    return name if valid_cgroup_name(name) else None


def be_cpu_parent(cpu_base: str) -> str:
    """v1: the cpu cgroup every best-effort sandbox's cpu cgroup goes under, given the
    edge's sandbox parent in the cpu hierarchy (``<own>/dsec-<name>`` ->
    ``<own>/dsec-<name>+be``) (pure).

    Why a sibling of the base and not a child: the kernel compares scheduling entities
    at the level where two tasks' cgroups meet. The edge (its asyncio loop, the zygote
    that forks execs) sits in ``<own>``; with BE sandboxes under ``dsec-<name>``, a BE
    spinner runs as part of the ``dsec-<name>`` entity, which is not idle (it holds the
    LS sandboxes too), so every wake-up on the exec path waits its turn against BE work
    as against an ordinary task. A ``cpu.idle=1`` group at the edge's own level is idle
    *there*: the edge's and LS sandboxes' wake-ups preempt BE work at once, and a CPU
    running only BE work counts as idle when the kernel places a waking task. Measured
    (docs/container.md "QoS", 50 % BE load, a host at load average 4-15): LS exec-step
    p99 inflation 0.86-1.17x with this parent vs 0.90-1.42x with BE beside LS."""
    return cpu_base + BE_SUFFIX


def v1_base(mountinfo: str, proc_cgroup: str, ctrl: str, *, name: str) -> str | None:
    """v1: ``<own cgroup>/dsec-<name>`` in the hierarchy of ``ctrl`` (cpuset, blkio),
    None where it is not mounted (pure). Those are managed only when asked for (CPU
    pinning, I/O limits: :class:`Governor` ``cpuset``/``blkio``): a cgroup per sandbox
    in one more hierarchy is kernel memory."""
    paths = parse_proc_cgroup(proc_cgroup)
    m = next((m for m in parse_mountinfo(mountinfo)
              if m.fstype == "cgroup" and ctrl in m.super_options), None)
    if m is None or ctrl not in paths:
        return None
    return os.path.join(_join(m, paths[ctrl]), f"dsec-{name}")


def all_leaf_dirs(mountinfo: str, proc_cgroup: str, *, name: str) -> list[str]:
    """``<own cgroup>/dsec-<name>`` in *every* mounted hierarchy (v1 blkio, cpuset,
    devices, name=systemd, ... and the v2 mount - not only the ones the governor manages):
    where runc's cgroupfs driver also makes the parent of a relative cgroupsPath (pure)."""
    own: dict[frozenset[str], str] = {}
    v2_own = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[1]:
            own[frozenset(parts[1].split(","))] = parts[2]
        else:
            v2_own = parts[2]
    out = []
    for m in parse_mountinfo(mountinfo):
        if m.fstype == "cgroup2":
            path = v2_own
        else:
            path = next((p for ctrls, p in own.items() if ctrls <= m.super_options), None)
        if path is not None:
            leaf = os.path.join(_join(m, path), f"dsec-{name}")
            out.append(leaf)
            if m.fstype == "cgroup" and "cpu" in m.super_options:
                out.append(be_cpu_parent(leaf))   # best-effort sandboxes' cpu cgroups
    return sorted(set(out))


def limit_writes(version: CgroupVersion, limits: Limits, *,
                 memsw: bool = False) -> list[tuple[str, str, str]]:
    """The ``(controller, file, value)`` writes that apply ``limits`` (pure).

    Memory is hard-capped with no swap beyond it (v2 ``memory.swap.max=0``, v1
    ``memsw`` = limit), so a bomb is OOM-killed instead of filling zram. CPU gets both a
    weight (fair share when contended) and a quota (hard cap at ``cpu_milli``).
    """
    shares = max(2, limits.cpu_milli * 1024 // 1000)
    quota = max(1000, limits.cpu_milli * CFS_PERIOD_US // 1000)
    pids = "max" if limits.pids_max is None else str(limits.pids_max)
    if version == 2:
        weight = 1 + ((shares - 2) * 9999) // 262142
        return [
            ("unified", "memory.max", str(limits.memory_bytes)),
            ("unified", "memory.swap.max", "0"),
            ("unified", "pids.max", pids),
            ("unified", "cpu.weight", str(max(1, min(10000, weight)))),
            ("unified", "cpu.max", f"{quota} {CFS_PERIOD_US}"),
        ]
    writes = [("memory", "memory.limit_in_bytes", str(limits.memory_bytes))]
    if memsw:
        writes.append(("memory", "memory.memsw.limit_in_bytes", str(limits.memory_bytes)))
    writes += [
        ("pids", "pids.max", pids),
        ("cpu", "cpu.shares", str(shares)),
        ("cpu", "cpu.cfs_period_us", str(CFS_PERIOD_US)),
        ("cpu", "cpu.cfs_quota_us", str(quota)),
    ]
    return writes


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _procs(d: str) -> list[int]:
    """The pids in ``d/cgroup.procs`` ([] if the cgroup is gone)."""
    try:
        return [int(p) for p in _read(os.path.join(d, "cgroup.procs")).split()]
    except (FileNotFoundError, ProcessLookupError):
        return []


def _subtree(d: str) -> list[str]:
    """``d`` and every cgroup below it, parents before children ([] if ``d`` is gone)."""
    if not os.path.isdir(d):
        return []
    out = [d]
    for dirpath in out:
        try:
            out.extend(e.path for e in os.scandir(dirpath) if e.is_dir(follow_symlinks=False))
        except FileNotFoundError:
            pass
    return out


#: Remounts the filesystem at a mount point with the given options (``MS_REMOUNT``);
#: raises OSError. The backends pass :func:`dsec.edge.backends.container.linux.remount`
#: (the syscall wrappers live with them, above this module).
Remount = Callable[[str, str], None]


def enable_favordynmods(mountinfo: str, remount: Remount) -> bool:
    """Turn on ``favordynmods`` via the cgroup2 mount (global for all hierarchies; it
    removes the RCU grace period from every task migration). False if it cannot."""
    for m in parse_mountinfo(mountinfo):
        if m.fstype == "cgroup2":
            if "favordynmods" in m.super_options:
                return True
            try:
                remount(m.mountpoint, "favordynmods")
                return True
            except OSError:
                return False
    return False


def ensure_compressed_swap(size_bytes: int, *, device: str = "/dev/zram0") -> str:
    """Make sure some swap exists, setting up ``device`` as zram swap if there is none.

    Paused sandboxes give their anonymous memory back by swapping it out; without any swap
    only page cache can be reclaimed. Returns a sentence saying what was done (for logs).
    Host-wide and left in place (it is idempotent and harmless to later runs).
    """
    with open("/proc/swaps") as f:
        if len(f.read().strip().splitlines()) > 1:
            return "swap already configured"
    name = os.path.basename(device)
    sysdir = f"/sys/block/{name}"
    if not os.path.isdir(sysdir):
        return f"no swap and no {device}: paused sandboxes give back page cache only"
    import ctypes
    import subprocess

    if int(_read(f"{sysdir}/disksize").strip() or 0) == 0:
        algos = _read(f"{sysdir}/comp_algorithm")
        for algo in ("zstd", "lz4", "lzo-rle"):
            if algo in algos.replace("[", " ").replace("]", " ").split():
                _write(f"{sysdir}/comp_algorithm", algo)
                break
        _write(f"{sysdir}/disksize", str(size_bytes))
    subprocess.run(["mkswap", device], check=True, capture_output=True)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.swapon(device.encode(), 0) != 0:
        err = ctypes.get_errno()
        if err != errno.EBUSY:
            raise BackendError(f"swapon({device}) failed: {os.strerror(err)}")
    return f"set up {size_bytes >> 20} MiB of zram swap on {device}"


_KILL_CHUNK = 512  # pidfds held at once


def kill_verified(listing: Callable[[], set[int]], sig: int = signal.SIGKILL) -> int:
    """Send ``sig`` to each process ``listing()`` names without ever hitting a process
    that merely inherited a listed pid number: open a pidfd per listed pid, call
    ``listing()`` again, and signal through the pidfd only the pids still listed. A pidfd
    that can still be signalled names a process that held its number from before the
    second listing until the signal - so the one that listing saw. Returns how many were
    signalled. Measured on the dev VM: ~4 us per process."""
    first = sorted(listing())
    sent = 0
    for k in range(0, len(first), _KILL_CHUNK):
        fds: dict[int, int] = {}
        try:
            for pid in first[k:k + _KILL_CHUNK]:
                try:
                    fds[pid] = os.pidfd_open(pid)
                except ProcessLookupError:
                    pass  # gone already
                except OSError as exc:
                    if exc.errno != errno.EINVAL:  # EINVAL: a thread id, not a process
                        raise
            again = listing()
            for pid, fd in fds.items():
                if pid not in again:
                    continue
                try:
                    signal.pidfd_send_signal(fd, sig)
                    sent += 1
                except ProcessLookupError:
                    pass
        finally:
            for fd in fds.values():
                os.close(fd)
    return sent


class Governor:
    """Creates, limits, freezes, reclaims and removes sandbox cgroups."""

    def __init__(self, *, name: str = "dsec", layout: CgroupLayout | None = None,
                 favor_dynmods: Remount | None = None, cpuset: bool = False,
                 blkio: bool = False) -> None:
        """``favor_dynmods``: how to remount the cgroup2 mount to turn ``favordynmods`` on
        (see :func:`enable_favordynmods`); None leaves the mount as it is. ``cpuset``:
        manage the cpuset controller too (CPU pinning, :class:`Limits` ``cpus``): v1 a
        cpuset cgroup per sandbox (~3 KiB of kernel memory each, no memcg), v2
        ``+cpuset`` delegated below the edge's cgroup. ``blkio``: manage block I/O
        throttling (:class:`Limits` ``io``) the same way (v1 blkio, v2 ``+io``)."""
        if not valid_cgroup_name(name):
            raise BackendError(f"cgroup name {name[:80]!r} must be 1-64 letters, digits, "
                               "'-', '_' or '.', not starting with '.': the sandboxes' "
                               "parent is dsec-<name> and no other dir dsec makes may "
                               "share it")
        self.name = name
        mountinfo = _read("/proc/self/mountinfo")
        self.favordynmods = False
        if favor_dynmods is not None:
            self.favordynmods = enable_favordynmods(mountinfo, favor_dynmods)
        self.layout = layout or detect_layout(
            mountinfo, _read("/proc/self/cgroup"), name=name,
            v2_controllers=lambda d: set(_read(os.path.join(d, "cgroup.controllers")).split())
            if os.path.exists(os.path.join(d, "cgroup.controllers")) else set())
        self.version: CgroupVersion = self.layout.version
        self._home_procs: str | None = None
        self.cpuset, self.blkio = cpuset, blkio
        for ctrl, on, knob in (("cpuset", cpuset, "CPU pinning (qos_cpus)"),
                               ("blkio", blkio, "I/O limits (qos_io)")):
            if not on or self.version != 1 or ctrl in self.layout.bases:
                continue
            base = v1_base(mountinfo, _read("/proc/self/cgroup"), ctrl, name=name)
            if base is None:
                raise BackendError(f"{knob} needs the {ctrl} controller, and no cgroup v1 "
                                   f"{ctrl} hierarchy is mounted here; mount it or leave "
                                   f"{knob.split('(')[1][:-1]} unset")
            self.layout = CgroupLayout(version=1, bases={**self.layout.bases, ctrl: base},
                                       memsw=self.layout.memsw, be_cpu=self.layout.be_cpu)
        if self.version == 2:
            self._prepare_v2()
        for base in self.layout.bases.values():
            os.makedirs(base, exist_ok=True)
        if self.version == 2:
            self._enable_subtree(self.layout.bases["unified"])
        #: the CPUs and memory nodes sandboxes may use (the cpuset the edge itself is
        #: in); "" where the cpuset controller is not managed
        self.node_cpus = self.node_mems = ""
        if cpuset:
            self._prepare_cpuset()
        if blkio and self.version == 2:
            self._enable_subtree(self.layout.bases["unified"], ("io",))

    def _prepare_cpuset(self) -> None:
        """Read the edge's own cpuset (what pinned sandboxes may get) and, on v1, give the
        sandboxes' parent the same CPUs and memory nodes: a v1 cpuset cgroup starts empty
        and refuses tasks until both are written."""
        if self.version == 2:
            own = self.layout.v2_own
            self._enable_subtree(self.layout.bases["unified"], ("cpuset",))
            self.node_cpus = _read(os.path.join(own, "cpuset.cpus.effective")).strip()
            self.node_mems = _read(os.path.join(own, "cpuset.mems.effective")).strip()
            return
        base = self.layout.bases["cpuset"]
        parent = os.path.dirname(base)
        self.node_cpus = _read(os.path.join(parent, "cpuset.effective_cpus")).strip()
        self.node_mems = _read(os.path.join(parent, "cpuset.effective_mems")).strip()
        if _read(os.path.join(base, "cpuset.mems")).strip() != self.node_mems:
            _write(os.path.join(base, "cpuset.mems"), self.node_mems)
        if _read(os.path.join(base, "cpuset.cpus")).strip() != self.node_cpus:
            _write(os.path.join(base, "cpuset.cpus"), self.node_cpus)

    # -- v2 delegation ---------------------------------------------------------------
    def _enable_subtree(self, d: str, ctrls: tuple[str, ...] = V2_REQUIRED) -> None:
        want = " ".join(f"+{c}" for c in ctrls)
        try:
            _write(os.path.join(d, "cgroup.subtree_control"), want)
        except OSError as exc:
            raise BackendError(f"cannot enable {want} in {d}/cgroup.subtree_control: {exc}; "
                               "the edge's cgroup must be delegated to it") from exc

    def _prepare_v2(self) -> None:
        own = self.layout.v2_own
        enabled = set(_read(os.path.join(own, "cgroup.subtree_control")).split())
        if set(V2_REQUIRED) <= enabled:
            return
        procs = _read(os.path.join(own, "cgroup.procs")).split()
        if procs:  # "no internal processes": move the edge's processes into a leaf first
            leaf = os.path.join(own, EDGE_LEAF)
            os.makedirs(leaf, exist_ok=True)
            for pid in procs:
                try:
                    _write(os.path.join(leaf, "cgroup.procs"), pid)
                except OSError:
                    pass  # exited meanwhile, or a kernel thread
        self._enable_subtree(own)

    def home_procs(self) -> str:
        """``cgroup.procs`` of this process's own cgroup in the hierarchy holding the pids
        controller: where the zygote (started by us) steps back to when a sandbox at its
        task limit refuses an exec's fork (nsexec.c, spawn_final). "" if unknown."""
        if self._home_procs is None:
            self._home_procs = ""
            try:
                mounts = parse_mountinfo(_read("/proc/self/mountinfo"))
                paths = parse_proc_cgroup(_read("/proc/self/cgroup"))
            except OSError:
                return ""
            key = "unified" if self.version == 2 else "pids"
            m = next((m for m in mounts if (m.fstype == "cgroup2") == (self.version == 2)
                      and (self.version == 2 or "pids" in m.super_options)), None)
            if m is not None and key in paths:
                self._home_procs = os.path.join(_join(m, paths[key]), "cgroup.procs")
        return self._home_procs

    # -- per sandbox -----------------------------------------------------------------
    def paths(self, sid: str, qos: Literal["ls", "be"] | None = None,
              memory_group: str | None = None) -> SandboxCgroup:
        """The sandbox's cgroup dirs. v1: a best-effort sandbox's cpu cgroup is under
        :attr:`CgroupLayout.be_cpu`; ``qos`` None (a caller that does not know the
        class, e.g. cleaning up after a crash) looks for it there first. With
        ``memory_group`` its memory cgroup is the group's (v1 only)."""
        dirs = {c: os.path.join(b, sid) for c, b in self.layout.bases.items()}
        if self.layout.be_cpu and "cpu" in dirs:
            be = os.path.join(self.layout.be_cpu, sid)
            if qos == "be" or (qos is None and os.path.isdir(be)):
                dirs["cpu"] = be
        if memory_group is None:
            return SandboxCgroup(self.version, dirs)
        if self.version != 1 or "memory" not in dirs:
            raise BackendError("memory groups need the cgroup v1 memory hierarchy (on v2 a "
                               "sandbox's cgroup holds every controller: not built)")
        dirs["memory"] = os.path.join(self.layout.bases["memory"], memory_group)
        return SandboxCgroup(self.version, dirs, ("memory",))

    def set_group_memory(self, group_dir: str, limit_bytes: int, *, soft_bytes: int,
                         lower: bool = True, force: bool = False) -> bool:
        """Set a memory group's limit (v1 ``memory.limit_in_bytes``, and ``memsw`` to the
        same: no swap beyond it) and soft limit; all three move together or none does.
        Raising writes memsw first (v1 refuses memsw below the limit). Lowering happens
        only when the group already fits (its memory + swap use is at most the new
        limit): the kernel would otherwise push a running member's memory to swap to
        lower the limit and then refuse memsw (EBUSY), leaving memsw above the limit
        (red team 26, B). False if it was not lowered (or ``lower`` is False: a raise
        only) - the old limit stays, the caller tries again later. ``force``: lower even
        if it does not fit yet - the limit's write makes the kernel reclaim (page cache,
        anon to swap) and memsw's refuses while memory + swap is still over; then both
        go back (the group's lowering deadline, red team 27 C)."""
        limit = os.path.join(group_dir, "memory.limit_in_bytes")
        memsw = os.path.join(group_dir, "memory.memsw.limit_in_bytes") \
            if self.layout.memsw else None
        current = int(_read(limit))
        if limit_bytes < current:
            used = os.path.join(group_dir, "memory.memsw.usage_in_bytes" if memsw
                                else "memory.usage_in_bytes")
            if not lower or (not force and int(_read(used)) > limit_bytes):
                # the soft limit goes down at once: under node pressure global reclaim
                # takes a group holding a departed member's share first (red team 27 C)
                with contextlib.suppress(OSError):
                    _write(os.path.join(group_dir, "memory.soft_limit_in_bytes"),
                           str(min(soft_bytes, limit_bytes)))
                return False
            files = [limit] if memsw is None else [limit, memsw]
        else:
            files = [limit] if memsw is None else [memsw, limit]
        done: list[str] = []
        try:
            for f in files:
                _write(f, str(limit_bytes))
                done.append(f)
        except OSError as exc:
            # a lowering refused after all (the group grew meanwhile): put back what
            # moved, so limit and memsw stay equal
            for f in reversed(done):
                with contextlib.suppress(OSError):
                    _write(f, str(current))
            if exc.errno != errno.EBUSY:
                raise
            return False
        _write(os.path.join(group_dir, "memory.soft_limit_in_bytes"), str(soft_bytes))
        return True

    @staticmethod
    def group_limit(group_dir: str) -> int:
        """A memory group's limit now (one small read: on every join and leave)."""
        return int(_read(os.path.join(group_dir, "memory.limit_in_bytes")))

    def group_use(self, group_dir: str) -> tuple[int, int]:
        """A memory group's (memory + swap in use, clean file cache): the cache is what
        the limit's write can reclaim at once (no writeback, no swap)."""
        used = int(_read(os.path.join(group_dir, "memory.memsw.usage_in_bytes"
                                      if self.layout.memsw else "memory.usage_in_bytes")))
        stat = parse_keyed(_read(os.path.join(group_dir, "memory.stat")))
        clean = (stat.get("total_inactive_file", 0) + stat.get("total_active_file", 0)
                 - stat.get("total_dirty", 0) - stat.get("total_writeback", 0))
        return used, max(0, clean)

    @staticmethod
    def remove_group(group_dir: str) -> bool:
        """rmdir a memory group's cgroup (called when its last member has gone); False
        if a task is still in it (EBUSY: the group is kept and tried again)."""
        try:
            os.rmdir(group_dir)
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            return False
        return True

    def _be_parent(self) -> None:
        """mkdir (if missing) the v1 best-effort cpu parent and (re)write its class:
        the lowest weight and ``cpu.idle=1`` where the kernel has it (Linux >= 5.15)."""
        d = self.layout.be_cpu
        os.makedirs(d, exist_ok=True)
        if os.path.exists(os.path.join(d, "cpu.idle")):   # (an idle group refuses shares:
            _write(os.path.join(d, "cpu.idle"), "1")       # EINVAL; its weight is 3)
        else:
            _write(os.path.join(d, "cpu.shares"), "2")

    def set_cpu_quota(self, cg: SandboxCgroup, cores: float, *,
                      period_us: int = CFS_PERIOD_US) -> tuple[int, int]:
        """Set one sandbox's CPU cap to ``cores`` (returns the ``(quota, period)`` us
        written) - the node's BE suppression scales best-effort sandboxes' caps with it
        (:class:`dsec.edge.qos.CpuSuppressor`). Per sandbox, not on the BE parent: v1
        refuses (EINVAL) a parent quota below any child's, and every sandbox has one.
        A cap under the kernel's smallest quota (1 ms) per 100 ms period takes a 1 s
        period, down to 0.001 core: with 1 ms per 100 ms as the floor, N BE sandboxes
        kept N x 0.01 cores whatever the cap (red team 24 B1). ``period_us``: the period
        wanted (the suppressor asks 10 ms: see CpuSuppressPolicy.period_us), taken when
        the cap gives at least 1 ms in it, else 100 ms, else 1 s."""
        period = next((p for p in (period_us, CFS_PERIOD_US) if cores * p >= 1000),
                      CFS_PERIOD_MAX_US)
        quota = max(1000, round(cores * period))
        if cg.version == 2:
            _write(os.path.join(cg.dirs["unified"], "cpu.max"), f"{quota} {period}")
        else:
            d = cg.dirs["cpu"]
            # v1 checks each write against the parents' quotas (a child may not ask more
            # than a capped parent - a systemd CPUQuota=, a pod's limit): the pair in
            # between must not exceed both the old and the new ratio. Shrinking the
            # period, the quota goes first (q_new / p_old < q_new / p_new); growing it,
            # the period (q_old / p_new < q_old / p_old). Period-first always asked
            # 10 cores for a moment going 100 ms -> 10 ms: EINVAL under a capped parent,
            # every tick (red team 25 B1).
            try:
                old_period = int(_read(os.path.join(d, "cpu.cfs_period_us")))
            except (OSError, ValueError):
                old_period = period
            order = ("cpu.cfs_quota_us", "cpu.cfs_period_us") if period < old_period \
                else ("cpu.cfs_period_us", "cpu.cfs_quota_us")
            for f in order:
                _write(os.path.join(d, f), str(quota if f == "cpu.cfs_quota_us" else period))
        return quota, period

    def create(self, sid: str, limits: Limits) -> SandboxCgroup:
        """mkdir the sandbox's cgroups and apply ``limits``; on failure remove them."""
        cg = self.paths(sid, limits.qos, limits.memory_group)
        cpus = self._cpus_of(limits)   # refusals first: nothing made yet
        if limits.io is not None and not self.blkio:
            raise BackendError("sandbox has I/O limits but this governor does not manage "
                               "block I/O (Governor(blkio=True))")
        try:
            if limits.qos == "be" and self.layout.be_cpu:
                self._be_parent()
            for ctrl, d in cg.dirs.items():
                if ctrl in cg.shared:
                    os.makedirs(d, exist_ok=True)   # the group's: made by its first member
                else:
                    os.mkdir(d)
            for ctrl, fname, value in limit_writes(self.version, limits,
                                                   memsw=self.layout.memsw):
                if ctrl not in cg.shared:
                    _write(os.path.join(cg.dirs[ctrl], fname), value)
            self._apply_qos(cg, limits, cpus=cpus)
            if limits.io is not None:
                for ctrl, fname, value, _ in io_writes(self.version, *limits.io):
                    _write(os.path.join(cg.dirs[ctrl], fname), value)
        except OSError as exc:
            self.remove(cg)
            raise BackendError(f"cannot create cgroups for sandbox {sid} under "
                               f"{sorted(self.layout.bases.values())}: {exc}") from exc
        return cg

    def _cpus_of(self, limits: Limits) -> str | None:
        """The cpuset.cpus to write: the sandbox's pin; v1 with the cpuset hierarchy
        managed needs one even unpinned (a v1 cpuset cgroup starts empty): the node's."""
        if limits.cpus is not None and not self.cpuset:
            raise BackendError(f"sandbox pinned to CPUs {limits.cpus} but this governor does "
                               "not manage the cpuset controller (Governor(cpuset=True))")
        if limits.cpus is None and self.cpuset and self.version == 1:
            return self.node_cpus
        return limits.cpus

    @staticmethod
    def _apply_qos(cg: SandboxCgroup, limits: Limits, *, cpus: str | None = None,
                   mems: str | None = None) -> None:
        """The QoS class's writes (issue 22); optional ones skipped where the controller
        or file is absent (this VM: no managed blkio hierarchy). ``cpus``/``mems``: the
        sandbox's cpuset (see :meth:`_cpus_of`)."""
        from dsec.edge.qos import qos_writes

        if cpus is not None and mems is None and cg.version == 1:
            mems = _read(os.path.join(os.path.dirname(cg.dirs["cpuset"]),
                                      "cpuset.mems")).strip()
        for ctrl, fname, value, optional in qos_writes(
                cg.version, limits.qos, cpu_milli=limits.cpu_milli,
                memory_bytes=limits.memory_bytes, cpu_quota_milli=limits.cpu_quota_milli,
                cpus=cpus, mems=mems):
            if ctrl in cg.shared:
                continue          # a memory group's soft limit: set_group_memory
            d = cg.dirs.get(ctrl)
            if d is None or (optional and not os.path.exists(os.path.join(d, fname))):
                if optional:
                    continue
                raise BackendError(f"cgroup controller {ctrl} needed for {fname} is not "
                                   "managed on this node")
            _write(os.path.join(d, fname), value)

    def _main(self, cg: SandboxCgroup, ctrl: str) -> str:
        return cg.dirs["unified" if cg.version == 2 else ctrl]

    def pids(self, cg: SandboxCgroup) -> list[int]:
        try:
            return [int(p) for p in _read(os.path.join(self._main(cg, "pids"),
                                                       "cgroup.procs")).split()]
        except FileNotFoundError:
            return []

    def exists(self, cg: SandboxCgroup) -> bool:
        return all(os.path.isdir(d) for d in cg.dirs.values())

    def present(self, cg: SandboxCgroup) -> bool:
        """Any of the sandbox's own cgroup dirs exists: what a kill or a removal must act
        on. ``exists`` (all of them) was the test before, and a partial set - a create or
        a teardown cut off between hierarchies, a memory-group member whose memory dir is
        the group's - was neither killed nor removed (red team 26, E)."""
        return any(os.path.isdir(d) for c, d in cg.dirs.items() if c not in cg.shared)

    def freeze(self, cg: SandboxCgroup) -> None:
        self._set_frozen(cg, True)

    def thaw(self, cg: SandboxCgroup) -> None:
        self._set_frozen(cg, False)

    def _set_frozen(self, cg: SandboxCgroup, frozen: bool) -> None:
        if cg.version == 2:
            _write(os.path.join(cg.dirs["unified"], "cgroup.freeze"), "1" if frozen else "0")
            return
        state = os.path.join(cg.dirs["freezer"], "freezer.state")
        _write(state, "FROZEN" if frozen else "THAWED")
        if frozen:  # v1 freezing is asynchronous: FREEZING until every task stopped
            for _ in range(2000):
                if _read(state).strip() == "FROZEN":
                    return
                time.sleep(0.0005)

    def is_frozen(self, cg: SandboxCgroup) -> bool:
        if cg.version == 2:
            return "frozen 1" in _read(os.path.join(cg.dirs["unified"], "cgroup.events"))
        return _read(os.path.join(cg.dirs["freezer"], "freezer.state")).strip() != "THAWED"

    def memory_usage(self, cg: SandboxCgroup) -> int:
        if cg.version == 2:
            return int(_read(os.path.join(cg.dirs["unified"], "memory.current")))
        return int(_read(os.path.join(cg.dirs["memory"], "memory.usage_in_bytes")))

    def reclaim(self, cg: SandboxCgroup) -> tuple[int, int]:
        """Push the (frozen) sandbox's memory out: page cache dropped, anonymous memory
        to (compressed) swap. Returns ``(resident_before, resident_after)`` bytes.

        v2: ``memory.reclaim`` with swap temporarily allowed. v1 has no memory.reclaim:
        set the cgroup's own ``memory.swappiness`` to 100 and write ``memory.force_empty``,
        which reclaims as much as it can even with tasks inside (the memsw limit stays
        equal to the memory limit, so swapping out never lets the sandbox grow).
        """
        before = self.memory_usage(cg)
        if cg.version == 2:
            d = cg.dirs["unified"]
            _write(os.path.join(d, "memory.swap.max"), "max")
            try:
                _write(os.path.join(d, "memory.reclaim"), str(max(before, 4096)))
            except OSError as exc:
                if exc.errno != errno.EAGAIN:  # EAGAIN: reclaimed less than asked
                    raise
        else:
            d = cg.dirs["memory"]
            _write(os.path.join(d, "memory.swappiness"), "100")
            # Measured on 6.18: without this read, force_empty on a freshly filled cgroup
            # reclaimed ~1% (42 MB -> 42 MB); with it, 99% (42 MB -> 0.4 MB). Reading
            # memory.stat flushes the memcg's lazily aggregated LRU statistics, which
            # reclaim uses to size its scan - unflushed they say "nothing to scan".
            _read(os.path.join(d, "memory.stat"))
            try:
                _write(os.path.join(d, "memory.force_empty"), "0")
            except OSError as exc:
                if exc.errno not in (errno.EBUSY, errno.EINTR):
                    raise
        return before, self.memory_usage(cg)

    def after_resume(self, cg: SandboxCgroup) -> None:
        """Undo what :meth:`reclaim` relaxed (v2: no swap beyond the limit again)."""
        if cg.version == 2:
            _write(os.path.join(cg.dirs["unified"], "memory.swap.max"), "0")

    def oom_kills(self, cg: SandboxCgroup) -> int:
        """How many tasks the OOM killer has killed in this sandbox's cgroup."""
        try:
            if cg.version == 2:
                text = _read(os.path.join(cg.dirs["unified"], "memory.events"))
            else:
                text = _read(os.path.join(cg.dirs["memory"], "memory.oom_control"))
        except FileNotFoundError:
            return 0
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
        return 0

    def oom_eventfd(self, cg: SandboxCgroup) -> int | None:
        """v1: an eventfd that becomes readable whenever the sandbox hits its memory limit
        (``cgroup.event_control`` on ``memory.oom_control``). v2: None (callers check
        :meth:`oom_kills` when a process dies instead)."""
        if cg.version == 2:
            return None
        d = cg.dirs["memory"]
        efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        ctl = os.open(os.path.join(d, "memory.oom_control"), os.O_RDONLY | os.O_CLOEXEC)
        try:
            _write(os.path.join(d, "cgroup.event_control"), f"{efd} {ctl}")
        except OSError:
            os.close(efd)
            raise
        finally:
            os.close(ctl)
        return efd

    def cpu_ns(self, cg: SandboxCgroup) -> int:
        """The sandbox's CPU time so far, ns (one file read; 0 if it is gone)."""
        try:
            if cg.version == 2:
                for line in _read(os.path.join(cg.dirs["unified"], "cpu.stat")).splitlines():
                    if line.startswith("usage_usec"):
                        return int(line.split()[1]) * 1000
                return 0
            return int(_read(os.path.join(cg.dirs["cpuacct"], "cpuacct.usage")).split()[0])
        except (OSError, ValueError, IndexError, KeyError):
            return 0

    def stats(self, cg: SandboxCgroup) -> tuple[int, int, float, int]:
        """``(memory_bytes, memory_peak_bytes, cpu_seconds, pids)``."""
        def num(path: str) -> int:
            try:
                return int(_read(path).split()[0])
            except (OSError, ValueError, IndexError):
                return 0
        cpu_s = self.cpu_ns(cg) / 1e9
        if cg.version == 2:
            d = cg.dirs["unified"]
            return (num(os.path.join(d, "memory.current")), num(os.path.join(d, "memory.peak")),
                    cpu_s, num(os.path.join(d, "pids.current")))
        return (num(os.path.join(cg.dirs["memory"], "memory.usage_in_bytes")),
                num(os.path.join(cg.dirs["memory"], "memory.max_usage_in_bytes")),
                cpu_s, num(os.path.join(cg.dirs["pids"], "pids.current")))

    # -- killing, race-free ---------------------------------------------------------
    # Signalling a pid number read from cgroup.procs can hit another process: the listed
    # task may exit, be reaped and its number handed to a new (host) process before the
    # kill() lands (seen once: a host test process SIGKILLed next to a fork-bombing
    # sandbox). v2 has cgroup.kill (the kernel walks the tasks). v1: open a pidfd for each
    # listed pid, list again, and signal through the pidfd only the pids still listed.
    # A pidfd that can still be signalled names a process that was alive - so held its
    # number - from before the second listing until the signal, hence the process the
    # second listing saw in the cgroup. Freezing first only keeps fork bombs from
    # outrunning the loop (and frozen tasks cannot exit), it is not what makes it exact.
    # Measured on the dev VM: ~4 us per task (pidfd_open + pidfd_send_signal + close).

    def _v1_sandbox_pids(self, cg: SandboxCgroup) -> set[int]:
        """Every task of the sandbox: its pids cgroup (flat in v1: exec cgroups exist only
        in the freezer hierarchy) and its freezer subtree (a task joins the freezer
        first, so one that is still joining is found there)."""
        out: set[int] = set()
        for ctrl in ("pids", "freezer"):
            d = cg.dirs.get(ctrl)
            if d is None:
                continue
            for dirpath in _subtree(d):
                out.update(_procs(dirpath))
        return out

    def _freeze_briefly(self, freezer_dir: str, wait_s: float = 0.05) -> bool:
        """v1: ask ``freezer_dir`` to freeze and wait a little for it (dying tasks may
        keep it FREEZING); True if the request was made."""
        state = os.path.join(freezer_dir, "freezer.state")
        try:
            _write(state, "FROZEN")
        except OSError:
            return False
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                if _read(state).strip() == "FROZEN":
                    break
            except OSError:
                break
            time.sleep(0.0002)
        return True

    def _unidle_for_exit(self, cg: SandboxCgroup) -> None:
        """v1: a best-effort sandbox's tasks about to be killed leave the idle cpu parent
        for the sandboxes' base and run SCHED_OTHER, so they can die on a busy host.
        Measured: at load 13, tasks SIGKILLed in the ``cpu.idle`` parent (SCHED_IDLE too)
        were still there after 2 s (rmdir EBUSY); a dying task needs a little CPU to exit,
        and an idle group gets ~3/1024 of a busy CPU. Best effort: a task gone meanwhile
        (ESRCH, EINVAL) is skipped."""
        cpu = cg.dirs.get("cpu")
        base = self.layout.bases.get("cpu")
        if not cpu or not base or not self.layout.be_cpu \
                or os.path.dirname(cpu) != self.layout.be_cpu:
            return
        for pid in _procs(cpu):
            with contextlib.suppress(OSError):
                _write(os.path.join(base, "cgroup.procs"), str(pid))
            with contextlib.suppress(OSError):
                os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))

    def kill_all(self, cg: SandboxCgroup, *, freeze_wait_s: float = 0.05) -> int:
        """SIGKILL every task in the sandbox, exec cgroups included (v2 ``cgroup.kill``;
        v1: freeze, pidfd-verified kill, thaw). Returns the tasks signalled (v1; v2: 0).

        ``freeze_wait_s``: how long v1 waits (sleeping: call it from a thread in async
        code) for the freeze to complete; a task the kernel holds in D state keeps it
        FREEZING for that long on every call. 0: ask and go on (the kill is exact either
        way; freezing only keeps fork bombs from outrunning it)."""
        if not self.present(cg):
            return 0
        if cg.version == 2:
            _write(os.path.join(cg.dirs["unified"], "cgroup.kill"), "1")
            return 0
        frozen = self._freeze_briefly(cg.dirs["freezer"], freeze_wait_s) \
            if "freezer" in cg.dirs else False
        self._unidle_for_exit(cg)
        try:
            return kill_verified(lambda: self._v1_sandbox_pids(cg))
        finally:
            if frozen:  # v1: a frozen task dies only once thawed
                try:
                    self.thaw(cg)
                except OSError:
                    pass

    # -- per-exec cgroups ------------------------------------------------------------
    def exec_cgroup(self, cg: SandboxCgroup, name: str) -> ExecCgroup:
        """mkdir the cgroup of one foreground exec under the sandbox's freezer (v1) or v2
        cgroup. Measured: mkdir ~9 us, rmdir ~7 us (v1 freezer)."""
        parent = cg.dirs["unified" if cg.version == 2 else "freezer"]
        d = os.path.join(parent, name)
        os.mkdir(d)
        return ExecCgroup(cg.version, d, cg)

    def exec_pids(self, ec: ExecCgroup) -> set[int]:
        return set(_procs(ec.dir))

    def kill_exec(self, ec: ExecCgroup, *, freeze_wait_s: float = 0.05) -> int:
        """SIGKILL every process of one exec (v2 ``cgroup.kill``; v1: freeze it, kill
        through verified pidfds, thaw). The sandbox's other processes are untouched.
        ``freeze_wait_s``: as for :meth:`kill_all`."""
        if ec.version == 2:
            try:
                _write(os.path.join(ec.dir, "cgroup.kill"), "1")
            except FileNotFoundError:
                pass
            return 0
        if not os.path.isdir(ec.dir):
            return 0
        frozen = self._freeze_briefly(ec.dir, freeze_wait_s)
        try:
            return kill_verified(lambda: self.exec_pids(ec))
        finally:
            if frozen:
                try:
                    _write(os.path.join(ec.dir, "freezer.state"), "THAWED")
                except OSError:
                    pass

    def remove_exec(self, ec: ExecCgroup) -> bool:
        """rmdir the exec's cgroup; False while processes are still in it."""
        try:
            os.rmdir(ec.dir)
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                return False
            raise
        return True

    # -- limits hit --------------------------------------------------------------------
    def pids_limit_hits(self, cg: SandboxCgroup) -> int:
        """How often a fork in the sandbox failed on its task limit (``pids.events``
        ``max``; v1 counts failed forks of the sandbox's tasks, v2 hits of its limit)."""
        try:
            text = _read(os.path.join(self._main(cg, "pids"), "pids.events"))
        except OSError:
            return 0
        return parse_keyed(text).get("max", 0)

    def pids_limit(self, cg: SandboxCgroup) -> tuple[int, int | None]:
        """``(pids.current, pids.max)`` of the sandbox (None: no limit)."""
        d = self._main(cg, "pids")
        try:
            cur = int(_read(os.path.join(d, "pids.current")).strip() or 0)
            mx = _read(os.path.join(d, "pids.max")).strip()
        except (OSError, ValueError):
            return 0, None
        return cur, None if mx == "max" else int(mx)

    def memory_stat(self, cg: SandboxCgroup) -> dict[str, int]:
        """The sandbox's parsed ``memory.stat`` ({} if the cgroup is gone)."""
        try:
            return parse_keyed(_read(os.path.join(self._main(cg, "memory"), "memory.stat")))
        except OSError:
            return {}

    def memory_shmem(self, cg: SandboxCgroup) -> int:
        """Bytes of tmpfs/shared memory charged to the sandbox (its /tmp, /dev/shm, a
        disk-capped upper): memory that no OOM kill gives back."""
        d = self._main(cg, "memory")
        try:
            stat = parse_keyed(_read(os.path.join(d, "memory.stat")))
        except OSError:
            return 0
        return stat.get("total_shmem", stat.get("shmem", 0))

    def remove(self, cg: SandboxCgroup, *, wait_s: float = 2.0) -> None:
        """rmdir every directory of the sandbox (exec cgroups below it first), waiting up
        to ``wait_s`` for exiting tasks to leave (rmdir answers EBUSY while a task is
        still inside); idempotent."""
        deadline = time.monotonic() + wait_s
        for ctrl, top in cg.dirs.items():
            if ctrl in cg.shared:
                continue          # a memory group's: removed with its last member
            for d in reversed(_subtree(top)):
                while True:
                    try:
                        os.rmdir(d)
                        break
                    except FileNotFoundError:
                        break
                    except OSError as exc:
                        if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                            raise BackendError(
                                f"cannot remove cgroup {d}: {exc}; tasks still inside: "
                                f"{sorted(_procs(d))}") from exc
                        time.sleep(0.001)

    def limit_total_pids(self, n: int) -> None:
        """``pids.max = n`` on the parent cgroup of all sandboxes: whatever each sandbox's
        own limit, together they cannot take the node's last pids (the edge and the host
        keep ``kernel.pid_max - n``)."""
        ctrl = "unified" if self.version == 2 else "pids"
        _write(os.path.join(self.layout.bases[ctrl], "pids.max"), str(n))

    def limit_total_memory(self, n: int | None) -> None:
        """Cap the memory of all this edge's sandboxes together at ``n`` bytes (None: no
        cap): v1 ``memory.limit_in_bytes`` of their parent (swap beyond it allowed, so a
        full node reclaims into swap instead of OOM-killing), v2 ``memory.max``. Used by
        the qos bench to put a node's worth of sandboxes under memory pressure without
        pressing the whole host."""
        if self.version == 2:
            _write(os.path.join(self.layout.bases["unified"], "memory.max"),
                   "max" if n is None else str(n))
            return
        _write(os.path.join(self.layout.bases["memory"], "memory.limit_in_bytes"),
               "-1" if n is None else str(n))

    def remove_base(self) -> None:
        """rmdir this edge's (empty) parent cgroups - for edge shutdown with no sandboxes
        left, tests and node decommission. v1: in every hierarchy (and the v2 mount of a
        hybrid layout), including those only runc makes a parent in. A parent that still holds sandboxes (EBUSY) is kept."""
        dirs = list(self.layout.bases.values())
        if self.layout.be_cpu:
            dirs.append(self.layout.be_cpu)
        if self.version == 1:
            try:
                dirs += all_leaf_dirs(_read("/proc/self/mountinfo"),
                                      _read("/proc/self/cgroup"), name=self.name)
            except OSError:
                pass
        for base in dict.fromkeys(dirs):
            try:
                os.rmdir(base)
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                    raise

    def list_sandboxes(self) -> list[str]:
        """Names of the sandbox cgroups currently under this edge's parent (leak checks)."""
        names: set[str] = set()
        for base in [*self.layout.bases.values(), *filter(None, [self.layout.be_cpu])]:
            try:
                names.update(e.name for e in os.scandir(base)
                             if e.is_dir() and not is_group_name(e.name))
            except FileNotFoundError:
                pass
        return sorted(names)
