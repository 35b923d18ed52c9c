"""QoS classes on a node (issue 22): latency-sensitive (``ls``) and best-effort (``be``).

A burst of best-effort work (environment builds, background judging, batch evaluation)
must not slow the latency-sensitive sandboxes an agent (and a GPU behind it) waits on.
What a class means on this node:

* **CPU.** A BE sandbox's cgroup gets the lowest weight (v1 ``cpu.shares=2``, v2
  ``cpu.weight=1``) and ``cpu.idle=1`` (the cgroup's group entity is SCHED_IDLE: every
  task in it, however it got there, runs only when nothing else wants the CPU; the file
  exists on v1 and v2 since Linux 5.15). Its processes also run SCHED_IDLE themselves:
  :func:`set_sched_idle` on the sandbox's init and exec helper (inherited by everything
  they fork) and on each exec's command. LS sandboxes keep a weight proportional to
  their request and an optional cap (``cpu_quota_milli``).
* **BE suppression** (:class:`CpuSuppressor`, v1 with the BE parent): SCHED_IDLE alone
  does not keep best-effort work off an LS sandbox's CPU when LS demand is near the
  node's capacity. Traced on this VM (``perf sched``, 2 vCPUs, HZ=250): two LS shells
  time-shared CPU 0 (each preempted for ~4 ms) while CPU 1 ran only the SCHED_IDLE BE
  spinners; BE got its whole quota (1 core) while LS work waited. The kernel places
  wakeups and forks by signals that count SCHED_IDLE tasks as load (the idle-CPU scan
  is skipped when the LLC's utilisation is high; fork balancing classifies a CPU
  running two idle tasks as overloaded), and a CPU running BE never goes idle, so the
  newidle balance that pulls a waiting task at once never runs - only the periodic
  balance at the next tick does. So the node caps BE sandboxes together to what LS
  leave: ``threshold x cores - LS use`` (:func:`be_cpu_cap`, re-read every
  ``interval_s``; shared among them by demand, :func:`share_be_cap`, in 10 ms slices),
  keeping real idle time on the node for the scheduler to place LS work into. The
  price: BE never uses more than ``threshold`` of the node, and yields when LS are busy.
* **Core scheduling** (``prctl(PR_SCHED_CORE)``) where the kernel has CONFIG_SCHED_CORE:
  :func:`core_sched_available` says whether it has (this dev VM's 6.18 kernel lacks it:
  EINVAL), reported in node info.
* **Memory.** BE gets soft limit 0 (v1 ``memory.soft_limit_in_bytes``: reclaimed first
  under global pressure), LS its limit; v2 ``memory.high`` at 15/16 of the limit
  throttles (reclaims) a sandbox before ``memory.max`` OOM-kills it. Under node memory
  pressure (PSI, ``/proc/pressure/memory``) :func:`plan_relief` picks BE sandboxes to
  pause-and-reclaim, idle longest first; :class:`PressureDriver` carries it out with an
  injected clock and reports each pause.
* **CPU pinning** (:class:`ClassCpus`, a node policy): the CPUs each class may run on,
  e.g. ``be=0`` keeps best-effort work off CPU 1 (reserved for LS) and ``ls=1;be=0``
  partitions the node. Per class rather than per sandbox (no spec field): what a core is
  reserved *for* is the node operator's decision, and one knob keeps placement honest.
  Enforced by the cpuset controller (v1: a per-sandbox cpuset cgroup, made only when the
  policy is set; v2: ``cpuset.cpus`` of the sandbox's cgroup), so a process inside cannot
  widen its affinity with ``sched_setaffinity``.
* **Block I/O.** A proportional weight (v2 ``io.weight``, v1 ``blkio.bfq.weight``) where
  the controller and the disk's scheduler support it (this VM: every disk runs ``none``,
  so weights would do nothing; written as optional), and per-sandbox throttle limits per
  class (:func:`parse_class_io`, a node policy ``qos_io``) on the disk pool's block
  device: v1 ``blkio.throttle.*``, v2 ``io.max``. Measured: on v1 they hold for reads,
  O_DIRECT and fsync'd writes, not for buffered writes the kernel writes back later.

Pure functions take numbers and text; the few syscalls are in small wrappers.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

import msgspec

from dsec.errors import InvalidArgument, PermissionDenied
from dsec.rmtree import unescape_mountinfo
from dsec.wire.spec import QosClass, SandboxSpec, qos_of

__all__ = [
    "CFS_PERIOD_US",
    "ClassCpus",
    "CpuSuppressPolicy",
    "CpuSuppressor",
    "IoLimits",
    "MemoryHeld",
    "PressureDriver",
    "PressurePolicy",
    "Psi",
    "QosView",
    "Relief",
    "be_cpu_cap",
    "core_sched_available",
    "core_sched_cookie",
    "format_cpulist",
    "idle_every_task",
    "io_writes",
    "memory_held",
    "mount_source",
    "node_qos",
    "parse_class_cpus",
    "parse_class_io",
    "parse_cpulist",
    "parse_psi",
    "plan_relief",
    "qos_features",
    "qos_policy_text",
    "qos_process",
    "qos_writes",
    "read_busy_ns",
    "read_psi",
    "sched_policy",
    "set_sched_idle",
    "share_be_cap",
]

CFS_PERIOD_US: Final = 100_000
BE_SHARES: Final = 2          # v1 minimum
BE_WEIGHT: Final = 1          # v2 minimum
IO_WEIGHT: Final[dict[str, int]] = {"ls": 100, "be": 10}   # v2 io.weight 1..10000
BFQ_WEIGHT: Final[dict[str, int]] = {"ls": 100, "be": 10}  # v1 blkio.bfq.weight 1..1000

# ------------------------------------------------------------------ cpu pinning
def parse_cpulist(text: str) -> frozenset[int]:
    """A kernel CPU list (``"0-3,6"``, as in ``cpuset.cpus``) -> CPU numbers (pure).
    Raises :class:`InvalidArgument` naming what is wrong."""
    out: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise InvalidArgument(f"CPU list {text!r}: {part!r} is not a number or a range "
                                  "like 0-3", field="qos_cpus") from None
        if a < 0 or b < a or b - a > 65535:
            raise InvalidArgument(f"CPU list {text!r}: range {part!r} is empty or "
                                  "negative", field="qos_cpus")
        out.update(range(a, b + 1))
    return frozenset(out)


def format_cpulist(cpus: frozenset[int] | set[int]) -> str:
    """CPU numbers -> the kernel's compact list (``{0,1,2,5}`` -> ``"0-2,5"``) (pure)."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


@dataclass(frozen=True, slots=True)
class ClassCpus:
    """The CPUs each class may run on (None: every CPU the node gives its sandboxes),
    as kernel CPU lists already checked against the node's CPUs."""

    ls: str | None = None
    be: str | None = None

    def of(self, qos: QosClass) -> str | None:
        return self.ls if qos == "ls" else self.be


def parse_class_cpus(text: str, node_cpus: frozenset[int]) -> ClassCpus:
    """``"be=0"`` / ``"ls=1;be=0"`` (``;`` or spaces between classes) -> :class:`ClassCpus`,
    each list a non-empty subset of ``node_cpus`` (the CPUs the edge's own cpuset
    allows) (pure). What it refuses it names, with the node's CPUs."""
    have = format_cpulist(node_cpus)
    got: dict[str, str] = {}
    for item in text.replace(";", " ").split():
        cls, eq, cpus = item.partition("=")
        if cls not in ("ls", "be") or not eq:
            raise InvalidArgument(f"qos_cpus {text!r}: {item!r} must be ls=CPUS or be=CPUS "
                                  "(e.g. 'be=0' or 'ls=1;be=0')", field="qos_cpus")
        if cls in got:
            raise InvalidArgument(f"qos_cpus {text!r} names class {cls!r} twice",
                                  field="qos_cpus")
        want = parse_cpulist(cpus)
        if not want:
            raise InvalidArgument(f"qos_cpus {text!r}: class {cls!r} gets no CPU",
                                  field="qos_cpus")
        if not want <= node_cpus:
            raise InvalidArgument(
                f"qos_cpus {text!r}: CPUs {format_cpulist(want - node_cpus)} of class "
                f"{cls!r} are not among this node's CPUs {have} (the edge's cpuset)",
                field="qos_cpus")
        got[cls] = format_cpulist(want)
    return ClassCpus(ls=got.get("ls"), be=got.get("be"))


# ------------------------------------------------------------------ block I/O limits
@dataclass(frozen=True, slots=True)
class IoLimits:
    """Per-sandbox block I/O throttle on the node's sandbox disk (bytes/s, I/O ops/s;
    None: unlimited). Where it holds (measured, docs/container.md "Block I/O"): on cgroup
    v1 only on I/O a sandbox's task submits itself - reads, O_DIRECT writes, writes it
    fsync()s - never on buffered writes left to the kernel's background writeback."""

    rbps: int | None = None
    wbps: int | None = None
    riops: int | None = None
    wiops: int | None = None


_UNITS: Final = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_class_io(text: str) -> dict[QosClass, IoLimits]:
    """``"be:wbps=10M,rbps=20M;ls:riops=2000"`` -> {class: :class:`IoLimits`} (pure;
    K/M/G are binary multiples). What it refuses it names."""
    out: dict[QosClass, IoLimits] = {}
    for item in text.replace(";", " ").split():
        cls, colon, rest = item.partition(":")
        if cls not in ("ls", "be") or not colon or not rest:
            raise InvalidArgument(f"qos_io {text!r}: {item!r} must be CLASS:KEY=N,... with "
                                  "CLASS ls or be (e.g. 'be:wbps=10M,rbps=20M')",
                                  field="qos_io")
        if cls in out:
            raise InvalidArgument(f"qos_io {text!r} names class {cls!r} twice", field="qos_io")
        vals: dict[str, int] = {}
        for kv in rest.split(","):
            k, eq, v = kv.partition("=")
            unit = v[-1:].lower() if v[-1:].isalpha() else ""
            num = v[:-1] if unit else v
            if k not in ("rbps", "wbps", "riops", "wiops") or not eq or unit not in _UNITS \
                    or not num.isdigit() or int(num) == 0:
                raise InvalidArgument(
                    f"qos_io {text!r}: {kv!r} must be rbps|wbps|riops|wiops=N (N > 0, "
                    "optional K/M/G)", field="qos_io")
            vals[k] = int(num) * _UNITS[unit]
        out["ls" if cls == "ls" else "be"] = IoLimits(
            rbps=vals.get("rbps"), wbps=vals.get("wbps"), riops=vals.get("riops"),
            wiops=vals.get("wiops"))
    return out


def io_writes(version: Literal[1, 2], device: str, limits: IoLimits) -> list[QosWrite]:
    """The throttle writes for one sandbox on block device ``device`` (``"7:0"``) (pure):
    v1 ``blkio.throttle.*_device``, v2 one ``io.max`` line."""
    if version == 2:
        parts = [f"{k}={'max' if v is None else v}" for k, v in
                 (("rbps", limits.rbps), ("wbps", limits.wbps),
                  ("riops", limits.riops), ("wiops", limits.wiops))]
        return [("unified", "io.max", f"{device} {' '.join(parts)}", False)]
    out: list[QosWrite] = []
    for fname, v in (("read_bps", limits.rbps), ("write_bps", limits.wbps),
                     ("read_iops", limits.riops), ("write_iops", limits.wiops)):
        if v is not None:
            out.append(("blkio", f"blkio.throttle.{fname}_device", f"{device} {v}", False))
    return out


def mount_source(mountinfo: str, path: str) -> str | None:
    """The source (``/dev/loop3``) of the mount at exactly ``path`` in a
    ``/proc/self/mountinfo`` text, the last one listed (the visible one) (pure)."""
    found = None
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) >= 5 and len(rfields) >= 2 and unescape_mountinfo(fields[4]) == path:
            found = rfields[1]
    return found


#: A cgroup write: (controller key, file, value, optional). Optional writes are skipped
#: when the file does not exist (an older kernel's cpu.idle, an unmanaged io controller).
QosWrite = tuple[str, str, str, bool]


def qos_writes(version: Literal[1, 2], qos: QosClass, *, cpu_milli: int,
               memory_bytes: int, cpu_quota_milli: int | None = None,
               cpus: str | None = None, mems: str | None = None) -> list[QosWrite]:
    """The cgroup writes that make ``qos`` of a sandbox, applied after the governor's
    limit writes (so a BE sandbox's weight replaces the request-proportional one) (pure).

    ``cpu_quota_milli`` replaces the cap at ``cpu_milli`` (None: keep it). ``cpus`` /
    ``mems``: the sandbox's cpuset (None: not pinned; v1 needs both written before a task
    can join a cpuset cgroup, so the governor passes the node's when the class is not
    pinned but the cpuset hierarchy is managed)."""
    out: list[QosWrite] = []
    if version == 2 and cpus is not None:
        out.append(("unified", "cpuset.cpus", cpus, False))
    elif version == 1 and cpus is not None:
        out += [("cpuset", "cpuset.mems", mems or "0", False),
                ("cpuset", "cpuset.cpus", cpus, False)]
    if version == 2:
        if qos == "be":
            out += [("unified", "cpu.weight", str(BE_WEIGHT), False),
                    ("unified", "cpu.idle", "1", True)]
        if cpu_quota_milli is not None:
            quota = max(1000, cpu_quota_milli * CFS_PERIOD_US // 1000)
            out.append(("unified", "cpu.max", f"{quota} {CFS_PERIOD_US}", False))
        high = memory_bytes * 15 // 16   # throttled (reclaimed) before OOM-killed
        out += [("unified", "memory.high", str(high), False),
                ("unified", "io.weight", f"default {IO_WEIGHT[qos]}", True)]
        return out
    if qos == "be":
        out += [("cpu", "cpu.shares", str(BE_SHARES), False),
                ("cpu", "cpu.idle", "1", True)]
    if cpu_quota_milli is not None:
        quota = max(1000, cpu_quota_milli * CFS_PERIOD_US // 1000)
        out.append(("cpu", "cpu.cfs_quota_us", str(quota), False))
    soft = 0 if qos == "be" else memory_bytes
    out += [("memory", "memory.soft_limit_in_bytes", str(soft), False),
            ("blkio", "blkio.bfq.weight", str(BFQ_WEIGHT[qos]), True)]
    return out


# ------------------------------------------------------------------ scheduling policy
def set_sched_idle(pid: int) -> bool:
    """Put ``pid`` under SCHED_IDLE (children it forks afterwards inherit it). False if
    the process is gone."""
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except ProcessLookupError:
        return False
    return True


def idle_every_task(cgroup_dir: str) -> int:
    """SCHED_IDLE for every thread already in a cgroup (its ``tasks`` file, v1; v2
    ``cgroup.threads``), returning how many were set: for runtimes that start
    multi-threaded processes the edge did not fork (gVisor's Sentry and gofer, Go
    programs): setting the main thread's policy reaches only threads created after it
    (red team 25 C1: most of a BE gVisor sandbox's threads ran SCHED_OTHER). Threads they
    create from now on inherit it. Threads gone meanwhile are skipped."""
    n = 0
    for name in ("tasks", "cgroup.threads"):
        try:
            with open(os.path.join(cgroup_dir, name)) as f:
                tids = [int(t) for t in f.read().split()]
        except (OSError, ValueError):
            continue
        for tid in tids:
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                n += 1
            except OSError:
                pass
        break
    return n


def sched_policy(pid: int) -> int:
    """``pid``'s scheduling policy (``os.SCHED_OTHER``, ``os.SCHED_IDLE``, ...)."""
    return os.sched_getscheduler(pid)


PR_SCHED_CORE: Final = 62
PR_SCHED_CORE_GET: Final = 0
PR_SCHED_CORE_CREATE: Final = 1
PIDTYPE_TGID: Final = 1

_libc = ctypes.CDLL(None, use_errno=True)


def core_sched_available() -> bool:
    """Whether the kernel has core scheduling (CONFIG_SCHED_CORE): ``PR_SCHED_CORE_GET``
    on ourselves answers; EINVAL means the kernel was built without it."""
    cookie = ctypes.c_ulong(0)
    rc = _libc.prctl(PR_SCHED_CORE, PR_SCHED_CORE_GET, 0, PIDTYPE_TGID,
                     ctypes.byref(cookie))
    return bool(rc == 0 or ctypes.get_errno() != errno.EINVAL)


def core_sched_cookie(pid: int) -> bool:
    """Give ``pid``'s thread group a core-scheduling cookie of its own (its SMT sibling
    then never runs another sandbox's task; children inherit it). False where the kernel
    lacks core scheduling or the process is gone."""
    rc = _libc.prctl(PR_SCHED_CORE, PR_SCHED_CORE_CREATE, pid, PIDTYPE_TGID, 0)
    return bool(rc == 0)


def node_qos(spec: SandboxSpec, be_only: Sequence[str], node: str) -> SandboxSpec:
    """The edge door's QoS rule (pure): a resolved spec's class, "be" for a project
    under one of ``be_only`` (a node setting, ``dsec edge --qos-be-only``), else "ls"
    when unset; "ls" asked there is refused (:class:`PermissionDenied`)."""
    project = spec.project or ""
    restricted = next((p for p in be_only
                       if project == p or project.startswith(p + "/")), None)
    if spec.qos is None:
        return msgspec.structs.replace(spec, qos="be" if restricted else "ls")
    if spec.qos == "ls" and restricted is not None:
        raise PermissionDenied(
            f"qos='ls' is refused on node {node} for project {project!r}: the node runs "
            f"project {restricted!r} and its subprojects best-effort only (--qos-be-only); "
            "ask for qos='be' or leave qos unset", field="qos")
    return spec


_CORE_SCHED: bool | None = None


def qos_process(spec: SandboxSpec, pid: int) -> None:
    """What a sandbox's class means for one of its processes the edge started (its init,
    its exec helper, a command forked by the zygote): BE runs SCHED_IDLE; where the
    kernel has core scheduling, every such process gets a cookie of its own, so no other
    sandbox's task shares its core's SMT sibling. Children inherit both."""
    global _CORE_SCHED
    if qos_of(spec) == "be":
        set_sched_idle(pid)
    if _CORE_SCHED is None:
        _CORE_SCHED = core_sched_available()
    if _CORE_SCHED:
        core_sched_cookie(pid)


_FEATURES: dict[str, bool] | None = None


def qos_features(sys_root: str = "/sys") -> dict[str, bool]:
    """What this kernel offers QoS classes (reported in node info, computed once):
    ``core_sched`` (CONFIG_SCHED_CORE; this dev VM: no), ``cpu_idle`` (the cgroup
    ``cpu.idle`` file, v1 or v2), ``psi`` (/proc/pressure/memory), ``io_weight`` (some
    disk runs bfq, the scheduler that honours blkio/io weights; this VM: ``none``)."""
    global _FEATURES
    if _FEATURES is not None:
        return dict(_FEATURES)
    cg = os.path.join(sys_root, "fs", "cgroup")
    io = False
    try:
        for dev in os.listdir(os.path.join(sys_root, "block")):
            try:
                with open(os.path.join(sys_root, "block", dev, "queue", "scheduler")) as f:
                    io = io or "[bfq]" in f.read()
            except OSError:
                continue
    except OSError:
        pass
    _FEATURES = {
        "core_sched": core_sched_available(),
        "cpu_idle": any(os.path.exists(os.path.join(cg, d, "cpu.idle"))
                        for d in ("cpu", "cpu,cpuacct", "")),
        "psi": os.path.exists("/proc/pressure/memory"),
        "io_weight": io,
    }
    return dict(_FEATURES)


# ------------------------------------------------------------------ memory held
@dataclass(frozen=True, slots=True)
class MemoryHeld:
    """What a sandbox's memory cgroup holds, by kind: anonymous memory (RSS), page
    cache charged to it (file pages, including what its writable layer caches), and
    shared memory (tmpfs files such as /tmp and /dev/shm, SysV and POSIX segments it
    created: all shmem pages charged to the cgroup)."""

    rss: int
    cache: int
    shm: int


def memory_held(version: Literal[1, 2], stat: dict[str, int]) -> MemoryHeld:
    """Split a ``memory.stat`` (parsed) into :class:`MemoryHeld` (pure). v1 uses the
    ``total_*`` (hierarchical: the sandbox's exec cgroups included) counters."""
    if version == 2:
        return MemoryHeld(rss=stat.get("anon", 0), cache=stat.get("file", 0),
                          shm=stat.get("shmem", 0))
    return MemoryHeld(rss=stat.get("total_rss", stat.get("rss", 0)),
                      cache=stat.get("total_cache", stat.get("cache", 0)),
                      shm=stat.get("total_shmem", stat.get("shmem", 0)))


# ------------------------------------------------------------------ pressure
@dataclass(frozen=True, slots=True)
class Psi:
    """``/proc/pressure/memory``: share of wall time (percent) some / all tasks stalled
    on memory over 10 s and 60 s."""

    some_avg10: float
    some_avg60: float
    full_avg10: float
    full_avg60: float


def parse_psi(text: str) -> Psi:
    """Parse a PSI file (pure). A missing ``full`` line (the cpu file) reads as 0."""
    vals: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        vals[kind] = {k: float(v) for k, _, v in (f.partition("=") for f in rest.split())
                      if k.startswith("avg")}
    some, full = vals.get("some", {}), vals.get("full", {})
    return Psi(some_avg10=some.get("avg10", 0.0), some_avg60=some.get("avg60", 0.0),
               full_avg10=full.get("avg10", 0.0), full_avg60=full.get("avg60", 0.0))


def read_psi(path: str = "/proc/pressure/memory") -> Psi | None:
    """The node's memory pressure, or None where the kernel has no PSI."""
    try:
        with open(path) as f:
            return parse_psi(f.read())
    except (FileNotFoundError, OSError):
        return None


@dataclass(frozen=True, slots=True)
class QosView:
    """What the pressure policy knows of one sandbox."""

    id: str
    qos: QosClass
    state: str                 # "running", "paused", ...
    last_active_at: float      # unix seconds of its last operation
    memory_bytes: int          # resident now
    #: its memory group ("" for a memcg of its own, dsec.edge.memgroups): a member's
    #: memory is reclaimed only once every member is paused
    group: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class PressurePolicy:
    """When the node is under memory pressure and how hard to relieve it.

    ``some_avg10_pct``: stalled-time share (10 s average) that counts as pressure;
    ``relieve_bytes``: resident memory to pause away per round; ``max_per_round``:
    sandboxes paused per round at most; ``min_idle_s``: a BE sandbox active more recently
    than this is left alone (it is mid-step); ``cooldown_s``: wait between rounds, so PSI
    (a 10 s average) can show the effect of the last one."""

    some_avg10_pct: float = 10.0
    full_avg10_pct: float = 2.0
    relieve_bytes: int = 512 << 20
    max_per_round: int = 8
    min_idle_s: float = 5.0
    cooldown_s: float = 10.0


@dataclass(frozen=True, slots=True)
class Relief:
    """One round's decision: pause these BE sandboxes (in order), and why."""

    pause: tuple[str, ...]
    reason: str


def under_pressure(psi: Psi, policy: PressurePolicy) -> bool:
    return (psi.some_avg10 >= policy.some_avg10_pct
            or psi.full_avg10 >= policy.full_avg10_pct)


def plan_relief(psi: Psi, views: Sequence[QosView], *, now: float,
                policy: PressurePolicy) -> Relief:
    """Which sandboxes to pause-and-reclaim now (pure). Nothing below the thresholds.
    Only running BE sandboxes idle at least ``min_idle_s`` qualify, idle longest first,
    until ``relieve_bytes`` of resident memory is covered or ``max_per_round`` are
    picked. LS sandboxes are never paused for pressure: a latency-sensitive sandbox is
    what the pressure is relieved *for*.

    A memory group (``QosView.group``) is one unit: its memory is reclaimed only once
    every member is paused, so it qualifies only when every member that runs does, and
    then all of them are picked together and its memory counted once. A member alone
    was paused for nothing (red team 26, D)."""
    if not under_pressure(psi, policy):
        return Relief((), "")

    def idle_be(v: QosView) -> bool:
        return v.qos == "be" and v.state == "running" \
            and now - v.last_active_at >= policy.min_idle_s

    mates: dict[str, list[QosView]] = {}
    for v in views:
        if v.group:
            mates.setdefault(v.group, []).append(v)
    cands = sorted((v for v in views if idle_be(v)),
                   key=lambda v: (v.last_active_at, -v.memory_bytes, v.id))
    out: list[str] = []
    freed = 0
    taken: set[str] = set()
    for v in cands:
        if len(out) >= policy.max_per_round or freed >= policy.relieve_bytes:
            break
        if not v.group:
            out.append(v.id)
            freed += v.memory_bytes
            continue
        if v.group in taken:
            continue
        taken.add(v.group)
        group = mates[v.group]
        if not all(idle_be(m) or m.state == "paused" for m in group):
            continue                  # a member is active: pausing the rest frees nothing
        running = sorted(m.id for m in group if m.state == "running")
        if out and len(out) + len(running) > policy.max_per_round:
            continue
        out += running
        freed += sum(m.memory_bytes for m in group)
    reason = (f"memory pressure: some avg10={psi.some_avg10:.1f}% full avg10="
              f"{psi.full_avg10:.1f}% (thresholds {policy.some_avg10_pct:g}%/"
              f"{policy.full_avg10_pct:g}%); pausing {len(out)} best-effort sandbox(es) "
              f"holding {freed >> 20} MiB, idle longest first")
    return Relief(tuple(out), reason)


class PressureDriver:
    """Runs :func:`plan_relief` on a schedule: ``tick()`` reads PSI, asks the policy,
    pauses (with reclaim) what it picked, then notifies once per paused sandbox. Every
    dependency is injected (PSI reader, the sandboxes' views, pause, notify, clock), so
    the driver is tested without a loaded machine. The caller (the edge node) calls
    ``tick()`` every few seconds."""

    def __init__(self, *, read: Callable[[], Psi | None],
                 views: Callable[[], Sequence[QosView]],
                 pause: Callable[[str], Awaitable[None]],
                 notify: Callable[[str, str], None],
                 clock: Callable[[], float],
                 policy: PressurePolicy | None = None) -> None:
        self.read, self.views, self.pause, self.notify = read, views, pause, notify
        self.clock = clock
        self.policy = policy or PressurePolicy()
        self._last_round: float | None = None
        self.paused: list[str] = []

    async def tick(self) -> Relief:
        now = self.clock()
        if self._last_round is not None and now - self._last_round < self.policy.cooldown_s:
            return Relief((), "cooling down")
        psi = self.read()
        if psi is None:
            return Relief((), "no PSI on this kernel")
        relief = plan_relief(psi, self.views(), now=now, policy=self.policy)
        if not relief.pause:
            return relief
        self._last_round = now
        for sid in relief.pause:
            try:
                await self.pause(sid)
            except Exception as exc:  # noqa: BLE001 - one sandbox's failure stops no other
                self.notify(sid, f"memory pressure: pause failed: {exc}")
                continue
            self.paused.append(sid)
            self.notify(sid, relief.reason)
        return relief


# ------------------------------------------------------------------ BE suppression
@dataclass(frozen=True, slots=True)
class CpuSuppressPolicy:
    """How much of the node best-effort work may use: at most ``threshold`` of the
    node's cores less what LS work (everything not BE: LS sandboxes, the edge, the
    host) used, never below ``floor_cores`` (BE always makes some progress), decided
    every ``interval_s``. LS use is taken as the larger of the last interval's and the
    previous estimate halved (a burst is remembered for a few intervals, a lull is not
    believed at once)."""

    threshold: float = 0.65
    floor_cores: float = 0.02
    interval_s: float = 0.25
    #: the CFS period of a suppressed BE sandbox: its share comes in slices of at most
    #: this long, so an LS step that meets BE work waits a slice, not a 100 ms period's
    #: whole quota at once. Measured (qos bench, 50 % BE, suppression 0.65): exec-step
    #: p99 inflation 1.48x with the default 100 ms period, 0.88-1.20x with 10 ms (four runs).
    period_us: int = 10_000

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise InvalidArgument(f"be cpu threshold {self.threshold} must be in (0, 1]",
                                  field="threshold")
        if self.floor_cores < 0 or self.interval_s <= 0:
            raise InvalidArgument("be cpu floor must be >= 0 and its interval > 0",
                                  field="floor_cores")


def be_cpu_cap(cores: float, ls_cores: float, policy: CpuSuppressPolicy) -> float:
    """The CPU cap of all BE sandboxes together, in cores, given the node's cores and
    LS use (pure)."""
    return max(policy.floor_cores, min(cores, cores * policy.threshold - ls_cores))


def share_be_cap(cap: float, own: Mapping[str, float], used: Mapping[str, float], *,
                 min_demand: float = 0.01) -> dict[str, float]:
    """The BE cap shared among BE sandboxes by *demand* (pure): each one's demand is
    twice what it used over the last interval (room to grow: a sandbox using all of its
    share doubles it per interval), at least ``min_demand``, at most its own cap; the
    cap is then shared in proportion to demand, nobody above its own cap. By declared
    caps instead, one idle sandbox declaring 1,024 cores left a busy 1-core one 0.001
    of a 1.3-core budget that nobody used (red team 25 A1); an idle or frozen sandbox
    now holds ``min_demand`` and gets more back within intervals once it works."""
    demand = {s: min(o, max(2.0 * used.get(s, 0.0), min_demand)) for s, o in own.items()}
    total = sum(demand.values())
    if total <= 0:
        return dict.fromkeys(own, 0.0)
    scale = cap / total
    out = {s: min(own[s], d * scale) for s, d in demand.items()}
    # what the own caps clipped goes to the others, in proportion again (a few rounds)
    for _ in range(4):
        left = cap - sum(out.values())
        free = {s: own[s] - v for s, v in out.items() if own[s] - v > 1e-9}
        if left <= 1e-9 or not free:
            break
        weight = sum(demand[s] for s in free)
        for s in free:
            out[s] = min(own[s], out[s] + left * demand[s] / weight)
    return out


def read_busy_ns(text: str, hz: int = 100) -> int:
    """CPU time the whole node spent not idle, in ns, from ``/proc/stat``'s first line
    (pure): user, nice, system, irq, softirq, steal (not idle, iowait, guest - guest
    time is already in user)."""
    f = text.split("\n", 1)[0].split()
    if not f or f[0] != "cpu":
        raise ValueError("not /proc/stat: its first line is not the 'cpu' total")
    t = [int(x) for x in f[1:9]] + [0] * max(0, 8 - len(f[1:9]))
    user, nice, system, _idle, _iowait, irq, softirq, steal = t[:8]
    return (user + nice + system + irq + softirq + steal) * (1_000_000_000 // hz)


class CpuSuppressor:
    """Runs :func:`be_cpu_cap` on a schedule: ``tick()`` reads the node's busy time and
    the BE sandboxes' CPU time (both cumulative ns), estimates LS use over the interval,
    and sets the cap when it moved by more than 5 % (a write is a cgroup file write).
    Everything is injected (readers, the setter, the clock); the backend calls
    ``tick()`` every ``policy.interval_s`` while it has BE sandboxes, and ``release()``
    (no cap) when the last one goes."""

    def __init__(self, *, cores: float, busy_ns: Callable[[], int],
                 be_ns: Callable[[], int], set_cap: Callable[[float | None], None],
                 clock: Callable[[], float], policy: CpuSuppressPolicy | None = None) -> None:
        self.cores = cores
        self.busy_ns, self.be_ns, self.set_cap, self.clock = busy_ns, be_ns, set_cap, clock
        self.policy = policy or CpuSuppressPolicy()
        self._last: tuple[float, int, int] | None = None
        self.ls_cores = 0.0
        self.cap: float | None = None      # cores; None: uncapped

    def tick(self) -> float | None:
        now, busy, be = self.clock(), self.busy_ns(), self.be_ns()
        last, self._last = self._last, (now, busy, be)
        if last is None or now <= last[0]:
            return self.cap
        wall_ns = (now - last[0]) * 1e9
        busy_cores = (busy - last[1]) / wall_ns
        ls = max(0.0, busy_cores - max(0, be - last[2]) / wall_ns)
        self.ls_cores = max(ls, self.ls_cores * 0.5)
        cap = be_cpu_cap(self.cores, self.ls_cores, self.policy)
        if self.cap is not None and busy_cores >= 0.95 * self.cores:
            # A saturated node hides LS demand (what BE took, LS may have wanted): the
            # cap halves until the node has idle time again - without this it crept
            # down one interval at a time (measured: 1.57 -> 0.05 cores over 1.5 s).
            cap = max(self.policy.floor_cores, min(cap, self.cap * 0.5))  # (24 B2)
        if self.cap is None or abs(cap - self.cap) > 0.05 * max(self.cap, 0.1):
            self.set_cap(cap)
            self.cap = cap
        return self.cap

    def release(self) -> None:
        """No BE sandbox left: no cap, and the next tick starts afresh."""
        if self.cap is not None:
            self.set_cap(None)
        self.cap, self._last, self.ls_cores = None, None, 0.0


# ------------------------------------------------------------------ node info
def qos_policy_text(cpus: ClassCpus | None, io: Mapping[QosClass, IoLimits],
                    io_device: str = "", pressure: PressurePolicy | None = None,
                    be_only: tuple[str, ...] = ()) -> dict[str, str]:
    """The QoS policies a node applies, as node info reports them (pure): ``cpus.ls`` /
    ``cpus.be`` (the CPU list a class is pinned to; absent: every CPU), ``io.ls`` /
    ``io.be`` (``rbps=N,wbps=N,riops=N,wiops=N``, bytes or ops per second, the limits
    set) with ``io.device`` (``major:minor`` of the sandbox disk they apply on),
    ``pressure`` (the PSI thresholds and relief of :class:`PressurePolicy`; absent: off)
    and ``be_only`` (projects run best-effort only, comma-separated)."""
    out: dict[str, str] = {}
    classes: tuple[QosClass, ...] = ("ls", "be")
    if cpus is not None:
        for cls in classes:
            cl = cpus.of(cls)
            if cl is not None:
                out[f"cpus.{cls}"] = cl
    for cls in classes:
        lim = io.get(cls)
        if lim is None:
            continue
        parts = [f"{k}={v}" for k in ("rbps", "wbps", "riops", "wiops")
                 if (v := getattr(lim, k)) is not None]
        if parts:
            out[f"io.{cls}"] = ",".join(parts)
    if io_device and any(k.startswith("io.") for k in out):
        out["io.device"] = io_device
    if pressure is not None:
        out["pressure"] = (f"some_avg10>={pressure.some_avg10_pct:g}%,"
                           f"full_avg10>={pressure.full_avg10_pct:g}%,"
                           f"relieve={pressure.relieve_bytes},"
                           f"max_per_round={pressure.max_per_round},"
                           f"min_idle_s={pressure.min_idle_s:g}")
    if be_only:
        out["be_only"] = ",".join(be_only)
    return out
