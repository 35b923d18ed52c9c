"""mount(2) through ctypes and the node's layer mount cache.

util-linux ``mount`` wraps a regular-file source in a loop device (~4 ms); this kernel
(CONFIG_EROFS_FS_BACKED_BY_FILE) mounts EROFS straight from the file in ~0.05 ms, so we
call mount(2) ourselves. Each layer is mounted once per node at a short path
(``<root>/<12 hex>``: short paths keep many lowerdirs inside overlay's one-page option
string), shared by every sandbox, reference-counted and unmounted when the last user
releases it. The file's sha256 is verified before its first mount on this node, so a
corrupt or truncated layer raises :class:`~dsec.errors.CorruptLayer` and mounts nothing.
A layer this node serves lazily (``lazy=``, :class:`dsec.edge.lazy.layers.LazyLayers`) is
mounted from its FUSE file instead, and checked chunk by chunk as it is read.

Crashes: refcounts live in the process, so a process killed with -9 leaves its mount root
(``/run/dsec/m*``) mounted. Each root has an owner file beside it (``<root>.owner``: pid +
start time, so pid reuse cannot fool it); a new
cache reclaims the roots of owners that are gone: it detaches (``MNT_DETACH``) every mount
below them and removes the directories. Lazily, because sandboxes left running for
re-adoption may still use those layers: overlayfs holds its own private clone of each
lower layer, so a running sandbox keeps reading its files after the host-side mount is
detached (tested: an adopted sandbox reads its image after the reclaim), and the kernel
frees the superblock when the last overlay goes. A re-adopted sandbox takes its layers'
references in the new cache, so new sandboxes share the same (re-mounted) layers.
Roots without an owner file (made before it existed, or being created right now) are
left alone: there is no telling whether their owner still runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import stat
import tempfile
import threading
from dataclasses import dataclass
from typing import Protocol, Self

from dsec.errors import BlobUnavailable, CorruptLayer, ImageError, InUse, InvalidArgument
from dsec.image.erofs import hash_file
from dsec.image.manifest import LayerManifest, short_digest
from dsec.ownership import claim, disown, owner_alive
from dsec.rmtree import unescape_mountinfo

__all__ = ["MS_RDONLY", "LazySource", "MountCache", "is_mountpoint", "mounts_below", "reclaim_dead_roots",
           "sys_mount", "sys_umount"]

RUN_ROOT = "/run/dsec"

MS_RDONLY = 0x1
MNT_DETACH = 0x2
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def sys_mount(source: str, target: str, fstype: str, flags: int = 0,
              data: str | None = None) -> None:
    """mount(2); raises OSError with the kernel's errno."""
    rc = _libc.mount(source.encode(), target.encode(), fstype.encode(), flags,
                     data.encode() if data is not None else None)
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {fstype} {source} on {target}: {os.strerror(e)}")


def sys_umount(target: str, *, detach: bool = False) -> None:
    rc = _libc.umount2(target.encode(), MNT_DETACH if detach else 0)
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"umount {target}: {os.strerror(e)}")


def is_mountpoint(path: str) -> bool:
    try:
        return os.path.ismount(path)
    except OSError:
        return False


def mounts_below(mountinfo: str, prefix: str) -> list[str]:
    """Mount points strictly below directory ``prefix`` in a ``/proc/self/mountinfo``
    text, deepest first (the order to unmount them in). Pure."""
    base = prefix.rstrip("/") + "/"
    out = []
    for line in mountinfo.splitlines():
        fields = line.split(" ", 5)
        if len(fields) < 5:
            continue
        mp = unescape_mountinfo(fields[4])
        if mp.startswith(base):
            out.append(mp)
    return sorted(set(out), key=lambda p: (-p.count("/"), p))


def _reclaim_root(root: str, *, remove_root: bool) -> list[str]:
    """Detach every mount below ``root`` and remove the emptied mount points."""
    with open("/proc/self/mountinfo") as f:
        mountinfo = f.read()
    gone = []
    for mp in mounts_below(mountinfo, root):
        try:
            sys_umount(mp, detach=True)
            gone.append(mp)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: already unmounted by someone else
                raise
        try:
            os.rmdir(mp)
        except OSError:
            pass
    try:
        for e in os.scandir(root):
            if e.is_dir(follow_symlinks=False):
                try:
                    os.rmdir(e.path)
                except OSError:
                    pass
    except FileNotFoundError:
        return gone
    if remove_root:
        try:
            os.rmdir(root)
        except OSError:
            pass
    disown(root)
    return gone


def reclaim_dead_roots(parent: str = RUN_ROOT) -> list[str]:
    """Reclaim the mount roots under ``parent`` whose owner process is gone (see the
    module docstring); returns the mount points detached."""
    gone: list[str] = []
    try:
        entries = list(os.scandir(parent))
    except FileNotFoundError:
        return gone
    for e in entries:
        if e.name.startswith("m") and e.is_dir(follow_symlinks=False) \
                and owner_alive(e.path) is False:
            gone += _reclaim_root(e.path, remove_root=True)
    return gone


@dataclass(slots=True)
class _Entry:
    path: str
    refs: int
    manifest: LayerManifest | None = None   # set for a lazy layer (rebound on restart)


class LazySource(Protocol):
    """Where a layer this node serves lazily can be mounted from
    (:class:`dsec.edge.lazy.layers.LazyLayers`)."""

    def path(self, manifest: LayerManifest) -> str | None:
        """The (FUSE-backed) file to mount for ``manifest``, or None if not lazy here."""


def _not_writable_by_others(path: str) -> None:
    """Refuse a ``path`` owned by another user and drop group/other write bits from it:
    whoever may write the directory holding the cache's own 0700 root could rename that
    root away and put a directory of theirs in its place, and every layer (tenants'
    files) would then be mounted where they can read it. (/run/dsec was made with the
    umask's mode by older code: 0777 under umask 0.)"""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise ImageError(f"{path} is not a directory owned by uid {os.geteuid()} (it is "
                         f"owned by uid {st.st_uid}); remove it or pass mount_root=")
    if st.st_mode & 0o022:
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o022)


class MountCache:
    """Mount each layer once per node, shared and reference-counted.

    ``mount_root`` defaults to a fresh short directory under ``/run/dsec`` owned by this
    cache (one cache per node process: refcounts live in this process); making one first
    reclaims the roots of caches whose process died (``reclaimed`` lists what was
    detached). A given ``mount_root`` left by a dead process is reclaimed the same way;
    one a live process owns is refused with ``InUse``. ``close()`` unmounts everything
    it still holds.
    """

    def __init__(self, *, mount_root: str | None = None, verify: bool = True,
                 lazy: LazySource | None = None) -> None:
        self.lazy = lazy
        self._own_root = mount_root is None
        if mount_root is None:
            # mkdtemp makes the cache's own root 0700: the mounted layers below it are
            # tenants' files, and other host users must not walk into them.
            os.makedirs(RUN_ROOT, mode=0o700, exist_ok=True)
            _not_writable_by_others(RUN_ROOT)
            self.reclaimed = reclaim_dead_roots(RUN_ROOT)
            mount_root = tempfile.mkdtemp(prefix="m", dir=RUN_ROOT)
        else:
            os.makedirs(mount_root, mode=0o700, exist_ok=True)
            os.chmod(mount_root, 0o700)
            alive = owner_alive(mount_root)
            if alive:
                raise InUse(f"mount root {mount_root} belongs to another live mount cache; "
                            "close it or give this cache another mount_root",
                            mount_root=mount_root)
            self.reclaimed = (_reclaim_root(mount_root, remove_root=False)
                              if alive is False else [])
        claim(mount_root)
        self.root = mount_root
        self.verify = verify
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._mounts: dict[str, _Entry] = {}
        self._pending: set[str] = set()      # digests being mounted (lock not held)
        # (ino, size, mtime_ns, ctime_ns) of files already verified, so a layer that is
        # unmounted and mounted again is not re-hashed (sha256 runs ~1 GB/s here).
        self._verified: dict[str, tuple[int, int, int, int]] = {}

    def acquire(self, manifest: LayerManifest, layer_path: str) -> str:
        """Mount (or share) the layer; returns its read-only mount point.

        Thread-safe, and the cache's lock is not held while a layer is mounted: the first
        mount of a lazy layer reads its superblock through FUSE from the blob store
        (seconds when the store is slow), and meanwhile other layers are shared and
        released at once. A second caller for the same layer waits for that mount."""
        digest = manifest.digest
        with self._cv:
            while True:
                ent = self._mounts.get(digest)
                if ent is not None:
                    ent.refs += 1
                    return ent.path
                if digest not in self._pending:
                    break
                self._cv.wait()
            self._pending.add(digest)
        try:
            target, lazy = self._mount(manifest, layer_path)
        except BaseException:
            with self._cv:
                self._pending.discard(digest)
                self._cv.notify_all()
            raise
        with self._cv:
            self._pending.discard(digest)
            self._mounts[digest] = _Entry(target, 1, manifest if lazy else None)
            self._cv.notify_all()
        return target

    def _mount(self, manifest: LayerManifest, layer_path: str) -> tuple[str, bool]:
        """Check and mount one layer (the caller holds its pending mark, not the lock);
        returns the mount point and whether it is served lazily."""
        target = os.path.join(self.root, short_digest(manifest.digest))
        lazy_path = (self.lazy.path(manifest)
                     if self.lazy is not None and not os.path.exists(layer_path) else None)
        if lazy_path is not None:
            # A remote layer: a FUSE file whose every chunk is checked against the
            # layer's chunk table as it arrives (dsec.edge.lazy.fs), so no whole-file
            # hash here (it would fetch the whole layer); the size still must match.
            layer_path = lazy_path
            self._check_size(manifest, layer_path)
        else:
            self._check(manifest, layer_path)
        os.makedirs(target, exist_ok=True)
        try:
            sys_mount(layer_path, target, "erofs", MS_RDONLY)
        except OSError as exc:
            try:
                os.rmdir(target)
            except OSError:
                pass
            if lazy_path is not None and exc.errno in (errno.EIO, errno.ENOTCONN,
                                                       errno.ECONNABORTED):
                raise BlobUnavailable(
                    f"layer {manifest.digest} could not be read from the blob store "
                    f"({os.strerror(exc.errno or 0)}): its first chunks did not arrive; "
                    "retry when the blob store is reachable", digest=manifest.digest,
                ) from exc
            if exc.errno in (errno.EINVAL, errno.EUCLEAN, errno.EIO, errno.EFBIG):
                raise CorruptLayer(
                    f"layer {manifest.digest} at {layer_path} is not a mountable EROFS "
                    f"image ({os.strerror(exc.errno or 0)}); rebuild or re-import it",
                    digest=manifest.digest) from exc
            raise ImageError(f"mounting layer {manifest.digest} failed: {exc}") from exc
        return target, lazy_path is not None

    def rebind_lazy(self) -> list[str]:
        """Mount every lazy layer this cache holds afresh from the lazy source's current
        file (its daemon was restarted: the old FUSE connection is gone), at the same
        mount point, so new sandboxes read through the new daemon. The old EROFS mount is
        detached: sandboxes already running keep it (their overlay holds it) and read
        what it has cached. Returns the digests rebound."""
        done = []
        with self._lock:
            for digest, ent in self._mounts.items():
                if ent.manifest is None or self.lazy is None:
                    continue
                src = self.lazy.path(ent.manifest)
                if src is None:
                    continue
                try:
                    sys_umount(ent.path, detach=True)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                sys_mount(src, ent.path, "erofs", MS_RDONLY)
                done.append(digest)
        return done

    def _check_size(self, manifest: LayerManifest, layer_path: str) -> os.stat_result:
        try:
            st = os.stat(layer_path)
        except FileNotFoundError:
            raise CorruptLayer(f"layer file {layer_path} of {manifest.digest} is missing",
                               digest=manifest.digest) from None
        except OSError as exc:
            raise ImageError(f"layer {manifest.digest}: cannot stat {layer_path}: "
                             f"{exc.strerror}") from exc
        if st.st_size != manifest.size_bytes:
            raise CorruptLayer(
                f"layer {manifest.digest} is {st.st_size} bytes on disk but its manifest "
                f"says {manifest.size_bytes} (truncated or replaced); rebuild it",
                digest=manifest.digest)
        return st

    def _check(self, manifest: LayerManifest, layer_path: str) -> None:
        st = self._check_size(manifest, layer_path)
        key = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if not self.verify or self._verified.get(manifest.digest) == key:
            return
        actual = hash_file(layer_path)
        if "sha256:" + actual != manifest.digest:
            raise CorruptLayer(
                f"layer {layer_path} hashes to sha256:{actual}, not {manifest.digest}; "
                "the file is corrupt: rebuild or re-import it", digest=manifest.digest)
        self._verified[manifest.digest] = key

    def release(self, digest: str) -> None:
        """Drop one reference; the last one unmounts the layer."""
        with self._lock:
            ent = self._mounts.get(digest)
            if ent is None:
                raise InvalidArgument(f"layer {digest} is not held by this mount cache")
            ent.refs -= 1
            if ent.refs > 0:
                return
            del self._mounts[digest]
            self._unmount(ent.path)

    @staticmethod
    def _unmount(path: str) -> None:
        try:
            sys_umount(path)
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                # Still pinned by a sandbox mount namespace: detach, the kernel frees it
                # when the last user goes.
                sys_umount(path, detach=True)
            elif exc.errno != errno.EINVAL:
                raise
        try:
            os.rmdir(path)
        except OSError:
            pass

    def refs(self, digest: str) -> int:
        ent = self._mounts.get(digest)
        return ent.refs if ent else 0

    def mounted(self) -> dict[str, str]:
        """digest -> mount point of every layer this cache holds."""
        return {d: e.path for d, e in self._mounts.items()}

    def close(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: not self._pending)
            for ent in self._mounts.values():
                self._unmount(ent.path)
            self._mounts.clear()
        disown(self.root)
        if self._own_root:
            try:
                os.rmdir(self.root)
            except OSError:
                pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
