"""A timed-out or cancelled exec leaves nothing behind (issue 11.5); one that ends on its
own keeps what it started in the background; exec cgroups do not accumulate.

Each foreground exec runs in a cgroup of its own (a child of the sandbox's freezer cgroup
on v1, of its cgroup on v2), so "everything the exec started" includes processes that
called setsid or double-forked - which a process-group kill missed."""

from __future__ import annotations

import asyncio
import os

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.ids import SandboxId
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import SPEC, new_sid

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

# A command that escapes its process group twice: a setsid'd sleep and a double fork, each
# leaving its pid in /tmp so the test can check that exact process afterwards.
ESCAPES = ("setsid sh -c 'echo $$ > /tmp/setsid.pid; exec sleep 1001' & "
           "(sh -c 'echo $$ > /tmp/double.pid; exec sleep 1002' &) ; "
           "while [ ! -s /tmp/setsid.pid ] || [ ! -s /tmp/double.pid ]; do sleep 0.01; done; "
           "echo ready; sleep 1003")


async def _sh(b: ContainerBackend, sid: str, cmd: str) -> str:
    r = await b.exec(SandboxId(sid), ExecRequest(shell=cmd, timeout_s=30))
    assert r.exit_code == 0, (cmd, r)
    return r.stdout.decode()


async def _alive(b: ContainerBackend, sid: str, *pidfiles: str) -> list[str]:
    """The commands (from /proc/<pid>/cmdline) still running for the pids in ``pidfiles``."""
    out = await _sh(b, sid, " ; ".join(
        f"p=$(cat {f}); [ -e /proc/$p/cmdline ] && tr '\\0' ' ' < /proc/$p/cmdline && echo"
        for f in pidfiles) + " ; true")
    return [line for line in out.splitlines() if line.strip()]


def _exec_cgroups(b: ContainerBackend, sid: str) -> list[str]:
    """The exec cgroups under the sandbox's freezer (v1) / v2 cgroup."""
    cg = b.governor.paths(sid)
    parent = cg.dirs.get("freezer", cg.dirs.get("unified", ""))
    return sorted(e.name for e in os.scandir(parent) if e.is_dir())


async def _sleeps(b: ContainerBackend, sid: str) -> list[str]:
    out = await _sh(b, sid, "ps -o args | grep '^sleep 100' ; true")
    return out.split("\n")[:-1]


async def _timeout_kills_escapees(b: ContainerBackend) -> None:
    sid = new_sid()
    await b.create(sid, SPEC)
    r = await b.exec(sid, ExecRequest(shell=ESCAPES, timeout_s=1.5))
    assert r.timed_out and r.exit_code == 128 + 9 and r.stdout == b"ready\n", r
    # gone by the time the call returned - not dying
    assert await _alive(b, sid, "/tmp/setsid.pid", "/tmp/double.pid") == []
    assert await _sleeps(b, sid) == []
    assert _exec_cgroups(b, sid) == []


async def test_timeout_kills_setsid_and_double_forked_processes(
        backend: ContainerBackend) -> None:
    await _timeout_kills_escapees(backend)


async def test_runc_timeout_kills_setsid_and_double_forked_processes(
        runc_backend: ContainerBackend) -> None:
    await _timeout_kills_escapees(runc_backend)


async def test_cancelled_exec_leaves_nothing(backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    task = asyncio.ensure_future(backend.exec(sid, ExecRequest(shell=ESCAPES)))
    for _ in range(500):
        if len(await _sleeps(backend, sid)) == 3:
            break
        await asyncio.sleep(0.01)
    assert len(await _sleeps(backend, sid)) == 3
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(500):  # the cleanup finishes in the background
        if not await _sleeps(backend, sid) and _exec_cgroups(backend, sid) == []:
            break
        await asyncio.sleep(0.01)
    assert await _sleeps(backend, sid) == []
    assert _exec_cgroups(backend, sid) == []


async def test_normal_exit_keeps_daemons_and_background_execs_outlive_timeouts(
        backend: ContainerBackend) -> None:
    """The documented rule: an exec that ends on its own keeps what it started in the
    background (`server &`); a timeout elsewhere does not touch background execs."""
    sid = new_sid()
    await backend.create(sid, SPEC)
    bg = await backend.exec(sid, ExecRequest(shell="exec sleep 1004", background=True))
    r = await backend.exec(sid, ExecRequest(shell="setsid sleep 1005 & echo started"))
    assert (r.exit_code, r.stdout, r.timed_out) == (0, b"started\n", False)
    assert len(_exec_cgroups(backend, sid)) == 1  # it lingers with the daemon inside
    t = await backend.exec(sid, ExecRequest(shell="sleep 1006", timeout_s=0.3))
    assert t.timed_out
    running = await _sleeps(backend, sid)
    assert sorted(running) == ["sleep 1004", "sleep 1005"], running
    assert (await _sh(backend, sid, f"cat /proc/{bg.pid}/cmdline")).startswith("sleep")
    # once the daemon is gone its cgroup is removed at a later exec (retried once a second)
    await _sh(backend, sid, "killall sleep")
    await asyncio.sleep(1.1)
    await _sh(backend, sid, "true")
    assert _exec_cgroups(backend, sid) == []
    # destroy removes lingering exec cgroups with the sandbox
    await _sh(backend, sid, "setsid sleep 1007 &")
    assert len(_exec_cgroups(backend, sid)) == 1
    cg = backend.governor.paths(sid)
    await backend.destroy(SandboxId(sid))
    assert not any(os.path.exists(d) for d in cg.dirs.values())


async def test_execs_leave_no_exec_cgroups(backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    rs = await asyncio.gather(*(backend.exec(sid, ExecRequest(argv=("true",)))
                                for _ in range(100)))
    assert all(r.exit_code == 0 for r in rs)
    rs = await asyncio.gather(*(backend.exec(sid, ExecRequest(argv=("no-such-cmd",)))
                                for _ in range(10)))
    assert all(r.exit_code == 127 for r in rs)
    assert _exec_cgroups(backend, sid) == []
