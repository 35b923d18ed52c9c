"""The lowering deadline (873cd6e2) kills one process per limits tick, "the largest" by
VmRSS + VmSwap, and expects that to free memory. Pages a process shares (MAP_SHARED
anonymous memory, a tmpfs/shm file mapped by several processes) show in every mapper's
VmRSS but are charged once and freed only with the last mapping. A member keeps a small
supervisor holding a 100 MiB MAP_SHARED mapping (its own page tables dropped, so its
RSS is tiny) and three children that fault the pages in (100 MiB RSS each); a killed
child is replaced at once. Every tick dsec kills a child (the largest of the member most
"over"), nothing is freed, the supervisor - never the largest - forks another: the group
never fits, its limit never comes down, and dsec sends an oom_kill every tick for ever.
Red team 27 C (a member keeps its departed group-mate's share for good) is open again,
with an endless kill loop on top.

Repro (pairs, limits_poll_s 0.5, memory_group_grace_s 1): a (32 MiB) and big (96 MiB)
share a 128 MiB group; a runs `hog29 share 100 3`; big is destroyed. 10 s later (~18
ticks past the deadline) the group's limit is still 128 MiB, it still holds ~100 MiB,
and dsec has "killed" a's processes every tick.

Severity: medium (the deadline's purpose - the admission pool released the departed
share - is defeated by any tenant; an unbounded SIGKILL/notice loop per group).

Fix: judge a kill by what it freed (memory.memsw.usage_in_bytes before/after): if a
kill freed nothing, escalate within the member - kill its whole process tree, or the
sandbox (its init) - rather than the next "largest" process; use PSS (smaps_rollup
Pss + SwapPss) rather than RSS so shared pages are not counted N times; cap the number
of deadline kills per member.
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
                         limits_poll_s=0.5, memory_group_grace_s=1.0)
    try:
        yield b
    finally:
        await _cleanup(b)


async def test_b_deadline_makes_a_shared_memory_group_fit(pairs: ContainerBackend) -> None:
    b = pairs
    notices: list[tuple[str, str, str]] = []
    b.watch(lambda sid, reason, detail: notices.append((sid, reason, detail)))
    kills: list[int] = []
    real_kill = b._kill_member_proc

    def counting_kill(box: object, pid: int) -> bool:
        ok = real_kill(box, pid)  # type: ignore[arg-type]
        if ok:
            kills.append(pid)
        return ok

    b._kill_member_proc = counting_kill  # type: ignore[method-assign]
    a, big = new_sid(), new_sid()
    await b.create(a, spec("p", 32))
    await b.create(big, spec("p", 96))
    gdir = b.memory_group_of(a)
    assert gdir and gdir == b.memory_group_of(big)
    r = await b.exec(a, ExecRequest(shell="hog29 share 100 3", timeout_s=30))
    assert r.exit_code == 0, r
    await asyncio.sleep(1.5)
    await b.destroy(big)
    await asyncio.sleep(10.0)
    limit = group_file(gdir, "memory.limit_in_bytes")
    usage = group_file(gdir, "memory.memsw.usage_in_bytes")
    assert limit <= 32 * MIB and usage <= 32 * MIB, (
        f"{a} (memory_bytes 32 MiB) alone in {os.path.basename(gdir)} 10 s after its 96 MiB "
        f"group-mate left (deadline 1 s): the limit is still {limit >> 20} MiB, it holds "
        f"{usage >> 20} MiB; dsec SIGKILLed {len(kills)} of a's processes meanwhile "
        f"(pids {kills[:6]}...), each freeing nothing; oom_kill notices: "
        f"{sum(1 for n in notices if n[1] == 'oom_kill')}")
    # the whole member went (a kill of one process freed nothing): its death is an
    # event with the reason, not a backend crash
    deaths = [n for n in notices if n[0] == a and n[1] in ("oom", "backend_crash")]
    assert deaths and deaths[-1][1] == "oom" and "dsec killed every process" in deaths[-1][2], \
        deaths
