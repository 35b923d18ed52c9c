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
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from dsec.errors import ImageError
from dsec.rmtree import remove_tree

__all__ = [
    "OPAQUE_XATTR",
    "SkipKind",
    "TreeStats",
    "apply_tree",
    "copy_entry",
    "copy_meta",
    "data_extents",
    "is_opaque",
    "is_whiteout",
    "make_whiteout",
    "remove_path",
    "set_opaque",
    "skip_counts",
    "special_skip",
    "tree_stats",
    "write_sparse",
]

OPAQUE_XATTR = "trusted.overlay.opaque"
_OVERLAY_XATTR_PREFIX = "trusted.overlay."
_COPY_CHUNK = 1 << 20
_BLOCK = 4096
_ZERO_BLOCK = bytes(_BLOCK)


SkipKind = Literal["devices", "sockets"]


def special_skip(mode: int, rdev: int) -> SkipKind | None:
    """THE rule for special files, at every door (SDK upload, ``dsec image build``, tar
    and OCI import, pack_diff, the builder; pure): what of an entry of type ``mode`` (and
    device number ``rdev``) is left out of a layer, counted under the returned kind.

    * a whiteout (character device 0/0) is kept: it is overlay's deletion marker, which
      snapshots, merges and OCI layers are made of;
    * every other character or block device is skipped: a sandbox gets its own /dev, and
      a node in a layer would name a host device (a debootstrap tree has dozens);
    * sockets are skipped: they are a live process's endpoint, meaningless in an image
      (and tar cannot carry them);
    * FIFOs are kept: a name and a mode, harmless, and programs may expect them.

    None: keep. Before, each door had its own rule: the SDK upload refused a debootstrap
    tree (the server refused device members) while ``dsec image build`` packed its /dev."""
    if stat.S_ISCHR(mode):
        return None if rdev == 0 else "devices"
    if stat.S_ISBLK(mode):
        return "devices"
    if stat.S_ISSOCK(mode):
        return "sockets"
    return None


def skip_counts(*counts: dict[str, int]) -> dict[str, int]:
    """Sum per-kind skip counts, leaving out zeros (pure)."""
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return {k: v for k, v in sorted(out.items()) if v}


def is_whiteout(st: os.stat_result) -> bool:
    """A whiteout is a character device with device number 0/0."""
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def make_whiteout(path: str) -> None:
    """A whiteout at ``path``, with mtime 0: overlay never shows it, and a time of "now"
    would make the same deletion give a different layer every build (reproducible
    layers, :mod:`dsec.image.erofs`)."""
    os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))
    os.utime(path, ns=(0, 0), follow_symlinks=False)


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
        res = remove_tree(path)          # never across a mount point
        if not res.clean:
            raise OSError(f"cannot remove {path}: {res.describe()}")
    else:
        os.unlink(path)


def _user_xattrs(path: str) -> Iterator[tuple[str, bytes]]:
    """xattrs worth carrying into a layer: everything but overlay's private markers, by
    name: mkfs.erofs stores them in the order the staged inode lists them (insertion
    order on ext4), so a sorted copy is the same layer whatever order the source has."""
    try:
        names = sorted(os.listxattr(path, follow_symlinks=False))
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
        xattrs = list(_user_xattrs(src))
        for name, value in xattrs:
            try:
                os.setxattr(dst, name, value, follow_symlinks=False)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.E2BIG, errno.ERANGE):
                    raise
                # ext4 keeps an inode's xattrs in one block (btrfs allows ~16 KiB each):
                # ENOSPC here is the inode, not the disk.
                total = sum(len(n) + len(v) for n, v in xattrs)
                raise ImageError(
                    f"its {len(xattrs)} extended attributes ({total} bytes) do not fit one "
                    f"inode of the layer store's filesystem ({exc.strerror}); remove or "
                    "shrink them") from exc
    if times:
        os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def data_extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of each data run of the open file ``fd`` (``size`` bytes long),
    skipping holes (SEEK_DATA/SEEK_HOLE); a filesystem without hole reporting yields the
    whole file as one run."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:      # only a hole from pos to the end
                return
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                yield pos, size - pos
                return
            raise
        if start >= size:
            return
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        yield start, end - start
        pos = end


def write_sparse(fd: int, data: bytes, offset: int) -> None:
    """Write ``data`` at ``offset``, leaving whole zero blocks as holes (the file's size is
    set by the caller with ftruncate). ``bytes == bytes`` is a memcmp: ~10 GB/s."""
    view = memoryview(data)
    for i in range(0, len(data), _BLOCK):
        block = view[i:i + _BLOCK]
        if block != _ZERO_BLOCK[:len(block)]:
            os.pwrite(fd, block, offset + i)


def _copy_data(src: str, dst: str, mode: int) -> None:
    """Copy a regular file's bytes keeping its holes: a 1 GiB sparse file with 4 KiB of
    data costs 4 KiB here, not 1 GiB (snapshots of a capped sandbox stay that size)."""
    fd_in = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            size = os.fstat(fd_in).st_size
            for start, length in data_extents(fd_in, size):
                _copy_range(fd_in, fd_out, start, length)
            os.ftruncate(fd_out, size)
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)


def _copy_range(fd_in: int, fd_out: int, start: int, length: int) -> None:
    # copy_file_range stays in the kernel (and may share extents); fall back to
    # read/write when the two files live on filesystems that refuse it (EROFS->ext4).
    done = 0
    try:
        while done < length:
            n = os.copy_file_range(fd_in, fd_out, min(length - done, 1 << 30),
                                   start + done, start + done)
            if n == 0:
                return
            done += n
        return
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
    while done < length:
        chunk = os.pread(fd_in, min(_COPY_CHUNK, length - done), start + done)
        if not chunk:
            return
        write_sparse(fd_out, chunk, start + done)
        done += len(chunk)


def copy_entry(src: str, dst: str, st: os.stat_result, *,
               times: bool = True) -> SkipKind | None:
    """Copy one non-directory entry (file, symlink, whiteout, fifo) with its metadata;
    what :func:`special_skip` leaves out is not copied, and its kind returned."""
    mode = st.st_mode
    skip = special_skip(mode, st.st_rdev)
    if skip is not None:
        return skip
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
    else:   # pragma: no cover - special_skip covers every other type
        raise ImageError(f"cannot copy {src!r}: unknown file type {stat.S_IFMT(mode):o}")
    copy_meta(src, dst, st, times=times)
    return None


@dataclass(slots=True)
class TreeStats:
    """What a tree holds. ``content_bytes`` sums regular-file sizes per path (what a
    reader sees); ``apparent_bytes`` and ``allocated_bytes`` count each inode once
    (hardlinks share one), apparent by size, allocated by the blocks it really uses
    (holes cost nothing). ``chunked_bytes``: what the files' data takes in a
    chunk-based layer of ``chunk_bytes`` chunks, where a chunk holding any data is
    stored whole (only all-zero chunks are shared): a file with 4 KiB of data every 64
    KiB is 16 times its allocation there."""

    entries: int = 0
    content_bytes: int = 0
    files: int = 0
    apparent_bytes: int = 0
    allocated_bytes: int = 0
    chunked_bytes: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    """Entries :func:`special_skip` leaves out, per kind (not in ``entries``)."""
    skip_paths: list[str] = field(default_factory=list)
    """Their paths relative to the root (for mkfs.erofs ``--exclude-path``)."""


def _chunked_bytes(path: str, st: os.stat_result, chunk_bytes: int) -> int:
    if st.st_blocks * 512 >= st.st_size:           # no holes: its blocks
        return st.st_blocks * 512
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        chunks = 0
        last = -1
        for off, length in data_extents(fd, st.st_size):
            first, end = off // chunk_bytes, (off + length - 1) // chunk_bytes
            chunks += end - max(first, last + 1) + 1 if end > last else 0
            last = max(last, end)
        return chunks * chunk_bytes
    finally:
        os.close(fd)


def tree_stats(root: str, *, chunk_bytes: int = 64 << 10) -> TreeStats:
    """Count entries and regular-file bytes under ``root`` (not following links)."""
    out = TreeStats()
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        out.entries += len(dirnames) + len(filenames)
        for name in filenames:
            st = os.lstat(os.path.join(dirpath, name))
            skip = special_skip(st.st_mode, st.st_rdev)
            if skip is not None:
                out.entries -= 1
                out.skipped[skip] = out.skipped.get(skip, 0) + 1
                out.skip_paths.append(os.path.relpath(os.path.join(dirpath, name), root))
                continue
            if stat.S_ISREG(st.st_mode):
                out.content_bytes += st.st_size
                if st.st_nlink > 1:
                    key = (st.st_dev, st.st_ino)
                    if key in seen:
                        continue
                    seen.add(key)
                out.files += 1
                out.apparent_bytes += st.st_size
                out.allocated_bytes += st.st_blocks * 512
                out.chunked_bytes += _chunked_bytes(os.path.join(dirpath, name), st,
                                                    chunk_bytes)
    return out


def apply_tree(src: str, dst: str, *, keep_whiteouts: bool) -> None:
    """Lay the overlay-format tree ``src`` over ``dst`` as overlayfs would stack them.

    Whiteouts delete what is below; opaque directories replace it; other directories
    merge. ``keep_whiteouts`` keeps the whiteouts and opaque markers in ``dst`` so they
    still hide layers below the merged result; pass False when ``dst`` is the bottom of
    the stack (nothing below to hide).
    """
    # The root too, as overlay shows the highest layer's root: a staging root left at
    # mode 0700 and "now" made every merge of the same layers a different layer.
    root_st = os.lstat(src)
    copy_meta(src, dst, root_st, times=False)
    dirs_done: list[tuple[str, str, os.stat_result]] = [(src, dst, root_st)]
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
