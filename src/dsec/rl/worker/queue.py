"""The rollout worker's durable record: submitted tasks and finished trajectories.

One SQLite file (WAL, ``synchronous=FULL``: a commit survives kill -9 and power loss)
is the single source of truth for a worker's rollouts. Every answer the worker gives is
given after the transaction that makes it true has committed (durable before
acknowledged):

- ``submit`` commits the tasks, then the trainer hears "accepted". A task id is the
  trainer's own; submitting it again (a trainer that crashed before it saw the answer)
  is a no-op, and the same id with a different body is refused.
- An episode's trajectory is committed in the same transaction that marks its task
  ``done``, so a task has at most one trajectory, whatever crashes when.
- Trajectories carry a sequence number. The trainer reads ``after`` the last sequence
  it has durably processed and acknowledges what it no longer needs; unacknowledged ones
  are delivered again after a reconnect, acknowledged ones are deleted.

A task's lifecycle is a table (:data:`TASK_TRANSITIONS`). ``running`` tasks found at
start are the episodes a killed worker had in flight: :meth:`RolloutQueue.recover`
puts them back to ``queued`` with their attempt counter raised (their sandboxes are
destroyed by the worker; the episode starts over in a fresh sandbox).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from dsec.errors import Conflict, InvalidArgument, InvalidTransition

__all__ = ["TASK_TRANSITIONS", "Delivery", "QueueCounts", "RolloutQueue", "TaskRow",
           "TaskState"]

TaskState = Literal["queued", "running", "done"]
TaskEvent = Literal["claim", "finish", "requeue"]

TASK_TRANSITIONS: dict[TaskState, dict[TaskEvent, TaskState]] = {
    "queued": {"claim": "running"},
    "running": {"finish": "done", "requeue": "queued"},
    "done": {},
}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    task_id TEXT PRIMARY KEY,
    body BLOB NOT NULL,
    state TEXT NOT NULL,
    attempt INTEGER NOT NULL DEFAULT 0,
    submitted_at REAL NOT NULL,
    seq INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS tasks_state ON tasks (state, seq);
CREATE TABLE IF NOT EXISTS trajectories (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id TEXT NOT NULL UNIQUE,
    attempt INTEGER NOT NULL,
    body BLOB NOT NULL
);
"""


@dataclass(slots=True, frozen=True)
class TaskRow:
    task_id: str
    body: bytes
    attempt: int


@dataclass(slots=True, frozen=True)
class Delivery:
    """One finished trajectory as the trainer receives it."""

    seq: int
    task_id: str
    attempt: int
    body: bytes


@dataclass(slots=True, frozen=True)
class QueueCounts:
    queued: int
    running: int
    done: int
    unacked: int


def _next(task_id: str, state: TaskState, event: TaskEvent) -> TaskState:
    nxt = TASK_TRANSITIONS[state].get(event)
    if nxt is None:
        raise InvalidTransition(f"task {task_id!r} cannot {event} in state {state!r}",
                                task_id=task_id, event=event, state=state)
    return nxt


class RolloutQueue:
    """Thread-safe (one connection behind a lock; every call is one short transaction)."""

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # the trainer's data: owner only
        os.close(fd)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _tx(self) -> _Tx:
        return _Tx(self)

    # -- trainer side ------------------------------------------------------------------
    def submit(self, tasks: Sequence[tuple[str, bytes]]) -> tuple[int, int]:
        """Record ``(task_id, body)`` pairs; returns (newly accepted, already known).
        All or nothing: a known id with a different body raises :class:`Conflict` and
        records none of the batch."""
        if len({t for t, _ in tasks}) != len(tasks):
            raise InvalidArgument("a submit names the same task id twice")
        now = time.time()
        new = 0
        with self._tx() as db:
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) FROM tasks").fetchone()[0]
            for task_id, body in tasks:
                row = db.execute("SELECT body FROM tasks WHERE task_id = ?",
                                 (task_id,)).fetchone()
                if row is not None:
                    if bytes(row[0]) != body:
                        raise Conflict(
                            f"task {task_id!r} was submitted before with a different body; "
                            "a task id names one task for ever: use a new id",
                            task_id=task_id)
                    continue
                seq += 1
                db.execute("INSERT INTO tasks (task_id, body, state, attempt, submitted_at, "
                           "seq) VALUES (?, ?, 'queued', 0, ?, ?)", (task_id, body, now, seq))
                new += 1
        return new, len(tasks) - new

    def read(self, after: int, limit: int) -> list[Delivery]:
        """Unacknowledged trajectories with a sequence number above ``after``, oldest
        first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, task_id, attempt, body FROM trajectories WHERE seq > ? "
                "ORDER BY seq LIMIT ?", (after, limit)).fetchall()
        return [Delivery(int(s), str(t), int(a), bytes(b)) for s, t, a, b in rows]

    def ack(self, seqs: Iterable[int] = (), *, upto: int | None = None) -> int:
        """Forget delivered trajectories (the trainer has them durably): ``seqs``, and
        every one up to ``upto`` inclusive (a trainer restarting from its stored cursor
        releases what it had processed but not acknowledged before it died). Returns how
        many were still held; acknowledging one twice is not an error."""
        seqs = list(seqs)
        with self._tx() as db:
            n = 0
            for s in seqs:
                n += db.execute("DELETE FROM trajectories WHERE seq = ?", (s,)).rowcount
            if upto is not None:
                n += db.execute("DELETE FROM trajectories WHERE seq <= ?", (upto,)).rowcount
        return n

    def counts(self) -> QueueCounts:
        with self._lock:
            by = dict(self._db.execute(
                "SELECT state, COUNT(*) FROM tasks GROUP BY state").fetchall())
            unacked = self._db.execute("SELECT COUNT(*) FROM trajectories").fetchone()[0]
        return QueueCounts(int(by.get("queued", 0)), int(by.get("running", 0)),
                           int(by.get("done", 0)), int(unacked))

    # -- worker side -------------------------------------------------------------------
    def claim(self, n: int) -> list[TaskRow]:
        """Up to ``n`` queued tasks, oldest first, now ``running`` (durably: a worker
        killed after this finds them at :meth:`recover`)."""
        out: list[TaskRow] = []
        with self._tx() as db:
            rows = db.execute("SELECT task_id, body, attempt FROM tasks WHERE state = "
                              "'queued' ORDER BY seq LIMIT ?", (n,)).fetchall()
            for task_id, body, attempt in rows:
                nxt = _next(task_id, "queued", "claim")
                db.execute("UPDATE tasks SET state = ?, attempt = attempt + 1 "
                           "WHERE task_id = ?", (nxt, task_id))
                out.append(TaskRow(str(task_id), bytes(body), int(attempt) + 1))
        return out

    def finish(self, task_id: str, attempt: int, body: bytes) -> int:
        """Commit an episode's trajectory and its task's ``done`` together; returns the
        trajectory's sequence number. A stale attempt (the task was requeued meanwhile)
        raises :class:`InvalidTransition` and records nothing."""
        with self._tx() as db:
            row = db.execute("SELECT state, attempt FROM tasks WHERE task_id = ?",
                             (task_id,)).fetchone()
            if row is None:
                raise InvalidArgument(f"no task {task_id!r}")
            state, current = row
            nxt = _next(task_id, state, "finish")
            if int(current) != attempt:
                raise InvalidTransition(
                    f"task {task_id!r} attempt {attempt} finished, but attempt {current} "
                    "owns it now", task_id=task_id)
            db.execute("UPDATE tasks SET state = ? WHERE task_id = ?", (nxt, task_id))
            cur = db.execute("INSERT INTO trajectories (task_id, attempt, body) "
                             "VALUES (?, ?, ?)", (task_id, attempt, body))
            return int(cur.lastrowid or 0)

    def requeue(self, task_id: str) -> None:
        with self._tx() as db:
            (state,) = db.execute("SELECT state FROM tasks WHERE task_id = ?",
                                  (task_id,)).fetchone()
            db.execute("UPDATE tasks SET state = ? WHERE task_id = ?",
                       (_next(task_id, state, "requeue"), task_id))

    def recover(self) -> list[TaskRow]:
        """At start: every task a previous process left ``running`` goes back to
        ``queued`` (its attempt number stays; the next claim raises it). Returns them."""
        with self._tx() as db:
            rows = db.execute("SELECT task_id, body, attempt FROM tasks "
                              "WHERE state = 'running'").fetchall()
            for task_id, _, _ in rows:
                db.execute("UPDATE tasks SET state = ? WHERE task_id = ?",
                           (_next(task_id, "running", "requeue"), task_id))
        return [TaskRow(str(t), bytes(b), int(a)) for t, b, a in rows]


class _Tx:
    """``with queue._tx() as db``: one ``BEGIN IMMEDIATE`` transaction under the lock;
    committed (fsynced) on success, rolled back on any exception."""

    def __init__(self, q: RolloutQueue) -> None:
        self.q = q

    def __enter__(self) -> sqlite3.Connection:
        self.q._lock.acquire()
        try:
            self.q._db.execute("BEGIN IMMEDIATE")
        except BaseException:
            self.q._lock.release()
            raise
        return self.q._db

    def __exit__(self, exc_type: object, *_: object) -> None:
        try:
            self.q._db.execute("ROLLBACK" if exc_type is not None else "COMMIT")
        finally:
            self.q._lock.release()
