"""C2: a table process started through the exec helper (sf) makes the node's one zygote
block in ``read(2)`` when its command ends before the helper has closed its copy of the
status pipe: every exec, start, create and destroy of every sandbox on the node waits.

sf passes the status pipe's write end (F_TRACK) to the sandbox's exec helper over
SCM_RIGHTS (nsexec.c ``forward_exec``); the helper forks the command, reports its pid,
writes the go byte and only then closes what it received (``do_helper``: ``close(go..)``,
then ``for k < nfds: close(fds[k])``). The zygote's ``fg_exited`` reads the status pipe
when the command has exited before the pipe's EOF event, on the premise "every writer is
gone, so this read does not block" - true on the per-exec path (intermediate and final
are both reaped), false here: the helper may still hold a writer, and the pipe is
blocking (``pipe2(sp, O_CLOEXEC)``). The zygote then sleeps until the helper closes it.

The helper runs in the sandbox's cgroups: it is throttled by the sandbox's cpu quota (a
tenant burns its quota on purpose: cpu.cfs throttling stops it for up to a period at
any instruction), it is SCHED_IDLE in a best-effort sandbox, and it is *frozen* with the
sandbox by a pause - a pause (tenant-driven, or the TTL's on_timeout=pause) landing in
that window holds the node's zygote for as long as the sandbox stays paused.

Modelled here deterministically: the helper is delayed before each close(2) (strace
``inject=close:delay_enter``, as a scheduler would delay it), a table process ``true``
starts in sandbox A, and another sandbox B's exec is timed. Secure behaviour: B's exec is
not held by A's helper (the zygote never blocks on a sandbox's process)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import SPEC, backend, new_sid  # noqa: F401
from tests.edge.container.test_exec_helper import _helper_pid, _helper_up

pytestmark = pytest.mark.root

DELAY_US = 1_000_000


def _sleeping_in(pid: int | None) -> tuple[str, list[str]]:
    with open(f"/proc/{pid}/wchan") as f:
        where = f.read()
    with open(f"/proc/{pid}/syscall") as f:
        return where, f.read().split()[:2]


async def test_a_helper_slow_to_close_does_not_stall_other_sandboxes(
        backend: ContainerBackend) -> None:  # noqa: F811
    if shutil.which("strace") is None:
        pytest.skip("needs strace")
    a, b = new_sid(), new_sid()
    await backend.create(a, SPEC)
    await backend.create(b, SPEC)
    await _helper_up(backend, a)
    await _helper_up(backend, b)
    hp = _helper_pid(backend, a)
    tracer = subprocess.Popen(  # noqa: ASYNC220 - a tracer left running, killed below
        ["strace", "-qq", "-p", str(hp), "-e", "trace=close",
         "-e", f"inject=close:delay_enter={DELAY_US}", "-o", "/dev/null"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started: asyncio.Task[object] | None = None
    try:
        await asyncio.sleep(0.5)                 # attached
        assert tracer.poll() is None, "strace did not attach to the helper"

        def sink(_stream: str, _data: bytes) -> None:
            return None
        started = asyncio.ensure_future(backend.spawn_process(
            a, ExecRequest(argv=("true",)), sink))
        await asyncio.sleep(0.5)                 # A's command ran and exited by now
        zpid = backend._zygote.pid
        t0 = time.monotonic()
        ex = asyncio.ensure_future(backend.exec(b, ExecRequest(argv=("true",))))
        await asyncio.sleep(0.3)
        where, call = _sleeping_in(zpid)     # where the zygote sleeps meanwhile
        r = await asyncio.wait_for(ex, 30)
        took = time.monotonic() - t0
        assert r.exit_code == 0, r
        assert took < 1.5, (
            f"sandbox B's exec took {took:.1f} s: the zygote was blocked reading sandbox "
            "A's status pipe (its command had exited, its exec helper still held the "
            f"pipe's write end); the zygote meanwhile: wchan {where}, syscall {call}")
    finally:
        tracer.kill()
        tracer.wait()
        if started is not None:
            with contextlib.suppress(BaseException):
                p = await asyncio.wait_for(started, 30)
                await asyncio.wait_for(p.wait(), 30)  # type: ignore[attr-defined]
