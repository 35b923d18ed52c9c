from __future__ import annotations

import itertools

import pytest

from dsec.control.iam import ACTION_ROLE, Iam, hash_secret
from dsec.control.store import StateStore
from dsec.control.store.postgres import PostgresStore
from dsec.control.store.sqlite import SqliteStore
from dsec.errors import Conflict, InvalidArgument, NotFound, PermissionDenied, Unauthenticated

from .conftest import FakeClock


@pytest.fixture
def iam(store: StateStore, clock: FakeClock) -> Iam:
    return Iam(store, clock=clock)


def test_key_is_shown_once_and_stored_only_as_a_hash(iam: Iam, store: StateStore) -> None:
    iam.create_principal("alice")
    key = iam.create_key("alice")
    assert key.token.startswith(f"dsk_{key.key_id}_")
    secret = key.token.split("_", 2)[2]
    row = store.get_api_key(key.key_id)
    assert row is not None and row.secret_hash == hash_secret(secret)
    # the secret appears nowhere in the database (the SQLite file and its WAL; every
    # row of every table on PostgreSQL)
    if isinstance(store, PostgresStore):
        import psycopg
        with psycopg.connect(store.url) as conn:
            db = b"".join(repr(conn.execute(f"SELECT * FROM {t}").fetchall()).encode()
                          for t in store.table_rows())
        assert key.key_id.encode() in db      # the dump is real: the key's id is in it
    else:
        assert isinstance(store, SqliteStore)
        with open(store.path, "rb") as f:
            db = f.read()
        import glob
        for extra in glob.glob(store.path + "-wal"):
            with open(extra, "rb") as f:
                db += f.read()
    assert secret.encode() not in db
    assert iam.authenticate(key.token).id == "alice"


def test_authenticate_rejects_wrong_malformed_missing_and_revoked(iam: Iam) -> None:
    iam.create_principal("alice")
    key = iam.create_key("alice")
    wrong = key.token[:-1] + ("A" if key.token[-1] != "A" else "B")
    with pytest.raises(Unauthenticated, match="is not valid") as exc:
        iam.authenticate(wrong)
    assert wrong not in str(exc.value)
    unknown = "dsk_" + "0" * 16 + "_" + key.token.split("_", 2)[2]
    with pytest.raises(Unauthenticated, match="is not valid"):
        iam.authenticate(unknown)
    with pytest.raises(Unauthenticated, match="malformed"):
        iam.authenticate("Bearer nonsense")
    with pytest.raises(Unauthenticated, match="no API key"):
        iam.authenticate(None)
    iam.revoke_key(key.key_id)
    with pytest.raises(Unauthenticated, match="revoked"):
        iam.authenticate(key.token)


def test_deterministic_keys_with_injected_randomness(store: StateStore,
                                                     clock: FakeClock) -> None:
    counter = itertools.count()
    iam = Iam(store, clock=clock, token_bytes=lambda n: bytes([next(counter) % 256]) * n)
    iam.create_principal("bob")
    assert iam.create_key("bob").key_id == "00" * 8


def test_roles_inherit_down_the_tree_and_not_up(iam: Iam) -> None:
    alice = iam.create_principal("alice")
    iam.grant("alice", "org/team", "member")
    assert iam.authorize(alice, "org/team/exp1", "sandbox.create") == "member"
    assert iam.authorize(alice, "org/team", "sandbox.get") == "member"
    with pytest.raises(PermissionDenied) as exc:
        iam.authorize(alice, "org", "sandbox.get")
    assert exc.value.detail["project"] == "org" and exc.value.detail["needed"] == "reader"
    with pytest.raises(PermissionDenied, match="needs role 'admin'"):
        iam.authorize(alice, "org/team/exp1", "quota.set")
    # a stronger binding higher up wins over a weaker one lower down
    iam.grant("alice", "org", "admin")
    iam.grant("alice", "org/team/exp1", "reader")
    assert iam.role_on(alice, "org/team/exp1") == "admin"
    assert iam.revoke("alice", "org") is True
    assert iam.role_on(alice, "org/team/exp1") == "member"
    with pytest.raises(PermissionDenied):
        iam.authorize(alice, "org/other", "sandbox.list")


def test_reader_member_admin_matrix(iam: Iam) -> None:
    rank = {"reader": 1, "member": 2, "admin": 3}
    for role in ("reader", "member", "admin"):
        p = iam.create_principal(f"p-{role}")
        iam.grant(p.id, "proj", role)  # type: ignore[arg-type]
        for action, need in ACTION_ROLE.items():
            if rank[role] >= rank[need]:
                iam.authorize(p, "proj", action)
            else:
                with pytest.raises(PermissionDenied):
                    iam.authorize(p, "proj", action)


def test_superuser_is_admin_everywhere(iam: Iam) -> None:
    root = iam.create_principal("root", superuser=True)
    assert iam.authorize(root, "any/project/at/all", "quota.set") == "admin"


def test_bad_input_is_rejected_clearly(iam: Iam) -> None:
    with pytest.raises(InvalidArgument, match="invalid principal id"):
        iam.create_principal("Not Valid!")
    with pytest.raises(NotFound):
        iam.create_key("ghost")
    iam.create_principal("alice")
    with pytest.raises(InvalidArgument, match="unknown role"):
        iam.grant("alice", "org", "owner")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="invalid project path"):
        iam.grant("alice", "Org//x", "reader")


def test_create_principal_refuses_an_existing_id(iam: Iam) -> None:
    iam.create_principal("root", superuser=True)
    with pytest.raises(Conflict, match="already exists"):
        iam.create_principal("root")
    assert iam.get_principal("root").superuser   # unchanged
