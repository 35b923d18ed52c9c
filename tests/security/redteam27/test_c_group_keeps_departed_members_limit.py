"""Red team 26 B's fix lowers a group's limit after a member leaves only "once the group
fits" (memory + swap <= the new sum); until then the group is `pending` and the limits
timer retries. Nothing ever makes it fit: a remaining member that keeps using the
memory its departed group-mate's limit paid for keeps the old, higher limit for as long
as it likes. So a sandbox of memory_bytes 32 MiB holds 100 MiB indefinitely once its
96 MiB group-mate is destroyed - and the node's admission pool released those 96 MiB
with the destroy (it reserves each sandbox's memory_bytes). One group of pairs per
(project, class, index) - a tenant can repeat it for as many groups as it likes: each
lingering group keeps up to (k - 1) x the largest departed member's memory_bytes that
no quota counts.

Repro: a (32 MiB) and b (96 MiB) share a group (128 MiB); a holds 100 MiB of anonymous
memory (allowed: the group's limit); b is destroyed; two limits-timer passes later
(limits_poll_s 0.5) the group's limit is still 128 MiB and a still holds 100 MiB.

Fix: a pending lowering has a deadline: after a grace period reclaim the group down to
the new sum (write the limit, which reclaims or swaps; on EBUSY OOM-kill within the
group, as any memory limit does), and count a pending group's real limit, not its
members' sum, in the node's accounting until then.
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
async def fast(tmp_path: object, hog_images: str) -> AsyncIterator[ContainerBackend]:
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                         images=DirectoryImages(hog_images), memory_group_size=2,
                         limits_poll_s=0.5, memory_group_grace_s=1.0)
    try:
        yield b
    finally:
        await _cleanup(b)


async def test_a_departed_members_limit_is_taken_back(fast: ContainerBackend) -> None:
    b = fast
    notices: list[tuple[str, str, str]] = []
    b.watch(lambda sid, reason, detail: notices.append((sid, reason, detail)))
    a, big = new_sid(), new_sid()
    await b.create(a, spec("p", 32))
    await b.create(big, spec("p", 96))
    gdir = b.memory_group_of(a)
    assert gdir and gdir == b.memory_group_of(big)
    r = await b.exec(a, ExecRequest(shell="hog anon 100", timeout_s=30))
    assert r.exit_code == 0, r
    await asyncio.sleep(0.5)
    await b.destroy(big)
    # the fix: past memory_group_grace_s the group is made to fit - reclaim, then the
    # process holding the most over its sandbox's own share (a's hog) is killed
    deadline = asyncio.get_running_loop().time() + 15
    while True:
        limit = group_file(gdir, "memory.limit_in_bytes")
        usage = group_file(gdir, "memory.usage_in_bytes")
        if (limit <= 32 * MIB and usage <= 32 * MIB) \
                or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.25)
    alive = (await b.exec(a, ExecRequest(argv=("true",), timeout_s=30))).exit_code
    assert limit <= 32 * MIB and usage <= 32 * MIB, (
        f"{a} (memory_bytes 32 MiB) alone in {os.path.basename(gdir)} 15 s after its "
        f"96 MiB group-mate was destroyed: the group's limit is {limit >> 20} MiB and it "
        f"holds {usage >> 20} MiB (its `true`: exit {alive}); the admission pool "
        f"released the 96 MiB at the destroy")
    assert alive == 0        # the hog was killed, not the sandbox
    kills = [n for n in notices if n[1] == "oom_kill"]
    assert len(kills) == 1 and kills[0][0] == a and "dsec killed process" in kills[0][2], \
        notices
    assert group_file(gdir, "memory.memsw.limit_in_bytes") == limit
