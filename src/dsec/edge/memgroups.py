"""Memory groups: up to ``size`` sandboxes of one project and QoS class in one memory
cgroup (opt-in density trade, issue 22; docs/container.md "Memory groups").

Why: every memory cgroup on the host keeps a shrinker map with a slot for every
superblock on the host (1 KiB per 64), so N sandboxes with S superblocks each cost
N x (S x N / 64) KiB - at 10,000 sandboxes ~516-672 KiB per sandbox, the largest term of
their host memory. Sandboxes sharing a memory cgroup by groups of ``size`` divide that
term by ``size``. **The trade**: a group has one limit (the sum of its members'), so a
sandbox can use memory its group-mates leave unused and, at the group's limit, the OOM
killer may pick a process of any member. Nothing else is shared: namespaces, other
cgroups (cpu, pids, freezer), files and disk stay per sandbox, and what no OOM kill
frees (tmpfs files, SysV shared memory) stays capped at each member's own limit.
Groups never mix projects or QoS classes.

Pure: the table of groups and members, keyed by the group's cgroup directory (an edge
restarted in another cgroup adopts members of groups under the old parent; new
sandboxes join only groups under its own). The governor and the backend do the I/O.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

__all__ = ["GROUP_PREFIX", "LOWER_GRACE_S", "MemoryGroup", "MemoryGroups", "PinnedBudget",
           "Proc", "Strike", "group_name", "groupable", "is_group_name", "kill_freed_nothing",
           "member_figure", "pick_victim", "pinned_budget"]

#: every group's cgroup dir name starts with this; no sandbox id can ("sb-..."): the
#: census and the leak checks tell a group from a sandbox by it
GROUP_PREFIX = "+mg-"


def group_name(project: str, qos: str, index: int) -> str:
    """The cgroup dir name of a project's ``index``-th group of class ``qos``."""
    h = hashlib.sha256(f"{project}\0{qos}".encode()).hexdigest()[:12]
    return f"{GROUP_PREFIX}{h}-{index}"


def is_group_name(name: str) -> bool:
    return name.startswith(GROUP_PREFIX)


#: the smallest memory_bytes a member may have: below it the floors of what it may pin
#: (a 1 MiB tmpfs, one page of SysV shm) no longer fit in 15/16 of its own memory
#: (red team 28 E); a smaller sandbox gets a memory cgroup of its own
MIN_MEMBER_BYTES = 4 << 20


def groupable(user_namespace: bool, allow_nested: bool,
              memory_bytes: int = MIN_MEMBER_BYTES) -> bool:
    """Whether a sandbox may join a memory group. Not one that can make namespaces of
    its own (``allow_nested``): a new ipc or mount namespace has the kernel's defaults
    again - unlimited SysV shm, a tmpfs of any size - and what it holds is charged to
    the group and outlives OOM kills while a tiny process keeps it (red team 27 B). Not
    a user-namespace sandbox: its ipc namespace belongs to its user namespace, and the
    edge cannot write its caps (27 F). Not one under :data:`MIN_MEMBER_BYTES` (28 E).
    Each of them gets a memory cgroup of its own."""
    return not user_namespace and not allow_nested and memory_bytes >= MIN_MEMBER_BYTES


#: how long a group may keep a departed member's share before it is made to fit its
#: members' new total (reclaim, then kill the process holding the most over its own
#: share): long enough for a short burst, short enough that the node's admission -
#: which released that share at the destroy - is not overcommitted for long
LOWER_GRACE_S = 10.0


@dataclass(frozen=True, slots=True)
class Proc:
    """A member's process as the deadline sees it: its memory (RSS + swap, bytes)."""

    pid: int
    bytes: int
    init: bool = False      # the sandbox's PID 1: killed last (its death ends the sandbox)


@dataclass(frozen=True, slots=True)
class Strike:
    """The deadline's last kill in a group: whose, the group's memory + swap before it
    and what the victim held - to see whether the kill freed anything."""

    sid: str
    group_used: int
    freed: int


def member_figure(procs: list[Proc], pinned: int) -> int:
    """What a member holds: its processes' proportional memory (PSS + swap: a page
    shared by its processes counts once) and what it pins with no process mapping it
    (detached SysV shm, message queues, its tmpfs mounts)."""
    return sum(p.bytes for p in procs) + pinned


def pick_victim(procs: dict[str, list[Proc]], shares: dict[str, int],
                pinned: dict[str, int] | None = None) -> tuple[str, Proc] | None:
    """Which process to kill so that a group over its members' new total can be lowered
    (pure): in the member holding the most over its own share (``shares``: sandbox ->
    memory_bytes; figures by :func:`member_figure`, ``pinned``: sandbox -> bytes) among
    those with a process, its largest process, the init last (its death ends the
    sandbox - and its ipc namespace and tmpfs with it). None if no member is over its
    share: what is over is in no one's figure (shared page cache, kernel memory, an
    unmapped memfd), and killing by size there killed a member within its share (red
    team 29 A, 30 A) - the group then stays pending, its soft limit at the sum."""
    pinned = pinned or {}
    over = {sid: member_figure(ps, pinned.get(sid, 0)) - shares.get(sid, 0)
            for sid, ps in procs.items() if ps}
    candidates = [s for s in over if over[s] > 0]
    if not candidates:
        return None
    worst = max(candidates, key=lambda s: (over[s], s))
    best = max(procs[worst], key=lambda p: (not p.init, p.bytes))
    return worst, best


def kill_freed_nothing(last: Strike | None, sid: str, group_used: int) -> bool:
    """Whether the deadline's last kill in ``sid`` (a member over its own share) freed
    (almost) nothing: the group still holds more than it did then less half of what the
    victim held - shared memory another process keeps, a process started again. Then
    the whole member goes (red team 29 B). Judged by the group's usage, not the
    member's PSS, which rises in the survivors of a copy-on-write pair (30 B)."""
    return (last is not None and last.sid == sid
            and group_used > last.group_used - last.freed // 2)


@dataclass(frozen=True, slots=True)
class PinnedBudget:
    """What a member may hold that no OOM kill frees (it lives as long as its init and
    its ipc namespace), in bytes of memory charged to the group. Together at most
    15/16 of its own memory_bytes, so no member can wedge its group-mates whatever it
    pins (red team 26 H; 27 A: each capped at memory_bytes alone added up to 3x)."""

    tmpfs_bytes: int       # /tmp, /dev, /dev/shm: file pages (nsexec caps inodes at 1/KiB)
    shm_bytes: int         # SysV shared memory: shmmax, shmall
    msg_bytes: int         # SysV message queues, worst case (msgmni)
    sem_bytes: int         # SysV semaphores (kernel.sem)


def pinned_budget(memory_bytes: int) -> PinnedBudget:
    """A quarter each to tmpfs pages and (through nr_inodes, one per KiB) tmpfs inodes,
    a quarter to SysV shm, an eighth to message queues, a sixteenth to semaphores."""
    return PinnedBudget(tmpfs_bytes=max(1 << 20, memory_bytes // 4),
                        shm_bytes=memory_bytes // 4, msg_bytes=memory_bytes // 8,
                        sem_bytes=memory_bytes // 16)


@dataclass
class MemoryGroup:
    dir: str                                              # its cgroup directory
    key: tuple[str, str]                                  # (project, qos)
    members: dict[str, int] = field(default_factory=dict)  # sandbox id -> its memory bytes
    #: the OOM-kill counter of the group's cgroup last reported (shared by the members:
    #: one kill is reported once, by the member that saw it first)
    oom_seen: int = 0
    #: no member left but its cgroup could not be removed (a task still inside): never
    #: joined again, its name never reused, removal retried (red team 26, G)
    retired: bool = False
    #: its limit is above its members' sum (a lowering waits until the group fits)
    pending: bool = False
    #: when the lowering began to wait (monotonic); past the grace the group is made to
    #: fit (red team 27 C). Cleared only by a lowering that succeeds or once the members
    #: it waited for (``debtors``) are gone - a sibling that joins and leaves (the join
    #: "raises" to the limit it has) does not start the grace again (red team 29 D)
    pending_since: float | None = None
    debtors: frozenset[str] = frozenset()
    #: the deadline's last kill here
    strike: Strike | None = None

    @property
    def name(self) -> str:
        return os.path.basename(self.dir)

    @property
    def limit_bytes(self) -> int:
        """The group's memory limit: the sum of its members' limits."""
        return sum(self.members.values())


@dataclass
class MemoryGroups:
    """Which group each sandbox is in. ``size`` members at most per group."""

    size: int
    groups: dict[str, MemoryGroup] = field(default_factory=dict)   # dir -> group
    of: dict[str, str] = field(default_factory=dict)      # sandbox id -> group dir

    def __post_init__(self) -> None:
        if self.size < 2:
            raise ValueError(f"memory group size {self.size}: a group holds at least 2 "
                             "sandboxes (1 means every sandbox has its own memory cgroup)")

    def join(self, sid: str, parent: str, project: str, qos: str,
             memory_bytes: int) -> MemoryGroup:
        """Put ``sid`` in the fullest group of its key under ``parent`` with room (fewer
        cgroups on the host), or a new one with the lowest index free there."""
        if sid in self.of:
            raise ValueError(f"sandbox {sid} is in memory group {self.of[sid]} already")
        key = (project, qos)
        # never one waiting to be lowered: it holds more than its members' total, and a
        # join there would hide that (red team 29 D) - or race its deadline's write
        open_ = [g for g in self.groups.values() if g.key == key and not g.retired
                 and not g.pending
                 and os.path.dirname(g.dir) == parent and len(g.members) < self.size]
        if open_:
            g = max(open_, key=lambda g: (len(g.members), g.dir))
        else:
            i = 0
            while os.path.join(parent, group_name(project, qos, i)) in self.groups:
                i += 1
            g = MemoryGroup(os.path.join(parent, group_name(project, qos, i)), key)
            self.groups[g.dir] = g
        g.members[sid] = memory_bytes
        self.of[sid] = g.dir
        return g

    def adopt(self, sid: str, group_dir: str, project: str, qos: str,
              memory_bytes: int) -> MemoryGroup:
        """Record ``sid`` in the group it is found in on the host (edge restart). A group
        found with members of another key, or over ``size``, is kept as found: the host
        is what it is; new sandboxes only join groups of their own key with room."""
        g = self.groups.get(group_dir)
        if g is None:
            g = self.groups[group_dir] = MemoryGroup(group_dir, (project, qos))
        g.retired = False
        g.members[sid] = memory_bytes
        self.of[sid] = group_dir
        return g

    def leave(self, sid: str) -> MemoryGroup | None:
        """Take ``sid`` out of its group; the group (maybe now empty: the caller removes
        its cgroup, then :meth:`drop` s it, or :meth:`retire` s it) or None."""
        d = self.of.pop(sid, None)
        if d is None:
            return None
        g = self.groups[d]
        g.members.pop(sid, None)
        return g

    def drop(self, group_dir: str) -> None:
        g = self.groups.get(group_dir)
        if g is not None and not g.members:
            del self.groups[group_dir]

    def retire(self, group_dir: str) -> None:
        g = self.groups.get(group_dir)
        if g is not None and not g.members:
            g.retired = True

    def group_of(self, sid: str) -> MemoryGroup | None:
        d = self.of.get(sid)
        return None if d is None else self.groups.get(d)
