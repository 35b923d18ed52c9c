"""Red team 22 B5: a short write to ``processes.jsonl`` (state disk full mid-line) is
neither an error nor repaired: the torn line swallows the next record.

``ProcessJournal._append`` does ``os.write(fd, data)`` and ignores its count. On a disk
that fills during the write (B4 lets a tenant fill it with its argv bytes) the kernel
writes what fits and returns that count - no ENOSPC for this call. So:

- ``put`` returns normally: ``process_start`` answers for a process whose entry is half
  a line (not durable; a restart drops its descriptors);
- the next append (once space is back) lands on the same line, after the torn half: at
  load the merged line is unreadable and is skipped - a second process, journaled whole,
  is lost too (its pipes dropped by ``restore``; the process runs on untracked in its
  sandbox).
"""

from __future__ import annotations

import contextlib
import errno
import os

import pytest

from dsec.edge.backends.container import linux
from dsec.edge.fdstore import DurableProcess, ProcessJournal
from dsec.errors import DsecError
from dsec.wire.process import ProcessInfo

pytestmark = pytest.mark.root


def _dp(pid: int, cmd: str) -> DurableProcess:
    return DurableProcess(sid="sb-x", pid=pid, host_pid=10_000 + pid, host_start=7,
                          exec_cgroup="/sys/fs/cgroup/freezer/dsec-x/sb-x/e1",
                          info=ProcessInfo(pid=pid, cmd=cmd, started_at=1.0), tenant="t")


def test_a_short_journal_write_loses_no_later_record(tmp_path: object) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (a small tmpfs as the state disk)")
    d = os.path.join(str(tmp_path), "state")
    os.mkdir(d)
    linux.mount("tmpfs", d, "tmpfs", 0, "size=256k")
    try:
        j = ProcessJournal(d)
        j.load()
        filler = os.path.join(d, "filler")
        with open(filler, "wb", buffering=0) as f:     # fill the disk but ~8 KiB
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        os.truncate(filler, os.path.getsize(filler) - 8192)
        first_raised = False
        try:
            j.put(_dp(2, "A" * 20_000))          # does not fit: a short write
        except DsecError:
            first_raised = True                  # (the honest answer: not durable)
        os.unlink(filler)                        # space comes back
        j.put(_dp(3, "echo small"))              # a whole, small record
        j.close()
        live = ProcessJournal(d).load()
        assert ("sb-x", 3) in live, ("a record journaled whole after a short write was "
                                     "lost: it shares the torn line")
        assert first_raised or ("sb-x", 2) in live, (
            "put() returned normally but its record is not in the journal (a short write "
            "was taken for a whole one)")
    finally:
        with contextlib.suppress(OSError):
            linux.umount2(d, linux.MNT_DETACH)
