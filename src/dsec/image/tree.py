"""Overlay-format directory trees: whiteouts, opaque dirs, metadata copies, layer merging.

A layer tree uses overlayfs' own encoding, so an EROFS layer can sit directly in an
overlay lowerdir stack: a deletion is a character device 0/0 (a *whiteout*) and a
directory that hides everything below it carries ``trusted.overlay.opaque=y``.
:func:`apply_tree` lays one such tree over another exactly as overlayfs would see it,
which is how consecutive layers are merged and OCI layers are squashed.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = [
    "OPAQUE_XATTR",
    "TreeStats",
    "apply_tree",
    "copy_entry",
    "copy_meta",
    "is_opaque",
    "is_whiteout",
    "make_whiteout",
    "remove_path",
    "set_opaque",
    "tree_stats",
]

OPAQUE_XATTR = "trusted.overlay.opaque"
_OVERLAY_XATTR_PREFIX = "trusted.overlay."
_COPY_CHUNK = 1 << 20


def is_whiteout(st: os.stat_result) -> bool:
    """A whiteout is a character device with device number 0/0."""
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def make_whiteout(path: str) -> None:
    os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))


def is_opaque(path: str) -> bool:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP):
            return False
        raise


def set_opaque(path: str) -> None:
    os.setxattr(path, OPAQUE_XATTR, b"y", follow_symlinks=False)


def remove_path(path: str) -> None:
    """Remove a file, link, whiteout or whole directory tree; missing is fine."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _user_xattrs(path: str) -> Iterator[tuple[str, bytes]]:
    """xattrs worth carrying into a layer: everything but overlay's private markers."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EPERM):
            return
        raise
    for name in names:
        if name.startswith(_OVERLAY_XATTR_PREFIX):
            continue
        try:
            yield name, os.getxattr(path, name, follow_symlinks=False)
        except OSError as exc:
            if exc.errno not in (errno.ENODATA, errno.ENOTSUP):
                raise


def copy_meta(src: str, dst: str, st: os.stat_result, *, times: bool = True) -> None:
    """Copy owner, mode, xattrs (minus overlay markers) and optionally times."""
    link = stat.S_ISLNK(st.st_mode)
    os.lchown(dst, st.st_uid, st.st_gid)
    if not link:
        os.chmod(dst, stat.S_IMODE(st.st_mode))
        for name, value in _user_xattrs(src):
            os.setxattr(dst, name, value, follow_symlinks=False)
    if times:
        os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _copy_data(src: str, dst: str, mode: int) -> None:
    fd_in = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            size = os.fstat(fd_in).st_size
            # copy_file_range stays in the kernel (and may share extents); fall back to
            # read/write when the two files live on filesystems that refuse it (EROFS->ext4).
            try:
                left = size
                while left > 0:
                    n = os.copy_file_range(fd_in, fd_out, min(left, 1 << 30))
                    if n == 0:
                        break
                    left -= n
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                os.lseek(fd_in, 0, os.SEEK_SET)
                os.ftruncate(fd_out, 0)
                os.lseek(fd_out, 0, os.SEEK_SET)
                while chunk := os.read(fd_in, _COPY_CHUNK):
                    os.write(fd_out, chunk)
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)


def copy_entry(src: str, dst: str, st: os.stat_result, *, times: bool = True) -> None:
    """Copy one non-directory entry (file, symlink, whiteout, fifo) with its metadata."""
    mode = st.st_mode
    if stat.S_ISREG(mode):
        _copy_data(src, dst, mode)
    elif stat.S_ISLNK(mode):
        os.symlink(os.readlink(src), dst)
    elif is_whiteout(st):
        make_whiteout(dst)
    elif stat.S_ISFIFO(mode):
        os.mkfifo(dst, 0o600)
    elif stat.S_ISDIR(mode):
        raise IsADirectoryError(src)
    else:
        # Device nodes other than whiteouts never enter a layer (hostile input).
        return
    copy_meta(src, dst, st, times=times)


@dataclass(slots=True)
class TreeStats:
    entries: int = 0
    content_bytes: int = 0


def tree_stats(root: str) -> TreeStats:
    """Count entries and regular-file bytes under ``root`` (not following links)."""
    out = TreeStats()
    for dirpath, dirnames, filenames in os.walk(root):
        out.entries += len(dirnames) + len(filenames)
        for name in filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISREG(st.st_mode):
                out.content_bytes += st.st_size
    return out


def apply_tree(src: str, dst: str, *, keep_whiteouts: bool) -> None:
    """Lay the overlay-format tree ``src`` over ``dst`` as overlayfs would stack them.

    Whiteouts delete what is below; opaque directories replace it; other directories
    merge. ``keep_whiteouts`` keeps the whiteouts and opaque markers in ``dst`` so they
    still hide layers below the merged result; pass False when ``dst`` is the bottom of
    the stack (nothing below to hide).
    """
    dirs_done: list[tuple[str, str, os.stat_result]] = []
    _apply_dir(src, dst, keep_whiteouts, dirs_done)
    # Directory times last: creating children above changed them.
    for s, d, st in reversed(dirs_done):
        os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _apply_dir(src: str, dst: str, keep: bool,
               dirs_done: list[tuple[str, str, os.stat_result]]) -> None:
    with os.scandir(src) as it:
        entries = sorted(it, key=lambda e: e.name)
    for e in entries:
        s = e.path
        d = os.path.join(dst, e.name)
        st = os.lstat(s)
        if is_whiteout(st):
            remove_path(d)
            if keep:
                make_whiteout(d)
            continue
        if stat.S_ISDIR(st.st_mode):
            opaque = is_opaque(s)
            try:
                dst_st: os.stat_result | None = os.lstat(d)
            except FileNotFoundError:
                dst_st = None
            if opaque or (dst_st is not None and not stat.S_ISDIR(dst_st.st_mode)):
                remove_path(d)
                dst_st = None
            if dst_st is None:
                os.mkdir(d, 0o700)
            copy_meta(s, d, st, times=False)
            if opaque and keep:
                set_opaque(d)
            dirs_done.append((s, d, st))
            _apply_dir(s, d, keep, dirs_done)
            continue
        remove_path(d)
        copy_entry(s, d, st)
