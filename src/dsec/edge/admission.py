"""Admission control: the edge's final say on whether a sandbox fits (``ResourcePool``).

Optimistic: :meth:`ResourcePool.reserve` adds the request to the usage first, then
verifies every limit, and rolls the addition back if one is broken. Placement decisions
made elsewhere are only overlays on a heartbeat snapshot; this is where they meet
reality. Reservations are keyed by sandbox id, so releasing is idempotent and a leak is
visible as a key that outlived its sandbox (:attr:`ResourcePool.held`).

Pure logic: the node calls it with no ``await`` between reserve and verify, so under
any contention exactly ``max_sandboxes`` creations succeed.

Two refusals, kept apart: ``CapacityExceeded`` (503) is "not now" (the node is full, a
retry elsewhere or later may work); ``Unsatisfiable`` (400) is "never" (the request is
larger than the node's whole capacity, so no amount of waiting helps).

A node's capacity comes from the machine: :func:`measure_host` reads the cores this
process may use (affinity and cgroup CPU quota), its memory (``/proc/meminfo`` or the
cgroup memory limit, whichever is lower) and the size of the state dir's filesystem;
:func:`plan_capacity` turns that into what the node admits, times an
:class:`Overcommit` factor (agent sandboxes idle most of the time, so reservations may
exceed the machine; the real limits are each sandbox's cgroup).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import msgspec

from dsec.errors import CapacityExceeded, Conflict, InvalidArgument, Unsatisfiable
from dsec.wire.node import (
    Resources,
    describe_request,
    format_amount,
    format_bytes,
    format_cpu,
    too_big,
)

__all__ = ["Capacity", "HostResources", "Overcommit", "ResourcePool", "Resources",
           "bound_disk", "describe_request", "format_amount", "format_bytes", "format_cpu",
           "measure_host", "plan_capacity", "too_big"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Capacity:
    """What a node admits. ``cpu_milli`` above the physical cores is CPU overcommit;
    ``physical`` (when known) is what the machine has before the overcommit factor, so a
    refusal can say "24 GiB x overcommit 4"."""

    cpu_milli: int            # millicores admitted in total
    memory_bytes: int         # bytes admitted in total
    max_sandboxes: int        # live sandboxes (any state but destroyed)
    disk_bytes: int | None = None      # largest disk cap of one sandbox; None = unchecked
    physical: Resources | None = None  # measured (or given) before overcommit

    def __post_init__(self) -> None:
        for name in ("cpu_milli", "memory_bytes", "max_sandboxes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise InvalidArgument(f"node capacity {name}={v!r} must be a non-negative integer",
                                      field=name)
        if self.disk_bytes is not None and (not isinstance(self.disk_bytes, int)
                                            or self.disk_bytes < 0):
            raise InvalidArgument(f"node capacity disk_bytes={self.disk_bytes!r} must be a "
                                  "non-negative integer or None", field="disk_bytes")

    def as_resources(self) -> Resources:
        return Resources(cpu_milli=self.cpu_milli, memory_bytes=self.memory_bytes,
                         sandboxes=self.max_sandboxes, disk_bytes=self.disk_bytes)


# ------------------------------------------------------------------ sizing the node
@dataclass(frozen=True, slots=True, kw_only=True)
class Overcommit:
    """How far reservations may exceed the machine, per resource (1.0 = not at all).

    Defaults: CPU 64x, memory 4x. A sandbox's ``cpu_milli`` is a CFS ceiling and a weight,
    not a reserved core, and agent sandboxes idle most of the time (waiting on a model), so
    CPU is overcommitted far: 2 cores admit 128 one-core sandboxes, enough for the demo's
    50 and the RL pool's 64. Memory is what really runs out, so it is overcommitted
    little: 24 GiB admit 96 GiB of limits (192 default 512 MiB sandboxes); paused
    sandboxes give their memory back. Density setups (thousands of small sandboxes) set
    small ``memory`` per sandbox or raise the factor."""

    cpu: float = 64.0
    memory: float = 4.0

    def __post_init__(self) -> None:
        for name in ("cpu", "memory"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 10_000:
                raise InvalidArgument(f"{name} overcommit {v!r} must be a factor within "
                                      "(0, 10000], e.g. 4 (reservations up to 4x the machine)",
                                      field=f"{name}_overcommit")


@dataclass(frozen=True, slots=True, kw_only=True)
class HostResources:
    """What this machine (as this process sees it) has; ``sources`` says where each
    figure came from, for ``dsec up``'s banner and for debugging a surprising number."""

    cpu_milli: int
    memory_bytes: int
    disk_bytes: int | None
    sources: Mapping[str, str]


def plan_capacity(host: HostResources, *, overcommit: Overcommit, max_sandboxes: int,
                  share: int = 1) -> Capacity:
    """The capacity of one node that gets ``1/share`` of ``host`` (``dsec up --edges N``
    runs N nodes on one machine: together they admit what the machine does, not N times
    it). Disk is not split: it is a per-sandbox ceiling, not a pool."""
    if share < 1:
        raise InvalidArgument(f"share={share} must be >= 1")
    physical = Resources(cpu_milli=max(1, host.cpu_milli // share),
                         memory_bytes=max(1, host.memory_bytes // share),
                         sandboxes=max_sandboxes, disk_bytes=host.disk_bytes)
    return Capacity(cpu_milli=int(physical.cpu_milli * overcommit.cpu),
                    memory_bytes=int(physical.memory_bytes * overcommit.memory),
                    max_sandboxes=max_sandboxes, disk_bytes=host.disk_bytes,
                    physical=physical)


def bound_disk(capacity: Capacity, backends: Iterable[object]) -> Capacity:
    """``capacity`` with its per-sandbox disk ceiling lowered to the largest disk pool a
    backend has (the container backend's ``disk.total_bytes()``: its sandboxes' upper
    layers live there, so no cap above it can ever be honoured)."""
    pools = [total() for b in backends
             if callable(total := getattr(getattr(b, "disk", None), "total_bytes", None))]
    if not pools:
        return capacity
    most = max(int(p) for p in pools)
    if capacity.disk_bytes is not None and capacity.disk_bytes <= most:
        return capacity
    physical = capacity.physical
    if physical is not None:
        physical = msgspec.structs.replace(physical, disk_bytes=most)
    return dataclasses.replace(capacity, disk_bytes=most, physical=physical)


_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as ~2**63 rounded to the page size


def measure_host(state_dir: str | None = None, *, proc_root: str = "/proc",
                 cgroup_root: str = "/sys/fs/cgroup",
                 cpus_allowed: int | None = None) -> HostResources:
    """Cores, memory and disk this process can use: the lower of what the machine has
    and what the cgroup this process runs in allows (an edge nests its sandboxes in its
    own cgroup, so that limit binds them too). ``proc_root``, ``cgroup_root`` and
    ``cpus_allowed`` (default: this process's CPU affinity) are for tests that lay out a
    fake tree."""
    sources: dict[str, str] = {}
    if cpus_allowed is None:
        cpus_allowed = len(os.sched_getaffinity(0))
    cpu = cpus_allowed * 1000
    sources["cpu"] = "CPU affinity"
    paths = _cgroup_paths(_read(os.path.join(proc_root, "self", "cgroup")) or "")
    quota = _cgroup_cpu_milli(cgroup_root, paths)
    if quota is not None and quota[0] < cpu:
        cpu, sources["cpu"] = max(1, quota[0]), quota[1]
    memory = _meminfo_total(proc_root)
    sources["memory"] = f"{proc_root}/meminfo MemTotal"
    limit = _cgroup_memory(cgroup_root, paths)
    if limit is not None and limit[0] < memory:
        memory, sources["memory"] = limit
    disk = None
    if state_dir is not None:
        probe = os.path.abspath(state_dir)
        while not os.path.exists(probe) and probe != "/":
            probe = os.path.dirname(probe)
        st = os.statvfs(probe)
        disk = st.f_blocks * st.f_frsize
        sources["disk"] = f"statvfs({probe})"
    return HostResources(cpu_milli=cpu, memory_bytes=memory, disk_bytes=disk, sources=sources)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _meminfo_total(proc_root: str) -> int:
    for line in (_read(os.path.join(proc_root, "meminfo")) or "").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise InvalidArgument(f"cannot read MemTotal from {proc_root}/meminfo; give the node's "
                          "memory by hand (--memory)")


def _cgroup_paths(text: str) -> dict[str, str]:
    """``/proc/self/cgroup`` -> controller -> path (``""`` is the v2 unified entry)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for ctrl in parts[1].split(","):
            out[ctrl] = parts[2]
    return out


def _ancestry(base: str, path: str) -> list[str]:
    """``base/path`` and each of its parents up to ``base`` (the limits along the way
    all apply: the lowest one binds)."""
    out = []
    rel = path.strip("/")
    while True:
        d = os.path.join(base, rel) if rel else base
        if os.path.isdir(d):
            out.append(d)
        if not rel:
            return out
        rel = os.path.dirname(rel)


def _v2_root(cgroup_root: str) -> str | None:
    for cand in (cgroup_root, os.path.join(cgroup_root, "unified")):
        if os.path.exists(os.path.join(cand, "cgroup.controllers")):
            return cand
    return None


def _cgroup_cpu_milli(root: str, paths: Mapping[str, str]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None

    def take(milli: int, where: str) -> None:
        nonlocal best
        if best is None or milli < best[0]:
            best = (milli, where)
    if "cpu" in paths:
        for d in _ancestry(os.path.join(root, "cpu"), paths["cpu"]):
            q, p = _read(os.path.join(d, "cpu.cfs_quota_us")), _read(
                os.path.join(d, "cpu.cfs_period_us"))
            if q is not None and p is not None and int(q) > 0 and int(p) > 0:
                take(int(q) * 1000 // int(p), f"{d}/cpu.cfs_quota_us")
    v2 = _v2_root(root)
    if v2 is not None and "" in paths:
        for d in _ancestry(v2, paths[""]):
            text = _read(os.path.join(d, "cpu.max"))
            if text is None:
                continue
            q, _, p = text.strip().partition(" ")
            if q != "max" and q.isdigit() and p.isdigit() and int(p) > 0:
                take(int(q) * 1000 // int(p), f"{d}/cpu.max")
    return best


def _cgroup_memory(root: str, paths: Mapping[str, str]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None

    def take(limit: int, where: str) -> None:
        nonlocal best
        if limit < _UNLIMITED and (best is None or limit < best[0]):
            best = (limit, where)
    if "memory" in paths:
        for d in _ancestry(os.path.join(root, "memory"), paths["memory"]):
            text = _read(os.path.join(d, "memory.limit_in_bytes"))
            if text is not None and text.strip().isdigit():
                take(int(text), f"{d}/memory.limit_in_bytes")
    v2 = _v2_root(root)
    if v2 is not None and "" in paths:
        for d in _ancestry(v2, paths[""]):
            text = _read(os.path.join(d, "memory.max"))
            if text is not None and text.strip().isdigit():
                take(int(text), f"{d}/memory.max")
    return best


class ResourcePool:
    """Reserve -> verify -> roll back on cpu, memory and a sandbox count."""

    __slots__ = ("_held", "capacity", "cpu_milli", "memory_bytes", "node")

    def __init__(self, capacity: Capacity, *, node: str = "this node") -> None:
        self.capacity = capacity
        self.node = node
        self.cpu_milli = 0
        self.memory_bytes = 0
        self._held: dict[str, tuple[int, int]] = {}

    @property
    def count(self) -> int:
        return len(self._held)

    @property
    def held(self) -> frozenset[str]:
        """Keys that currently hold a reservation."""
        return frozenset(self._held)

    def usage(self) -> Resources:
        return Resources(cpu_milli=self.cpu_milli, memory_bytes=self.memory_bytes,
                         sandboxes=len(self._held))

    def free(self) -> Resources:
        c = self.capacity
        return Resources(cpu_milli=c.cpu_milli - self.cpu_milli,
                         memory_bytes=c.memory_bytes - self.memory_bytes,
                         sandboxes=c.max_sandboxes - len(self._held))

    def check_fits(self, cpu_milli: int, memory_bytes: int,
                   disk_bytes: int | None = None) -> None:
        """Raise :class:`Unsatisfiable` if the request is more than this node could hold
        even empty (a caller mistake, unlike a full node)."""
        cap = self.capacity
        if (cpu_milli <= cap.cpu_milli and memory_bytes <= cap.memory_bytes
                and (disk_bytes is None or cap.disk_bytes is None
                     or disk_bytes <= cap.disk_bytes)):
            return
        over = too_big(cap.as_resources(), cap.physical, cpu_milli=cpu_milli,
                       memory_bytes=memory_bytes, disk_bytes=disk_bytes)
        field, has, want, most = over[0]
        pooled = field != "disk_bytes"
        raise Unsatisfiable(
            f"{describe_request(field, want)} is more than {self.node} could ever hold (it "
            f"has {has}{' for all its sandboxes' if pooled else ''}); ask for at most "
            f"{format_amount(field, most)}{' or raise its overcommit' if 'x' in has else ''}",
            field=field, requested=want, most=most, node=self.node)

    def reserve(self, key: str, cpu_milli: int, memory_bytes: int, *,
                disk_bytes: int | None = None) -> None:
        """Hold ``cpu_milli`` and ``memory_bytes`` for ``key`` or raise CapacityExceeded
        (full now) or Unsatisfiable (more than the whole node)."""
        held = self._held
        if key in held:
            raise Conflict(f"resources for {key} are already reserved", key=key)
        self.check_fits(cpu_milli, memory_bytes, disk_bytes)
        # Optimistic: take first, then check, then give back if a limit broke.
        held[key] = (cpu_milli, memory_bytes)
        self.cpu_milli += cpu_milli
        self.memory_bytes += memory_bytes
        cap = self.capacity
        if (self.cpu_milli <= cap.cpu_milli and self.memory_bytes <= cap.memory_bytes
                and len(held) <= cap.max_sandboxes):
            return
        short = {}
        if self.cpu_milli > cap.cpu_milli:
            short["cpu_milli"] = self.cpu_milli - cap.cpu_milli
        if self.memory_bytes > cap.memory_bytes:
            short["memory_bytes"] = self.memory_bytes - cap.memory_bytes
        if len(held) > cap.max_sandboxes:
            short["sandboxes"] = len(held) - cap.max_sandboxes
        self._rollback(key)
        free = self.free()
        what = ", ".join(f"{k} short by {v}" for k, v in short.items())
        raise CapacityExceeded(
            f"node cannot admit {key} (cpu_milli={cpu_milli}, memory_bytes={memory_bytes}): "
            f"{what}; free now: cpu_milli={free.cpu_milli}, memory_bytes={free.memory_bytes}, "
            f"sandboxes={free.sandboxes}. Ask for less or place it on another node",
            short=short, requested={"cpu_milli": cpu_milli, "memory_bytes": memory_bytes},
            free={"cpu_milli": free.cpu_milli, "memory_bytes": free.memory_bytes,
                  "sandboxes": free.sandboxes},
        )

    def adopt(self, key: str, cpu_milli: int, memory_bytes: int) -> bool:
        """Hold what a sandbox that already runs holds (re-adopted at an edge restart),
        past the capacity if need be: the capacity is re-measured at every start and may
        have shrunk, and a limit on new reservations is no reason to kill a running
        sandbox. The node then admits nothing new until usage is back under capacity.
        Returns False when the pool is now over its capacity."""
        if key in self._held:
            raise Conflict(f"resources for {key} are already reserved", key=key)
        self._held[key] = (cpu_milli, memory_bytes)
        self.cpu_milli += cpu_milli
        self.memory_bytes += memory_bytes
        cap = self.capacity
        return (self.cpu_milli <= cap.cpu_milli and self.memory_bytes <= cap.memory_bytes
                and len(self._held) <= cap.max_sandboxes)

    def release(self, key: str) -> bool:
        """Give back what ``key`` holds; False if it held nothing (idempotent)."""
        if key not in self._held:
            return False
        self._rollback(key)
        return True

    def _rollback(self, key: str) -> None:
        cpu, mem = self._held.pop(key)
        self.cpu_milli -= cpu
        self.memory_bytes -= mem
