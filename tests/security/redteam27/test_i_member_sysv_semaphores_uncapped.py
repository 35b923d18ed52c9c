"""Red team 26 H's SysV fix (density.cap_sysv_ipc) caps a member's shared memory
(shmmax, shmall) and message queues (msgmni) in its ipc namespace, but not its
semaphores: kernel.sem stays at the kernel's defaults (32,000 arrays of up to 32,000
semaphores, 1,024,000,000 in all). A semaphore is a cache-line-aligned struct sem
(64 bytes) charged to the memory cgroup - the group's - and an array lives as long as
the namespace: no OOM kill frees it. 10 arrays of 32,000 are 20 MiB of kernel memory;
70 pin more than a whole 128 MiB group, and every process of the member's group-mates
is OOM-killed from then on - H again, through semget.

Repro: two members of 64 MiB (group 128 MiB); a runs `hog sem 200` (semget until refused
or killed) and writes 4 MiB to its /tmp (well inside its tmpfs cap); b runs `true`
three times.

Fix: cap kernel.sem too in cap_sysv_ipc (semmns so that semmns x 64 B fits the
member's share, semmni to match), inside one budget with shm and msg (see A).
"""

from __future__ import annotations

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import new_sid

from .conftest import group_file, mate_answers, spec

pytestmark = [pytest.mark.root]


async def test_member_semaphores_stay_in_its_share(grouped: ContainerBackend) -> None:
    b = grouped
    a, mate = new_sid(), new_sid()
    await b.create(a, spec("p", 64))
    await b.create(mate, spec("p", 64))
    gdir = b.memory_group_of(a)
    assert gdir is not None and gdir == b.memory_group_of(mate)
    w = await b.exec(a, ExecRequest(shell="hog sysctl | grep sem; hog sem 200; head -c 4m /dev/zero > /tmp/x", timeout_s=60))
    kmem = group_file(gdir, "memory.kmem.usage_in_bytes")
    results, kills = await mate_answers(b, mate, gdir)
    assert kmem <= 64 << 20 and results == [(0, False)] * 3 and kills == 0, (
        f"member {a} (memory_bytes 64 MiB) made SysV semaphore arrays "
        f"({w.stdout.decode().strip()!r}): the group's kernel memory is {kmem >> 20} MiB; "
        f"its group-mate's `true` x3: {results}, {kills} OOM kills in the group")
