"""Administration and image administration stand on their own (issue 13 moved them out of
ControlPlane): built over a real SQLite store, IAM and quota index, with an injected clock
and a recorder for the apiserver's key caches, no plane and no apiserver."""

from __future__ import annotations

from typing import Any

import pytest

from dsec.control.api.admin import Admin
from dsec.control.api.images import ImageAdmin
from dsec.control.api.plane import ControlPlane, IamAuthority, PlaneConfig
from dsec.control.api.service import Caller
from dsec.control.iam import Iam
from dsec.control.metrics import ApiMetrics
from dsec.control.quota import QuotaIndex
from dsec.control.registry import Registry
from dsec.control.store import StateStore
from dsec.errors import Conflict, ImageNotFound, NotFound, QuotaExceeded
from dsec.wire.api import CreateKeyRequest
from dsec.wire.spec import SandboxSpec
from tests.control.conftest import FakeClock


class Caches:
    def __init__(self) -> None:
        self.keys: list[str] = []
        self.principals: list[str] = []

    def forget_key(self, key_id: str) -> None:
        self.keys.append(key_id)

    def forget_principal(self, principal_id: str) -> None:
        self.principals.append(principal_id)


def _admin(store: StateStore, clock: FakeClock, caches: Caches | None,
           **limits: Any) -> tuple[Admin, Iam]:
    iam = Iam(store, clock=clock)
    quota = QuotaIndex()
    synced: list[int] = []
    admin = Admin(store=store, iam=iam, quota=quota,
                  registry=Registry(store, clock=clock, quota=quota),
                  limits=PlaneConfig(**limits),
                  clock=clock, sync_snapshots=lambda: synced.append(1), caches=lambda: caches)
    return admin, iam


def _root(store: StateStore, iam: Iam) -> Caller:
    iam.create_principal("admin", name="admin", superuser=True)
    iam.grant("admin", "default", "admin")
    return IamAuthority(iam, store).authenticate(iam.create_key("admin").token)


def test_sessions_lease_cap_and_close_with_an_injected_clock(store: StateStore,
                                                             clock: FakeClock) -> None:
    admin, iam = _admin(store, clock, None, max_sessions_per_principal=2)
    root = _root(store, iam)
    a = admin.open_session(root, 30.0)
    assert a.expires_at == clock.t + 30.0
    admin.open_session(root, 30.0)
    with pytest.raises(QuotaExceeded, match="holds 2 sessions"):
        admin.open_session(root, 30.0)
    clock.t += 20
    assert admin.renew_session(root, a.id).expires_at == clock.t + 30.0
    admin.close_session(root, a.id)
    with pytest.raises(NotFound, match="was closed"):
        admin.renew_session(root, a.id)
    assert admin.sessions()[a.id].closed


def test_key_changes_reach_the_apiservers_caches(store: StateStore, clock: FakeClock) -> None:
    caches = Caches()
    admin, iam = _admin(store, clock, caches)
    root = _root(store, iam)
    made = admin.create_key(root, CreateKeyRequest(name="carol", project="default",
                                                   role="member"))
    admin.create_key(root, CreateKeyRequest(name="carol", project="org", role="reader",
                                            existing=True))
    assert caches.principals == ["carol"]        # her roles changed: cached keys re-read
    admin.revoke_key(root, made.key_id)
    assert caches.keys == [made.key_id]
    # no apiserver yet (bootstrap): nothing to tell, nothing fails
    bare, _ = _admin(store, clock, None)
    again = bare.create_key(root, CreateKeyRequest(name="dave", project="default",
                                                   role="reader"))
    bare.revoke_key(root, again.key_id)


def test_images_without_a_layer_store(store: StateStore) -> None:
    plane = ControlPlane.open(store, metrics=ApiMetrics())
    images = ImageAdmin(plane)
    root = IamAuthority(plane.iam, store).authenticate(plane.bootstrap_admin("admin"))
    with pytest.raises(Conflict, match="no layer store"):
        images.list_images(root)
    spec = SandboxSpec(image="base")
    assert images.resolve_layers(root, spec) is spec     # a bare name goes on unchanged
    with pytest.raises(ImageNotFound):
        images.resolve_layers(root, SandboxSpec(image="sha256:" + "ab" * 32))
    # the plane's layer_dir is its ImageAdmin's
    assert plane.layer_dir is None and plane.images.layer_dir is None
    plane.layer_dir = "/nonexistent"
    assert plane.images.layer_dir == "/nonexistent"
