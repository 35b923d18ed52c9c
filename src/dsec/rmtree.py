"""Recursive deletes that never cross a mount point.

Why: a directory dsec deletes recursively (a dead owner's scratch entry in the layer
store's ``tmp/``, a build or pull scratch dir, a sandbox's state dir, a cluster's state
dir) may have something mounted below it: mmdebstrap in root mode binds the host's
``/dev/shm``, ``/proc``, ``/sys`` into its target; a sandbox's rootfs, disk or /dev are
mounts. ``shutil.rmtree`` walks through them, so the reclaim of a killed bootstrap's
scratch would delete every POSIX shm segment and semaphore of the host (red team 15, F18).

Decision - both of:

1. ``detach_mounts=True`` (only for dsec's OWN scratch: a directory dsec created whose
   every mount below is one dsec or its helper made there): the mounts at or below the
   directory, as ``/proc/self/mountinfo`` lists them, are detached (``MNT_DETACH``, deepest
   first) before the walk. Detaching drops this mount namespace's view of them only; the
   source (the host's /dev/shm) keeps its files. Lazy because a mount may still be busy
   (a process with its cwd there): it then goes when its last user does.
2. The walk is one-file-system whatever the caller asked: fd based (``O_NOFOLLOW |
   O_DIRECTORY`` + ``dir_fd``, so a symlink swapped in mid-walk is never followed), and
   every directory it opens must be on the same mount as the top one: same ``mnt_id``
   (``/proc/self/fdinfo``: catches a bind of a directory of the SAME filesystem, where
   ``st_dev`` is equal) and same ``st_dev``. A directory on another mount - one the caller
   may not detach, or one mounted after the mountinfo read - is left alone, listed in
   :attr:`Removal.refused` and logged.

3. The walk is iterative and holds at most :data:`MAX_OPEN_DIRS` directory fds, whatever
   the depth: the trees are often a tenant's (a sandbox's /tmp in the shared scratch, its
   overlay upper, a file-API remove), and the recursive walk this was raised
   RecursionError on a ``mkdir d; cd d`` loop ~1,000 deep, leaving the sandbox's files
   in the node's tmpfs (red team 22, B3). A directory below the fd window is renamed into
   the top directory and emptied from there: each directory is listed once, nothing is
   re-walked, and the walk never climbs by ``..``. Measured here (ext4, load ~14): a
   chain 3,000 deep in 7.8 s, all of it in ``rmdir``'s journal writes.

A walk that only refused (option 2 alone) would leave mounts and their mount points
behind for good; one that only unmounted (option 1 alone) races a mount made after the
mountinfo read. The per-directory check costs one read of a small /proc file per
directory; measured here (2 loaded cores, best of 3): 1,941 directories and 19,000 empty
files removed in 0.90 s by :func:`remove_tree`, 1.76 s by ``shutil.rmtree`` - the check
does not show next to the unlinks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import stat
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

_MNT_DETACH = 0x2
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(slots=True)
class Removal:
    """What :func:`remove_tree` did: the mounts it detached, the directories it left
    because they are on another mount (``refused``) and the paths it could not remove
    (``errors``: path -> reason)."""

    detached: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return not self.refused and not self.errors

    def describe(self) -> str:
        parts = []
        if self.refused:
            parts.append(f"{len(self.refused)} directories on other mounts left alone: "
                         f"{self.refused[:5]}")
        if self.errors:
            parts.append(f"{len(self.errors)} paths not removed: "
                         f"{list(self.errors.items())[:5]}")
        return "; ".join(parts) or "removed"


def unescape_mountinfo(path: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (``\\040``)."""
    if "\\" not in path:
        return path
    out, i = [], 0
    while i < len(path):
        esc = path[i + 1:i + 4]
        if path[i] == "\\" and len(esc) == 3 and all(c in "01234567" for c in esc):
            out.append(chr(int(esc, 8)))
            i += 4
        else:
            out.append(path[i])
            i += 1
    return "".join(out)


def mounts_at_or_below(mountinfo: str, path: str) -> list[str]:
    """Mount points at or below ``path`` in a ``/proc/self/mountinfo`` text, deepest
    first (the order to detach them in); a point mounted twice is listed twice (each
    detach removes the top one). Pure."""
    top = path.rstrip("/") or "/"
    base = top if top == "/" else top + "/"
    out = []
    for line in mountinfo.splitlines():
        fields = line.split(" ", 5)
        if len(fields) < 5:
            continue
        mp = unescape_mountinfo(fields[4])
        if mp == top or mp.startswith(base):
            out.append(mp)
    return sorted(out, key=lambda p: (-p.count("/"), p))


def _read_mountinfo() -> str:
    with open("/proc/self/mountinfo") as f:
        return f.read()


def _mnt_id(fd: int) -> int:
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    raise OSError(errno.ENOTSUP, "no mnt_id in /proc/self/fdinfo (kernel < 3.15?)")


def detach_mounts(path: str) -> list[str]:
    """Detach (``MNT_DETACH``) every mount at or below ``path``, deepest first; return
    them. Only for directories that are dsec's own scratch (see the module doc)."""
    done = []
    for mp in mounts_at_or_below(_read_mountinfo(), os.path.abspath(path)):
        if _libc.umount2(mp.encode(), _MNT_DETACH) != 0:
            e = ctypes.get_errno()
            if e not in (errno.EINVAL, errno.ENOENT):   # already gone
                raise OSError(e, f"umount2({mp!r}, MNT_DETACH): {os.strerror(e)}")
            continue
        done.append(mp)
    return done


def remove_tree(path: str, *, detach: bool = False, missing_ok: bool = True) -> Removal:
    """Remove ``path`` (a directory, or a file) recursively without ever crossing a
    mount point. ``detach``: first detach the mounts at or below it (dsec's own scratch
    only). What could not go is in the result and logged; nothing raises but a missing
    ``path`` with ``missing_ok=False``."""
    res = Removal()
    path = os.path.abspath(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not missing_ok:
            raise
        return res
    if not stat.S_ISDIR(st.st_mode):
        try:
            os.unlink(path)
        except OSError as exc:
            res.errors[path] = exc.strerror or str(exc)
        return res
    if detach:
        try:
            res.detached = detach_mounts(path)
        except OSError as exc:
            res.errors[path] = str(exc)
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        res.errors[path] = exc.strerror or str(exc)
        return res
    try:
        parent_fd = os.open(os.path.dirname(path), _DIR_FLAGS)
    except OSError as exc:
        os.close(fd)
        res.errors[path] = exc.strerror or str(exc)
        return res
    try:
        _remove_dir(parent_fd, os.path.basename(path), fd, path, res)
    finally:
        os.close(fd)
        os.close(parent_fd)
    if not res.clean:
        log.warning("remove_tree(%s): %s", path, res.describe())
    return res


def remove_tree_at(parent_fd: int, name: str, where: str) -> Removal:
    """:func:`remove_tree` of the directory ``name`` in the directory open as
    ``parent_fd`` (no detach: for trees dsec does not own, e.g. a sandbox's files);
    ``where`` names it in the result."""
    res = Removal()
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    try:
        _remove_dir(parent_fd, name, fd, where, res)
    finally:
        os.close(fd)
    return res


#: directory fds one removal holds open at most (the directory being emptied and its
#: ancestors up to the top): a deeper directory is moved up into the top directory and
#: emptied from there (:func:`_clear`)
MAX_OPEN_DIRS = 64


def _remove_dir(parent_fd: int, name: str, fd: int, where: str, res: Removal) -> None:
    top_dev, top_mnt = os.fstat(parent_fd).st_dev, _mnt_id(parent_fd)
    if (os.fstat(fd).st_dev, _mnt_id(fd)) != (top_dev, top_mnt):
        res.refused.append(where)         # itself a mount point (not detached)
        return
    _clear(fd, where, top_dev, top_mnt, res)
    try:
        os.rmdir(name, dir_fd=parent_fd)
    except OSError as exc:
        if not (res.refused or res.errors):
            res.errors[where] = exc.strerror or str(exc)


@dataclass(slots=True)
class _Level:
    """One directory of the walk's current path: open as ``fd``, named ``name`` in the
    level above, its entries not yet looked at in ``todo``."""

    fd: int
    name: str
    path: str
    todo: list[str]


def _clear(top_fd: int, where: str, dev: int, mnt: int, res: Removal) -> None:
    """Empty the directory open as ``top_fd`` (the caller's fd: not closed here).

    Iterative, with at most :data:`MAX_OPEN_DIRS` directory fds: the tree's shape is a
    tenant's (a sandbox's /tmp, its overlay upper, a file-API remove), and one
    ``mkdir d; cd d`` loop a few MB long made the recursive walk this replaced raise
    RecursionError (red team 22, B3) - or EMFILE, one fd per level. A directory
    found below the deepest level allowed is renamed into the top directory (same
    file system and mount: checked before) under a fresh name and emptied from there
    once its turn comes: every directory is listed once, no path is ever re-walked
    and nothing goes up by ``..`` (a directory a live tenant moves meanwhile cannot
    take the walk out of the tree). Symlinks are never followed (``O_NOFOLLOW``,
    ``lstat``) and no directory on another mount is entered (``st_dev`` + ``mnt_id``).
    The memory it holds is the names still to look at along the current path."""
    try:
        todo = os.listdir(top_fd)
    except OSError as exc:
        res.errors[where] = exc.strerror or str(exc)
        return
    path: list[_Level] = [_Level(top_fd, "", where, todo)]
    try:
        while path:
            cur = path[-1]
            if not cur.todo:
                path.pop()
                if not path:
                    break
                os.close(cur.fd)
                try:
                    os.rmdir(cur.name, dir_fd=path[-1].fd)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    if not any(r.startswith(cur.path + "/") for r in res.refused) \
                            and not any(e.startswith(cur.path + "/") for e in res.errors):
                        res.errors[cur.path] = exc.strerror or str(exc)
                continue
            name = cur.todo.pop()
            p = os.path.join(cur.path, name)
            try:
                st = os.stat(name, dir_fd=cur.fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            except OSError as exc:
                res.errors[p] = exc.strerror or str(exc)
                continue
            if not stat.S_ISDIR(st.st_mode):
                try:
                    os.unlink(name, dir_fd=cur.fd)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    res.errors[p] = exc.strerror or str(exc)
                continue
            try:
                cfd = os.open(name, _DIR_FLAGS, dir_fd=cur.fd)
            except OSError as exc:
                res.errors[p] = exc.strerror or str(exc)
                continue
            try:
                if os.fstat(cfd).st_dev != dev or _mnt_id(cfd) != mnt:
                    res.refused.append(p)
                    os.close(cfd)
                    continue
                if len(path) >= MAX_OPEN_DIRS:
                    # too deep to hold another fd: move it up, to be emptied from the
                    # top (a mount point cannot be renamed: EBUSY, reported)
                    os.close(cfd)
                    up = _move_up(cur.fd, name, top_fd, p, res)
                    if up is not None:
                        path[0].todo.append(up)
                    continue
                todo = os.listdir(cfd)
            except OSError as exc:
                os.close(cfd)
                res.errors[p] = exc.strerror or str(exc)
                continue
            path.append(_Level(cfd, name, p, todo))
    finally:
        for lv in path[1:]:
            os.close(lv.fd)


def _move_up(dfd: int, name: str, top_fd: int, p: str, res: Removal) -> str | None:
    """Rename the directory ``name`` of ``dfd`` into ``top_fd`` under a fresh random
    name (unguessable: the top may be a tenant's directory, where a name it made first
    would be replaced if empty or refuse the move if not); the new name, or None with
    the error recorded."""
    for _ in range(4):
        up = f".dsec-rm-{os.urandom(8).hex()}"
        try:
            os.rename(name, up, src_dir_fd=dfd, dst_dir_fd=top_fd)
            return up
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                continue
            res.errors[p] = f"move up to the top directory: {exc.strerror or exc}"
            return None
    res.errors[p] = "move up to the top directory: every fresh name was taken"
    return None
