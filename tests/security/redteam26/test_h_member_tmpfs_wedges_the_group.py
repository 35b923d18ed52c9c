"""With the shared scratch tmpfs (the default: every sandbox's /tmp, /dev and /dev/shm
are its dir of the node's one tmpfs) a sandbox's tmpfs has no size cap: "the memory
limit is the bound" (nsexec.c). In a memory group that bound is the *group's* limit.
One member can then hold the whole group's memory - more than its own memory_bytes -
in tmpfs pages, which no OOM kill frees: at the limit every process of every other
member is OOM-killed, from then on, until that member deletes its files. Its
group-mates are wedged for good (an exec of `true` is killed), not just subject to
"the OOM killer may pick a process of any member" of the documented trade.

Repro: two members of 64 MiB (group 128 MiB); a writes up to 200 MiB to its /tmp (over its
own limit: accepted); b can no longer run a command.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import _cleanup, new_sid

from .conftest import spec

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]


@pytest.fixture
async def grouped(tmp_path: object, images_dir: str) -> AsyncIterator[ContainerBackend]:
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                         images=DirectoryImages(images_dir), memory_group_size=2)
    try:
        yield b
    finally:
        await _cleanup(b)


async def test_a_member_cannot_fill_its_group_with_tmpfs(grouped: ContainerBackend) -> None:
    b = grouped
    a, a2 = new_sid(), new_sid()
    await b.create(a, spec("p", 64))
    await b.create(a2, spec("p", 64))
    w = await b.exec(a, ExecRequest(shell="head -c 200m /dev/zero > /tmp/big; "
                                          "ls -l /tmp/big", timeout_s=60))
    held = b.governor.memory_shmem(b.box(a).cg)
    r = await b.exec(a2, ExecRequest(argv=("true",), timeout_s=30))
    assert (r.exit_code, r.oom_killed) == (0, False), (
        f"member {a} (memory_bytes 64 MiB) holds {held >> 20} MiB of tmpfs in the group "
        f"({w.stdout.decode().strip()}); its group-mate's `true`: exit {r.exit_code}, "
        f"oom_killed={r.oom_killed}")
