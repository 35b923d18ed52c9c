"""Who may mint and revoke API keys for whom (ControlPlane.create_key / revoke_key over a
real SQLite store): a key acts as its principal with all of its roles, so minting one
for someone else is impersonation."""

from __future__ import annotations

import pytest

from dsec.control.api.plane import ControlPlane, IamAuthority
from dsec.control.api.service import Caller
from dsec.control.metrics import ApiMetrics
from dsec.control.store import StateStore
from dsec.errors import Conflict, NotFound, PermissionDenied, Unauthenticated
from dsec.wire.api import CreateKeyRequest


@pytest.fixture
def plane(store: StateStore) -> ControlPlane:
    return ControlPlane.open(store, metrics=ApiMetrics())


def _as(plane: ControlPlane, token: str) -> Caller:
    return IamAuthority(plane.iam, plane.store).authenticate(token)


def test_superusers_mint_their_own_keys_only(plane: ControlPlane) -> None:
    root = _as(plane, plane.bootstrap_admin("admin"))
    other = _as(plane, plane.bootstrap_admin("ops"))          # a second superuser
    with pytest.raises(PermissionDenied, match="superuser"):
        plane.create_key(root, CreateKeyRequest(name="ops", project="default", role="admin"))
    own = plane.create_key(other, CreateKeyRequest(name="ops", project="default",
                                                   role="admin"))
    assert _as(plane, own.api_key).id == "ops"
    # nor revoke another superuser's key: it answers like a missing one
    with pytest.raises(NotFound, match="no API key"):
        plane.revoke_key(root, own.key_id)
    plane.revoke_key(other, own.key_id)
    with pytest.raises(Unauthenticated, match="revoked"):
        _as(plane, own.api_key)


def test_superuser_grants_to_existing_principals_and_admins_only_create(
        plane: ControlPlane) -> None:
    root = _as(plane, plane.bootstrap_admin("admin"))
    bob = _as(plane, plane.create_key(root, CreateKeyRequest(
        name="bob", project="org/b", role="admin")).api_key)
    made = plane.create_key(bob, CreateKeyRequest(name="carol", project="org/b/x",
                                                  role="reader"))
    carol = _as(plane, made.api_key)
    assert carol.roles == {"org/b/x": "reader"}
    with pytest.raises(Conflict, match="already exists"):
        plane.create_key(bob, CreateKeyRequest(name="carol", project="org/b/x",
                                               role="admin"))
    with pytest.raises(PermissionDenied):      # outside bob's subtree, even a new name
        plane.create_key(bob, CreateKeyRequest(name="dave", project="org", role="reader"))
    assert plane.store.get_principal("dave") is None
    # the superuser grants an existing principal only when it says so: bob created carol
    # and holds a key of hers, which would gain the role too
    with pytest.raises(Conflict, match="existing"):
        plane.create_key(root, CreateKeyRequest(name="carol", project="org/c",
                                                role="member"))
    assert carol.roles == {"org/b/x": "reader"}
    assert _as(plane, made.api_key).roles == {"org/b/x": "reader"}
    again = plane.create_key(root, CreateKeyRequest(name="carol", project="org/c",
                                                    role="member", existing=True))
    assert _as(plane, again.api_key).roles == {"org/b/x": "reader", "org/c": "member"}
    # a project admin does not revoke keys of others, even of principals it created
    with pytest.raises(NotFound):
        plane.revoke_key(bob, made.key_id)
    with pytest.raises(NotFound):
        plane.revoke_key(bob, "not-a-key-id")
    plane.revoke_key(root, made.key_id)
    with pytest.raises(Unauthenticated):
        _as(plane, made.api_key)
