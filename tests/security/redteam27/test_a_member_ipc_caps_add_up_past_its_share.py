"""Red team 26 H's fix caps each thing no OOM kill frees at the member's *own*
memory_bytes - separately: its tmpfs (/tmp, /dev, /dev/shm) at memory_bytes, its ipc
namespace's SysV shm at memory_bytes (shmmax, shmall) and its message queues at
memory_bytes (msgmni x msgmnb). Together that is ~3 x memory_bytes, and a group of k
members has a limit of k x memory_bytes: with k = 2, SysV shm (60 MiB) plus message
queues (64 MiB) alone pin 124 MiB of a 128 MiB group, held by the member's ipc namespace
(its init) - which no OOM kill frees. From then on its group-mate's commands are
OOM-killed, and its init can be too (seen: the group-mate's sandbox died, "not running
(its init ... is gone)").

Repro: two members of 64 MiB (group 128 MiB); a runs `hog shm 60` (two segments, left
in place) and `hog msg 64` (4,096 queues of 16 KiB: msgmni's cap), then b runs `true`
three times.

Fix: one budget of memory_bytes for all three (e.g. tmpfs + shmall pages + msgmni x
msgmnb <= memory_bytes), not one each.
"""

from __future__ import annotations

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import new_sid

from .conftest import group_file, mate_answers, spec

pytestmark = [pytest.mark.root]


async def test_member_ipc_caps_fit_its_own_share(grouped: ContainerBackend) -> None:
    b = grouped
    a, mate = new_sid(), new_sid()
    await b.create(a, spec("p", 64))
    await b.create(mate, spec("p", 64))
    gdir = b.memory_group_of(a)
    assert gdir is not None and gdir == b.memory_group_of(mate)
    w = await b.exec(a, ExecRequest(shell="hog shm 30 30 30; hog msg 64; cat /tmp/x 2>/dev/null; head -c 8m /dev/zero > /tmp/x; ls -l /tmp/x", timeout_s=60))
    held = b.governor.memory_shmem(b.box(a).cg)
    usage = group_file(gdir, "memory.usage_in_bytes")
    results, kills = await mate_answers(b, mate, gdir)
    assert results == [(0, False)] * 3 and kills == 0, (
        f"member {a} (memory_bytes 64 MiB) pinned SysV shm {held >> 20} MiB + message "
        f"queues in its ipc namespace, group usage {usage >> 20} MiB ({w.stdout.decode().strip()!r}); its group-mate's "
        f"`true` x3: {results}, {kills} OOM kills in the group")
