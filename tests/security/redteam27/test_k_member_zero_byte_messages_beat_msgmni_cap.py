"""Red team 26 H's fix caps a member's message queues at memory_bytes by msgmni =
memory_bytes / msgmnb: "queues of msgmnb bytes each". But msgmnb bounds a queue's
*bytes* and, separately, its number of messages (q_qnum <= q_qbytes): a queue of
0-byte messages holds 16,384 of them, each a msg_msg header (~70 bytes of kmalloc,
charged to the memory cgroup - the group's), ~1.1 MiB per queue instead of the 16 KiB
the cap assumed: 64 x over. With msgmni = 4,096 (a 64 MiB member) that is ~4.4 GiB a
member can pin, no OOM kill freeing it; 120 queues fill a 128 MiB group.

Repro: two members of 64 MiB (group 128 MiB); a runs `hog msg0 130` (queues filled
with 0-byte messages until refused, or until it is killed); b runs `true` three times.

Fix: size the cap on kernel memory, not bytes: lower msgmnb (it bounds the message
count too) and take msgmni from memory_bytes / (msgmnb x ~70 B + the queue), inside one
budget with shm, sem and the tmpfs (A).
"""

from __future__ import annotations

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import new_sid

from .conftest import group_file, mate_answers, spec

pytestmark = [pytest.mark.root]


async def test_member_message_headers_stay_in_its_share(grouped: ContainerBackend) -> None:
    b = grouped
    a, mate = new_sid(), new_sid()
    await b.create(a, spec("p", 64))
    await b.create(mate, spec("p", 64))
    gdir = b.memory_group_of(a)
    assert gdir is not None and gdir == b.memory_group_of(mate)
    w = await b.exec(a, ExecRequest(shell="hog msg0 130; head -c 4m /dev/zero > /tmp/x",
                                    timeout_s=60))
    kmem = group_file(gdir, "memory.kmem.usage_in_bytes")
    results, kills = await mate_answers(b, mate, gdir)
    assert kmem <= 64 << 20 and results == [(0, False)] * 3 and kills == 0, (
        f"member {a} (memory_bytes 64 MiB, msgmni capped) filled message queues with "
        f"0-byte messages ({w.stdout.decode().strip()!r}): the group's kernel memory is "
        f"{kmem >> 20} MiB; its group-mate's `true` x3: {results}, {kills} OOM kills")
