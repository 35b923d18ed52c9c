"""Red team 23 B1: ``FdStore.put_async`` still blocks the edge's event loop on a keeper
that stopped reading.

Commit 2d64400 moved the *wait for the ack* off the loop ("a stopped keeper held every
request 2 s per start"), and ``_send_drop_now`` sends drops with MSG_DONTWAIT for the
same reason ("never blocks the loop: a keeper that stopped reading (SIGSTOP) with its
queue full"). But ``put_async`` still sends the put itself with a *blocking*
``sendmsg`` (``FdStore._send``). A SOCK_SEQPACKET unix socket charges every queued
message to the sender's SO_SNDBUF (212,992 bytes here): once a few hundred puts wait in
a keeper that does not read (SIGSTOP, swapped out, a debugger, a 2-core host under
load), the next ``process_start``/``process_run``/stdin close blocks the whole edge
loop - every request, every heartbeat - until the keeper reads again, forever if it
never does.

The same blocking send deadlocks without any SIGSTOP: ``_redeposit_all`` (a new keeper
after the old one died) sends one put per running process in one loop callback, the
keeper answers each, the acks pile up unread in the edge's socket (the loop is busy in
the burst), the keeper's own blocking ``_send`` of an ack then stops it, and the edge's
next put blocks on it: both processes wait on each other for good (see
test_b_redeposit_all_deadlock.py).

Fix: send puts with MSG_DONTWAIT as drops are; a put that does not fit now is not
durable (refused, said in the process's output) or waits in a bounded queue flushed by
a writer callback - never a blocking send on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from dsec.edge.fdstore import FdStore
from dsec.errors import DsecError


@pytest.fixture
def store(tmp_path: object) -> Iterator[FdStore]:
    s = FdStore(str(tmp_path), orphan_s=30.0)
    try:
        yield s
    finally:
        if s.keeper is not None and s.keeper.poll() is None:
            os.kill(s.keeper.pid, signal.SIGCONT)
        s.close()
        if s.keeper is not None:
            if s.keeper.poll() is None:
                s.keeper.kill()
            s.keeper.wait()


def test_put_async_never_blocks_the_loop_on_a_stopped_keeper(store: FdStore) -> None:
    r, w = os.pipe()
    slowest = [0.0]
    done = threading.Event()
    confirms: list[object] = []

    async def starts() -> None:
        confirms.append(store.put_async("sb/1/1", {"out": r}))   # spawns the keeper
        await confirms[-1]()
        assert store.keeper is not None
        os.kill(store.keeper.pid, signal.SIGSTOP)                 # it stops reading
        for i in range(1200):                                     # process starts
            t0 = time.monotonic()
            try:
                confirms.append(store.put_async(f"sb/{i + 2}/1", {"out": r}))
            except DsecError:
                pass                     # refused now: fine, the start says so
            slowest[0] = max(slowest[0], time.monotonic() - t0)
            await asyncio.sleep(0)

    def run() -> None:
        with contextlib.suppress(BaseException):   # reported through slowest/done
            asyncio.run(starts())
        done.set()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    finished = done.wait(10.0)
    if not finished:
        # the loop is stuck in sendmsg: let the keeper read so the thread can end
        slowest[0] = max(slowest[0], 10.0)
        assert store.keeper is not None
        os.kill(store.keeper.pid, signal.SIGCONT)
        done.wait(20.0)
    os.close(r)
    os.close(w)
    assert finished and slowest[0] < 0.5, (
        f"one put_async held the event loop {slowest[0]:.1f} s (blocking sendmsg to a "
        "stopped keeper): every request of the edge waited with it")
