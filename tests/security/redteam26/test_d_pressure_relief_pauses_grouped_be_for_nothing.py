"""The node's memory-pressure relief (PSI, ``dsec.edge.qos.plan_relief``) pauses idle
best-effort sandboxes one by one, counting each one's memory as freed. In a memory
group a member's pause reclaims nothing while a group-mate runs (by design: the group's
memory is also the running member's), so under pressure the relief pauses BE sandboxes
- unavailable to their users, each with a ``memory_pressure`` notice saying it was
paused to free N MiB - and frees nothing; the next round pauses more, and the node stays
under pressure. Groups are invisible to the policy (QosView has no group).

Repro: a node on a container backend with memory_group_size=2; two BE sandboxes of one
project (one group): the idle one holds 48 MiB of page cache, the other is active.
Under PSI pressure the relief pauses the idle one; the group's usage does not drop.
"""

from __future__ import annotations

import contextlib
import os

import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.clock import FakeClock
from dsec.edge.qos import PressurePolicy, Psi
from dsec.wire.spec import ExecRequest, SandboxSpec
from tests.edge.conftest import make_node

from .conftest import MIB, group_file

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

BE = SandboxSpec(backend="container", qos="be", memory_bytes=128 * MIB, pids_max=64)


async def test_pressure_relief_frees_what_it_pauses_in_a_memory_group(
        tmp_path: object, images_dir: str) -> None:
    clock = FakeClock()
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                         images=DirectoryImages(images_dir), memory_group_size=2)
    node = make_node(b, clock=clock, memory_pressure=PressurePolicy(min_idle_s=5.0,
                                                                    cooldown_s=0.0))
    await node.start()
    made: list[str] = []
    try:
        node.pressure.read = lambda: Psi(40.0, 20.0, 3.0, 1.0)
        idle = await node.create(BE)
        made.append(idle.id)
        r = await node.exec(idle.id, ExecRequest(
            shell="head -c 48m /dev/zero > /root/f && sync", timeout_s=60))
        assert r.exit_code == 0, r
        clock.advance(60)
        busy = await node.create(BE)
        made.append(busy.id)
        clock.advance(1)
        gdir = b.box(idle.id).cg.dirs["memory"]
        assert b.box(busy.id).cg.dirs["memory"] == gdir       # one group
        before = group_file(gdir, "memory.usage_in_bytes")
        # (fixed: a group with an active member is not paused at all - it frees nothing)
        relief = await node.relieve_pressure()
        assert relief.pause == (), relief
        assert node.get(idle.id).state == "running"
        # once every member is idle, the group is paused as one and its memory goes
        clock.advance(60)
        relief = await node.relieve_pressure()
        assert sorted(relief.pause) == sorted((idle.id, busy.id)), relief
        assert node.get(idle.id).state == "paused" and node.get(busy.id).state == "paused"
        after = group_file(gdir, "memory.usage_in_bytes")
        assert before - after >= 32 * MIB, (
            f"pressure relief paused {idle.id} ({relief.reason}) but its memory group "
            f"went from {before >> 20} to {after >> 20} MiB: nothing was freed")
    finally:
        for sid in made:     # by the node: close() would leave them for an adopt
            with contextlib.suppress(Exception):
                await node.destroy(sid)
        await node.close()
        from tests.edge.container.conftest import _cleanup
        await _cleanup(b)
