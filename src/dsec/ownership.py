"""Which process owns a directory it made for itself, so the next process can reclaim
what a dead one left behind (a crash skips every cleanup).

The owner is written beside the directory (``<dir>.owner``: pid and the process's start
time from ``/proc/<pid>/stat``, which together name one process across pid reuse), not
inside it, so the directory's own listing stays what its user put there. A directory
without an owner file is someone else's business (made before this existed, or being
made right now): callers must leave it alone.
"""

from __future__ import annotations

import os

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
    """Record this process as the owner of ``path`` (atomically replaced)."""
    me = os.getpid()
    tmp = _file(path) + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{me} {start_time(me)}\n")
    os.replace(tmp, _file(path))


def disown(path: str) -> None:
    """Remove the owner record of ``path`` (after removing or handing over ``path``)."""
    for p in (_file(path), _file(path) + ".tmp"):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def owner_alive(path: str) -> bool | None:
    """True if the recorded owner of ``path`` still runs, False if it is gone, None if
    ``path`` has no (readable) owner record."""
    try:
        with open(_file(path)) as f:
            pid_s, start_s = f.read().split()
        pid, start = int(pid_s), int(start_s)
    except (OSError, ValueError):
        return None
    return start_time(pid) == start
