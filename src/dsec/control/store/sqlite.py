"""The embedded default :class:`~dsec.control.store.StateStore`: SQLite in WAL mode.

WAL lets readers (watchers) proceed while the writer commits; ``synchronous=NORMAL``
keeps commits durable against process crashes (not power loss), which is the right
trade for state the management plane can rebuild from edge heartbeats anyway.
Measured on the CI machine (MACHINE-NOTES.md): ~33k single-row commits/s, ~170k rows/s
batched, which is why the registry batches its event writes.
"""

from __future__ import annotations

import os
import sqlite3

from dsec.control.store.sql import Dialect, SqlStore
from dsec.errors import InvalidArgument

__all__ = ["SQLITE", "SqliteStore"]

SQLITE = Dialect(name="sqlite", param="?", blob="BLOB", write_lock=("BEGIN IMMEDIATE",),
                 charge_lock=("BEGIN IMMEDIATE",))


class SqliteStore(SqlStore):
    """SQLite file (or ``":memory:"`` for tests) in WAL mode."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        if self.path != ":memory:":
            _private_files(self.path)
        try:
            # The stdlib's implicit transactions (BEGIN before the first write) plus the
            # commit in SqlStore._tx make every store method one transaction.
            conn = sqlite3.connect(self.path, check_same_thread=False, timeout=30.0)
        except sqlite3.Error as exc:
            raise InvalidArgument(
                f"cannot open the SQLite state store at {self.path!r}: {exc}; "
                "check the directory exists and is writable"
            ) from exc
        # Retention deletes rows; with incremental auto-vacuum the freed pages can be given
        # back to the filesystem (SqlStore.reclaim_space), so the file shrinks too. It can
        # only be switched on before the first table exists: new stores get it, an older
        # store keeps its size at its high-water mark (a one-off VACUUM converts it).
        if not conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0]:
            conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
        if self.path != ":memory:":
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                conn.close()
                raise InvalidArgument(
                    f"SQLite at {self.path!r} refused WAL mode (got {mode!r}); "
                    "put the state store on a local filesystem"
                )
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        super().__init__(conn, SQLITE)

    def reclaim_space(self, pages: int) -> None:
        """``PRAGMA incremental_vacuum`` of up to ``pages`` free pages. Run through
        ``executescript``: stepped through a cursor, the pragma stops after one page
        (measured: 1 of 942 free pages given back per call)."""
        if pages <= 0:
            return
        with self._lock:
            self._conn.executescript(f"PRAGMA incremental_vacuum({int(pages)});")


def _private_files(path: str) -> None:
    """Make the database file 0600 before SQLite opens it: it holds API key hashes and
    stored create requests (with their ``env``). SQLite creates ``-wal`` and ``-shm``
    with the main file's mode, and older ones are tightened here too."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return   # sqlite3.connect below reports it with the path and what to do
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    for extra in (path + "-wal", path + "-shm", path + "-journal"):
        try:
            os.chmod(extra, 0o600)
        except FileNotFoundError:
            pass
