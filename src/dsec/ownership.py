"""Which process owns a directory it made for itself, so the next process can reclaim
what a dead one left behind (a crash skips every cleanup).

The owner is written beside the directory (``<dir>.owner``: pid, the process's start
time from ``/proc/<pid>/stat`` and its pid namespace, which together name one process
across pid reuse), not inside it, so the directory's own listing stays what its user put
there. A directory without an owner file is someone else's business (made before this
existed, or being made right now): callers must leave it alone. So is one whose owner
lives in another pid namespace (its pid means nothing here), and an owner file this
user did not write (another local user may plant one beside a directory in a shared
place such as /tmp to have it "reclaimed").

:func:`token` is the same identity as one path component, for scratch entries named by
their owner (``<store>/tmp/<token>/...``): :func:`token_alive` tells a dead owner's.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile

__all__ = ["claim", "disown", "owner_alive", "start_time", "token", "token_alive"]

SUFFIX = ".owner"


def start_time(pid: int, *, running: bool = False) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks since boot): with the pid it names
    one process for the whole boot (pids are reused, this is not). None if no such
    process; with ``running``, also if it is dead and waiting to be reaped (a zombie).
    The one reader of it (ownership files, the idempotency store's holders, container
    sandboxes' init processes and cgroup-name claims, supervised edge processes)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        # comm (field 2) may contain spaces and ')': split after the last ')'
        fields = raw[raw.rfind(b")") + 2:].split()
        if running and fields[0] in (b"Z", b"X"):
            return None
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _pid_ns() -> int:
    """The inode of this process's pid namespace (0 if unreadable)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _file(path: str) -> str:
    return path.rstrip("/") + SUFFIX


def _alive(pid: int, start: int, ns: int | None) -> bool | None:
    if ns is not None and ns != _pid_ns():
        return None  # another pid namespace's process: no telling from here
    return start_time(pid) == start


def claim(path: str) -> None:
    """Record this process as the owner of ``path`` (atomically replaced).

    The record may sit in a directory other users can write (fncall's default root is
    in /tmp), so it is written through a fresh, randomly named file (O_EXCL: never one
    someone planted - with a fixed temp name, root followed a planted symlink and
    overwrote its target) and renamed over whatever ``<path>.owner`` was (a rename
    replaces a planted symlink, it does not follow it)."""
    me = os.getpid()
    owner = _file(path)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(owner) + ".",
                               dir=os.path.dirname(owner) or ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"{me} {start_time(me)} {_pid_ns()}\n")
            os.fchmod(f.fileno(), 0o644)
        os.replace(tmp, owner)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def disown(path: str) -> None:
    """Remove the owner record of ``path`` (after removing or handing over ``path``)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_file(path))


def owner_alive(path: str) -> bool | None:
    """True if the recorded owner of ``path`` still runs, False if it is gone, None if
    ``path`` has no owner record this user wrote (none, unreadable, not a regular file,
    written by another user) or its owner is in another pid namespace."""
    try:
        fd = os.open(_file(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        fields = os.read(fd, 128).split()
        pid, start = int(fields[0]), int(fields[1])
        ns = int(fields[2]) if len(fields) > 2 else None
    except (OSError, ValueError, IndexError):
        return None
    finally:
        os.close(fd)
    return _alive(pid, start, ns)


def token() -> str:
    """This process as one path component: ``<pid-namespace>.<pid>.<start time>``."""
    me = os.getpid()
    return f"{_pid_ns()}.{me}.{start_time(me)}"


def token_alive(name: str) -> bool | None:
    """For a name made by :func:`token`: True if that process runs, False if it is gone,
    None if ``name`` is not such a token or belongs to another pid namespace."""
    parts = name.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    ns, pid, start = (int(p) for p in parts)
    return _alive(pid, start, ns)
