"""Red team 22 B4: a tenant grows ``<state-dir>/processes.jsonl`` by gigabytes with no
process alive.

Every journal line carries the process's whole ``ProcessInfo.cmd``: up to
``MAX_ARGV_BYTES`` (1 MiB) of the tenant's argv, which msgspec's JSON writes as
``\\u00XX`` for each control byte - ~5.5 MB for one argv of 7 x 130,000 ``\\x01``.
``ProcessTable`` appends it at start (``_persist``), again when the process ends
(``_forget``) and an end line at eviction. Compaction runs on a LINE count
(``_lines > 4 * len(live) + 1000``), never on bytes: a tenant looping ``process_start``
of ``/bin/true`` with such an argv puts ~1,000 lines (~5.5 GB) on the edge's state disk
before the first compaction - with nothing running. That disk holds the edge's sandbox
journal too (a full disk fails every tenant's create), and the next edge start reads the
whole file into memory (``ProcessJournal.load``: ``f.read()`` then ``splitlines``).

Here: the table's sequence for 12 short-lived processes, each with that argv (~130 MB
written); the journal must stay bounded by what is live (nothing).
"""

from __future__ import annotations

import os

import msgspec

from dsec.edge.fdstore import DurableProcess, ProcessJournal
from dsec.wire.process import ProcessInfo
from dsec.wire.spec import ExecRequest


def test_journal_bytes_stay_bounded_by_the_live_entries(tmp_path: object) -> None:
    argv = ["/bin/true"] + ["\x01" * 130_000] * 7
    ExecRequest(argv=tuple(argv))          # a request the wire accepts (per-arg and total limits)
    j = ProcessJournal(str(tmp_path))
    j.load()
    try:
        for pid in range(2, 14):
            info = ProcessInfo(pid=pid, cmd=list(argv), started_at=1.0)
            dp = DurableProcess(sid="sb-x", pid=pid, host_pid=10_000 + pid, host_start=7,
                                exec_cgroup="/sys/fs/cgroup/freezer/dsec-x/sb-x/e1",
                                info=info, tenant="t")
            j.put(dp)                                     # _persist: before the answer
            dp.info = msgspec.structs.replace(info, running=False, exit_code=0,
                                              ended_at=2.0)
            j.put(dp)                                     # _forget: its end, journaled
            j.end("sb-x", pid)                            # _evict: the entry goes
        size = os.path.getsize(j.path)
    finally:
        j.close()
    assert not j.live
    assert size <= 16 << 20, (f"processes.jsonl holds {size / 1e6:.0f} MB with no live "
                              "entry after 12 short processes (compaction counts lines, "
                              "not bytes; ~1,000 such lines before it runs)")
