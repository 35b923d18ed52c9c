"""The jail a fncall worker runs a call in: a container sandbox's isolation, pre-started.

A pre-started worker does not know which sandbox it will serve, so the jail is built in
three steps, each by a different process of the worker tree (see ``fncall_worker.py``):

1. **zygote** (once per pool): a private mount namespace whose root is a tmpfs holding
   read-only binds of the Python runtime only (``/usr``, the interpreter's prefix, the
   venv: :func:`python_runtime`), a synthetic ``/etc`` (passwd, group, hosts,
   nsswitch.conf, ld.so.cache) and a ``/dev`` of six device nodes; then ``pivot_root``.
   Nothing else of the host (``/root``, ``/home``, ``/var``, ``/run``, the state dir, the
   repo, other sandboxes) exists in there. The zygote never runs user code.
2. **worker init** (per warm worker, PID 1 of a fresh pid namespace): its own mount, net,
   uts and ipc namespaces; a fresh ``/proc`` with the container's masks
   (``rootfs.MASKED_FILES``/``MASKED_DIRS``/``READONLY_PATHS``), private ``/tmp`` and
   ``/dev/shm`` tmpfs, a private ``/etc`` (a small tmpfs with the synthetic files, so
   admission can name the sandbox's user in it), ``lo`` up (no other interface
   exists). Killing this process kills every process of the call (the kernel tears the
   pid namespace down), so the edge kills a worker through a pidfd of it: race-free,
   never by a pid number.
3. **call process** (PID 2): at pre-start it cuts its capability bounding set and sets
   no_new_privs; at **admission** (when a call arrives) it joins the sandbox's cgroups
   (through ``cgroup.procs`` fds the edge opened), unshares a cgroup namespace,
   ``move_mount``s the sandbox's work dir (a detached bind the edge made with
   ``open_tree(OPEN_TREE_CLONE)`` and passed as an fd) onto ``/workspace``, sets the
   hostname, switches to the sandbox's own unprivileged host uid (all capabilities
   gone; the edge gives each sandbox a uid of its own, because the kernel counts some
   resources per host uid - inotify instances, fds in flight, RLIMIT_NPROC - and a
   shared uid lets one tenant use them up for all others), and loads the container
   seccomp profile (``dsec.net.seccomp``). Only then does user code run.

The plans (what the root holds, what each worker mounts) are pure tables, tested without
root; the functions below them carry them out with the system calls of
``container/linux.py`` plus the new mount API calls Python lacks.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import msgspec

from dsec.edge.backends.container import linux
from dsec.edge.backends.container.rootfs import (
    DEVICES,
    MASKED_DIRS,
    MASKED_FILES,
    READONLY_PATHS,
    SHM_BYTES,
)
from dsec.net.seccomp import Rule

__all__ = [
    "ADMISSION_SYSCALLS",
    "FORBIDDEN_RUNTIME_ROOTS",
    "JAIL_EXTRA_RULES",
    "NS_FLAGS",
    "JailConfig",
    "RootStep",
    "WorkerMount",
    "admit",
    "build_root",
    "clone_tree",
    "enter_worker",
    "etc_files",
    "next_child_in_new_pid_namespace",
    "prestart_call",
    "python_runtime",
    "root_plan",
    "split_profile",
    "user_lines",
    "worker_mounts",
]


class _HasSyscall(Protocol):
    @property
    def syscall(self) -> str: ...


RuleT = TypeVar("RuleT", bound=_HasSyscall)

# Namespaces of a worker besides its pid namespace (the zygote makes that one at fork).
NS_FLAGS = linux.CLONE_NEWNS | linux.CLONE_NEWNET | linux.CLONE_NEWUTS | linux.CLONE_NEWIPC

# A runtime bind may never be one of these (or contain them): binding e.g. a Python that
# lives directly in /root would put the host's /root into every jail.
FORBIDDEN_RUNTIME_ROOTS: tuple[str, ...] = ("/", "/root", "/home", "/var", "/run", "/etc",
                                            "/tmp", "/proc", "/sys", "/dev", "/srv", "/mnt",
                                            "/media", "/opt", "/work")
_TOP_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
ETC_BYTES = 256 << 10  # a worker's private /etc: the synthetic files and one more user
_LD_CACHE = "/etc/ld.so.cache"


class JailConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How the worker tree isolates a call (sent to the zygote as msgpack).

    ``uid``: 0 means calls run as root with the container's default capabilities;
    anything else means calls run unprivileged, as the uid (= gid) each call names
    (the sandbox's own, see ``FncallBackend``), or as ``uid`` itself when the call names
    none. ``workdir``: where the sandbox's work dir appears. ``runtime``: host directories bound read-only at the same path
    (:func:`python_runtime`). ``mountpoint``: an empty host directory the zygote mounts
    the jail's root tmpfs on, in its private mount namespace (the host sees it empty).
    ``seccomp`` + ``seccomp_admit``: the container profile in two stacked parts
    (:func:`split_profile`).
    """

    uid: int = 65534
    workdir: str = "/workspace"
    runtime: tuple[str, ...] = ()
    mountpoint: str = ""
    seccomp: bytes = b""        # loaded when pre-started: the profile minus ADMISSION_SYSCALLS
    seccomp_admit: bytes = b""  # stacked on it at the end of admission: exactly those
    # Nice value of the zygote and of each worker's init while it builds the worker
    # (forks, namespaces, mounts): refills yield to calls being served. The call process
    # and the built init run at nice 0 (see docs/isolation.md for what was measured).
    prestart_nice: int = 5
    tmp_bytes: int = 1 << 30   # private /tmp (pages count against the sandbox's memory)
    shm_bytes: int = SHM_BYTES
    hostname: str = "fncall"


# The calls of the container seccomp profile that admission itself still makes: the
# cgroup namespace (unshare) and attaching the work dir (move_mount). The rest of the
# profile is loaded when the worker is pre-started; these follow as a second, stacked
# filter once admission is done. Measured on the dev VM: the first filter a process
# loads costs ~0.3 ms (the full profile, 92 instructions), a second small one stacked on
# it ~0.04 ms - so the handout pays 0.04 ms instead of 0.3 and the end state is the
# same profile as a container's.
ADMISSION_SYSCALLS: frozenset[str] = frozenset({"unshare", "move_mount"})


# What only a fncall jail adds to the container profile. Its work dir is a btrfs subvolume
# (the disk pool of container/disk.py) bound in directly - a container reaches its upper
# only through overlayfs, which passes no btrfs ioctl on - so btrfs' own ioctls (type
# 0x94: creating a subvolume or snapshot inside the work dir would make data no qgroup
# limit counts, and a nested subvolume would block the work dir's deletion; clone,
# dedupe, ...) answer ENOTTY, as on a filesystem without them.
JAIL_EXTRA_RULES: tuple[Rule, ...] = (
    Rule("ioctl", errno=errno.ENOTTY, arg1_masked=(0xFF00, 0x9400)),
)


# ------------------------------------------------------------------------- pure plans
def split_profile(rules: Sequence[RuleT]) -> tuple[list[RuleT], list[RuleT]]:
    """(loaded at pre-start, stacked at admission): the rules of ``rules`` on calls
    admission does not make, and those it does. Together they are ``rules``."""
    return ([r for r in rules if r.syscall not in ADMISSION_SYSCALLS],
            [r for r in rules if r.syscall in ADMISSION_SYSCALLS])


@dataclass(frozen=True, slots=True)
class RootStep:
    """One entry of the jail root. ``kind``: ``dir`` (mode), ``bind`` (read-only bind of
    host ``source``; a file when ``file``), ``link`` (symlink to ``source``), ``write``
    (a file holding ``data``), ``dev`` (character device ``major:minor``)."""

    kind: str
    path: str
    source: str = ""
    mode: int = 0o755
    data: bytes = b""
    file: bool = False
    major: int = 0
    minor: int = 0


@dataclass(frozen=True, slots=True)
class WorkerMount:
    """One mount a worker makes in its own mount namespace; ``optional`` targets are
    skipped when the kernel does not have them (e.g. ``/proc/asound``)."""

    source: str | None
    target: str
    fstype: str | None
    flags: int
    data: str | None = None
    optional: bool = False


def _norm(path: str) -> str:
    return os.path.normpath(path) if path else path


def python_runtime(prefix: str, base_prefix: str, site_dirs: Iterable[str] = ()) -> tuple[str, ...]:
    """The host directories a jailed interpreter needs, minimal and without nesting:
    ``/usr``, the interpreter's ``base_prefix`` (e.g. a pyenv build), the venv
    (``prefix``) and any site-packages dir outside those. Refuses (``ValueError``) a
    directory that is or contains a host tree a sandbox must never see."""
    wanted = ["/usr", _norm(base_prefix), _norm(prefix), *(_norm(d) for d in site_dirs)]
    out: list[str] = []
    for d in sorted({w for w in wanted if w}, key=lambda p: (p.count("/"), p)):
        if not os.path.isabs(d):
            raise ValueError(f"Python runtime path {d!r} is not absolute")
        for bad in FORBIDDEN_RUNTIME_ROOTS:
            if d == bad or (bad != "/" and bad.startswith(d + "/")):
                raise ValueError(
                    f"the Python runtime lives at {d!r}; binding it into every fncall jail "
                    f"would expose the host's {bad}. Install Python (or the venv) under a "
                    "prefix of its own, e.g. /opt/python or /usr/local")
        if not any(d == o or d.startswith(o.rstrip("/") + "/") for o in out):
            out.append(d)
    return tuple(out)


def user_lines(uid: int, workdir: str = "/workspace") -> tuple[str, str]:
    """The /etc/passwd and /etc/group lines of the unprivileged ``uid`` calls run as
    (programs look themselves up: git, ssh, getpass)."""
    name = "nobody" if uid == 65534 else "sandbox"
    gname = "nogroup" if uid == 65534 else "sandbox"
    return (f"{name}:x:{uid}:{uid}:{name}:{workdir}:/usr/sbin/nologin\n",
            f"{gname}:x:{uid}:\n")


def etc_files(uid: int) -> dict[str, bytes]:
    """The synthetic /etc: who the ids are, localhost, files-only name service."""
    passwd = "root:x:0:0:root:/root:/usr/sbin/nologin\n"
    group = "root:x:0:\n"
    if uid != 0:
        pw, gr = user_lines(uid)
        passwd += pw
        group += gr
    return {
        "/etc/passwd": passwd.encode(),
        "/etc/group": group.encode(),
        "/etc/hosts": b"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n",
        "/etc/nsswitch.conf": b"passwd: files\ngroup: files\nhosts: files\n",
    }


def root_plan(cfg: JailConfig, top: Mapping[str, str | None],
              host_files: Iterable[str] = ()) -> list[RootStep]:
    """The jail root, in order. ``top``: the host's ``/bin``, ``/lib``, ... as name ->
    symlink target (merged /usr) or None (a real directory, bound read-only); names the
    host lacks are absent. ``host_files``: host files bound read-only at the same path
    if they exist (``/etc/ld.so.cache``, so the dynamic loader finds libraries)."""
    steps: list[RootStep] = []
    made: set[str] = {"/"}

    def mkdirs(path: str, mode: int = 0o755) -> None:
        parts = [p for p in path.split("/") if p]
        for i in range(1, len(parts) + 1):
            d = "/" + "/".join(parts[:i])
            if d not in made:
                made.add(d)
                steps.append(RootStep("dir", d, mode=mode))

    for name, target in sorted(top.items()):
        if target is None:
            mkdirs("/" + name)
            steps.append(RootStep("bind", "/" + name, source="/" + name))
        else:
            steps.append(RootStep("link", "/" + name, source=target))
    for d in cfg.runtime:
        mkdirs(d)
        steps.append(RootStep("bind", d, source=d))
    mkdirs("/etc")
    for path, data in sorted(etc_files(cfg.uid).items()):
        steps.append(RootStep("write", path, data=data, mode=0o644))
    for path in host_files:
        mkdirs(os.path.dirname(path))
        steps.append(RootStep("bind", path, source=path, file=True))
    mkdirs("/dev")
    for name, major, minor, mode in DEVICES:
        steps.append(RootStep("dev", f"/dev/{name}", mode=mode, major=major, minor=minor))
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        steps.append(RootStep("link", f"/dev/{name}", source=target))
    for d in ("/dev/shm", "/dev/.empty", "/proc", "/tmp", cfg.workdir):
        mkdirs(d)
    return steps


def worker_mounts(cfg: JailConfig) -> list[WorkerMount]:
    """What each worker mounts over the (read-only) jail root in its own namespace: a
    fresh /proc with the container's masks and read-only kernel knobs, private /tmp and
    /dev/shm. The same lists as the container root (``rootfs.py``)."""
    nsd = linux.MS_NOSUID | linux.MS_NODEV
    out = [WorkerMount("proc", "/proc", "proc", nsd | linux.MS_NOEXEC)]
    out += [WorkerMount("/dev/null", p, None, linux.MS_BIND, optional=True)
            for p in MASKED_FILES]
    out += [WorkerMount("/dev/.empty", p, None, linux.MS_BIND, optional=True)
            for p in MASKED_DIRS if p.startswith("/proc/")]
    for p in READONLY_PATHS:
        out.append(WorkerMount(p, p, None, linux.MS_BIND | linux.MS_REC, optional=True))
        out.append(WorkerMount(None, p, None, linux.MS_BIND | linux.MS_REMOUNT | linux.MS_RDONLY
                               | nsd, optional=True))
    out.append(WorkerMount("tmpfs", "/tmp", "tmpfs", nsd,
                           f"mode=1777,size={cfg.tmp_bytes},nr_inodes={max(4096, cfg.tmp_bytes >> 13)}"))
    out.append(WorkerMount("tmpfs", "/dev/shm", "tmpfs", nsd | linux.MS_NOEXEC,
                           f"mode=1777,size={cfg.shm_bytes}"))
    if cfg.uid != 0:
        # Refilled with etc_files() right after (and ld.so.cache bound back in):
        # admission adds the sandbox's user to passwd/group. Root-owned, so the call
        # (unprivileged by then) cannot change it. Root calls keep the read-only /etc.
        out.append(WorkerMount("tmpfs", "/etc", "tmpfs", nsd | linux.MS_NOEXEC,
                               f"mode=0755,size={ETC_BYTES},nr_inodes=64"))
    return out


# ----------------------------------------------------------------- new mount API calls
_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_SYS_MOUNT_SETATTR = 442
OPEN_TREE_CLONE = 1
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
AT_SYMLINK_NOFOLLOW = 0x100
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
_PR_SET_DUMPABLE = 4
_PR_CAPBSET_DROP = 24
_PR_SET_PDEATHSIG = 1


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def _open_tree(path: str) -> int:
    return _check(int(_syscall(_SYS_OPEN_TREE, ctypes.c_int(-100), path.encode(),
                               ctypes.c_uint(OPEN_TREE_CLONE | os.O_CLOEXEC
                                             | AT_SYMLINK_NOFOLLOW))),
                  f"open_tree({path!r})")


def clone_tree(path: str) -> int:
    """A detached bind mount of directory ``path`` (``open_tree(OPEN_TREE_CLONE)``),
    nosuid and nodev, as a close-on-exec fd: the edge hands it to a worker, which can
    only attach it (``move_mount``) - never walk out of it: the root of a detached mount
    is its own parent, so ``..`` stays put."""
    fd = _open_tree(path)
    try:
        attr = _MountAttr(MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0, 0, 0)
        _check(int(_syscall(_SYS_MOUNT_SETATTR, ctypes.c_int(fd), b"",
                            ctypes.c_uint(AT_EMPTY_PATH), ctypes.byref(attr),
                            ctypes.c_size_t(ctypes.sizeof(attr)))), "mount_setattr")
    except OSError:
        os.close(fd)
        raise
    return fd


def _move_mount(fd: int, target: str) -> None:
    _check(int(_syscall(_SYS_MOVE_MOUNT, ctypes.c_int(fd), b"", ctypes.c_int(-100),
                        target.encode(), ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH))),
           f"move_mount(-> {target!r})")


def _prctl(option: int, arg: int, what: str) -> None:
    _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0),
                       ctypes.c_ulong(0), ctypes.c_ulong(0)), what)


# -------------------------------------------------------------------- carrying it out
def _host_top() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in _TOP_LINKS:
        p = "/" + name
        if os.path.islink(p):
            out[name] = os.readlink(p)
        elif os.path.isdir(p):
            out[name] = None
    return out


def build_root(cfg: JailConfig) -> None:
    """Zygote: enter a private mount namespace and make the jail root its ``/``."""
    linux.unshare(linux.CLONE_NEWNS)
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    new = cfg.mountpoint
    linux.mount("tmpfs", new, "tmpfs", linux.MS_NOSUID, "mode=0755,size=4m,nr_inodes=4096")
    ro = linux.MS_BIND | linux.MS_REMOUNT | linux.MS_RDONLY | linux.MS_NOSUID | linux.MS_NODEV
    for step in root_plan(cfg, _host_top(), [p for p in ("/etc/ld.so.cache",)
                                             if os.path.isfile(p)]):
        at = new + step.path
        if step.kind == "dir":
            os.mkdir(at, step.mode)
        elif step.kind == "link":
            os.symlink(step.source, at)
        elif step.kind == "write":
            with open(at, "wb") as f:
                f.write(step.data)
            os.chmod(at, step.mode)
        elif step.kind == "dev":
            os.mknod(at, 0o020000 | step.mode, os.makedev(step.major, step.minor))
            os.chmod(at, step.mode)
        elif step.kind == "bind":
            if step.file:
                os.close(os.open(at, os.O_CREAT | os.O_WRONLY, 0o644))
            linux.mount(step.source, at, None, linux.MS_BIND)
            linux.mount(None, at, None, ro)
    linux.mount(None, new, None, linux.MS_REMOUNT | linux.MS_RDONLY | linux.MS_NOSUID,
                "mode=0755")
    os.chdir(new)
    linux.pivot_root(".", ".")
    linux.umount2(".", linux.MNT_DETACH)
    os.chdir("/")


def next_child_in_new_pid_namespace(own_pidns_fd: int) -> None:
    """Zygote, before each fork: the next child is PID 1 of a new pid namespace. A
    process may only unshare one while its children would still be born in its own, so
    step back into ours first (``own_pidns_fd``: /proc/self/ns/pid opened at start)."""
    linux.setns(own_pidns_fd, linux.CLONE_NEWPID)
    linux.unshare(linux.CLONE_NEWPID)


def _lo_up() -> None:
    """``ip link set lo up`` (SIOCGIFFLAGS/SIOCSIFFLAGS on a throwaway socket)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s.fileno(), 0x8913, req))[1]
        fcntl.ioctl(s.fileno(), 0x8914, struct.pack("16sH22x", b"lo", flags | 1))


def enter_worker(cfg: JailConfig) -> None:
    """Worker init (PID 1 of its own pid namespace): own mount/net/uts/ipc namespaces,
    fresh /proc with masks, private /tmp and /dev/shm, loopback up. It dies with the
    zygote (PR_SET_PDEATHSIG), so an edge killed with -9 leaves no call running: the
    zygote exits on EOF of its control socket, and each worker's pid namespace with it."""
    _prctl(_PR_SET_PDEATHSIG, 9, "prctl(PR_SET_PDEATHSIG)")
    linux.unshare(NS_FLAGS)
    # The root's read-only ld.so.cache, kept across the tmpfs that covers /etc below.
    private_etc = cfg.uid != 0
    cache = _open_tree(_LD_CACHE) if private_etc and os.path.isfile(_LD_CACHE) else -1
    try:
        for m in worker_mounts(cfg):
            try:
                linux.mount(m.source, m.target, m.fstype, m.flags, m.data)
            except OSError as exc:
                if not (m.optional and exc.errno in (errno.ENOENT, errno.ENOTDIR)):
                    raise
        for path, data in etc_files(cfg.uid).items() if private_etc else ():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        if cache >= 0:
            os.close(os.open(_LD_CACHE, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
            _move_mount(cache, _LD_CACHE)
    finally:
        if cache >= 0:
            os.close(cache)
    linux.sethostname(cfg.hostname)
    _lo_up()


def prestart_call(cfg: JailConfig) -> None:
    """Call process, before any call: shrink the capability bounding set (to nothing, or
    to the container default set for uid 0), set no_new_privs and load the seccomp
    profile but for the calls admission makes. The effective capability set stays until
    :func:`admit` has used it."""
    keep = set(linux.DEFAULT_CAPS) if cfg.uid == 0 else set()
    for cap in range(linux.CAP_LAST_CAP + 1):
        if cap not in keep:
            r = _libc.prctl(ctypes.c_int(_PR_CAPBSET_DROP), ctypes.c_ulong(cap),
                            ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
            if r < 0 and ctypes.get_errno() != errno.EINVAL:
                _check(r, f"prctl(PR_CAPBSET_DROP, {cap})")
    os.setpriority(os.PRIO_PROCESS, 0, 0)  # it serves a call: back from prestart_nice
    linux.limit_nofile()   # not the edge's raised RLIMIT_NOFILE (red team 19, B5)
    linux.set_no_new_privs()
    if cfg.seccomp:
        linux.load_seccomp(cfg.seccomp)


def admit(cfg: JailConfig, fds: Sequence[int], *, hostname: str,
          uid: int | None = None) -> None:
    """Call process, when a call arrives: ``fds`` = [work-dir tree, cgroup.procs...].
    Join the cgroups, unshare a cgroup namespace, attach the work dir, drop to the
    sandbox's user ``uid`` (default: ``cfg.uid``) and load seccomp. Closes ``fds``. After
    this nothing privileged is left in the process: no capability, no host fd but the
    reply socket."""
    uid = cfg.uid if uid is None else uid
    if not fds or (uid == 0) != (cfg.uid == 0) or not 0 <= uid < 2**32 - 1:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"admission needs the work dir's tree fd ({len(fds)} fds) and "
                         f"a uid of this jail's kind (uid {uid}, jail uid {cfg.uid})")
    tree, cgroups = fds[0], fds[1:]
    try:
        for fd in cgroups:
            os.write(fd, b"0")  # "0": the writing process
        linux.unshare(linux.CLONE_NEWCGROUP)
        _move_mount(tree, cfg.workdir)
        linux.sethostname(hostname)
    finally:
        for fd in fds:
            os.close(fd)
    if uid not in (0, cfg.uid):  # name the sandbox's user (the worker's own /etc)
        for path, line in zip(("/etc/passwd", "/etc/group"), user_lines(uid, cfg.workdir),
                              strict=True):
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
    if uid == 0:
        linux.drop_capabilities(linux.DEFAULT_CAPS)
    else:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # from root to non-root: every capability is cleared
    # Credentials changed, so the kernel made us non-dumpable (/proc/self/* root-owned);
    # user code (subprocess's fd cleanup, ...) needs its own /proc/self back.
    _prctl(_PR_SET_DUMPABLE, 1, "prctl(PR_SET_DUMPABLE)")
    if cfg.seccomp_admit:
        linux.load_seccomp(cfg.seccomp_admit)  # now the whole container profile holds
