"""_member_pinned (14a6fdb3) reads what a member pins through ``/proc/<box.init_pid>``:
statvfs of ``/proc/<init>/root/tmp`` and the ipc namespace of ``/proc/<init>/ns/ipc``
(a thread setns's into it and reads /proc/sysvipc). A member whose init has died (the
kernel's OOM killer took it, the deadline's own whole-member kill, a crash) stays a
member - with its share in the group - until its client destroys it, and box.init_pid
keeps the dead pid. This host has pid_max 32768: the pid comes back, to any process of
the node (or, by cycling forks, to one an attacker picks). dsec then weighs the dead
member by *that* process's /tmp and ipc namespace: a host process's /tmp is the host's
root filesystem (tens of GB "pinned"), and its ipc namespace is the host's. The dead
member, with no processes, is "most over its share" by far; pick_victim returns its
(empty) process list's best: None; nothing is ever killed and the group keeps its
overage for good. The lowering deadline is off for that group.

Repro (groups of 3, limits_poll_s 0.5, memory_group_grace_s 1): dead, hog, c of 64
MiB. hog holds 140 MiB of anonymous memory (two 70 MiB processes; over its share). dead's init is SIGKILLed
(what the kernel's OOM killer does to it); its pid goes to a host ``sleep`` (the test
sets ns_last_pid, standing in for the node's pid churn). c is destroyed: the group must
go to 128 MiB and holds ~140 MiB (hog is the only one over). Past the deadline
nothing is killed: hog keeps its 140 MiB, the group's limit stays at 192 MiB.

Why it matters: the deadline (red team 27 C's fix) is defeated by an ordinary event (a
dead, not yet destroyed member + pid reuse), and an attacker can arrange it on purpose
(its own second sandbox's init OOM-killed, then cycle pids); the edge also setns's a
thread into whatever namespace the reused pid has, reading it as the member's.

Severity: medium (group keeps memory over the node's admission for good; wrong-
namespace reads).

Fix: read a member through a pidfd of its init taken at create (pidfd_open + check the
pid is still in the sandbox's cgroup, or /proc/self/fd of a pidfd's ns via
ioctl(PIDFD_GET_IPC_NAMESPACE)), skip members whose init is gone (their pins went with
their namespaces), and in pick_victim only consider members that have a process to
kill.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import new_sid

from .conftest import MIB, group_file, spec

pytestmark = [pytest.mark.root]


def _take_pid(pid: int) -> subprocess.Popen[bytes] | None:
    """A host ``sleep`` with pid ``pid`` (ns_last_pid; a few tries), or None."""
    for _ in range(20):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        p = subprocess.Popen(["sleep", "60"])
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    return None


async def test_e_dead_member_does_not_switch_off_the_deadline(threes: ContainerBackend) -> None:
    b = threes
    notices: list[tuple[str, str, str]] = []
    b.watch(lambda sid, reason, detail: notices.append((sid, reason, detail)))
    dead, hog, c = new_sid(), new_sid(), new_sid()
    for sid in (dead, hog, c):
        await b.create(sid, spec("p", 64))
    gdir = b.memory_group_of(hog)
    assert gdir and gdir == b.memory_group_of(dead) == b.memory_group_of(c)
    r = await b.exec(hog, ExecRequest(shell="hog30 anon 70 && hog30 anon 70", timeout_s=30))
    assert r.exit_code == 0, r
    init = b._boxes[dead].init_pid
    os.kill(init, signal.SIGKILL)
    for _ in range(40):
        await asyncio.sleep(0.1)
        if not os.path.exists(f"/proc/{init}"):
            break
    squatter = _take_pid(init)
    assert squatter is not None, f"setup: pid {init} was not reused"
    try:
        await asyncio.sleep(1.0)
        used = group_file(gdir, "memory.memsw.usage_in_bytes")
        assert used > 128 * MIB, f"setup: the group holds only {used >> 20} MiB"
        await b.destroy(c)
        await asyncio.sleep(6.0)     # ~10 limits ticks past the 1 s deadline
        limit = group_file(gdir, "memory.limit_in_bytes")
        killed = [n for n in notices if n[0] == hog and n[1] == "oom_kill"]
        assert killed or limit <= 128 * MIB, (
            f"the lowering deadline never acted: {hog} keeps its 140 MiB (over its 64 MiB "
            f"share) and group {os.path.basename(gdir)}'s limit stays {limit >> 20} MiB, "
            f"because dead member {dead}'s init pid {init} now belongs to a host process "
            f"and dsec weighs {dead} by the host's /tmp (and ipc namespace)")
    finally:
        squatter.kill()
        squatter.wait()
    await b.destroy(dead)
