"""The lowering deadline (14a6fdb3) weighs a member by its processes' PSS + SwapPss and
what it "pins with no process" - detached SysV shm, message queues, and statvfs of its
/tmp. Shared memory that is charged to the group but is in none of those escapes every
figure: a memfd (or a MAP_SHARED anonymous region after MADV_DONTNEED, or a shm segment
attached by a process that never faults it in) that a process keeps open but never
maps. Its pages are shmem (swap-backed, not "clean cache": the forced lowering is not
tried), in no process's PSS, not SysV, not in /tmp. (Smaller doors of the same kind:
files in /dev/shm and /dev, which are tmpfs mounts of their own - _member_pinned statvfs's
only /tmp; pipe buffers and other kernel memory charged to the group.) So the attacker's figure stays
small, no member is "over" its share, and pick_victim falls back to "the group's largest
process" - the group-mate that kept within its share. Red team 29 A again, by a door
the fix did not close.

Repro (groups of 3, limits_poll_s 0.5, memory_group_grace_s 1): a, good, c of 64 MiB
share a group (192 MiB). a holds 80 MiB in an unmapped memfd (figure ~1 MiB); good runs
one 52 MiB process (within its 64 MiB). c is destroyed: the group must go down to
128 MiB and holds ~135 MiB. Past the deadline dsec kills good's process (and goes on
one per tick to its init: the sandbox ends), with an oom_kill notice blaming good; a
keeps its 80 MiB.

Why it matters: any member can have dsec SIGKILL a group-mate's work, and in the end its
whole sandbox, on demand, while itself holding more than its share.

Severity: medium-high (cross-sandbox kill of an innocent member, up to its init;
misleading attribution). Same class as red team 29 A.

Fix: do not build the figure from a list of known hiding places. Attribute from the
kernel: give each member its own memory cgroup under the group (hierarchical v1: the
group's limit still binds the sum) and read its memsw usage, which counts memfd/shmem,
tmpfs, SysV, kmem alike; failing that, when no member's figure explains the group's
overage (sum of figures << group usage), do not kill anyone in the fallback (or only
the member with the largest unexplained share - unknowable), leave the group pending
and report it.
"""

from __future__ import annotations

import asyncio

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import new_sid

from .conftest import MIB, group_file, spec

pytestmark = [pytest.mark.root]


async def test_a_unmapped_memfd_does_not_get_a_groupmate_killed(threes: ContainerBackend) -> None:
    b = threes
    notices: list[tuple[str, str, str]] = []
    b.watch(lambda sid, reason, detail: notices.append((sid, reason, detail)))
    a, good, c = new_sid(), new_sid(), new_sid()
    for sid in (a, good, c):
        await b.create(sid, spec("p", 64))
    gdir = b.memory_group_of(a)
    assert gdir and gdir == b.memory_group_of(good) == b.memory_group_of(c)
    r = await b.exec(a, ExecRequest(shell="hog30 memfd 80", timeout_s=30))
    assert r.exit_code == 0, r
    r = await b.exec(good, ExecRequest(shell="hog30 anon 52", timeout_s=30))
    assert r.exit_code == 0, r
    await asyncio.sleep(1.0)
    good_pids = set(b.governor.pids(b._boxes[good].cg))
    used = group_file(gdir, "memory.memsw.usage_in_bytes")
    assert used > 128 * MIB, f"setup: the group holds only {used >> 20} MiB"
    await b.destroy(c)
    await asyncio.sleep(6.0)     # ~10 limits ticks past the 1 s deadline
    box = b._boxes.get(good)
    left = set(b.governor.pids(box.cg)) if box is not None else set()
    killed = [n for n in notices if n[1] == "oom_kill" and n[0] == good]
    assert not killed and good_pids <= left, (
        f"{good} (memory_bytes 64 MiB, one 52 MiB process: within its share) lost "
        f"{sorted(good_pids - left)} to the lowering deadline, while {a} holds 80 MiB "
        f"in a memfd no process maps (in no member's figure); the notice blamed it: "
        f"{killed[:1]}")
