"""Red team 23 A1: on the runc tier (``runtime="runc"``) every sandbox command - and the
sandbox's init - still starts with signal 32 ignored when the edge was started with it
ignored (glibc's posix_spawn leaves its internal signal 32 so: CI's parent did, commit
121914d "CI found 32").

Commit 121914d resets every disposition by raw ``rt_sigaction`` in nsexec.c
(``default_signals``: the native driver's init, exec and exec helper, the gvisor filter),
in the keeper and in the fncall zygote. The runc driver starts ``runc run``/``runc exec``
straight from the edge (``RuncDriver`` in container/runc.py, asyncio subprocesses): the
edge's ignored 32 reaches runc, runc's own start-up (Go: signal 32 is one the Go runtime
leaves alone, _SigSetStack) keeps it, and execve keeps an ignored signal. A process that
relies on the default action of signal 32 (glibc's cancellation signal in a statically
linked or non-glibc runtime, or a program using SIGRTMIN-2 by number) finds it ignored -
exactly the leak the commit meant to close, on the other container driver. (The edge's
event loop, uvloop/libuv, resets 1-31 in a child; 32-64 it leaves as they are.)

Fix: start runc through the same reset (nsexec's ``default_signals`` as a tiny
``exec`` wrapper, or reset 32-64 by raw rt_sigaction in a preexec step), or reset the
edge's own ignored signals at its start (``reset_ignored_signals`` in ``dsec edge``).
"""

from __future__ import annotations

import signal

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.wire.spec import ExecRequest
from tests.edge.container.test_process_durability import _sig_fields, _sigaction
from tests.security.conftest import PROBE_SPEC, new_sid

pytestmark = pytest.mark.root


async def test_runc_commands_and_init_ignore_nothing(runc_backend: ContainerBackend) -> None:
    ignored = (signal.SIGHUP, 32)        # nohup's, posix_spawn's
    before = {s: _sigaction(s, 1) for s in ignored}
    try:
        sid = new_sid()
        await runc_backend.create(sid, PROBE_SPEC)
        cmd = await runc_backend.exec(sid, ExecRequest(
            argv=("grep", "-E", "^Sig(Ign|Blk)", "/proc/self/status"), timeout_s=20))
        init = await runc_backend.exec(sid, ExecRequest(
            argv=("grep", "-E", "^SigIgn", "/proc/1/status"), timeout_s=20))
    finally:
        for s, h in before.items():
            _sigaction(s, h)
    got = _sig_fields(cmd.stdout.decode())
    assert got == {"SigIgn": "0" * 16, "SigBlk": "0" * 16}, (
        f"a runc sandbox's command starts with {got} (signal 32 = 0x80000000 ignored)")
    init_ign = _sig_fields(init.stdout.decode())["SigIgn"]
    assert init_ign == "0" * 16, f"the runc sandbox's init ignores {init_ign}"


async def test_runc_commands_and_init_block_nothing_the_edge_had_blocked(
        runc_backend: ContainerBackend) -> None:
    """The same class for the *blocked* mask (survives fork and execve, and Popen
    leaves it): the edge's thread blocked SIGTERM, SIGINT and 32 when it started a
    command. Holds without dsec's help - runc's start-up gives the command an empty
    mask (checked: the fncall zygote did not, tests/edge/test_fncall.py) - kept as the
    guard for this door."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, 32})
    try:
        sid = new_sid()
        await runc_backend.create(sid, PROBE_SPEC)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, 32})
        cmd = await runc_backend.exec(sid, ExecRequest(
            argv=("grep", "-E", "^Sig(Ign|Blk)", "/proc/self/status"), timeout_s=20))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    # (the init itself blocks every signal on purpose: it waits for them with sigwait)
    assert _sig_fields(cmd.stdout.decode())["SigBlk"] == "0" * 16, cmd.stdout
