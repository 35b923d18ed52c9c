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

The tar is read by :class:`_TarReader`, not the stdlib ``tarfile``: that one reads a pax
or GNU long-name header whole before anything here can bound it (a guest's 1 GiB header
is 2 GiB of edge memory), and before 3.11.10 searched pax headers with a quadratic regex
holding the GIL (CVE-2024-6232: the edge's event loop stops). The reader knows only what
the agent writes (POSIX ustar blocks, pax ``x`` headers with the records in
``_ALLOWED_PAX``), checks each header's checksum, bounds a pax header's size before
reading it and parses its records by hand, in linear time.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from dataclasses import dataclass
from typing import IO

from dsec.errors import QuotaExceeded, UnsafeArchive

__all__ = ["MAX_PAX_BYTES", "Bounds", "extract_upper", "member_parts", "parse_pax"]

_OPAQUE = "SCHILY.xattr.trusted.overlay.opaque"
_ALLOWED_PAX = {"path", "linkpath", "size", "mtime", "atime", "ctime", "uid", "gid",
                "uname", "gname", _OPAQUE}
_CHUNK = 1 << 20
_BLOCK = 512
#: a pax header's size, refused beyond before it is read: two 4 KiB paths and a few
#: numbers are what the agent writes
MAX_PAX_BYTES = 16 << 10
_REG, _DIR, _SYM, _CHR, _PAX = b"0", b"5", b"2", b"3", b"x"


@dataclass(slots=True)
class _Member:
    name: str
    type: bytes
    mode: int
    uid: int
    gid: int
    size: int
    mtime: float
    linkname: str
    devmajor: int
    devminor: int
    opaque: str | None = None

    def isdir(self) -> bool:
        return self.type == _DIR


def _octal(field: bytes, what: str) -> int:
    """A ustar numeric field: octal digits, NUL/space padded (pure)."""
    digits = field.strip(b" \0")
    if not digits:
        return 0
    if len(digits) > 12 or digits.strip(b"01234567"):
        raise UnsafeArchive(f"diff tar header field {what} is not octal: {field[:16]!r}")
    return int(digits, 8)


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def parse_pax(buf: bytes) -> dict[str, str]:
    """The records (``LEN KEY=VALUE\\n``) of a pax extended header, or UnsafeArchive
    (pure; linear in ``len(buf)``, no regex). Only keys in ``_ALLOWED_PAX`` pass."""
    out: dict[str, str] = {}
    pos, end = 0, len(buf)
    while pos < end:
        if buf[pos] == 0:                     # the block's padding
            if buf[pos:].strip(b"\0"):
                raise UnsafeArchive("diff tar pax header has data after its padding")
            break
        sp = buf.find(b" ", pos, min(end, pos + 8))
        if sp < 0 or not buf[pos:sp].isdigit():
            raise UnsafeArchive("diff tar pax record does not start with its length")
        n = int(buf[pos:sp])
        rec_end = pos + n
        if n <= sp - pos + 3 or rec_end > end or buf[rec_end - 1] != 0x0A:
            raise UnsafeArchive(f"diff tar pax record of length {n} at {pos} is malformed")
        eq = buf.find(b"=", sp + 1, rec_end)
        if eq < 0:
            raise UnsafeArchive("diff tar pax record has no '='")
        key = buf[sp + 1:eq].decode("utf-8", "surrogateescape")
        if key not in _ALLOWED_PAX:
            raise UnsafeArchive(f"diff tar has pax record {key[:100]!r}, which this "
                                "format does not use")
        out[key] = buf[eq + 1:rec_end - 1].decode("utf-8", "surrogateescape")
        pos = rec_end
    return out


class _TarReader:
    """The members of a diff tar, one at a time (see the module docstring)."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self._left = 0          # data bytes of the current member not read yet
        self._pad = 0

    def _exact(self, n: int, what: str) -> bytes:
        buf = self._f.read(n)
        if len(buf) != n:
            raise UnsafeArchive(f"diff tar is cut short in {what}")
        return buf

    def _header(self) -> bytes | None:
        self.skip()
        blk = self._f.read(_BLOCK)
        if not blk or blk == bytes(_BLOCK):
            return None                     # end of archive (or of the stream)
        if len(blk) != _BLOCK:
            raise UnsafeArchive("diff tar is cut short in a header")
        if blk[257:265] != b"ustar\x0000":
            raise UnsafeArchive("diff is not a POSIX ustar archive (bad magic): the agent "
                                "writes ustar with pax headers only")
        want = _octal(blk[148:156], "chksum")
        if want != sum(blk[:148]) + 8 * 32 + sum(blk[156:]):
            raise UnsafeArchive("diff tar header checksum mismatch")
        return blk

    def next(self) -> _Member | None:
        pax: dict[str, str] = {}
        blk = self._header()
        if blk is not None and blk[156:157] == _PAX:
            size = _octal(blk[124:136], "size")
            if size > MAX_PAX_BYTES:
                raise UnsafeArchive(f"diff tar pax header of {size} bytes (at most "
                                    f"{MAX_PAX_BYTES})")
            pax = parse_pax(self._exact(size + (-size % _BLOCK), "a pax header"))
            blk = self._header()
            if blk is None:
                raise UnsafeArchive("diff tar ends after a pax header")
            if blk[156:157] == _PAX:
                raise UnsafeArchive("diff tar has two pax headers in a row")
        if blk is None:
            return None
        name = _text(blk[0:100])
        prefix = _text(blk[345:500])
        if prefix:
            name = prefix + "/" + name
        t = blk[156:157]
        m = _Member(name=pax.get("path", name), type=_REG if t == b"\0" else t,
                    mode=_octal(blk[100:108], "mode"), uid=_octal(blk[108:116], "uid"),
                    gid=_octal(blk[116:124], "gid"), size=_octal(blk[124:136], "size"),
                    mtime=_octal(blk[136:148], "mtime"),
                    linkname=pax.get("linkpath", _text(blk[157:257])),
                    devmajor=_octal(blk[329:337], "devmajor"),
                    devminor=_octal(blk[337:345], "devminor"),
                    opaque=pax.get(_OPAQUE))
        try:
            for key in ("size", "uid", "gid"):
                if key in pax:
                    v = pax[key]
                    if not v.isdigit() or len(v) > 20:
                        raise ValueError(v)
                    setattr(m, key, int(v))
            if "mtime" in pax:
                v = pax["mtime"]
                if len(v) > 40:
                    raise ValueError(v)
                m.mtime = float(v)
        except ValueError:
            raise UnsafeArchive(f"diff member {m.name[:200]!r} has a bad numeric pax "
                                "record") from None
        self._left = m.size if m.type == _REG else 0
        self._pad = -self._left % _BLOCK
        return m

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes of the current member's data."""
        buf = self._f.read(min(n, self._left))
        self._left -= len(buf)
        return buf

    def skip(self) -> None:
        while self._left:
            if not self.read(_CHUNK):
                raise UnsafeArchive("diff tar is cut short in a member's data")
        if self._pad:
            self._exact(self._pad, "padding")
            self._pad = 0


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
    seen: set[bytes] = set()        # digests of the names: 16 bytes each, not a tuple
    try:
        tf = _TarReader(fileobj)
        while True:
            m = tf.next()
            if m is None:
                break
            entries += 1
            path_bytes += len(m.name.encode(errors="surrogateescape"))
            if entries > bounds.entries or path_bytes > bounds.path_bytes:
                raise QuotaExceeded(
                    f"the sandbox's changes hold more than {bounds.entries} entries or "
                    f"{bounds.path_bytes} bytes of paths", resource="snapshot_entries")
            parts = member_parts(m.name)
            key = hashlib.blake2b("/".join(parts).encode("utf-8", "surrogateescape"),
                                  digest_size=16).digest()
            if key in seen:
                raise UnsafeArchive(f"diff member {m.name[:200]!r} appears twice")
            seen.add(key)
            mode = m.mode & 0o7777
            if not parts and not m.isdir():
                raise UnsafeArchive(f"diff member {m.name[:200]!r} names the root but "
                                    "is not a directory")
            if m.isdir():
                fd = _walk(root_fd, parts)
                try:
                    if m.opaque == "y":
                        os.setxattr(fd, "trusted.overlay.opaque", b"y")
                finally:
                    os.close(fd)
                dirs.append((parts, mode, m.uid, m.gid, m.mtime))
                continue
            if m.opaque is not None:
                raise UnsafeArchive(f"diff member {m.name[:200]!r}: opaque on a non-dir")
            pfd = _walk(root_fd, parts[:-1])
            name = parts[-1]
            try:
                if m.type == _REG:
                    data += m.size
                    if data > bounds.data_bytes:
                        raise QuotaExceeded(
                            f"the sandbox's changes hold more than {bounds.data_bytes} "
                            "bytes of file data", resource="snapshot_bytes",
                            limit=bounds.data_bytes)
                    src = tf
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
                elif m.type == _SYM:
                    if not m.linkname or "\0" in m.linkname or len(m.linkname) > 4095:
                        raise UnsafeArchive(f"diff symlink {m.name[:200]!r} has a bad "
                                            "target")
                    os.symlink(m.linkname, name, dir_fd=pfd)
                    os.chown(name, m.uid, m.gid, dir_fd=pfd, follow_symlinks=False)
                elif m.type == _CHR and m.devmajor == 0 and m.devminor == 0:
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
