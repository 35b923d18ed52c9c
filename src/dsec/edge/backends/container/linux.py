"""Thin ctypes wrappers over the Linux calls Python 3.11 lacks.

Python 3.11 has no ``os.unshare``/``os.setns``/``os.pidfd_open``-based setns, no mount(2),
pivot_root(2), openat2(2), capset(2) or seccomp loading, so they are called through libc
here (x86_64 syscall numbers where glibc has no wrapper). Every wrapper raises ``OSError``
with errno and the arguments, the way the ``os`` module does; callers map it to the dsec
error tree at their boundary.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import resource

__all__ = [
    "CAP_LAST_CAP",
    "CLONE_NEWCGROUP",
    "CLONE_NEWIPC",
    "CLONE_NEWNET",
    "CLONE_NEWNS",
    "CLONE_NEWPID",
    "CLONE_NEWUSER",
    "CLONE_NEWUTS",
    "DEFAULT_CAPS",
    "MNT_DETACH",
    "MS_BIND",
    "MS_NODEV",
    "MS_NOEXEC",
    "MS_NOSUID",
    "MS_PRIVATE",
    "MS_RDONLY",
    "MS_REC",
    "MS_REMOUNT",
    "RESOLVE_IN_ROOT",
    "RESOLVE_NO_MAGICLINKS",
    "FsCreds",
    "as_root",
    "current_fs_creds",
    "drop_capabilities",
    "fs_creds",
    "fstatfs_type",
    "load_seccomp",
    "mount",
    "open_init_pidfd",
    "openat2",
    "pidfd_open",
    "pidfd_send_signal",
    "pivot_root",
    "remount",
    "set_fs_creds",
    "set_no_new_privs",
    "sethostname",
    "setns",
    "umount2",
    "unshare",
]

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10

# x86_64 syscall numbers (glibc 2.36 wraps none of these usefully for us).
_SYS_PIVOT_ROOT = 155
_SYS_CAPSET = 126
_SYS_PIDFD_SEND_SIGNAL = 424
_SYS_PIDFD_OPEN = 434
_SYS_OPENAT2 = 437

_PR_SET_NO_NEW_PRIVS = 38
_PR_CAPBSET_DROP = 24
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2

CAP_LAST_CAP = 40
# RLIMIT_NOFILE (soft = hard) of every sandbox process, set before its execve by nsexec.c
# (SANDBOX_NOFILE there: keep in step) and in runc's config (oci.py), never the edge's own
# raised limit (dsec.nofile): a sandbox holds at most pids_max x this many open files of
# the node's file table (fs.file-max), 1,048,576 at the default pids_max (red team 19, B5;
# docs/container.md "Node budget"). DEFAULT_CAPS has no CAP_SYS_RESOURCE to raise it.
SANDBOX_NOFILE = 1024


def limit_nofile(limit: int = SANDBOX_NOFILE) -> None:
    """Set this process's RLIMIT_NOFILE to ``limit`` (soft = hard; a lower inherited hard
    limit is kept): a sandbox process's, before it runs sandbox code (nsexec.c does the
    same in C for the container backend's processes)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    n = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

# The usual container default set (Docker/containerd/runc "default" profile) minus
# CAP_MKNOD: the v2 device controller needs a BPF program we do not install, so instead of
# relying on a devices cgroup we make device-node creation impossible (see docs/container.md).
DEFAULT_CAPS: tuple[int, ...] = (
    0,   # CAP_CHOWN
    1,   # CAP_DAC_OVERRIDE
    3,   # CAP_FOWNER
    4,   # CAP_FSETID
    5,   # CAP_KILL
    6,   # CAP_SETGID
    7,   # CAP_SETUID
    8,   # CAP_SETPCAP
    10,  # CAP_NET_BIND_SERVICE
    13,  # CAP_NET_RAW
    18,  # CAP_SYS_CHROOT
    29,  # CAP_AUDIT_WRITE
    31,  # CAP_SETFCAP
)


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), f"unshare(0x{flags:x})")


def setns(fd: int, nstype: int) -> None:
    """Join the namespaces ``nstype`` of ``fd`` (a namespace fd or, since 5.8, a pidfd)."""
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), f"setns({fd}, 0x{nstype:x})")


def mount(source: str | None, target: str, fstype: str | None, flags: int = 0,
          data: str | None = None) -> None:
    _check(
        _libc.mount(
            None if source is None else source.encode(),
            target.encode(),
            None if fstype is None else fstype.encode(),
            ctypes.c_ulong(flags),
            None if data is None else data.encode(),
        ),
        f"mount({source!r}, {target!r}, {fstype!r}, 0x{flags:x}, {data!r})",
    )


def remount(target: str, data: str) -> None:
    """Remount the filesystem mounted at ``target`` with options ``data`` (``MS_REMOUNT``)."""
    mount(None, target, None, MS_REMOUNT, data)


def umount2(target: str, flags: int = 0) -> None:
    _check(_libc.umount2(target.encode(), ctypes.c_int(flags)), f"umount2({target!r})")


def pivot_root(new_root: str, put_old: str) -> None:
    _check(_syscall(_SYS_PIVOT_ROOT, new_root.encode(), put_old.encode()),
           f"pivot_root({new_root!r}, {put_old!r})")


def sethostname(name: str) -> None:
    raw = name.encode()[:64]
    _check(_libc.sethostname(raw, ctypes.c_size_t(len(raw))), f"sethostname({name!r})")


def pidfd_open(pid: int) -> int:
    return _check(int(_syscall(_SYS_PIDFD_OPEN, ctypes.c_int(pid), ctypes.c_uint(0))),
                  f"pidfd_open({pid})")


def pidfd_send_signal(pidfd: int, sig: int) -> None:
    _check(int(_syscall(_SYS_PIDFD_SEND_SIGNAL, ctypes.c_int(pidfd), ctypes.c_int(sig),
                        None, ctypes.c_uint(0))), f"pidfd_send_signal({pidfd}, {sig})")


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """openat2(2): with ``RESOLVE_IN_ROOT`` every ``..``, absolute path and symlink is
    resolved as if ``dirfd`` were ``/`` - atomically, so a racing symlink swap cannot
    escape either."""
    how = _OpenHow(flags, mode, resolve)
    return _check(
        int(_syscall(_SYS_OPENAT2, ctypes.c_int(dirfd), path.encode(), ctypes.byref(how),
                     ctypes.c_size_t(ctypes.sizeof(how)))),
        f"openat2({path!r})",
    )


def fstatfs_type(fd: int) -> int:
    """``f_type`` of the filesystem ``fd`` lives on (fstatfs(2); works on O_PATH fds).
    Python's ``os.fstatvfs`` does not report it."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit
    _check(_libc.fstatfs(ctypes.c_int(fd), buf), f"fstatfs({fd})")
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def set_no_new_privs() -> None:
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), ctypes.c_ulong(0),
                       ctypes.c_ulong(0), ctypes.c_ulong(0)), "prctl(PR_SET_NO_NEW_PRIVS)")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def drop_capabilities(keep: tuple[int, ...] = DEFAULT_CAPS) -> None:
    """Shrink the bounding set to ``keep``, clear ambient caps and set eff/perm/inh to it.

    Dropping the bounding set is what matters for root: execve gives uid 0 the whole
    bounding set as permitted, so a cap not in it can never come back.
    """
    keep_set = set(keep)
    for cap in range(CAP_LAST_CAP + 1):
        if cap not in keep_set:
            r = _libc.prctl(_PR_CAPBSET_DROP, ctypes.c_ulong(cap), ctypes.c_ulong(0),
                            ctypes.c_ulong(0), ctypes.c_ulong(0))
            if r < 0 and ctypes.get_errno() != 22:  # EINVAL: cap unknown to this kernel
                _check(r, f"prctl(PR_CAPBSET_DROP, {cap})")
    _libc.prctl(_PR_CAP_AMBIENT, ctypes.c_ulong(_PR_CAP_AMBIENT_CLEAR_ALL), ctypes.c_ulong(0),
                ctypes.c_ulong(0), ctypes.c_ulong(0))
    mask = 0
    for cap in keep:
        mask |= 1 << cap
    hdr = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    for i in range(2):
        word = (mask >> (32 * i)) & 0xFFFFFFFF
        data[i].effective = word
        data[i].permitted = word
        data[i].inheritable = 0
    _check(int(_syscall(_SYS_CAPSET, ctypes.byref(hdr), ctypes.byref(data))), "capset")


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def load_seccomp(bpf: bytes) -> None:
    """Install a classic-BPF seccomp program (as exported by libseccomp) on this thread.

    Needs no_new_privs (or CAP_SYS_ADMIN) first. The program is built once per helper
    process; loading raw BPF here costs microseconds where building it costs milliseconds.
    """
    if len(bpf) % 8:
        raise ValueError(f"seccomp program of {len(bpf)} bytes is not a whole number of "
                         "8-byte BPF instructions")
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = _SockFprog(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p))
    _check(_libc.prctl(_PR_SET_SECCOMP, ctypes.c_ulong(_SECCOMP_MODE_FILTER),
                       ctypes.byref(prog), ctypes.c_ulong(0), ctypes.c_ulong(0)),
           "prctl(PR_SET_SECCOMP)")



_landlock_abi: int | None = None


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none, or disabled at boot). Asked once."""
    global _landlock_abi
    if _landlock_abi is None:
        libc = ctypes.CDLL(None, use_errno=True)
        # landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION), x86_64/arm64
        nr = {"x86_64": 444, "aarch64": 444}.get(os.uname().machine)
        v = libc.syscall(nr, None, ctypes.c_size_t(0), ctypes.c_uint32(1)) if nr else -1
        _landlock_abi = max(0, int(v))
    return _landlock_abi


def open_init_pidfd(pid: int, start: int) -> int:
    """A pidfd of process ``pid`` if it is still the one that started at ``start`` (clock
    ticks since boot, /proc/<pid>/stat field 22), else ``ProcessLookupError``.

    Race-free: the pidfd is opened first, then the start time read, then the pidfd
    signalled with 0. If that signal succeeds, the pidfd's process was alive after the
    read, so the pid named it during the read: the start time read was its own. (A pidfd
    does not keep a pid number from being reused; this check is what makes it exact.)"""
    from dsec.ownership import start_time

    fd = os.pidfd_open(pid)
    try:
        if start_time(pid, running=True) != start:
            raise ProcessLookupError(errno.ESRCH, f"pid {pid} is no longer the sandbox's init")
        pidfd_send_signal(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


# ---------------------------------------------------------------- per-thread fs creds
# x86_64 numbers (the module's convention); setgroups MUST be the raw syscall: glibc's
# setgroups() wrapper broadcasts the change to every thread of the process (nptl's
# setxid), which would hand the user's groups to the edge's other threads.
_SYS_SETGROUPS = 116
_SYS_SETFSUID = 122
_SYS_SETFSGID = 123
MAX_FS_GROUPS = 256


class FsCreds:
    """A file-system identity for one thread: fsuid, fsgid and supplementary groups
    (host ids, i.e. already mapped through the sandbox's user namespace)."""

    __slots__ = ("gid", "groups", "uid")

    def __init__(self, uid: int, gid: int, groups: tuple[int, ...] = ()) -> None:
        self.uid, self.gid, self.groups = uid, gid, tuple(groups)[:MAX_FS_GROUPS]

    def __repr__(self) -> str:
        return f"FsCreds(uid={self.uid}, gid={self.gid}, groups={self.groups})"


def _fsid(nr: int, value: int) -> int:
    """setfsuid/setfsgid(2): answers the previous id (they never fail visibly)."""
    return int(_syscall(ctypes.c_long(nr), ctypes.c_uint(value & 0xFFFFFFFF))) & 0xFFFFFFFF


def _setgroups(groups: tuple[int, ...]) -> None:
    arr = (ctypes.c_uint * max(1, len(groups)))(*groups)
    _check(int(_syscall(ctypes.c_long(_SYS_SETGROUPS), ctypes.c_size_t(len(groups)), arr)),
           "setgroups")


def current_fs_creds() -> FsCreds:
    """This thread's fsuid, fsgid and groups (setfs*id(-1) changes nothing and answers
    the current id)."""
    return FsCreds(_fsid(_SYS_SETFSUID, 0xFFFFFFFF), _fsid(_SYS_SETFSGID, 0xFFFFFFFF),
                   tuple(os.getgroups()))


def set_fs_creds(c: FsCreds) -> None:
    """Make this thread (only) act on files as ``c``. Groups and fsgid first (changing
    them needs CAP_SETGID, which a non-zero fsuid does not drop but order keeps it
    obvious), fsuid last: moving fsuid from 0 to non-zero clears the file capabilities
    (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER, CAP_CHOWN, CAP_FSETID, ...)
    from the thread's effective set, so the kernel checks every path step, open,
    create, unlink and rename as that user - atomically, no check-then-act. Moving it
    back to 0 restores them. Verified after the calls (setfs*id report no errors)."""
    _setgroups(c.groups)
    _fsid(_SYS_SETFSGID, c.gid)
    _fsid(_SYS_SETFSUID, c.uid)
    now = current_fs_creds()
    if now.uid != c.uid or now.gid != c.gid:
        raise OSError(errno.EPERM, f"could not take file identity {c!r} (have {now!r})")


class fs_creds:  # a context manager, used like a function
    """``with fs_creds(c):`` this thread acts on files as ``c`` (None: unchanged), and
    gets back its own identity after, whatever happens. A thread that cannot get its
    identity back must not do root's work with a user's: the process aborts (the edge
    restarts; a half-privileged file thread would be a silent hole)."""

    __slots__ = ("c", "saved")

    def __init__(self, c: FsCreds | None) -> None:
        self.c = c
        self.saved: FsCreds | None = None

    def __enter__(self) -> None:
        if self.c is None:
            return
        self.saved = current_fs_creds()
        try:
            set_fs_creds(self.c)
        except BaseException:
            self._restore()
            raise

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            self._restore()

    def _restore(self) -> None:
        saved, self.saved = self.saved, None
        assert saved is not None
        try:
            _fsid(_SYS_SETFSUID, saved.uid)
            _fsid(_SYS_SETFSGID, saved.gid)
            _setgroups(saved.groups)
            now = current_fs_creds()
            ok = now.uid == saved.uid and now.gid == saved.gid
        except BaseException:  # noqa: BLE001 - any failure here ends the process
            ok = False
        if not ok:
            os.write(2, b"dsec: a file thread could not restore its credentials; aborting\n")
            os.abort()


def as_root() -> fs_creds:
    """Root's file identity for a step inside a user's operation that is the edge's own
    (its cgroup bookkeeping, a helper's /proc files); a no-op when already root."""
    cur = _fsid(_SYS_SETFSUID, 0xFFFFFFFF)
    return fs_creds(None if cur == 0 else FsCreds(0, 0, ()))
