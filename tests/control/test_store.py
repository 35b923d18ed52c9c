from __future__ import annotations

import sqlite3
from pathlib import Path

import psycopg
import pytest

from dsec.control.store import (
    ApiKeyRow,
    EventRow,
    LostSandboxRow,
    PrincipalRow,
    QuotaRow,
    RoleBindingRow,
    SandboxRow,
    StateStore,
    open_store,
)
from dsec.control.store.sqlite import SqliteStore
from dsec.errors import InvalidArgument


def test_sqlite_store_satisfies_the_interface_and_uses_wal(store_path: Path) -> None:
    store = SqliteStore(store_path)
    assert isinstance(store, StateStore)
    store.close()
    conn = sqlite3.connect(store_path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


def test_rows_round_trip_and_survive_reopen(store_url: str) -> None:
    s = open_store(store_url)
    try:
        s.put_principal(PrincipalRow(id="alice", name="Alice", superuser=False, created_at=1.0))
        s.put_api_key(ApiKeyRow(key_id="k1", principal_id="alice", secret_hash=b"\x01" * 32,
                                created_at=2.0))
        s.put_role_binding(RoleBindingRow(principal_id="alice", project="org", role="member"))
        s.put_role_binding(RoleBindingRow(principal_id="alice", project="org", role="admin"))
        s.put_quota(QuotaRow(project="org", quota={"cpu_milli": 4000}))
        s.commit_events(
            [EventRow(version=1, time=3.0, kind="sandbox_added", sandbox_id="sb-1",
                      node_id="n1", payload={"reason": "created"})],
            upserts=[SandboxRow(id="sb-1", node="n1", project="org", record={"id": "sb-1"})],
        )
    finally:
        s.close()
    s = open_store(store_url)
    try:
        assert s.get_principal("alice") == PrincipalRow(id="alice", name="Alice",
                                                        created_at=1.0)
        assert s.get_api_key("k1") == ApiKeyRow(key_id="k1", principal_id="alice",
                                                secret_hash=b"\x01" * 32, created_at=2.0)
        assert s.list_role_bindings("alice") == [
            RoleBindingRow(principal_id="alice", project="org", role="admin")]
        assert s.list_quotas() == [QuotaRow(project="org", quota={"cpu_milli": 4000})]
        assert s.read_events(0, 10) == [EventRow(version=1, time=3.0, kind="sandbox_added",
                                                 sandbox_id="sb-1", node_id="n1",
                                                 payload={"reason": "created"})]
        assert [r.id for r in s.list_sandboxes()] == ["sb-1"]
        assert s.event_bounds() == (1, 1)
        assert s.delete_role_binding("alice", "org") is True
        assert s.delete_role_binding("alice", "org") is False
        assert s.delete_quota("org") is True
    finally:
        s.close()


def test_commit_events_is_atomic(store: StateStore) -> None:
    store.commit_events([EventRow(version=1, time=0.0, kind="x")])
    # version 1 again violates the primary key: the sandbox upsert must roll back too.
    with pytest.raises((sqlite3.IntegrityError, psycopg.IntegrityError)):
        store.commit_events([EventRow(version=1, time=0.0, kind="y")],
                            upserts=[SandboxRow(id="sb", node="n", project="p", record={})])
    assert store.list_sandboxes() == []
    assert [e.kind for e in store.read_events(0, 10)] == ["x"]


def test_compaction_keeps_the_newest_event(store: StateStore) -> None:
    store.commit_events([EventRow(version=v, time=0.0, kind="x") for v in range(1, 6)])
    assert store.compact_events(100) == 4
    assert store.event_bounds() == (5, 5)


def test_unopenable_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="cannot open the SQLite state store"):
        SqliteStore(tmp_path / "missing-dir" / "state.db")


def test_add_principal_never_overwrites(store: StateStore) -> None:
    root = PrincipalRow(id="root", name="root", superuser=True, created_at=1.0)
    assert store.add_principal(root) is True
    assert store.add_principal(PrincipalRow(id="root", name="evil", superuser=False,
                                            created_at=2.0)) is False
    assert store.get_principal("root") == root


def test_lost_tombstones_round_trip_newest_kept(store_url: str) -> None:
    s = open_store(store_url)
    try:
        s.put_lost([LostSandboxRow(id=f"sb-{i}", node="n1", lost_at=float(i),
                                   record={"i": i}) for i in range(5)], keep=3)
        s.put_lost([LostSandboxRow(id="sb-4", node="n1", lost_at=4.0, record={"i": 44})],
                   keep=3)
    finally:
        s.close()
    s = open_store(store_url)
    try:
        assert [(r.id, r.record) for r in s.list_lost(10)] == [
            ("sb-2", {"i": 2}), ("sb-3", {"i": 3}), ("sb-4", {"i": 44})]
        assert [r.id for r in s.list_lost(2)] == ["sb-3", "sb-4"]
    finally:
        s.close()
