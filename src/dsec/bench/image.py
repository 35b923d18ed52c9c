"""Suite ``image``: layer builds, EROFS+overlay roots vs tar extraction, on-demand reads,
pack_diff snapshot and apply rates. All on real files, mounts and the machine's disk."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import random
import resource
import subprocess
import tempfile
import time
from collections.abc import Iterator

from dsec.bench import BenchContext, suite
from dsec.image.compose import RootStack, compose, mount_root
from dsec.image.erofs import hash_file, mkfs_erofs
from dsec.image.manifest import LayerManifest
from dsec.image.mount import MountCache
from dsec.image.packdiff import restore_stack, snapshot
from dsec.image.store import LayerStore
from dsec.rmtree import remove_tree

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]


def _make_tree(root: str, total_bytes: int, rng: random.Random) -> list[str]:
    """A source-tree-like mix: many small files, some large; half random, half text."""
    files: list[str] = []
    text = b"def handler(event, context):\n    return {'status': 200, 'body': event}\n" * 64
    written = 0
    i = 0
    while written < total_bytes:
        d = os.path.join(root, f"pkg{i % 37}", f"mod{i % 11}")
        os.makedirs(d, exist_ok=True)
        size = rng.choice([2_000, 8_000, 16_000, 64_000]) if i % 10 else rng.randint(
            256_000, 4_000_000)
        data = rng.randbytes(size) if rng.random() < 0.5 else (text * (size // len(text) + 1))[:size]
        path = os.path.join(d, f"f{i}.bin")
        with open(path, "wb") as f:
            f.write(data)
        files.append(path)
        written += size
        i += 1
    return files


def _io() -> dict[str, int]:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k.strip()] = int(v)
    return out


def _block_sectors() -> tuple[int, int]:
    """(sectors read, sectors written) summed over whole disks (not partitions)."""
    r = w = 0
    for dev in os.listdir("/sys/block"):
        if dev.startswith(("loop", "ram", "zram", "dm-")):
            continue
        try:
            with open(f"/sys/block/{dev}/stat") as f:
                fields = f.read().split()
        except OSError:
            continue
        r += int(fields[2])
        w += int(fields[6])
    return r, w


def _resident_bytes(path: str) -> int:
    """Bytes of ``path`` in the page cache (mincore over a read-only mapping)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    page = mmap.PAGESIZE
    n = (size + page - 1) // page
    vec = (ctypes.c_ubyte * n)()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, ctypes.c_size_t(size), mmap.PROT_READ, mmap.MAP_SHARED, fd,
                          ctypes.c_long(0))
        if addr in (None, ctypes.c_void_p(-1).value):
            return -1
        try:
            if _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
                return -1
        finally:
            _libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    finally:
        os.close(fd)
    return sum(1 for b in vec if b & 1) * page


@contextlib.contextmanager
def _workdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="dsec-bench-image-", dir="/var/tmp")
    try:
        yield d
    finally:
        # sandbox roots first (deepest mount first), then the tree
        with open("/proc/self/mountinfo") as f:
            targets = [ln.split(" ")[4] for ln in f if f" {d}/" in ln]
        for t in sorted(targets, key=len, reverse=True):
            subprocess.run(["umount", "-l", t], check=False)
        remove_tree(d)


@suite("image")
def image_suite(ctx: BenchContext) -> None:
    """EROFS layer build, sandbox rootfs prep vs tar, on-demand reads, pack_diff rates."""
    image_mb = ctx.scale(100, 16)
    n_roots = ctx.scale(50, 10)
    with _workdir() as work, MountCache() as cache:
        store = LayerStore(os.path.join(work, "store"))
        src = os.path.join(work, "src")
        files = _make_tree(src, image_mb * 10**6, random.Random(7))
        content = sum(os.path.getsize(p) for p in files)

        # -- layer_build -----------------------------------------------------------------
        # Side by side on the same tree (issue 15: reproducible within 10% of before):
        # mkfs.erofs + sha256 as LayerStore.add_tree runs them, with the fixed UUID and
        # build time (``reproducible: true``, what the store does) and with mkfs.erofs'
        # own random ones (the old behaviour), alternating, best of three each.
        base: LayerManifest | None = None
        for comp in (None, "lz4"):
            best: dict[bool, float] = {True: float("inf"), False: float("inf")}
            size = 0
            for i in range(6):
                repro = i % 2 == 0
                out = os.path.join(work, f"build-{i}.erofs")
                t0 = time.perf_counter()
                mkfs_erofs(src, out, compression=comp, reproducible=repro)
                hash_file(out)
                best[repro] = min(best[repro], time.perf_counter() - t0)
                size = os.path.getsize(out)
                os.unlink(out)
            for repro in (True, False):
                ctx.record("layer_build", content / best[repro] / 1e6, "MB/s",
                           compression=comp or "none", reproducible=repro,
                           tree_mb=round(content / 1e6), image_mb=round(size / 1e6, 1))
            m = store.add_tree(src, kind="base", compression=comp)
            if comp is None:
                base = m
        assert base is not None
        stack = compose(base)

        # -- image_prune: N unreferenced layers among named ones ---------------------------
        n_garbage = ctx.scale(200, 50)
        gstore = LayerStore(os.path.join(work, "gc-store"))
        tiny = os.path.join(work, "tiny")
        os.mkdir(tiny)
        for i in range(n_garbage + 10):
            with open(os.path.join(tiny, "f"), "w") as f:
                f.write(str(i))
            gstore.add_tree(tiny, kind="base", name="keep" if i >= n_garbage else None,
                            tag=str(i))
        t0 = time.perf_counter()
        plan = gstore.prune(dry_run=True)
        t_dry = time.perf_counter() - t0
        t0 = time.perf_counter()
        done = gstore.prune()
        t_prune = time.perf_counter() - t0
        assert len(plan.removed) == len(done.removed) == n_garbage
        ctx.record("image_prune", t_prune * 1e3, "ms", layers=n_garbage + 10,
                   removed=n_garbage, dry_run_ms=round(t_dry * 1e3, 2))

        # -- sandbox_rootfs_erofs_vs_tar ---------------------------------------------------
        tar_path = os.path.join(work, "image.tar")
        subprocess.run(["tar", "-C", src, "-cf", tar_path, "."], check=True)
        os.sync()
        io0, blk0 = _io()["write_bytes"], _block_sectors()[1]
        t0 = time.perf_counter()
        roots = [mount_root(store, cache, stack, os.path.join(work, f"sb{i}"))
                 for i in range(n_roots)]
        t_erofs = time.perf_counter() - t0
        os.sync()
        t_erofs_sync = time.perf_counter() - t0
        w_erofs = _io()["write_bytes"] - io0
        blk_erofs = (_block_sectors()[1] - blk0) * 512
        for r in roots:
            r.unmount()

        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN).ru_oublock
        blk0 = _block_sectors()[1]
        t0 = time.perf_counter()
        for i in range(n_roots):
            d = os.path.join(work, f"tar{i}")
            os.mkdir(d)
            subprocess.run(["tar", "-C", d, "-xf", tar_path], check=True)
        t_tar = time.perf_counter() - t0
        os.sync()
        t_tar_sync = time.perf_counter() - t0
        w_tar = (resource.getrusage(resource.RUSAGE_CHILDREN).ru_oublock - ru0) * 512
        blk_tar = (_block_sectors()[1] - blk0) * 512
        for i in range(n_roots):
            remove_tree(os.path.join(work, f"tar{i}"))
        p = {"n": n_roots, "image_mb": round(content / 1e6)}
        ctx.record("rootfs_erofs_prep", t_erofs / n_roots * 1e3, "ms/root", **p)
        ctx.record("rootfs_tar_prep", t_tar / n_roots * 1e3, "ms/root", **p)
        ctx.record("rootfs_speedup", t_tar / t_erofs, "x", **p)
        ctx.record("rootfs_speedup_durable", t_tar_sync / t_erofs_sync, "x",
                   note="including os.sync() of what was written", **p)
        ctx.record("rootfs_erofs_bytes_written", max(w_erofs, blk_erofs), "bytes",
                   proc_io=w_erofs, block_dev=blk_erofs, **p)
        ctx.record("rootfs_tar_bytes_written", max(w_tar, blk_tar), "bytes",
                   rusage=w_tar, block_dev=blk_tar, **p)
        ctx.record("rootfs_bytes_ratio", max(w_tar, blk_tar) / max(w_erofs, blk_erofs, 4096),
                   "x", note="tar / erofs; erofs floor 4 KiB", **p)
        ctx.note("rootfs: EROFS prep = N overlay mounts over one shared, already verified "
                 "layer mount (first root pays sha256 + mount); tar prep = GNU tar -x per "
                 "root. Bytes: /proc/self/io write_bytes (tar: rusage ru_oublock) and "
                 "/sys/block sectors written across os.sync(), the larger of the two.")

        # -- ondemand_fraction -----------------------------------------------------------
        layer_file = store.layer_path(base)
        by_size = sorted(files, key=os.path.getsize)
        mid = len(by_size) * 3 // 4              # "a few files" of a few tens of KB each
        picks = by_size[mid: mid + 5]
        want = sum(os.path.getsize(p) for p in picks)
        with open(layer_file, "rb") as f:
            os.fdatasync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        resident0 = _resident_bytes(layer_file)
        r0, blkr0 = _io()["read_bytes"], _block_sectors()[0]
        root = mount_root(store, cache, stack, os.path.join(work, "od"))   # fresh EROFS mount
        try:
            got = 0
            for pth in picks:
                with open(os.path.join(root.target, os.path.relpath(pth, src)), "rb") as f:
                    got += len(f.read())
        finally:
            root.unmount()
        read_io = _io()["read_bytes"] - r0
        read_blk = (_block_sectors()[0] - blkr0) * 512
        resident = _resident_bytes(layer_file) - resident0
        fraction_src = max(read_io, resident)
        ctx.record("ondemand_fraction", 100 * fraction_src / base.size_bytes, "% of image",
                   files=len(picks), file_bytes=want, image_bytes=base.size_bytes,
                   proc_read_bytes=read_io, block_read_bytes=read_blk,
                   page_cache_bytes=resident)
        ctx.note("ondemand: the layer file's pages are dropped (fadvise DONTNEED) and the "
                 "layer remounted; figure = max(/proc/self/io read_bytes, newly cached "
                 "pages of the image file via mincore) / image size.")

        # -- packdiff_snapshot / packdiff_apply --------------------------------------------
        sbdir = os.path.join(work, "pd")
        root = mount_root(store, cache, stack, sbdir)
        try:
            n_small = ctx.scale(1000, 200)
            for i in range(n_small):
                d = os.path.join(root.target, "work", f"d{i % 20}")
                os.makedirs(d, exist_ok=True)
                with open(os.path.join(d, f"s{i}"), "wb") as f:
                    f.write(b"x" * 100)
            time.sleep(0.06)                     # leave the racy window
            s1 = snapshot(store, root.upper, base=stack)
            n, t0 = 0, time.perf_counter()
            budget = 0.3 if ctx.quick else 1.5
            while time.perf_counter() - t0 < budget:
                assert snapshot(store, root.upper, s1) is s1
                n += 1
            ctx.record("packdiff_snapshot_unchanged", n / (time.perf_counter() - t0),
                       "snapshots/s", upper_entries=n_small + 21)
            changed_mb = ctx.scale(100, 16)
            rng = random.Random(3)
            for i in range(changed_mb):
                with open(os.path.join(root.target, "work", f"big{i}"), "wb") as f:
                    f.write(rng.randbytes(10**6))
            t0 = time.perf_counter()
            s2 = snapshot(store, root.upper, s1)
            dt = time.perf_counter() - t0
            ctx.record("packdiff_snapshot_changed", changed_mb / dt, "MB/s",
                       changed_mb=changed_mb, seconds=round(dt, 3))
        finally:
            root.unmount()
        snap_stack: RootStack = restore_stack(store, s2)
        # warm: the chain's layers stay mounted on the node (another sandbox holds them)
        holder = mount_root(store, cache, snap_stack, os.path.join(work, "hold"))
        try:
            n, t0 = 0, time.perf_counter()
            budget = 0.3 if ctx.quick else 1.5
            while time.perf_counter() - t0 < budget:
                r = mount_root(store, cache, restore_stack(store, s2),
                               os.path.join(work, f"ap{n}"))
                r.unmount()
                n += 1
            ctx.record("packdiff_apply", n / (time.perf_counter() - t0), "restores/s",
                       chain=len(snap_stack.layers), layers_warm=True)
        finally:
            holder.unmount()
        t0 = time.perf_counter()
        r = mount_root(store, cache, restore_stack(store, s2), os.path.join(work, "cold"))
        r.unmount()
        ctx.record("packdiff_apply_cold", 1 / (time.perf_counter() - t0), "restores/s",
                   chain=len(snap_stack.layers), note="layers mounted for it (verified once)")
        ctx.note("packdiff: unchanged = lstat of every upperdir entry compared to the "
                 "previous snapshot's index (no reads); changed = copy + mkfs.erofs + sha256;"
                 " apply = resolve the chain + one overlay mount + unmount.")

        # -- image_pull, image_first_exec_s (registry pulls, issue 15) ---------------------
        from dsec.bench._image_pull import pull_bench
        pull_bench(ctx, work)
    _build_figures(ctx)


def _build_figures(ctx: BenchContext) -> None:
    """``image_build_cached_ms``: a rebuild of a recipe whose every step is in the step
    cache (one snapshot listing + one image lookup, nothing runs); ``image_build_step``:
    what a layer step costs above its command's own run time (build sandbox create, exec
    round trip, pack_diff snapshot, destroy), on a one-edge container cluster."""
    import statistics

    from dsec.client.build import Image
    from dsec.cluster.local import LocalCluster

    n_steps = ctx.scale(8, 4)
    with tempfile.TemporaryDirectory(prefix="dsec-bench-build-") as tmp, \
            LocalCluster(edges=1, backend="container") as cl, cl.client() as c:
        with open(os.path.join(tmp, "data.txt"), "w") as f:
            f.write("x" * 4096)
        image = Image.from_image("base").copy(tmp, "/data")
        for i in range(n_steps - 1):
            image = image.run(f"echo {i} > /step{i}")
        built = image.build(c)
        over = [s - cmd for s, cmd in zip(built.step_seconds, built.command_seconds,
                                           strict=True)]
        ctx.record("image_build_step", statistics.mean(over) * 1e3, "ms/step",
                   steps=n_steps, note="overhead above the command's own run time")
        times = []
        for _ in range(ctx.scale(20, 5)):
            again = image.build(c)
            assert again.ran == 0 and again.cached == n_steps
            times.append(again.seconds * 1e3)
        ctx.record("image_build_cached_ms", statistics.median(times), "ms",
                   steps=n_steps, note="every step cached: nothing runs")

