"""ContainerBackend: real Linux isolation behind the :class:`~dsec.edge.backend.Backend`
protocol, with two drivers that share everything but process start:

- ``runtime="native"`` (default): our own namespace/overlay/cgroup/seccomp code, run by a
  small static C helper process, the zygote (``dsec-nsexec serve``, driven by :mod:`.native`;
  built by :mod:`.nsexec`). create ~ms, exec ~ms.
- ``runtime="runc"``: the same spec as an OCI bundle run by Debian's runc - the reference
  the fast path is measured against, and a compatibility fallback.
- ``runtime="runsc"``: that OCI bundle run by gVisor (:mod:`.runsc`): the sandbox's
  processes on a user-space kernel; the "gvisor" backend and isolation tier
  (:mod:`dsec.edge.backends.gvisor`).

Per sandbox on disk: ``<root_dir>/sb/<sid>/{root,state.json}`` and its overlay upper and
work dirs in ``<root_dir>/pool/<sid>``, a btrfs subvolume of the backend's disk pool whose
qgroup limit is the sandbox's disk cap (``spec.disk_bytes`` or the node default; see
:mod:`.disk`), so it survives an edge restart and pack_diff reads it like any directory.
The overlay (image lowerdirs + upper) is mounted only inside the sandbox's own mount
namespace by the native driver, so the host mount table does not grow for it and it dies
with the sandbox.
``root_dir`` and everything below it is 0700: a setuid file a sandbox made in its upper
layer cannot be reached, let alone run, by other host users.
cgroups come from :class:`~dsec.edge.governor.Governor`; files go through openat2
confinement (:mod:`.files`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import fcntl
import itertools
import logging
import os
import resource
import secrets
import signal
import stat
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import msgspec

from dsec.edge import filestream
from dsec.edge.backend import DeathSink, Leftover
from dsec.edge.backends.container import linux
from dsec.edge.backends.container.box import Box
from dsec.edge.backends.container.census import (
    Census,
    cgroup_name_of,
    cgroup_parents,
    claim_cgroup_name,
    hand_over_cgroup_name,
    reap_orphan_names,
    record_parents,
    recorded_parents,
    release_cgroup_name,
    remove_cgroup_dirs,
    take_census,
)
from dsec.edge.backends.container.density import (
    SUPERBLOCKS_PER_SANDBOX,
    make_scratch_dir,
    mount_shared_scratch,
    mount_shared_sysfs,
    new_namespace_ipc_caps,
    release_shared_scratch,
    remove_scratch_dir,
    uncharged_bytes,
    unmount_shared_sysfs,
)
from dsec.edge.backends.container.disk import DEFAULT_DISK_BYTES, DiskPool, near_cap
from dsec.edge.backends.container.execio import OutputPump, StdinFeeder
from dsec.edge.backends.container.files import MemoryHome, SandboxFiles
from dsec.edge.backends.container.images import ImageResolver, RootLayers
from dsec.edge.backends.container.native import ZygoteClient
from dsec.edge.backends.container.protocol import (
    Create,
    Created,
    Exec,
    Exited,
    Failed,
    Helper,
    Kill,
    Reply,
    Started,
    exec_failure,
)
from dsec.edge.backends.container.rootfs import build_env, overlay_options
from dsec.edge.backends.container.snapshot import ContainerSnapshots
from dsec.edge.backends.container.state import BoxRecord, load_record, save_record
from dsec.edge.fdkeeper import reset_ignored_signals
from dsec.edge.governor import (
    DEFAULT_MAX_SANDBOX_PIDS,
    DEFAULT_PIDS_HEADROOM,
    ExecCgroup,
    Governor,
    Limits,
    SandboxCgroup,
    ensure_compressed_swap,
    kernel_pid_max,
    pids_budget,
    sandbox_pids,
)
from dsec.edge.memgroups import (
    LOWER_GRACE_S,
    MemoryGroup,
    MemoryGroups,
    Proc,
    Strike,
    groupable,
    is_group_name,
    kill_freed_nothing,
    member_figure,
    pick_victim,
    pinned_budget,
)
from dsec.edge.notices import NoticeLimiter
from dsec.edge.qos import (
    CpuSuppressor,
    CpuSuppressPolicy,
    idle_every_task,
    memory_held,
    mount_source,
    parse_class_cpus,
    parse_class_io,
    parse_cpulist,
    qos_policy_text,
    qos_process,
    read_busy_ns,
    share_be_cap,
)
from dsec.edge.usage import net_bytes
from dsec.errors import (
    BackendError,
    CapacityExceeded,
    Conflict,
    DsecError,
    InUse,
    InvalidArgument,
    QuotaExceeded,
    SandboxError,
    SandboxNotFound,
)
from dsec.fswalk import walk
from dsec.ids import SandboxId
from dsec.net.attach import SandboxNetwork
from dsec.nofile import raise_nofile
from dsec.ownership import start_time
from dsec.rmtree import remove_tree
from dsec.wire.files import FileEvent
from dsec.wire.spec import (
    BackendName,
    ExecChunk,
    ExecRequest,
    ExecResult,
    FileInfo,
    PauseStats,
    SandboxSpec,
    SandboxStats,
    SnapshotInfo,
    qos_of,
)

if TYPE_CHECKING:
    from dsec.edge.backends.container.procio import ContainerProcess
    from dsec.edge.backends.container.runc import RuncDriver
    from dsec.edge.backends.container.runsc import RunscDriver

__all__ = ["ContainerBackend", "Runtime"]

log = logging.getLogger("dsec.edge.container")

Runtime = Literal["native", "runc", "runsc"]
#: the backend name each runtime serves (the node's backend table, BackendName)
RUNTIME_NAMES: dict[str, str] = {"native": "container", "runc": "runc", "runsc": "gvisor"}


_T = TypeVar("_T")

FILE_THREADS = 4   # threads for file operations (one tenant's walk leaves others three)
# Host ids of user-namespace sandboxes (spec.user_namespace): root inside is host uid/gid
# USERNS_BASE, ids 0..65535 inside map to USERNS_BASE.. +65535. One range shared by all
# such sandboxes of a node for now (above the 1000.. range of host accounts and Debian's
# subuid default 100000 + 65536 * n; configurable per backend): an escapee of its mount
# namespace is an unprivileged user on the host, though the same one as other
# user-namespace sandboxes' roots. Per-sandbox slices would need an allocator persisted
# for re-adoption.
USERNS_BASE = 100000
USERNS_SIZE = 65536


#: exec helpers of one sandbox that may die or fail to start before it is served by the
#: per-exec path for good (a sandbox that keeps OOM-killing its helper).
HELPER_MAX_FAILS = 3


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code



def network_refusal(mode: str, *, runtime: str, router: bool) -> str | None:
    """Why a sandbox with egress mode ``mode`` cannot run here, or None (pure).

    Policies are enforced by the node's router on a slot the native driver's zygote
    joins; a runc sandbox makes its own network namespace, off every slot, so no rule
    would apply to it - refused rather than run unfiltered or cut off."""
    if mode == "none":
        return None
    if runtime != "native":
        return (f"network mode {mode!r} is enforced for runtime='native' container sandboxes "
                f"only; this backend runs runtime={runtime!r}, whose sandboxes are not put on "
                "the node's router: use the 'container' backend (runtime native) or "
                "network mode 'none'")
    if not router:
        return (f"network mode {mode!r} needs this node's network router, which this "
                "container backend was started without (dsec edge --net-uplink); use "
                "'none' (loopback only)")
    return None


def _busy_ns() -> int:
    """The node's non-idle CPU time so far (``/proc/stat``), ns."""
    with open("/proc/stat") as f:
        return read_busy_ns(f.read(256), os.sysconf("SC_CLK_TCK"))


class ContainerBackend:
    """Sandboxes as Linux containers. See the module docstring and docs/container.md."""

    #: The most exec helpers alive at once (issue 22). A helper is a process of ~100 KiB
    #: of kernel memory and holds two descriptors in the zygote (its request socket and a
    #: pidfd); 10,000 sandboxes that each answered one exec made 10,000 of them. Sandboxes
    #: past the budget take the per-exec path (~0.3 ms more CPU per exec), nothing fails.
    max_exec_helpers: int = 1024

    def __init__(self, *, root_dir: str, images: ImageResolver, runtime: Runtime = "native",
                 cgroup_name: str | None = None, governor: Governor | None = None,
                 zram_swap_bytes: int | None = 4 << 30, runc_binary: str = "runc",
                 runsc_binary: str = "runsc", gvisor_platform: str | None = None,
                 max_sandbox_pids: int = DEFAULT_MAX_SANDBOX_PIDS,
                 pids_headroom: int = DEFAULT_PIDS_HEADROOM,
                 pids_share: float | None = None,
                 userns_range: tuple[int, int] = (USERNS_BASE, USERNS_SIZE),
                 default_disk_bytes: int = DEFAULT_DISK_BYTES,
                 disk_pool_bytes: int | None = None,
                 notice_interval_s: float = 60.0,
                 snapshot_max_apparent_bytes: int = 64 << 30,
                 snapshot_max_entries: int = 1_000_000,
                 snapshot_max_path_bytes: int = 128 << 20,
                 snapshot_workers: int = 4,
                 limits_poll_s: float | None = 5.0,
                 denied_poll_s: float | None = 1.0,
                 denied_notice_s: float = 10.0,
                 exec_start_timeout_s: float = 30.0,
                 network: SandboxNetwork | None = None,
                 exec_helper: bool | None = None,
                 qos_cpus: str | None = None,
                 qos_io: str | None = None,
                 shared_sysfs: bool | str = True,
                 shared_scratch: bool | str = True,
                 lazy_devpts: bool | str = False,
                 helper_idle_s: float | None = 60.0,
                 be_cpu_threshold: float | str | None = 0.65,
                 memory_group_size: int | str = 1,
                 memory_group_grace_s: float | str = LOWER_GRACE_S,
                 clock: Callable[[], float] = time.time) -> None:
        """``max_sandbox_pids``: the most tasks one sandbox may have; a spec asking for more
        is refused, ``pids_max=None`` ("no cap") gets this. ``pids_headroom``: pids kept
        free for the edge and the host - all sandboxes of this backend together get
        ``pids.max = pids_share x (kernel.pid_max - pids_headroom)`` on their parent
        cgroup, so fork bombs in many sandboxes cannot take the node's last pids.
        ``pids_share``: this backend's fraction of that budget, the rest being the other
        tiers' on the host (None: all of it, a backend alone on its host - the density
        bench's 10,000 sandboxes need it; `dsec edge`, `dsec up` and the in-process cluster
        pass the split between the tiers they run, :func:`~dsec.edge.governor.pids_split`). ``default_disk_bytes``: the
        disk cap of a sandbox whose spec names none (``disk_bytes=None``; 10 GiB).
        ``disk_pool_bytes``: size of the btrfs pool holding every sandbox's upper layer
        when it is first made (None: 90% of the free space of ``root_dir``'s filesystem;
        see :mod:`.disk`). ``notice_interval_s``: at most one notice of a kind
        (``disk_full``, ``pids_limit``, ``oom_kill``, ...) per sandbox this often; the
        next says how many were folded into it. ``snapshot_max_apparent_bytes``: the most
        file bytes one snapshot may pack, sparse files at their full size (mkfs.erofs 1.5
        reads them whole, ~4.6 s/GiB; see :mod:`.snapshot`). ``snapshot_max_entries`` and
        ``snapshot_max_path_bytes``: the most upper entries (and bytes of their paths) one
        snapshot scans and indexes - the edge holds them all in memory (a 64 MiB cap held
        92,080 files with 3.6 KB paths: 680 MiB of edge memory unbounded).
        ``snapshot_workers``: threads building snapshots (4; one project gets all but one,
        so another project always finds one free; mkfs.erofs is CPU-bound).
        ``limits_poll_s``: how often every sandbox's limit counters (task limit hits; OOM
        kills on v2) are checked for notices besides after each exec and on stats (None:
        never); ~8 us per sandbox.
        ``exec_start_timeout_s``: how long a background exec may take to start its command
        (milliseconds normally; a process in the sandbox can stop it before it runs, and
        the call must not wait for ever) - then it is killed and the call fails.
        ``exec_helper``: fork foreground execs from a per-sandbox helper that entered the
        sandbox (namespaces, cgroups, capabilities, seccomp) once, instead of an
        intermediate per exec that does it every time (nsexec.c, do_helper; the helper
        is invisible inside and counts one task and a few pages in the sandbox's cgroups).
        Anything it cannot serve - a user namespace, nested sandboxes, background execs,
        the task limit, a helper gone - takes the per-exec path. ``None`` (default): on,
        unless the environment says ``DSEC_EXEC_HELPER=0`` (how `dsec bench rl` runs the
        old path beside the new one through `dsec up`).
        ``network``: the node's router slots (dsec.net); a sandbox whose policy needs
        more than loopback joins a slot's netns. None: only loopback-only sandboxes.
        ``qos_cpus``: CPU pinning per QoS class, a node policy (``"be=0"``: best-effort
        sandboxes run on CPU 0 only, leaving the rest to latency-sensitive ones;
        ``"ls=1;be=0"`` partitions; :func:`dsec.edge.qos.parse_class_cpus`), enforced by
        the cpuset controller (managed only then). None: nothing pinned.
        ``qos_io``: block I/O throttle per sandbox of a class on the disk pool's device
        (``"be:wbps=10M,rbps=20M;ls:riops=2000"``, :func:`dsec.edge.qos.parse_class_io`;
        v1 blkio / v2 io.max, managed only then; what it does and does not throttle:
        docs/container.md "Block I/O"). None: no limit.
        ``shared_sysfs``: loopback-only sandboxes (native driver) get the node's one
        read-only sysfs of an empty network namespace at /sys instead of their own - one
        superblock less per sandbox (:func:`.density.mount_shared_sysfs` says what they
        see); False: each its own, as before.
        ``shared_scratch``: every sandbox's /dev, /dev/shm and /tmp are a directory of the
        node's one scratch tmpfs (native driver; :func:`.density.mount_shared_scratch`
        says what is shared and what is not) instead of a tmpfs of its own - one
        superblock less per sandbox; False: each its own, as before.
        ``lazy_devpts``: a sandbox gets its devpts instance (its terminals) only when
        the edge first runs a command on a terminal (pty exec, ``dsec sandbox shell``),
        not at create - one superblock less per sandbox that never asks for one. The
        trade (why it is off by default): until then a program inside that opens a
        terminal itself (openpty, ``script``, tmux, pexpect, sudo's use_pty) gets ENOENT
        on /dev/ptmx. User-namespace sandboxes always get theirs at create.
        ``helper_idle_s``: an exec helper unused this long is stopped (checked by the
        limits timer, so within ``limits_poll_s`` more); the sandbox's next exec starts a
        new one. None: helpers stay while their sandbox lives.
        ``be_cpu_threshold``: BE suppression (:class:`dsec.edge.qos.CpuSuppressor`):
        best-effort sandboxes together get at most this share of the node's CPUs less
        what everything else used in the last quarter second, in 10 ms slices, so LS
        work finds idle CPUs (v1 with the BE parent; the trace behind it is in
        :mod:`dsec.edge.qos`). Default 0.65 (Koordinator's CPU-suppress default):
        measured at 50 % BE load, LS exec-step p99 1.93x of unloaded without it, 0.88-
        1.20x with it (four runs); the price is BE's: at most 65 % of an idle node, next to nothing
        of a busy one (docs/container.md "BE suppression"). None or 0: off - BE takes
        every cycle SCHED_IDLE gives it.
        ``memory_group_size``: 1 (default): every sandbox has a memory cgroup of its own.
        k >= 2 (opt-in density trade, native driver on cgroup v1): up to k sandboxes of
        one project and QoS class share one memory cgroup whose limit is the sum of
        theirs - a k-th of the memory cgroups, so a k-th of the host's per-memcg
        shrinker maps (the largest per-sandbox cost at 10,000, docs/container.md
        "Memory groups"); the trade: a sandbox may use memory its group-mates leave
        unused, and at the group's limit the OOM killer may pick a process of any of
        them. Nothing else is shared (:mod:`dsec.edge.memgroups`).
        ``memory_group_grace_s``: how long a group may hold more than its members' total
        after one left (default 10 s); then it is made to fit - reclaim, then the
        process holding the most over its own sandbox's share is killed (an
        ``oom_kill`` notice names it).
        ``runsc_binary``, ``gvisor_platform``: gVisor's runsc and its platform for
        ``runtime="runsc"`` (None: probed once per node, see :mod:`.runsc`)."""
        if isinstance(be_cpu_threshold, str):   # (refused before anything is made)
            try:
                be_cpu_threshold = float(be_cpu_threshold)
            except ValueError:
                raise InvalidArgument(
                    f"be_cpu_threshold {be_cpu_threshold!r} is not a number (a share of "
                    "the node's CPUs, e.g. 0.65; 0 turns BE suppression off)",
                    field="be_cpu_threshold") from None
        if be_cpu_threshold:
            CpuSuppressPolicy(threshold=be_cpu_threshold)   # refuses one outside (0, 1]
        if runtime not in RUNTIME_NAMES:
            raise InvalidArgument(f"container runtime {runtime!r} is unknown; use 'native', "
                                  "'runc' or 'runsc'", field="runtime")
        try:   # `dsec edge --backend-opt` gives strings (refused before anything is made)
            memory_group_size = int(memory_group_size)
        except ValueError:
            raise InvalidArgument(f"memory_group_size {memory_group_size!r} is not a whole "
                                  "number (1: a memory cgroup per sandbox; k >= 2: up to k "
                                  "sandboxes of a project share one)",
                                  field="memory_group_size") from None
        try:
            memory_group_grace_s = float(memory_group_grace_s)
        except ValueError:
            raise InvalidArgument(f"memory_group_grace_s {memory_group_grace_s!r} is not a "
                                  "number of seconds", field="memory_group_grace_s") from None
        if not memory_group_grace_s >= 0:
            raise InvalidArgument(f"memory_group_grace_s={memory_group_grace_s} must be 0 or "
                                  "more seconds", field="memory_group_grace_s")
        if memory_group_size < 1:
            raise InvalidArgument(f"memory_group_size={memory_group_size} must be at least 1 "
                                  "(1: a memory cgroup per sandbox)", field="memory_group_size")
        if memory_group_size > 1 and runtime != "native":
            raise InvalidArgument("memory groups are made by the native driver's cgroups; "
                                  f"runtime {runtime!r} makes its own - leave "
                                  "memory_group_size at 1 or use runtime 'native'",
                                  field="memory_group_size")
        if runtime != "native" and (qos_cpus is not None or qos_io is not None):
            # runc makes its own cgroups from config.json; these node policies are
            # applied by the governor, which only the native driver's cgroups go through
            raise InvalidArgument(f"qos_cpus/qos_io are applied by the native driver only; "
                                  f"runtime {runtime!r} makes its own cgroups - leave them "
                                  "unset or use runtime 'native'", field="qos_cpus")
        if exec_helper is None:
            exec_helper = os.environ.get("DSEC_EXEC_HELPER", "1") != "0"
        self.exec_helper = exec_helper and runtime == "native"
        pids_total, per_sandbox = pids_budget(
            kernel_pid_max(), headroom=pids_headroom, max_sandbox=max_sandbox_pids,
            share=1.0 if pids_share is None else pids_share)
        if not 1 << 20 <= default_disk_bytes:
            raise InvalidArgument(f"default_disk_bytes={default_disk_bytes} must be at least "
                                  "1 MiB", field="default_disk_bytes")
        base, size = userns_range
        if not (1 <= base and 1 <= size and base + size <= 2**32 - 1):
            raise InvalidArgument(f"userns_range={userns_range!r} must be (first host id >= 1, "
                                  "count >= 1) ending below 2**32-1", field="userns_range")
        #: host (uid/gid of root, id count) of user-namespace sandboxes
        self.userns_range = (base, size)
        #: pids.max of the parent cgroup of all this backend's sandboxes
        self.pids_total = pids_total
        self.max_sandbox_pids = per_sandbox
        self.runtime: Runtime = runtime
        self.network = network
        self.name = RUNTIME_NAMES[runtime]
        self.root_dir = os.path.abspath(root_dir)
        self.images = images
        self.clock = clock
        for d in (self.root_dir, os.path.join(self.root_dir, "sb")):
            os.makedirs(d, mode=0o700, exist_ok=True)
            os.chmod(d, 0o700)  # also when it existed: upper layers may hold setuid files
        # Stable per root_dir, so a restarted edge finds its parent cgroup again.
        self.cgroup_name = cgroup_name or cgroup_name_of(self.root_dir)
        # One live backend per root_dir, taken before anything of the root's is touched:
        # a second backend refused after claiming the name had re-bound it to itself,
        # and its clean-up removed the live backend's base cgroups (red team 26, F).
        # reconcile() removes whatever this backend does not hold.
        self._lock_fd = _lock_root(self.root_dir)
        try:  # names of crashed backends whose root dir is gone: their cgroups go too
            for name, dirs in reap_orphan_names().items():
                log.info("removed %d cgroup(s) of cgroup name %r: its root dir is gone and "
                         "the backend that claimed it is dead", len(dirs), name)
        except OSError as exc:  # never fatal: the next start tries again
            log.warning("could not reap orphaned cgroup names: %s", exc)
        try:  # one root dir per cgroup name: the census owns everything under it
            claim_cgroup_name(self.cgroup_name, self.root_dir)
        except BaseException as exc:
            os.close(self._lock_fd)
            self._lock_fd = -1
            if isinstance(exc, OSError):
                raise BackendError(f"cannot claim cgroup name {self.cgroup_name!r}: "
                                   f"{exc}") from exc
            raise
        try:  # whatever __init__ made is released if it fails or a stop interrupts it
            self.governor = governor or Governor(name=self.cgroup_name,
                                                 favor_dynmods=linux.remount,
                                                 cpuset=qos_cpus is not None,
                                                 blkio=qos_io is not None)
            if memory_group_size > 1 and (self.governor.version != 1
                                          or "memory" not in self.governor.layout.bases):
                raise InvalidArgument(
                    "memory groups need the cgroup v1 memory hierarchy (on cgroup v2 a "
                    "sandbox's cgroup holds every controller; sharing its memory is not "
                    "built) - leave memory_group_size at 1", field="memory_group_size")
            #: memory groups (issue 22 density trade; size 1: none is made, but groups an
            #: earlier edge made are still tracked for their members' adopt and teardown)
            self.memory_group_size = memory_group_size
            self.memory_group_grace_s = memory_group_grace_s
            self._memgroups = MemoryGroups(max(2, memory_group_size))
            self._unsettled: set[str] = set()   # groups the limits timer settles
            self._fitting: set[str] = set()     # groups a deadline step is working on
            #: CPU pinning per QoS class (issue 22; None: none)
            self.qos_cpus = None if qos_cpus is None else parse_class_cpus(
                qos_cpus, parse_cpulist(self.governor.node_cpus))
            try:
                self.governor.limit_total_pids(self.pids_total)
            except OSError as exc:
                raise BackendError(f"cannot set pids.max={self.pids_total} on the sandboxes' "
                                   f"parent cgroup: {exc}") from exc
            self.swap_note = ensure_compressed_swap(zram_swap_bytes) if zram_swap_bytes else ""
            #: the cap of sandboxes created without disk_bytes
            self.default_disk_bytes = default_disk_bytes
            #: the btrfs pool holding every sandbox's upper layer (one subvolume each)
            self.disk = DiskPool(self.root_dir, size_bytes=disk_pool_bytes)
            #: I/O throttle per QoS class on the pool's block device (issue 22)
            self.qos_io = {} if qos_io is None else parse_class_io(qos_io)
            self.io_device = self._pool_device() if self.qos_io else ""
            if isinstance(shared_sysfs, str):   # `dsec edge --backend-opt` gives strings
                shared_sysfs = shared_sysfs.strip().lower() not in ("", "0", "false", "no",
                                                                    "off")
            #: the node's shared sysfs, bound at loopback-only sandboxes' /sys ("": none)
            self.shared_sysfs = mount_shared_sysfs(os.path.join(self.root_dir, "sysfs")) \
                if shared_sysfs and runtime == "native" else ""
            if isinstance(shared_scratch, str):
                shared_scratch = shared_scratch.strip().lower() not in ("", "0", "false",
                                                                        "no", "off")
            #: the node's one scratch tmpfs holding every sandbox's /dev and /tmp ("": a
            #: tmpfs each). Kept mounted while any sandbox dir is in it (adopt after a
            #: restart finds and removes them through it).
            self.shared_scratch = mount_shared_scratch(os.path.join(self.root_dir, "scratch")) \
                if shared_scratch and runtime == "native" else ""
            if isinstance(lazy_devpts, str):
                lazy_devpts = lazy_devpts.strip().lower() not in ("", "0", "false", "no",
                                                                  "off")
            #: devpts mounted by the first pty exec, not at create (native driver)
            self.lazy_devpts = bool(lazy_devpts) and runtime == "native"
            #: BE suppression (None: off, or no BE parent to cap on this host)
            self._suppress = CpuSuppressor(
                cores=float(len(os.sched_getaffinity(0))), busy_ns=_busy_ns,
                be_ns=self._be_cpu_ns, set_cap=self._set_be_cap, clock=time.monotonic,
                policy=CpuSuppressPolicy(threshold=be_cpu_threshold)) \
                if be_cpu_threshold and self.governor.layout.be_cpu else None
            self._suppress_timer: asyncio.TimerHandle | None = None
            self._be_quota: dict[str, float] = {}   # BE caps written (cores), by sandbox
            self._be_seen: dict[str, tuple[float, int]] = {}   # last cpu reading (t, ns)
            self._be_used: dict[str, float] = {}    # cores each used, last interval
            self._be_warned: set[str] = set()       # a failed cap write said once
            self._notices = NoticeLimiter(notice_interval_s)
            # Denied packets (plan-14 §4.7): the slots' counters are read every
            # ``denied_poll_s`` (one netlink dump, 0.28 ms for 1,000 slots), a
            # ``network_denied`` notice goes out at most every ``denied_notice_s`` per
            # sandbox and counts every packet denied since the previous one.
            self.denied_poll_s = denied_poll_s
            self._denied_notices = NoticeLimiter(denied_notice_s)
            self._denied_pending: dict[str, int] = {}
            self._dpoll: asyncio.TimerHandle | None = None
            #: ceiling denies of sandboxes being adopted (the node's, see adopting())
            self._adopt_ceiling: dict[str, tuple[str, ...]] = {}
            self.snapshot_max_apparent_bytes = snapshot_max_apparent_bytes
            self.snapshot_max_entries = snapshot_max_entries
            self.snapshot_max_path_bytes = snapshot_max_path_bytes
            sb_dir = os.path.join(self.root_dir, "sb")
            for name in self.disk.sandboxes():
                # A subvolume without its sandbox dir is garbage by construction: teardown
                # removes the subvolume before the dir, create makes the dir first.
                if not os.path.isdir(os.path.join(sb_dir, name)):
                    self.disk.remove(name)
            raise_nofile()  # descriptors are per operation, none per idle sandbox (issue 22)
            # Real-time signals (32-64) this process inherited ignored (a parent started
            # by glibc's posix_spawn leaves 32 so) back to the default: runc and runsc are
            # started through libuv, which resets 1-31 in a child but not these, and runc
            # passes them on to the sandbox's init and commands (red team 23, A1). Not
            # 1-31: an operator's nohup (SIGHUP) is this process's to keep; nsexec resets
            # every signal for the sandboxes it starts itself.
            reset_ignored_signals(first=32)
            self._boxes: dict[str, Box] = {}
            self._peak_boxes = 0   # the most held at once (stats: the shrinker-map estimate)
            self._sink: DeathSink | None = None
            self.limits_poll_s = limits_poll_s
            self.helper_idle_s = None if helper_idle_s is None else float(helper_idle_s)
            if not exec_start_timeout_s > 0:
                raise InvalidArgument(f"exec_start_timeout_s={exec_start_timeout_s} must be > 0",
                                      field="exec_start_timeout_s")
            self.exec_start_timeout_s = exec_start_timeout_s
            #: how long a timed-out exec waits for its SIGKILLed command to be reaped before
            #: it returns anyway (a command the kernel holds in D state cannot die sooner)
            self.kill_wait_s = 10.0
            self._poll: asyncio.TimerHandle | None = None
            self._poll_next = 0
            # exec cgroup names: unique across edge restarts (a lingering one may survive)
            self._exec_seq = itertools.count(time.time_ns() // 1000)
            self._cleanups: set[asyncio.Task[None]] = set()
            # destroys that failed, retried in the background (cancelled by close())
            self._removers: set[asyncio.Task[None]] = set()
            # file operations run beside the loop (see _file_op); made on first use
            self._file_pool: concurrent.futures.ThreadPoolExecutor | None = None
            self._file_ops: set[asyncio.Future[Any]] = set()
            self._settling: asyncio.Task[None] | None = None
            self._settle_again = False
            self._zygote = ZygoteClient()
            #: request ids of the exec helpers started and not yet gone (at most
            #: max_exec_helpers: each costs the zygote two descriptors and a process)
            self._helpers: set[int] = set()
            # ... and at most an eighth of the descriptors the zygote may open (it inherits
            # our RLIMIT_NOFILE): two each, the rest for execs in flight
            self._helper_budget = min(self.max_exec_helpers,
                                      resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 16)
            self._devnull = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
            self._runc: RuncDriver | None = None
            #: the same driver as _runc when it is gVisor's (None otherwise)
            self._runsc: RunscDriver | None = None
            if runtime == "runc":
                from dsec.edge.backends.container.runc import RuncDriver

                self._runc = RuncDriver(binary=runc_binary, root_dir=self.root_dir,
                                        cgroup_parent=f"dsec-{self.cgroup_name}")
            elif runtime == "runsc":
                from dsec.edge.backends.container.runsc import RunscDriver

                self._runc = self._runsc = RunscDriver(
                    binary=runsc_binary, root_dir=self.root_dir,
                    cgroup_parent=f"dsec-{self.cgroup_name}", platform=gvisor_platform)
            self._snapshots = ContainerSnapshots(self, workers=snapshot_workers)
            try:  # where this process nests sandbox cgroups, beside where earlier ones did
                self._own_parents = cgroup_parents(self.cgroup_name)
                record_parents(self.root_dir, self.cgroup_name, self._own_parents)
            except OSError as exc:   # (_release_partial gives the lock back)
                raise BackendError(f"cannot record the cgroup parents of {self.root_dir}: "
                                   f"{exc}") from exc
        except BaseException:
            self._release_partial()
            raise

    def _release_partial(self) -> None:
        """Release what an __init__ that did not finish made (a failure, or a stop
        signal during an edge's start): the disk pool (unmounted and detached when it
        holds no sandbox), the helper, fds, and the parent cgroups and the cgroup-name
        claim when no sandbox of this root is left to adopt."""
        for attr in ("_snapshots", "_zygote", "disk"):
            part = getattr(self, attr, None)
            if part is not None:
                with contextlib.suppress(Exception):
                    part.close()
        if getattr(self, "shared_sysfs", ""):
            with contextlib.suppress(Exception):
                unmount_shared_sysfs(self.shared_sysfs)
        if getattr(self, "shared_scratch", ""):
            with contextlib.suppress(Exception):
                release_shared_scratch(self.shared_scratch)
        # the base cgroups and the name are the root's: only a backend that held its
        # lock may give them back (a refused one must not touch a live one's)
        owned = getattr(self, "_lock_fd", -1) >= 0
        for attr in ("_devnull", "_lock_fd"):
            fd = getattr(self, attr, -1)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, attr, -1)
        governor = getattr(self, "governor", None)
        sb = os.path.join(self.root_dir, "sb")
        with contextlib.suppress(Exception):
            if owned and not (os.path.isdir(sb) and os.listdir(sb)) and (
                    governor is None or not governor.list_sandboxes()):
                if governor is not None:
                    governor.remove_base()
                release_cgroup_name(self.cgroup_name, self.root_dir)

    # -- plumbing ----------------------------------------------------------------------
    def _pool_device(self) -> str:
        """``major:minor`` of the block device under the disk pool (the loop device of
        its image): where a sandbox's reads and writes are submitted, so where a v1
        throttle holds (measured: a limit on the device under the loop's backing file
        caught reads only)."""
        with open("/proc/self/mountinfo") as f:
            src = mount_source(f.read(), self.disk.path)
        try:
            st = os.stat(src) if src else None
        except OSError:
            st = None
        if st is None or not stat.S_ISBLK(st.st_mode):
            raise BackendError(f"qos_io: the disk pool {self.disk.path} is not on a block "
                               f"device (mount source {src!r}); I/O limits need one")
        return f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"

    def watch(self, sink: DeathSink) -> None:
        self._sink = sink

    def upper_dir(self, sid: str) -> str:
        """The overlay upperdir of ``sid``: the sandbox's changes (for pack_diff)."""
        box = self._boxes.get(sid)
        if box is not None and box.upper:
            return box.upper
        return self._rw_dirs(sid)[0]

    def _rw_dirs(self, sid: str) -> tuple[str, str]:
        """(upperdir, workdir) of ``sid``: in its subvolume of the disk pool; a sandbox made
        before the pool existed has them on its disk tmpfs or in its directory."""
        sub = self.disk.sandbox_path(sid)
        if os.path.isdir(sub):
            return os.path.join(sub, "upper"), os.path.join(sub, "work")
        return _legacy_rw_dirs(self._dir(sid))

    def disk_cap(self, spec: SandboxSpec) -> int:
        """The disk cap a sandbox gets: ``spec.disk_bytes`` or the node default (clamped
        to the pool's size)."""
        if spec.disk_bytes is None:
            return self.disk.default_cap(self.default_disk_bytes)
        return spec.disk_bytes

    def _pids_for(self, spec: SandboxSpec) -> int:
        """The task limit a sandbox gets: ``spec.pids_max``, or the node's per-sandbox
        maximum when the spec asks for no cap (None); more than that is refused."""
        return sandbox_pids(spec.pids_max, self.max_sandbox_pids)

    def _dir(self, sid: str) -> str:
        if not sid or "/" in sid or sid.startswith("."):
            raise InvalidArgument(f"sandbox id {sid!r} cannot name a directory")
        return os.path.join(self.root_dir, "sb", sid)

    def box(self, sid: str) -> Box:
        box = self._boxes.get(sid)
        if box is None or box.dying:
            raise SandboxNotFound(f"sandbox {sid} is not running on this container backend",
                                  sandbox_id=sid)
        return box

    def sandbox_ids(self) -> list[str]:
        return sorted(self._boxes)

    def netns_fd(self, sid: SandboxId) -> int:
        """A pidfd of the sandbox's init (a dup: the caller closes it); ``setns`` on it
        with CLONE_NEWNET enters the sandbox's network namespace, and unlike
        /proc/PID/ns/net it cannot name a recycled pid (dsec.net.tunnel)."""
        box = self.box(sid)
        if box.pidfd >= 0:
            return os.dup(box.pidfd)
        if not box.init_pid:
            raise SandboxNotFound(f"sandbox {sid} has no init process yet", sandbox_id=sid)
        try:
            return linux.open_init_pidfd(box.init_pid, box.init_start)
        except OSError as exc:
            raise SandboxNotFound(f"sandbox {sid}'s init is gone: {exc}",
                                  sandbox_id=sid) from exc

    @contextlib.contextmanager
    def _init_fd(self, box: Box) -> Iterator[int]:
        """A pidfd of ``box``'s init for one operation: the held one (runc, adopted), else
        one opened now and checked against the init's start time (~10 µs), closed after.
        A native sandbox holds no descriptor while idle (issue 22)."""
        if box.pidfd >= 0:
            yield box.pidfd
            return
        try:
            fd = linux.open_init_pidfd(box.init_pid, box.init_start)
        except OSError as exc:
            raise BackendError(f"sandbox {box.sid} is not running (its init, pid "
                               f"{box.init_pid}, is gone: {exc})") from exc
        try:
            yield fd
        finally:
            os.close(fd)

    def init_pid(self, sid: str) -> int:
        """Host pid of the sandbox's init (tests, diagnostics)."""
        return self.box(sid).init_pid

    # -- create / adopt / destroy ----------------------------------------------------------
    async def create(self, sid: SandboxId, spec: SandboxSpec) -> None:
        spec.validate()
        self._refuse_network(spec)
        if spec.user_namespace and self.runtime != "native":
            raise InvalidArgument("user_namespace is implemented by the native container "
                                  "driver only; use runtime='native' or drop it",
                                  field="user_namespace")
        if sid in self._boxes:
            raise Conflict(f"sandbox {sid} already exists on this backend", sandbox_id=sid)
        if self.network is not None and spec.net.net_mode != "none":
            # compiled off the loop (a big policy's split costs ms) and refused before
            # anything is built; attach() below finds the plan prepared
            await self.network.prepare_off_loop(spec)
        d = self._dir(sid)
        pids = self._pids_for(spec)
        cap = self.disk_cap(spec)
        try:
            self.disk.check_fit(cap)
        except CapacityExceeded:
            if self._settling is None or self._settling.done():
                raise
            await self._settled()     # space of just-destroyed sandboxes coming back
            self.disk.check_fit(cap)
        layers = await self._acquire_layers(spec)
        box: Box | None = None
        try:
            os.mkdir(d, 0o700)
            sub = self.disk.create(sid, cap)
            upper, work = os.path.join(sub, "upper"), os.path.join(sub, "work")
            for path in (upper, work, os.path.join(d, "root")):
                os.mkdir(path, 0o700 if path != upper else 0o755)
            if spec.user_namespace:  # the overlay's root dir: writable by the mapped root
                os.chown(upper, self.userns_range[0], self.userns_range[0])
            opts = overlay_options(layers.lowerdirs, upper, work)
            del opts  # validated here, composed again by the driver
            if self._runc is not None:  # runc makes (and removes) its own cgroups
                cg = self.governor.paths(sid)
            else:
                cpus = None if self.qos_cpus is None else self.qos_cpus.of(qos_of(spec))
                io = self.qos_io.get(qos_of(spec))
                group = self._memgroups.join(sid, self.governor.layout.bases["memory"],
                                             spec.project or "", qos_of(spec),
                                             spec.memory_bytes) \
                    if self.memory_group_size > 1 and groupable(spec.user_namespace,
                                                                spec.allow_nested,
                                                                spec.memory_bytes) else None
                try:
                    cg = self.governor.create(sid, Limits(
                        spec.cpu_milli, spec.memory_bytes, pids, qos_of(spec),
                        spec.cpu_quota_milli, cpus,
                        None if io is None else (self.io_device, io),
                        memory_group=None if group is None else group.name))
                    if group is not None:    # raised before the member's first task joins
                        self._set_group_limit(group)
                except BaseException:
                    if group is not None:
                        self._leave_memory_group(sid)
                    raise
            box = Box(sid, spec, d, cg, layers, upper=upper, work=work, pids_max=pids,
                       disk_cap=cap, disk_q=self.disk.qgroup_dir(sid))
            self._boxes[sid] = box
            self._peak_boxes = max(self._peak_boxes, len(self._boxes))
            if self.network is not None:
                slot = self.network.attach(sid, spec)
                if slot is not None:
                    assert self._runc is None  # _refuse_network: native only
                    box.netns_fd = slot.fd
                    self._write_resolv_conf(box)
            if self._runc is not None:
                box.init_pid = await self._runc.create(box)
                box.pidfd = os.pidfd_open(box.init_pid)
                box.init_start = start_time(box.init_pid) or 0
                if qos_of(spec) == "be" and ("cpu" in cg.dirs or "unified" in cg.dirs):
                    self._idle_oci_box(cg)
            else:
                box.init_pid, fd = await self._native_create(box)
                try:   # read while the pidfd proves the pid still names the init
                    box.init_start = start_time(box.init_pid, running=True) or 0
                    linux.pidfd_send_signal(fd, 0)
                finally:
                    os.close(fd)   # no descriptor per idle sandbox: the zygote reports exit
                if not box.init_start:
                    raise BackendError(f"sandbox {sid}'s init (pid {box.init_pid}) exited "
                                       "as it started")
            qos_process(spec, box.init_pid)   # SCHED_IDLE for BE: inherited by its forks
            # OOM kills: no v1 eventfd (a descriptor per sandbox); the counter is read after
            # every exec, on stats and by the limits timer (as on v2)
            box.oom_seen = self.governor.oom_kills(cg)
            box.pids_seen = self.governor.pids_limit_hits(cg)
            self._watch_box(box)
            save_record(os.path.join(d, "state.json"), self._record(box))
        except BaseException as exc:
            self._boxes.pop(sid, None)
            await self._teardown(sid, d, box, layers)
            if isinstance(exc, DsecError) or not isinstance(exc, Exception):
                raise
            if isinstance(exc, ValueError):
                raise InvalidArgument(f"cannot create sandbox {sid}: {exc}") from exc
            raise BackendError(f"cannot create sandbox {sid}: {exc}") from exc

    async def set_network(self, sid: SandboxId, spec: SandboxSpec,
                          ceiling_deny: tuple[str, ...], generation: int) -> None:
        """A new egress policy for a running sandbox (``network_update``; the node has
        journaled it): loaded on its slot in one atomic batch, cutting the flows it no
        longer allows. On failure nothing changed in the kernel."""
        box = self.box(sid)
        self._refuse_network(spec, sid)
        if self.network is None:
            box.spec = spec
            return
        await self.network.prepare_off_loop(spec, ceiling_deny)
        self.network.update(sid, spec, ceiling_deny)
        box.spec = spec
        log.debug("sandbox %s: network policy generation %d loaded", sid, generation)

    @property
    def network_ipv6(self) -> bool:
        """Whether this node's sandboxes have IPv6 (their policies' v6 entries enforced):
        the router was started with it (``dsec edge --net-ipv6``)."""
        return self.network is not None and self.network.router.config.ipv6

    def network_status(self, sid: SandboxId) -> tuple[str | None, int, int]:
        """(address, denied packets, live DNS pins) for ``network_get``."""
        if self.network is None:
            return None, 0, 0
        return self.network.status(sid, time.monotonic())

    async def check_network(self, sid: SandboxId, spec: SandboxSpec,
                            ceiling_deny: tuple[str, ...]) -> None:
        """Refuse a policy this node cannot load *before* the node journals it (no fsync
        and rollback for an update that will be refused): compiled on a worker thread,
        the plan kept for the set_network that follows."""
        self.box(sid)
        self._refuse_network(spec, sid)
        if self.network is None:
            return
        await self.network.prepare_off_loop(spec, ceiling_deny)

    def _refuse_network(self, spec: SandboxSpec, sid: str | None = None) -> None:
        """A policy this backend cannot enforce is refused before anything is made
        (create) or journaled (update): see :func:`network_refusal`."""
        why = network_refusal(spec.net.net_mode, runtime=self.runtime,
                              router=self.network is not None)
        if why is not None:
            raise InvalidArgument(why, field="network",
                                  **({"sandbox_id": sid} if sid is not None else {}))

    def _write_resolv_conf(self, box: Box) -> None:
        """Point the sandbox's /etc/resolv.conf at the router's resolver (in its upper
        layer, before it starts; DNS to any other server is redirected there anyway).
        The upper layer was made empty by this create: no lookup, no unlink, and the
        owner set only where it is not root already (4 syscalls on the create path, not
        8: each is ~20-50 us on the loop of a loaded 2-core node)."""
        assert self.network is not None
        etc = os.path.join(box.upper, "etc")
        owner = self.userns_range[0] if box.spec.user_namespace else 0
        os.mkdir(etc, 0o755)
        path = os.path.join(etc, "resolv.conf")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, self.network.resolv_conf())
            if owner:
                os.fchown(fd, owner, owner)
        finally:
            os.close(fd)
        if owner:
            os.chown(etc, owner, owner)

    def qos_policy(self) -> dict[str, str]:
        """This backend's QoS pinning and I/O limits, for node info (issue 22)."""
        return qos_policy_text(self.qos_cpus, self.qos_io, self.io_device)

    def _record(self, box: Box) -> BoxRecord:
        return BoxRecord(sid=box.sid, runtime=self.runtime, spec=box.spec,
                         init_pid=box.init_pid,
                         init_start=box.init_start,
                         cgroup_version=box.cg.version, cgroup_dirs=box.cg.dirs,
                         lowerdirs=list(box.layers.lowerdirs), created_at=self.clock())

    def _tmp_bytes(self, box: Box) -> int:
        """The size of a sandbox's own tmpfs past its /dev/shm (nsexec.c: 64 KiB +
        SHM_BYTES + this): its memory limit bounds it anyway. In a memory group, whose
        limit is the group's, the whole tmpfs is the member's tmpfs budget (negative: a
        total, with an inode cap - dsec.edge.memgroups.pinned_budget): no member can pin
        its group's memory in files no OOM kill frees (red team 26 H, 27 E/M)."""
        if self._memgroups.group_of(box.sid) is None:
            return box.spec.memory_bytes
        return -pinned_budget(box.spec.memory_bytes).tmpfs_bytes

    async def _native_create(self, box: Box) -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[Reply, list[int]]] = loop.create_future()
        rid = self._zygote.next_id()
        req = Create(id=rid, lowerdirs=list(box.layers.lowerdirs),
                     upper=box.upper, work=box.work,
                     root=os.path.join(box.dir, "root"), hostname=box.sid[:63],
                     cgroup_procs=box.cg.procs_files,
                     loopback=True,   # mode "none": lo up (the old "none", lo down, is gone)
                     nested=box.spec.allow_nested, tmp_bytes=self._tmp_bytes(box),
                     userns=self.userns_range if box.spec.user_namespace else None,
                     netns=box.netns_fd >= 0,
                     # a slot's netns has interfaces of its own: its sysfs shows them
                     sysfs="" if box.netns_fd >= 0 else self.shared_sysfs,
                     # a memory group's member: a tmpfs of its own, capped at its own
                     # memory_bytes - on the shared scratch the bound was the group's
                     # limit, and one member's files (no OOM kill frees them) wedged its
                     # group-mates (red team 26, H)
                     scratch=make_scratch_dir(self.shared_scratch, box.sid)
                     if self.shared_scratch and self._memgroups.group_of(box.sid) is None
                     else "",
                     lazy_pts=self.lazy_devpts and not box.spec.user_namespace,
                     # a member's SysV objects (no OOM kill frees them) capped to its
                     # own budget in its ipc namespace (red team 26 H, 27 A/I/K)
                     ipc_caps=tuple(new_namespace_ipc_caps(box.spec.memory_bytes))
                     if self._memgroups.group_of(box.sid) is not None else ())

        def on_reply(reply: Reply, fds: list[int]) -> None:
            if fut.done():   # after Created: the init's exit (Exited) or the zygote's death
                for fd in fds:
                    os.close(fd)
                self._on_init_report(box, rid, reply)
                return
            if not isinstance(reply, Created):
                self._zygote.done(rid)
            else:
                box.watch_rid = rid
            fut.set_result((reply, fds))

        self._zygote.send(req, [box.netns_fd] if box.netns_fd >= 0 else [], on_reply)
        reply, fds = await fut
        if isinstance(reply, Created) and len(fds) == 1:
            return reply.pid, fds[0]
        for fd in fds:
            os.close(fd)
        msg = reply.message if isinstance(reply, Failed) else repr(reply)
        raise BackendError(f"sandbox {box.sid} failed to start: {msg}")

    def _watch_box(self, box: Box) -> None:
        loop = asyncio.get_running_loop()
        if box.pidfd >= 0:
            loop.add_reader(box.pidfd, self._on_init_exit, box)
        if box.oom_fd is not None:
            loop.add_reader(box.oom_fd, self._on_oom_event, box)
        if self._poll is None and self.limits_poll_s is not None:
            self._poll = loop.call_later(self.limits_poll_s, self._poll_limits)
        if self._dpoll is None and self.network is not None and self.denied_poll_s:
            self._dpoll = loop.call_later(self.denied_poll_s, self._poll_denied_tick)
        if qos_of(box.spec) == "be":
            self._suppress_start()

    _POLL_SLICE = 256  # sandboxes checked per timer tick (~8 us each): no long loop stall

    def _idle_oci_box(self, cg: SandboxCgroup) -> None:
        """runc/runsc BE sandbox: runc made its cpu cgroup (beside the LS ones under the
        base, not under the idle BE parent - see docs/container.md "BE suppression"), so
        the group is marked ``cpu.idle`` itself (idle against its LS siblings) and every
        thread already in it - the gVisor Sentry's and gofer's, started multi-threaded -
        is put under SCHED_IDLE (red team 25 C1)."""
        d = cg.dirs["unified"] if cg.version == 2 else cg.dirs["cpu"]
        with contextlib.suppress(OSError), open(os.path.join(d, "cpu.idle"), "w") as f:
            f.write("1")
        idle_every_task(d)

    # -- BE suppression -----------------------------------------------------------------
    def _be_boxes(self) -> list[Box]:
        return [b for b in self._boxes.values() if qos_of(b.spec) == "be" and not b.dying]

    def _be_cpu_ns(self) -> int:
        """CPU time of the live BE sandboxes, ns: one file read each (cpuacct.usage;
        v2 cpu.stat) - measured ~60 us each on this VM when it went through ``stats``'
        four reads (red team 24 B4), so a tick at 1,000 BE sandboxes stalled the loop
        ~60 ms; a BE parent in the cpuacct hierarchy would make it one read (not done).
        Also notes what each used since the last reading (cores), for sharing the cap
        by demand."""
        total = 0
        now = time.monotonic()
        seen: dict[str, tuple[float, int]] = {}
        for b in self._be_boxes():
            ns = self.governor.cpu_ns(b.cg)
            total += ns
            seen[b.sid] = (now, ns)
            last = self._be_seen.get(b.sid)
            if last is not None and now > last[0]:
                self._be_used[b.sid] = max(0.0, (ns - last[1]) / ((now - last[0]) * 1e9))
        self._be_seen = seen
        self._be_used = {s: u for s, u in self._be_used.items() if s in seen}
        return total

    def _own_cpu_cores(self, spec: SandboxSpec) -> float:
        return (spec.cpu_quota_milli or spec.cpu_milli) / 1000

    def _set_be_cap(self, cores: float | None) -> None:
        """Share ``cores`` among the live BE sandboxes by demand
        (:func:`dsec.edge.qos.share_be_cap`; ``None``: each back to its own cap).
        Written per sandbox (v1 refuses a BE parent quota below a child's), only where
        the value moved; below 1 ms per 10 ms a sandbox gets a 100 ms, then 1 s period
        (``Governor.set_cpu_quota``), so the shares add up to the cap down to 0.001 core
        per BE sandbox."""
        boxes = self._be_boxes()
        own: dict[str, float] = {b.sid: self._own_cpu_cores(b.spec) for b in boxes}
        share = own if cores is None or self._suppress is None else \
            share_be_cap(cores, own, self._be_used)
        for b in boxes:
            want = share[b.sid]
            had = self._be_quota.get(b.sid)
            if had is not None and (want == had or (
                    want < own[b.sid] and abs(want - had) <= 0.05 * had)):
                continue   # (demand moves a little every tick: no write for that)
            try:
                if want >= own[b.sid] or self._suppress is None:   # its own cap, as made
                    self.governor.set_cpu_quota(b.cg, own[b.sid])
                else:
                    self.governor.set_cpu_quota(
                        b.cg, want, period_us=self._suppress.policy.period_us)
                self._be_quota[b.sid] = want
            except (OSError, KeyError) as exc:   # gone meanwhile (or no cpu dir known)
                if b.sid not in self._be_warned:
                    self._be_warned.add(b.sid)
                    log.warning("BE suppression: cannot cap sandbox %s: %s", b.sid, exc)
        for sid in [s for s in self._be_quota if s not in own]:
            del self._be_quota[sid]
        self._be_warned &= set(own)

    def _suppress_tick(self) -> None:
        """Every ``interval_s`` while BE sandboxes live: re-cap them (see __init__)."""
        self._suppress_timer = None
        sup = self._suppress
        if sup is None:
            return
        if not self._be_boxes():
            sup.release()
            return
        if self._runc is not None:
            # threads an OCI runtime's processes (gVisor's Sentry, its stubs) made since
            # from threads that predate their sandbox's idle pass
            for b in self._be_boxes():
                self._idle_oci_box(b.cg)
        try:
            before = sup.cap
            sup.tick()                  # sets the cap through _set_be_cap when it moved
            if sup.cap == before:
                self._set_be_cap(sup.cap)   # else: new BE sandboxes, demand that moved
        except (OSError, ValueError) as exc:
            log.warning("BE suppression tick failed: %s", exc)
        self._suppress_timer = asyncio.get_running_loop().call_later(
            sup.policy.interval_s, self._suppress_tick)

    def _suppress_start(self) -> None:
        if self._suppress is not None and self._suppress_timer is None:
            self._suppress_timer = asyncio.get_running_loop().call_later(
                0, self._suppress_tick)

    def _poll_limits(self) -> None:
        """Every ``limits_poll_s``: limit counters of every sandbox (v1 pids.events has no
        notification, and a fork bomb in a background process may never be followed by
        an exec). At most _POLL_SLICE sandboxes per tick, ticks coming sooner when there
        are more, so each is still checked about every ``limits_poll_s``."""
        self._poll = None
        boxes = list(self._boxes.values())
        if self.limits_poll_s is None:
            return
        self._settle_groups()
        if not boxes:
            self._poll_groups_later()
            return
        start = self._poll_next % len(boxes)
        chunk = (boxes[start:] + boxes[:start])[:self._POLL_SLICE]
        self._poll_next = start + len(chunk)
        now = time.monotonic()
        for box in chunk:
            # (init_pid 0: still being created - its init is not started yet; the runc
            # and runsc drivers register the box before `run` answers, 0.1-0.4 s for
            # runsc, and a tick then declared it dead: "init (pid 0) exited")
            if not box.dying and box.init_pid and box.pidfd < 0 and not box.watch_rid \
                    and not box.exited.is_set() \
                    and start_time(box.init_pid, running=True) != box.init_start:
                # nobody reports this init's exit (the zygote that was its parent died)
                self._init_died(box)
            if not box.dying:
                self._check_pids(box)
                if box.oom_fd is None:  # v2: no OOM eventfd to wake us
                    self._check_oom(box, report=True)
                if box.helper and not box.helper_busy and self.helper_idle_s is not None \
                        and now - box.helper_used >= self.helper_idle_s:
                    self._retire_idle_helper(box)
        delay = self.limits_poll_s * min(1.0, self._POLL_SLICE / len(boxes))
        self._poll = asyncio.get_running_loop().call_later(delay, self._poll_limits)

    def _retire_idle_helper(self, box: Box) -> None:
        """Stop ``box``'s exec helper, idle for ``helper_idle_s`` (density, issue 22: a
        helper is a process - measured ~93 KiB of kernel memory per sandbox at n=1,000 -
        that an idle sandbox does not need; its next exec takes the per-exec
        path and starts a new one). Signalled through a pidfd checked against the start
        time recorded when it started, so never another process that got its number; its
        exit (reaped and reported by the zygote) is then not counted as a failure."""
        rid, pid = box.helper, box.helper_pid
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return   # gone already: the zygote's Exited reply clears it
        try:
            if start_time(pid, running=True) != box.helper_pid_start:
                return
            box.helper_retiring = rid
            box.helper = 0   # no exec goes to it any more, not even a BE one waiting on
            box.helper_start = None   # its start: the next exec starts a new helper
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(fd)

    def _poll_denied_tick(self) -> None:
        self._dpoll = None
        if not self._boxes or self.network is None or not self.denied_poll_s:
            return  # the next sandbox watched starts it again
        self._poll_denied()
        self._dpoll = asyncio.get_running_loop().call_later(self.denied_poll_s,
                                                            self._poll_denied_tick)

    def _poll_denied(self) -> None:
        """One counter dump for every slot (0.28 ms for 1,000); a ``network_denied``
        notice per sandbox that had packets dropped, at most one per ``denied_notice_s``
        with every packet since the last. The examples come from a libnftables listing
        (milliseconds on a big table), so they are fetched off the loop, and only for a
        notice that will go out."""
        assert self.network is not None
        try:
            denials = self.network.poll_denied()
        except DsecError as exc:
            log.warning("reading the network counters failed: %s", exc.message)
            return
        for d in denials:
            box = self._boxes.get(d.sandbox_id)
            if box is None or box.dying:
                continue
            pending = self._denied_pending[box.sid] = (
                self._denied_pending.get(box.sid, 0) + d.packets)
            folded = self._denied_notices.admit(box.sid, "network_denied", self.clock())
            if folded is None:
                continue
            self._denied_pending[box.sid] = 0
            task = asyncio.get_running_loop().create_task(
                self._denied_notice(box, pending, d.total))
            self._cleanups.add(task)
            task.add_done_callback(self._cleanups.discard)

    async def _denied_notice(self, box: Box, packets: int, total: int) -> None:
        assert self.network is not None
        slot = self.network.slot(box.sid)
        held = (slot, slot.generation) if slot is not None else None
        try:
            examples = await asyncio.to_thread(self.network.recent_denied, box.sid)
        except (DsecError, OSError):
            examples = []
        now = self.network.slot(box.sid)
        if held is None or now is not held[0] or now.generation != held[1]:
            # the slot changed hands (or policy) while it was listed: the examples may
            # be the next tenant's destinations, never shown to this one
            examples = []
        detail = (f"sandbox {box.sid}'s egress policy dropped {packets} packet(s) "
                  f"since its last such notice ({total} since it started)"
                  + (f", e.g. to {', '.join(examples[:4])}" if examples else "")
                  + "; allow the destination in its network policy if it is needed"
                  + f" (at most one such notice per {self._denied_notices.interval_s:g} s)")
        if not box.dying:
            self._report(box, "network_denied", detail)

    def _unwatch_box(self, box: Box) -> None:
        loop = asyncio.get_running_loop()
        if box.pidfd >= 0:
            loop.remove_reader(box.pidfd)
        if box.oom_fd is not None:
            loop.remove_reader(box.oom_fd)
        if box.watch_rid:
            self._zygote.done(box.watch_rid)
            box.watch_rid = 0

    def _on_init_report(self, box: Box, rid: int, reply: Reply) -> None:
        """What the zygote says about a running sandbox's init: Exited (it was reaped), or
        Failed (the zygote died: the init lives on, reparented; the limits timer then
        watches it by its start time)."""
        self._zygote.done(rid)
        if box.watch_rid == rid:
            box.watch_rid = 0
        if isinstance(reply, Exited):
            self._init_died(box)
        elif self._poll is None and self.limits_poll_s is not None and not box.dying:
            self._poll = asyncio.get_running_loop().call_later(self.limits_poll_s,
                                                               self._poll_limits)

    def _on_init_exit(self, box: Box) -> None:
        asyncio.get_running_loop().remove_reader(box.pidfd)
        self._init_died(box)

    def _init_died(self, box: Box) -> None:
        if box.exited.is_set():
            return
        box.exited.set()
        if box.dying:
            return
        oom = self._check_oom(box, report=False) or bool(box.kill_reason)
        reason = "oom" if oom else "backend_crash"
        detail = (f"the sandbox's init (pid {box.init_pid}) exited"
                  + (f": {box.kill_reason}" if box.kill_reason else
                     f" after the OOM killer fired in its cgroup (memory limit "
                     f"{box.spec.memory_bytes} bytes)" if oom else ""))
        if not oom and self._runsc is not None \
                and self.governor.pids_limit_hits(box.cg) > box.pids_seen:
            # gVisor's Sentry cannot go on when the host refuses it a task (a stub for a
            # new process): the whole sandbox stops instead of one fork failing
            detail += (f" after its host task limit was hit (pids_max {box.spec.pids_max}"
                       " plus the Sentry's own threads): on the gvisor tier too many "
                       "processes stop the whole sandbox - raise pids_max")
        self._report(box, reason, detail)

    def _on_oom_event(self, box: Box) -> None:
        assert box.oom_fd is not None
        try:
            os.eventfd_read(box.oom_fd)
        except BlockingIOError:
            return
        if not box.dying:
            self._check_oom(box, report=True)

    # -- memory groups (opt-in, dsec.edge.memgroups) ------------------------------------
    def _set_group_limit(self, g: MemoryGroup, *, lower: bool = True) -> None:
        """The group's limit to the sum of its members' (raised before a new member's
        first task joins; lowered after a leaving one's tasks are dead, once the group
        fits - until then ``pending``, retried by the limits timer). ``lower=False``:
        raise only (adopt: members not adopted yet still run in the group)."""
        soft = 0 if g.key[1] == "be" else g.limit_bytes
        try:
            before = self.governor.group_limit(g.dir)
            done = self.governor.set_group_memory(g.dir, g.limit_bytes, soft_bytes=soft,
                                                  lower=lower)
        except OSError as exc:
            log.warning("memory group %s: its limit could not be set to %d bytes: %s",
                        g.dir, g.limit_bytes, exc)
            g.pending = True
            return
        lowered = done and lower and g.limit_bytes < before
        g.pending = not done
        if g.pending and lower and g.pending_since is None:
            g.pending_since, g.debtors, g.strike = time.monotonic(), frozenset(g.members), None
        elif g.pending_since is not None and (lowered or not g.debtors & set(g.members)):
            g.pending_since, g.debtors, g.strike = None, frozenset(), None
        self._mark_unsettled(g)
        if not done and lower:
            log.info("memory group %s holds more than its members' new total of %d "
                     "bytes: its limit is lowered once it fits", g.dir, g.limit_bytes)

    def _leave_memory_group(self, sid: str) -> None:
        """``sid`` leaves its memory group (if any); its last member removes the group's
        cgroup. On the loop with no await between: no create joins it meanwhile. A
        group whose cgroup still holds a task is retired: never joined again, its name
        never reused, its removal retried by the limits timer (red team 26, G)."""
        g = self._memgroups.leave(sid)
        if g is not None:
            self._settle_group(g)

    def _settle_group(self, g: MemoryGroup) -> None:
        if g.dir in self._fitting:        # a deadline step runs: the tick after it
            self._unsettled.add(g.dir)
            return
        try:
            if g.members:
                self._set_group_limit(g)
            elif self.governor.remove_group(g.dir):
                self._memgroups.drop(g.dir)
            else:
                if not g.retired:
                    log.warning("memory group %s has no member left but still holds "
                                "tasks; retired (removed once empty)", g.dir)
                self._memgroups.retire(g.dir)
                self._mark_unsettled(g)
        except OSError as exc:
            log.warning("memory group %s: %s", g.dir, exc)

    async def _make_group_fit(self, g: MemoryGroup) -> None:
        """A group past its lowering deadline (red team 27 C: a member that kept using
        its departed group-mate's share kept it for good, while the node's admission had
        released it at the destroy). One step per limits tick, every slow part in a
        worker thread (the limit's write can reclaim for seconds, PSS reads walk page
        tables: red team 29 C, 30 D/F); the group takes no new member meanwhile
        (a pending group never does) and its other settles wait for the step:

        - if what it holds less its clean, unmapped file cache fits, lower with reclaim
          (the limit's write drops that cache; memsw's follows);
        - otherwise kill, as the kernel's OOM killer would at the new limit, in the
          member most over its own share by what it really holds - its processes' PSS
          + swap and what it pins with no process (:func:`memgroups.pick_victim`; 29 A)
          - its largest process; if the last kill there freed nothing of the group's
          memory (29 B), every process of it, its init too, which ends the sandbox and
          frees its ipc namespace and tmpfs. No member over its share: nothing is
          killed (30 A); the group waits, its soft limit at the sum.

        Each kill is an ``oom_kill`` notice; a whole member's end is its death reason."""
        try:
            if g.dir not in self._memgroups.groups or not g.pending:
                return
            soft = 0 if g.key[1] == "be" else g.limit_bytes
            try:
                used, clean = self.governor.group_use(g.dir)
                if used - clean <= g.limit_bytes and await asyncio.to_thread(
                        self.governor.set_group_memory, g.dir, g.limit_bytes,
                        soft_bytes=soft, force=True):
                    g.pending, g.pending_since, g.debtors, g.strike = \
                        False, None, frozenset(), None
                    return
            except OSError as exc:
                log.warning("memory group %s: cannot lower its limit: %s", g.dir, exc)
                return
            members = dict(g.members)
            live = {sid: box for sid in members
                    if (box := self._boxes.get(sid)) is not None and not box.exited.is_set()
                    and not box.dying}
            procs, pinned = await asyncio.to_thread(self._member_figures, live)
            if g.dir not in self._memgroups.groups or not g.pending or g.members != members:
                return              # changed while it was read: the next tick
            victim = pick_victim(procs, members, pinned)
            if victim is None:
                return
            sid, proc = victim
            box = live[sid]
            figure = member_figure(procs[sid], pinned[sid])
            why = (f"its memory group {g.name} still held {used} bytes, more than its "
                   f"members' total of {g.limit_bytes}, {self.memory_group_grace_s:g} s "
                   f"after a member left, and sandbox {sid} held {figure} bytes (its "
                   f"processes' PSS + swap, and {pinned[sid]} pinned in SysV IPC and its "
                   f"tmpfs) against its memory_bytes of {members[sid]} (docs/container.md "
                   "'Memory groups')")
            if kill_freed_nothing(g.strike, sid, used):
                g.strike = None
                box.kill_reason = f"dsec killed every process of it: {why}"
                self._notice(box, "oom_kill", f"dsec killed every process of sandbox "
                             f"{sid}, its init too (so the sandbox ends): {why}; killing "
                             "its largest process had freed nothing")
                await asyncio.to_thread(self.governor.kill_all, box.cg)
                return
            if self._kill_member_proc(box, proc.pid):
                g.strike = Strike(sid=sid, group_used=used, freed=proc.bytes)
                self._notice(box, "oom_kill", (
                    f"dsec killed process {proc.pid} ({proc.bytes} bytes"
                    f"{', the sandbox init' if proc.init else ''}) in sandbox {sid}: {why}"))
        finally:
            self._fitting.discard(g.dir)

    def _member_figures(self, live: dict[str, Box]
                        ) -> tuple[dict[str, list[Proc]], dict[str, int]]:
        """(thread) Each live member's processes with their PSS + swap (a page its
        processes share counts once; from its own pids cgroup, v1 flat: exec'd processes
        too), and what it pins with no process mapping it: SysV shm segments no one
        attaches and message queues (read in its ipc namespace), its tmpfs mounts (/tmp,
        /dev, /dev/shm). Reached through its init only while that pid is still its init
        (start time): a dead member's reused pid is another process (red team 30 E)."""
        procs: dict[str, list[Proc]] = {}
        pinned: dict[str, int] = {}
        for sid, box in live.items():
            procs[sid] = [Proc(pid=pid, bytes=used, init=pid == box.init_pid)
                          for pid in self.governor.pids(box.cg)
                          if (used := _pss_and_swap(pid)) is not None]
            pinned[sid] = 0
            if not box.init_start or start_time(box.init_pid) != box.init_start:
                continue
            root = f"/proc/{box.init_pid}/root"
            with contextlib.suppress(OSError):
                seen = {os.stat(root).st_dev}        # the overlay root: not a tmpfs
                for path in ("tmp", "dev", "dev/shm"):
                    st = os.stat(f"{root}/{path}")
                    if st.st_dev in seen:
                        continue
                    seen.add(st.st_dev)
                    v = os.statvfs(f"{root}/{path}")
                    pinned[sid] += (v.f_blocks - v.f_bfree) * v.f_frsize
            try:
                fd = os.open(f"/proc/{box.init_pid}/ns/ipc", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                if start_time(box.init_pid) == box.init_start:   # still its init's
                    pinned[sid] += _sysvipc_pinned(fd)
            finally:
                os.close(fd)
        return procs, pinned

    def _kill_member_proc(self, box: Box, pid: int) -> bool:
        """SIGKILL ``pid`` if it is still one of ``box``'s: a pidfd first, then the
        membership check, so a pid reused since the read is never signalled."""
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return False
        try:
            if pid not in self.governor.pids(box.cg):
                return False
            linux.pidfd_send_signal(fd, signal.SIGKILL)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def _mark_unsettled(self, g: MemoryGroup) -> None:
        if g.pending or g.retired:
            self._unsettled.add(g.dir)
        else:
            self._unsettled.discard(g.dir)

    def _settle_groups(self) -> None:
        """The limits timer, every tick (only the groups that wait: a set, not a scan -
        red team 27 G): lowerings that waited for a group to fit, retired groups'
        removal."""
        for d in list(self._unsettled):
            g = self._memgroups.groups.get(d)
            if g is None:
                self._unsettled.discard(d)
                continue
            if (g.pending and g.members and g.pending_since is not None
                    and time.monotonic() - g.pending_since >= self.memory_group_grace_s
                    and d not in self._fitting):
                self._fitting.add(d)
                task = asyncio.get_running_loop().create_task(self._make_group_fit(g))
                self._cleanups.add(task)
                task.add_done_callback(self._cleanups.discard)
                continue            # its settle is the task's, after it
            if d in self._fitting:
                continue
            self._settle_group(g)
            if d not in self._memgroups.groups:
                self._unsettled.discard(d)
            else:
                self._mark_unsettled(g)

    def _poll_groups_later(self) -> None:
        """Keep the limits timer going while a group waits, even with no sandbox held
        (a group retired at reconcile, red team 27 L)."""
        if self._unsettled and self._poll is None and self.limits_poll_s is not None:
            self._poll = asyncio.get_running_loop().call_later(self.limits_poll_s,
                                                               self._poll_limits)

    def memory_group_of(self, sid: str) -> str:
        """The memory group ``sid`` is in ("" for a memcg of its own): the node's
        pressure policy pauses a group's members together (dsec.edge.qos.plan_relief)."""
        g = self._memgroups.group_of(sid)
        return "" if g is None else g.dir

    def _memory_limit(self, box: Box) -> int:
        """The memory limit that binds ``box``: its own, or its memory group's."""
        g = self._memgroups.group_of(box.sid)
        return box.spec.memory_bytes if g is None else g.limit_bytes

    def _check_oom(self, box: Box, *, report: bool) -> bool:
        """True if the OOM killer killed something in ``box`` since the last check. In a
        memory group the counter is the group's: a kill is reported once, by the member
        that sees it first, saying the victim may be any member's."""
        kills = self.governor.oom_kills(box.cg)
        g = self._memgroups.group_of(box.sid)
        seen = box.oom_seen if g is None else max(box.oom_seen, g.oom_seen)
        box.oom_seen = max(box.oom_seen, kills)
        if kills <= seen:
            return False
        n = kills - seen
        if g is not None:
            g.oom_seen = kills
            if report:
                held = memory_held(box.cg.version, self.governor.memory_stat(box.cg))
                others = sorted(m for m in g.members if m != box.sid)
                self._notice(box, "oom_kill", (
                    f"the OOM killer killed {n} process(es) in memory group {g.name}, "
                    f"which hit its limit of {g.limit_bytes} bytes (the sum of its "
                    f"{len(g.members)} sandboxes' memory_bytes; at the kill the group held "
                    f"rss={held.rss} cache={held.cache} shm={held.shm} bytes). The victim "
                    f"may be in this sandbox or in {', '.join(others) or 'none other'} "
                    "(memory_group_size > 1 shares one limit: docs/container.md 'Memory "
                    "groups'); the sandbox itself is still running"))
                self._check_tmpfs(box)
            return True
        if report:
            # what the sandbox held right then, by kind (issue 22): which kind to cut
            held = memory_held(box.cg.version, self.governor.memory_stat(box.cg))
            self._notice(box, "oom_kill", f"the OOM killer killed {n} process(es) in sandbox "
                         f"{box.sid}, which hit its memory limit of {box.spec.memory_bytes} "
                         f"bytes (at the kill it held rss={held.rss} cache={held.cache} "
                         f"shm={held.shm} bytes, qos={qos_of(box.spec)}); the sandbox "
                         "itself is still running - raise memory_bytes")
            self._check_tmpfs(box)
        return True

    def _check_disk(self, box: Box) -> bool:
        """After an exec (and on a refused file write): a sandbox at its disk cap, or on a
        full pool, gets a ``disk_full`` notice (at most one per ``notice_interval_s``).
        Two sysfs reads and one statvfs, ~20 µs."""
        if not box.disk_q:
            return False
        use = DiskPool.usage_at(box.disk_q)
        if near_cap(use.used_bytes, use.cap_bytes):
            detail = (f"sandbox {box.sid} filled its disk cap of {use.cap_bytes} bytes "
                      f"({use.used_bytes} used); writes fail with EDQUOT (Disk quota "
                      "exceeded) until files are removed - free space inside the sandbox "
                      "or create it with a larger disk_bytes")
        else:
            vfs = os.statvfs(box.upper)
            free = vfs.f_bavail * vfs.f_frsize
            if free >= 1 << 20:
                return False
            detail = (f"the node's sandbox disk pool is full ({free} bytes free, sandbox "
                      f"{box.sid} holds {use.used_bytes} of its {use.cap_bytes}-byte cap); "
                      "writes fail with ENOSPC until sandboxes free space")
        self._notice(box, "disk_full", detail)
        return True

    def _disk_room(self, box: Box) -> tuple[int, str]:
        """Bytes ``box`` may still write to its disk (its cap, or the pool when that has
        less free) and a phrase naming the limit (for the file API's refusals)."""
        use = DiskPool.usage_at(box.disk_q)
        room = max(0, use.cap_bytes - use.used_bytes)
        vfs = os.statvfs(box.upper)
        pool_free = vfs.f_bavail * vfs.f_frsize
        if pool_free < room:
            return pool_free, "the node's sandbox disk pool"
        return room, (f"its disk cap of {use.cap_bytes} bytes ({use.used_bytes} used)")

    def _memory_room(self, box: Box) -> tuple[int, str]:
        """Bytes ``box``'s memory limit has left (for writes into its tmpfs)."""
        limit = self._memory_limit(box)
        try:
            used = self.governor.memory_usage(box.cg)
        except (OSError, ValueError):
            used = 0
        return max(0, limit - used), f"its memory limit of {limit} bytes ({used} used)"

    def _enter_memcg(self, box: Box, pid: int) -> Callable[[], None]:
        """Move the edge's writer ``pid`` into ``box``'s memory cgroup (files.py,
        ChargedWriter: tmpfs pages are charged to the writer). v1: the memory hierarchy
        only (not the freezer: a paused sandbox must not freeze the edge's write). v2:
        a leaf of its own below the sandbox's cgroup (the no-internal-process rule),
        removed after the writer exited; charges stay with the sandbox."""
        if box.cg.version == 2:
            ec = self.governor.exec_cgroup(box.cg, f"files-{secrets.token_hex(4)}")
            try:
                with open(os.path.join(ec.dir, "cgroup.procs"), "w") as f:
                    f.write(str(pid))
            except BaseException:
                self.governor.remove_exec(ec)
                raise

            def undo() -> None:
                self.governor.remove_exec(ec)
            return undo
        with open(os.path.join(box.cg.dirs["memory"], "cgroup.procs"), "w") as f:
            f.write(str(pid))
        return lambda: None

    def _check_tmpfs(self, box: Box) -> None:
        """After an OOM kill: if tmpfs files (/tmp and /dev/shm are sized by memory, and
        no OOM kill frees them) hold most of the memory limit, every new process will be
        OOM-killed too - the sandbox is wedged though "running". Say so, and how out."""
        held = self.governor.memory_shmem(box.cg)
        limit = self._memory_limit(box)
        if held * 2 < limit:
            return
        self._notice(box, "tmpfs_full", (
            f"tmpfs files (/tmp, /dev/shm) in sandbox {box.sid} hold {held >> 20} MiB of its "
            f"{limit >> 20} MiB memory limit, and no OOM kill gives that back: new "
            "processes will be OOM-killed. Delete files there with the file API (remove "
            "'/tmp/...'), which needs no process inside, or destroy the sandbox"))

    def _check_pids(self, box: Box) -> None:
        """A notice when forks in ``box`` failed on its task limit since the last check."""
        hits = self.governor.pids_limit_hits(box.cg)
        if hits <= box.pids_seen:
            return
        n, box.pids_seen = hits - box.pids_seen, hits
        cur, limit = self.governor.pids_limit(box.cg)
        self._notice(box, "pids_limit", (
            f"{n} fork(s) in sandbox {box.sid} failed: it has {cur} tasks of its limit of "
            f"{limit if limit is not None else box.pids_max} (pids_max; all sandboxes of this "
            f"tier together may have {self.pids_total}); the sandbox itself is still "
            "running - raise pids_max or end processes"))

    def _check_limits(self, box: Box) -> None:
        """Every limit that turns into a notice, after each exec: OOM kills, the task
        limit (~8 us per counter read), the disk cap (~20 us)."""
        self._check_oom(box, report=True)
        self._check_pids(box)
        self._check_disk(box)

    def _notice(self, box: Box, reason: str, detail: str) -> None:
        """Report a notice (``lifecycle.NOTICE_REASONS``: the sandbox lives on), at most
        one per kind and sandbox per interval; the next one says how many were folded.
        The helper for every backend-level limit event (OOM kills, task limit, disk)."""
        folded = self._notices.admit(box.sid, reason, self.clock())
        if folded is None:
            return
        if folded:
            detail += (f" ({folded} more notice(s) of this kind in the last "
                       f"{self._notices.interval_s:g} s were folded into this one)")
        self._report(box, reason, detail)

    def lazy_event(self, ev: dict[str, Any]) -> None:
        """An event of the node's lazy layer daemon (:mod:`dsec.edge.lazy.layers`; call
        on the event loop): a failed fetch or a daemon restart becomes a
        ``layer_unavailable`` notice for every sandbox whose image holds the layer."""
        kind = ev.get("ev")
        if kind == "fetch_failed" and not ev.get("prefetch"):
            digest = "sha256:" + str(ev.get("layer"))
            detail = (f"reads of image layer {digest} failed with EIO inside the sandbox: "
                      f"{ev.get('cause')}; the node and other layers are unaffected, "
                      "retry when the blob store is reachable")
        elif kind == "daemon_restarted":
            digest = None
            detail = ("the node's lazy layer daemon died and was restarted: pages of lazily "
                      "loaded layers this sandbox had not read yet fail with EIO in it "
                      "(its mounts were bound to the old daemon); recreate the sandbox, "
                      "new sandboxes read through the new daemon")
        else:
            return
        for box in list(self._boxes.values()):
            token = box.layers.token
            digests = getattr(token, "digests", ())
            lazy = getattr(self.images, "lazy", None)
            if digest is None:
                hit = lazy is not None and any(lazy.knows(d) for d in digests)
            else:
                hit = digest in digests
            if hit:
                self._notice(box, "layer_unavailable", detail)

    def _report(self, box: Box, reason: str, detail: str) -> None:
        if self._sink is not None:
            self._sink(box.sid, reason, detail)

    async def _acquire_layers(self, spec: SandboxSpec) -> RootLayers:
        """``images.acquire(spec)`` in a worker thread. A cold create on lazy layers
        resolves manifests and chunk tables from the blob store and its first mount reads
        the superblock through FUSE: seconds on a slow store, during which this loop
        serves every other sandbox of the node (it used to run here and stall them all).
        A thread cannot be interrupted, so a create cancelled meanwhile waits for it and
        gives back what it acquired: once the cancellation surfaces, no mount reference
        of the create is left."""
        task = asyncio.ensure_future(asyncio.to_thread(self.images.acquire, spec))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            while not task.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({task})
            if not task.cancelled() and task.exception() is None:
                self.images.release(task.result())
            raise

    async def adopt(self, sid: SandboxId, spec: SandboxSpec) -> bool:
        """Take back a sandbox a previous edge process created (after a kill -9).

        It is alive if the recorded init pid still has the recorded start time and sits
        in the recorded cgroup; then it is watched again and exec-able. Otherwise what is
        left of it (cgroups, directory) is removed and False returned."""
        ceiling = self._adopt_ceiling.pop(sid, ())
        if sid in self._boxes:
            return True
        d = self._dir(sid)
        rec = load_record(os.path.join(d, "state.json"))
        if rec is None:
            await self._teardown(sid, d, None, None)
            return False
        cg = SandboxCgroup(rec.cgroup_version, dict(rec.cgroup_dirs))  # type: ignore[arg-type]
        gdir = cg.dirs.get("memory", "")
        if is_group_name(os.path.basename(gdir)):   # tracked whatever this edge's size
            cg = SandboxCgroup(cg.version, cg.dirs, ("memory",))
            self._memgroups.adopt(sid, gdir, spec.project or "", qos_of(spec),
                                  spec.memory_bytes)
        layers = RootLayers(tuple(rec.lowerdirs))
        try:
            layers = await self._acquire_layers(spec)
        except DsecError:
            pass  # the image went away; the running sandbox still has its mounts
        upper, work = self._rw_dirs(sid)
        box = Box(sid, spec, d, cg, layers, upper=upper, work=work,
                   pids_max=rec.spec.pids_max, init_pid=rec.init_pid,
                   init_start=rec.init_start, adopted=True)
        if os.path.isdir(self.disk.sandbox_path(sid)):
            box.disk_q = self.disk.qgroup_dir(sid)
            box.disk_cap = DiskPool.usage_at(box.disk_q).cap_bytes
        start = start_time(rec.init_pid)
        members = self.governor.pids(cg)
        alive = start == rec.init_start and rec.init_pid in members
        why = ("" if alive else f"its init (pid {rec.init_pid}, start {rec.init_start}) is "
               + ("gone" if start is None else f"another process (start {start})"
                  if start != rec.init_start else f"not in its cgroup ({len(members)} there)"))
        if alive:
            try:
                box.pidfd = os.pidfd_open(rec.init_pid)
            except OSError as exc:
                alive, why = False, f"pidfd_open of its init failed: {exc}"
        if not alive:
            log.warning("sandbox %s cannot be adopted: %s; removing what is left", sid, why)
            await self._teardown(sid, d, box, layers)
            return False
        if qos_of(spec) == "be":
            # its own CPU cap back: one a suppressing edge scaled lives in the kernel,
            # not in a record, and a kill -9 restored nothing (red team 24 B3); this
            # edge's suppressor, if any, scales from here
            with contextlib.suppress(OSError):
                self.governor.set_cpu_quota(cg, self._own_cpu_cores(spec))
        box.paused = self.governor.is_frozen(cg)
        box.oom_seen = self.governor.oom_kills(cg)
        box.pids_seen = self.governor.pids_limit_hits(cg)
        g = self._memgroups.group_of(sid)
        if g is not None:
            g.oom_seen = max(g.oom_seen, box.oom_seen)
            # raise only: group-mates not adopted yet run in it, with their share (red
            # team 26, A); reconcile sets the exact sum once adoption is over
            self._set_group_limit(g, lower=False)
        self._boxes[sid] = box
        self._peak_boxes = max(self._peak_boxes, len(self._boxes))
        self._watch_box(box)
        self._lazy_adopted(box)
        if self.network is not None and spec.net.net_mode != "none":
            # Its slot (netns held by its processes, veth end by the pinned router) is
            # checked against the router, with every other adopted one, by reconcile()
            # before the edge serves (dsec.net.reconcile).
            try:
                fd = os.open(f"/proc/{rec.init_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                self._network_lost(box, f"its netns cannot be opened: {exc}")
            else:
                self.network.adopt(sid, spec, fd, ceiling)
        return True

    def adopting(self, sid: str, ceiling_deny: tuple[str, ...]) -> None:
        """The node's word, before :meth:`adopt`, on the project ceilings' deny entries
        the sandbox's policy was loaded with (journaled beside it)."""
        self._adopt_ceiling[sid] = ceiling_deny

    def _lazy_adopted(self, box: Box) -> None:
        """An adopted sandbox on lazily read layers: its overlay still stands on the
        layers the previous edge's FUSE daemon served, and that daemon went with its
        edge (it exits when its edge does), so pages it had not read fail with EIO. Say
        so (issue 17); new sandboxes read through this edge's daemon."""
        lazy = getattr(self.images, "lazy", None)
        digests = getattr(box.layers.token, "digests", ())
        remote = [d for d in digests if lazy is not None and lazy.knows(d)]
        if remote:
            self._notice(box, "layer_unavailable", (
                f"sandbox {box.sid} was adopted after an edge restart; its lazily loaded "
                f"layers ({', '.join(remote)}) were served by the previous edge's FUSE "
                "daemon, so pages it had not read yet fail with EIO in it; recreate the "
                "sandbox to read them through this edge's daemon"))

    def _network_lost(self, box: Box, why: str) -> None:
        assert self.network is not None
        self.network.lost.add(box.sid)
        detail = (f"sandbox {box.sid} was adopted after an edge restart without its "
                  f"network ({why}): it now reaches nothing; re-create it to get its "
                  "network policy back")
        log.warning("%s", detail)
        self._notice(box, "network_lost", detail)

    async def destroy(self, sid: SandboxId) -> None:
        box = self._boxes.pop(sid, None)
        d = self._dir(sid)
        if box is None:
            # Left over from a crash or an earlier edge process: adopt() either takes it
            # back (then it is destroyed like any other) or cleans up what is left.
            if os.path.isdir(d) and await self.adopt(sid, SandboxSpec()):
                await self.destroy(sid)
            return
        try:
            await self._teardown(sid, d, box, box.layers)
        except BackendError as exc:
            await self._destroy_again(sid, exc.message)
        except OSError as exc:   # a step that does not collect its errors (EMFILE in rmtree)
            await self._destroy_again(sid, f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # a bug in one step (the RecursionError
            # of red team 22, B3) must not leave the sandbox's cgroups, processes and
            # files behind with nothing retrying: log it and retry from the census
            log.exception("destroy of sandbox %s raised", sid)
            await self._destroy_again(sid, f"{type(exc).__name__}: {exc}")

    #: pauses between the attempts of a destroy whose teardown failed (each attempt
    #: looks at the host afresh: census + removal of whatever it finds, processes first)
    DESTROY_RETRY_S: tuple[float, ...] = (0.05, 0.25, 1.0)
    #: after those, the same in the background every this often until clean (or close)
    DESTROY_BACKGROUND_S = 15.0

    async def _destroy_again(self, sid: str, first: str) -> None:
        """A teardown left something (EMFILE, EBUSY on a cgroup, a stuck unmount...):
        retry from what the host holds (the census - the same removal reconcile does,
        which kills every process its cgroups list, race-free), then report. Nothing is
        left running silently: if it is still there the caller gets a ``BackendError``
        naming what is left (the node records the sandbox ``failed`` with that reason),
        and a background task keeps trying (then reconcile at the next start)."""
        log.warning("destroy of sandbox %s failed (%s); retrying", sid, first)
        for delay in self.DESTROY_RETRY_S:
            await asyncio.sleep(delay)
            if await self._remove_what_is_left(sid):
                log.warning("destroy of sandbox %s: done on retry", sid)
                return
        left = self._census_of(sid)
        task = asyncio.get_running_loop().create_task(self._remove_later(sid))
        self._removers.add(task)
        task.add_done_callback(self._removers.discard)
        raise BackendError(f"destroying sandbox {sid} failed ({first}) and "
                           f"{1 + len(self.DESTROY_RETRY_S)} attempts left {left}; the edge "
                           f"retries every {self.DESTROY_BACKGROUND_S:g} s and at its next "
                           "start (reconcile)", sandbox_id=sid)

    def _census_of(self, sid: str) -> str:
        try:
            c = self.census(sid)
        except OSError as exc:
            return f"an unknown part of it (census failed: {exc})"
        return c.describe(sid) if sid in c.sandboxes() else "nothing"

    async def _remove_what_is_left(self, sid: str) -> bool:
        """One attempt: remove what the host holds for ``sid``; True if nothing is left."""
        try:
            census = self.census(sid)
            if sid in census.sandboxes():
                await self._remove_leftover(sid, census)
            return sid not in self.census(sid).sandboxes()
        except (OSError, DsecError) as exc:
            log.warning("removing what is left of sandbox %s failed: %s", sid, exc)
            return False
        except Exception:  # the background retry must go on retrying
            log.exception("removing what is left of sandbox %s raised", sid)
            return False

    async def _remove_later(self, sid: str) -> None:
        while not await self._remove_what_is_left(sid):
            await asyncio.sleep(self.DESTROY_BACKGROUND_S)
        log.warning("destroy of sandbox %s: what was left is removed now", sid)

    async def _teardown(self, sid: str, d: str, box: Box | None,
                        layers: RootLayers | None) -> None:
        """Kill, wait, remove cgroups, release layers, delete the directory. Each step is
        tolerant of the resource already being gone, so this also cleans half-creates."""
        errors: list[str] = []
        cg = box.cg if box is not None else self.governor.paths(sid)
        if box is not None:
            box.dying = True
            self._unwatch_box(box)
            # SIGKILL before the thaw: a frozen init keeps it pending and dies as the thaw
            # lets it run. The other order left a window (kill -9 of the edge between the
            # thaw and the signal) where a sandbox the journal says is paused ran on,
            # thawed, after the restart (found by test_kill_9_at_random_points_...).
            if box.pidfd < 0 and box.init_pid and not box.exited.is_set():
                try:  # held for the rest of the teardown: the kill and the wait for exit
                    box.pidfd = linux.open_init_pidfd(box.init_pid, box.init_start)
                except OSError:
                    pass  # gone already; its cgroups are killed below all the same
            if box.pidfd >= 0:
                try:
                    linux.pidfd_send_signal(box.pidfd, signal.SIGKILL)
                except OSError:
                    pass
            if box.paused:
                try:
                    self.governor.thaw(cg)
                except OSError:
                    pass
        # Nothing here signals a pid number: the init through its pidfd (its pid namespace
        # takes every process inside with it), the cgroups race-free (governor.kill_all:
        # cgroup.kill, or pidfds checked against a second listing).
        try:  # no wait for the freeze here: _remove_cgroup repeats the kill off the loop
            self.governor.kill_all(cg, freeze_wait_s=0)
        except OSError as exc:
            errors.append(f"kill: {exc}")
        if box is not None and box.pidfd >= 0:
            await self._wait_exit(box)
        if self._runc is not None:  # the container is stopped now: runc signals nothing
            await self._runc.destroy(sid, d)
        if self.shared_scratch:
            # before the cgroup goes: its /dev and /tmp pages are uncharged from a live
            # memcg (no offline memcg kept by them); its processes are dead (the init's
            # pid namespace took them) or killed above
            left = await asyncio.to_thread(remove_scratch_dir, self.shared_scratch, sid)
            if left:
                errors.append(left)
        cgroup_gone = True
        try:
            await self._remove_cgroup(cg)
        except BackendError as exc:
            errors.append(str(exc))
            cgroup_gone = False
        # its tasks are dead (or reported above): the group's limit shrinks by its share,
        # and a group it was the last member of goes
        self._leave_memory_group(sid)
        if self.network is not None:
            # Reused only when no process of the sandbox can be left to hold a socket in
            # its netns: the cgroup every one of them was in is gone (else dropped).
            self.network.detach(sid, reusable=cgroup_gone)
        if box is not None:
            box.netns_fd = -1
            for fd in (box.pidfd, box.oom_fd):
                if fd is not None and fd >= 0:
                    os.close(fd)
            box.pidfd, box.oom_fd = -1, None
        if layers is not None:
            self.images.release(layers)
        self._notices.forget(sid)
        self._denied_notices.forget(sid)
        self._denied_pending.pop(sid, None)
        disk_kept = False
        try:  # before the directory: a subvolume without one is known garbage at start
            self._remove_disk(sid)
        except OSError as exc:
            disk_kept = True
            errors.append(f"delete disk subvolume of {sid}: {exc}")
        disk = os.path.join(d, "disk")   # the disk tmpfs of a sandbox made before the pool
        if os.path.ismount(disk):
            try:  # lazily: the sandbox's (dying) mount namespace may still hold it
                linux.umount2(disk, linux.MNT_DETACH)
            except OSError as exc:
                errors.append(f"umount {disk}: {exc}")
        if os.path.isdir(d) and not os.path.ismount(disk) and not disk_kept:
            # off the loop: ~7 rmdirs, measured 2.6 ms a sandbox on the loaded VM's ext4,
            # which stalled every other sandbox's execs for each destroy; never across a
            # mount point (a leftover one is reported, not walked into)
            res = await asyncio.to_thread(remove_tree, d)
            if not res.clean:
                errors.append(f"remove {d}: {res.describe()}")
        if errors:
            raise BackendError(f"destroying sandbox {sid} left something behind: "
                               + "; ".join(errors))

    def _remove_disk(self, sid: str) -> None:
        """Delete ``sid``'s subvolume and have btrfs give its space back soon.

        A deleted subvolume keeps its space until btrfs' cleaner drops it, which it does
        after the next transaction commit - up to 30 s later. Measured before: one
        sandbox created with a 150 MiB cap, filled and destroyed three times in 10 s
        held 420 MiB of a 499 MiB pool, and every other create was refused
        (CapacityExceeded) or writes failed (ENOSPC) until the commit. A commit
        (BTRFS_IOC_SYNC, 1-8 ms here) right after the delete returns it at once; it runs
        off the loop, coalesced, so destroy does not wait for it."""
        self.disk.remove(sid)
        if self._settling is not None and not self._settling.done():
            self._settle_again = True
            return
        try:
            self._settling = asyncio.get_running_loop().create_task(self._settle())
        except RuntimeError:      # no loop (a synchronous caller): settle here
            self.disk.settle()

    async def _settle(self) -> None:
        while True:
            self._settle_again = False
            try:
                await asyncio.to_thread(self.disk.settle)
            except OSError as exc:
                log.warning("btrfs sync of the disk pool %s failed: %s", self.disk.path, exc)
                return
            if not self._settle_again:
                return

    async def _settled(self) -> None:
        """Wait for a commit in flight that gives deleted subvolumes' space back."""
        task = self._settling
        if task is not None and not task.done():
            await asyncio.shield(task)

    async def _wait_exit(self, box: Box, timeout_s: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)
        loop.add_reader(box.pidfd, ready)
        try:
            async with asyncio.timeout(timeout_s):
                await fut
        except TimeoutError:
            pass
        finally:
            loop.remove_reader(box.pidfd)

    async def _remove_cgroup(self, cg: SandboxCgroup, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.governor.remove(cg, wait_s=0)
                return
            except BackendError:
                if time.monotonic() > deadline:
                    raise
                # In a thread: the v1 freeze waits up to 50 ms, every round, while a task
                # the kernel holds (D state: a `sync` of a full upper is one) keeps the
                # cgroup FREEZING - it blocked the event loop, so every sandbox on the
                # node, for the whole 5 s (rt-kernel review).
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(self.governor.kill_all, cg)
                await asyncio.sleep(0.002)

    async def close(self) -> None:
        """Stop the helper and forget sandboxes; they keep running for a later adopt().

        With no sandbox left (none running, none on disk awaiting adoption) the backend's
        parent cgroups are removed too, so nothing of it stays on the node."""
        idle = not self._boxes
        if self._poll is not None:
            self._poll.cancel()
            self._poll = None
        if self._dpoll is not None:
            self._dpoll.cancel()
            self._dpoll = None
        if self._suppress_timer is not None:
            self._suppress_timer.cancel()
            self._suppress_timer = None
        if self._suppress is not None:
            self._suppress.release()      # a later backend measures afresh
        for task in list(self._removers):  # reconcile at the next start takes over
            task.cancel()
        if self._removers:
            await asyncio.gather(*self._removers, return_exceptions=True)
        if self._cleanups:  # timed-out/cancelled execs still being cleared
            await asyncio.gather(*self._cleanups, return_exceptions=True)
        if self._file_pool is not None:  # file operations in flight finish first
            await asyncio.gather(*self._file_ops, return_exceptions=True)
            self._file_pool.shutdown(wait=True)
            self._file_pool = None
        for box in self._boxes.values():
            self._unwatch_box(box)
            for fd in (box.pidfd, box.oom_fd):
                if fd is not None and fd >= 0:
                    os.close(fd)
        self._boxes.clear()
        self._zygote.close()
        if self._devnull >= 0:
            os.close(self._devnull)
            self._devnull = -1
        sb = os.path.join(self.root_dir, "sb")
        if idle and not (os.path.isdir(sb) and os.listdir(sb)) \
                and not self.governor.list_sandboxes():
            self.governor.remove_base()
            release_cgroup_name(self.cgroup_name, self.root_dir)
            if self._runsc is not None:   # no control socket left in its namespace
                self._runsc.release()
        else:   # sandboxes left for the next backend's adopt: it may claim the name
            hand_over_cgroup_name(self.cgroup_name, self.root_dir)
        if self.shared_sysfs:
            # Always: sandboxes left running for a later adopt() keep their own binds of
            # it (their /sys/class/net reads empty once its namespace goes); the next
            # backend mounts a new one.
            unmount_shared_sysfs(self.shared_sysfs)
        if self.shared_scratch and idle:
            # only empty: a sandbox left for adopt() has its /dev and /tmp files here,
            # removed through this path when it is destroyed (a second close: nothing)
            release_shared_scratch(self.shared_scratch)
        await self._settled()
        self._snapshots.close()
        self.disk.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the root_dir lock
            self._lock_fd = -1

    # -- reconciliation after a crash -------------------------------------------------------
    def census(self, sid: str | None = None) -> Census:
        """What the host holds for this backend (or for ``sid`` only), by sandbox id."""
        return take_census(self.root_dir, self.cgroup_name, only=sid)

    async def reconcile(self, keep: AbstractSet[str]) -> list[Leftover]:
        """Remove every trace on the host of sandboxes this backend does not hold and the
        node does not keep: their processes (found through their cgroups; the pid
        namespace and netns die with the init), cgroups in every hierarchy, mounts below
        their directory (runc rootfs, an old disk tmpfs), their disk subvolume, runc state
        and the directory. The node
        calls this at start, after adoption; returns what was removed, one per sandbox."""
        # The backend reconciling this root at start owns its cgroup name (again): an
        # edge killed after another process on the same root re-claimed it left the
        # binding to a dead claimer, and any container edge's start then swept this
        # one's empty cgroups - a paused VM's, an idle base (CI: census.idle_names).
        await asyncio.to_thread(claim_cgroup_name, self.cgroup_name, self.root_dir)
        census = self.census()
        out = []
        for sid in sorted(census.sandboxes()):
            if sid in self._boxes or sid in keep:
                continue
            try:
                out.append(await self._remove_leftover(sid, census))
            except Exception as exc:  # one sandbox's leftovers that
                # cannot go (or a bug in one step) must not keep the others' from going,
                # nor the router, the runc logs and the parents below from reconciling
                log.exception("leftovers of sandbox %s: removal raised", sid)
                out.append(Leftover(sid, self._kind, f"{census.describe(sid)}; could not "
                                    f"remove it: {type(exc).__name__}: {exc}"))
        # Memory groups: adoption is over, so each group's limit is its adopted members'
        # sum (lowered once it fits); a group no live sandbox is in goes (its members'
        # leftovers are gone above: an empty group is only a cost, a memcg and its
        # shrinker map), or is retired while a task holds it - never reused.
        for sid in [s for s in self._memgroups.of if s not in self._boxes]:
            self._memgroups.leave(sid)     # an adopt that failed midway (red team 26, C)
        for gdir in sorted(census.memory_groups | set(self._memgroups.groups)):
            g = self._memgroups.groups.get(gdir)
            if g is None:
                g = self._memgroups.groups[gdir] = MemoryGroup(gdir, ("", ""))
            self._settle_group(g)
        self._poll_groups_later()
        if self.network is not None:
            # after the census: the leftovers' processes (holding their slots' netns)
            # are dead, so their router links go (plan-14 §9.2)
            t0 = time.monotonic()
            lost = await asyncio.to_thread(self.network.reconcile)
            log.info("net: router reconciled in %.1f ms (%d sandboxes on slots, %d lost)",
                     (time.monotonic() - t0) * 1000, len(self.network.by_sandbox), len(lost))
            for sid, why in lost.items():
                box = self._boxes.get(sid)
                if box is not None:
                    self._network_lost(box, why)
            for sid, slot in self.network.by_sandbox.items():
                box = self._boxes.get(sid)
                if box is not None:
                    box.netns_fd = slot.fd
        if self._runc is not None:
            self._runc.sweep_logs()
        if self._runsc is not None:   # after adoption: what the live sandboxes bind stays
            gone = await asyncio.to_thread(
                self._runsc.gc_helpers, [b.dir for b in self._boxes.values()])
            if gone:
                log.info("gvisor: removed %d old helper dir(s): %s", len(gone),
                         ", ".join(gone))
        # Parents an earlier process (in another cgroup) made: gone once empty.
        for parent in recorded_parents(self.root_dir, self.cgroup_name):
            if parent not in self._own_parents:
                with contextlib.suppress(OSError):
                    os.rmdir(parent)
        record_parents(self.root_dir, self.cgroup_name, self._own_parents)
        return out

    @property
    def _kind(self) -> BackendName:
        return self.name  # type: ignore[return-value]

    async def discard(self, sid: SandboxId) -> Leftover | None:
        """Remove what the host holds for ``sid``, which the node has no record of; None
        if there is nothing."""
        if sid in self._boxes:
            await self.destroy(sid)
            return Leftover(sid, self._kind, "a running sandbox the node did not list")
        census = self.census(sid)
        if sid not in census.sandboxes():
            return None
        return await self._remove_leftover(sid, census)

    async def _remove_leftover(self, sid: str, census: Census) -> Leftover:
        what = census.describe(sid)
        d = os.path.join(self.root_dir, "sb", sid)
        rec = load_record(os.path.join(d, "state.json")) if sid in census.dirs else None
        errors: list[str] = []
        cg_dirs = list(census.cgroups.get(sid, ()))
        managed = self.governor.paths(sid)
        if self.governor.present(managed):
            with contextlib.suppress(OSError):  # freeze, verified kill, thaw: no fork
                # escapes, no pid number is signalled; in a thread (the freeze waits)
                await asyncio.to_thread(self.governor.kill_all, managed)
        if self._runc is not None and (sid in census.runc or self._runsc is not None):
            # (runsc keeps its state as files, not a directory the census lists)
            # after the kill: `delete --force` of a running container signals its init by
            # pid number; of a stopped one it only removes state, cgroups and the rootfs
            await self._runc.destroy(sid, d)
        if self.shared_scratch and sid in census.scratch:
            left = await asyncio.to_thread(remove_scratch_dir, self.shared_scratch, sid)
            if left:
                errors.append(left)
        try:
            await remove_cgroup_dirs(cg_dirs)
        except OSError as exc:
            errors.append(f"cgroups: {exc}")
        for mp in census.mounts.get(sid, ()):
            try:  # lazily: a dying mount namespace may still hold it
                linux.umount2(mp, linux.MNT_DETACH)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.ENOENT):
                    errors.append(f"umount {mp}: {exc}")
        self._notices.forget(sid)
        self._denied_notices.forget(sid)
        self._denied_pending.pop(sid, None)
        try:  # before the directory: a subvolume without one is known garbage at start
            self._remove_disk(sid)
        except OSError as exc:
            errors.append(f"delete disk subvolume: {exc}")
        for path in (d, os.path.join(self.root_dir, "runc-state", sid)):
            if os.path.isdir(path) and not errors:
                # off the loop: the box dir holds the overlay upper, tenant-shaped
                res = await asyncio.to_thread(remove_tree, path)
                if not res.clean:
                    errors.append(f"remove {path}: {res.describe()}")
        if errors:
            log.error("leftovers of sandbox %s (%s) not fully removed: %s", sid, what,
                      "; ".join(errors))
            what += "; could not remove all of it: " + "; ".join(errors)
        else:
            log.warning("removed leftovers of sandbox %s: %s", sid, what)
        return Leftover(sid, self._kind, what, rec.spec if rec is not None else None)

    # -- exec --------------------------------------------------------------------------
    async def exec(self, sid: SandboxId, req: ExecRequest) -> ExecResult:
        return await self._exec(sid, req, None)

    async def exec_stream(self, sid: SandboxId,
                          req: ExecRequest) -> AsyncIterator[ExecChunk | ExecResult]:
        queue: asyncio.Queue[ExecChunk | ExecResult | BaseException] = asyncio.Queue()
        task = asyncio.ensure_future(self._exec(sid, req, queue.put_nowait))
        task.add_done_callback(
            lambda t: queue.put_nowait(t.exception() or t.result()) if not t.cancelled()
            else None)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, ExecResult):
                    return
        finally:
            if not task.done():
                task.cancel()

    # -- processes (issue 19: the edge's process table, dsec.edge.processes) ----------
    @property
    def supports_processes(self) -> bool:
        """The native runtime spawns the table's processes itself (pipes, ptys, signals);
        under runc the table runs them through exec_stream."""
        return self._runc is None

    async def spawn_process(self, sid: SandboxId, req: ExecRequest,
                            sink: Callable[[Literal["stdout", "stderr"], bytes], None], *,
                            input_pending: int = 1 << 20, input_wait_s: float = 30.0,
                            ) -> ContainerProcess:
        from dsec.edge.backends.container.procio import spawn
        box = self.box(sid)
        if box.paused:
            await self.resume(sid)
        argv = list(req.argv) if req.argv else ["/bin/sh", "-c", req.shell or ""]
        env = build_env(box.sid[:63], box.spec.env, req.env)
        req = msgspec.structs.replace(req, cwd=req.cwd or box.spec.cwd,
                                      user=req.user or box.spec.user)
        return await spawn(self, box, req, argv, env, sink, input_pending=input_pending,
                           input_wait_s=input_wait_s)

    def _exec_cgroup_at(self, box: Box, path: str) -> ExecCgroup:
        """An existing exec cgroup of ``box`` named by its directory (from the process
        journal: only a direct child of the sandbox's own cgroup is taken)."""
        parent = box.cg.dirs["unified" if box.cg.version == 2 else "freezer"]
        if os.path.dirname(os.path.normpath(path)) != os.path.normpath(parent):
            raise BackendError(f"exec cgroup {path!r} is not one of sandbox {box.sid}'s")
        return ExecCgroup(box.cg.version, path, box.cg)

    async def adopt_process(self, sid: SandboxId, *, pid: int, host_pid: int,
                            host_start: int, exec_cgroup: str, fds: dict[str, int],
                            sink: Callable[[Literal["stdout", "stderr"], bytes], None],
                            pty: tuple[int, int] | None, deadline_in_s: float | None,
                            input_pending: int = 1 << 20, input_wait_s: float = 30.0,
                            lost_status: Callable[[], int | None] | None = None,
                            ) -> ContainerProcess | None:
        """A process of the table a previous edge started (dsec.edge.fdstore), taken back
        with its descriptors; None if it is gone (``fds`` are closed then)."""
        from dsec.edge.backends.container.procio import adopt
        try:
            box = self.box(sid)
            ec = self._exec_cgroup_at(box, exec_cgroup)
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        return adopt(self, box, ec, sink, pid=pid, host_pid=host_pid,
                     host_start=host_start, fds=fds, pty=pty, deadline_in_s=deadline_in_s,
                     input_pending=input_pending, input_wait_s=input_wait_s,
                     lost_status=lost_status)

    async def kill_process(self, sid: SandboxId, exec_cgroup: str) -> None:
        """End a process of the table a previous edge started whose descriptors were
        lost (the keeper died too): everything in its exec cgroup, which then goes."""
        box = self.box(sid)
        ec = self._exec_cgroup_at(box, exec_cgroup)
        if os.path.isdir(ec.dir):
            self._kill_exec(0, ec, send=False)
            await self._clear_exec_cgroup(box, ec)

    def oom_kills_of(self, sid: SandboxId) -> int:
        """The OOM kills in ``sid``'s cgroup so far (the process table compares it
        around a background process, as exec does around a command)."""
        return self.governor.oom_kills(self.box(sid).cg)

    @property
    def supports_hide(self) -> bool:
        """``ExecRequest.hide`` is kept: native runtime (nsexec applies Landlock before
        execve) on a kernel with Landlock."""
        return self._runc is None and linux.landlock_abi() > 0

    async def _exec(self, sid: str, req: ExecRequest,
                    on_chunk: Callable[[ExecChunk], None] | None) -> ExecResult:
        box = self.box(sid)
        if box.paused:  # an exec on a paused sandbox resumes it transparently
            await self.resume(SandboxId(sid))
        argv = list(req.argv) if req.argv else ["/bin/sh", "-c", req.shell or ""]
        env = build_env(box.sid[:63], box.spec.env, req.env)
        if (req.cwd is None and box.spec.cwd is not None) or (
                req.user is None and box.spec.user is not None):
            # the sandbox's defaults (the image config's, or the create's) under the exec's
            req = msgspec.structs.replace(req, cwd=req.cwd or box.spec.cwd,
                                          user=req.user or box.spec.user)
        if req.hide and self._runc is not None:
            raise InvalidArgument("exec hide (Landlock) needs the native container runtime; "
                                  f"this backend ({self.name}) runs containers with "
                                  f"{self.runtime}", field="hide")
        oom_before = self.governor.oom_kills(box.cg)
        try:
            if self._runc is not None:
                result = await self._runc_exec(box, req, argv, env, on_chunk)
            else:
                result = await self._native_exec(box, req, argv, env, on_chunk)
            if not req.background and self.governor.oom_kills(box.cg) > oom_before:
                # the counter is bumped at the kill, before the victim's exit is seen
                result.oom_killed = True
            return result
        finally:
            # The v1 OOM eventfd does not always fire although memory.oom_control's
            # oom_kill counter rose (measured: ~1 run in 4 of the OOM test), and v1
            # pids.events has no notification at all: one read of each counter per
            # finished exec (~8 µs each) makes sure an OOM kill or a refused fork during
            # the command is reported by the time exec returns. The eventfd and the
            # limits timer cover background processes between execs.
            if not box.dying:
                self._check_limits(box)

    def _helper(self, box: Box) -> int:
        """The id of ``box``'s running exec helper, or 0: then this exec takes the per-exec
        path, and a helper is started for the next ones. Not waiting for it keeps a
        sandbox's first exec as fast as before and costs one-exec sandboxes nothing
        (waiting made the first exec pay the helper's start too); none is started once
        helpers kept failing here."""
        if box.helper:
            return box.helper
        if box.helper_fails >= HELPER_MAX_FAILS or box.dying:
            return 0
        if box.helper_start is None and len(self._helpers) >= self._helper_budget:
            return 0   # the budget (see max_exec_helpers): this one takes the per-exec path
        if box.helper_start is None:
            fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            rid = self._zygote.next_id()

            def on_reply(reply: Reply, fds: list[int]) -> None:
                for fd in fds:
                    os.close(fd)
                if isinstance(reply, Started):
                    qos_process(box.spec, reply.pid)   # before any exec is forwarded to it
                    box.helper = rid
                    box.helper_pid = reply.pid   # its identity, for a later retirement
                    box.helper_pid_start = start_time(reply.pid, running=True) or 0
                    box.helper_used = time.monotonic()
                    if box.dying:
                        self._helpers.discard(rid)
                    if not fut.done():
                        fut.set_result(rid)
                    return
                # Exited (it is gone: the sandbox went, or it died) or Failed (no start)
                self._zygote.done(rid)
                self._helpers.discard(rid)
                if box.helper == rid:
                    box.helper = 0
                if box.helper_start is fut:
                    box.helper_start = None
                if box.helper_retiring == rid:   # retired for idleness: not a failure
                    box.helper_retiring = 0
                elif not box.dying:
                    box.helper_fails += 1
                if not fut.done():
                    fut.set_result(0)

            box.helper_start = fut
            self._helpers.add(rid)
            try:
                with self._init_fd(box) as pidfd:
                    self._zygote.send(Helper(id=rid, cgroup_procs=box.cg.procs_files),
                                      [pidfd], on_reply)
            except DsecError:
                self._helpers.discard(rid)
                box.helper_start = None
                box.helper_fails += 1
        return 0

    async def _native_exec(self, box: Box, req: ExecRequest, argv: list[str], env: list[str],
                           on_chunk: Callable[[ExecChunk], None] | None,
                           *, via_helper: bool = True) -> ExecResult:
        loop = asyncio.get_running_loop()
        helper = 0
        if (via_helper and self.exec_helper and not req.background
                and not box.spec.user_namespace and not box.spec.allow_nested
                and not req.hide):  # red17 merge: the helper path cannot apply Landlock
            helper = self._helper(box)
            if not helper and box.helper_start is not None and qos_of(box.spec) == "be":
                # best-effort waits for its (SCHED_IDLE) helper: a command the zygote
                # forks itself gets the policy only once it reported started, an instant
                # in which it runs (and could fork) as SCHED_OTHER (issue 22)
                helper = await asyncio.shield(box.helper_start)
        if not helper:
            return await self._native_exec_run(box, req, argv, env, on_chunk, loop, helper)
        box.helper_busy += 1   # never retired while it serves (see _retire_idle_helper)
        try:
            return await self._native_exec_run(box, req, argv, env, on_chunk, loop, helper)
        finally:
            box.helper_busy -= 1
            box.helper_used = time.monotonic()

    async def _native_exec_run(self, box: Box, req: ExecRequest, argv: list[str],
                               env: list[str], on_chunk: Callable[[ExecChunk], None] | None,
                               loop: asyncio.AbstractEventLoop, helper: int) -> ExecResult:
        t0 = time.monotonic()
        started: asyncio.Future[Reply] = loop.create_future()
        exited: asyncio.Future[Reply] = loop.create_future()
        rid = self._zygote.next_id()

        def on_reply(reply: Reply, fds: list[int]) -> None:
            for fd in fds:
                os.close(fd)
            if isinstance(reply, Started) and not started.done():
                if not helper:   # forked from the helper: inherited already
                    qos_process(box.spec, reply.pid)
                started.set_result(reply)
                if req.background:
                    self._zygote.done(rid)
                return
            self._zygote.done(rid)
            for f in (started, exited):
                if not f.done():
                    f.set_result(reply)

        # A foreground exec runs in a cgroup of its own, so a timeout or cancel can kill
        # everything it started (setsid and double forks included); background execs
        # join the sandbox's cgroup and outlive the call.
        ec = None if req.background else self._new_exec_cgroup(box)
        target: SandboxCgroup | ExecCgroup = box.cg if ec is None else ec
        local: list[int] = []
        try:
            with self._init_fd(box) as pidfd:
                if req.background:
                    send_fds = [pidfd, self._devnull, self._devnull, self._devnull]
                    pump = None
                else:
                    out_r, out_w = os.pipe2(os.O_CLOEXEC)
                    local += [out_r, out_w]
                    err_r, err_w = os.pipe2(os.O_CLOEXEC)
                    local += [err_r, err_w]
                    if req.stdin:
                        in_r, in_w = os.pipe2(os.O_CLOEXEC)
                        local += [in_r, in_w]
                    else:
                        in_r, in_w = self._devnull, -1
                    send_fds = [pidfd, in_r, out_w, err_w]
                self._zygote.send(
                    Exec(id=rid, argv=argv, env=env, cwd=req.cwd, user=req.user,
                         cgroup_procs=target.procs_files, nested=box.spec.allow_nested,
                         background=req.background, userns=box.spec.user_namespace,
                         pids_index=target.pids_index, home_procs=self.governor.home_procs(),
                         hide=req.hide, helper=helper),
                    send_fds, on_reply)
        except BaseException:
            for fd in local:
                os.close(fd)
            if ec is not None:
                self.governor.remove_exec(ec)
            raise
        if req.background:
            try:
                async with asyncio.timeout(self.exec_start_timeout_s):
                    reply = await asyncio.shield(started)
            except TimeoutError:
                reply = await self._kill_unstarted(box, rid, started)
            if not isinstance(reply, Started):
                # a missing program, user or cwd is the caller's mistake (CannotRun, 4xx)
                raise exec_failure(box.sid, str(getattr(reply, "message", reply)))
            return ExecResult(exit_code=0, pid=reply.ns_pid,
                              duration_s=time.monotonic() - t0)
        assert ec is not None
        for fd in (out_w, err_w) + ((in_r,) if req.stdin else ()):
            os.close(fd)
        pump = OutputPump(loop, {"stdout": out_r, "stderr": err_r}, req.output_cap_bytes,
                          on_chunk)
        feeder = StdinFeeder(loop, in_w, req.stdin) if req.stdin else None
        timed_out = False
        try:
            reply = await started
            if isinstance(reply, Failed) and helper:
                # The helper refused it (gone, at the task limit, too big): the command
                # never ran - a Failed comes only before the helper reported a pid.
                pump.finish()
                if feeder is not None:
                    feeder.close()
                await self._clear_exec_cgroup(box, ec)
                return await self._native_exec(box, req, argv, env, on_chunk,
                                               via_helper=False)
            if isinstance(reply, Failed):
                raise BackendError(f"exec in sandbox {box.sid} failed to start: "
                                   f"{reply.message}")
            try:
                if req.timeout_s is None:
                    reply = await asyncio.shield(exited)
                else:
                    async with asyncio.timeout(req.timeout_s):
                        reply = await asyncio.shield(exited)
            except TimeoutError:
                timed_out = True
                self._kill_exec(rid, ec)
                try:
                    async with asyncio.timeout(self.kill_wait_s):
                        reply = await asyncio.shield(exited)
                except TimeoutError:
                    # SIGKILLed but held by the kernel (D state): it dies when let go; the
                    # zygote still reaps it. The call does not wait for that (it waited
                    # for as long as the kernel held the command - for ever on a hung
                    # filesystem; rt-kernel review).
                    reply = Exited(rid, signal.SIGKILL)
                await self._clear_exec_cgroup(box, ec)
        except BaseException:
            # cancelled (or failed to start): nothing the exec started may run on
            self._kill_exec(rid, ec, send=not exited.done())
            task = asyncio.ensure_future(self._clear_after(box, ec, exited))
            self._cleanups.add(task)
            task.add_done_callback(self._cleanups.discard)
            pump.finish()
            if feeder is not None:
                feeder.close()
            raise
        pump.finish()
        if feeder is not None:
            feeder.close()
        if isinstance(reply, Failed):
            await self._clear_exec_cgroup(box, ec)
            if helper and not timed_out:  # the helper went before it forked the command
                return await self._native_exec(box, req, argv, env, on_chunk,
                                               via_helper=False)
            raise BackendError(f"exec in sandbox {box.sid} failed: {reply.message}")
        assert isinstance(reply, Exited)
        if not timed_out:
            if reply.pid == 0:  # the helper died before the command: nothing legit inside
                await self._clear_exec_cgroup(box, ec)
            else:
                self._release_exec_cgroup(box, ec)
        code = _exit_code(reply.status)
        return ExecResult(
            exit_code=code,
            stdout=bytes(pump.bufs["stdout"]), stderr=bytes(pump.bufs["stderr"]),
            stdout_truncated=pump.truncated["stdout"], stderr_truncated=pump.truncated["stderr"],
            timed_out=timed_out, duration_s=time.monotonic() - t0)

    async def _kill_unstarted(self, box: Box, rid: int,
                              started: asyncio.Future[Reply]) -> Reply:
        """A background exec that did not start in time - stopped (a SIGSTOP from a process
        inside) or held before its execve: kill it through the zygote and take its answer
        (Started if it started meanwhile; else Failed, raised here with the reason)."""
        try:
            self._zygote.send(Kill(id=rid), [], None)
            async with asyncio.timeout(10.0):
                reply = await asyncio.shield(started)
        except (DsecError, TimeoutError):
            self._zygote.done(rid)
            reply = Failed(rid, "no answer from the container helper")
        if isinstance(reply, Started):
            return reply
        raise BackendError(
            f"background exec in sandbox {box.sid} did not start its command within "
            f"{self.exec_start_timeout_s:g} s (its process was stopped or held before it "
            "could run - e.g. by a SIGSTOP from a process inside); it was killed "
            f"({getattr(reply, 'message', reply)})")

    async def _runc_exec(self, box: Box, req: ExecRequest, argv: list[str], env: list[str],
                         on_chunk: Callable[[ExecChunk], None] | None) -> ExecResult:
        """``runc exec``, a foreground one in its own cgroup (the same rule as native);
        ``runsc exec`` kills a timed-out exec's session from inside instead (its tasks are
        the Sentry's, in no cgroup of their own)."""
        assert self._runc is not None
        if req.background or self._runsc is not None:
            return await self._runc.exec(box, req, argv, env, on_chunk,
                                         start_timeout_s=self.exec_start_timeout_s)
        ec = self._new_exec_cgroup(box)
        try:
            res = await self._runc.exec(box, req, argv, env, on_chunk, cgroup=ec,
                                        kill=lambda: self.governor.kill_exec(
                                            ec, freeze_wait_s=0))
        except BaseException:
            self._kill_exec(0, ec, send=False)
            task = asyncio.ensure_future(self._clear_exec_cgroup(box, ec))
            self._cleanups.add(task)
            task.add_done_callback(self._cleanups.discard)
            raise
        if res.timed_out:
            await self._clear_exec_cgroup(box, ec)
        else:
            self._release_exec_cgroup(box, ec)
        return res

    # -- exec cgroups: what a timeout or cancel kills ------------------------------------
    # Rule (docs/container.md): a foreground exec that times out or is cancelled leaves
    # nothing behind - every process it started is killed, however it detached. One that
    # exits on its own keeps what it started in the background (`python server.py &` is
    # normal agent behaviour); its cgroup lingers until those exit (then it is removed at
    # the next exec of the sandbox) or the sandbox is destroyed. Measured: mkdir + rmdir
    # of a v1 freezer cgroup ~16 us per exec.

    def _new_exec_cgroup(self, box: Box) -> ExecCgroup:
        for _ in range(8):
            try:
                return self.governor.exec_cgroup(box.cg, f"x{next(self._exec_seq)}")
            except FileExistsError:
                continue  # left by an earlier edge process under the same name
            except OSError as exc:
                raise BackendError(f"cannot make the exec cgroup in sandbox {box.sid}: "
                                   f"{exc}") from exc
        raise BackendError(f"cannot name an exec cgroup in sandbox {box.sid}")

    def _kill_exec(self, rid: int, ec: ExecCgroup, *, send: bool = True) -> None:
        """Kill one exec: its helper and command through the zygote's pidfds, and
        everything in its cgroup (the command may not have joined it yet when the
        cgroup is read: _clear_exec_cgroup repeats the kill until it is empty)."""
        if send:
            try:
                self._zygote.send(Kill(id=rid), [], None)
            except DsecError:
                pass  # the zygote is gone; the cgroup kill below still applies
        try:  # no waiting for the freeze on the event loop (_clear_exec_cgroup waits)
            self.governor.kill_exec(ec, freeze_wait_s=0)
        except OSError:
            pass

    async def _clear_exec_cgroup(self, box: Box, ec: ExecCgroup, *,
                                 limit_s: float = 5.0) -> None:
        """Kill what is left in a killed exec's cgroup until it is empty, then remove
        it, so a timed-out result means its processes are gone, not dying. Bounded: a
        task stuck in the kernel (D state) must not hold the caller forever; such a
        cgroup is kept with the sandbox and removed with it."""
        deadline = time.monotonic() + limit_s
        delay = 0.0005
        while True:
            try:
                if self.governor.remove_exec(ec):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                box.lingering.append(ec)
                return
            with contextlib.suppress(OSError):  # the freeze waits: off the event loop
                await asyncio.to_thread(self.governor.kill_exec, ec)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.02)

    async def _clear_after(self, box: Box, ec: ExecCgroup,
                           exited: asyncio.Future[Reply]) -> None:
        """A cancelled exec: once the zygote reports the end, clear its cgroup."""
        try:
            async with asyncio.timeout(10.0):
                await asyncio.shield(exited)
        except (TimeoutError, asyncio.CancelledError):
            pass
        await self._clear_exec_cgroup(box, ec)

    def _release_exec_cgroup(self, box: Box, ec: ExecCgroup) -> None:
        """An exec that ended on its own: remove its cgroup if empty, else keep it (its
        background processes live on). Earlier ones that were not empty are retried at
        most once a second (a failed rmdir is ~2 us, but an agent may leave many)."""
        try:
            now = time.monotonic()
            if box.lingering and now - box.lingering_checked >= 1.0:
                box.lingering_checked = now
                box.lingering = [e for e in box.lingering if not self.governor.remove_exec(e)]
            if not self.governor.remove_exec(ec):
                box.lingering.append(ec)
        except OSError:
            box.lingering.append(ec)

    # -- files -------------------------------------------------------------------------
    def _files(self, sid: str) -> SandboxFiles:
        box = self.box(sid)
        if self._runsc is not None:  # the bundle root; no tmpfs of the host's in reach
            try:
                return self._runsc.files(
                    box, disk_room=(lambda: self._disk_room(box)) if box.disk_q else None)
            except OSError as exc:
                raise BackendError(f"sandbox {sid}'s root is gone: {exc}") from exc
        try:
            with self._init_fd(box) as pidfd:
                return SandboxFiles.of_process(
                    pidfd, box.init_pid, sid,
                    owner=self.userns_range[0] if box.spec.user_namespace else None,
                    disk_room=(lambda: self._disk_room(box)) if box.disk_q else None,
                    memory=MemoryHome(room=lambda: self._memory_room(box),
                                      enter=lambda pid: self._enter_memcg(box, pid)))
        except OSError as exc:
            raise BackendError(f"sandbox {sid} is not running (its init is gone): {exc}"
                               ) from exc

    # File operations may run as a sandbox user (``user=``): this backend does them with
    # that user's fsuid/fsgid/groups on the file thread (linux.fs_creds), so the kernel
    # checks them, atomically (docs/sdk.md, "Files as a user").
    FILES_AS_USER = True

    async def _file_op(self, sid: str, op: Callable[[SandboxFiles], _T],
                       user: str | None = None) -> _T:
        """Run ``op`` on the sandbox's files beside the event loop, in the backend's file
        threads. A sandbox decides how big its trees are, so a walk on the loop (a
        recursive remove or a listing of hundreds of thousands of files: tens of seconds
        measured on the fncall backend) stopped every other sandbox's execs, heartbeats
        and connections. ``op`` gets its own root fd (opened here, closed by its thread),
        so a destroy meanwhile can never leave the thread with a number the kernel gave
        to something else. Measured cost of the hop: ~30-60 µs per call on the dev VM."""
        files = self._files(sid)

        def work() -> _T:
            with files:
                creds = files.user_creds(user) if user else None
                files.as_user = user if creds is not None else None
                with linux.fs_creds(creds):
                    return op(files)

        if self._file_pool is None:
            self._file_pool = concurrent.futures.ThreadPoolExecutor(
                FILE_THREADS, thread_name_prefix="dsec-container-files")
        try:
            fut = asyncio.get_running_loop().run_in_executor(self._file_pool, work)
        except BaseException:
            files.close()
            raise
        self._file_ops.add(fut)
        fut.add_done_callback(self._file_ops.discard)
        return await fut

    async def read_file(self, sid: SandboxId, path: str, *, offset: int = 0,
                        length: int | None = None, user: str | None = None) -> bytes:
        return await self._file_op(sid, lambda f: f.read(path, offset, length), user)

    async def write_file(self, sid: SandboxId, path: str, data: bytes, *, mode: int = 0o644,
                         append: bool = False, user: str | None = None) -> None:
        try:
            await self._file_op(sid, lambda f: f.write(path, data, mode=mode, append=append),
                                user)
        except SandboxError as exc:
            cause = exc.__cause__
            if not (isinstance(cause, OSError)
                    and cause.errno in (errno.ENOSPC, errno.EDQUOT)):
                raise
            box = self.box(sid)
            self._check_disk(box)
            use = DiskPool.usage_at(box.disk_q) if box.disk_q else None
            where = (f"its disk cap of {use.cap_bytes} bytes ({use.used_bytes} used)"
                     if use is not None and cause.errno == errno.EDQUOT
                     else "the node's sandbox disk pool")
            raise QuotaExceeded(
                f"write {path[:200]!r} ({len(data)} bytes) in sandbox {sid} failed: "
                f"{cause.strerror}: the sandbox filled {where}; remove files in it "
                "or create the sandbox with a larger disk_bytes",
                resource="disk_bytes", sandbox_id=sid,
                limit=use.cap_bytes if use is not None else None) from exc

    # streamed transfer, rename, watch (issue 19; dsec.edge.filestream drives them)
    async def _in_pool(self, fn: Callable[[], _T]) -> _T:
        if self._file_pool is None:
            self._file_pool = concurrent.futures.ThreadPoolExecutor(
                FILE_THREADS, thread_name_prefix="dsec-container-files")
        fut = asyncio.get_running_loop().run_in_executor(self._file_pool, fn)
        self._file_ops.add(fut)
        fut.add_done_callback(self._file_ops.discard)
        return await fut

    async def _run_as(self, files: SandboxFiles, user: str | None
                      ) -> Callable[[Callable[[], _T]], Awaitable[_T]]:
        """The file-thread runner of a streamed operation: each step as ``user`` (their
        identity taken and given back around every hop), or as the edge."""
        if not user:
            return self._in_pool
        creds = await self._in_pool(lambda: files.user_creds(user))
        files.as_user = user if creds is not None else None

        def step(fn: Callable[[], _T]) -> Awaitable[_T]:
            def work() -> _T:
                with linux.fs_creds(creds):
                    return fn()
            return self._in_pool(work)
        return step

    async def read_stream(self, sid: SandboxId, path: str, offset: int, length: int | None,
                          sink: Callable[[bytes], Awaitable[None]], *,
                          user: str | None = None) -> FileInfo:
        with self._files(sid) as files:
            return await filestream.read_stream(files, path, offset, length, sink,
                                                await self._run_as(files, user))

    async def write_stream(self, sid: SandboxId, path: str, mode: int, size: int | None,
                           source: AsyncIterator[bytes], *,
                           user: str | None = None) -> FileInfo:
        with self._files(sid) as files:
            return await filestream.write_stream(files, path, mode, size, source,
                                                 await self._run_as(files, user))

    async def rename_file(self, sid: SandboxId, src: str, dst: str,
                          overwrite: bool, *, user: str | None = None) -> FileInfo:
        return await self._file_op(sid, lambda f: f.rename(src, dst, overwrite=overwrite),
                                   user)

    async def watch_files(self, sid: SandboxId, path: str, recursive: bool,
                          tenant: str = "") -> AsyncIterator[FileEvent]:
        with self._files(sid) as files:
            async for ev in filestream.watch(files, path, recursive, self._in_pool,
                                             tenant):
                yield ev

    async def list_dir(self, sid: SandboxId, path: str, *,
                       user: str | None = None) -> list[FileInfo]:
        return await self._file_op(sid, lambda f: f.list(path), user)

    async def stat(self, sid: SandboxId, path: str, *, user: str | None = None) -> FileInfo:
        return await self._file_op(sid, lambda f: f.stat(path), user)

    async def mkdir(self, sid: SandboxId, path: str, *, parents: bool = True,
                    user: str | None = None) -> None:
        await self._file_op(sid, lambda f: f.mkdir(path, parents=parents), user)

    async def remove(self, sid: SandboxId, path: str, *, recursive: bool = False,
                     user: str | None = None) -> None:
        await self._file_op(sid, lambda f: f.remove(path, recursive=recursive), user)

    # -- pause / resume / stats ----------------------------------------------------------
    async def pause(self, sid: SandboxId) -> PauseStats:
        """Freeze every task, then push the sandbox's memory out (page cache dropped,
        anonymous pages to compressed swap). Reports resident bytes before and reclaimed."""
        box = self.box(sid)
        t0 = time.monotonic()
        if not box.paused:
            try:  # in a thread: v1 waits up to ~1 s for FROZEN, which a task the kernel
                # holds (D state) never reaches - that wait blocked the event loop
                await asyncio.to_thread(self.governor.freeze, box.cg)
            except OSError as exc:
                raise BackendError(f"cannot freeze sandbox {sid}: {exc}") from exc
            box.paused = True
        g = self._memgroups.group_of(sid)
        if g is not None and not all(
                (m := self._boxes.get(other)) is not None and m.paused for other in g.members):
            # the group's memory is also running members': nothing is pushed out until
            # every member is paused (then the last pause reclaims the group)
            used = self.governor.memory_usage(box.cg)
            return PauseStats(resident_before_bytes=used, reclaimed_bytes=0,
                              duration_s=time.monotonic() - t0)
        before, after = await asyncio.to_thread(self.governor.reclaim, box.cg)
        return PauseStats(resident_before_bytes=before, reclaimed_bytes=max(0, before - after),
                          duration_s=time.monotonic() - t0)

    async def resume(self, sid: SandboxId) -> None:
        box = self.box(sid)
        if not box.paused:
            return
        try:
            self.governor.after_resume(box.cg)
            self.governor.thaw(box.cg)
        except OSError as exc:
            raise BackendError(f"cannot thaw sandbox {sid}: {exc}") from exc
        box.paused = False

    async def stats(self, sid: SandboxId) -> SandboxStats:
        box = self.box(sid)
        self._check_oom(box, report=True)  # a trainer polling stats sees the notices too
        self._check_pids(box)
        mem, peak, cpu, pids = self.governor.stats(box.cg)
        cap: int | None = None
        full = False
        if box.disk_q:
            use = DiskPool.usage_at(box.disk_q)
            disk, cap = use.used_bytes, use.cap_bytes
            full = self._check_disk(box)
        else:  # a sandbox made before the disk pool existed
            disk = await asyncio.to_thread(_tree_bytes, self.upper_dir(sid))
        rx, tx = (None, None) if box.dying else net_bytes(box.init_pid)
        held = memory_held(box.cg.version, self.governor.memory_stat(box.cg))
        g = self._memgroups.group_of(sid)
        return SandboxStats(memory_bytes=mem, memory_peak_bytes=peak, cpu_seconds=cpu,
                            pids=pids, disk_bytes=disk, disk_cap_bytes=cap, disk_full=full,
                            memory_tmpfs_bytes=self.governor.memory_shmem(box.cg),
                            memory_limit_bytes=self._memory_limit(box),
                            pids_max=box.spec.pids_max, net_rx_bytes=rx, net_tx_bytes=tx,
                            oom_kills=self.governor.oom_kills(box.cg),
                            # (a member's share of its group's memory)
                            memory_host_bytes=mem // (1 if g is None else len(g.members))
                            + uncharged_bytes(
                                self._peak_boxes,
                                SUPERBLOCKS_PER_SANDBOX
                                - (1 if self.shared_sysfs and box.netns_fd < 0 else 0)
                                - (1 if self.shared_scratch and g is None else 0)
                                - (1 if self.lazy_devpts and not box.spec.user_namespace
                                   else 0),
                                memcg_share=1 if g is None else len(g.members)),
                            qos=qos_of(box.spec), memory_rss_bytes=held.rss,
                            memory_cache_bytes=held.cache, memory_shm_bytes=held.shm,
                            memory_group="" if g is None else g.name,
                            memory_group_members=0 if g is None else len(g.members))

    # -- snapshots (pack_diff; needs images=StoreImages, see snapshot.py) -----------------
    async def snapshot(self, sid: SandboxId, *, strip: tuple[str, ...] = (),
                       max_bytes: int | None = None) -> SnapshotInfo:
        return await self._snapshots.snapshot(sid, strip=strip, max_bytes=max_bytes)

    async def snapshots(self) -> list[SnapshotInfo]:
        return await self._snapshots.snapshots()

    async def snapshot_info(self, ref: str) -> SnapshotInfo:
        return await self._snapshots.snapshot_info(ref)

    async def delete_snapshot(self, ref: str) -> SnapshotInfo:
        return await self._snapshots.delete_snapshot(ref)

    def images_present(self) -> Iterable[str]:
        return self._snapshots.images_present()


def _lock_root(root_dir: str) -> int:
    """flock ``<root_dir>/backend.lock`` (released when the process dies)."""
    fd = os.open(os.path.join(root_dir, "backend.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise InUse(f"container root_dir {root_dir} is in use by another backend (pid "
                    f"{owner or '?'}); stop it or give this one another root_dir",
                    root_dir=root_dir) from exc
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _legacy_rw_dirs(d: str) -> tuple[str, str]:
    """(upperdir, workdir) of a sandbox made before the disk pool (an upgrade adopting
    it): on its per-sandbox disk tmpfs if it had one, else in its directory. The tmpfs
    backing was dropped: it spent RAM (charged to the sandbox's memory cgroup) for disk
    and added a host mount per sandbox; see :mod:`.disk`."""
    disk = os.path.join(d, "disk")
    base = disk if os.path.ismount(disk) else d
    return os.path.join(base, "upper"), os.path.join(base, "work")


def _tree_bytes(path: str) -> int:
    total = 0
    for dirpath, dirnames, filenames in walk(path):   # tenant-shaped: no recursion
        for name in dirnames + filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise
    return total


def _pss_and_swap(pid: int) -> int | None:
    """A process's proportional resident + swapped memory in bytes
    (/proc/PID/smaps_rollup Pss + SwapPss: a page shared by n processes counts 1/n in
    each; ~1 ms per 100 MiB mapped); None if it is gone. A zombie or kernel thread: 0."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return 0
    total = 0
    for line in text.splitlines():
        if line.startswith((b"Pss:", b"SwapPss:")):
            total += int(line.split()[1]) * 1024
    return total


def _sysvipc_pinned(ipc_ns_fd: int) -> int:
    """Bytes the SysV objects of the ipc namespace ``ipc_ns_fd`` pin that no process
    maps: shm segments with no attach (rss + swap) and message queues (their bytes and
    ~64 B per message). Runs in the calling thread, which joins the namespace: the
    /proc/sysvipc files show the reader's (a thread of its own: call via to_thread)."""
    out: list[int] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            linux.setns(ipc_ns_fd, linux.CLONE_NEWIPC)
            total = 0
            with open("/proc/sysvipc/shm") as f:
                head = f.readline().split()
                for line in f:
                    row = dict(zip(head, line.split(), strict=False))
                    if row.get("nattch") == "0":
                        total += int(row.get("rss", 0)) + int(row.get("swap", 0))
            with open("/proc/sysvipc/msg") as f:
                head = f.readline().split()
                for line in f:
                    row = dict(zip(head, line.split(), strict=False))
                    total += int(row.get("cbytes", 0)) + 64 * int(row.get("qnum", 0))
            out.append(total)
        except BaseException as exc:  # noqa: BLE001 - reported below
            err.append(exc)

    t = threading.Thread(target=run, name="dsec-ipc-read")
    t.start()
    t.join()
    return out[0] if out else 0
