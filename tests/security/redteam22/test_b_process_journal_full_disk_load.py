"""Red team 22 B6: on a full state disk ``ProcessJournal.load`` raises OSError (its
compaction cannot write ``processes.jsonl.tmp``), which ``ProcessTable.restore`` does not
catch: ``EdgeNode.start`` fails, so an edge restarted on a full state disk (B4 fills it
from a tenant's argv) does not come up - and every running background process it would
have taken back is left to the keeper's orphan timeout. A half-written ``.tmp`` stays.

The journal is readable; only the optional rewrite fails. The durable behaviour: load
returns what the file holds (compaction is an optimisation) and leaves no partial .tmp.
"""

from __future__ import annotations

import contextlib
import errno
import os

import pytest

from dsec.edge.backends.container import linux
from dsec.edge.fdstore import DurableProcess, ProcessJournal
from dsec.wire.process import ProcessInfo

pytestmark = pytest.mark.root


def test_load_on_a_full_state_disk_returns_the_entries(tmp_path: object) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (a small tmpfs as the state disk)")
    d = os.path.join(str(tmp_path), "state")
    os.mkdir(d)
    linux.mount("tmpfs", d, "tmpfs", 0, "size=64k")
    try:
        j = ProcessJournal(d)
        j.load()
        for pid in range(2, 6):
            j.put(DurableProcess(sid="sb-x", pid=pid, host_pid=10_000 + pid, host_start=7,
                                 exec_cgroup="/x", info=ProcessInfo(pid=pid, cmd="a" * 5000)))
        j.close()
        with open(os.path.join(d, "filler"), "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        again = ProcessJournal(d)
        try:
            live = again.load()
        except OSError as exc:
            pytest.fail(f"ProcessJournal.load raised {exc!r} on a full state disk: "
                        "ProcessTable.restore -> EdgeNode.start fails with it")
        finally:
            again.close()
        assert sorted(live) == [("sb-x", p) for p in range(2, 6)]
        assert not os.path.exists(os.path.join(d, "processes.jsonl.tmp"))
    finally:
        with contextlib.suppress(OSError):
            linux.umount2(d, linux.MNT_DETACH)
