"""Suite ``snapshot``: sandbox snapshots end to end on the container backend.

Measured through :class:`~dsec.edge.node.EdgeNode` with the layer store
(:class:`~dsec.edge.backends.container.images.StoreImages`), i.e. what ``POST /v1/sandboxes/{id}/snapshot``
costs on the edge: the freeze, pack_diff's scan, the EROFS build of the diff, the thaw.

- ``snapshot_unchanged``: snapshots of a sandbox that changed nothing since its last one
  (the scan only; returns the previous snapshot), with ``files`` entries in its upperdir.
- ``snapshot_step``: one agent-like step (write one small file) then a snapshot: a new
  layer of a few KiB in the chain.
- ``create_from_snapshot`` vs ``create_from_image``: sandbox creation from the tip of a
  chain (``chain`` layers above the image) vs from the image alone.
- ``snapshot_sparse_bytes_written``: bytes the layer store grew by for a snapshot of a
  sandbox (64 MiB disk cap) holding a 1 GiB sparse file with 4 KiB of data (holes are
  kept: chunk-based EROFS, zero chunks stored once); ``snapshot_sparse_s`` its time.

Needs root (namespaces, cgroups, mounts); skipped with a note otherwise.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import tempfile
import time

from dsec.bench import BenchContext, suite
from dsec.rmtree import remove_tree


@suite("snapshot")
def snapshot_suite(ctx: BenchContext) -> None:
    """Container sandbox snapshots: unchanged, per step, and creating from a chain."""
    if os.geteuid() != 0:
        ctx.note("snapshot: skipped (needs root for containers)")
        return
    asyncio.run(_run(ctx))


async def _run(ctx: BenchContext) -> None:
    from dsec.edge.admission import Capacity
    from dsec.edge.backends.container import ContainerBackend
    from dsec.edge.backends.container.images import StoreImages
    from dsec.edge.node import EdgeNode, NodeConfig
    from dsec.image import LayerStore, MountCache, ensure_busybox_base
    from dsec.image.packdiff import RACY_WINDOW_NS
    from dsec.wire.spec import ExecRequest, SandboxSpec

    root = tempfile.mkdtemp(prefix="dsec-bench-snap-")
    cache = MountCache()
    store = LayerStore(os.path.join(root, "layers"))
    store.tag(ensure_busybox_base(store).digest, "base")
    backend = ContainerBackend(root_dir=os.path.join(root, "c"),
                               images=StoreImages(store, cache))
    node = EdgeNode(NodeConfig(node_id="bench", capacity=Capacity(
        cpu_milli=10**6, memory_bytes=1 << 40, max_sandboxes=1000)), backend,
        rng=random.Random(1))
    spec = {"backend": "container", "memory_bytes": 256 << 20}
    try:
        await node.start()
        files = ctx.scale(200, 50)
        sb = await node.create(SandboxSpec(image="base", **spec))  # type: ignore[arg-type]
        await node.exec(sb.id, ExecRequest(shell=(
            f"mkdir -p /work/repo && cd /work/repo && for i in $(seq {files}); do "
            "echo line $i > f$i.txt; done"), timeout_s=60))
        await node.snapshot(sb.id)
        await asyncio.sleep(RACY_WINDOW_NS / 1e9 + 0.02)   # out of the racy window
        await node.snapshot(sb.id)

        n = ctx.scale(200, 30)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            info = await node.snapshot(sb.id)
            times.append(time.perf_counter() - t0)
            assert info.unchanged
        ctx.record("snapshot_unchanged", statistics.median(times) * 1e3, "ms",
                   files=files + 2, n=n)

        steps = ctx.scale(40, 8)
        times = []
        for i in range(steps):
            await node.exec(sb.id, ExecRequest(shell=f"echo step {i} >> /work/repo/log.txt"))
            t0 = time.perf_counter()
            await node.snapshot(sb.id)
            times.append(time.perf_counter() - t0)
        ctx.record("snapshot_step", statistics.median(times) * 1e3, "ms", steps=steps,
                   files=files + 3)
        tip = (await node.snapshot(sb.id)).id
        chain = len(store.lowers(store.get(tip))) - 1

        m = ctx.scale(30, 8)
        for label, make in (("create_from_image", SandboxSpec(image="base", **spec)),  # type: ignore[arg-type]
                            ("create_from_snapshot", SandboxSpec(snapshot=tip, **spec))):  # type: ignore[arg-type]
            times = []
            for _ in range(m):
                t0 = time.perf_counter()
                s = await node.create(make)
                times.append(time.perf_counter() - t0)
                await node.destroy(s.id)
            ctx.record(label, statistics.median(times) * 1e3, "ms", n=m,
                       chain=chain if label.endswith("snapshot") else 0)
        sparse = await node.create(SandboxSpec(image="base", disk_bytes=64 << 20, **spec))  # type: ignore[arg-type]
        await node.exec(sparse.id, ExecRequest(shell=(
            "mkdir -p /work && dd if=/dev/urandom of=/work/sparse bs=4096 count=1 "
            "seek=262143 2>/dev/null"), timeout_s=60))
        before = _store_bytes(store.root)
        t0 = time.perf_counter()
        await node.snapshot(sparse.id)
        took = time.perf_counter() - t0
        ctx.record("snapshot_sparse_bytes_written", _store_bytes(store.root) - before, "bytes",
                   apparent_bytes=1 << 30, used_bytes=4096, disk_cap_bytes=64 << 20)
        ctx.record("snapshot_sparse_s", took, "s", apparent_bytes=1 << 30)
        await node.destroy(sparse.id)
        ctx.note("snapshot: container backend through EdgeNode with the layer store "
                 "(StoreImages), median per call. unchanged = freeze + lstat of each upperdir "
                 "entry + thaw; step = one appended line, then freeze, scan, copy of the "
                 "changed entries, mkfs.erofs of the diff (a subprocess: most of the cost), "
                 "sha256, thaw. create_from_snapshot mounts every layer of the chain (shared "
                 "mounts are reused) under one overlay.")
    finally:
        ids = [i.id for i in node.list()]
        if ids:
            await node.destroy_many(ids)
        await node.close()
        cache.close()
        backend.governor.remove_base()
        remove_tree(root)


def _store_bytes(root: str) -> int:
    """Bytes allocated under the layer store (layers, manifests, indexes)."""
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total
