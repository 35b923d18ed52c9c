"""Red team 26 H's fix sizes a member's own tmpfs at "its memory_bytes (at least /dev/shm's
64 MiB)": `_tmp_bytes` is max(0, memory_bytes - SHM_BYTES - 64 KiB) and nsexec adds
SHM_BYTES + 64 KiB back, so every member below 64 MiB gets a 64 MiB tmpfs. memory_bytes
goes down to 1 MiB, and dense groups are what groups are for: a member of 16 MiB pins
64 MiB - 4 x its share, its whole group of two (32 MiB) - in /dev/shm, which no OOM kill
frees, and its group-mate is OOM-killed from then on (H again, for small members).

Repro: two members of 16 MiB (group 32 MiB); a writes 40 MiB to /dev/shm (refused only
at the group's limit); b runs `true` three times.

Fix: size the whole tmpfs (/dev/shm included) at the member's memory_bytes (or its
share of one budget, A) - /dev/shm smaller for a small member - or refuse members below
SHM_BYTES.
"""

from __future__ import annotations

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import new_sid

from .conftest import mate_answers, spec

pytestmark = [pytest.mark.root]


async def test_small_member_tmpfs_stays_in_its_share(grouped: ContainerBackend) -> None:
    b = grouped
    a, mate = new_sid(), new_sid()
    await b.create(a, spec("p", 16))
    await b.create(mate, spec("p", 16))
    gdir = b.memory_group_of(a)
    assert gdir is not None and gdir == b.memory_group_of(mate)
    w = await b.exec(a, ExecRequest(shell="df -k /dev/shm | tail -1; "
                                          "head -c 40m /dev/zero > /dev/shm/x", timeout_s=60))
    held = b.governor.memory_shmem(b.box(a).cg)
    results, kills = await mate_answers(b, mate, gdir)
    assert held <= 16 << 20 and results == [(0, False)] * 3 and kills == 0, (
        f"member {a} (memory_bytes 16 MiB) holds {held >> 20} MiB of tmpfs "
        f"({w.stdout.decode().strip()!r}); its group-mate's `true` x3: {results}, "
        f"{kills} OOM kills in the group")
