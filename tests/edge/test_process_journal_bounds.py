"""The process journal's bounds and fault paths (red team 22, B4-B6; dsec.edge.fdstore):
an entry's argv is cut to a few KiB with a mark, the file is compacted on bytes, the load
streams past over-long lines, a record is written whole or not at all (a short write on a
filling disk raises and is cut back), a torn tail is cut before the next append even when
the load could not compact (full disk)."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator

import msgspec
import pytest

from dsec.edge import fdstore
from dsec.edge.backends.container import linux
from dsec.edge.fdstore import (
    JOURNAL_CMD_BYTES,
    PROCESS_JOURNAL,
    DurableProcess,
    ProcessJournal,
    cut_cmd,
)
from dsec.errors import BackendError
from dsec.wire.process import ProcessInfo


def _proc(pid: int, cmd: list[str] | str = "sleep 1", sid: str = "sb-a") -> DurableProcess:
    return DurableProcess(sid=sid, pid=pid, host_pid=1000 + pid, host_start=5,
                          exec_cgroup="/x", info=ProcessInfo(pid=pid, cmd=cmd))


def test_cut_cmd_bounds_the_json_marks_the_cut_and_is_idempotent() -> None:
    small = ["/bin/echo", "hi"]
    assert cut_cmd(small) is small
    argv = ["/bin/true", "-x"] + ["\x01" * 130_000] * 7     # ~5.5 MB of JSON
    cut = cut_cmd(argv)
    assert isinstance(cut, list)
    assert len(msgspec.json.encode(cut)) <= JOURNAL_CMD_BYTES
    assert cut[:2] == ["/bin/true", "-x"] and cut[2] and set(cut[2]) == {"\x01"}
    assert "cut to fit" in cut[-1] and str(sum(len(a) + 1 for a in argv)) in cut[-1]
    assert cut_cmd(cut) is cut
    shell = "é" * 50_000
    s = cut_cmd(shell)
    assert isinstance(s, str) and s.startswith("é" * 100) and "cut to fit" in s
    assert len(msgspec.json.encode(s)) <= JOURNAL_CMD_BYTES and cut_cmd(s) is s


def test_file_stays_bounded_by_bytes_with_nothing_live(tmp_path: object) -> None:
    j = ProcessJournal(str(tmp_path))
    j.load()
    big = ["x" * 4000]                         # under the cut: whole 4 KiB lines
    most = 0
    for pid in range(2, 1200):
        j.put(_proc(pid, big))
        j.end("sb-a", pid)
        most = max(most, os.path.getsize(j.path))
    j.close()
    # 2,400 lines of ~4 KiB: the line rule alone let ~1,000 of them (~4 MB) pile up
    assert most <= (1 << 20) + 8192, most


def test_load_streams_past_an_over_long_line_and_cuts_old_entries(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    d = str(tmp_path)
    enc = msgspec.json.Encoder()
    with open(os.path.join(d, PROCESS_JOURNAL), "wb") as f:
        # an earlier release's whole-argv entry, a line over the cap, then a good one
        f.write(enc.encode(fdstore._Put(_proc(2, ["a" * 20_000]))) + b"\n")
        f.write(b"{" + b"z" * 5000 + b"\n")
        f.write(enc.encode(fdstore._Put(_proc(3))) + b"\n")
    j = ProcessJournal(d)
    monkeypatch.setattr(fdstore, "_MAX_LOAD_LINE", 1000)
    live = j.load()
    j.close()
    assert sorted(live) == [("sb-a", 3)]        # the entry line is over 1,000 too
    monkeypatch.setattr(fdstore, "_MAX_LOAD_LINE", 8 << 20)
    with open(os.path.join(d, PROCESS_JOURNAL), "ab") as f:
        f.write(enc.encode(fdstore._Put(_proc(4, ["b" * 20_000]))) + b"\n")
    live = ProcessJournal(d).load()
    assert sorted(live) == [("sb-a", 3), ("sb-a", 4)]
    assert len(msgspec.json.encode(live[("sb-a", 4)].info.cmd)) <= JOURNAL_CMD_BYTES


@pytest.fixture
def small_disk(tmp_path: object) -> Iterator[str]:
    if os.geteuid() != 0:
        pytest.skip("needs root (a small tmpfs as the state disk)")
    d = os.path.join(str(tmp_path), "state")
    os.mkdir(d)
    linux.mount("tmpfs", d, "tmpfs", 0, "size=128k")
    try:
        yield d
    finally:
        with contextlib.suppress(OSError):
            linux.umount2(d, linux.MNT_DETACH)


def _fill(d: str, leave: int) -> str:
    filler = os.path.join(d, "filler")
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    os.truncate(filler, os.path.getsize(filler) - leave)
    return filler


@pytest.mark.root
def test_a_short_write_raises_and_is_cut_back(small_disk: str) -> None:
    d = small_disk
    j = ProcessJournal(d)
    j.load()
    j.put(_proc(2))
    filler = _fill(d, 0)         # what is left of the file's page: a 4.3 KiB line is cut
    with pytest.raises(BackendError, match="free space"):
        j.put(_proc(3, ["y" * 4000]))
    assert ("sb-a", 3) not in j.live
    with open(j.path, "rb") as f:
        assert f.read().endswith(b"\n")          # no half line left behind
    os.unlink(filler)
    j.put(_proc(4))
    j.close()
    assert sorted(ProcessJournal(d).load()) == [("sb-a", 2), ("sb-a", 4)]


@pytest.mark.root
def test_a_torn_tail_is_cut_when_the_load_cannot_compact(
        small_disk: str, monkeypatch: pytest.MonkeyPatch) -> None:
    d = small_disk
    j = ProcessJournal(d)
    j.load()
    j.put(_proc(2, ["z" * 3000]))
    j.close()
    with open(os.path.join(d, PROCESS_JOURNAL), "ab") as f:
        f.write(b'["p",{"sid":"sb-a","pid":9')    # the crash's half line
    filler = _fill(d, 0)
    again = ProcessJournal(d)
    assert sorted(again.load()) == [("sb-a", 2)]  # compaction failed, logged
    assert not os.path.exists(os.path.join(d, PROCESS_JOURNAL + ".tmp"))
    os.unlink(filler)
    again.put(_proc(3))                            # lands on a line of its own
    again.close()
    assert sorted(ProcessJournal(d).load()) == [("sb-a", 2), ("sb-a", 3)]
    # and where even the cut fails, a newline fences the tail off
    j3 = ProcessJournal(d)
    j3.load()
    j3.close()
    with open(os.path.join(d, PROCESS_JOURNAL), "ab") as f:
        f.write(b'["p",{"sid":"sb-a","pid":9')
    filler = _fill(d, 0)
    j4 = ProcessJournal(d)
    j4.load()
    os.unlink(filler)

    def no_truncate(fd: int, n: int) -> None:
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(os, "ftruncate", no_truncate)
    j4.put(_proc(5))
    j4.close()
    monkeypatch.undo()
    assert sorted(ProcessJournal(d).load()) == [("sb-a", 2), ("sb-a", 3), ("sb-a", 5)]
