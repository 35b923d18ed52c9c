"""The "kill freed nothing -> kill every process of the member, its init too" rule
(14a6fdb3, memgroups.kill_freed_nothing) applies to whichever member the last kill hit
- also one that was never over its share, picked by pick_victim's fallback ("no member
is over: the group's largest process") - and it judges "freed" by that member's PSS
figure. A member whose processes share copy-on-write memory (any pre-fork server: a
parent and its forked workers) shows half of it in each: killing one worker frees
nothing (the pages stay with the other), the survivor's PSS doubles, the figure does
not move, and the next tick ends the whole sandbox.

Repro (groups of 3, limits_poll_s 0.5, memory_group_grace_s 1): a, good, c of 64 MiB
share a group. a holds 80 MiB in an unmapped memfd (in no figure: see test A); good
runs a 52 MiB process with one forked child sharing it copy-on-write (within its
64 MiB). c is destroyed. Past the deadline dsec kills one of good's two processes, then,
its figure unchanged, every process of good with its init: the innocent sandbox is
gone in two ticks (~1 s), while a keeps its 80 MiB.

Why it matters: with test A's hiding place, one member ends a group-mate's whole sandbox
(other jobs, often other users) on demand, in about a second past the deadline; the
notice says the victim was the one over its share.

Severity: high (cross-sandbox termination of an innocent sandbox).

Fix: only escalate to a whole-member kill for a member that is itself over its share
(never for the fallback's pick); judge "freed nothing" by the group's memory + swap
usage (did it drop by ~the victim's RSS?) rather than by the member's PSS figure, which
redistributes shared pages among survivors; and fix test A's attribution.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import new_sid

from .conftest import MIB, group_file, spec

pytestmark = [pytest.mark.root]


async def test_b_innocent_prefork_member_keeps_its_sandbox(threes: ContainerBackend) -> None:
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
    r = await b.exec(good, ExecRequest(shell="hog30 cow 52 1", timeout_s=30))
    assert r.exit_code == 0, r
    await asyncio.sleep(1.0)
    init = b._boxes[good].init_pid
    used = group_file(gdir, "memory.memsw.usage_in_bytes")
    assert used > 128 * MIB, f"setup: the group holds only {used >> 20} MiB"
    await b.destroy(c)
    await asyncio.sleep(6.0)     # ~10 limits ticks past the 1 s deadline
    whole = [n for n in notices if n[0] == good and "every process" in n[2]]
    assert not whole and os.path.exists(f"/proc/{init}"), (
        f"{good} (memory_bytes 64 MiB, a 52 MiB pre-fork pair: within its share) was "
        f"ended whole by the lowering deadline (init {init} alive: "
        f"{os.path.exists(f'/proc/{init}')}), while {a} holds 80 MiB in an unmapped memfd; "
        f"notices: {[n[2][:160] for n in notices if n[0] == good]}")
