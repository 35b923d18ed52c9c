"""Red team 26 H's fix gives a member a tmpfs of its own whose *size* is capped at its
memory_bytes. The size counts data pages only: the tmpfs has no nr_inodes cap (the
kernel's default: half of RAM's pages, ~3 million here), and an empty file costs ~1.2 KiB
of kernel memory (shmem inode + dentry + a long name), charged to the memory cgroup -
the group's - and, being tmpfs, never reclaimable and freed by no OOM kill. So with
0 bytes of its tmpfs used, a member pins as much of its group as it likes: 110,000
empty files (df: 0% used) are ~130 MiB, its whole 128 MiB group, and its group-mate's
commands are OOM-killed from then on - H again, through the inodes.

Repro: two members of 64 MiB (group 128 MiB); a makes 110,000 empty files with
200-character names in its /tmp; b runs `true` three times.

Fix: a member's tmpfs gets nr_inodes too (e.g. memory_bytes / 4 KiB), so its size plus
inodes stay inside its own share (with the SysV caps, one budget: see A).
"""

from __future__ import annotations

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import new_sid

from .conftest import group_file, mate_answers, spec

pytestmark = [pytest.mark.root]


async def test_member_tmpfs_inodes_stay_in_its_share(grouped: ContainerBackend) -> None:
    b = grouped
    a, mate = new_sid(), new_sid()
    await b.create(a, spec("p", 64))
    await b.create(mate, spec("p", 64))
    gdir = b.memory_group_of(a)
    assert gdir is not None and gdir == b.memory_group_of(mate)
    w = await b.exec(a, ExecRequest(shell="mkdir /tmp/d; hog files /tmp/d 110000; "
                                          "df -k /tmp | tail -1", timeout_s=120))
    kmem = group_file(gdir, "memory.kmem.usage_in_bytes")
    results, kills = await mate_answers(b, mate, gdir)
    assert results == [(0, False)] * 3 and kills == 0, (
        f"member {a} (memory_bytes 64 MiB) made empty files in its tmpfs "
        f"({w.stdout.decode().strip()!r}): the group's kernel memory is {kmem >> 20} MiB; "
        f"its group-mate's `true` x3: {results}, {kills} OOM kills in the group")
