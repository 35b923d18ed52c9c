"""Shed the host's mounts a helper's private mount namespace does not need, then exec it.

Why: a private mount namespace (``unshare --mount``) starts as a copy of every mount the
host has at that instant, and each copy holds its superblock - whatever the host later
unmounts. A long helper in one (mmdebstrap, tens of seconds) so pinned every other
dsec object on the node made before it started: an edge that closed its sandbox disk
pool unmounted it and deleted ``pool.img``, yet the btrfs filesystem, its loop device and
the deleted image's blocks stayed until the bootstrap ended (CI, a bootstrap test beside
an edge's kill -9 test); likewise EROFS layer mounts (their layer files held open),
network namespace pins (nsfs: the namespace and its veths alive), FUSE layer daemons'
mounts. Propagation does not help: on a host whose ``/`` is private (no systemd) a slave
namespace receives no unmount either.

Decision: the helper runs ``python -m dsec.mountshed --keep PATH ... -- ARGV``
as the first process in its namespace, which unshares a mount namespace of its own
(started in one its caller shares, it stripped the caller's: red team 29 E), makes its
``/`` recursively private (so no
detach can propagate to a peer: run in a namespace that shared mounts with its caller,
it unmounted the caller's; run in PID 1's own mount namespace it refuses - red team 28
F), moves to ``/`` (its working directory held its caller's mount: 28 A), and detaches
(``MNT_DETACH``) every mount but:

- ``/`` and every mount that is an ancestor of, or is, a kept path (the build target,
  the mirror, ``$TMPDIR``), so what the helper reads and writes is where it was;
- the API filesystems (``/proc``, ``/sys``, ``/dev`` and all below them);
- a mount exactly at one of the system directories (``/usr``, ``/etc``, ``/var``, ...):
  a host that splits its OS over several filesystems still runs the helper's binaries;
- everything at or below ``/etc``, and every mount on a single file but a namespace pin
  (nsfs): the host's configuration as container hosts bind it - ``/etc/resolv.conf``,
  ``/etc/hosts``, CA bundles (red team 28 D: the default http mirror lost its DNS).

so that only those remain pinned. Mounts are detached deepest first, each lazily (a busy
one goes with its last user, which is none: nothing else runs in the namespace yet).
Measured here: ~40 ms of Python start-up before a bootstrap of ~15 s.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import os
import sys
from collections.abc import Callable, Iterable, Sequence

from dsec.rmtree import unescape_mountinfo

__all__ = ["SYSTEM_DIRS", "foreign_mounts", "shed_argv"]

#: mount points kept when a mount sits exactly there (not what is mounted below them)
SYSTEM_DIRS = frozenset({"/usr", "/etc", "/var", "/var/lib", "/var/cache", "/var/tmp",
                         "/var/log", "/opt", "/bin", "/sbin", "/lib", "/lib32", "/lib64",
                         "/libx32", "/boot", "/home", "/root", "/run", "/tmp", "/srv"})
#: kept with everything below them (the kernel's own filesystems and the device tree)
API_TREES = ("/proc", "/sys", "/dev")
#: kept with everything below them: the host's configuration, as container hosts bind it
CONFIG_TREES = ("/etc",)

_MNT_DETACH = 2
_MS_REC, _MS_PRIVATE = 0x4000, 1 << 18
_CLONE_NEWNS = 0x00020000


def _within(path: str, top: str) -> bool:
    return top == "/" or path == top or path.startswith(top.rstrip("/") + "/")


def foreign_mounts(mountinfo: str, keep: Iterable[str],
                   is_dir: Callable[[str], bool] = lambda _p: True) -> list[str]:
    """The mount points of a ``/proc/self/mountinfo`` text to detach, deepest first, one
    entry per mount (a mount point covered twice is listed twice): every mount but those
    the module docstring keeps. ``keep``: absolute paths (need not exist); ``is_dir``:
    whether a mount point is a directory (the I/O, injected)."""
    kept_paths = [os.path.normpath(k) for k in keep]
    out: list[str] = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        mp = os.path.normpath(unescape_mountinfo(fields[4]))
        sep = fields.index("-", 6) if "-" in fields[6:] else -1
        fstype = fields[sep + 1] if 0 < sep < len(fields) - 1 else ""
        if mp == "/" or mp in SYSTEM_DIRS:
            continue
        if any(_within(mp, top) for top in (*API_TREES, *CONFIG_TREES)):
            continue
        if any(_within(k, mp) for k in kept_paths):   # mp is k or one of its ancestors
            continue
        if fstype != "nsfs" and not is_dir(mp):      # a file bind: the host's config
            continue
        out.append(mp)
    return sorted(out, key=lambda p: p.count("/"), reverse=True)


def shed_argv(argv: Sequence[str], keep: Iterable[str]) -> list[str]:
    """``argv`` preceded by this module's shedding step (run it as the first process of
    a fresh private mount namespace)."""
    out = [sys.executable, "-m", "dsec.mountshed"]
    for k in keep:
        out += ["--keep", os.path.abspath(k)]
    return [*out, "--", *argv]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.unshare.argtypes = [ctypes.c_int]
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                           ctypes.c_ulong, ctypes.c_void_p]
    return libc


def _detach(libc: ctypes.CDLL, points: Sequence[str]) -> int:
    failed = 0
    for mp in points:
        # EINVAL/ENOENT: gone with a parent detached before it (a stacked or
        # unreachable mount point) - nothing left to pin
        if (libc.umount2(mp.encode(), _MNT_DETACH) != 0
                and ctypes.get_errno() not in (errno.EINVAL, errno.ENOENT)):
            failed += 1
    return failed


def _is_dir(path: str) -> bool:
    try:
        return os.path.isdir(path)
    except OSError:
        return True


def main(args: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsec.mountshed",
                                description="detach the mounts this private mount "
                                            "namespace does not need, then exec ARGV")
    p.add_argument("--keep", action="append", default=[], metavar="PATH")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    ns = p.parse_args(args)
    argv = ns.argv[1:] if ns.argv[:1] == ["--"] else ns.argv
    if not argv:
        p.error("no command given after --")
    try:
        if os.stat("/proc/self/ns/mnt").st_ino == os.stat("/proc/1/ns/mnt").st_ino:
            print("dsec.mountshed: refusing to run in PID 1's mount namespace (it detaches "
                  "mounts: run it as the first process of a new private one, e.g. under "
                  "unshare --mount)", file=sys.stderr)
            return 2
    except OSError:
        pass   # /proc/1 not ours to read: the private remount below still confines us
    libc = _libc()
    # a namespace of its own first: started in one that other processes share (a
    # service's, a container's, one entered with nsenter -m), the detaches below would
    # strip theirs (red team 29 E); from the copy, nothing reaches back
    if libc.unshare(_CLONE_NEWNS) != 0:
        print(f"dsec.mountshed: cannot make a mount namespace: "
              f"{os.strerror(ctypes.get_errno())}", file=sys.stderr)
        return 2
    if libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        print(f"dsec.mountshed: cannot make / private: {os.strerror(ctypes.get_errno())}",
              file=sys.stderr)
        return 2
    os.chdir("/")
    with open("/proc/self/mountinfo") as f:
        points = foreign_mounts(f.read(), [os.path.realpath(k) for k in ns.keep], _is_dir)
    if _detach(libc, points):
        # still correct, only pinning more than it needs: say so, run anyway
        print(f"dsec.mountshed: {len(points)} mounts to detach, some refused",
              file=sys.stderr)
    os.execvp(argv[0], argv)
    return 127   # not reached


if __name__ == "__main__":
    sys.exit(main())
