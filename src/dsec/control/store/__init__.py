"""The state store: the one place the management plane keeps durable state.

:class:`StateStore` is the interface every caller (IAM, quotas, registry) programs
against; :mod:`dsec.control.store.sqlite` is the embedded default. The rows are msgspec
structs so a second backend (PostgreSQL, for several apiserver replicas) reuses them; the
portable SQL lives in :mod:`dsec.control.store.sql` and only the dialect differs.

Methods are synchronous: SQLite calls take microseconds, and an async runner that must not
block its loop calls them from a worker thread. Every method is atomic on its own;
:meth:`StateStore.commit_events` writes a batch of events *and* the sandbox rows they
change in one transaction, so the event log and the table never disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec

__all__ = [
    "ApiKeyRow",
    "EventRow",
    "PrincipalRow",
    "QuotaRow",
    "Role",
    "RoleBindingRow",
    "SandboxRow",
    "StateStore",
]

Role = Literal["reader", "member", "admin"]


class PrincipalRow(msgspec.Struct, frozen=True, kw_only=True):
    """A user or service account. ``superuser`` holds admin on every project."""

    id: str
    name: str
    superuser: bool = False
    created_at: float = 0.0


class ApiKeyRow(msgspec.Struct, frozen=True, kw_only=True):
    """An API key as stored: the lookup id and a hash of the secret, never the secret."""

    key_id: str
    principal_id: str
    secret_hash: bytes          # sha256 of the secret part (see dsec.control.iam)
    created_at: float = 0.0
    revoked: bool = False


class RoleBindingRow(msgspec.Struct, frozen=True, kw_only=True):
    """``principal_id`` holds ``role`` on ``project`` and, by inheritance, its subtree."""

    principal_id: str
    project: str
    role: Role


class QuotaRow(msgspec.Struct, frozen=True, kw_only=True):
    """A project's quota, stored as the JSON of :class:`dsec.control.quota.Quota`."""

    project: str
    quota: dict[str, Any]


class SandboxRow(msgspec.Struct, frozen=True, kw_only=True):
    """A sandbox as the registry stores it (the JSON of a SandboxRecord)."""

    id: str
    node: str
    project: str
    record: dict[str, Any]


class EventRow(msgspec.Struct, frozen=True, kw_only=True):
    """One registry event. ``version`` is global, dense and strictly increasing."""

    version: int
    time: float
    kind: str
    sandbox_id: str | None = None
    node_id: str | None = None
    payload: dict[str, Any] = {}


@runtime_checkable
class StateStore(Protocol):
    """Durable state of the management plane. See the module docstring for semantics."""

    # principals and keys
    def put_principal(self, row: PrincipalRow) -> None: ...
    def get_principal(self, principal_id: str) -> PrincipalRow | None: ...
    def list_principals(self) -> list[PrincipalRow]: ...
    def put_api_key(self, row: ApiKeyRow) -> None: ...
    def get_api_key(self, key_id: str) -> ApiKeyRow | None: ...
    def list_api_keys(self, principal_id: str) -> list[ApiKeyRow]: ...

    # roles
    def put_role_binding(self, row: RoleBindingRow) -> None: ...
    def delete_role_binding(self, principal_id: str, project: str) -> bool: ...
    def list_role_bindings(self, principal_id: str) -> list[RoleBindingRow]: ...

    # quotas
    def put_quota(self, row: QuotaRow) -> None: ...
    def delete_quota(self, project: str) -> bool: ...
    def list_quotas(self) -> list[QuotaRow]: ...

    # registry
    def commit_events(
        self,
        events: Sequence[EventRow],
        upserts: Sequence[SandboxRow] = (),
        deletes: Sequence[str] = (),
    ) -> None: ...
    def read_events(self, after_version: int, limit: int) -> list[EventRow]: ...
    def event_bounds(self) -> tuple[int, int]:
        """``(oldest retained version, newest version)``; ``(0, 0)`` when empty."""
        ...
    def compact_events(self, below_version: int) -> int: ...
    def list_sandboxes(self) -> list[SandboxRow]: ...

    def close(self) -> None: ...
