"""Red team 22 B1: the descriptor keeper (dsec.edge.fdkeeper) at its descriptor limit.

The keeper holds up to three descriptors per background process of the node, in one
process with one RLIMIT_NOFILE (raised to its hard limit, finite: 20,000 on this box,
often 1,024-65,536 elsewhere). At the limit:

- a ``put`` arrives with its SCM_RIGHTS truncated (MSG_CTRUNC): the keeper silently
  drops the key (and what it held before under it) while the edge, whose ``sendmsg``
  succeeded, believes the process is durable;
- ``accept`` fails with EMFILE, ``serve`` does ``continue``, and the listener stays
  readable: the keeper spins at 100 % CPU and never answers a new connection again. A
  restarted edge's ``keys``/``take`` time out (5 s) and return None, so
  ``ProcessTable.restore`` treats every running process as "descriptors lost" and
  kills its exec cgroup.

The limit is lowered here (a wrapper runs the keeper under ``prlimit --nofile=64``) so
the test reaches it with 30 processes' worth of pipes instead of thousands.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator

import pytest

from dsec.edge.fdstore import FdStore

pytestmark = pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit")


@pytest.fixture
def small_store(tmp_path: object) -> Iterator[FdStore]:
    wrapper = os.path.join(str(tmp_path), "py")
    with open(wrapper, "w") as f:
        f.write(f"#!/bin/sh\nexec prlimit --nofile=64:64 {os.path.realpath(sys.executable)} \"$@\"\n")
    os.chmod(wrapper, 0o755)
    state = os.path.join(str(tmp_path), "state")
    os.mkdir(state)
    s = FdStore(state, orphan_s=30.0, python=wrapper)
    try:
        yield s
    finally:
        s.close()
        if s.keeper is not None:
            if s.keeper.poll() is None:
                s.keeper.kill()
            s.keeper.wait()


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read()
    fields = raw[raw.rfind(b")") + 2:].split()
    return int(fields[11]) + int(fields[12])


def test_keeper_at_its_fd_limit_keeps_answering_and_loses_nothing_silently(
        small_store: FdStore) -> None:
    store = small_store
    ours: list[int] = []
    keys = []
    try:
        for i in range(30):           # 3 descriptors each: past 64 with the keeper's own
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            in_r, in_w = os.pipe()
            ours += [out_r, out_w, err_r, err_w, in_r, in_w]
            key = f"sb-{i}/{1000 + i}/{5000 + i}"
            store.put(key, {"out": out_r, "err": err_r, "in": in_w})   # no error raised
            keys.append(key)
        assert store.keeper is not None
        time.sleep(0.3)
        problems = []
        # a restarted edge asks what is held (restore): it must get an answer ...
        again = FdStore(os.path.dirname(store.path))
        t0 = time.monotonic()
        held = again.keys()
        waited = time.monotonic() - t0
        again.close()
        if held is None:
            problems.append(f"no answer from the keeper in {waited:.1f} s: a restarted edge "
                            "would kill every background process (restore: descriptors lost)")
        # every put the edge was not told failed must still be held
        elif sorted(held) != sorted(keys):
            problems.append(f"{len(keys) - len(held)} of {len(keys)} keys silently dropped "
                            "by the keeper (SCM_RIGHTS truncated at its descriptor limit) "
                            "though put() succeeded")
        # ... and the keeper must not burn a CPU while a connection waits
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as pending:
            pending.connect(store.path)
            pid = store.keeper.pid
            before = _cpu_ticks(pid)
            time.sleep(1.0)
            spent = (_cpu_ticks(pid) - before) / os.sysconf("SC_CLK_TCK")
        if spent > 0.15:
            problems.append(f"the keeper spent {spent:.2f} s of CPU in 1 s with a connection "
                            "pending: accept() fails with EMFILE and the listener stays "
                            "readable (busy loop)")
        assert not problems, "; ".join(problems)
    finally:
        for fd in ours:
            os.close(fd)
