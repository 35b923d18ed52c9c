"""Safe extraction of (possibly hostile) tar streams into a staging directory.

Image tarballs come from users and registries, so every member is checked before it
touches the disk: no absolute names, no ``..``, no device nodes, no relative symlink
climbing out of the root, no member written through a symlink (the classic
"symlink then file under it" escape), no member or archive larger than the limits.
Anything else raises :class:`~dsec.errors.UnsafeArchive` naming the member; the caller
owns the staging directory and removes it on failure.

Absolute symlink targets are accepted: inside a sandbox they resolve against the
sandbox root (``/bin/sh -> /bin/busybox``), and nothing here ever follows a link.

With ``oci_whiteouts=True`` the OCI encoding of deletions is translated into overlayfs'
own: ``dir/.wh.name`` becomes a character device 0/0 at ``dir/name`` and
``dir/.wh..wh..opq`` sets ``trusted.overlay.opaque=y`` on ``dir``.

Holes: extraction leaves whole zero blocks unwritten (a sparse member, or a plain one
full of zeros, costs what its data costs), and :func:`pack_tree` writes files with holes
as GNU PAX 1.0 sparse members (which Python's tarfile and GNU tar read), so a directory
holding a 1 GiB sparse file uploads and stores as its data, not as 1 GiB of zeros. The
limits still count a member at its full size: that is what mkfs.erofs reads.
"""

from __future__ import annotations

import errno
import io
import os
import posixpath
import stat
import tarfile
from dataclasses import dataclass, field
from typing import IO

from dsec.errors import UnsafeArchive
from dsec.image.tree import (
    data_extents,
    make_whiteout,
    remove_path,
    set_opaque,
    special_skip,
    write_sparse,
)

__all__ = ["DEFAULT_LIMITS", "ExtractLimits", "ExtractStats", "check_pax", "extract_tar",
           "open_tar", "pack_tree"]

_WH = ".wh."
_OPQ = ".wh..wh..opq"
_XATTR_PAX = "SCHILY.xattr."
_CHUNK = 1 << 20
#: extension headers (pax, GNU long name/link) are refused above these sizes before
#: tarfile reads them whole: a path is at most max_path_bytes (4 KiB), a pax header holds
#: a few of those and the xattrs of one file (64 KiB each at most on Linux)
MAX_LONGNAME_BYTES = 64 << 10
MAX_PAX_BYTES = 1 << 20
#: global pax headers of one archive, all together (tarfile keeps them for good)
MAX_GLOBAL_PAX_BYTES = 1 << 20
#: a run of ASCII digits in a pax header longer than this is refused (see _BoundedTarInfo)
_MAX_DIGIT_RUN = 64


class _Replay:
    """``inner`` with ``head`` (already read from it) put back in front: what a
    TarInfo method reads after a check looked at the bytes first."""

    def __init__(self, head: bytes, inner: IO[bytes]) -> None:
        self._head = head
        self._inner = inner

    def read(self, n: int = -1) -> bytes:
        if not self._head:
            return self._inner.read(n)
        if n < 0:
            out, self._head = self._head, b""
            return out + self._inner.read()
        out, self._head = self._head[:n], self._head[n:]
        return out if len(out) == n else out + self._inner.read(n - len(out))

    def tell(self) -> int:
        return self._inner.tell() - len(self._head)

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


def check_pax(buf: bytes) -> None:
    """Refuse a pax header tarfile would parse slowly or wrongly (pure, linear): records
    must be well formed (``LEN KEY=VALUE\\n`` back to back, then NUL padding), no run of
    digits may exceed _MAX_DIGIT_RUN and ``hdrcharset=`` may appear only as a record's
    key. Python before 3.11.10 searches pax headers with ``\\d+ hdrcharset=`` (CVE-2024-6232),
    quadratic in digit runs and in such substrings, inside ``re`` holding the GIL: one
    header of a hostile image stopped every thread of the process for minutes."""
    pos, end = 0, len(buf)
    while pos < end:
        if buf[pos] == 0:
            if buf[pos:].strip(b"\0"):
                raise UnsafeArchive("tar pax header has data after its padding")
            break
        sp = buf.find(b" ", pos, min(end, pos + 9))
        if sp < 0 or not buf[pos:sp].isdigit():
            raise UnsafeArchive("tar pax record does not start with its length")
        rec_end = pos + int(buf[pos:sp])
        eq = buf.find(b"=", sp + 1, rec_end)
        if rec_end > end or rec_end <= sp + 2 or buf[rec_end - 1] != 0x0A or eq < 0:
            raise UnsafeArchive(f"tar pax record at byte {pos} is malformed")
        if buf.find(b"hdrcharset=", sp + 2, rec_end) >= 0:
            raise UnsafeArchive("tar pax record holds 'hdrcharset=' inside it")
        pos = rec_end
    run = 0
    for c in buf:       # bytes iterate as ints; ~30 ns a byte, on at most MAX_PAX_BYTES
        if 48 <= c <= 57:
            run += 1
            if run > _MAX_DIGIT_RUN:
                raise UnsafeArchive(f"tar pax header holds a run of more than "
                                    f"{_MAX_DIGIT_RUN} digits (refused: Python's tarfile "
                                    "parses such headers in quadratic time)")
        else:
            run = 0


class _BoundedTarInfo(tarfile.TarInfo):
    """TarInfo that bounds extension headers before tarfile reads them (see
    MAX_PAX_BYTES) and checks pax headers with :func:`check_pax` first. Errors are
    UnsafeArchive (not a tarfile HeaderError, which tarfile may take for the end of the
    archive)."""

    def _proc_member(self, tarfile: tarfile.TarFile) -> tarfile.TarInfo:
        t = self.type
        if self.size < 0:
            raise UnsafeArchive(f"tar member {self.name[:200]!r} has a negative size")
        if t in (tarfile_mod.GNUTYPE_LONGNAME, tarfile_mod.GNUTYPE_LONGLINK):
            if self.size > MAX_LONGNAME_BYTES:
                raise UnsafeArchive(f"tar GNU long name of {self.size} bytes (at most "
                                    f"{MAX_LONGNAME_BYTES})")
        elif t in (tarfile_mod.XHDTYPE, tarfile_mod.XGLTYPE, tarfile_mod.SOLARIS_XHDTYPE):
            if self.size > MAX_PAX_BYTES:
                raise UnsafeArchive(f"tar pax header of {self.size} bytes (at most "
                                    f"{MAX_PAX_BYTES})")
            if t == tarfile_mod.XGLTYPE:
                total = getattr(tarfile, "_dsec_global", 0) + self.size
                if total > MAX_GLOBAL_PAX_BYTES:
                    raise UnsafeArchive(f"tar global pax headers exceed "
                                        f"{MAX_GLOBAL_PAX_BYTES} bytes")
                tarfile._dsec_global = total  # type: ignore[attr-defined]
            inner = tarfile.fileobj
            assert inner is not None
            buf = inner.read(self._block(self.size))  # type: ignore[attr-defined]
            check_pax(buf[:self.size])
            tarfile.fileobj = _Replay(buf, inner)  # type: ignore[arg-type,assignment]
            try:
                return super()._proc_member(tarfile)  # type: ignore[misc,no-any-return]
            finally:
                tarfile.fileobj = inner
        return super()._proc_member(tarfile)  # type: ignore[misc,no-any-return]


tarfile_mod = tarfile


def open_tar(fileobj: IO[bytes] | None = None, mode: str = "r|*", *,
             name: str | None = None) -> tarfile.TarFile:
    """``tarfile.open`` for hostile archives: extension headers bounded and pax headers
    checked before tarfile parses them (:class:`_BoundedTarInfo`)."""
    return tarfile.open(name=name, fileobj=fileobj, mode=mode,  # type: ignore[call-overload,no-any-return]
                        tarinfo=_BoundedTarInfo)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExtractLimits:
    """Ceilings that turn a decompression bomb into an error instead of a full disk."""

    max_member_bytes: int = 16 * 2**30      # one file; larger is refused
    max_total_bytes: int = 64 * 2**30       # sum of regular-file sizes in the archive
    max_members: int = 5_000_000
    max_path_bytes: int = 4096


DEFAULT_LIMITS = ExtractLimits()


@dataclass(slots=True)
class ExtractStats:
    members: int = 0
    content_bytes: int = 0
    whiteouts: int = 0
    opaque_dirs: int = 0
    _dir_meta: list[tuple[str, tarfile.TarInfo]] = field(default_factory=list)
    _implied: list[str] = field(default_factory=list)
    """Directories made without a member of their own (the root without ``./``, parents
    of members listed before them or never): they get :attr:`_newest_ns` as mtime."""
    _newest_ns: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    """Members :func:`dsec.image.tree.special_skip` leaves out (device nodes other than
    whiteouts), per kind."""


def _clean_name(raw: str, what: str) -> str:
    """Normalise a member name to a relative path; refuse escapes."""
    if "\0" in raw:
        raise UnsafeArchive(f"tar {what} {raw!r} contains a NUL byte", member=raw)
    if raw.startswith("/"):
        raise UnsafeArchive(f"tar {what} {raw!r} is an absolute path; image archives must "
                            "use relative names", member=raw)
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeArchive(f"tar {what} {raw!r} contains '..'", member=raw)
    return "/".join(parts)


def _ensure_parent(root: str, rel: str, member: str,
                   implied: list[str] | None = None) -> str:
    """Create the parent directories of ``rel`` under ``root`` without following links
    (each one made is appended to ``implied``)."""
    parent = root
    for comp in rel.split("/")[:-1]:
        parent = os.path.join(parent, comp)
        try:
            st = os.lstat(parent)
        except FileNotFoundError:
            os.mkdir(parent, 0o755)
            if implied is not None:
                implied.append(parent)
            continue
        if stat.S_ISLNK(st.st_mode):
            raise UnsafeArchive(
                f"tar member {member!r} would be written through the symlink "
                f"{os.path.relpath(parent, root)!r}", member=member)
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeArchive(f"tar member {member!r} needs {os.path.relpath(parent, root)!r} "
                                "to be a directory but it is a file", member=member)
    return os.path.join(root, rel)


def _symlink_escapes(rel: str, target: str) -> bool:
    if target.startswith("/"):
        return False
    depth = len(rel.split("/")) - 1
    for comp in target.split("/"):
        if comp == "..":
            depth -= 1
            if depth < 0:
                return True
        elif comp not in ("", "."):
            depth += 1
    return False


def _set_meta(path: str, ti: tarfile.TarInfo, *, link: bool, is_root: bool) -> None:
    if is_root:
        os.lchown(path, ti.uid, ti.gid)
    if not link:
        os.chmod(path, ti.mode & 0o7777)
        # Sorted: mkfs.erofs keeps the staged inode's xattr order (reproducible layers).
        for key, value in sorted(ti.pax_headers.items()):
            if key.startswith(_XATTR_PAX):
                name = key[len(_XATTR_PAX):]
                # overlay's private xattrs in an archive could forge whiteouts/redirects.
                if name.startswith("trusted.overlay."):
                    continue
                try:
                    os.setxattr(path, name, value.encode("utf-8", "surrogateescape"),
                                follow_symlinks=False)
                except OSError as exc:
                    if exc.errno not in (errno.ENOTSUP, errno.EPERM):
                        raise
    os.utime(path, ns=(int(ti.mtime * 1e9),) * 2, follow_symlinks=False)


def extract_tar(fileobj: IO[bytes], dest: str, *, limits: ExtractLimits = DEFAULT_LIMITS,
                oci_whiteouts: bool = False) -> ExtractStats:
    """Extract the tar stream ``fileobj`` (plain, gzip, bzip2 or xz) into ``dest``."""
    is_root = os.geteuid() == 0
    stats = ExtractStats()
    try:
        # Opened apart from `with tf:` below so a bad stream is told apart from a bad member.
        tf = open_tar(fileobj, "r|*")
    except tarfile.TarError as exc:
        raise UnsafeArchive(f"not a readable tar stream: {exc}") from exc
    try:
        with tf:
            for ti in tf:
                _extract_member(tf, ti, dest, limits, stats, oci_whiteouts, is_root)
    except tarfile.TarError as exc:
        raise UnsafeArchive(f"corrupt tar stream after {stats.members} members: {exc}") from exc
    except EOFError as exc:
        raise UnsafeArchive(f"truncated tar stream after {stats.members} members") from exc
    explicit = {path for path, _ in stats._dir_meta}
    for path, ti in reversed(stats._dir_meta):
        _set_meta(path, ti, link=False, is_root=is_root)
    # What the archive does not date gets a time from its content, not "now": the same
    # archive must stage the same tree (reproducible layers, dsec.image.erofs).
    for path in [*stats._implied, dest]:
        if path not in explicit:
            os.utime(path, ns=(stats._newest_ns,) * 2, follow_symlinks=False)
    stats._dir_meta.clear()
    stats._implied.clear()
    return stats


def _extract_member(tf: tarfile.TarFile, ti: tarfile.TarInfo, dest: str,
                    limits: ExtractLimits, stats: ExtractStats, oci: bool,
                    is_root: bool) -> None:
    stats.members += 1
    if stats.members > limits.max_members:
        raise UnsafeArchive(f"tar has more than {limits.max_members} members")
    if len(ti.name.encode("utf-8", "surrogateescape")) > limits.max_path_bytes:
        raise UnsafeArchive(f"tar member name of {len(ti.name)} chars exceeds "
                            f"{limits.max_path_bytes} bytes", member=ti.name[:200])
    rel = _clean_name(ti.name, "member")
    stats._newest_ns = max(stats._newest_ns, int(ti.mtime * 1e9))
    if ti.ischr() or ti.isblk():
        # The one rule (tree.special_skip): a 0/0 character device is a whiteout and
        # kept, every other device node is left out and counted.
        skip = special_skip(stat.S_IFCHR if ti.ischr() else stat.S_IFBLK,
                            os.makedev(ti.devmajor, ti.devminor))
        if skip is not None:
            stats.skipped[skip] = stats.skipped.get(skip, 0) + 1
            return
    if ti.isreg() and ti.size > limits.max_member_bytes:
        raise UnsafeArchive(f"tar member {ti.name!r} is {ti.size} bytes, over the limit of "
                            f"{limits.max_member_bytes}", member=ti.name)
    if not rel:                                 # "./" itself: metadata of the root
        if ti.isdir():
            stats._dir_meta.append((dest, ti))
        return
    base = posixpath.basename(rel)
    if oci and base.startswith(_WH):
        parent_rel = posixpath.dirname(rel)
        if parent_rel:
            d = _ensure_parent(dest, parent_rel + "/x", ti.name, stats._implied)
            d = os.path.dirname(d)
            if not os.path.lexists(d):
                os.mkdir(d, 0o755)
                stats._implied.append(d)
        else:
            d = dest
        if base == _OPQ:
            set_opaque(d)
            stats.opaque_dirs += 1
        else:
            hidden = base[len(_WH):]
            if hidden in ("", ".", "..") or "/" in hidden:
                raise UnsafeArchive(f"tar whiteout {ti.name!r} names no entry", member=ti.name)
            target = os.path.join(d, hidden)
            remove_path(target)
            make_whiteout(target)
            stats.whiteouts += 1
        return
    path = _ensure_parent(dest, rel, ti.name, stats._implied)
    if ti.isdir():
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode):
                remove_path(path)
                os.mkdir(path, 0o700)
        except FileNotFoundError:
            os.mkdir(path, 0o700)
        stats._dir_meta.append((path, ti))
        return
    remove_path(path)
    if ti.isreg():
        stats.content_bytes += ti.size
        if stats.content_bytes > limits.max_total_bytes:
            raise UnsafeArchive(f"tar content exceeds {limits.max_total_bytes} bytes at member "
                                f"{ti.name!r}", member=ti.name)
        src = tf.extractfile(ti)
        assert src is not None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            done = 0
            while done < ti.size:
                chunk = src.read(min(_CHUNK, ti.size - done))
                if not chunk:
                    raise UnsafeArchive(f"tar member {ti.name!r} is truncated", member=ti.name)
                write_sparse(fd, chunk, done)
                done += len(chunk)
            os.ftruncate(fd, ti.size)
        finally:
            os.close(fd)
        _set_meta(path, ti, link=False, is_root=is_root)
    elif ti.issym():
        if _symlink_escapes(rel, ti.linkname):
            raise UnsafeArchive(f"tar symlink {ti.name!r} -> {ti.linkname!r} points outside "
                                "the image root", member=ti.name)
        os.symlink(ti.linkname, path)
        _set_meta(path, ti, link=True, is_root=is_root)
    elif ti.islnk():
        target_rel = _clean_name(ti.linkname, "hardlink target")
        target = _ensure_parent(dest, target_rel, ti.name)
        try:
            tst = os.lstat(target)
        except FileNotFoundError:
            raise UnsafeArchive(f"tar hardlink {ti.name!r} -> {ti.linkname!r}: target is not "
                                "in the archive before it", member=ti.name) from None
        if stat.S_ISDIR(tst.st_mode):
            raise UnsafeArchive(f"tar hardlink {ti.name!r} points at a directory",
                                member=ti.name)
        os.link(target, path, follow_symlinks=False)
    elif ti.isfifo():
        os.mkfifo(path, 0o600)
        _set_meta(path, ti, link=False, is_root=is_root)
    elif ti.ischr():                            # a whiteout (special_skip kept it)
        make_whiteout(path)
        _set_meta(path, ti, link=False, is_root=is_root)
    else:
        raise UnsafeArchive(f"tar member {ti.name!r} has unsupported type {ti.type!r}",
                            member=ti.name)


# A file is packed as a sparse member when its holes save at least this much.
_SPARSE_MIN_SAVING = 1 << 20
# ustar's octal size field ends at 8 GiB; beyond it tarfile adds a pax "size" record that
# would override the sparse member's real size, so such members are packed plainly.
_USTAR_MAX_SIZE = 8 << 30


def pack_tree(root: str, out: IO[bytes]) -> dict[str, int]:
    """Tar ``root``'s contents (names relative to it, owners and modes kept, PAX format),
    writing files with holes as GNU PAX 1.0 sparse members: only their data travels.
    Special files go by the one rule (:func:`dsec.image.tree.special_skip`): what it
    skips is left out here and counted (the result), so the upload holds what the layer
    will."""
    skipped: dict[str, int] = {}
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        # The root's own mode, owner and time travel too ("./", as `tar -C root -c .`):
        # without it the server's staging dir stood in for them, and the same tree gave
        # another layer through the SDK than through `dsec image build`.
        tar.addfile(tar.gettarinfo(root, arcname="."))
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(dirnames) + sorted(filenames):
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                skip = special_skip(st.st_mode, st.st_rdev)
                if skip is not None:
                    skipped[skip] = skipped.get(skip, 0) + 1
                    continue
                arc = os.path.relpath(path, root)
                ti = tar.gettarinfo(path, arcname=arc)
                if ti.isreg():
                    _add_file(tar, ti, path)
                else:
                    tar.addfile(ti)
    return skipped


def _add_file(tar: tarfile.TarFile, ti: tarfile.TarInfo, path: str) -> None:
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_size - st.st_blocks * 512 < _SPARSE_MIN_SAVING:
            tar.addfile(ti, f)
            return
        extents = list(data_extents(f.fileno(), st.st_size))
        table = [f"{len(extents) + 1}\n"]
        table += [f"{off}\n{length}\n" for off, length in extents]
        table.append(f"{st.st_size}\n0\n")     # GNU tar ends the map at the real size
        head = "".join(table).encode()
        head += bytes(-len(head) % tarfile.BLOCKSIZE)
        stored = len(head) + sum(length for _, length in extents)
        if stored >= _USTAR_MAX_SIZE:
            tar.addfile(ti, f)
            return
        ti.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0",
                          "GNU.sparse.name": ti.name, "GNU.sparse.realsize": str(st.st_size)}
        ti.name = f"GNUSparseFile.0/{os.path.basename(ti.name)[:80]}"
        ti.size = stored
        tar.addfile(ti, _SparseStream(f.fileno(), head, extents))


class _SparseStream(io.RawIOBase):
    """The data of a sparse member: the map block, then each data run in order."""

    def __init__(self, fd: int, head: bytes, extents: list[tuple[int, int]]) -> None:
        self._fd = fd
        self._head = head
        self._extents = extents
        self._i = 0
        self._pos = 0      # offset within the current run

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        """Exactly ``n`` bytes until the end (tarfile's copy treats a short read as a
        truncated file)."""
        if n < 0:
            n = 1 << 62
        out = bytearray(self._head[:n])
        self._head = self._head[len(out):]
        while len(out) < n and self._i < len(self._extents):
            off, length = self._extents[self._i]
            if self._pos >= length:
                self._i += 1
                self._pos = 0
                continue
            data = os.pread(self._fd, min(n - len(out), length - self._pos), off + self._pos)
            if not data:
                raise UnsafeArchive(f"file shrank while it was packed (run at {off})")
            self._pos += len(data)
            out += data
        return bytes(out)
