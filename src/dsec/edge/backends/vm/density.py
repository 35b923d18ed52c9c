"""How many microVMs fit on a host: the QEMU and guest-kernel settings that return a VM's
unused memory to the host and share what all VMs read (issue 21).

A VM's guest RAM is anonymous memory of its QEMU process: every page the guest ever
touched stays resident on the host, whether the guest still uses it or not. Four
mechanisms cut that, each found working by standalone runs (QEMU 7.2 TCG, Debian's 6.12
cloud kernel, busybox initramfs, 512 MiB guest, a 91 MiB EROFS layer; figures in
docs/isolation.md, "Density"):

1. **Read-only layers on virtio-pmem with DAX.** A layer file is mapped into the guest's
   physical address space (``memory-backend-file,share=on,readonly=on`` +
   ``virtio-pmem-pci``) and the guest mounts it ``erofs -o dax=always`` from
   ``/dev/pmemN``: file reads are loads from the host's page cache of that file, never
   copies in guest RAM, so N VMs of one image hold its files once (host page cache) instead
   of N times (each guest's page cache, as with virtio-blk). Costs: the guest's
   ``struct page`` array for the region (64 bytes per 4 KiB page = 1/64 of the layer,
   :func:`guest_struct_page_bytes`), and DAX applies to uncompressed files stored
   without an inline tail only (erofs gives S_DAX to the FLAT_PLAIN layout alone):
   mkfs.erofs packs file tails into the inode by default, which left 104 of 104 MiB read
   in the guest page cache (measured); build layers for the vm tier with
   :data:`MKFS_DAX_ARGS` (``-Enoinline_data``: the 91 MiB layer grew 7%, then 5 MiB
   stayed in the guest page cache). A ``-zlz4`` layer never gets DAX.
   Placing the regions above 4 GiB makes the guest allocate (and touch) a 64 MiB SWIOTLB
   bounce buffer: 64 MiB more resident per VM, measured; virtio devices do not use it
   (no VIRTIO_F_ACCESS_PLATFORM), so :func:`kernel_cmdline` turns it off
   (``swiotlb=noforce``). Alignment: the guest maps a
   region in 2 MiB subsections and refuses a misaligned one ("misaligned, unable to map",
   no /dev/pmem0), QEMU refuses a ``size`` larger than the file, so a layer whose size is
   not a multiple of 2 MiB is used through a padded clone (:func:`prepare_pmem_layer`).
   Guest writes to the read-only region are dropped by QEMU (measured: ``dd`` onto
   /dev/pmem0 "succeeds", reads return the old bytes, the host file is unchanged).
2. **Free page reporting** (``virtio-balloon-pci,free-page-reporting=on``): the guest
   reports free 2 MiB blocks (``page_reporting_order`` 9) and QEMU discards them
   (``MADV_DONTNEED``), so memory a workload used and freed goes back to the host. The
   guest reports 1/16 of a free list per pass, one pass every 2 s, so it takes ~30 s to
   return everything after a burst.
3. **DAMON_RECLAIM** in the guest (built into the 6.12 cloud kernel, set on the kernel
   command line; **off by default**: in our runs it started - kdamond running, enabled=Y -
   but tried 0 regions in 90 s with 5 s min_age and always-on watermarks, leaving 104 MiB
   of cold page cache, and cost ~10% of a host core per idle VM with 100 ms sampling
   under TCG, 0.3-0.4% without it): pages not accessed for ``min_age`` are reclaimed (clean page cache is
   dropped; anonymous pages would need guest swap, which we do not configure), and with
   reporting they reach the host. Its watermarks default to reclaiming only when free
   memory is under 40%, which an idle sandbox never is: we make it always on. Its sampling
   costs guest CPU, which under TCG is host CPU: intervals are widened (100 ms / 2 s).
4. **TCG translation cache cap** (``-accel tcg,tb-size=N`` MiB): the default cache grows
   with the code the guest runs and its pages stay resident; a cap flushes instead.

Measured (QEMU RssAnon of one 512 MiB VM after reading its 91 MiB image and freeing a
128 MiB tmpfs file): 423 MiB with none of this, 160 MiB with the defaults (plus the
layer's host page cache, 98 MiB shared by every VM of the image); idle 204 -> 156 MiB.
Per mechanism: tb-size cap -26 MiB; reporting returns the freed 128 MiB within 10 s;
pmem+DAX keeps the image out of guest RAM (5 MiB of guest page cache instead of 104).

Pure functions build argv pieces; :func:`prepare_pmem_layer` is the one that touches the
disk. The host side (``backend.py``) puts :func:`qemu_args` into ``VmSpec.extra``,
:func:`kernel_cmdline` into the kernel command line and ``tb_size_mib`` into its
``-accel``, and passes ``dax=opts.pmem_dax`` and :func:`guest_layer_devices` to the
agent's ``setup``.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

from dsec import statedir
from dsec.errors import InvalidArgument, SandboxError

__all__ = [
    "MKFS_DAX_ARGS", "PMEM_ALIGN", "DensityOptions", "PmemLayer", "accel_args", "device_args",
    "guest_layer_devices", "guest_struct_page_bytes", "host_overhead_bytes", "kernel_cmdline",
    "memory_arg", "pmem_bytes", "pmem_layer_name", "prepare_pmem_layer", "qemu_args",
]

#: the guest maps pmem in memory-hotplug subsections (2 MiB on x86-64): a region whose
#: size or start is not a multiple is refused (measured: nd_pmem "misaligned, unable to map")
PMEM_ALIGN = 2 << 20
#: mkfs.erofs options for a layer the vm tier maps with DAX: no inline file tails (erofs
#: only gives DAX to FLAT_PLAIN files)
MKFS_DAX_ARGS: tuple[str, ...] = ("-Enoinline_data",)
#: ``struct page`` is 64 bytes per 4 KiB page: the guest RAM a DAX region costs
_STRUCT_PAGE_RATIO = 64
_MIB = 1 << 20
_FICLONE = 0x40049409


@dataclass(frozen=True, slots=True, kw_only=True)
class DensityOptions:
    """Which density mechanisms a VM gets. On by default: the ones measured to help
    (pmem+DAX, free page reporting, the TCG cache cap); DAMON_RECLAIM is off (see
    ``damon_reclaim``). None changes what the sandbox sees."""

    #: read-only EROFS layers on virtio-pmem, mounted ``dax=always`` (else virtio-blk)
    pmem_dax: bool = True
    #: virtio-balloon with free page reporting: freed guest memory returns to the host
    free_page_reporting: bool = True
    #: smallest free block the guest reports, as a page order (None: the kernel's 9,
    #: 2 MiB). Measured idle: 0 (4 KiB) -> 137 MiB against 158 MiB with 9: boot leaves
    #: free memory fragmented. Not the default: its cost on a busy guest (a report and a
    #: host refault per small block, no host huge pages) is not measured yet
    page_reporting_order: int | None = None
    #: the balloon gives its pages back when the guest would OOM (the balloon is never
    #: inflated by us; this only makes a future inflation safe)
    deflate_on_oom: bool = True
    #: DAMON_RECLAIM in the guest: reclaim pages idle for ``damon_min_age_s``. Off by
    #: default: measured here it reclaimed nothing in 90 s (0 regions tried, 104 MiB of
    #: cold page cache left) while its sampling cost ~10% of a host core per idle VM
    #: under TCG (0.3-0.4% without it)
    damon_reclaim: bool = False
    #: seconds a region must go unaccessed before DAMON_RECLAIM reclaims it
    damon_min_age_s: float = 30.0
    #: DAMON's sampling interval (kernel default 5 ms: ~2% host CPU per idle VM under TCG)
    damon_sample_ms: int = 100
    #: DAMON's aggregation interval (kernel default 100 ms)
    damon_aggr_ms: int = 2000
    #: at most this many bytes reclaimed per second (kernel default 128 MiB)
    damon_quota_bytes_per_s: int = 128 * _MIB
    #: TCG translation cache cap in MiB; None = QEMU's default (grows with guest code)
    tb_size_mib: int | None = 32

    def __post_init__(self) -> None:
        if self.tb_size_mib is not None and not 1 <= self.tb_size_mib <= 4096:
            raise InvalidArgument(f"tb_size_mib={self.tb_size_mib} is out of range: give "
                                  "1..4096 MiB, or None for QEMU's default")
        if not 0 < self.damon_min_age_s <= 86400:
            raise InvalidArgument(f"damon_min_age_s={self.damon_min_age_s} is out of range: "
                                  "give a positive number of seconds up to a day")
        if not 1 <= self.damon_sample_ms <= self.damon_aggr_ms <= 60_000:
            raise InvalidArgument(
                f"damon_sample_ms={self.damon_sample_ms}, damon_aggr_ms={self.damon_aggr_ms}: "
                "need 1 <= sample <= aggregation <= 60000 ms")
        if self.page_reporting_order is not None and not 0 <= self.page_reporting_order <= 10:
            raise InvalidArgument(f"page_reporting_order={self.page_reporting_order}: give "
                                  "0..10 (a page order), or None for the kernel's default")
        if self.damon_quota_bytes_per_s < _MIB:
            raise InvalidArgument(f"damon_quota_bytes_per_s={self.damon_quota_bytes_per_s} "
                                  "is below 1 MiB/s: DAMON_RECLAIM would reclaim nothing useful")


@dataclass(frozen=True, slots=True)
class PmemLayer:
    """A layer file ready to be a virtio-pmem region: ``size`` is a multiple of
    :data:`PMEM_ALIGN` and equals the file's size."""

    path: str
    size: int


def pmem_bytes(size: int) -> int:
    """The region size for a layer of ``size`` bytes (rounded up to :data:`PMEM_ALIGN`)."""
    if size <= 0:
        raise InvalidArgument(f"a layer of {size} bytes cannot be a pmem region: it is empty")
    return -(-size // PMEM_ALIGN) * PMEM_ALIGN


def pmem_layer_name(layer_path: str, size: int, mtime_ns: int) -> str:
    """The file name of a layer's padded clone: the layer's name plus a digest of what
    identifies this version of it (path, size, mtime), so a rebuilt layer never reuses a
    stale clone. Pure."""
    key = f"{os.path.abspath(layer_path)}\0{size}\0{mtime_ns}".encode()
    return f"{os.path.basename(layer_path)}.{hashlib.sha256(key).hexdigest()[:16]}.pmem"


def prepare_pmem_layer(layer_path: str, cache_dir: str) -> PmemLayer:
    """The layer as a pmem region: the file itself when its size is already aligned and
    it is world-readable, else a padded (0444) clone in ``cache_dir`` (a reflink where the filesystem has them, a copy
    otherwise; the padding is a hole), made once and shared by every VM of the layer —
    sharing the host page cache of one file is the point. Idempotent, safe against
    concurrent callers (temp file + rename).

    World-readable because QEMU opens ``mem-path`` itself (memory-backend-file has no
    ``fd=`` in 7.2) and runs as an unprivileged uid: pass it ``/proc/self/fd/N`` of a
    descriptor the edge opened, and the reopen checks only the inode's mode."""
    try:
        st = os.stat(layer_path)
    except OSError as exc:
        raise SandboxError(f"layer {layer_path} cannot be used as a pmem region: {exc}") from exc
    want = pmem_bytes(st.st_size)
    if want == st.st_size and st.st_mode & 0o004:
        return PmemLayer(layer_path, want)
    os.makedirs(cache_dir, mode=0o700, exist_ok=True)
    dst = os.path.join(cache_dir, pmem_layer_name(layer_path, st.st_size, st.st_mtime_ns))
    try:
        if os.stat(dst).st_size == want:
            return PmemLayer(dst, want)
    except FileNotFoundError:
        pass
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=os.path.basename(dst) + ".tmp.")
    try:
        with open(layer_path, "rb") as src, open(fd, "wb") as out:
            try:
                fcntl.ioctl(out.fileno(), _FICLONE, src.fileno())
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOTTY):
                    raise
                shutil.copyfileobj(src, out, 1 << 20)
            out.truncate(want)
            os.fchmod(out.fileno(), 0o444)
            # on disk before it is named: a copy of the right size is reused unread, and
            # after a power loss an unsynced one has that size (the truncate) over zeros
            os.fsync(out.fileno())
        os.replace(tmp, dst)
        statedir.fsync_dir(cache_dir)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise SandboxError(f"could not make the padded pmem copy {dst} of layer {layer_path} "
                           f"({st.st_size} bytes -> {want}): {exc}; check free space in "
                           f"{cache_dir}") from exc
    return PmemLayer(dst, want)


def _qopt(value: str) -> str:
    """A value inside a QEMU ``key=value,...`` option string (commas are doubled)."""
    if "\n" in value or "\0" in value:
        raise InvalidArgument(f"{value!r} cannot be passed to QEMU: it holds a newline or NUL")
    return value.replace(",", ",,")


def accel_args(opts: DensityOptions) -> list[str]:
    """``-accel tcg`` with the translation cache cap (TCG only: /dev/kvm here is PVM)."""
    accel = "tcg" if opts.tb_size_mib is None else f"tcg,tb-size={opts.tb_size_mib}"
    return ["-accel", accel]


def memory_arg(ram_bytes: int, pmem: Sequence[PmemLayer]) -> str:
    """The ``-m`` value: guest RAM, plus room in the device-memory area for the pmem
    regions (``maxmem`` - RAM must cover them; QEMU adds its own 1 GiB per slot of
    alignment slack on top)."""
    if ram_bytes < 64 * _MIB or ram_bytes % _MIB:
        raise InvalidArgument(f"guest RAM of {ram_bytes} bytes: give a whole number of MiB, "
                              "at least 64 MiB (the 6.12 kernel and agent need ~40 MiB)")
    ram = ram_bytes // _MIB
    if not pmem:
        return f"{ram}M"
    extra = sum(p.size for p in pmem) // _MIB
    return f"{ram}M,slots={len(pmem)},maxmem={ram + extra}M"


def device_args(opts: DensityOptions, pmem: Sequence[PmemLayer]) -> list[str]:
    """The pmem regions (lowest layer first: guest ``/dev/pmem0`` is ``pmem[0]``) and the
    balloon device."""
    args: list[str] = []
    if pmem and not opts.pmem_dax:
        raise InvalidArgument("pmem layers were given but pmem_dax is off: attach the "
                              "layers as virtio-blk drives instead")
    for i, p in enumerate(pmem):
        if p.size % PMEM_ALIGN:
            raise InvalidArgument(f"pmem region {p.path} is {p.size} bytes, not a multiple "
                                  f"of {PMEM_ALIGN}: use prepare_pmem_layer")
        backend = (f"memory-backend-file,id=dsec-pm{i},mem-path={_qopt(p.path)},"
                   f"size={p.size},share=on,readonly=on,dump=off")
        args += ["-object", backend,
                 "-device", f"virtio-pmem-pci,memdev=dsec-pm{i},id=dsec-vpm{i}"]
    if opts.free_page_reporting or opts.deflate_on_oom:
        bal = "virtio-balloon-pci,id=dsec-balloon"
        if opts.free_page_reporting:
            bal += ",free-page-reporting=on"
        if opts.deflate_on_oom:
            bal += ",deflate-on-oom=on"
        args += ["-device", bal]
    return args


def qemu_args(opts: DensityOptions, pmem: Sequence[PmemLayer] = (), *,
              ram_bytes: int) -> list[str]:
    """The QEMU arguments density adds to a command line that already has ``-accel`` (use
    :func:`accel_args` or ``tb_size_mib``) and ``-m <ram>``: with pmem regions, a second
    ``-m`` giving ``slots``/``maxmem`` (QEMU merges repeated ``-m`` options, the later
    value winning: measured on 7.2, base memory stays ``ram_bytes`` and the regions are
    plugged), then the pmem regions and the balloon."""
    extra = ["-m", memory_arg(ram_bytes, pmem)] if pmem else []
    return extra + device_args(opts, pmem)


def kernel_cmdline(opts: DensityOptions) -> list[str]:
    """Guest kernel parameters (``-append``). DAMON_RECLAIM is built in, so its module
    parameters are set here and it starts at boot (a VM restored from a memory file keeps
    them). Watermarks 1000/999/0 per mille keep it always active (its defaults only work
    when free memory is under 40%). With pmem regions, ``swiotlb=noforce``: see the module
    doc (64 MiB of bounce buffer nothing uses)."""
    out = ["swiotlb=noforce"] if opts.pmem_dax else []
    if opts.free_page_reporting and opts.page_reporting_order is not None:
        out.append(f"page_reporting.page_reporting_order={opts.page_reporting_order}")
    if not opts.damon_reclaim:
        return out
    p = "damon_reclaim."
    return [*out, f"{p}enabled=Y",
            f"{p}min_age={int(opts.damon_min_age_s * 1_000_000)}",
            f"{p}sample_interval={opts.damon_sample_ms * 1000}",
            f"{p}aggr_interval={opts.damon_aggr_ms * 1000}",
            f"{p}quota_sz={opts.damon_quota_bytes_per_s}",
            f"{p}quota_reset_interval_ms=1000",
            f"{p}wmarks_high=1000", f"{p}wmarks_mid=999", f"{p}wmarks_low=0"]


def guest_layer_devices(opts: DensityOptions, n_layers: int, *, first_blk: int = 0) -> list[str]:
    """The guest device of each layer, lowest first, for the agent's ``setup`` (with
    ``dax=opts.pmem_dax``): ``/dev/pmemN`` in device order, else ``/dev/vdX`` counting
    from the ``first_blk``-th virtio-blk disk."""
    if opts.pmem_dax:
        return [f"/dev/pmem{i}" for i in range(n_layers)]
    if first_blk + n_layers > 26:
        raise InvalidArgument(f"{n_layers} layers do not fit in /dev/vda../dev/vdz")
    return [f"/dev/vd{chr(ord('a') + first_blk + i)}" for i in range(n_layers)]


def guest_struct_page_bytes(pmem: Sequence[PmemLayer]) -> int:
    """Guest RAM the kernel spends on ``struct page`` for the pmem regions."""
    return sum(p.size for p in pmem) // _STRUCT_PAGE_RATIO


def host_overhead_bytes(opts: DensityOptions) -> int:
    """Host memory a VM's QEMU holds beyond guest RAM, for its cgroup limit: the
    translation cache (its cap, or 256 MiB when uncapped: what the default reached in our
    runs is far less, but it is not bounded) plus ~48 MiB of QEMU itself (measured RSS of
    an idle ``-M pc`` QEMU: ~26 MiB of mapped binaries and libraries, ~20 MiB heap)."""
    tb = (opts.tb_size_mib or 256) * _MIB
    return tb + 48 * _MIB
