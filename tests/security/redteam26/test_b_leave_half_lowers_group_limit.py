"""When a member leaves a memory group that holds more than the remaining members' sum
(which the trade allows: a member may use what its group-mates leave unused),
``Governor.set_group_memory`` lowers ``memory.limit_in_bytes`` first - the kernel
succeeds by pushing the remaining member's anonymous memory out to zram - and then
fails (EBUSY) to lower ``memory.memsw.limit_in_bytes``: memory + swap cannot shrink by
reclaim. It returns False ("the old limit stays"), but half of the new limit was
applied: the group is left with limit = new sum and memsw = old sum. The remaining
member now holds its excess in swap and may keep up to the departed member's share
there for as long as it lives - the "no swap beyond the limit" rule (memsw = limit,
so a bomb is OOM-killed instead of filling zram) is gone for the group, and the soft
limit is never updated either.

Repro: members of 64 MiB each (group 128 MiB); b holds ~100 MiB (tail buffering a
newline-less stream). a is destroyed. Expected either both files at the new 64 MiB or
both left at 128 MiB; found limit 64 MiB, memsw 128 MiB.
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


async def test_a_member_leaving_leaves_limit_and_memsw_equal(
        grouped: ContainerBackend) -> None:
    b = grouped
    if not b.governor.layout.memsw:
        pytest.skip("by design: the host has no v1 memsw accounting (swapaccount=0)")
    a, a2 = new_sid(), new_sid()
    await b.create(a, spec("p", 64))
    await b.create(a2, spec("p", 64))
    gdir = b.box(a).cg.dirs["memory"]
    # a2 holds ~100 MiB (< the group's 128): tail keeps a newline-less stream until EOF
    r = await b.exec(a2, ExecRequest(shell="(head -c 100m /dev/zero; sleep 600) | tail "
                                           ">/dev/null", background=True))
    assert r.exit_code == 0, r
    for _ in range(200):
        if group_file(gdir, "memory.usage_in_bytes") > 96 * MIB:
            break
        await asyncio.sleep(0.05)
    assert group_file(gdir, "memory.usage_in_bytes") > 96 * MIB
    await b.destroy(a)
    limit = group_file(gdir, "memory.limit_in_bytes")
    memsw = group_file(gdir, "memory.memsw.limit_in_bytes")
    soft = group_file(gdir, "memory.soft_limit_in_bytes")
    # (the soft limit may go lower at once: red team 27 C)
    assert memsw == limit and soft <= limit, (
        f"after a member left, the group's limit is {limit >> 20} MiB but memsw "
        f"{memsw >> 20} MiB and soft {soft >> 20} MiB: its remaining member may hold "
        f"{(memsw - limit) >> 20} MiB in swap")
