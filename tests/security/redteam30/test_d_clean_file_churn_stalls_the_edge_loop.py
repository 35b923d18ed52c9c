"""Red team 29 C's fix (14a6fdb3) does the forced lowering only when the group's memory
+ swap usage less its "clean file cache" (memory.stat total_{in,}active_file - dirty -
writeback) fits the new limit - "the write only drops clean cache: ~1 ms per 100 MiB"
- and still does that write synchronously on the edge's event loop. But clean file cache
is not free to drop when it is *mapped and in use*: a member whose processes map a file
from its (disk-backed overlay) rootfs and read every page round and round refaults each
page the kernel reclaims, so v1's resize loop (mem_cgroup_resize_max: retry while
reclaim makes progress) keeps "making progress" and the write() takes seconds, now with
disk reads per refault. Same stall as 29 C, through the door the fix left open.

Repro (pairs, limits_poll_s 0.5, memory_group_grace_s 1): a (32 MiB) and big (96 MiB);
a runs `hog30 filechurn /root/f 100 4` (writes and fsyncs a 100 MiB file, maps it
read-only MAP_SHARED, 4 children read it round and round: ~100 MiB of clean file
cache); big is destroyed. An asyncio task sleeping 10 ms at a time measures the loop's
stalls over 8 s: seen 0.49-2.4 s in one stall (2-CPU host, one group).

Why it matters: any tenant, with two sandboxes in one group (destroy one), stalls the
node's whole control plane (creates, execs, destroys, OOM/exit events of every sandbox)
for seconds per group it controls.

Severity: medium (control-plane availability, node-wide).

Fix: never write a lowering limit on the loop - do the forced write in a worker thread
(asyncio.to_thread, one per group at a time, the _fitting guard already exists); do not
count *mapped* file pages as droppable (memory.stat total_mapped_file), or bound the
attempt (write an intermediate limit in steps / use memory.force_empty-like bounded
reclaim) and fall through to the kill when it does not converge.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import _cleanup, new_sid

from .conftest import spec

pytestmark = [pytest.mark.root]


@pytest.fixture
async def pairs(tmp_path: object, hog30_images: str) -> AsyncIterator[ContainerBackend]:
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                         images=DirectoryImages(hog30_images), memory_group_size=2,
                         limits_poll_s=0.5, memory_group_grace_s=1.0)
    try:
        yield b
    finally:
        await _cleanup(b)


async def test_d_the_deadline_never_stalls_the_edge_loop(pairs: ContainerBackend) -> None:
    b = pairs
    a, big = new_sid(), new_sid()
    await b.create(a, spec("p", 32))
    await b.create(big, spec("p", 96))
    gdir = b.memory_group_of(a)
    assert gdir and gdir == b.memory_group_of(big)
    r = await b.exec(a, ExecRequest(shell="hog30 filechurn /root/f 100 4", timeout_s=30))
    assert r.exit_code == 0, r
    await asyncio.sleep(1.5)
    await b.destroy(big)
    loop = asyncio.get_running_loop()
    stalls: list[float] = []
    end = loop.time() + 8.0
    while loop.time() < end:
        t = loop.time()
        await asyncio.sleep(0.01)
        stalls.append(loop.time() - t - 0.01)
    worst = max(stalls)
    long_ = sum(1 for s in stalls if s > 0.1)
    assert worst < 0.25, (
        f"the edge's event loop stalled {worst:.2f} s at worst ({long_} stalls over "
        f"100 ms in 8 s) while the lowering deadline force-wrote "
        f"{os.path.basename(gdir)}'s limit on it: a member's clean but mapped, in-use "
        f"file cache (counted as droppable) keeps v1's resize loop reclaiming")
