"""Identity and access: principals, API keys, roles on a project tree.

An API key is shown once, at creation, as ``dsk_<key id>_<secret>``. The store keeps the
key id (for lookup) and ``sha256(secret)``; the secret is 32 random bytes, so a plain
hash is enough: a slow KDF (scrypt, argon2) protects *low-entropy* passwords against
offline guessing, and with 256 bits of entropy there is nothing to guess, while scrypt
would add milliseconds to every authenticated request. Hashes are compared with
:func:`hmac.compare_digest` so timing does not leak how many bytes matched.

Roles (``reader`` < ``member`` < ``admin``) are bound per project and inherited down the
tree: ``member`` on ``org`` is ``member`` on ``org/team/exp1``. The effective role is the
highest binding on the project or any ancestor. A ``superuser`` principal is admin
everywhere (the bootstrap account).

:class:`Iam` reads through the injected :class:`~dsec.control.store.StateStore` on every
call, so a key revoked or a binding changed by any apiserver replica takes effect at once.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

from dsec.control.store import ApiKeyRow, PrincipalRow, RoleBindingRow, StateStore
from dsec.errors import Conflict, InvalidArgument, NotFound, PermissionDenied, Unauthenticated
from dsec.ids import parse_project_path
from dsec.wire.api import ROLE_RANK, Role, role_on

__all__ = [
    "ACTION_ROLE",
    "Action",
    "ApiKey",
    "Iam",
    "Principal",
    "hash_secret",
]

Action = Literal[
    # reader
    "sandbox.get", "sandbox.list", "sandbox.watch", "project.get", "quota.get",
    # member
    "sandbox.create", "sandbox.exec", "sandbox.files", "sandbox.pause", "sandbox.resume",
    "sandbox.snapshot", "sandbox.destroy",
    # admin
    "quota.set", "role.grant", "role.revoke", "key.create", "key.revoke", "project.admin",
]

#: The least role that may perform each action.
ACTION_ROLE: dict[Action, Role] = {
    "sandbox.get": "reader", "sandbox.list": "reader", "sandbox.watch": "reader",
    "project.get": "reader", "quota.get": "reader",
    "sandbox.create": "member", "sandbox.exec": "member", "sandbox.files": "member",
    "sandbox.pause": "member", "sandbox.resume": "member", "sandbox.snapshot": "member",
    "sandbox.destroy": "member",
    "quota.set": "admin", "role.grant": "admin", "role.revoke": "admin",
    "key.create": "admin", "key.revoke": "admin", "project.admin": "admin",
}
assert set(ACTION_ROLE) == set(get_args(Action))

_KEY_RE = re.compile(r"dsk_([0-9a-f]{16})_([A-Za-z0-9_-]{43})")
_PRINCIPAL_RE = re.compile(r"[a-z0-9][a-z0-9_.@-]{0,127}")


def hash_secret(secret: str) -> bytes:
    """The stored form of a key's secret part (see the module docstring for why sha256)."""
    return hashlib.sha256(secret.encode("ascii")).digest()


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the principal id, display name and whether it is a superuser."""

    id: str
    name: str
    superuser: bool = False


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A freshly created key. ``token`` is the only time the secret exists in clear."""

    key_id: str
    principal_id: str
    token: str


class Iam:
    """Principals, keys and role bindings over a :class:`StateStore`.

    ``clock`` gives creation timestamps; ``token_bytes`` draws key material (injected so
    tests can be deterministic; production uses :func:`secrets.token_bytes`).
    """

    def __init__(
        self,
        store: StateStore,
        *,
        clock: Callable[[], float],
        token_bytes: Callable[[int], bytes] = secrets.token_bytes,
    ) -> None:
        self._store = store
        self._clock = clock
        self._token_bytes = token_bytes

    # --- administration --------------------------------------------------------------
    def create_principal(self, principal_id: str, *, name: str = "",
                         superuser: bool = False) -> Principal:
        """Create a new principal; :class:`Conflict` if the id exists. Never an upsert:
        re-"creating" an existing principal must not change it (e.g. clear ``superuser``)
        nor hand its name to whoever asked second."""
        if not isinstance(principal_id, str) or not _PRINCIPAL_RE.fullmatch(principal_id):
            raise InvalidArgument(
                f"invalid principal id {principal_id!r}: use 1-128 lowercase letters, "
                "digits and '_.@-'", field="principal_id")
        row = PrincipalRow(id=principal_id, name=name or principal_id, superuser=superuser,
                           created_at=self._clock())
        if not self._store.add_principal(row):
            raise Conflict(f"principal {principal_id!r} already exists; pick another name",
                           principal_id=principal_id)
        return Principal(row.id, row.name, row.superuser)

    def get_principal(self, principal_id: str) -> Principal:
        row = self._store.get_principal(principal_id)
        if row is None:
            raise NotFound(f"principal {principal_id!r} does not exist; create it first",
                           principal_id=principal_id)
        return Principal(row.id, row.name, row.superuser)

    def create_key(self, principal_id: str) -> ApiKey:
        """Issue a new API key for an existing principal; the token is returned once."""
        self.get_principal(principal_id)
        key_id = self._token_bytes(8).hex()
        secret = _b64(self._token_bytes(32))
        self._store.put_api_key(ApiKeyRow(key_id=key_id, principal_id=principal_id,
                                          secret_hash=hash_secret(secret),
                                          created_at=self._clock()))
        return ApiKey(key_id, principal_id, f"dsk_{key_id}_{secret}")

    def revoke_key(self, key_id: str) -> None:
        row = self._store.get_api_key(key_id)
        if row is None:
            raise NotFound(f"API key {key_id!r} does not exist", key_id=key_id)
        self._store.put_api_key(ApiKeyRow(key_id=row.key_id, principal_id=row.principal_id,
                                          secret_hash=row.secret_hash,
                                          created_at=row.created_at, revoked=True))

    def grant(self, principal_id: str, project: str, role: Role) -> None:
        """Bind ``role`` on ``project`` (and so its subtree), replacing an earlier binding."""
        self.get_principal(principal_id)
        if role not in ROLE_RANK:
            raise InvalidArgument(f"unknown role {role!r}: use one of {sorted(ROLE_RANK)}",
                                  field="role")
        parse_project_path(project)
        self._store.put_role_binding(RoleBindingRow(principal_id=principal_id,
                                                    project=project, role=role))

    def revoke(self, principal_id: str, project: str) -> bool:
        return self._store.delete_role_binding(principal_id, project)

    # --- the request path ---------------------------------------------------------------
    def authenticate(self, token: str | None) -> Principal:
        """The principal behind an API key, or :class:`Unauthenticated`.

        The message never echoes the token. Unknown key ids and wrong secrets get the same
        answer so a caller cannot probe which key ids exist.
        """
        if not token:
            raise Unauthenticated("no API key given: send 'Authorization: Bearer dsk_...'")
        m = _KEY_RE.fullmatch(token) if isinstance(token, str) else None
        if m is None:
            raise Unauthenticated("malformed API key: expected 'dsk_<16 hex>_<43 chars>'")
        row = self._store.get_api_key(m.group(1))
        given = hash_secret(m.group(2))
        # Compare against a dummy hash when the id is unknown so both paths do the work.
        stored = row.secret_hash if row is not None else b"\0" * len(given)
        if not hmac.compare_digest(given, stored) or row is None:
            raise Unauthenticated(f"API key dsk_{m.group(1)}_... is not valid")
        if row.revoked:
            raise Unauthenticated(f"API key dsk_{m.group(1)}_... was revoked; create a new one")
        p = self._store.get_principal(row.principal_id)
        if p is None:
            raise Unauthenticated(f"API key dsk_{m.group(1)}_... belongs to a deleted principal")
        return Principal(p.id, p.name, p.superuser)

    def role_on(self, principal: Principal, project: str) -> Role | None:
        """The effective role of ``principal`` on ``project`` (inherited from ancestors)."""
        if principal.superuser:
            return "admin"
        parse_project_path(project)
        roles = {b.project: b.role for b in self._store.list_role_bindings(principal.id)}
        return role_on(roles, project)

    def authorize(self, principal: Principal, project: str, action: Action) -> Role:
        """Return the effective role if it allows ``action`` on ``project``, else raise
        :class:`PermissionDenied` naming the principal, action, project and needed role."""
        need = ACTION_ROLE.get(action)
        if need is None:
            raise InvalidArgument(f"unknown action {action!r}", field="action")
        have = self.role_on(principal, project)
        if have is None or ROLE_RANK[have] < ROLE_RANK[need]:
            raise PermissionDenied(
                f"principal {principal.id!r} may not {action} in project {project!r}: "
                f"needs role {need!r} there or on an ancestor, has "
                f"{repr(have) if have else 'none'}",
                principal=principal.id, project=project, action=action, needed=need,
                role=have)
        return have


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")
