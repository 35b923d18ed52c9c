"""RolloutQueue: idempotent submits, one trajectory per task, recovery, acks, durability."""

from __future__ import annotations

import os
import signal
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dsec.errors import Conflict, InvalidArgument, InvalidTransition
from dsec.rl.worker.queue import RolloutQueue


def test_submit_is_idempotent_per_task_id(tmp_path: Path) -> None:
    q = RolloutQueue(str(tmp_path / "q.sqlite"))
    assert q.submit([("a", b"1"), ("b", b"2")]) == (2, 0)
    assert q.submit([("a", b"1"), ("c", b"3")]) == (1, 1)
    with pytest.raises(Conflict, match="different body"):
        q.submit([("d", b"4"), ("a", b"other")])
    assert q.counts().queued == 3           # all or nothing: "d" was not recorded
    with pytest.raises(InvalidArgument, match="twice"):
        q.submit([("e", b"5"), ("e", b"5")])
    assert stat.S_IMODE(os.stat(tmp_path / "q.sqlite").st_mode) == 0o600


def test_lifecycle_one_trajectory_per_task(tmp_path: Path) -> None:
    q = RolloutQueue(str(tmp_path / "q.sqlite"))
    q.submit([("a", b"A"), ("b", b"B"), ("c", b"C")])
    rows = q.claim(2)
    assert [(r.task_id, r.attempt) for r in rows] == [("a", 1), ("b", 1)]
    s1 = q.finish("a", 1, b"traj-a")
    with pytest.raises(InvalidTransition, match="'done'"):
        q.finish("a", 1, b"again")              # a task never yields two trajectories
    # a crashed worker's in-flight episode comes back as the next attempt
    assert [r.task_id for r in q.recover()] == ["b"]
    with pytest.raises(InvalidTransition, match="queued"):
        q.finish("b", 1, b"stale")
    rows = q.claim(5)
    assert [(r.task_id, r.attempt) for r in rows] == [("b", 2), ("c", 1)]
    with pytest.raises(InvalidTransition, match="attempt 1 finished, but attempt 2"):
        q.finish("b", 1, b"stale")
    s2 = q.finish("b", 2, b"traj-b")
    assert [(d.seq, d.task_id, d.attempt, d.body) for d in q.read(0, 10)] == [
        (s1, "a", 1, b"traj-a"), (s2, "b", 2, b"traj-b")]
    assert [d.task_id for d in q.read(s1, 10)] == ["b"]
    assert q.ack([s1, s1, 999]) == 1
    assert [d.seq for d in q.read(0, 10)] == [s2]
    c = q.counts()
    assert (c.queued, c.running, c.done, c.unacked) == (0, 1, 2, 1)
    s3 = q.finish("c", 1, b"traj-c")
    assert q.ack(upto=s3 - 1) == 1 and [d.seq for d in q.read(0, 10)] == [s3]
    with pytest.raises(InvalidTransition, match="requeue"):
        q.requeue("c")


_KILL_CHILD = r"""
import sys
from dsec.rl.worker.queue import RolloutQueue
q = RolloutQueue(sys.argv[1])
i = 0
while True:
    q.submit([(f"t{i}", b"x")])
    print(i, flush=True)             # the answer goes out only after the commit
    [row] = q.claim(1)
    q.finish(row.task_id, row.attempt, b"traj")
    print(f"f{i}", flush=True)
    i += 1
"""


def test_answered_means_durable_across_kill9(tmp_path: Path) -> None:
    """kill -9 of a process in a tight submit/finish loop: every submit and finish it
    announced is in the file afterwards (synchronous=FULL, WAL), none half-done."""
    path = str(tmp_path / "q.sqlite")
    p = subprocess.Popen([sys.executable, "-c", _KILL_CHILD, path], stdout=subprocess.PIPE,
                         text=True)
    seen: list[str] = []
    try:
        assert p.stdout is not None
        while len(seen) < 300:
            line = p.stdout.readline()
            assert line, "the child died on its own"
            seen.append(line.strip())
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    submitted = [s for s in seen if not s.startswith("f")]
    finished = [s[1:] for s in seen if s.startswith("f")]
    db = sqlite3.connect(path)
    ids = {r[0]: r[1] for r in db.execute("SELECT task_id, state FROM tasks")}
    trajs = [r[0] for r in db.execute("SELECT task_id FROM trajectories")]
    db.close()
    assert all(f"t{i}" in ids for i in submitted)
    assert all(ids[f"t{i}"] == "done" for i in finished)
    assert len(trajs) == len(set(trajs))
    # done <=> has a trajectory (one transaction), whatever the kill interrupted
    assert {t for t, s in ids.items() if s == "done"} == set(trajs)
