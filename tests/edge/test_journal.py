from __future__ import annotations

import asyncio
import errno
import os
import subprocess
from pathlib import Path

import msgspec
import pytest

from dsec.edge.journal import JournalEnd, JournalRecord, SandboxJournal
from dsec.errors import BackendError, InUse
from dsec.wire.spec import SandboxSpec


def rec(i: int, state: str = "running") -> JournalRecord:
    return JournalRecord(id=f"sb-{i:012x}-n1", state=state, spec=SandboxSpec(),  # type: ignore[arg-type]
                         created_at=1.0, last_active_at=2.0)


def end(i: int, reason: str = "requested") -> JournalEnd:
    return JournalEnd(id=f"sb-{i:012x}-n1", state="destroyed", spec=SandboxSpec(),
                      created_at=1.0, ended_at=3.0, reason=reason, detail=f"d{i}")


def test_tick_mode_skips_what_cancels_out(tmp_path) -> None:  # type: ignore[no-untyped-def]
    j = SandboxJournal(str(tmp_path), sync="tick")
    assert j.open().records == {}
    j.put(rec(1))
    j.put(rec(2))
    j.end(end(2))  # created and destroyed within one tick: never written
    assert j.flush() > 0 and j.writes == 1
    j.put(rec(1, "paused"))
    j.end(end(3))  # never on disk: nothing to write
    j.flush()
    assert j.writes == 2
    j.close()
    j2 = SandboxJournal(str(tmp_path))
    got = j2.open()
    assert list(got.records) == [rec(1).id] and got.records[rec(1).id].state == "paused"
    assert got.ended == []
    j2.close()


def test_tombstones_survive_reopen_newest_kept(tmp_path) -> None:  # type: ignore[no-untyped-def]
    j = SandboxJournal(str(tmp_path), keep_ended=3)
    j.open()
    for i in range(5):
        j.put(rec(i))
    j.flush()
    for i in range(4):
        j.end(end(i, reason="ttl" if i % 2 else "requested"))
    j.flush()
    j.close()
    j2 = SandboxJournal(str(tmp_path), keep_ended=3)
    got = j2.open()
    assert list(got.records) == [rec(4).id]
    assert [(e.id, e.reason, e.detail) for e in got.ended] == [
        (end(i).id, "ttl" if i % 2 else "requested", f"d{i}") for i in (1, 2, 3)]
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
    assert list(j3.open().records) == [rec(1).id]
    j3.close()


def test_compaction_bounds_the_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    j = SandboxJournal(str(tmp_path), sync="write", keep_ended=100)
    live = [rec(0)]
    ended: list[JournalEnd] = []
    j.open(keep=lambda: (live, ended[-100:]))
    j.put(live[0])
    for i in range(1, 12_000):
        j.put(rec(i))
        j.flush()
        ended.append(end(i))
        j.end(ended[-1])
        j.flush()
    assert os.path.getsize(j.path) < 500_000
    j.close()
    j2 = SandboxJournal(str(tmp_path), keep_ended=100)
    got = j2.open()
    assert list(got.records) == [rec(0).id]
    assert [e.id for e in got.ended] == [e.id for e in ended[-100:]]
    j2.close()


async def test_group_commit_one_write_covers_every_waiter(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """200 concurrent commits share a handful of write+fsync calls, and each returns
    only once its own record is in the file."""
    j = SandboxJournal(str(tmp_path))
    j.open()
    seen_missing = []

    async def one(i: int) -> None:
        j.put(rec(i))
        await j.commit()
        if rec(i).id.encode() not in Path(j.path).read_bytes():
            seen_missing.append(i)

    await asyncio.gather(*(one(i) for i in range(200)))
    assert seen_missing == []
    assert 1 <= j.syncs <= 3 and j.writes == j.syncs
    # one at a time: one write+fsync each (nothing to share)
    for i in range(200, 205):
        await one(i)
    assert j.syncs <= 3 + 5 and seen_missing == []
    await j.drain()
    j.close()
    j2 = SandboxJournal(str(tmp_path))
    assert len(j2.open().records) == 205
    j2.close()


@pytest.fixture
def tiny_fs(tmp_path):  # type: ignore[no-untyped-def]
    """A 256 KiB tmpfs of our own: a disk that really fills up."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs (CI runs as root)")
    d = str(tmp_path / "tiny")
    os.makedirs(d)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", d], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", d], check=False)


async def test_full_disk_fails_the_commit_and_loses_nothing(tiny_fs: str) -> None:
    j = SandboxJournal(os.path.join(tiny_fs, "state"))
    j.open()
    j.put(rec(1))
    await j.commit()
    filler = os.path.join(tiny_fs, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"x" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    for i in range(2, 100):  # more than the free tail of the file's last page
        j.put(rec(i, "paused" if i == 3 else "running"))
    with pytest.raises(BackendError, match="could not record.*No space left"):
        await asyncio.gather(j.commit(), j.commit())
    assert j.dirty  # still noted: the next write retries them
    os.unlink(filler)
    await j.commit()
    j.close()
    j2 = SandboxJournal(os.path.join(tiny_fs, "state"))
    got = j2.open().records
    assert len(got) == 99 and got[rec(3).id].state == "paused"
    assert got[rec(1).id].state == got[rec(99).id].state == "running"
    j2.close()


def test_a_line_of_each_earlier_layout_still_reads() -> None:
    """array_like records: fields are appended, defaulted. A line main wrote before the
    ports field (nb's net_generation, ceiling_deny last) reads with no ports; one with
    ports keeps nb's fields where they were (merge of nc after nb)."""
    from dsec.edge.journal import _decoder, _encoder
    from dsec.wire.ports import PortRecord

    rec = JournalRecord(id="sb-0123456789ab-n1", state="running", spec=SandboxSpec(),
                        created_at=1.0, last_active_at=2.0, net_generation=3,
                        ceiling_deny=("198.51.100.0/24",),
                        ports=(PortRecord(port=8000, generation=7, exposed_at=1.5),))
    line = msgspec.json.decode(_encoder.encode(rec))
    # issue 19's lifetime fields (expires_at, ttl_left_s, paused_reason) come after ports,
    # then the pause time of the paused retention (red team 19, B4)
    assert line[-4:] == [None, None, "", None], line
    assert _decoder.decode(_encoder.encode(line)) == rec
    line = line[:-1]                       # the line as written before paused_at
    assert _decoder.decode(_encoder.encode(line)) == rec
    line = line[:-3]                       # the line as written before issue 19
    assert line[-3:-1] == [3, ["198.51.100.0/24"]], line
    assert _decoder.decode(_encoder.encode(line)) == rec
    before_ports = _decoder.decode(msgspec.json.encode(line[:-1]))
    assert isinstance(before_ports, JournalRecord)
    assert before_ports.ports == () and before_ports.net_generation == 3
    before_net = _decoder.decode(msgspec.json.encode(line[:-3]))
    assert isinstance(before_net, JournalRecord)
    assert before_net.net_generation == 0 and before_net.ports == ()
