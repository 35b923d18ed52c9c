"""``file:///abs/dir``: a blob store in a local (or NFS) directory.

Objects are plain files under the directory, named by key. Writes go to
``<dir>/.partial/<random>`` first, are fsynced and then renamed into place (and the
directory fsynced), so a reader sees a whole object or none, also after kill -9; a
writer killed mid-copy leaves only a ``.partial`` file, which no key can name
(:func:`~dsec.image.blob.keys.check_key` refuses a leading dot) and which
:meth:`FileBlobStore.sweep_partial` removes once it is older than any live upload.
"""

from __future__ import annotations

import errno
import grp
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from dsec.errors import BlobNotFound, BlobUnavailable, InvalidArgument
from dsec.image.blob.keys import check_key

__all__ = ["FileBlobStore"]

_PARTIAL = ".partial"
_COPY = 1 << 20


def _private_dirs(root: str, path: str, gid: int | None) -> None:
    """Make the directories from ``root`` down to ``path`` that are missing, each 0700
    (or 0750 of group ``gid``) whatever the umask. Directories that exist keep their
    mode: an operator's root (say, one nginx writes too) is the operator's choice."""
    mode = 0o750 if gid is not None else 0o700
    rel = os.path.relpath(path, root)
    todo = [root] + [os.path.join(root, *rel.split(os.sep)[:k + 1])
                     for k in range(0 if rel == "." else len(rel.split(os.sep)))]
    for p in todo:
        try:
            os.mkdir(p, mode)
        except FileExistsError:
            continue
        if gid is not None:
            os.chown(p, -1, gid)
        os.chmod(p, mode)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(eq=False)
class FileBlobStore:
    """A directory of objects. ``root``: absolute path (created when missing)."""

    root: str
    url: str = ""
    clock: Callable[[], float] = field(default=time.time, repr=False)
    group: str | int | None = None
    """Objects are the projects' layers, so they are the service user's only: dirs 0700,
    files 0600 (F10 of red team 17). ``group`` (``file:///dir?group=www-data``): the
    group of a server that serves the directory (nginx), given read access: dirs 0750,
    files 0640 of that group; never other users."""

    def __post_init__(self) -> None:
        if not os.path.isabs(self.root):
            raise InvalidArgument(f"file:// blob store needs an absolute directory, got "
                                  f"{self.root[:200]!r}")
        self.root = os.path.normpath(self.root)
        if not self.url:
            self.url = "file://" + self.root + (
                f"?group={self.group}" if self.group is not None else "")
        self._gid: int | None = None
        if self.group is not None:
            try:
                self._gid = (self.group if isinstance(self.group, int)
                             else grp.getgrnam(self.group).gr_gid)
            except KeyError:
                raise InvalidArgument(f"file:// blob store group {self.group!r}: no such "
                                      "group on this host") from None
        try:
            os.makedirs(os.path.dirname(self.root), exist_ok=True)
            _private_dirs(self.root, self.root, self._gid)
            _private_dirs(self.root, os.path.join(self.root, _PARTIAL), None)
        except OSError as exc:
            raise BlobUnavailable(f"blob store {self.url}: cannot create {self.root}: "
                                  f"{exc.strerror}", store=self.url) from exc

    @classmethod
    def from_url(cls, url: str, **opts: Any) -> FileBlobStore:
        parts = urlsplit(url)
        query = parse_qs(parts.query, keep_blank_values=True)
        if parts.netloc not in ("", "localhost") or set(query) - {"group"} \
                or any(len(v) != 1 for v in query.values()):
            raise InvalidArgument(f"file blob store URL {url[:200]!r}: use file:///abs/dir "
                                  "or file:///abs/dir?group=NAME (no host, no other query)")
        if "group" in query:
            opts.setdefault("group", query["group"][0])
        return cls(root=unquote(parts.path), **opts)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, check_key(key))

    def head(self, key: str) -> int | None:
        try:
            st = os.stat(self._path(key))
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            return None
        except OSError as exc:
            raise BlobUnavailable(f"blob store {self.url}: stat {key}: {exc.strerror}",
                                  store=self.url, key=key) from exc
        return st.st_size

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0:
            raise InvalidArgument(f"range of {key}: offset {offset}, length {length}: "
                                  "negative")
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise BlobNotFound(f"blob store {self.url} has no object {key}",
                               store=self.url, key=key) from exc
        except OSError as exc:
            raise BlobUnavailable(f"blob store {self.url}: open {key}: {exc.strerror}",
                                  store=self.url, key=key) from exc
        try:
            size = os.fstat(fd).st_size
            if offset + length > size:
                raise InvalidArgument(
                    f"range {offset}+{length} of {key} is past its end ({size} bytes)",
                    store=self.url, key=key, size=size)
            out = bytearray()
            while len(out) < length:
                piece = os.pread(fd, length - len(out), offset + len(out))
                if not piece:           # truncated under us: never hand out a short read
                    raise BlobUnavailable(
                        f"blob store {self.url}: {key} ended at {offset + len(out)} while "
                        f"reading {length} bytes at {offset}", store=self.url, key=key)
                out += piece
            return bytes(out)
        except OSError as exc:
            raise BlobUnavailable(f"blob store {self.url}: read {key}: {exc.strerror}",
                                  store=self.url, key=key) from exc
        finally:
            os.close(fd)

    def _publish(self, key: str, write: Callable[[int], None]) -> None:
        dest = self._path(key)
        tmp = os.path.join(self.root, _PARTIAL, secrets.token_hex(8))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            if self._gid is not None:
                os.fchown(fd, -1, self._gid)
                os.fchmod(fd, 0o640)
            try:
                write(fd)
                os.fsync(fd)
            finally:
                os.close(fd)
            parent = os.path.dirname(dest)
            _private_dirs(self.root, parent, self._gid)
            os.replace(tmp, dest)
            _fsync_dir(parent)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            kind = "full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "failed"
            raise BlobUnavailable(f"blob store {self.url}: writing {key} {kind}: "
                                  f"{exc.strerror}", store=self.url, key=key) from exc

    def put_bytes(self, key: str, data: bytes) -> None:
        def write(fd: int) -> None:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        self._publish(key, write)

    def put_file(self, key: str, path: str) -> None:
        try:
            src = open(path, "rb")  # noqa: SIM115 - closed by the `with` below
        except OSError as exc:
            raise InvalidArgument(f"cannot upload {path}: {exc.strerror}") from exc

        def write(fd: int) -> None:
            with os.fdopen(os.dup(fd), "wb") as dst:
                shutil.copyfileobj(src, dst, _COPY)
        with src:
            self._publish(key, write)

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as exc:
            raise BlobUnavailable(f"blob store {self.url}: delete {key}: {exc.strerror}",
                                  store=self.url, key=key) from exc

    def list_keys(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (a ``/``-terminated key prefix), sorted."""
        base = os.path.join(self.root, check_key(prefix.rstrip("/")))
        out: list[str] = []
        for dirpath, _dirs, files in os.walk(base):
            rel = os.path.relpath(dirpath, self.root)
            out.extend(f"{rel}/{f}" for f in files)
        return sorted(out)

    def sweep_partial(self, older_than: float = 3600.0) -> int:
        """Remove uploads abandoned (writer killed) more than ``older_than`` s ago."""
        d = os.path.join(self.root, _PARTIAL)
        n = 0
        for name in os.listdir(d):
            p = os.path.join(d, name)
            try:
                if self.clock() - os.stat(p).st_mtime > older_than:
                    os.unlink(p)
                    n += 1
            except FileNotFoundError:
                continue
        return n
