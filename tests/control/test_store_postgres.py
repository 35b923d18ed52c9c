"""What only the PostgreSQL store has: URLs and their errors, versions allocated under
the lock by concurrent writers, prepared statements, NOTIFY on commit."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psycopg
import pytest

from dsec.control.store import EventRow, PrincipalRow, SandboxRow, open_store, redact_url
from dsec.control.store.postgres import PostgresStore
from dsec.control.store.sqlite import SqliteStore
from dsec.errors import InvalidArgument, Unavailable


def test_urls_name_the_store(tmp_path: Path, pg_dsn: str) -> None:
    for url in (str(tmp_path / "a.sqlite"), f"sqlite://{tmp_path / 'b.sqlite'}"):
        s = open_store(url)
        assert isinstance(s, SqliteStore)
        s.close()
    assert (tmp_path / "a.sqlite").exists() and (tmp_path / "b.sqlite").exists()
    s = open_store(pg_dsn)
    assert isinstance(s, PostgresStore)
    s.close()
    s = open_store(pg_dsn.replace("postgresql://", "postgres://"))
    assert isinstance(s, PostgresStore)
    s.close()
    for bad, words in (("mysql://u@h/db", "unknown state store scheme 'mysql'"),
                       ("sqlite://", "names no file"), ("", "empty state store URL"),
                       ("postgresql:db", "has no '//'")):
        with pytest.raises(InvalidArgument, match=words):
            open_store(bad)


def test_an_unreachable_server_is_a_clear_error_without_the_password(tmp_path: Path,
                                                                     pg_dsn: str) -> None:
    url = f"postgresql://dsec:s3cret-pw@/x?host={tmp_path}&port=5999"
    with pytest.raises(Unavailable) as err:
        open_store(url)
    msg = str(err.value)
    assert "cannot reach the PostgreSQL state store" in msg and str(tmp_path) in msg
    assert "s3cret-pw" not in msg and "dsec:***@" in msg
    assert "check the server is running" in msg
    # a live server without that database says which
    missing = pg_dsn.replace("/t", "/nosuchdb_t", 1)
    with pytest.raises(Unavailable, match='database "nosuchdb_t'):
        open_store(missing)
    assert redact_url("postgresql://u:pw@h:5/db?password=pw2") == (
        "postgresql://u:***@h:5/db?password=***")
    assert redact_url("postgresql://u@h/db") == "postgresql://u@h/db"


def test_concurrent_writers_get_dense_unique_versions(pg_dsn: str) -> None:
    stores = [open_store(pg_dsn) for _ in range(3)]
    firsts: list[list[int]] = [[] for _ in stores]

    def write(i: int) -> None:
        for n in range(40):
            firsts[i].append(stores[i].commit_events(
                [EventRow(version=0, time=float(n), kind=f"w{i}") for _ in range(3)],
                [SandboxRow(id=f"sb-{i}-{n}", node="e0", project="p", record={})],
                assign_versions=True))

    try:
        threads = [threading.Thread(target=write, args=(i,)) for i in range(len(stores))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        versions = [e.version for e in stores[0].read_events(0, 1000)]
        assert versions == list(range(1, 361))
        # each batch got three consecutive versions of its own
        starts = sorted(v for f in firsts for v in f)
        assert starts == list(range(1, 361, 3))
        assert len(stores[1].list_sandboxes()) == 120
    finally:
        for s in stores:
            s.close()


def test_repeated_statements_are_prepared_and_commits_notify(pg_dsn: str) -> None:
    store = open_store(pg_dsn)
    assert isinstance(store, PostgresStore)
    heard: list[int] = []
    try:
        store.put_principal(PrincipalRow(id="p", name="p"))
        for _ in range(5):
            assert store.get_principal("p") is not None
        rows = store._all("SELECT statement FROM pg_prepared_statements")
        assert any("FROM principals WHERE id" in r[0] for r in rows), rows
        assert store.listen_versions(heard.append) is True
        deadline = time.monotonic() + 10
        while not store.listening:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        store.commit_events([EventRow(version=0, time=0.0, kind="x")] * 2,
                            assign_versions=True)
        # a rolled-back commit notifies nobody
        with pytest.raises(psycopg.IntegrityError):
            store.commit_events([EventRow(version=2, time=0.0, kind="dup")])
        store.commit_events([EventRow(version=0, time=0.0, kind="y")], assign_versions=True)
        while len(heard) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.1)
        assert heard == [2, 3]
    finally:
        store.close()


def test_replicas_opening_a_new_database_at_once_do_not_collide(pg_dsn: str) -> None:
    errors: list[Exception] = []
    opened: list[PostgresStore] = []

    def open_one() -> None:
        try:
            s = open_store(pg_dsn)
            assert isinstance(s, PostgresStore)
            opened.append(s)
        except Exception as exc:  # noqa: BLE001 - collected, asserted empty below
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors
        assert len(opened) == 4 and opened[0].table_rows()["events"] == 0
    finally:
        for s in opened:
            s.close()


def test_a_value_postgresql_cannot_store_is_invalid_input_not_an_internal_error(
        pg_dsn: str) -> None:
    """A NUL byte in a text value (SQLite stores it, PostgreSQL refuses it) is the
    request's bad input: InvalidArgument (400), never a driver error (500). Found by
    schemathesis through a create's session id."""
    store = open_store(pg_dsn)
    try:
        with pytest.raises(InvalidArgument, match="cannot be stored"):
            store.get_session("ses-\x00")
        assert store.get_session("ses-0") is None          # the store is fine after it
    finally:
        store.close()
