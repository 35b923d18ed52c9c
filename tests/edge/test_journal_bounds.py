"""The sandbox journal's byte bounds and full-disk open (red team 22, B4/B6's class in
dsec.edge.journal): tombstones (each with its spec: env up to 512 KiB) are kept by bytes
as well as count, the file is compacted on bytes, and an open whose rewrite fails on a
full state disk still starts (it appends to the file as it is, its tail fenced off)."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator

import pytest

from dsec.edge.backends.container import linux
from dsec.edge.journal import JournalEnd, JournalRecord, SandboxJournal
from dsec.wire.spec import SandboxSpec

BIG = SandboxSpec(env={"K": "\x01" * 50_000})       # ~300 KB of JSON per line


def _rec(i: int, spec: SandboxSpec | None = None) -> JournalRecord:
    return JournalRecord(id=f"sb-{i:012x}-n1", state="running", spec=spec or SandboxSpec(),
                         created_at=1.0, last_active_at=2.0)


def _end(i: int, spec: SandboxSpec | None = None) -> JournalEnd:
    return JournalEnd(id=f"sb-{i:012x}-n1", state="destroyed", spec=spec or SandboxSpec(),
                      created_at=1.0, ended_at=3.0, reason="requested")


def test_tombstones_and_the_file_are_bounded_by_bytes(tmp_path: object) -> None:
    d = str(tmp_path)
    ended: list[JournalEnd] = []
    j = SandboxJournal(d, sync="write", keep_ended_bytes=1 << 20, compact_min_bytes=2 << 20)
    j.open(keep=lambda: ((), ended))
    most = 0
    for i in range(40):                        # 40 sandboxes created and destroyed
        j.put(_rec(i, BIG))
        j.flush()
        e = _end(i, BIG)
        ended.append(e)
        j.end(e)
        j.flush()
        most = max(most, os.path.getsize(j.path))
    j.close()
    # ~24 MB written; the line rule (4 x (0 + 10,000) + 10,000 lines) never compacted
    assert most <= 4 * (1 << 20) + (2 << 20) + (1 << 20), most
    j2 = SandboxJournal(d, keep_ended_bytes=1 << 20)
    got = j2.open()
    j2.close()
    assert got.ended[-1].id == _end(39).id     # the newest kept; the rewrite trims:
    assert os.path.getsize(j2.path) <= 1 << 20


@pytest.fixture
def tiny(tmp_path: object) -> Iterator[str]:
    if os.geteuid() != 0:
        pytest.skip("needs root (a small tmpfs as the state disk)")
    d = os.path.join(str(tmp_path), "tiny")
    os.mkdir(d)
    linux.mount("tmpfs", d, "tmpfs", 0, "size=256k")
    try:
        yield d
    finally:
        with contextlib.suppress(OSError):
            linux.umount2(d, linux.MNT_DETACH)


@pytest.mark.root
def test_open_on_a_full_disk_starts_and_appends(tiny: str) -> None:
    state = os.path.join(tiny, "state")
    j = SandboxJournal(state, sync="write")
    j.open()
    for i in range(5):
        j.put(_rec(i))
    j.flush()
    j.close()
    with open(os.path.join(state, "sandboxes.jsonl"), "ab") as f:
        f.write(b'["put","sb-0000')                 # a crash's half line
    filler = os.path.join(tiny, "filler")
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    j2 = SandboxJournal(state, sync="write")
    got = j2.open()                                   # the rewrite fails: logged
    assert sorted(got.records) == sorted(_rec(i).id for i in range(5))
    assert not os.path.exists(os.path.join(state, "sandboxes.jsonl.tmp"))
    os.unlink(filler)
    j2.put(_rec(7))
    j2.flush()
    j2.close()
    j3 = SandboxJournal(state)
    assert sorted(j3.open().records) == sorted(_rec(i).id for i in (0, 1, 2, 3, 4, 7))
    j3.close()
