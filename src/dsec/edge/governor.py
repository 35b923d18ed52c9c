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

import errno
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from dsec.errors import BackendError

__all__ = [
    "CgroupLayout",
    "Governor",
    "Limits",
    "SandboxCgroup",
    "all_leaf_dirs",
    "detect_layout",
    "enable_favordynmods",
    "ensure_compressed_swap",
    "limit_writes",
    "parse_mountinfo",
    "parse_proc_cgroup",
]

CgroupVersion = Literal[1, 2]
V1_CONTROLLERS: tuple[str, ...] = ("memory", "cpu", "cpuacct", "pids", "freezer")
V1_REQUIRED: tuple[str, ...] = ("memory", "cpu", "pids", "freezer")
V2_REQUIRED: tuple[str, ...] = ("memory", "cpu", "pids")
CFS_PERIOD_US = 100_000


@dataclass(frozen=True, slots=True)
class Limits:
    """What a sandbox may use: millicores, bytes of memory (no swap beyond it), tasks."""

    cpu_milli: int
    memory_bytes: int
    pids_max: int | None


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


@dataclass(frozen=True, slots=True)
class SandboxCgroup:
    """The cgroup directories of one sandbox (controller -> absolute path)."""

    version: CgroupVersion
    dirs: dict[str, str] = field(default_factory=dict)

    @property
    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files a new task of this sandbox is written into."""
        return [os.path.join(d, "cgroup.procs") for d in self.dirs.values()]


def parse_mountinfo(text: str) -> list[Mount]:
    """The cgroup/cgroup2 mounts listed in a ``/proc/self/mountinfo`` text."""
    out = []
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 3 or rfields[0] not in ("cgroup", "cgroup2"):
            continue
        out.append(Mount(root=fields[3], mountpoint=fields[4].replace("\\040", " "),
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
    return CgroupLayout(version=1, bases=bases, memsw=memsw)


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
            out.append(os.path.join(_join(m, path), f"dsec-{name}"))
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


def enable_favordynmods(mountinfo: str) -> bool:
    """Turn on ``favordynmods`` via the cgroup2 mount (global for all hierarchies; it
    removes the RCU grace period from every task migration). False if it cannot."""
    from dsec.edge.backends.container import linux

    for m in parse_mountinfo(mountinfo):
        if m.fstype == "cgroup2":
            if "favordynmods" in m.super_options:
                return True
            try:
                linux.mount(None, m.mountpoint, None, linux.MS_REMOUNT, "favordynmods")
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


class Governor:
    """Creates, limits, freezes, reclaims and removes sandbox cgroups."""

    def __init__(self, *, name: str = "dsec", layout: CgroupLayout | None = None,
                 favor_dynmods: bool = True) -> None:
        self.name = name
        mountinfo = _read("/proc/self/mountinfo")
        if favor_dynmods:
            self.favordynmods = enable_favordynmods(mountinfo)
        self.layout = layout or detect_layout(
            mountinfo, _read("/proc/self/cgroup"), name=name,
            v2_controllers=lambda d: set(_read(os.path.join(d, "cgroup.controllers")).split())
            if os.path.exists(os.path.join(d, "cgroup.controllers")) else set())
        self.version: CgroupVersion = self.layout.version
        if self.version == 2:
            self._prepare_v2()
        for base in self.layout.bases.values():
            os.makedirs(base, exist_ok=True)
        if self.version == 2:
            self._enable_subtree(self.layout.bases["unified"])

    # -- v2 delegation ---------------------------------------------------------------
    def _enable_subtree(self, d: str) -> None:
        want = " ".join(f"+{c}" for c in V2_REQUIRED)
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
            leaf = os.path.join(own, "dsec-edge")
            os.makedirs(leaf, exist_ok=True)
            for pid in procs:
                try:
                    _write(os.path.join(leaf, "cgroup.procs"), pid)
                except OSError:
                    pass  # exited meanwhile, or a kernel thread
        self._enable_subtree(own)

    # -- per sandbox -----------------------------------------------------------------
    def paths(self, sid: str) -> SandboxCgroup:
        return SandboxCgroup(self.version,
                             {c: os.path.join(b, sid) for c, b in self.layout.bases.items()})

    def create(self, sid: str, limits: Limits) -> SandboxCgroup:
        """mkdir the sandbox's cgroups and apply ``limits``; on failure remove them."""
        cg = self.paths(sid)
        try:
            for d in cg.dirs.values():
                os.mkdir(d)
            for ctrl, fname, value in limit_writes(self.version, limits,
                                                   memsw=self.layout.memsw):
                _write(os.path.join(cg.dirs[ctrl], fname), value)
        except OSError as exc:
            self.remove(cg)
            raise BackendError(f"cannot create cgroups for sandbox {sid} under "
                               f"{sorted(self.layout.bases.values())}: {exc}") from exc
        return cg

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

    def pids_limit_hits(self, cg: SandboxCgroup) -> int:
        """How many forks in this sandbox were refused because it reached ``pids.max``
        (the ``max`` counter of ``pids.events``, v1 and v2)."""
        try:
            text = _read(os.path.join(self._main(cg, "pids"), "pids.events"))
        except FileNotFoundError:
            return 0
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == "max":
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

    def stats(self, cg: SandboxCgroup) -> tuple[int, int, float, int]:
        """``(memory_bytes, memory_peak_bytes, cpu_seconds, pids)``."""
        def num(path: str) -> int:
            try:
                return int(_read(path).split()[0])
            except (OSError, ValueError, IndexError):
                return 0
        if cg.version == 2:
            d = cg.dirs["unified"]
            cpu_us = 0
            try:
                for line in _read(os.path.join(d, "cpu.stat")).splitlines():
                    if line.startswith("usage_usec"):
                        cpu_us = int(line.split()[1])
            except OSError:
                pass
            return (num(os.path.join(d, "memory.current")), num(os.path.join(d, "memory.peak")),
                    cpu_us / 1e6, num(os.path.join(d, "pids.current")))
        cpu_ns = num(os.path.join(cg.dirs["cpuacct"], "cpuacct.usage")) if "cpuacct" in cg.dirs \
            else 0
        return (num(os.path.join(cg.dirs["memory"], "memory.usage_in_bytes")),
                num(os.path.join(cg.dirs["memory"], "memory.max_usage_in_bytes")),
                cpu_ns / 1e9, num(os.path.join(cg.dirs["pids"], "pids.current")))

    def kill_all(self, cg: SandboxCgroup) -> None:
        """SIGKILL every task in the sandbox (v2 ``cgroup.kill``; v1: freeze, kill the
        listed tasks, thaw - freezing first means nothing can fork past the list)."""
        if not self.exists(cg):
            return
        if cg.version == 2:
            _write(os.path.join(cg.dirs["unified"], "cgroup.kill"), "1")
            return
        try:
            self.freeze(cg)
        except OSError:
            pass
        for pid in self.pids(cg):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.thaw(cg)
        except OSError:
            pass

    def remove(self, cg: SandboxCgroup, *, wait_s: float = 2.0) -> None:
        """rmdir every directory of the sandbox, waiting up to ``wait_s`` for exiting
        tasks to leave (rmdir answers EBUSY while a task is still inside); idempotent."""
        deadline = time.monotonic() + wait_s
        for d in cg.dirs.values():
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise BackendError(f"cannot remove cgroup {d}: {exc}; tasks still "
                                           f"inside: {_read(d + '/cgroup.procs').split()}"
                                           ) from exc
                    time.sleep(0.001)

    def limit_total_pids(self, n: int) -> None:
        """``pids.max = n`` on the parent cgroup of all sandboxes: whatever each sandbox's
        own limit, together they cannot take the node's last pids (the edge and the host
        keep ``kernel.pid_max - n``)."""
        ctrl = "unified" if self.version == 2 else "pids"
        _write(os.path.join(self.layout.bases[ctrl], "pids.max"), str(n))

    def remove_base(self) -> None:
        """rmdir this edge's (empty) parent cgroups - for edge shutdown with no sandboxes
        left, tests and node decommission. v1: in every hierarchy (and the v2 mount of a
        hybrid layout), including those only runc makes a parent in. A parent that still holds sandboxes (EBUSY) is kept."""
        dirs = list(self.layout.bases.values())
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
        for base in self.layout.bases.values():
            try:
                names.update(e.name for e in os.scandir(base) if e.is_dir())
            except FileNotFoundError:
                pass
        return sorted(names)
