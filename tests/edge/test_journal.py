from __future__ import annotations

import os

import pytest

from dsec.edge.journal import JournalRecord, SandboxJournal
from dsec.edge.spec import SandboxSpec
from dsec.errors import InUse


def rec(i: int, state: str = "running") -> JournalRecord:
    return JournalRecord(id=f"sb-{i:012x}-n1", state=state, spec=SandboxSpec(),  # type: ignore[arg-type]
                         created_at=1.0, last_active_at=2.0)


def test_batched_writes_skip_what_cancels_out(tmp_path) -> None:  # type: ignore[no-untyped-def]
    j = SandboxJournal(str(tmp_path))
    assert j.open() == {}
    j.put(rec(1))
    j.put(rec(2))
    j.delete(rec(2).id)  # created and destroyed within one tick: never written
    assert j.flush() == 1
    j.put(rec(1, "paused"))
    j.delete(rec(3).id)  # never on disk: nothing to delete
    assert j.flush() == 1
    j.close()
    j2 = SandboxJournal(str(tmp_path))
    got = j2.open()
    assert list(got) == [rec(1).id] and got[rec(1).id].state == "paused"
    j2.close()


def test_torn_tail_is_skipped_and_lock_is_exclusive(tmp_path) -> None:  # type: ignore[no-untyped-def]
    j = SandboxJournal(str(tmp_path))
    j.open()
    j.put(rec(1))
    j.flush()
    with pytest.raises(InUse, match=str(os.getpid())):
        SandboxJournal(str(tmp_path)).open()
    j.close()
    with open(os.path.join(tmp_path, "sandboxes.jsonl"), "ab") as f:
        f.write(b'["put","sb-0000')  # a crash mid-write
    j3 = SandboxJournal(str(tmp_path))
    assert list(j3.open()) == [rec(1).id]
    j3.close()


def test_compaction_bounds_the_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    j = SandboxJournal(str(tmp_path))
    j.open()
    live = [rec(0)]
    j.put(live[0])
    for i in range(1, 12_000):
        j.put(rec(i))
        j.flush()
        j.delete(rec(i).id)
        j.flush(lambda: live)
    assert os.path.getsize(j.path) < 200_000
    j.close()
    j2 = SandboxJournal(str(tmp_path))
    assert list(j2.open()) == [rec(0).id]
    j2.close()
