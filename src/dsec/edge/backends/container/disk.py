"""The sandboxes' disk: one btrfs pool per backend, one subvolume with a qgroup limit per
sandbox, holding that sandbox's overlay upper and work dirs.

Every container sandbox gets a disk cap (``spec.disk_bytes``, or the node default): a
write past it fails inside the sandbox with ``EDQUOT`` ("Disk quota exceeded"; btrfs
answers quota with EDQUOT where ext4/XFS project quotas answer ENOSPC), and a full pool
with ``ENOSPC`` - on the pool, never on the host filesystem the state dir lives on.

**Why btrfs qgroups.** What was measured on the dev VM (kernel 6.18, 2 vCPU):

- *tmpfs per sandbox* (the first design): ~0.1 ms to mount, but it is RAM: its pages are
  charged to the sandbox's memory cgroup, so a 512 MiB sandbox could never use a 10 GiB
  disk, and a node's disk would be bounded by its RAM + swap. Each one is also a host
  mount, which every later create copies into its new mount namespace (+0.4 ms per 100
  capped sandboxes alive).
- *ext4 or XFS project quotas* (what Docker's overlay2 does with xfs pquota): not
  available on this kernel: ext4's quota feature needs CONFIG_QFMT_V2 ("The kernel was
  not built with CONFIG_QUOTA and CONFIG_QFMT_V2", mount refused) and CONFIG_XFS_QUOTA is
  off. Node kernels are not ours to choose, so the backing must work without them.
- *an ext4 image + loop device per sandbox*: mkfs + losetup + mount is ~10+ ms per create
  and a jbd2 thread and loop workqueue per sandbox (density).
- *btrfs qgroups* (this module): one image file under ``root_dir``, loop-mounted
  once (mkfs + mount + quota enable ~80 ms at backend start); per sandbox one
  ``BTRFS_IOC_SUBVOL_CREATE_V2`` that creates the subvolume *with* its qgroup limit in the
  same call: create + 2 mkdirs 0.035 ms p50, destroy 0.018 ms p50 (200 each), no RAM
  beyond page cache, no per-sandbox mount. btrfs has no inode table to exhaust: every
  inode costs metadata bytes that the qgroup counts (a 64 MiB cap held 186,327 empty
  files), so the byte cap also caps inodes. Simple quotas (kernel >= 6.7) are used when
  the kernel has them (no backref walks at commit), else full qgroups.

The image is **preallocated** (``posix_fallocate``: unwritten extents, ~ms for GiBs on
ext4) and mounted ``nodiscard``, so the pool owns its host space for as long as it
exists. Measured with a sparse image first: when anything else filled the host
filesystem under it, the loop device could not back btrfs' next write, btrfs aborted its
transaction and forced the *whole pool* read-only - every sandbox lost its disk and
destroy could no longer delete subvolumes. Preallocated, a full host is the other
writer's ENOSPC, never the pool's. The price is that the pool's size is taken from the
host when it is made, so the default is modest (half the free space of the state dir's
filesystem, at most 64 GiB; ``--disk-pool`` sets it, ``$DSEC_DISK_POOL_BYTES`` gives
the default for a test suite or CI) and an empty pool is deleted when its backend
closes. A create is refused (``CapacityExceeded``) when its cap does not fit what the
pool has free at that moment; caps are limits, not reservations (as with Docker's
quotas), so sandboxes filling the pool together later get ENOSPC inside, with a
``disk_full`` event. A sandbox that names no cap gets the node default, or what the
pool has free if that is less.

Deleted subvolumes are cleaned by btrfs' cleaner thread (space returns within one commit
interval, ~30 s, or at once after :meth:`DiskPool.settle`) and their qgroups are removed
by the kernel once the subvolume is fully dropped, so no id allocator is needed: a
sandbox's qgroup is its subvolume's id, found from the path (``BTRFS_IOC_INO_LOOKUP``),
which is what makes adoption after an edge restart and reconciliation work.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass

from dsec.edge.backends.container import linux
from dsec.errors import BackendError, CapacityExceeded, InvalidArgument
from dsec.rmtree import remove_tree

log = logging.getLogger("dsec.edge.disk")

__all__ = [
    "BTRFS_SUPER_MAGIC",
    "DEFAULT_DISK_BYTES",
    "DiskPool",
    "DiskUsage",
    "detach_loop",
    "loops_of",
    "near_cap",
    "pool_size_for",
]

BTRFS_SUPER_MAGIC = 0x9123683E
DEFAULT_DISK_BYTES = 10 << 30
"""The cap a sandbox gets when its spec names none (``disk_bytes=None``)."""
MIN_POOL_BYTES = 256 << 20
"""mkfs.btrfs needs ~110 MiB for its own trees; smaller pools are refused."""
POOL_FREE_FRACTION = 0.5
"""Default pool size: this share of the state dir filesystem's free space at first start,"""
POOL_MAX_DEFAULT_BYTES = 64 << 30
"""... and at most this much (the image is preallocated: its size is taken from the host)."""
POOL_SIZE_ENV = "DSEC_DISK_POOL_BYTES"
"""Environment variable with the default pool size in bytes (test suites, CI)."""

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (0x94 << 8) | nr


_W, _R = 1, 2
_SUBVOL_CREATE_V2 = _ioc(_W, 24, 4096)
_SNAP_DESTROY_V2 = _ioc(_W, 63, 4096)
_QUOTA_CTL = _ioc(_W | _R, 40, 16)
_INO_LOOKUP = _ioc(_W | _R, 18, 4096)
_FS_INFO = _ioc(_R, 31, 1024)
_SYNC = _ioc(0, 8, 0)
_QUOTA_ENABLE, _QUOTA_ENABLE_SIMPLE = 1, 4
_SUBVOL_QGROUP_INHERIT = 1 << 2
_INHERIT_SET_LIMITS = 1
_LIMIT_MAX_RFER, _LIMIT_MAX_EXCL = 1, 2
_FIRST_FREE_OBJECTID = 256


class _Limit(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("max_rfer", ctypes.c_uint64),
                ("max_excl", ctypes.c_uint64), ("rsv_rfer", ctypes.c_uint64),
                ("rsv_excl", ctypes.c_uint64)]


class _Inherit(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("num_qgroups", ctypes.c_uint64),
                ("num_ref_copies", ctypes.c_uint64), ("num_excl_copies", ctypes.c_uint64),
                ("lim", _Limit)]


class _VolArgsV2(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int64), ("transid", ctypes.c_uint64),
                ("flags", ctypes.c_uint64), ("size", ctypes.c_uint64),
                ("qgroup_inherit", ctypes.c_void_p), ("unused", ctypes.c_uint64 * 2),
                ("name", ctypes.c_char * 4040)]


class _QuotaCtl(ctypes.Structure):
    _fields_ = [("cmd", ctypes.c_uint64), ("status", ctypes.c_uint64)]


class _InoLookup(ctypes.Structure):
    _fields_ = [("treeid", ctypes.c_uint64), ("objectid", ctypes.c_uint64),
                ("name", ctypes.c_char * 4080)]


class _FsInfo(ctypes.Structure):  # struct btrfs_ioctl_fs_info_args, 1024 bytes
    _fields_ = [("max_id", ctypes.c_uint64), ("num_devices", ctypes.c_uint64),
                ("fsid", ctypes.c_uint8 * 16), ("rest", ctypes.c_uint8 * 992)]


for _t, _size in ((_VolArgsV2, 4096), (_InoLookup, 4096), (_FsInfo, 1024), (_QuotaCtl, 16),
                  (_Inherit, 72)):
    # the kernel writes whole structs back: a short one would corrupt the heap
    assert ctypes.sizeof(_t) == _size, (_t.__name__, ctypes.sizeof(_t))


def _ioctl(fd: int, request: int, arg: ctypes.Structure | None, what: str) -> None:
    ptr = ctypes.byref(arg) if arg is not None else None
    if _libc.ioctl(ctypes.c_int(fd), ctypes.c_ulong(request), ptr) < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


@dataclass(frozen=True, slots=True)
class DiskUsage:
    """A sandbox's disk: bytes it holds (committed + reserved by in-flight writes) and
    its cap."""

    used_bytes: int
    cap_bytes: int


def pool_size_for(free_bytes: int, *, fraction: float = POOL_FREE_FRACTION,
                  most: int = POOL_MAX_DEFAULT_BYTES) -> int:
    """The default pool size for a state dir filesystem with ``free_bytes`` free: a share
    of it, at most ``most``, whole MiB. Raises when that is too small for a pool at all."""
    size = min(int(free_bytes * fraction), most) & ~((1 << 20) - 1)
    if size < MIN_POOL_BYTES:
        raise BackendError(
            f"the state dir's filesystem has only {free_bytes} bytes free: the sandbox disk "
            f"pool needs at least {MIN_POOL_BYTES} bytes; free space there or set the "
            "pool size (dsec edge/up --disk-pool)")
    return size


def near_cap(used: int, cap: int) -> bool:
    """Whether a sandbox using ``used`` bytes of ``cap`` has hit it (a write of a few
    blocks would fail). btrfs refuses a write whose reservation would pass the limit, so
    a full sandbox sits within a block or so below its cap, never exactly on it."""
    return used >= cap - max(256 << 10, cap // 128)


class DiskPool:
    """The btrfs filesystem holding every sandbox's upper layer, one subvolume each.

    ``<root_dir>/pool`` is the mount point (or, if ``root_dir`` is itself on btrfs with
    quotas enabled, a plain directory there); ``<root_dir>/pool.img`` the preallocated
    image. ``size_bytes``: the image size when it is first made (None:
    ``$DSEC_DISK_POOL_BYTES``, else half the state dir filesystem's free space, at most
    64 GiB); an existing image keeps its size.
    """

    def __init__(self, root_dir: str, *, size_bytes: int | None = None) -> None:
        if size_bytes is not None and size_bytes < MIN_POOL_BYTES:
            raise InvalidArgument(f"disk pool size {size_bytes} is below the minimum of "
                                  f"{MIN_POOL_BYTES} bytes", field="disk_pool_bytes")
        self.root_dir = os.path.abspath(root_dir)
        self.path = os.path.join(self.root_dir, "pool")
        self.image = os.path.join(self.root_dir, "pool.img")
        #: True when the pool is our loop-mounted image (unmounted by close() when empty)
        self.owned = True
        self._fd = -1
        self._open(size_bytes)
        self.fsid = self._fsid()
        self._qgroups = f"/sys/fs/btrfs/{self.fsid}/qgroups"
        if not os.path.isdir(self._qgroups):
            self._enable_quota()

    # -------------------------------------------------------------------- set up
    def _open(self, size_bytes: int | None) -> None:
        if _fs_type(self.root_dir) == BTRFS_SUPER_MAGIC and not os.path.exists(self.image):
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            if self._quota_enabled_at(self.path):
                self.owned = False
                self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                return
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        if not os.path.ismount(self.path):
            if not os.path.exists(self.image):
                self._make_image(size_bytes)
                self._mount()
            elif loops := loops_of(self.image):
                # A dead edge of this root left its image on a loop device but not
                # mounted here (unmounted by hand, or the mount survives only in another
                # mount namespace): reuse that device - a second loop device over the
                # same image would be a second btrfs device with the same fsid.
                log.warning("the sandbox disk pool %s is still attached to %s: mounting "
                            "that device again", self.image, ", ".join(loops))
                self._mount(loops[0])
            else:
                self._preallocate_existing()
                self._mount()
        # (mounted already: a dead edge's pool, reused as it is - its subvolumes are the
        # sandboxes the journal adopts; the census removes the others)
        if _fs_type(self.path) != BTRFS_SUPER_MAGIC:
            raise BackendError(f"{self.path} is a mount point but not a btrfs filesystem; "
                               "unmount it (it is where the sandbox disk pool goes)")
        os.chmod(self.path, 0o700)
        self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def _quota_enabled_at(self, path: str) -> bool:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            info = _FsInfo()
            _ioctl(fd, _FS_INFO, info, f"BTRFS_IOC_FS_INFO({path})")
        finally:
            os.close(fd)
        return os.path.isdir(f"/sys/fs/btrfs/{uuid.UUID(bytes=bytes(info.fsid))}/qgroups")

    def _make_image(self, size_bytes: int | None) -> None:
        mkfs = shutil.which("mkfs.btrfs")
        if mkfs is None:
            raise BackendError("mkfs.btrfs not found: install the Debian package btrfs-progs "
                               "(make setup does); the sandbox disk pool is a btrfs image")
        if size_bytes is None:
            env = os.environ.get(POOL_SIZE_ENV)
            if env:
                try:
                    size_bytes = int(env)
                except ValueError as exc:
                    raise InvalidArgument(f"${POOL_SIZE_ENV}={env!r} must be a number of "
                                          "bytes", field=POOL_SIZE_ENV) from exc
            else:
                vfs = os.statvfs(self.root_dir)
                size_bytes = pool_size_for(vfs.f_bavail * vfs.f_frsize)
        tmp = self.image + ".tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        try:
            # Preallocated, not sparse: see the module docstring (a sparse image made the
            # whole pool read-only when the host filled up).
            os.posix_fallocate(fd, 0, size_bytes)
        except OSError as exc:
            os.close(fd)
            os.unlink(tmp)
            raise BackendError(
                f"cannot reserve {size_bytes} bytes for the sandbox disk pool under "
                f"{self.root_dir}: {exc.strerror}; free space there or set a smaller pool "
                "(dsec edge/up --disk-pool)") from exc
        os.close(fd)
        try:
            # -K: no discard of the (file) device, which would punch the preallocation out.
            proc = subprocess.run([mkfs, "-q", "-f", "-K", "-m", "single", "-d", "single",
                                   "-L", "dsec-pool", tmp], check=False, capture_output=True,
                                  text=True)
        except BaseException:  # a stop during an edge's start: the preallocation goes
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if proc.returncode != 0:
            os.unlink(tmp)
            raise BackendError(f"mkfs.btrfs of the sandbox disk pool {tmp} failed: "
                               f"{proc.stderr.strip()}")
        os.replace(tmp, self.image)

    def _preallocate_existing(self) -> None:
        """Give an image made sparse (by an older dsec) its blocks back before mounting;
        if the host has not got them, run as it is and say so."""
        st = os.stat(self.image)
        if st.st_blocks * 512 >= st.st_size:
            return
        fd = os.open(self.image, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.posix_fallocate(fd, 0, st.st_size)
        except OSError as exc:
            log.warning("the sandbox disk pool %s is sparse and the host cannot back it "
                        "(%s): a full host filesystem would make the pool read-only; free "
                        "space there", self.image, exc.strerror)
        finally:
            os.close(fd)

    def _mount(self, device: str | None = None) -> None:
        # util-linux sets up the loop device (with autoclear: the umount releases it);
        # once per backend start, so its ~4 ms do not matter. ``device``: a loop device
        # already backed by the image (no autoclear: close() detaches it).
        opts = "noatime,nosuid,nodev,nodiscard"
        proc = subprocess.run(["mount", "-t", "btrfs", "-o",
                               opts if device else f"loop,{opts}",
                               device or self.image, self.path], check=False,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise BackendError(f"cannot mount the sandbox disk pool {self.image} at "
                               f"{self.path}: {proc.stderr.strip()}")

    def _fsid(self) -> str:
        info = _FsInfo()
        _ioctl(self._fd, _FS_INFO, info, f"BTRFS_IOC_FS_INFO({self.path})")
        return str(uuid.UUID(bytes=bytes(info.fsid)))

    def _enable_quota(self) -> None:
        try:
            _ioctl(self._fd, _QUOTA_CTL, _QuotaCtl(cmd=_QUOTA_ENABLE_SIMPLE),
                   "enable simple quotas")
        except OSError:
            try:  # a kernel before 6.7: full qgroups (backref accounting at commit)
                _ioctl(self._fd, _QUOTA_CTL, _QuotaCtl(cmd=_QUOTA_ENABLE), "enable quotas")
            except OSError as exc:
                raise BackendError(f"cannot enable btrfs quotas on the sandbox disk pool "
                                   f"{self.path}: {exc}") from exc

    # -------------------------------------------------------------- per sandbox
    def sandbox_path(self, sid: str) -> str:
        return os.path.join(self.path, sid)

    def total_bytes(self) -> int:
        vfs = os.fstatvfs(self._fd)
        return vfs.f_blocks * vfs.f_frsize

    def unbacked_bytes(self) -> int:
        """How much more host space the image may take as the pool fills: its size less
        what it has allocated (0 for a preallocated image or a pool that is not ours). Whatever else
        writes to the image's host filesystem must leave this free - a write the loop
        device cannot back aborts btrfs' transaction and makes the whole pool read-only."""
        if not self.owned:
            return 0
        st = os.stat(self.image)
        return max(0, st.st_size - st.st_blocks * 512)

    def default_cap(self, node_default: int) -> int:
        """The cap of a sandbox that names none: the node default, or what the pool has
        free now if that is less (a small pool - a test suite's - would otherwise refuse
        every such create). An explicit cap that does not fit is refused instead."""
        vfs = os.fstatvfs(self._fd)
        return max(1 << 20, min(node_default, vfs.f_bavail * vfs.f_frsize))

    def check_fit(self, cap: int) -> None:
        """Refuse (``CapacityExceeded``) a cap the pool could never hold, or that does not
        fit what the pool - and, for an image the host could not preallocate, the host
        filesystem under it - has free now. Placement tries another node on CapacityExceeded."""
        vfs = os.fstatvfs(self._fd)
        total = vfs.f_blocks * vfs.f_frsize
        free = vfs.f_bavail * vfs.f_frsize
        if cap > total:
            raise CapacityExceeded(
                f"disk_bytes={cap} is more than this node's whole sandbox disk pool "
                f"({total} bytes); ask for at most that, or give the node a larger pool "
                "(--disk-pool)", resource="disk_bytes", requested=cap, available=total)
        if cap > free:
            raise CapacityExceeded(
                f"disk_bytes={cap} does not fit: this node's sandbox disk pool has {free} "
                f"of {total} bytes free; ask for less or use another node",
                resource="disk_bytes", requested=cap, available=free)
        if self.unbacked_bytes():   # an image the host could not preallocate
            host = os.statvfs(self.root_dir)
            host_free = host.f_bavail * host.f_frsize
            if cap > host_free:
                raise CapacityExceeded(
                    f"disk_bytes={cap} does not fit: the filesystem under the sandbox disk "
                    f"pool ({self.root_dir}) has {host_free} bytes free; free space there "
                    "or ask for less", resource="disk_bytes", requested=cap,
                    available=host_free)

    def create(self, sid: str, cap: int) -> str:
        """A subvolume for ``sid`` limited to ``cap`` bytes (its qgroup made and limited
        in the same ioctl); returns its path."""
        if cap < 1:
            raise InvalidArgument(f"disk cap {cap} must be positive", field="disk_bytes")
        inherit = _Inherit(flags=_INHERIT_SET_LIMITS,
                           lim=_Limit(flags=_LIMIT_MAX_RFER | _LIMIT_MAX_EXCL,
                                      max_rfer=cap, max_excl=cap))
        args = _VolArgsV2(flags=_SUBVOL_QGROUP_INHERIT, size=ctypes.sizeof(inherit),
                          qgroup_inherit=ctypes.addressof(inherit), name=sid.encode())
        _ioctl(self._fd, _SUBVOL_CREATE_V2, args, f"create subvolume {sid}")
        path = self.sandbox_path(sid)
        os.chmod(path, 0o700)
        return path

    def remove(self, sid: str) -> None:
        """Delete ``sid``'s subvolume (and so its data); missing is fine."""
        path = self.sandbox_path(sid)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if st.st_ino != _FIRST_FREE_OBJECTID:   # not a subvolume root: a stray directory
            res = remove_tree(path)
            if not res.clean:
                raise OSError(f"cannot remove {path}: {res.describe()}")
            return
        try:
            _ioctl(self._fd, _SNAP_DESTROY_V2, _VolArgsV2(name=sid.encode()),
                   f"delete subvolume {sid}")
        except FileNotFoundError:
            pass

    def qgroup_dir(self, sid: str) -> str:
        """sysfs directory of ``sid``'s qgroup (its counters and limits)."""
        fd = os.open(self.sandbox_path(sid), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            args = _InoLookup(treeid=0, objectid=_FIRST_FREE_OBJECTID)
            _ioctl(fd, _INO_LOOKUP, args, f"BTRFS_IOC_INO_LOOKUP({sid})")
        finally:
            os.close(fd)
        return f"{self._qgroups}/0_{args.treeid}"

    @staticmethod
    def usage_at(qgroup_dir: str) -> DiskUsage:
        """Used bytes (committed + reserved by writes in flight, which is what the limit
        is checked against) and the cap, from the qgroup's sysfs counters (~10 µs)."""
        used = 0
        for name in ("referenced", "rsv_data", "rsv_meta_pertrans", "rsv_meta_prealloc"):
            used += _read_int(os.path.join(qgroup_dir, name))
        return DiskUsage(used_bytes=used,
                         cap_bytes=_read_int(os.path.join(qgroup_dir, "max_referenced")))

    def sandboxes(self) -> list[str]:
        """Names of every sandbox subvolume in the pool (for reconciliation)."""
        return sorted(n for n in os.listdir(self.path) if not n.startswith("."))

    def settle(self) -> None:
        """Commit and wake btrfs' cleaner, so deleted subvolumes give their space (and
        qgroups) back now rather than within the next commit interval."""
        _ioctl(self._fd, _SYNC, None, "BTRFS_IOC_SYNC")

    def close(self) -> None:
        """Release the pool; an owned pool with no sandbox left is unmounted (which also
        frees its loop device) and its image deleted, giving its preallocated space back
        to the host. With sandboxes left it stays for their adoption."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if not (self.owned and os.path.ismount(self.path)):
            return
        try:
            left = self.sandboxes()
        except OSError:   # a pool btrfs forced read-only/broken: leave it for an operator
            return
        if left:
            return
        try:
            linux.umount2(self.path)
        except OSError:
            return  # still busy (a sandbox's namespace holds it): keep the image
        # The loop device goes with the last mount when util-linux attached it
        # (autoclear); one attached otherwise (a dead edge's, reused) is detached here -
        # or, while another mount namespace still holds the filesystem, marked to detach
        # when that goes (the kernel's LOOP_CLR_FD on a busy device).
        for dev in loops_of(self.image):
            detach_loop(dev)
        with contextlib.suppress(OSError):
            os.unlink(self.image)


_LOOP_CLR_FD = 0x4C01


def loops_of(image: str) -> list[str]:
    """The loop devices backed by ``image`` (/sys/block/loopN/loop/backing_file)."""
    want = os.path.realpath(image)
    out = []
    try:
        names = os.listdir("/sys/block")
    except OSError:
        return []
    for name in sorted(names):
        if not name.startswith("loop"):
            continue
        try:
            with open(f"/sys/block/{name}/loop/backing_file") as f:
                backing = f.read().strip()
        except OSError:
            continue  # not attached
        if backing == want:
            out.append(f"/dev/{name}")
    return out


def detach_loop(device: str) -> bool:
    """``losetup -d DEVICE`` (an ioctl); False if the kernel refused it."""
    try:
        fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return bool(_libc.ioctl(ctypes.c_int(fd), ctypes.c_ulong(_LOOP_CLR_FD), 0) == 0)
    finally:
        os.close(fd)


def _fs_type(path: str) -> int:
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        return linux.fstatfs_type(fd)
    finally:
        os.close(fd)


def _read_int(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip() or 0)
    except FileNotFoundError:
        return 0
    except OSError as exc:
        if exc.errno == errno.ENODEV:
            return 0
        raise
