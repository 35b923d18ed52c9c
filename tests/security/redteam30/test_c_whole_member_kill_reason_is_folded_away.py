"""When the lowering deadline ends a member whole (14a6fdb3: "kill every process of the
member, its init too, so the sandbox ends"), it says why in an ``oom_kill`` notice sent
through ``_notice`` - which admits at most one notice per kind and sandbox per interval
and folds the rest into the *next* one. The whole-member kill always follows the
deadline's previous single kill in the same member one limits tick earlier (that is its
trigger: kill_freed_nothing), whose oom_kill notice used up the interval. So the notice
that the sandbox is being ended is folded - and there is no next one: the sandbox is
dead. The client sees only a ``backend_crash`` report, "the sandbox's init (pid N)
exited": no reason, no memory group, no "dsec killed it" - and labelled as a crash of
the backend.

Repro (groups of 3, limits_poll_s 0.5, memory_group_grace_s 1): a, good, c of 64 MiB.
a runs a 100 MiB pre-fork pair (parent + forked child sharing it copy-on-write: over its
share, the rightful victim); good holds 40 MiB. c is destroyed. Past the deadline dsec kills
one of a's pair (frees nothing), then every process of a. a's reports: the first
oom_kill notice, then its init's exit; the "dsec killed every process of sandbox ...
(so the sandbox ends)" notice never arrives.

Why it matters: a sandbox terminated by the node's policy looks like it crashed by
itself; the user cannot tell a dsec kill (retry in a less loaded group / lower memory)
from a bug of theirs; the docs promise the member "gets an oom_kill notice naming what
went and why".

Severity: low-medium (lost attribution of a sandbox termination).

Fix: send the whole-member kill's reason outside the notice rate limiter (or as the
death event's own reason/detail: make the exit report say "ended by dsec: memory group
... lowering deadline"), e.g. record it on the box before kill_all and use it in the
init-exit report.
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


async def test_c_member_ended_whole_is_told_why(threes: ContainerBackend) -> None:
    b = threes
    notices: list[tuple[str, str, str]] = []
    b.watch(lambda sid, reason, detail: notices.append((sid, reason, detail)))
    a, good, c = new_sid(), new_sid(), new_sid()
    for sid in (a, good, c):
        await b.create(sid, spec("p", 64))
    gdir = b.memory_group_of(a)
    assert gdir and gdir == b.memory_group_of(good) == b.memory_group_of(c)
    r = await b.exec(a, ExecRequest(shell="hog30 cow 100 1", timeout_s=30))
    assert r.exit_code == 0, r
    r = await b.exec(good, ExecRequest(shell="hog30 anon 40", timeout_s=30))
    assert r.exit_code == 0, r
    await asyncio.sleep(1.0)
    init = b._boxes[a].init_pid
    used = group_file(gdir, "memory.memsw.usage_in_bytes")
    assert used > 128 * MIB, f"setup: the group holds only {used >> 20} MiB"
    await b.destroy(c)
    for _ in range(40):          # up to ~10 s
        await asyncio.sleep(0.25)
        if not os.path.exists(f"/proc/{init}"):
            break
    assert not os.path.exists(f"/proc/{init}"), (
        f"setup: {a} (a 100 MiB pre-fork pair over its 64 MiB share) was not ended "
        f"whole; notices: {[n[1:] for n in notices if n[0] == a]}")
    await asyncio.sleep(1.0)
    told = [n for n in notices if n[0] == a and "every process" in n[2]]
    assert told, (
        f"{a} was ended whole by the lowering deadline but never told why: its reports "
        f"were {[(n[1], n[2][:110]) for n in notices if n[0] == a]}")
    await b.destroy(a)
