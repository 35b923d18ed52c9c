"""The lowering deadline's forced attempt (Governor.set_group_memory(force=True), from
_make_group_fit on the limits timer) writes memory.limit_in_bytes below the group's
usage synchronously on the edge's asyncio loop. The kernel's v1 resize loops reclaim in
that write() until the usage fits or reclaim makes no progress; a member whose processes
keep touching their pages (each one swapped out is faulted straight back in) keeps it
making "progress", so one write takes hundreds of ms to over a second - every limits
tick, for as long as the group stays pending (test B keeps it pending for ever), once per
such group. Meanwhile nothing else the edge does runs: creates, execs, destroys, OOM and
init-exit events of every sandbox on the node. And it buys nothing: limit and memsw are
equal, so anon pushed to swap still counts in memsw and its write is refused anyway -
the write's only effect is to push every member's working set (the innocent ones' too)
to swap each tick.

Repro (pairs, limits_poll_s 0.5, memory_group_grace_s 1): a (32 MiB) and big (96 MiB);
a runs `hog29 share 100 4 churn` (100 MiB of MAP_SHARED memory, four children writing it
round and round, each replaced when killed); big is destroyed. Over the next 8 s an
asyncio task sleeping 10 ms at a time measures the loop's stalls: the longest is well
over 250 ms (seen: 0.39-1.1 s per stall on this 2-CPU host, one group).

Severity: medium (any tenant, per group it controls, stalls the node's whole control
plane; with a few groups the loop is never free).

Fix: never reclaim on the loop - do the forced write in a worker thread (asyncio.to_thread,
one at a time per group), and only when it can work: with memsw == limit, reclaim can
only help by dropping page cache, so skip the forced write when memsw usage minus the
group's reclaimable page cache (memory.stat total_inactive_file + total_active_file) is
still over the new sum, and go straight to the kill.
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
async def pairs(tmp_path: object, hog29_images: str) -> AsyncIterator[ContainerBackend]:
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                         images=DirectoryImages(hog29_images), memory_group_size=2,
                         limits_poll_s=0.5, memory_group_grace_s=1.0)
    try:
        yield b
    finally:
        await _cleanup(b)


async def test_c_the_deadline_never_stalls_the_edge_loop(pairs: ContainerBackend) -> None:
    b = pairs
    a, big = new_sid(), new_sid()
    await b.create(a, spec("p", 32))
    await b.create(big, spec("p", 96))
    gdir = b.memory_group_of(a)
    assert gdir and gdir == b.memory_group_of(big)
    r = await b.exec(a, ExecRequest(shell="hog29 share 100 4 churn", timeout_s=30))
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
        f"{os.path.basename(gdir)}'s limit on it: one tenant's churning memory in one "
        f"group blocks every create/exec/destroy on the node")
