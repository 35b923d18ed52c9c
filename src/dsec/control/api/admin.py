"""Administration of projects, quotas, API keys and sessions: the admin routes' logic.

Who may do what (the rules in each method's docstring) over the state store, IAM and the
quota index the control plane holds; the REST and Aether doors only decode and encode.
It used to live in :class:`~dsec.control.api.plane.ControlPlane` (issue 13 moved it out
so the plane keeps the cluster's state and loops); the plane builds one :class:`Admin`
over its own parts and hands it to the doors.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from dsec.control.api.service import ApiService, Caller
from dsec.control.iam import Iam
from dsec.control.quota import Limits, Quota, QuotaIndex
from dsec.control.registry import Registry
from dsec.control.store import QuotaRow, SessionRow, StateStore
from dsec.control.sweeper import Session
from dsec.errors import Conflict, InvalidArgument, NotFound, PermissionDenied, QuotaExceeded
from dsec.ids import parse_project_path
from dsec.wire.api import (
    MAX_QUOTA,
    CreateKeyRequest,
    CreateKeyResponse,
    KeyList,
    KeyView,
    ProjectList,
    ProjectView,
    QuotaBody,
    SessionView,
    TierQuota,
)

__all__ = ["Admin", "AdminLimits", "AuthCaches"]

_KEY_ID_RE = re.compile(r"[0-9a-f]{16}")


class AdminLimits(Protocol):
    """The bounds administration enforces (:class:`~dsec.control.api.plane.PlaneConfig`
    carries them)."""

    @property
    def min_lease_s(self) -> float: ...
    @property
    def max_lease_s(self) -> float: ...
    @property
    def session_retention_s(self) -> float: ...
    @property
    def max_sessions_per_principal(self) -> int | None: ...
    @property
    def max_keys_per_principal(self) -> int | None: ...


class AuthCaches(Protocol):
    """Caches of authenticated keys to drop when a key is revoked or a principal's roles
    change (:class:`~dsec.control.api.service.ApiService` holds them)."""

    def forget_key(self, key_id: str) -> None: ...
    def forget_principal(self, principal_id: str) -> None: ...


class Admin:
    """Projects, quotas, keys and sessions (see the module docstring).

    ``sync_snapshots`` brings the quota index's snapshot charges up to date with the store
    (other replicas charge too) before usage is shown; ``caches`` returns the apiserver's
    key caches, or None while there is no apiserver (bootstrap, tests)."""

    def __init__(self, *, store: StateStore, iam: Iam, quota: QuotaIndex, registry: Registry,
                 limits: AdminLimits, clock: Callable[[], float],
                 sync_snapshots: Callable[[], None],
                 caches: Callable[[], AuthCaches | None],
                 image_bytes: Callable[[str], int | None] = lambda project: None) -> None:
        self.store = store
        self.iam = iam
        self.quota = quota
        self.registry = registry
        self.limits = limits
        self.clock = clock
        self._sync_snapshots = sync_snapshots
        self._caches = caches
        self._image_bytes = image_bytes

    def _admin(self, caller: Caller, project: str) -> None:
        ApiService.require(caller, project, "admin")

    def list_projects(self, caller: Caller) -> ProjectList:
        paths = set(self.quota.quotas()) | set(caller.roles)
        for r in self.registry.sandboxes():
            paths.add(r.project)
        self._sync_snapshots()
        items = [self._view(p) for p in sorted(paths) if caller.role_on(p) is not None]
        return ProjectList(items=items)

    def _view(self, path: str) -> ProjectView:
        q = self.quota.quota(path)
        u = self.quota.usage(path)
        return ProjectView(
            path=path,
            quota=None if q is None else QuotaBody.clamped(max_sandboxes=q.max_sandboxes,
                                                            cpu_milli=q.cpu_milli,
                                                            memory_bytes=q.memory_bytes,
                                                            snapshot_bytes=q.snapshot_bytes,
                                                            image_bytes=q.image_bytes,
                                                            network=q.network,
                                                            registry_pull=q.registry_pull,
                                                            qos_ls=q.qos_ls,
                                                            tiers=_tier_views(q)),
            usage={"sandboxes": u.sandboxes, "cpu_milli": u.cpu_milli,
                   "memory_bytes": u.memory_bytes, "snapshot_bytes": u.snapshot_bytes,
                   **({} if (img := self._image_bytes(path)) is None
                      else {"image_bytes": img})})

    def get_project(self, caller: Caller, path: str) -> ProjectView:
        parse_project_path(path)
        ApiService.require(caller, path, "reader")
        self._sync_snapshots()
        return self._view(path)

    def set_quota(self, caller: Caller, path: str, q: QuotaBody) -> ProjectView:
        """Set ``path``'s quota. It needs admin on the *parent* project (a superuser for a
        top-level one): a quota bounds a project's admins too, so they must not be able
        to lift the one they were given (they still set their subprojects' quotas)."""
        parse_project_path(path)
        parent = path.rpartition("/")[0]
        if parent:
            have = caller.role_on(parent)
            if have != "admin":
                raise PermissionDenied(
                    f"principal {caller.name!r} cannot set the quota of project {path!r}: "
                    f"that needs role 'admin' on its parent project {parent!r} (has "
                    f"{have or 'none'}); a project's own admins cannot raise its quota")
        elif not caller.superuser:
            raise PermissionDenied(
                f"principal {caller.name!r} cannot set the quota of top-level project "
                f"{path!r}: only a superuser may (a project's own admins cannot raise its "
                "quota); admins set the quotas of their subprojects")
        quota = Quota(max_sandboxes=q.max_sandboxes, cpu_milli=q.cpu_milli,
                      memory_bytes=q.memory_bytes, snapshot_bytes=q.snapshot_bytes,
                      image_bytes=q.image_bytes, network=q.network,
                      registry_pull=q.registry_pull, qos_ls=q.qos_ls,
                      tiers={t: Limits(max_sandboxes=lim.max_sandboxes,
                                       cpu_milli=lim.cpu_milli, memory_bytes=lim.memory_bytes)
                             for t, lim in q.tiers.items()})
        self.quota.set_quota(path, quota)
        self.store.put_quota(QuotaRow(project=path, quota=msgspec.to_builtins(quota)))
        self._sync_snapshots()
        return self._view(path)

    def create_key(self, caller: Caller, req: CreateKeyRequest) -> CreateKeyResponse:
        """Mint an API key. Who may mint for whom (a key acts as its principal, with
        every role that principal holds anywhere, so minting one for someone else is
        impersonation):

        - ``req.name`` is the caller itself: an extra key of its own. Nothing is granted;
          the caller must already hold ``req.role`` on ``req.project``.
        - ``req.name`` is new: the caller must be admin of ``req.project``; the principal
          is created with ``req.role`` there (inside the caller's subtree, never above).
        - ``req.name`` exists and is someone else: only a superuser may (it also grants
          ``req.role`` on ``req.project``), and only when it says so (``req.existing``),
          and never for another superuser: a superuser's keys are minted by that
          superuser alone. A project admin gets a ``409 conflict`` (the name is taken),
          never a key. ``existing`` must be explicit because project admins create
          principals in the same cluster-wide id space: an admin who pre-creates
          ``carol`` keeps a key for her, and a superuser "creating" carol later would
          otherwise grant that key whatever carol is meant to get (a red-team finding).
        """
        parse_project_path(req.project)
        target = self.store.get_principal(req.name)
        if target is not None and target.id == caller.id:
            ApiService.require(caller, req.project, req.role)
            self._check_key_room(req.name)
        else:
            self._admin(caller, req.project)
            if target is None:
                self.iam.create_principal(req.name, name=req.name)  # Conflict on a race
                self.iam.grant(req.name, req.project, req.role)
            elif target.superuser:
                raise PermissionDenied(
                    f"principal {req.name!r} is a superuser: only it may mint keys for "
                    "itself (POST /v1/keys with its own key and its own name)")
            elif not caller.superuser:
                raise Conflict(
                    f"principal {req.name!r} already exists and is not yours: only it "
                    "(minting its own extra key) or a superuser may create keys for an "
                    "existing principal; pick a new name for a new principal")
            elif not req.existing:
                raise Conflict(
                    f"principal {req.name!r} already exists (with roles on "
                    f"{len(self.store.list_role_bindings(req.name))} project(s)); granting "
                    f"it {req.role!r} on {req.project!r} would give that role to every key "
                    "it already holds, including keys minted by whoever created it. Pass "
                    "\"existing\": true to grant this existing principal, or pick a new name",
                    principal_id=req.name)
            else:
                self._check_key_room(req.name)    # before granting: all or nothing
                self.iam.grant(req.name, req.project, req.role)
                self._forget_principal(req.name)
        key = self.iam.create_key(req.name)
        return CreateKeyResponse(name=req.name, project=req.project, role=req.role,
                                 api_key=key.token, key_id=key.key_id)

    def _check_key_room(self, principal_id: str) -> None:
        cap = self.limits.max_keys_per_principal
        if cap is None:
            return
        have = len(self.store.list_api_keys(principal_id))
        if have >= cap:
            raise QuotaExceeded(
                f"principal {principal_id!r} has {have} API keys (revoked ones included), "
                f"the limit is {cap}: reuse a key you hold instead of minting more",
                resource="api_keys", used=have, limit=cap, requested=1)

    def list_keys(self, caller: Caller, principal: str | None) -> KeyList:
        """The API keys of ``principal`` (default: the caller), oldest first, revoked
        ones included (their rows stay): the same rule as revoking, so a principal sees
        its own keys and a superuser those of non-superusers; any other principal
        answers exactly like a missing one. Ids, owner and times only, never a secret."""
        target = principal or caller.id
        allowed = target == caller.id
        if not allowed and caller.superuser:
            owner = self.store.get_principal(target)
            allowed = owner is not None and not owner.superuser
        if not allowed:
            raise NotFound(f"no principal {target!r} whose keys this API key may list (your "
                           "own keys: leave principal out)", principal=target)
        rows = sorted(self.store.list_api_keys(target), key=lambda r: (r.created_at, r.key_id))
        return KeyList(items=[KeyView(key_id=r.key_id, principal=r.principal_id,
                                      created_at=r.created_at, revoked=r.revoked)
                              for r in rows])

    def revoke_key(self, caller: Caller, key_id: str) -> None:
        """Revoke key ``key_id`` (its id, the 16 hex digits after ``dsk_``): the same
        rule as minting, so a principal revokes its own keys and a superuser those of
        non-superusers. A key the caller may not revoke answers exactly like a missing
        one (key ids do not leak). Takes effect at once on this replica (its principal
        cache is told) and within ``ApiConfig.principal_cache_s`` on other replicas."""
        row = self.store.get_api_key(key_id) if _KEY_ID_RE.fullmatch(key_id) else None
        allowed = False
        if row is not None:
            if row.principal_id == caller.id:
                allowed = True
            elif caller.superuser:
                owner = self.store.get_principal(row.principal_id)
                allowed = owner is None or not owner.superuser
        if not allowed:
            raise NotFound(f"no API key {key_id[:32]!r} visible to this API key (give the "
                           "key id: the 16 hex digits after 'dsk_')", key_id=key_id[:32])
        self.iam.revoke_key(key_id)
        caches = self._caches()
        if caches is not None:
            caches.forget_key(key_id)

    def _forget_principal(self, principal_id: str) -> None:
        """Drop cached authentications of ``principal_id`` (its roles just changed)."""
        caches = self._caches()
        if caches is not None:
            caches.forget_principal(principal_id)

    # -------------------------------------------------------------- sessions
    def open_session(self, caller: Caller, lease_s: float) -> SessionView:
        c = self.limits
        if not c.min_lease_s <= lease_s <= c.max_lease_s:
            raise InvalidArgument(f"lease_s={lease_s} must be within {c.min_lease_s:g}.."
                                  f"{c.max_lease_s:g} seconds", field="lease_s")
        cap = c.max_sessions_per_principal
        if cap is not None:
            have = self.store.count_sessions(caller.id)
            if have >= cap:
                raise QuotaExceeded(
                    f"principal {caller.name!r} holds {have} sessions (open ones, lapsed "
                    f"ones kept {c.session_retention_s:g}s for renewal, closed ones not yet "
                    f"swept), the limit is {cap}: close the sessions you no longer use "
                    "(DELETE /v1/sessions/{id}) or renew one instead of opening another",
                    resource="sessions", used=have, limit=cap, requested=1)
        sid = "ses-" + secrets.token_hex(8)
        row = SessionRow(id=sid, principal_id=caller.id, lease_s=lease_s,
                         expires_at=self.clock() + lease_s)
        self.store.put_session(row)
        return SessionView(id=row.id, lease_s=row.lease_s, expires_at=row.expires_at)

    def renew_session(self, caller: Caller, sid: str) -> SessionView:
        """Extend a lease (one atomic store update, so any replica may serve it). Only
        the principal that opened the session may renew it; an unknown id (never opened,
        or forgotten ``session_retention_s`` after it lapsed) is a 404 and is never
        claimed by whoever renews it first: session ids show up in sandbox labels, and
        the owner of a session decides when its sandboxes are swept."""
        if not _session_shaped(sid):
            raise NotFound(f"no session {sid[:64]!r}; open one with POST /v1/sessions")
        row = self.store.renew_session(sid, caller.id, self.clock())
        if row is None:
            old = self.store.get_session(sid)
            if old is not None and old.principal_id == caller.id and old.closed:
                raise NotFound(f"session {sid} was closed; open a new one")
            raise NotFound(f"no session {sid!r} of this API key's principal; open one with "
                           "POST /v1/sessions")
        return SessionView(id=row.id, lease_s=row.lease_s, expires_at=row.expires_at)

    def check_session(self, caller: Caller, sid: str) -> None:
        """A create may bind its sandbox only to a session of the caller's own principal
        that is not closed: another principal's session decides when *its* sandboxes are
        swept, and a sandbox bound to a session id that does not exist was swept (or
        kept) by chance. Refused as the renew of it would be (404, no hint whether the
        id exists for someone else)."""
        s = self.store.get_session(sid) if _session_shaped(sid) else None
        if s is None or s.principal_id != caller.id:
            raise NotFound(f"no session {sid[:64]!r} of this API key's principal: open one "
                           "with POST /v1/sessions and create under it", field="session")
        if s.closed:
            raise NotFound(f"session {sid} was closed; open a new one", field="session")

    def close_session(self, caller: Caller, sid: str) -> None:
        s = self.store.get_session(sid) if _session_shaped(sid) else None
        if s is None or s.principal_id != caller.id:
            raise NotFound(f"no session {sid[:64]!r}")
        self.store.put_session(SessionRow(id=s.id, principal_id=s.principal_id,
                                          lease_s=s.lease_s, expires_at=self.clock(),
                                          closed=True))

    def sessions(self) -> dict[str, Session]:
        """Every session in the store (what the sweeper decides on)."""
        return {r.id: Session(r.id, r.principal_id, r.lease_s, r.expires_at, r.closed)
                for r in self.store.list_sessions()}


def _tier_views(q: Quota) -> dict[Any, TierQuota]:
    """A stored quota's tier limits as the API shows them, each clamped into
    0..MAX_QUOTA as :meth:`QuotaBody.clamped` does for the overall ones."""
    def c(v: int | None) -> int | None:
        return None if v is None else min(max(v, 0), MAX_QUOTA)
    return {t: TierQuota(max_sandboxes=c(lim.max_sandboxes), cpu_milli=c(lim.cpu_milli),
                         memory_bytes=c(lim.memory_bytes)) for t, lim in q.tiers.items()}


def _session_shaped(sid: str) -> bool:
    """Could ``sid`` be a session id this control plane made (``ses-`` + hex)? Anything
    else is no session of ours and never reaches the store (a NUL byte in a session id
    was a PostgreSQL DataError, a 500, found by schemathesis)."""
    return (sid.startswith("ses-") and len(sid) <= 64 and sid.isascii()
            and sid.isprintable())
