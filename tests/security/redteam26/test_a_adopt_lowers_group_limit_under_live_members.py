"""A restarted edge adopts a memory group's members one at a time, and each adopt sets
the group's limit to the sum of the members adopted *so far* (``_set_group_limit`` at
the end of ``adopt``). The members not adopted yet are alive and running in the group
(they survived the edge's kill -9, that is why they are being adopted), so between the
first and the last adopt of a group the kernel limit is below what its live members
were given: a member's allocation that fitted before the restart is OOM-killed during
adoption (at 10,000 sandboxes the node adopts for many seconds). Lowering the limit also
makes the kernel reclaim the group at once (page cache dropped, anon pushed to zram).

Repro: two members of 64 MiB (group limit 128 MiB); the second one starts allocating
80 MiB (fits: the group was given 128) right after the first is adopted, before it is
adopted itself. It is OOM-killed; the limit read after the first adopt is 64 MiB.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import _cleanup, new_sid

from .conftest import MIB, group_file, oom_kills, read, spec

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

WAIT_AND_EAT = ("while [ ! -e /tmp/go ]; do sleep 0.05; done; "
                "if head -c 80m /dev/zero | tail > /dev/null; then echo ok > /tmp/res; "
                "else echo killed > /tmp/res; fi")


async def test_adopting_one_member_never_lowers_the_group_under_its_live_members(
        tmp_path: object, images_dir: str) -> None:
    root = os.path.join(str(tmp_path), "r")
    b1 = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir),
                          memory_group_size=2)
    b2: ContainerBackend | None = None
    a, a2 = new_sid(), new_sid()
    try:
        await b1.create(a, spec("p", 64))
        await b1.create(a2, spec("p", 64))
        gdir = b1.box(a).cg.dirs["memory"]
        assert b1.box(a2).cg.dirs["memory"] == gdir
        assert group_file(gdir, "memory.limit_in_bytes") == 128 * MIB
        r = await b1.exec(a2, ExecRequest(shell=WAIT_AND_EAT, background=True))
        assert r.exit_code == 0, r
        init2 = b1.box(a2).init_pid
        spec_a, spec_a2 = b1.box(a).spec, b1.box(a2).spec
        await b1.close()                       # as a kill -9: the sandboxes run on
        kills0 = oom_kills(gdir)

        b2 = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir),
                              memory_group_size=2)
        assert await b2.adopt(a, spec_a)
        limit_mid = group_file(gdir, "memory.limit_in_bytes")
        # a2 is alive in the group, not adopted yet: it allocates what it was given
        with open(f"/proc/{init2}/root/tmp/go", "w"):  # noqa: ASYNC230
            pass
        res = f"/proc/{init2}/root/tmp/res"
        for _ in range(600):
            if os.path.exists(res) and read(res).strip():
                break
            await asyncio.sleep(0.05)
        got = read(res).strip() if os.path.exists(res) else "(no result)"
        assert await b2.adopt(a2, spec_a2)
        assert (limit_mid, got, oom_kills(gdir) - kills0) == (128 * MIB, "ok", 0), (
            f"after adopting one member of two the group's limit was {limit_mid >> 20} "
            f"MiB (its live members were given 128 MiB); the other member's 80 MiB "
            f"allocation: {got}")
    finally:
        if b2 is None:
            await _cleanup(b1)
        else:
            await _cleanup(b2)
