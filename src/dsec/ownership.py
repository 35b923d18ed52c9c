"""Which process owns a directory it made for itself, so the next process can reclaim
what a dead one left behind (a crash skips every cleanup).

The owner is written beside the directory (``<dir>.owner``: pid and the process's start
time from ``/proc/<pid>/stat``, which together name one process across pid reuse), not
inside it, so the directory's own listing stays what its user put there. A directory
without an owner file is someone else's business (made before this existed, or being
made right now): callers must leave it alone.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

__all__ = ["claim", "disown", "owner_alive", "start_time"]

SUFFIX = ".owner"


def start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks since boot); None if no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        # comm (field 2) may contain spaces and ')': split after the last ')'
        return int(raw[raw.rfind(b")") + 2:].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _file(path: str) -> str:
    return path.rstrip("/") + SUFFIX


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
            f.write(f"{me} {start_time(me)}\n")
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
    ``path`` has no owner record of ours: none, unreadable, a symlink, or a file another
    user made (in a shared directory anyone can write one that names a dead process)."""
    try:
        fd = os.open(_file(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd) as f:
            if os.fstat(f.fileno()).st_uid != os.geteuid():
                return None
            pid_s, start_s = f.read().split()
        pid, start = int(pid_s), int(start_s)
    except (OSError, ValueError):
        return None
    return start_time(pid) == start
