"""Portable SQL behind :class:`~dsec.control.store.StateStore`.

:class:`SqlStore` speaks plain DB-API 2.0 with SQL that SQLite (>= 3.24) and PostgreSQL
both accept: ``INSERT ... ON CONFLICT (...) DO UPDATE``, ``BIGINT``, ``TEXT``. The bits
that differ live in :class:`Dialect` (placeholder style, the binary column type,
connection set-up), so a PostgreSQL store is a new ``Dialect`` plus a connection factory,
with no change to callers or to the statements here.

JSON payloads are stored as text encoded by msgspec, which both databases can index
later if needed (``json_extract`` / ``jsonb``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgspec

from dsec.control.store import (
    ApiKeyRow,
    EventRow,
    IdempotencyRow,
    ImagePinRow,
    LostSandboxRow,
    NodeDrainRow,
    PrincipalRow,
    QuotaRow,
    RoleBindingRow,
    SandboxRow,
    SessionRow,
    SnapshotChargeRow,
)
from dsec.control.store.membership import MembershipTables  # [join] nodes, join_tokens
from dsec.control.store.migrations import MigrationTables  # drain --migrate
from dsec.control.store.tags import ImageTagTables  # image tags shared by replicas

__all__ = ["Dialect", "SqlStore"]

log = logging.getLogger("dsec.store")

_json_enc = msgspec.json.Encoder()
_json_dec = msgspec.json.Decoder(dict[str, Any])


@dataclass(frozen=True, slots=True, kw_only=True)
class Dialect:
    """What differs between SQL databases. ``param`` is the DB-API placeholder."""

    name: str
    param: str = "?"            # sqlite3 uses qmark, psycopg uses "%s"
    blob: str = "BLOB"          # PostgreSQL: BYTEA
    # Statements that take the write lock before event versions are allocated in
    # commit_events(assign_versions=True), so registries of several apiserver replicas
    # over one database never hand out the same version. SQLite: "BEGIN IMMEDIATE" (the
    # MAX(version) read then happens under the one writer lock); PostgreSQL:
    # ("LOCK TABLE events IN SHARE ROW EXCLUSIVE MODE",) inside the implicit transaction.
    write_lock: tuple[str, ...] = ()
    # Statements that serialise snapshot charges between replicas (the subtree sums and
    # the insert in one transaction). SQLite: "BEGIN IMMEDIATE"; PostgreSQL:
    # ("LOCK TABLE snapshot_charges IN SHARE ROW EXCLUSIVE MODE",).
    charge_lock: tuple[str, ...] = ()
    # Statements run first in the schema transaction, so replicas opening one new
    # database at once do not race CREATE TABLE IF NOT EXISTS (PostgreSQL: an advisory
    # lock; SQLite's writer lock already serialises it).
    schema_lock: tuple[str, ...] = ()

    def sql(self, text: str) -> str:
        """Rewrite the ``?`` placeholders of the portable statements for this driver."""
        return text if self.param == "?" else text.replace("?", self.param)


_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS principals (
        id TEXT PRIMARY KEY, name TEXT NOT NULL, superuser INTEGER NOT NULL,
        created_at DOUBLE PRECISION NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS api_keys (
        key_id TEXT PRIMARY KEY, principal_id TEXT NOT NULL, secret_hash {blob} NOT NULL,
        created_at DOUBLE PRECISION NOT NULL, revoked INTEGER NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS api_keys_principal ON api_keys (principal_id)",
    """CREATE TABLE IF NOT EXISTS role_bindings (
        principal_id TEXT NOT NULL, project TEXT NOT NULL, role TEXT NOT NULL,
        PRIMARY KEY (principal_id, project))""",
    "CREATE TABLE IF NOT EXISTS quotas (project TEXT PRIMARY KEY, quota TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS events (
        version BIGINT PRIMARY KEY, time DOUBLE PRECISION NOT NULL, kind TEXT NOT NULL,
        sandbox_id TEXT, node_id TEXT, payload TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS sandboxes (
        id TEXT PRIMARY KEY, node TEXT NOT NULL, project TEXT NOT NULL, record TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS sandboxes_node ON sandboxes (node)",
    # Idempotency-Key claims, shared by every apiserver replica over this store.
    """CREATE TABLE IF NOT EXISTS idempotency (
        key TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, owner TEXT NOT NULL,
        response {blob}, expires_at DOUBLE PRECISION NOT NULL,
        holder TEXT NOT NULL DEFAULT '', intent TEXT)""",
    "CREATE INDEX IF NOT EXISTS idempotency_expiry ON idempotency (expires_at)",
    # One row per live apiserver process, renewed every second: an in-flight
    # idempotency claim is alive while its holder's lease is.
    """CREATE TABLE IF NOT EXISTS process_leases (
        holder TEXT PRIMARY KEY, expires_at DOUBLE PRECISION NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS sessions (
        id TEXT PRIMARY KEY, principal_id TEXT NOT NULL, lease_s DOUBLE PRECISION NOT NULL,
        expires_at DOUBLE PRECISION NOT NULL, closed INTEGER NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS sessions_principal ON sessions (principal_id)",
    # Sandboxes evicted with a lost node: a returning node is told to destroy them even
    # after an apiserver restart.
    """CREATE TABLE IF NOT EXISTS lost_sandboxes (
        id TEXT PRIMARY KEY, node TEXT NOT NULL, lost_at DOUBLE PRECISION NOT NULL,
        record TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS lost_sandboxes_age ON lost_sandboxes (lost_at)",
    "CREATE INDEX IF NOT EXISTS events_time ON events (time)",
    # Stored bytes of each snapshot, charged to its project's snapshot_bytes quota.
    """CREATE TABLE IF NOT EXISTS snapshot_charges (
        id TEXT PRIMARY KEY, project TEXT NOT NULL, node TEXT NOT NULL,
        size_bytes BIGINT NOT NULL, chain TEXT)""",
    # Edge nodes drained by an administrator (issue 16): no new placements there.
    """CREATE TABLE IF NOT EXISTS node_drains (
        node TEXT PRIMARY KEY, drained_at DOUBLE PRECISION NOT NULL, by_principal TEXT NOT NULL)""",
    # Images pinned fully cached on a node by an operator (issue 17).
    """CREATE TABLE IF NOT EXISTS image_pins (
        node TEXT NOT NULL, image TEXT NOT NULL, ref TEXT NOT NULL, layers TEXT NOT NULL,
        pinned_at DOUBLE PRECISION NOT NULL, by_principal TEXT NOT NULL,
        PRIMARY KEY (node, image))""",
]

# Columns added after a table first shipped: (table, column, definition). A store made by
# an older dsec gets them on open (CREATE TABLE IF NOT EXISTS leaves old tables as they are).
_ADDED_COLUMNS = [
    ("idempotency", "holder", "TEXT NOT NULL DEFAULT ''"),
    ("idempotency", "intent", "TEXT"),
    ("snapshot_charges", "chain", "TEXT"),
]

# Every table the store keeps (for table_rows).
_TABLES = ("principals", "api_keys", "role_bindings", "quotas", "events", "sandboxes",
           "idempotency", "process_leases", "sessions", "lost_sandboxes", "snapshot_charges",
           "node_drains", "image_pins", "image_tags")


class SqlStore(MembershipTables, ImageTagTables, MigrationTables):
    """A :class:`StateStore` over one DB-API connection, serialised by a lock.

    One connection with a lock is enough for the management plane: statements take
    microseconds and event writes are batched (see :meth:`commit_events`).
    """

    def __init__(self, conn: Any, dialect: Dialect) -> None:
        self._conn = conn
        self._d = dialect
        self._lock = threading.Lock()
        self._q: dict[str, str] = {}
        for table, column, definition in _ADDED_COLUMNS:
            self._add_column(table, column, definition)
        with self._tx() as cur:
            for stmt in dialect.schema_lock:
                cur.execute(stmt)
            for stmt in _SCHEMA:
                cur.execute(stmt.format(blob=dialect.blob))
        self._create_membership_tables()  # [join] control/store/membership.py
        self._create_tag_tables()         # control/store/tags.py
        self._create_migration_tables()   # control/store/migrations.py

    def _add_column(self, table: str, column: str, definition: str) -> None:
        """Add ``column`` to an existing ``table`` that lacks it (a store written by an
        older dsec). Probing with a SELECT is portable: SQLite and PostgreSQL both fail it
        on a missing column, and a failed statement is rolled back before the ALTER."""
        try:
            with self._tx() as cur:
                cur.execute(f"SELECT {column} FROM {table} WHERE 1 = 0")
            return
        except Exception:  # noqa: BLE001 - the table or the column is missing
            log.debug("store: %s.%s is missing", table, column)
        try:
            with self._tx() as cur:
                cur.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
            log.info("store: added column %s.%s (a store written by an older dsec)", table,
                     column)
        except Exception:  # noqa: BLE001 - no such table yet: the schema creates it whole
            log.debug("store: no table %s yet", table)

    # --- plumbing -------------------------------------------------------------------
    def _s(self, text: str) -> str:
        q = self._q.get(text)
        if q is None:
            q = self._q[text] = self._d.sql(text)
        return q

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        with self._lock:
            cur = self._conn.cursor()
            try:
                yield cur
                self._conn.commit()
            except BaseException:
                self._conn.rollback()
                raise
            finally:
                cur.close()

    def _all(self, text: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._tx() as cur:
            cur.execute(self._s(text), tuple(args))
            return list(cur.fetchall())

    def _exec(self, text: str, args: Sequence[Any] = ()) -> int:
        with self._tx() as cur:
            cur.execute(self._s(text), tuple(args))
            return int(cur.rowcount)

    # --- principals and keys ------------------------------------------------------------
    def put_principal(self, row: PrincipalRow) -> None:
        self._exec(
            "INSERT INTO principals (id, name, superuser, created_at) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (id) DO UPDATE SET name = excluded.name, "
            "superuser = excluded.superuser",
            (row.id, row.name, int(row.superuser), row.created_at),
        )

    def add_principal(self, row: PrincipalRow) -> bool:
        return self._exec(
            "INSERT INTO principals (id, name, superuser, created_at) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (id) DO NOTHING",
            (row.id, row.name, int(row.superuser), row.created_at),
        ) > 0

    def get_principal(self, principal_id: str) -> PrincipalRow | None:
        rows = self._all(
            "SELECT id, name, superuser, created_at FROM principals WHERE id = ?",
            (principal_id,),
        )
        return _principal(rows[0]) if rows else None

    def list_principals(self) -> list[PrincipalRow]:
        rows = self._all("SELECT id, name, superuser, created_at FROM principals ORDER BY id")
        return [_principal(r) for r in rows]

    def put_api_key(self, row: ApiKeyRow) -> None:
        self._exec(
            "INSERT INTO api_keys (key_id, principal_id, secret_hash, created_at, revoked) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT (key_id) DO UPDATE SET "
            "revoked = excluded.revoked",
            (row.key_id, row.principal_id, row.secret_hash, row.created_at, int(row.revoked)),
        )

    def get_api_key(self, key_id: str) -> ApiKeyRow | None:
        rows = self._all(
            "SELECT key_id, principal_id, secret_hash, created_at, revoked FROM api_keys "
            "WHERE key_id = ?",
            (key_id,),
        )
        return _api_key(rows[0]) if rows else None

    def list_api_keys(self, principal_id: str) -> list[ApiKeyRow]:
        rows = self._all(
            "SELECT key_id, principal_id, secret_hash, created_at, revoked FROM api_keys "
            "WHERE principal_id = ? ORDER BY created_at, key_id",
            (principal_id,),
        )
        return [_api_key(r) for r in rows]

    # --- roles ----------------------------------------------------------------------------
    def put_role_binding(self, row: RoleBindingRow) -> None:
        self._exec(
            "INSERT INTO role_bindings (principal_id, project, role) VALUES (?, ?, ?) "
            "ON CONFLICT (principal_id, project) DO UPDATE SET role = excluded.role",
            (row.principal_id, row.project, row.role),
        )

    def delete_role_binding(self, principal_id: str, project: str) -> bool:
        return self._exec(
            "DELETE FROM role_bindings WHERE principal_id = ? AND project = ?",
            (principal_id, project),
        ) > 0

    def list_role_bindings(self, principal_id: str) -> list[RoleBindingRow]:
        rows = self._all(
            "SELECT principal_id, project, role FROM role_bindings WHERE principal_id = ? "
            "ORDER BY project",
            (principal_id,),
        )
        return [RoleBindingRow(principal_id=r[0], project=r[1], role=r[2]) for r in rows]

    # --- quotas ---------------------------------------------------------------------------
    def put_quota(self, row: QuotaRow) -> None:
        self._exec(
            "INSERT INTO quotas (project, quota) VALUES (?, ?) "
            "ON CONFLICT (project) DO UPDATE SET quota = excluded.quota",
            (row.project, _json_enc.encode(row.quota).decode()),
        )

    def delete_quota(self, project: str) -> bool:
        return self._exec("DELETE FROM quotas WHERE project = ?", (project,)) > 0

    def list_quotas(self) -> list[QuotaRow]:
        rows = self._all("SELECT project, quota FROM quotas ORDER BY project")
        return [QuotaRow(project=r[0], quota=_json_dec.decode(r[1])) for r in rows]

    # --- snapshot storage charges ---------------------------------------------------------
    def put_snapshot_charge(self, row: SnapshotChargeRow) -> None:
        self._exec(
            "INSERT INTO snapshot_charges (id, project, node, size_bytes, chain) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
            (row.id, row.project, row.node, row.size_bytes, _chain_json(row)))

    def charge_snapshot(self, row: SnapshotChargeRow,
                        limits: Sequence[tuple[str, int]]) -> tuple[str, int] | None:
        like = self._s("SELECT COALESCE(SUM(size_bytes), 0) FROM snapshot_charges "
                       "WHERE project = ? OR substr(project, 1, ?) = ?")
        with self._tx() as cur:
            for stmt in self._d.charge_lock:
                cur.execute(stmt)
            cur.execute(self._s("SELECT 1 FROM snapshot_charges WHERE id = ?"), (row.id,))
            if cur.fetchone() is not None:
                return None
            for project, limit in limits:
                cur.execute(like, (project, len(project) + 1, project + "/"))
                used = int(cur.fetchone()[0])
                if used + row.size_bytes > limit:
                    return project, used
            cur.execute(self._s("INSERT INTO snapshot_charges (id, project, node, size_bytes, "
                                "chain) VALUES (?, ?, ?, ?, ?)"),
                        (row.id, row.project, row.node, row.size_bytes, _chain_json(row)))
        return None

    def delete_snapshot_charge(self, snapshot_id: str) -> bool:
        return self._exec("DELETE FROM snapshot_charges WHERE id = ?", (snapshot_id,)) > 0

    def list_snapshot_charges(self) -> list[SnapshotChargeRow]:
        rows = self._all("SELECT id, project, node, size_bytes, chain FROM snapshot_charges")
        return [_charge_row(r) for r in rows]

    # --- registry -------------------------------------------------------------------------
    def commit_events(
        self,
        events: Sequence[EventRow],
        upserts: Sequence[SandboxRow] = (),
        deletes: Sequence[str] = (),
        *,
        assign_versions: bool = False,
    ) -> int:
        """Append ``events`` and apply the sandbox row changes in one transaction.

        With ``assign_versions`` the events get the next dense versions after the newest
        stored one, allocated under the write lock (their own ``version`` is ignored);
        otherwise their versions are used as given. Returns the first event's version
        (0 when there are no events)."""
        enc = _json_enc.encode
        first = events[0].version if events else 0
        with self._tx() as cur:
            if events and assign_versions:
                for stmt in self._d.write_lock:
                    cur.execute(stmt)
                cur.execute("SELECT COALESCE(MAX(version), 0) FROM events")
                first = int(cur.fetchone()[0]) + 1
            if events:
                cur.executemany(
                    self._s("INSERT INTO events (version, time, kind, sandbox_id, node_id, "
                            "payload) VALUES (?, ?, ?, ?, ?, ?)"),
                    [(first + i if assign_versions else e.version, e.time, e.kind,
                      e.sandbox_id, e.node_id, enc(e.payload).decode())
                     for i, e in enumerate(events)],
                )
            if upserts:
                cur.executemany(
                    self._s("INSERT INTO sandboxes (id, node, project, record) "
                            "VALUES (?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
                            "node = excluded.node, project = excluded.project, "
                            "record = excluded.record"),
                    [(s.id, s.node, s.project, enc(s.record).decode()) for s in upserts],
                )
            if deletes:
                cur.executemany(self._s("DELETE FROM sandboxes WHERE id = ?"),
                                [(d,) for d in deletes])
            if events:
                self._committing(cur, first + len(events) - 1 if assign_versions
                                 else events[-1].version)
        return first

    def _committing(self, cur: Any, newest: int) -> None:
        """Called inside :meth:`commit_events`'s transaction with the newest version it
        writes: PostgreSQL sends its NOTIFY here, so watchers hear of the commit exactly
        when it becomes visible. Nothing by default (SQLite replicas poll)."""

    def listen_versions(self, callback: Callable[[int], None]) -> bool:
        """No push by default: the caller polls :meth:`event_bounds`."""
        return False

    def read_sandboxes(self, ids: Sequence[str]) -> list[SandboxRow]:
        """The stored rows of ``ids`` that exist (another replica's records, read when
        its events are applied by :meth:`dsec.control.registry.Registry.catch_up`)."""
        if not ids:
            return []
        out: list[SandboxRow] = []
        with self._tx() as cur:
            for i in range(0, len(ids), 500):
                chunk = list(ids[i : i + 500])
                marks = ", ".join("?" * len(chunk))
                cur.execute(self._d.sql(f"SELECT id, node, project, record FROM sandboxes "
                                        f"WHERE id IN ({marks})"), tuple(chunk))
                out.extend(SandboxRow(id=r[0], node=r[1], project=r[2],
                                      record=_json_dec.decode(r[3]))
                           for r in cur.fetchall())
        return out

    def read_events(self, after_version: int, limit: int) -> list[EventRow]:
        rows = self._all(
            "SELECT version, time, kind, sandbox_id, node_id, payload FROM events "
            "WHERE version > ? ORDER BY version LIMIT ?",
            (after_version, limit),
        )
        dec = _json_dec.decode
        return [EventRow(version=r[0], time=r[1], kind=r[2], sandbox_id=r[3], node_id=r[4],
                         payload=dec(r[5])) for r in rows]

    def event_bounds(self) -> tuple[int, int]:
        rows = self._all("SELECT MIN(version), MAX(version) FROM events")
        lo, hi = rows[0]
        return (0, 0) if hi is None else (int(lo), int(hi))

    def compact_events(self, below_version: int) -> int:
        """Delete events older than ``below_version``; the newest event is always kept
        so the global version survives a restart."""
        return self._exec(
            "DELETE FROM events WHERE version < ? AND version < (SELECT MAX(version) "
            "FROM events)",
            (below_version,),
        )

    def prune_events(self, *, keep_last: int | None, older_than: float | None) -> int:
        n = 0
        with self._tx() as cur:
            if keep_last is not None:
                cur.execute(self._s("DELETE FROM events WHERE version <= (SELECT MAX(version) "
                                    "FROM events) - ?"), (max(1, keep_last),))
                n += max(0, int(cur.rowcount))
            if older_than is not None:
                cur.execute(self._s("DELETE FROM events WHERE time < ? AND version < "
                                    "(SELECT MAX(version) FROM events)"), (older_than,))
                n += max(0, int(cur.rowcount))
        return n

    def list_sandboxes(self) -> list[SandboxRow]:
        rows = self._all("SELECT id, node, project, record FROM sandboxes ORDER BY id")
        return [SandboxRow(id=r[0], node=r[1], project=r[2], record=_json_dec.decode(r[3]))
                for r in rows]

    # --- idempotency keys -----------------------------------------------------------------
    _IDEM_COLS = "key, fingerprint, owner, holder, response, expires_at, intent"
    # A row is stale when it is in flight and its holder is gone (no live process lease)
    # or its backstop passed. Computed in SQL so one statement answers it.
    _IDEM_STALE = ("(response IS NULL AND (expires_at <= ? OR NOT EXISTS (SELECT 1 FROM "
                   "process_leases l WHERE l.holder = idempotency.holder AND "
                   "l.expires_at > ?)))")

    def idem_claim(self, row: IdempotencyRow, now: float) -> IdempotencyRow:
        """Drop a finished row past its window, take over a stale in-flight row with the
        same fingerprint (keeping its intent), insert ours unless a live one exists, and
        read back what is stored: one transaction, so of two replicas claiming at once
        exactly one wins (SQLite serialises writers; on PostgreSQL the UPDATE locks the
        row and ``ON CONFLICT DO NOTHING`` lets one insert win)."""
        with self._tx() as cur:
            cur.execute(self._s("DELETE FROM idempotency WHERE key = ? AND expires_at <= ? "
                                "AND response IS NOT NULL"), (row.key, now))
            cur.execute(self._s("UPDATE idempotency SET owner = ?, holder = ?, expires_at = ? "
                                f"WHERE key = ? AND fingerprint = ? AND {self._IDEM_STALE}"),
                        (row.owner, row.holder, row.expires_at, row.key, row.fingerprint,
                         now, now))
            cur.execute(self._s(f"INSERT INTO idempotency ({self._IDEM_COLS}) VALUES "
                                "(?, ?, ?, ?, NULL, ?, NULL) ON CONFLICT (key) DO NOTHING"),
                        (row.key, row.fingerprint, row.owner, row.holder, row.expires_at))
            cur.execute(self._s(f"SELECT {self._IDEM_COLS}, {self._IDEM_STALE} FROM "
                                "idempotency WHERE key = ?"), (now, now, row.key))
            return _idem(cur.fetchone())

    def idem_get(self, key: str, now: float) -> IdempotencyRow | None:
        rows = self._all(f"SELECT {self._IDEM_COLS}, {self._IDEM_STALE} FROM idempotency "
                         "WHERE key = ? AND (response IS NULL OR expires_at > ?)",
                         (now, now, key, now))
        return _idem(rows[0]) if rows else None

    def idem_note(self, key: str, owner: str, intent: str) -> bool:
        return self._exec("UPDATE idempotency SET intent = ? WHERE key = ? AND owner = ? "
                          "AND response IS NULL", (intent, key, owner)) > 0

    def idem_finish(self, key: str, owner: str, response: bytes, expires_at: float) -> bool:
        return self._exec("UPDATE idempotency SET response = ?, expires_at = ? "
                          "WHERE key = ? AND owner = ? AND response IS NULL",
                          (response, expires_at, key, owner)) > 0

    def idem_release(self, key: str, owner: str) -> bool:
        with self._tx() as cur:
            cur.execute(self._s("DELETE FROM idempotency WHERE key = ? AND owner = ? "
                                "AND response IS NULL AND intent IS NULL"), (key, owner))
            n = int(cur.rowcount)
            cur.execute(self._s("UPDATE idempotency SET holder = '' WHERE key = ? AND "
                                "owner = ? AND response IS NULL"), (key, owner))
            return n + int(cur.rowcount) > 0

    def idem_purge(self, now: float, keep: int) -> int:
        with self._tx() as cur:
            cur.execute(self._s("DELETE FROM idempotency WHERE response IS NOT NULL AND "
                                "expires_at <= ?"), (now,))
            n = max(0, int(cur.rowcount))
            # A stale claim that never named a sandbox has nothing to find: drop it.
            cur.execute(self._s(f"DELETE FROM idempotency WHERE intent IS NULL AND "
                                f"{self._IDEM_STALE}"), (now, now))
            n += max(0, int(cur.rowcount))
            # One that did, past its window, with no live holder: a create that failed
            # after naming its sandbox (the edge refused it) or whose apiserver died.
            # Kept until then for a retry to look for that sandbox; without this rule
            # every refused keyed create left a row forever.
            cur.execute(self._s("DELETE FROM idempotency WHERE response IS NULL AND "
                                "expires_at <= ? AND NOT EXISTS (SELECT 1 FROM "
                                "process_leases l WHERE l.holder = idempotency.holder AND "
                                "l.expires_at > ?)"), (now, now))
            n += max(0, int(cur.rowcount))
            cur.execute(self._s("SELECT COUNT(*) FROM idempotency WHERE response IS NOT NULL"))
            over = int(cur.fetchone()[0]) - keep
            if over > 0:
                # Over the count bound, the oldest finished keys give up their stored
                # answer but keep the sandbox id until their window ends (a holderless
                # claim naming it): a retry then finds that sandbox on its edge instead
                # of making a second one. At 1,000 creates/s, 50,000 answers last under a
                # minute; the SDK retries a create for two. Only rows without a sandbox
                # id are deleted outright (nothing to find).
                oldest = ("SELECT key FROM idempotency WHERE response IS NOT NULL ORDER BY "
                          "expires_at LIMIT ?")
                cur.execute(self._s(f"DELETE FROM idempotency WHERE intent IS NULL AND key "
                                    f"IN ({oldest})"), (over,))
                gone = max(0, int(cur.rowcount))
                cur.execute(self._s(f"UPDATE idempotency SET response = NULL, holder = '' "
                                    f"WHERE key IN ({oldest})"), (over - gone,))
                n += gone + max(0, int(cur.rowcount))
            return n

    # --- process leases -----------------------------------------------------------------
    def lease_renew(self, holder: str, expires_at: float) -> None:
        self._exec("INSERT INTO process_leases (holder, expires_at) VALUES (?, ?) "
                   "ON CONFLICT (holder) DO UPDATE SET expires_at = excluded.expires_at",
                   (holder, expires_at))

    def lease_drop(self, holder: str) -> None:
        self._exec("DELETE FROM process_leases WHERE holder = ?", (holder,))

    def lease_purge(self, now: float) -> int:
        return max(0, self._exec("DELETE FROM process_leases WHERE expires_at <= ?", (now,)))

    # --- sessions ---------------------------------------------------------------------------
    _SES_COLS = "id, principal_id, lease_s, expires_at, closed"

    def put_session(self, row: SessionRow) -> None:
        self._exec(
            f"INSERT INTO sessions ({self._SES_COLS}) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT (id) DO UPDATE SET principal_id = excluded.principal_id, "
            "lease_s = excluded.lease_s, expires_at = excluded.expires_at, "
            "closed = excluded.closed",
            (row.id, row.principal_id, row.lease_s, row.expires_at, int(row.closed)))

    def get_session(self, session_id: str) -> SessionRow | None:
        rows = self._all(f"SELECT {self._SES_COLS} FROM sessions WHERE id = ?", (session_id,))
        return _session(rows[0]) if rows else None

    def renew_session(self, session_id: str, principal_id: str, now: float) -> SessionRow | None:
        with self._tx() as cur:
            cur.execute(self._s("UPDATE sessions SET expires_at = ? + lease_s WHERE id = ? "
                                "AND principal_id = ? AND closed = 0"),
                        (now, session_id, principal_id))
            if cur.rowcount < 1:
                return None
            cur.execute(self._s(f"SELECT {self._SES_COLS} FROM sessions WHERE id = ?"),
                        (session_id,))
            return _session(cur.fetchone())

    def list_sessions(self) -> list[SessionRow]:
        return [_session(r) for r in self._all(f"SELECT {self._SES_COLS} FROM sessions "
                                                "ORDER BY id")]

    def count_sessions(self, principal_id: str) -> int:
        rows = self._all("SELECT COUNT(*) FROM sessions WHERE principal_id = ?",
                         (principal_id,))
        return int(rows[0][0])

    def delete_sessions(self, session_ids: Sequence[str]) -> int:
        if not session_ids:
            return 0
        with self._tx() as cur:
            cur.executemany(self._s("DELETE FROM sessions WHERE id = ?"),
                            [(i,) for i in session_ids])
            return len(session_ids)

    # --- lost-node tombstones ---------------------------------------------------------------
    def put_lost(self, rows: Sequence[LostSandboxRow], keep: int) -> None:
        enc = _json_enc.encode
        with self._tx() as cur:
            if rows:
                cur.executemany(
                    self._s("INSERT INTO lost_sandboxes (id, node, lost_at, record) "
                            "VALUES (?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
                            "node = excluded.node, lost_at = excluded.lost_at, "
                            "record = excluded.record"),
                    [(r.id, r.node, r.lost_at, enc(r.record).decode()) for r in rows])
            cur.execute(self._s("SELECT COUNT(*) FROM lost_sandboxes"))
            over = int(cur.fetchone()[0]) - keep
            if over > 0:
                cur.execute(self._s("DELETE FROM lost_sandboxes WHERE id IN (SELECT id FROM "
                                    "lost_sandboxes ORDER BY lost_at, id LIMIT ?)"), (over,))

    def list_lost(self, limit: int) -> list[LostSandboxRow]:
        rows = self._all("SELECT id, node, lost_at, record FROM lost_sandboxes "
                         "ORDER BY lost_at DESC, id DESC LIMIT ?", (limit,))
        dec = _json_dec.decode
        return [LostSandboxRow(id=r[0], node=r[1], lost_at=float(r[2]), record=dec(r[3]))
                for r in reversed(rows)]

    def prune_lost(self, older_than: float) -> int:
        return max(0, self._exec("DELETE FROM lost_sandboxes WHERE lost_at < ?",
                                 (older_than,)))

    # --- drained edge nodes (issue 16) ---------------------------------------------------
    def put_drain(self, row: NodeDrainRow) -> None:
        self._exec("INSERT INTO node_drains (node, drained_at, by_principal) VALUES (?, ?, ?) "
                   "ON CONFLICT (node) DO NOTHING", (row.node, row.drained_at, row.by))

    def delete_drain(self, node: str) -> bool:
        return self._exec("DELETE FROM node_drains WHERE node = ?", (node,)) > 0

    def list_drains(self) -> list[NodeDrainRow]:
        rows = self._all("SELECT node, drained_at, by_principal FROM node_drains ORDER BY node")
        return [NodeDrainRow(node=r[0], drained_at=float(r[1]), by=r[2]) for r in rows]

    # --- images pinned on nodes (issue 17) -------------------------------------------------
    def put_pin(self, row: ImagePinRow) -> None:
        self._exec("INSERT INTO image_pins (node, image, ref, layers, pinned_at, by_principal) "
                   "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (node, image) DO NOTHING",
                   (row.node, row.image, row.ref, json.dumps(list(row.layers)),
                    row.pinned_at, row.by))

    def delete_pin(self, node: str, image: str) -> bool:
        return self._exec("DELETE FROM image_pins WHERE node = ? AND image = ?",
                          (node, image)) > 0

    def list_pins(self, node: str | None = None) -> list[ImagePinRow]:
        cols = "SELECT node, image, ref, layers, pinned_at, by_principal FROM image_pins"
        rows = (self._all(cols + " ORDER BY node, image") if node is None else
                self._all(cols + " WHERE node = ? ORDER BY image", (node,)))
        return [ImagePinRow(node=r[0], image=r[1], ref=r[2], layers=tuple(json.loads(r[3])),
                            pinned_at=float(r[4]), by=r[5]) for r in rows]

    def reclaim_space(self, pages: int) -> None:
        """Give up to ``pages`` pages freed by deletes back to the filesystem (after
        retention). Nothing to do by default: PostgreSQL's autovacuum does it."""

    def table_rows(self) -> dict[str, int]:
        out: dict[str, int] = {}
        with self._tx() as cur:
            for t in _TABLES:
                cur.execute(f"SELECT COUNT(*) FROM {t}")
                out[t] = int(cur.fetchone()[0])
        return out

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _principal(r: tuple[Any, ...]) -> PrincipalRow:
    return PrincipalRow(id=r[0], name=r[1], superuser=bool(r[2]), created_at=float(r[3]))


def _idem(r: tuple[Any, ...]) -> IdempotencyRow:
    return IdempotencyRow(key=r[0], fingerprint=r[1], owner=r[2], holder=r[3] or "",
                          response=None if r[4] is None else bytes(r[4]),
                          expires_at=float(r[5]), intent=r[6], stale=bool(r[7]))


def _session(r: tuple[Any, ...]) -> SessionRow:
    return SessionRow(id=r[0], principal_id=r[1], lease_s=float(r[2]),
                      expires_at=float(r[3]), closed=bool(r[4]))


def _api_key(r: tuple[Any, ...]) -> ApiKeyRow:
    return ApiKeyRow(key_id=r[0], principal_id=r[1], secret_hash=bytes(r[2]),
                     created_at=float(r[3]), revoked=bool(r[4]))


def _chain_json(row: SnapshotChargeRow) -> str | None:
    """The ``chain`` column: what the layer is and stands on (None: not recorded)."""
    if row.kind is None:
        return None
    return _json_enc.encode({"kind": row.kind, "parent": row.parent,
                             "stack": list(row.stack)}).decode()


def _charge_row(r: Sequence[Any]) -> SnapshotChargeRow:
    chain = _json_dec.decode(r[4]) if r[4] else {}
    return SnapshotChargeRow(id=r[0], project=r[1], node=r[2], size_bytes=int(r[3]),
                             kind=chain.get("kind"), parent=chain.get("parent"),
                             stack=tuple(chain.get("stack") or ()))
