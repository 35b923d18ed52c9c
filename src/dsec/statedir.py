"""The state directory of ``dsec up`` / ``dsec edge``: private to the user running dsec.

Everything under it is some tenant's or the cluster's secret: ``control.sqlite`` holds API
key hashes and stored create requests with their ``env``, ``layers/`` every project's
images and snapshots, ``container/`` the sandboxes' roots, ``edges/`` the journals and
the edges' Aether sockets (no token on a Unix socket: who can connect can run commands).
So the directory is made 0700 at every start, also when it already existed with a looser
mode (a pre-created 0755 directory used to leave all of that world-readable), and it is
refused when another user owns it (that user could read or swap anything in it) or could
redirect its path (another user's symlink on the way, a parent others may write):
dsec then goes on with the real path it checked.
Files inside get private modes of their own as well (the SQLite store 0600, the layer
store 0700/0600), which matters where they live outside a state dir.

Where the directory is (:func:`default_state_dir`) and what a running ``dsec up`` wrote in
it for clients (:func:`read_local`: its URL, gateway and admin key) live here, on the
ground floor, so the SDK finds a local cluster without importing the server (issue 13).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import stat
from collections.abc import Callable
from typing import Any

from dsec.errors import InvalidArgument

__all__ = ["LOCAL_FILE", "check_path_is_ours", "create_private_file", "default_state_dir",
           "ensure_private_dir", "fsync_dir", "fsync_file", "read_local", "write_private_file"]

#: What a running ``dsec up`` writes in its state dir for local clients (mode 0600).
LOCAL_FILE = "local.json"


def default_state_dir() -> str:
    """``$DSEC_STATE_DIR``, else ``~/.dsec``."""
    return os.environ.get("DSEC_STATE_DIR") or os.path.join(os.path.expanduser("~"), ".dsec")


def read_local(state_dir: str | None = None) -> dict[str, Any] | None:
    """The ``local.json`` of a running ``dsec up`` (None if absent or unreadable)."""
    path = os.path.join(state_dir or default_state_dir(), LOCAL_FILE)
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def ensure_private_dir(path: str, *, what: str = "state dir") -> str:
    """Create ``path`` (and parents) if needed, then make it mode 0700. Returns its real
    path (symlinks resolved), which callers must use from then on. ``InvalidArgument``
    when it is not a directory, another user owns it, or another user could redirect it
    (:func:`check_path_is_ours`)."""
    path = os.path.abspath(path)
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        check_path_is_ours(path, what=what)
        path = os.path.realpath(path)
        st = os.stat(path)
    except OSError as exc:
        raise InvalidArgument(f"cannot create the {what} {path}: {exc.strerror or exc}; "
                              "pick a directory this user may create") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidArgument(f"the {what} {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise InvalidArgument(
            f"the {what} {path} is owned by uid {st.st_uid}, not by this process's uid "
            f"{os.geteuid()}: that user could read or replace the cluster's keys, layers "
            "and sandboxes; chown it or pick another directory")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def check_path_is_ours(path: str, *, what: str = "state dir") -> None:
    """Refuse a ``path`` that another host user could point elsewhere: a 0700 directory
    protects nothing if its *name* can be moved. That is the case when a symlink along
    ``path`` belongs to another user (one planted in /tmp: its owner swaps it for a
    link to a directory of theirs after the checks, and the cluster's keys, layers and
    sockets are written there), or when a directory above it (symlinks resolved) is
    owned by another user or is writable by others without the sticky bit (they rename
    ours away and put theirs in its place). Owners root and this process's uid are
    trusted (as OpenSSH's StrictModes does)."""
    ok = {0, os.geteuid()}
    parts = os.path.abspath(path).split("/")[1:]
    cur = ""
    for part in parts:
        cur += "/" + part
        st = os.lstat(cur)
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in ok:
            raise InvalidArgument(
                f"the {what} {path} goes through the symlink {cur}, owned by uid "
                f"{st.st_uid}: that user can point it anywhere after dsec checked it; use "
                "a path without other users' symlinks (e.g. the real directory)")
    real = os.path.realpath(path)
    d = os.path.dirname(real)
    while True:
        st = os.stat(d)
        if st.st_uid not in ok:
            raise InvalidArgument(
                f"the {what} {real} is inside {d}, owned by uid {st.st_uid}: that user "
                "could rename it and put a directory of theirs in its place; pick a "
                "directory whose parents belong to root or to this user")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise InvalidArgument(
                f"the {what} {real} is inside {d} (mode {stat.S_IMODE(st.st_mode):o}), "
                "which other users may write: they could rename it and put a directory "
                "of theirs in its place; pick a directory whose parents only root or "
                "this user can write (or a sticky one such as /tmp)")
        if d == "/":
            break
        d = os.path.dirname(d)


def fsync_dir(path: str) -> None:
    """fsync a directory (a rename or a new entry in it made durable); best effort."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_file(path: str) -> None:
    """fsync the file at ``path``: one another process wrote (a compiler, a mkfs) or that
    was written through a descriptor already closed, before it is renamed to the name
    the next start trusts as complete."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _staged(path: str, data: bytes) -> str:
    """``data`` in a new 0600 file next to ``path`` (unique name, O_EXCL|O_NOFOLLOW:
    never an existing file or a planted link), fsynced: ready to link or rename."""
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        os.fchmod(fd, 0o600)          # whatever the umask
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    return tmp


def create_private_file(path: str, make: Callable[[], bytes]) -> bool:
    """Make the secret/state file ``path`` (0600) holding ``make()`` unless it exists;
    True when this call made it (or remade it). Callers then read and check what is there.

    Whole or not at all: written to a temporary file, fsynced, then *linked* into place
    (a link never replaces: two processes starting at once agree on the first one) and
    the directory fsynced. The older way - ``O_CREAT|O_EXCL`` on the final name, then a
    write - left an empty file on a kill -9, OOM kill or power loss between the two, which
    every later start found, did not remake and refused: a crash loop until a human
    deleted it (red team 22 A4). Such an empty file, regular and ours, is a crash's
    leftover and nothing was ever made from it (every reader refuses an empty secret),
    so it is replaced here (under a lock on the directory, so concurrent starts still
    agree); any other existing content is the caller's to accept or explain."""
    try:
        st: os.stat_result | None = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not _crash_leftover(st):
        return False
    tmp = _staged(path, make())
    try:
        if st is None:
            try:
                os.link(tmp, path)
                fsync_dir(os.path.dirname(os.path.abspath(path)))
                return True
            except FileExistsError:
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    return False
                if not _crash_leftover(st):
                    return False
        return _replace_leftover(path, tmp)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _crash_leftover(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_size == 0 and st.st_uid == os.geteuid()


def _replace_leftover(path: str, tmp: str) -> bool:
    d = os.path.dirname(os.path.abspath(path))
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(dfd, fcntl.LOCK_EX)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None and not _crash_leftover(st):
            return False                  # another process remade it meanwhile
        logging.getLogger(__name__).warning(
            "%s was empty (left by a crash while it was being made): made it again", path)
        os.replace(tmp, path)
        os.fsync(dfd)
        return True
    finally:
        os.close(dfd)


def write_private_file(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` (0600), whole or not at all: a temporary file,
    fsynced, renamed over it, the directory fsynced. A crash (or power loss) leaves the
    old content or the new, never an empty or half-written file."""
    tmp = _staged(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))
