"""What the host spends on a sandbox beyond what its memory cgroup is charged (issue 22).

A sandbox's memory cgroup is charged for its processes' pages and most kernel memory they
allocate (the init's stack and page tables, the slab of the namespaces the intermediate
creates after joining the cgroup, tmpfs files). Not charged to it: its cgroups' own
structures (allocated by the edge's ``mkdir``), the superblocks of its mounts, and above
all its memcg's **shrinker map** - one slot per memcg-aware shrinker id on the host, in
units of 64 ids that take 1 KiB each (520 bytes in the 1 KiB slab class), allocated for the
highest id in use and never shrunk (docs/container.md, "Density"). Every superblock is a
shrinker, so that term is ~(superblocks on the host)/64 KiB per sandbox: quadratic in the
sandbox count overall.

:func:`uncharged_bytes` estimates that part for ``SandboxStats.memory_host_bytes``. The
shrinker term counts this backend's own superblocks at their peak (the kernel's map never
shrinks) - a lower bound, since the host's and other backends' superblocks count too. The
constants are from ``python -m dsec.bench.kcost`` on the dev VM (n=1,000); the density
bench prints the measured host delta next to this estimate.
"""

from __future__ import annotations

import os
import subprocess

from dsec.edge.backends.container import linux
from dsec.errors import BackendError
from dsec.rmtree import remove_tree

__all__ = ["SUPERBLOCKS_PER_SANDBOX", "make_scratch_dir", "mount_shared_scratch",
           "mount_shared_sysfs", "new_namespace_ipc_caps", "release_shared_scratch",
           "remove_scratch_dir", "scratch_dirs", "uncharged_bytes", "unmount_shared_scratch",
           "unmount_shared_sysfs"]

#: overlay root, the scratch tmpfs (/dev, /dev/shm, /tmp, masks), devpts, sysfs, proc and
#: the mqueue superblock of its ipc namespace (native driver; 9 before issue 22; 5 with
#: the shared sysfs, :func:`mount_shared_sysfs`; 4 with the shared scratch too,
#: :func:`mount_shared_scratch`)
SUPERBLOCKS_PER_SANDBOX = 6
#: struct mem_cgroup + per-node info + per-cpu stats, outside the shrinker map (estimate)
_MEMCG_BASE = 16 << 10
#: the cpu, cpuacct, pids and freezer cgroups (kcost: 7.5 + 3.7 + 3.4 + 2.8 KiB)
_OTHER_CGROUPS = 17 << 10
#: a superblock's own structures (kcost: 1-8 KiB of slab each, ~4 on average)
_SUPERBLOCK = 4 << 10


def uncharged_bytes(peak_sandboxes: int, superblocks: int = SUPERBLOCKS_PER_SANDBOX, *,
                    memcg_share: int = 1) -> int:
    """Kernel memory the host spends on one sandbox outside its memory cgroup, with
    ``peak_sandboxes`` the most sandboxes this backend has held at once and
    ``superblocks`` each one mounts; ``memcg_share`` sandboxes share its memory cgroup
    (a memory group: its memcg and shrinker map are split between them). Pure."""
    ids = max(1, peak_sandboxes) * superblocks
    shrinker_map = -(-ids // 64) * 1024
    return (_OTHER_CGROUPS + superblocks * _SUPERBLOCK
            + (_MEMCG_BASE + shrinker_map) // max(1, memcg_share))


#: kernel memory per SysV message at most (struct msg_msg, kmalloc'd: 48 B -> 64 B): a
#: queue holds up to msgmnb bytes *and* up to msgmnb messages (0-byte ones cost only
#: this), so its worst case is 64 x msgmnb (red team 27 K)
_MSG_HEADER = 64
#: kernel memory per SysV semaphore (struct sem, cache-line aligned) and per array
_SEM_BYTES, _SEM_ARRAY_BYTES = 64, 256
#: what a new ipc namespace starts with (include/uapi/linux/msg.h MSGMNB, sem.h SEMMSL
#: SEMMNS SEMOPM SEMMNI): the member's namespace is new, so nothing is read first - each
#: /proc/sys access is on the create path and costs more the more namespaces exist
_NEW_NS_MSGMNB, _NEW_NS_SEM = 16384, (32000, 1024000000, 500, 32000)


def ipc_caps(memory_bytes: int, *, page: int, msgmnb: int,
             sem: tuple[int, int, int, int]) -> list[tuple[str, str]]:
    """The ipc sysctls that keep a member's SysV objects inside its budget
    (:func:`dsec.edge.memgroups.pinned_budget`), as ``(name, value)`` (pure). ``msgmnb``
    and ``sem``: the namespace's ``kernel.msgmnb`` and ``kernel.sem`` now (SEMMSL SEMMNS
    SEMOPM SEMMNI). A queue holds up to msgmnb bytes *and* up to msgmnb messages, so
    msgmnb is lowered too when one queue's worst case would not fit: with the default
    one queue of 0-byte messages pinned 1 MiB whatever the member's size (red team 28
    E). Raising a queue past msgmnb (msgctl IPC_SET) needs CAP_SYS_RESOURCE, which no
    sandbox has."""
    from dsec.edge.memgroups import pinned_budget

    b = pinned_budget(memory_bytes)
    semmsl, _semmns, semopm, _semmni = sem
    semmns = max(1, b.sem_bytes // 2 // _SEM_BYTES)
    semmni = max(1, b.sem_bytes // 2 // _SEM_ARRAY_BYTES)
    queue = max(1, min(msgmnb, b.msg_bytes // _MSG_HEADER))
    return [("shmmax", str(max(page, b.shm_bytes))),
            ("shmall", str(max(1, b.shm_bytes // page))),
            ("msgmnb", str(queue)),
            ("msgmni", str(max(1, b.msg_bytes // (_MSG_HEADER * queue)))),
            ("sem", f"{min(semmsl, semmns)} {semmns} {semopm} {min(semmni, 32000)}")]


def new_namespace_ipc_caps(memory_bytes: int) -> list[tuple[str, str]]:
    """:func:`ipc_caps` for a member's new ipc namespace (it starts at the kernel's
    defaults, so nothing is read first). They live as long as the namespace - no OOM
    kill frees them - and are charged to the memory cgroup, which in a group is the
    group's: uncapped (the kernel's defaults are unlimited shm, 32,000 queues and 32,000
    semaphore arrays) one member could pin its whole group's memory in them and every
    process of its group-mates would be OOM-killed from then on (red team 26 H, 27
    A/I/K). The sandbox's PID 1 writes them through its own fresh /proc before anything
    of the tenant's runs (nsexec.c ``write_ipc_caps``: through the host's /proc each
    write cost more the more namespaces the host had); the tenant cannot raise them:
    /proc/sys is read-only in the sandbox."""
    return ipc_caps(memory_bytes, page=os.sysconf("SC_PAGE_SIZE"), msgmnb=_NEW_NS_MSGMNB,
                    sem=_NEW_NS_SEM)


def mount_shared_sysfs(path: str) -> str:
    """Mount the node's shared sysfs at ``path`` (made if missing; kept if mounted
    already, e.g. by a dead edge of the same root) and return ``path``.

    A sysfs superblock belongs to the network namespace of whoever mounts it, so every
    sandbox mounting its own /sys adds one superblock - and every superblock costs every
    memory cgroup on the host a shrinker slot (the quadratic term of Density in
    docs/container.md). This one is mounted read-only from a new, empty network
    namespace (util-linux ``unshare --net=<path>.netns``, which keeps it)
    and bound read-only at each loopback-only sandbox's /sys. What a sandbox sees there
    is what any sysfs shows (devices, kernel, modules: host-wide, read-only) plus the
    empty namespace's ``lo`` under /sys/class/net - its own ``lo`` counters are not
    there; nothing of another sandbox or of the host's interfaces is. Sandboxes in a
    router slot's network namespace keep a sysfs of their own (their eth0 is theirs)."""
    os.makedirs(path, mode=0o555, exist_ok=True)
    if os.path.ismount(path):
        return path
    # The superblock holds only a passive reference on its namespace: with nothing else
    # holding it the namespace is torn down when ``unshare`` exits and /sys/class/net
    # reads empty (measured). ``--net=FILE`` bind-mounts it there, keeping it (and its lo).
    holder = path + ".netns"
    if not os.path.exists(holder):
        with open(holder, "x"):
            pass
    if os.path.ismount(holder):
        linux.umount2(holder, linux.MNT_DETACH)
    try:
        subprocess.run(["unshare", f"--net={holder}", "--", "mount", "-t", "sysfs", "-o",
                        "ro,nosuid,nodev,noexec", "sysfs", path],
                       check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        raise BackendError(f"cannot mount the shared sysfs at {path}: {exc} "
                           f"{detail.decode(errors='replace').strip()}; set "
                           "shared_sysfs=False to give each sandbox its own") from exc
    return path


def unmount_shared_sysfs(path: str) -> None:
    """Detach the shared sysfs and its namespace's holder (sandboxes still running keep
    their binds of it)."""
    for p in (path, path + ".netns"):
        if os.path.ismount(p):
            linux.umount2(p, linux.MNT_DETACH)
    for remove in (os.rmdir, os.unlink):
        try:
            remove(path if remove is os.rmdir else path + ".netns")
        except OSError:
            pass


#: MS_PRIVATE: the node's scratch mount propagates nowhere (and receives nothing)
_MS_PRIVATE = 1 << 18


def mount_shared_scratch(path: str) -> str:
    """Mount the node's one scratch tmpfs at ``path`` (made 0700 if missing; kept if
    mounted already, e.g. by a killed edge of the same root, whose sandboxes' dirs are
    in it) and return ``path``.

    Each sandbox's /dev, /dev/shm and /tmp were a tmpfs of its own: one superblock per
    sandbox, and every superblock costs every memory cgroup on the host a shrinker slot
    (docs/container.md, Density). Now each sandbox gets a directory here
    (:func:`make_scratch_dir`) whose ``dev/`` and ``tmp/`` the helper binds into it
    (``nsexec.c`` ``F_SCRATCH``); nothing above those two is reachable from inside.
    ``size=0,nr_inodes=0``: no node-wide byte or inode cap that one sandbox could exhaust
    for the others - a sandbox's pages, inodes and dentries there are charged to its own
    memory cgroup (the writer's), so its memory limit is the bound, as it was (the old
    per-sandbox size was 64 MiB + 64 KiB + the memory limit, never reached first); and
    ``statfs`` of it reports no size or usage, so no sandbox reads the others' totals
    from ``df /tmp``. What it cannot hide: inode numbers come from this superblock's one
    counter, so a sandbox's new files' numbers advance with every other sandbox's creates
    (a rate, and a covert channel); no tmpfs option gives per-directory numbering, so
    nodes whose tenants must not observe each other use ``shared_scratch=False``
    (docs/container.md, Density; red team 22, B8). nosuid,nodev,noexec here; the
    sandbox's binds set their own flags."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    if os.path.ismount(path):
        return path
    try:
        linux.mount("tmpfs", path, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC,
                    "mode=0700,size=0,nr_inodes=0")
        linux.mount(None, path, None, _MS_PRIVATE)
    except OSError as exc:
        raise BackendError(f"cannot mount the shared scratch tmpfs at {path}: {exc}; set "
                           "shared_scratch=False to give each sandbox a tmpfs of its own"
                           ) from exc
    return path


def unmount_shared_scratch(path: str) -> None:
    """Detach the shared scratch tmpfs (call only with no sandbox dir left in it: a
    running sandbox keeps its binds, but its files could then no longer be removed
    through ``path``)."""
    if os.path.ismount(path):
        linux.umount2(path, linux.MNT_DETACH)
    try:
        os.rmdir(path)
    except OSError:
        pass


def release_shared_scratch(path: str) -> bool:
    """Unmount the shared scratch at ``path`` if it holds no sandbox dir (a backend's
    close; again after an earlier close: nothing). True if it is gone."""
    if not path or not os.path.ismount(path):
        return True
    try:
        if os.listdir(path):
            return False    # sandboxes left for adopt(): their files are removed through it
    except OSError:
        return False
    unmount_shared_scratch(path)
    return True


def scratch_dirs(path: str) -> list[str]:
    """The sandbox ids with a directory in the shared scratch at ``path`` (the census)."""
    if not path or not os.path.ismount(path):
        return []
    try:
        return [e.name for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def make_scratch_dir(path: str, sid: str) -> str:
    """A fresh empty 0700 directory for sandbox ``sid`` in the shared scratch (a leftover
    of the same id - a crashed create - is removed first). Returns its path."""
    if not os.path.ismount(path):
        # unmounted under a running edge: the dir would land on the host's disk (the
        # sandbox's /tmp silently on the root filesystem); refuse instead
        raise BackendError(f"the shared scratch tmpfs at {path} is not mounted (unmounted "
                           "under a running edge?); restart the edge to mount it again, or "
                           "set shared_scratch=False")
    d = os.path.join(path, sid)
    if os.path.lexists(d):
        remove_scratch_dir(path, sid)
    os.mkdir(d, 0o700)
    return d


def remove_scratch_dir(path: str, sid: str) -> str:
    """Remove sandbox ``sid``'s directory of the shared scratch (its /dev and /tmp
    files: memory charged to its cgroup until then). Returns what could not go ("": all
    of it). Never crosses a mount point; the sandbox's processes must be dead."""
    d = os.path.join(path, sid)
    if not os.path.lexists(d):
        return ""
    res = remove_tree(d)
    return "" if res.clean else f"remove {d}: {res.describe()}"
