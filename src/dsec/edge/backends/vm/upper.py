"""Rebuild a guest's overlay upper directory on the host from the agent's ``diff`` tar.

A vm sandbox's changes live in the guest (an ext4 scratch disk the host never mounts: a
filesystem a hostile guest wrote is no input for the host kernel). For a snapshot the
agent streams its upper dir as a tar (agentproto.DiffResult documents the format); this
module unpacks it into a plain directory in overlay's encoding, which
:func:`dsec.image.packdiff.snapshot` then captures like a container's upper dir.

The archive is hostile input. :func:`extract_upper` accepts only regular files,
directories, symlinks (stored, never followed), whiteouts (char device 0:0) and the
``trusted.overlay.opaque`` pax record; every name is relative, with no ``..``, empty or
NUL component; every parent is opened with ``O_NOFOLLOW`` relative to the one above it,
so a symlink member can never redirect a later member; nothing is overwritten (a
duplicate name is refused); the data, entry count and path bytes are bounded. Any
violation raises :class:`~dsec.errors.UnsafeArchive` and the caller removes the dir.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tarfile
from dataclasses import dataclass
from typing import IO

from dsec.errors import QuotaExceeded, UnsafeArchive

__all__ = ["Bounds", "extract_upper", "member_parts"]

_OPAQUE = "SCHILY.xattr.trusted.overlay.opaque"
_ALLOWED_PAX = {"path", "linkpath", "size", "mtime", "atime", "ctime", "uid", "gid",
                "uname", "gname", _OPAQUE}
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class Bounds:
    data_bytes: int              # file data, all members together
    entries: int = 1_000_000
    path_bytes: int = 128 << 20


def member_parts(name: str) -> tuple[str, ...]:
    """The path components of a member name (``()`` for the root itself), or
    UnsafeArchive (pure)."""
    if not name or "\0" in name or name.startswith("/"):
        raise UnsafeArchive(f"diff member name {name[:200]!r} is empty, absolute or holds NUL")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if any(p == ".." for p in parts):
        raise UnsafeArchive(f"diff member name {name[:200]!r} is empty or escapes with '..'")
    if any(len(p.encode()) > 255 for p in parts):
        raise UnsafeArchive(f"diff member name {name[:200]!r} has a component over 255 bytes")
    return parts


def _walk(root_fd: int, parts: tuple[str, ...]) -> int:
    """An fd of the directory ``parts`` below ``root_fd``, creating missing ones (0755);
    never through a symlink."""
    fd = os.dup(root_fd)
    try:
        for p in parts:
            try:
                nfd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                              dir_fd=fd)
            except FileNotFoundError:
                os.mkdir(p, 0o755, dir_fd=fd)
                nfd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                              dir_fd=fd)
            except OSError as exc:
                raise UnsafeArchive(f"diff member parent {'/'.join(parts)[:200]!r} is not a "
                                    f"directory ({exc.strerror})") from None
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def extract_upper(fileobj: IO[bytes], dest: str, bounds: Bounds) -> tuple[int, int]:
    """Unpack the diff tar in ``fileobj`` into the empty directory ``dest``; returns
    (entries, data bytes)."""
    entries = data = path_bytes = 0
    root_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    dirs: list[tuple[tuple[str, ...], int, int, int, float]] = []
    seen: set[tuple[str, ...]] = set()
    try:
        try:
            tf = tarfile.open(fileobj=fileobj, mode="r|", encoding="utf-8",  # noqa: SIM115
                              errors="surrogateescape")
        except tarfile.TarError as exc:
            raise UnsafeArchive(f"diff is not a tar archive: {exc}") from None
        with tf:
            while True:
                try:
                    m = tf.next()
                except tarfile.TarError as exc:
                    raise UnsafeArchive(f"diff tar is corrupt: {exc}") from None
                if m is None:
                    break
                entries += 1
                path_bytes += len(m.name.encode(errors="surrogateescape"))
                if entries > bounds.entries or path_bytes > bounds.path_bytes:
                    raise QuotaExceeded(
                        f"the sandbox's changes hold more than {bounds.entries} entries or "
                        f"{bounds.path_bytes} bytes of paths", resource="snapshot_entries")
                bad_pax = set(m.pax_headers) - _ALLOWED_PAX
                if bad_pax:
                    raise UnsafeArchive(f"diff member {m.name[:200]!r} has pax records "
                                        f"{sorted(bad_pax)[:5]} this format does not use")
                parts = member_parts(m.name)
                if parts in seen:
                    raise UnsafeArchive(f"diff member {m.name[:200]!r} appears twice")
                seen.add(parts)
                mode = m.mode & 0o7777
                if not parts and not m.isdir():
                    raise UnsafeArchive(f"diff member {m.name[:200]!r} names the root but "
                                        "is not a directory")
                if m.isdir():
                    fd = _walk(root_fd, parts)
                    try:
                        if m.pax_headers.get(_OPAQUE) == "y":
                            os.setxattr(fd, "trusted.overlay.opaque", b"y")
                    finally:
                        os.close(fd)
                    dirs.append((parts, mode, m.uid, m.gid, m.mtime))
                    continue
                if _OPAQUE in m.pax_headers:
                    raise UnsafeArchive(f"diff member {m.name[:200]!r}: opaque on a non-dir")
                pfd = _walk(root_fd, parts[:-1])
                name = parts[-1]
                try:
                    if m.isreg():
                        data += m.size
                        if data > bounds.data_bytes:
                            raise QuotaExceeded(
                                f"the sandbox's changes hold more than {bounds.data_bytes} "
                                "bytes of file data", resource="snapshot_bytes",
                                limit=bounds.data_bytes)
                        src = tf.extractfile(m)
                        assert src is not None
                        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                     | os.O_CLOEXEC, 0o600, dir_fd=pfd)
                        try:
                            left = m.size
                            while left:
                                buf = src.read(min(_CHUNK, left))
                                if not buf:
                                    raise UnsafeArchive(f"diff member {m.name[:200]!r} is "
                                                        "cut short")
                                os.write(fd, buf)
                                left -= len(buf)
                            os.fchown(fd, m.uid, m.gid)
                            os.fchmod(fd, mode)
                        finally:
                            os.close(fd)
                    elif m.issym():
                        if not m.linkname or "\0" in m.linkname or len(m.linkname) > 4095:
                            raise UnsafeArchive(f"diff symlink {m.name[:200]!r} has a bad "
                                                "target")
                        os.symlink(m.linkname, name, dir_fd=pfd)
                        os.chown(name, m.uid, m.gid, dir_fd=pfd, follow_symlinks=False)
                    elif m.ischr() and m.devmajor == 0 and m.devminor == 0:
                        os.mknod(name, stat.S_IFCHR, os.makedev(0, 0), dir_fd=pfd)
                    else:
                        raise UnsafeArchive(
                            f"diff member {m.name[:200]!r} has type {m.type!r}: only files, "
                            "directories, symlinks and whiteouts (char 0:0) are accepted")
                    with contextlib.suppress(OSError):
                        os.utime(name, (m.mtime, m.mtime), dir_fd=pfd, follow_symlinks=False)
                except FileExistsError:
                    raise UnsafeArchive(f"diff member {m.name[:200]!r} already exists (a "
                                        "directory made for an earlier member?)") from None
                finally:
                    os.close(pfd)
        # directories last: their mode may forbid writing, their mtime moved on each child
        for parts, mode, uid, gid, mtime in sorted(dirs, key=lambda d: -len(d[0])):
            fd = _walk(root_fd, parts)
            try:
                os.fchown(fd, uid, gid)
                os.fchmod(fd, mode)
                os.utime(fd, (mtime, mtime))
            finally:
                os.close(fd)
    finally:
        os.close(root_fd)
    return entries, data
