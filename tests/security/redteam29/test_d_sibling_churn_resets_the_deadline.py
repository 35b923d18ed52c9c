"""The lowering deadline (873cd6e2) counts from ``pending_since``, which
_set_group_limit clears whenever a limit write "succeeds" - including the raise a new
member's join makes - and sets afresh at the next departure. A member that wants to keep
a departed group-mate's share for good only has to create a sandbox of that size (it
joins the pending group: the fullest of its key with room), which "raises" the group to
exactly the limit it already has (the pending flag and the clock are dropped), and
destroy it at once (a new pending period starts from zero). Repeated every grace period
minus a little, the deadline never fires: red team 27 C is open again. The sibling
exists for ~50 ms of every period, so the node's admission counts the held share ~1-5%
of the time.

Repro (pairs, limits_poll_s 0.5, memory_group_grace_s 2): a (32 MiB) and big (96 MiB);
a holds 100 MiB (hog anon); big is destroyed; every 1.5 s a 96 MiB sandbox is created
and destroyed. 9 s later (4.5 grace periods) the group's limit is still 128 MiB and it
still holds ~100 MiB; dsec has killed nothing.

Severity: medium (defeats the deadline with ordinary API calls; the admission pool is
overcommitted by the departed share indefinitely).

Fix: keep the deadline when a join leaves the group's limit where it was (start it on
the first departure and clear it only when the limit actually comes down to the
members' sum, or when the group's usage fits), and/or count a pending group's real limit
(not its members' sum) in the node's admission until it fits.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import _cleanup, new_sid

from .conftest import MIB, group_file, spec

pytestmark = [pytest.mark.root]


@pytest.fixture
async def pairs(tmp_path: object, hog29_images: str) -> AsyncIterator[ContainerBackend]:
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                         images=DirectoryImages(hog29_images), memory_group_size=2,
                         limits_poll_s=0.5, memory_group_grace_s=2.0)
    try:
        yield b
    finally:
        await _cleanup(b)


async def test_d_sibling_churn_does_not_postpone_the_deadline(pairs: ContainerBackend) -> None:
    b = pairs
    notices: list[tuple[str, str, str]] = []
    b.watch(lambda sid, reason, detail: notices.append((sid, reason, detail)))
    a, big = new_sid(), new_sid()
    await b.create(a, spec("p", 32))
    await b.create(big, spec("p", 96))
    gdir = b.memory_group_of(a)
    assert gdir and gdir == b.memory_group_of(big)
    r = await b.exec(a, ExecRequest(shell="hog29 anon 100", timeout_s=30))
    assert r.exit_code == 0, r
    await asyncio.sleep(0.5)
    await b.destroy(big)
    loop = asyncio.get_running_loop()
    end, siblings, joined = loop.time() + 9.0, 0, 0
    while loop.time() < end:
        await asyncio.sleep(1.5)
        sib = new_sid()
        await b.create(sib, spec("p", 96))
        joined += b.memory_group_of(sib) == gdir
        await b.destroy(sib)
        siblings += 1
    limit = group_file(gdir, "memory.limit_in_bytes")
    usage = group_file(gdir, "memory.memsw.usage_in_bytes")
    kills = [n for n in notices if n[1] == "oom_kill"]
    assert limit <= 32 * MIB and usage <= 32 * MIB, (
        f"{a} (memory_bytes 32 MiB) still has a {limit >> 20} MiB limit and holds "
        f"{usage >> 20} MiB 9 s (4.5 x memory_group_grace_s) after its 96 MiB group-mate "
        f"left: {siblings} sibling sandboxes created and destroyed at once ({joined} of "
        f"them joined its group) reset the deadline each time; kills: {len(kills)}")
