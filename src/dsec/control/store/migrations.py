"""Sandboxes being moved off a drained node (``dsec node drain ID --migrate``, issue 16).

One row per sandbox on the move, written before each step is acted on, so a migration
interrupted by an apiserver's kill -9 is carried on by the next run (any replica) from
where it stopped, never twice: the snapshot it took is reused, and the new sandbox is
created under an Idempotency-Key derived from the old id (one new sandbox whatever
retries). Portable SQL, mixed into :class:`~dsec.control.store.sql.SqlStore`.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["MIGRATION_SCHEMA", "MigrationRow", "MigrationTables"]


class MigrationRow(msgspec.Struct, frozen=True, kw_only=True):
    """``state``: ``snapshotted`` (``snapshot_id`` taken), ``created`` (``new_id`` runs
    from it), ``done`` (the original destroyed, its event naming ``new_id``)."""

    sandbox_id: str
    node: str
    state: str
    snapshot_id: str | None = None
    new_id: str | None = None
    updated_at: float = 0.0


MIGRATION_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS migrations (
        sandbox_id TEXT PRIMARY KEY, node TEXT NOT NULL, state TEXT NOT NULL,
        snapshot_id TEXT, new_id TEXT, updated_at DOUBLE PRECISION NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS migrations_node ON migrations (node)",
]

_COLS = "sandbox_id, node, state, snapshot_id, new_id, updated_at"


class MigrationTables:
    """The migration methods of :class:`~dsec.control.store.sql.SqlStore`."""

    _tx: Any
    _s: Any
    _d: Any

    def _all(self, text: str, args: Any = ()) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def _exec(self, text: str, args: Any = ()) -> int:
        raise NotImplementedError

    def _create_migration_tables(self) -> None:
        with self._tx() as cur:
            for stmt in getattr(self._d, "schema_lock", ()):
                cur.execute(stmt)
            for stmt in MIGRATION_SCHEMA:
                cur.execute(stmt)

    def put_migration(self, row: MigrationRow) -> None:
        self._exec(f"INSERT INTO migrations ({_COLS}) VALUES (?, ?, ?, ?, ?, ?) "
                   "ON CONFLICT (sandbox_id) DO UPDATE SET state = excluded.state, "
                   "snapshot_id = excluded.snapshot_id, new_id = excluded.new_id, "
                   "updated_at = excluded.updated_at",
                   (row.sandbox_id, row.node, row.state, row.snapshot_id, row.new_id,
                    row.updated_at))

    def get_migration(self, sandbox_id: str) -> MigrationRow | None:
        rows = self._all(f"SELECT {_COLS} FROM migrations WHERE sandbox_id = ?", (sandbox_id,))
        return _row(rows[0]) if rows else None

    def list_migrations(self, node: str) -> list[MigrationRow]:
        return [_row(r) for r in self._all(
            f"SELECT {_COLS} FROM migrations WHERE node = ? ORDER BY sandbox_id", (node,))]


def _row(r: tuple[Any, ...]) -> MigrationRow:
    return MigrationRow(sandbox_id=r[0], node=r[1], state=r[2], snapshot_id=r[3],
                        new_id=r[4], updated_at=float(r[5]))
