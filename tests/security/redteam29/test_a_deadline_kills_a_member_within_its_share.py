"""The lowering deadline (873cd6e2) picks its victim by RSS + swap of each member's
processes (memgroups.pick_victim). Memory no process maps - SysV shm segments left
detached, message queues, tmpfs pages, which every member may pin up to ~69% of its
memory_bytes (pinned_budget: shm 1/4, tmpfs 1/4, msg 1/8, sem 1/16) - counts in the
group's memory + swap but in no member's figure. So a member can hold far more than its
share while its processes stay just under it; when no member looks "over",
pick_victim falls back to "the group's largest process", and that is the group-mate that
kept within its share but runs one bigger process.

Repro (groups of 3, limits_poll_s 0.5, memory_group_grace_s 1): a, b, c of 64 MiB
share a group (192 MiB). a pins 15 MiB of detached SysV shm + 7 MiB of message queues
and runs five 12 MiB processes (60 MiB of RSS: "under" its 64 MiB; it really holds
~82 MiB); b runs one 52 MiB process (within its 64 MiB). c is destroyed: the group must
go down to 128 MiB and holds ~134 MiB. Past the deadline dsec kills b's process - the
one sandbox that stayed within its share - and sends b an oom_kill notice blaming it
("this sandbox's processes held ... against its memory_bytes"); a keeps its 82 MiB.

Why it matters: any sandbox can have dsec SIGKILL its group-mate's work on demand (the
group-mates are other sandboxes of the project: other jobs, often other users), while
itself staying over its share; the notice tells the victim it was the culprit.

Severity: medium (cross-sandbox kill of an innocent member; availability + misleading
attribution).

Fix: count a member's pinned memory in its figure (its ipc namespace's shm/msg, its
tmpfs usage by statfs, all of which dsec already caps per member), and use PSS rather
than RSS; never fall back to another member's processes while some member's
(processes + pinned) total is over its share; if nothing can be attributed, kill the
member whose pinned + process total is largest relative to its share, not the largest
process.
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
async def threes(tmp_path: object, hog29_images: str) -> AsyncIterator[ContainerBackend]:
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                         images=DirectoryImages(hog29_images), memory_group_size=3,
                         limits_poll_s=0.5, memory_group_grace_s=1.0)
    try:
        yield b
    finally:
        await _cleanup(b)


async def test_a_deadline_spares_the_member_within_its_share(threes: ContainerBackend) -> None:
    b = threes
    notices: list[tuple[str, str, str]] = []
    b.watch(lambda sid, reason, detail: notices.append((sid, reason, detail)))
    a, good, c = new_sid(), new_sid(), new_sid()
    for sid in (a, good, c):
        await b.create(sid, spec("p", 64))
    gdir = b.memory_group_of(a)
    assert gdir and gdir == b.memory_group_of(good) == b.memory_group_of(c)
    r = await b.exec(a, ExecRequest(shell="hog shm 8 7 && hog msg 7 && for i in 1 2 3 4 5;"
                                    " do hog29 anon 12; done", timeout_s=30))
    assert r.exit_code == 0, r
    r = await b.exec(good, ExecRequest(shell="hog29 anon 52", timeout_s=30))
    assert r.exit_code == 0, r
    await asyncio.sleep(1.0)
    good_pids = set(b.governor.pids(b._boxes[good].cg))
    used = group_file(gdir, "memory.memsw.usage_in_bytes")
    assert used > 128 * MIB, f"setup: the group holds only {used >> 20} MiB"
    await b.destroy(c)
    await asyncio.sleep(6.0)     # ~10 limits ticks past the 1 s deadline
    left = set(b.governor.pids(b._boxes[good].cg))
    killed = [n for n in notices if n[1] == "oom_kill" and n[0] == good]
    assert not killed and good_pids <= left, (
        f"{good} (memory_bytes 64 MiB, one 52 MiB process: within its share) lost "
        f"{sorted(good_pids - left)} to the lowering deadline, while {a} holds ~82 MiB "
        f"(22 MiB in detached shm/msg queues no process maps + 60 MiB of RSS); the "
        f"notice blamed it: {killed[:1]}")
