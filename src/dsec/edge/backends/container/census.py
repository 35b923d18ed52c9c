"""What a container backend holds on the host, found by looking (not by remembering).

After a crash the edge's memory is gone but its sandboxes' traces are not: a directory
under ``<root_dir>/sb``, a subvolume of the disk pool (``<root_dir>/pool/<sid>``), a
cgroup ``dsec-<name>/<sid>`` in every hierarchy (v1 memory, cpu, pids, freezer, ...; the
ones runc makes in blkio, cpuset, devices, name=systemd and the v2 mount too), the
processes in those cgroups (the init, whose pid namespace and netns die with it), mounts
below the sandbox directory (runc's rootfs overlay; the disk tmpfs of a sandbox made
before the disk pool) and runc's state directory. A :class:`Census` lists each of them
by sandbox id, so start-up reconciliation (``ContainerBackend.reconcile``), ``destroy`` of
an id the node forgot, the leak tests and the ``faults`` bench all read the host the
same way.

Sandbox cgroups nest under the edge's *own* cgroup, which is not the same for every
process that uses one ``root_dir`` (an edge restarted from another login session or by
another service manager starts elsewhere). So every parent a backend used is recorded in
``<root_dir>/cgroup-parents`` (:func:`record_parents`) and the census looks under all of
them: a restart in another cgroup still finds, and reconciles, the previous process's
cgroups and the processes in them.

The parsing is pure (:func:`~dsec.image.mount.mounts_below`: mountinfo text in, mount
points out; :func:`parse_parents`); :func:`take_census` does the reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import time
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from dsec.edge.governor import (
    all_leaf_dirs,
    cgroup_leaf_names,
    cgroup_owner,
    kill_verified,
    parse_mountinfo,
    valid_cgroup_name,
)
from dsec.edge.memgroups import is_group_name
from dsec.fswalk import walk
from dsec.image.mount import mounts_below
from dsec.ownership import start_time

__all__ = [
    "Census",
    "cgroup_name_of",
    "cgroup_parents",
    "claim_cgroup_name",
    "hand_over_cgroup_name",
    "kill_tasks",
    "live_owners",
    "mounts_below",
    "other_edges",
    "parse_parents",
    "reap_orphan_names",
    "record_parents",
    "recorded_parents",
    "release_cgroup_name",
    "remove_cgroup_dirs",
    "remove_cgroup_dirs_now",
    "take_census",
    "tasks_of",
]

PARENTS = "cgroup-parents"


def cgroup_name_of(root_dir: str) -> str:
    """The default cgroup name of a backend rooted at ``root_dir``: stable across
    restarts, so a restarted edge finds its sandboxes' parent cgroup again (pure)."""
    return hashlib.sha1(os.path.abspath(root_dir).encode()).hexdigest()[:10]


@dataclass(frozen=True, slots=True)
class Census:
    """Host traces of one container backend, by sandbox id."""

    dirs: frozenset[str] = frozenset()                     # <root_dir>/sb/<sid>
    cgroups: dict[str, tuple[str, ...]] = field(default_factory=dict)  # sid -> cgroup dirs
    tasks: dict[str, tuple[int, ...]] = field(default_factory=dict)    # sid -> pids inside
    mounts: dict[str, tuple[str, ...]] = field(default_factory=dict)   # sid -> mount points
    runc: frozenset[str] = frozenset()                     # <root_dir>/runc-state/<sid>
    disk: frozenset[str] = frozenset()                     # <root_dir>/pool/<sid>
    pool_mounted: bool = False   # the backend-wide disk pool (kept while sandboxes live)
    scratch: frozenset[str] = frozenset()  # <root_dir>/scratch/<sid> (shared scratch tmpfs)
    #: memory groups' cgroup dirs (``+mg-*``, dsec.edge.memgroups): shared by sandboxes,
    #: never one sandbox's trace; reconcile removes those no live sandbox is in
    memory_groups: frozenset[str] = frozenset()

    def sandboxes(self) -> set[str]:
        """Every sandbox id with any trace on the host."""
        return (set(self.dirs) | set(self.cgroups) | set(self.mounts) | set(self.runc)
                | set(self.disk) | set(self.scratch))

    def describe(self, sid: str) -> str:
        """What the host holds for ``sid``, in words (for events and logs)."""
        parts = []
        if sid in self.dirs:
            parts.append("directory")
        if sid in self.disk:
            parts.append("disk subvolume")
        if self.cgroups.get(sid):
            parts.append(f"{len(self.cgroups[sid])} cgroup(s)")
        if self.tasks.get(sid):
            parts.append(f"{len(self.tasks[sid])} process(es)")
        if self.mounts.get(sid):
            parts.append(f"{len(self.mounts[sid])} mount(s)")
        if sid in self.runc:
            parts.append("runc state")
        if sid in self.scratch:
            parts.append("/dev and /tmp in the shared scratch")
        return ", ".join(parts) or "nothing"

    def counts(self) -> dict[str, int]:
        """Totals (leak checks compare these before and after)."""
        return {"dirs": len(self.dirs),
                "cgroups": sum(len(v) for v in self.cgroups.values()),
                "tasks": sum(len(v) for v in self.tasks.values()),
                "mounts": sum(len(v) for v in self.mounts.values()),
                "runc": len(self.runc), "disk": len(self.disk),
                "scratch": len(self.scratch),
                "memory_groups": len(self.memory_groups),
                "pool_mounts": int(self.pool_mounted)}


def _subdirs(path: str) -> list[str]:
    try:
        return [e.name for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def tasks_of(cgroup_dir: str) -> list[int]:
    """The pids ``cgroup_dir`` lists (none if it is gone)."""
    try:
        with open(os.path.join(cgroup_dir, "cgroup.procs")) as f:
            return [int(p) for p in f.read().split()]
    except (FileNotFoundError, ValueError):
        return []


def cgroup_parents(cgroup_name: str) -> list[str]:
    """``<own cgroup>/dsec-<cgroup_name>`` in every mounted hierarchy."""
    with open("/proc/self/mountinfo") as f:
        mountinfo = f.read()
    with open("/proc/self/cgroup") as f:
        own = f.read()
    return all_leaf_dirs(mountinfo, own, name=cgroup_name)


NAMES_DIR = "/run/dsec/cgroup-names"


def claim_cgroup_name(cgroup_name: str, root_dir: str, *, names_dir: str = NAMES_DIR) -> None:
    """Bind ``cgroup_name`` to ``root_dir`` for this boot (``<names_dir>/<name>`` holds
    the root dir; /run is empty after a reboot, as is every cgroup).

    The census takes every cgroup under ``dsec-<name>`` for this backend's, so two
    root dirs sharing one explicit ``cgroup_name`` reconciled each other's sandboxes
    away: an edge starting while the other was down killed all of its sandboxes. A
    name bound to another root dir that still exists is refused (``InUse``); one whose
    root dir is gone is taken over (nothing there can be adopted any more). A name bound
    to the same root dir by a live process (another backend on this root) is refused
    too: one backend per root."""
    from dsec.errors import InUse, InvalidArgument

    if not valid_cgroup_name(cgroup_name):
        raise InvalidArgument(f"cgroup_name {cgroup_name[:80]!r} must be 1-64 letters, "
                              "digits, '-', '_' or '.', not starting with '.'",
                              field="cgroup_name")
    path = os.path.join(names_dir, cgroup_name)
    with _names_locked(names_dir):
        bound = _binding(names_dir, cgroup_name)
        me = process_identity(os.getpid())
        owner = bound[0] if bound else None
        if bound == (root_dir, me):
            return
        if bound is not None and owner == root_dir and bound[1] and bound[1] != me \
                and _owner_alive(bound[1]):
            # a second backend on a live one's root (an operator's second edge, a
            # restart racing the old one): taking the name over bound it to whichever
            # claimed last, and once that one was gone any container edge's start swept
            # the live backend's empty cgroups - its base and pids total (red team 26, F/I)
            raise InUse(f"cgroup name {cgroup_name!r} of root dir {root_dir} is held by a "
                        f"live backend (process {bound[1].split()[0]}, see {path}); stop "
                        "it before starting another on the same root",
                        cgroup_name=cgroup_name, root_dir=root_dir)
        if owner and owner != root_dir and os.path.isdir(owner):
            raise InUse(f"cgroup name {cgroup_name!r} belongs to the container backend "
                        f"rooted at {owner} (see {path}); two root dirs sharing it would "
                        "reconcile each other's sandboxes away - give this one another "
                        "cgroup_name", cgroup_name=cgroup_name, root_dir=owner)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{root_dir}\n{me}\n")
        os.replace(tmp, path)


@contextlib.contextmanager
def _names_locked(names_dir: str) -> Iterator[None]:
    """Serialise claims and reaping of cgroup names across processes (flock on
    ``<names_dir>/.lock``): a reaper must never remove the cgroups of a name another
    backend has just taken over."""
    os.makedirs(names_dir, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(names_dir, ".lock"),
                 os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _binding(names_dir: str, cgroup_name: str) -> tuple[str, str] | None:
    """(root dir, owner) of a binding; owner is ``"<pid> <start ticks>"`` of the process
    that last claimed it ("" in bindings written before owners were recorded)."""
    try:
        fd = os.open(os.path.join(names_dir, cgroup_name),
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, IsADirectoryError):
        return None
    try:
        lines = os.read(fd, 4096).decode(errors="replace").splitlines()
    finally:
        os.close(fd)
    return (lines[0].strip() if lines else "", lines[1].strip() if len(lines) > 1 else "")


def process_identity(pid: int) -> str:
    """``"<pid> <start time in clock ticks>"``: names one process for its whole life
    (a recycled pid number has another start time); "" if ``pid`` is not running."""
    start = start_time(pid)
    return "" if start is None else f"{pid} {start}"


def _owner_alive(owner: str) -> bool:
    """The claimer still runs (a zombie - killed, not yet reaped by its parent - is
    dead: a restart right after a kill -9 must not be refused as a second backend)."""
    pid, _, _ = owner.partition(" ")
    if not pid.isdigit():
        return False
    start = start_time(int(pid), running=True)
    return start is not None and f"{pid} {start}" == owner


def orphan_names(bindings: dict[str, tuple[str, str]], *, exists: Callable[[str], bool],
                 alive: Callable[[str], bool]) -> dict[str, str]:
    """The bound names nothing can use any more (pure: ``exists``/``alive`` injected):
    the root dir is gone *and* the process that claimed the name is dead. A backend that
    died without :meth:`close` and whose root dir was then deleted left its base cgroups
    ``dsec-<name>`` behind. A live owner whose root dir we cannot see (another mount
    namespace, e.g. systemd's PrivateTmp) is never touched."""
    return {name: root for name, (root, owner) in bindings.items()
            if (not root.startswith("/") or not exists(root))
            and not (owner and alive(owner))}


def live_owners(bindings: dict[str, tuple[str, str]], *, alive: Callable[[str], bool],
                me: int) -> dict[int, list[str]]:
    """Processes other than ``me`` holding a cgroup-name claim now (pure): pid -> the
    root dirs they claimed. Every container/gvisor backend claims one, so these are the
    other dsec edges (and backends) running on this host."""
    out: dict[int, list[str]] = {}
    for _name, (root, owner) in sorted(bindings.items()):
        pid, _, _ = owner.partition(" ")
        if pid.isdigit() and int(pid) != me and alive(owner):
            out.setdefault(int(pid), []).append(root)
    return out


def other_edges(*, names_dir: str = NAMES_DIR) -> dict[int, list[str]]:
    """:func:`live_owners` of this host's claims ({} when none can be read)."""
    try:
        names = [n for n in os.listdir(names_dir)
                 if not n.startswith(".") and not n.endswith(".tmp")]
    except OSError:
        return {}
    bindings = {n: b for n in names if (b := _binding(names_dir, n)) is not None}
    return live_owners(bindings, alive=_owner_alive, me=os.getpid())


def idle_names(bindings: dict[str, tuple[str, str]], *, exists: Callable[[str], bool],
               alive: Callable[[str], bool]) -> list[str]:
    """The bound names whose root dir still exists but whose claimer is dead (pure): a
    backend that died without :meth:`close` (a killed test run, an edge that will never
    restart there). Their cgroups may still hold sandboxes a later start re-adopts, so
    only the *empty* ones may go (:func:`remove_empty_cgroups`); the binding stays."""
    return sorted(name for name, (root, owner) in bindings.items()
                  if root.startswith("/") and exists(root) and owner and not alive(owner))


def remove_empty_cgroups(top: str) -> list[str]:
    """rmdir every cgroup dir under (and including) ``top``, deepest first, that holds no
    task and no child: the kernel refuses (EBUSY) a cgroup with either, so a live or
    paused sandbox's cgroup is never touched and nothing is killed. Returns the dirs
    removed."""
    removed: list[str] = []
    for dirpath, _dirs, _files in walk(top, topdown=False):
        try:
            os.rmdir(dirpath)
        except OSError:
            continue  # EBUSY (tasks or children), or gone meanwhile
        removed.append(dirpath)
    return removed


def find_named_cgroups(mountinfo: str, names: AbstractSet[str] | None) -> list[str]:
    """Every ``dsec-<name>`` dir (``name`` in ``names``; any name if None) in every mounted cgroup
    hierarchy, wherever in the tree (the process that made it may have lived in another
    cgroup than the caller). The walk never descends into a ``dsec-*`` dir: sandboxes'
    cgroups live there, so the cost is the host's own cgroups (measured 0.8 ms for
    the 23 of the dev VM's 14 hierarchies)."""
    want = None if names is None else {leaf for n in names for leaf in cgroup_leaf_names(n)}
    out: list[str] = []
    for m in parse_mountinfo(mountinfo):
        if m.fstype not in ("cgroup", "cgroup2"):
            continue
        for dirpath, dirnames, _ in os.walk(m.mountpoint):
            out.extend(os.path.join(dirpath, d) for d in dirnames
                       if (d.startswith("dsec-") if want is None else d in want))
            dirnames[:] = [d for d in dirnames if not d.startswith("dsec-")]
    return sorted(set(out))


def _owner(cgroup_dir: str) -> str | None:
    """The cgroup name a ``dsec-<name>`` (or v1 best-effort cpu parent
    ``dsec-<name>+be``) dir belongs to, exactly; None for a dir no valid name owns
    (pure). Exact because ``+`` is in no name: with the ``.be`` suffix this used,
    ``dsec-x.be`` was attributed to ``x`` and the reaper of a dead ``x`` killed backend
    ``x.be``'s sandboxes (red team 22, B2)."""
    return cgroup_owner(os.path.basename(cgroup_dir))


def reap_orphan_names(*, names_dir: str = NAMES_DIR,
                      exists: Callable[[str], bool] = os.path.isdir,
                      alive: Callable[[str], bool] = _owner_alive,
                      unbound_min_age_s: float = 600.0,
                      unbound_scope: Callable[[str], bool] | None = None,
                      ) -> dict[str, list[str]]:
    """Remove the cgroups (killing any task left in them, pidfd-verified) and the
    binding of every cgroup name whose root dir is gone, and the empty cgroups of names
    whose root dir exists but whose claimer died (:func:`idle_names`); returns name ->
    the cgroup dirs removed. Called at each container backend's start, so a crashed backend whose root
    dir was deleted leaves nothing on the host for longer than the next start.

    The unbound sweep (empty ``dsec-<name>`` cgroups no binding in ``names_dir`` names)
    looks at every name of the host, which is right only for the host's own
    ``names_dir``: against another one, every live backend's base cgroup looks unbound.
    ``unbound_scope`` (a predicate on ``<name>``) limits that sweep; a caller with a
    ``names_dir`` of its own must pass one (a test that swept with an empty names dir
    and ``unbound_min_age_s=0`` removed the idle base cgroups of live edges of other
    tests running beside it, whose next create then failed)."""
    if not os.path.isdir(names_dir):
        return {}
    with _names_locked(names_dir):
        bindings = {}
        for entry in os.listdir(names_dir):
            if entry.startswith(".") or entry.endswith(".tmp"):
                continue
            bound = _binding(names_dir, entry)
            if bound is not None:
                bindings[entry] = bound
        orphans = orphan_names(bindings, exists=exists, alive=alive)
        idle = [n for n in idle_names(bindings, exists=exists, alive=alive)
                if n not in orphans]
        with open("/proc/self/mountinfo") as f:
            mountinfo = f.read()
        found = find_named_cgroups(mountinfo, None)
        out: dict[str, list[str]] = {}
        # Unbound: a dsec-<name> no binding names (its binding was lost, or written by
        # an older release). Nothing can adopt from it; only what is empty goes, and only
        # once it is older than a backend's start (claim, then mkdir) could take.
        now = time.time()
        for d in found:
            name = _owner(d)
            if name is None or name in bindings or (unbound_scope is not None and not unbound_scope(name)):
                continue
            try:
                if now - os.stat(d).st_mtime < unbound_min_age_s:
                    continue
            except FileNotFoundError:
                continue
            gone = remove_empty_cgroups(d)
            if gone:
                out.setdefault(name, []).extend(gone)
        for name in idle:  # owner dead, root kept: only what is empty goes
            gone = [r for d in found if _owner(d) == name
                    for r in remove_empty_cgroups(d)]
            if gone:
                out[name] = gone
        for name in sorted(orphans):
            dirs = [d for d in found if _owner(d) == name]
            try:
                remove_cgroup_dirs_now(dirs, timeout_s=2.0)
            except OSError:
                continue  # a task that will not leave: keep the binding, retry next start
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(names_dir, name))
            out[name] = dirs
        return out


def hand_over_cgroup_name(cgroup_name: str, root_dir: str, *,
                          names_dir: str = NAMES_DIR) -> None:
    """A backend that closes leaving sandboxes for a later adopt keeps ``root_dir``'s
    binding but no longer owns it: the owner becomes ``HANDED_OVER`` (if it is this
    process), so the next backend on the root may claim it while this process lives on
    (a claim is refused while a live process owns it). The sweep treats it as a dead
    claimer's, as before the hand-over existed (census.idle_names: its *empty* cgroups
    go - an idle vm tier's base was otherwise left for good)."""
    path = os.path.join(names_dir, cgroup_name)
    with contextlib.suppress(OSError), _names_locked(names_dir):
        if _binding(names_dir, cgroup_name) == (root_dir, process_identity(os.getpid())):
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(f"{root_dir}\n{HANDED_OVER}\n")
            os.replace(tmp, path)


#: the owner of a binding whose backend closed with sandboxes left: no process (never
#: alive, so claimable and, for the sweep, a dead claimer's); "" stays the legacy
#: "owner never recorded"
HANDED_OVER = "-"


def release_cgroup_name(cgroup_name: str, root_dir: str, *,
                        names_dir: str = NAMES_DIR) -> None:
    """Drop the binding of :func:`claim_cgroup_name` if it is ``root_dir``'s (a backend
    that closes with nothing left under the name)."""
    path = os.path.join(names_dir, cgroup_name)
    with contextlib.suppress(OSError), _names_locked(names_dir):
        bound = _binding(names_dir, cgroup_name)
        if bound is not None and bound[0] == root_dir:
            os.unlink(path)


def parse_parents(text: str, cgroup_name: str) -> list[str]:
    """The parent dirs a ``cgroup-parents`` text names: absolute, normalised paths
    ending in ``dsec-<cgroup_name>`` or, v1's best-effort cpu parent,
    ``dsec-<cgroup_name>+be`` (anything else is ignored: a damaged record must
    not point reconciliation at other cgroups). Pure."""
    leaves = cgroup_leaf_names(cgroup_name)
    out = []
    for line in text.splitlines():
        p = line.strip()
        if p.startswith("/") and os.path.normpath(p) == p \
                and os.path.basename(p) in leaves:
            out.append(p)
    return out


def recorded_parents(root_dir: str, cgroup_name: str) -> list[str]:
    """The parents recorded for the backend rooted at ``root_dir``."""
    try:
        with open(os.path.join(root_dir, PARENTS)) as f:
            return parse_parents(f.read(), cgroup_name)
    except FileNotFoundError:
        return []


def record_parents(root_dir: str, cgroup_name: str, parents: list[str]) -> list[str]:
    """Write the record: ``parents`` (this process's) plus those recorded before that
    still exist; returns what it holds. Atomic (temp file, rename) and fsynced: written
    once per backend start, before any sandbox is made under a new parent."""
    keep = sorted(set(parents) | {p for p in recorded_parents(root_dir, cgroup_name)
                                  if os.path.isdir(p)})
    path = os.path.join(root_dir, PARENTS)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("".join(p + "\n" for p in keep))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return keep


def take_census(root_dir: str, cgroup_name: str, *, only: str | None = None) -> Census:
    """Read what the backend rooted at ``root_dir`` (cgroup parent ``dsec-<name>``, in
    the calling process's own cgroups) holds on the host right now; with ``only``, just
    for that sandbox id (cheaper: no directory listings)."""
    root_dir = os.path.abspath(root_dir)
    sb = os.path.join(root_dir, "sb")
    runc_root = os.path.join(root_dir, "runc-state")
    pool = os.path.join(root_dir, "pool")
    scratch_dir = os.path.join(root_dir, "scratch")
    if only is not None:
        if not only or "/" in only or only.startswith("."):
            return Census()
        dirs = frozenset([only] if os.path.isdir(os.path.join(sb, only)) else [])
        runc = frozenset([only] if os.path.isdir(os.path.join(runc_root, only)) else [])
        disk = frozenset([only] if os.path.isdir(os.path.join(pool, only)) else [])
        scratch = frozenset([only] if os.path.ismount(scratch_dir) and os.path.isdir(
            os.path.join(scratch_dir, only)) else [])
    else:
        dirs = frozenset(_subdirs(sb))
        runc = frozenset(n for n in _subdirs(runc_root) if not n.startswith("."))
        disk = frozenset(n for n in _subdirs(pool) if not n.startswith("."))
        scratch = frozenset(_subdirs(scratch_dir)) if os.path.ismount(scratch_dir) \
            else frozenset()
    cgroups: dict[str, list[str]] = {}
    tasks: dict[str, set[int]] = {}
    groups: set[str] = set()
    parents = set(cgroup_parents(cgroup_name)) | set(recorded_parents(root_dir, cgroup_name))
    for parent in sorted(parents):
        names = _subdirs(parent) if only is None else (
            [only] if os.path.isdir(os.path.join(parent, only)) else [])
        for sid in names:
            d = os.path.join(parent, sid)
            if is_group_name(sid):     # shared: its tasks are its members', found in
                groups.add(d)          # their own pids and freezer cgroups
                continue
            cgroups.setdefault(sid, []).append(d)
            pids = tasks_of(d)
            if pids:
                tasks.setdefault(sid, set()).update(pids)
    with open("/proc/self/mountinfo") as f:
        mountinfo = f.read()
    mounts: dict[str, list[str]] = {}
    for mp in mounts_below(mountinfo, sb if only is None else os.path.join(sb, only)):
        sid = mp[len(sb) + 1:].split("/", 1)[0]
        mounts.setdefault(sid, []).append(mp)
    return Census(dirs=dirs, cgroups={k: tuple(v) for k, v in cgroups.items()},
                  tasks={k: tuple(sorted(v)) for k, v in tasks.items()},
                  mounts={k: tuple(v) for k, v in mounts.items()}, runc=runc, disk=disk,
                  pool_mounted=os.path.ismount(pool), scratch=scratch,
                  memory_groups=frozenset(groups))


def _listed(cgroup_dir: str) -> set[int]:
    """The pids ``cgroup_dir/cgroup.procs`` lists (empty if it cannot be read)."""
    try:
        with open(os.path.join(cgroup_dir, "cgroup.procs")) as f:
            return {int(p) for p in f.read().split()}
    except (OSError, ValueError):
        return set()


def kill_tasks(cgroup_dir: str) -> None:
    """SIGKILL every task ``cgroup_dir`` lists, never a pid number that went to another
    process meanwhile (pidfds checked against a second listing: governor.kill_verified).
    Killing the numbers read was the race issue 11.5 removed everywhere (found left in
    the reconciliation of leftovers by the rt-kernel review)."""
    with contextlib.suppress(OSError):
        kill_verified(lambda: _listed(cgroup_dir))


def _sweep(dirs: list[str]) -> OSError | None:
    """One pass: SIGKILL and rmdir bottom-up; the last rmdir error (a task still
    leaving), or None once every dir is gone."""
    busy: OSError | None = None
    for top in dirs:
        if not os.path.isdir(top):
            continue
        for dirpath, _, _ in sorted(walk(top), key=lambda w: -w[0].count("/")):
            kill_tasks(dirpath)
            # a v1-frozen task dies only once thawed: a paused sandbox's leftovers were
            # SIGKILLed frozen and outlived every sweep (red team 26, E)
            with contextlib.suppress(OSError):
                state = os.path.join(dirpath, "freezer.state")
                if os.path.exists(state):
                    with open(state, "w") as f:
                        f.write("THAWED")
            try:
                os.rmdir(dirpath)
            except FileNotFoundError:
                pass
            except OSError as exc:
                busy = exc
    return busy


async def remove_cgroup_dirs(dirs: list[str], timeout_s: float = 5.0) -> None:
    """SIGKILL every task in ``dirs`` (and in cgroups a nested sandbox made below them)
    and rmdir them, bottom-up, until they are gone; OSError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (busy := _sweep(dirs)) is not None:
        if time.monotonic() > deadline:
            raise busy
        await asyncio.sleep(0.005)


def remove_cgroup_dirs_now(dirs: list[str], timeout_s: float = 5.0) -> None:
    """:func:`remove_cgroup_dirs` for callers without an event loop (blocks)."""
    deadline = time.monotonic() + timeout_s
    while (busy := _sweep(dirs)) is not None:
        if time.monotonic() > deadline:
            raise busy
        time.sleep(0.005)
