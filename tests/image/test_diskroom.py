"""The process's ledger of disk room granted and not yet written (dsec.image.diskroom):
a check and its grant are one step, so two writers never count the same free bytes
(red team 16 F9's class: layer fetches, snapshots)."""

from __future__ import annotations

import os
import threading

from dsec.image import diskroom


def test_a_grant_is_seen_by_the_next_check_until_written_or_released(tmp_path: object) -> None:
    path = str(tmp_path)
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    half = free // 2 + 1
    ask = lambda r: half if half <= r.free - r.pending else None
    first, _ = diskroom.admit(path, ask)
    assert first is not None and diskroom.pending(path) >= half
    second, room = diskroom.admit(path, ask)
    assert second is None and room.pending >= half        # refused: the room is promised
    first.wrote(half - 1)                                 # written: statvfs counts it now
    assert diskroom.pending(path) == 1
    first.release()
    assert diskroom.pending(path) == 0
    again, _ = diskroom.admit(path, ask)
    assert again is not None
    again.release()


def test_concurrent_admissions_never_grant_more_than_there_is(tmp_path: object) -> None:
    path = str(tmp_path)
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    each = free // 3
    grants: list[diskroom.Grant] = []
    lock = threading.Lock()
    go = threading.Barrier(8)

    def one() -> None:
        go.wait()
        g, _ = diskroom.admit(path, lambda r: each if each <= r.free - r.pending else None)
        if g is not None:
            with lock:
                grants.append(g)

    ts = [threading.Thread(target=one) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    try:
        assert 1 <= len(grants) <= 3
        assert sum(g.remaining for g in grants) <= free
    finally:
        for g in grants:
            g.release()
    assert diskroom.pending(path) == 0


async def test_a_writer_cancelled_while_admitted_leaks_no_grant(tmp_path: object) -> None:
    import asyncio
    import time

    path = str(tmp_path)
    started = threading.Event()

    def slow_free(p: str) -> int:
        started.set()
        time.sleep(0.3)           # statvfs on a slow filesystem
        return 1 << 40

    task = asyncio.ensure_future(diskroom.admit_async(path, lambda r: 1 << 20,
                                                      free=slow_free))
    await asyncio.to_thread(started.wait, 5)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    deadline = time.monotonic() + 5
    while diskroom.pending(path) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert diskroom.pending(path) == 0
