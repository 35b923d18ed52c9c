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

import re
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec

from dsec.wire.api import Role

__all__ = [
    "ApiKeyRow",
    "EventRow",
    "IdempotencyRow",
    "ImagePinRow",
    "LostSandboxRow",
    "NodeDrainRow",
    "PrincipalRow",
    "QuotaRow",
    "RoleBindingRow",
    "SandboxRow",
    "SessionRow",
    "SnapshotChargeRow",
    "StateStore",
    "open_store",
    "redact_url",
]



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


class SnapshotChargeRow(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot's stored bytes, charged to its project's ``snapshot_bytes`` quota."""

    id: str
    project: str
    node: str
    size_bytes: int
    # What the layer is and stands on, as the control plane saw it made (the edge that
    # took the snapshot, or this apiserver's build/pull): a fetch onto another node
    # publishes the layer with this meaning, never the holder's manifest's (red team 16
    # F1). None: a row written before it was recorded (such a layer does not move).
    kind: str | None = None
    parent: str | None = None
    stack: tuple[str, ...] = ()


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


class IdempotencyRow(msgspec.Struct, frozen=True, kw_only=True):
    """One ``Idempotency-Key`` claim. ``owner`` is the apiserver request that claimed it
    and ``holder`` the apiserver process it runs in (whose lease in ``process_leases``
    keeps the claim alive); ``response`` is None while that request is in flight and the
    encoded answer once it finished. ``expires_at``: the in-flight backstop, then the
    replay window's end. ``intent``: the sandbox id the owner is creating, written
    before it asks the edge, so whoever takes a dead owner's claim over can find that
    sandbox instead of making a second one. ``stale`` (computed on read): in flight, and
    its holder's lease expired or the backstop passed; the next claim takes it over."""

    key: str
    fingerprint: str
    owner: str
    holder: str = ""
    response: bytes | None = None
    expires_at: float = 0.0
    intent: str | None = None
    stale: bool = False


class SessionRow(msgspec.Struct, frozen=True, kw_only=True):
    """A client session lease (see :mod:`dsec.control.sweeper`)."""

    id: str
    principal_id: str
    lease_s: float
    expires_at: float
    closed: bool = False


class LostSandboxRow(msgspec.Struct, frozen=True, kw_only=True):
    """A sandbox written off with its lost node (a tombstone). Kept in the store so an
    apiserver restarted while the node was away still knows, when the node returns, that
    these sandboxes must be destroyed there and not recorded as live again. ``record``
    is the JSON of what ``GET`` and ``/events`` answer for it (see
    :class:`dsec.control.api.plane.LostSandbox`)."""

    id: str
    node: str
    lost_at: float
    record: dict[str, Any]


class NodeDrainRow(msgspec.Struct, frozen=True, kw_only=True):
    """An edge node drained by an administrator (``dsec node drain``): placement puts
    no new sandbox there; the ones it holds run until they end. Stored so that every
    replica and a restarted apiserver keep honouring it (issue 16, Operations)."""

    node: str
    drained_at: float
    by: str = ""                # the principal id that drained it


class ImagePinRow(msgspec.Struct, frozen=True, kw_only=True):
    """An image pinned on a node by an operator (``dsec image pin``): the node keeps every
    layer of it fully in its lazy chunk cache (issue 17). Stored so every replica and a
    restarted apiserver answer the same pins."""

    node: str
    image: str                  # the image's (top layer's) digest
    ref: str                    # as the operator named it
    layers: tuple[str, ...]     # every layer of the image, lowest first
    pinned_at: float
    by: str = ""                # the principal id that pinned it


@runtime_checkable
class StateStore(Protocol):
    """Durable state of the management plane. See the module docstring for semantics."""

    # principals and keys
    def put_principal(self, row: PrincipalRow) -> None: ...
    def add_principal(self, row: PrincipalRow) -> bool:
        """Insert ``row`` unless its id exists (then change nothing, return False): one
        statement, so two admins creating the same new name cannot both get it."""
        ...
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

    # snapshot storage charges
    def put_snapshot_charge(self, row: SnapshotChargeRow) -> None: ...
    def charge_snapshot(self, row: SnapshotChargeRow,
                        limits: Sequence[tuple[str, int]]) -> tuple[str, int] | None:
        """Record ``row`` unless it would take a ``(project, snapshot_bytes)`` limit's
        subtree past it; check and insert are one transaction, so replicas sharing the
        store never overbook. Returns the first ``(project, used)`` over its limit, or
        None when recorded (or already recorded)."""
        ...
    def delete_snapshot_charge(self, snapshot_id: str) -> bool: ...
    def list_snapshot_charges(self) -> list[SnapshotChargeRow]: ...

    # registry
    def commit_events(
        self,
        events: Sequence[EventRow],
        upserts: Sequence[SandboxRow] = (),
        deletes: Sequence[str] = (),
        *,
        assign_versions: bool = False,
    ) -> int:
        """Returns the first event's version; with ``assign_versions`` the store
        allocates the versions (dense, after the newest stored) under its write lock."""
        ...
    def read_events(self, after_version: int, limit: int) -> list[EventRow]: ...
    def event_bounds(self) -> tuple[int, int]:
        """``(oldest retained version, newest version)``; ``(0, 0)`` when empty."""
        ...
    def compact_events(self, below_version: int) -> int: ...
    def prune_events(self, *, keep_last: int | None, older_than: float | None) -> int:
        """Delete events beyond the newest ``keep_last`` and events with ``time`` before
        ``older_than`` (None: no such bound); the newest event is always kept (it
        carries the global version across restarts). Returns how many."""
        ...
    def list_sandboxes(self) -> list[SandboxRow]: ...
    def read_sandboxes(self, ids: Sequence[str]) -> list[SandboxRow]:
        """The stored rows of those ``ids`` that exist."""
        ...
    def listen_versions(self, callback: Callable[[int], None]) -> bool:
        """Call ``callback(newest_version)`` from a store thread whenever any writer
        (another replica too) commits events, and with ``-1`` after the store was
        unreachable (something may have been missed: read it). Returns False when the
        store cannot push (SQLite): the caller polls :meth:`event_bounds` instead."""
        ...

    # idempotency keys (shared by every apiserver replica over this store)
    def idem_claim(self, row: IdempotencyRow, now: float) -> IdempotencyRow:
        """Claim ``row.key`` for ``row.owner`` (in process ``row.holder``) unless a live
        claim exists: a finished row past its window is dropped, a stale in-flight row
        with the same fingerprint is taken over (its ``intent`` kept). Returns the row
        now stored: ours if the claim succeeded, else the live holder's."""
        ...
    def idem_get(self, key: str, now: float) -> IdempotencyRow | None:
        """The row (in flight, or finished within its window), with ``stale`` set."""
        ...
    def idem_note(self, key: str, owner: str, intent: str) -> bool:
        """Record the sandbox id ``owner`` is about to create; False if the claim is no
        longer ``owner``'s (it was taken over)."""
        ...
    def idem_finish(self, key: str, owner: str, response: bytes, expires_at: float) -> bool: ...
    def idem_release(self, key: str, owner: str) -> bool:
        """Give up an in-flight claim (its create failed): deleted, or, when it names an
        ``intent`` that may exist, left without a holder so the next claim takes it over
        and looks for that sandbox first."""
        ...
    def idem_purge(self, now: float, keep: int) -> int:
        """Delete finished rows past their window, stale in-flight rows without an
        intent, and in-flight rows past their window whose holder is gone; then trim
        finished rows to ``keep``: the oldest lose their stored answer but keep their
        sandbox id (``intent``) until their window ends, so a retry finds the sandbox
        instead of making another. Returns how many rows were deleted or trimmed."""
        ...

    # apiserver process leases (what keeps an in-flight idempotency claim alive)
    def lease_renew(self, holder: str, expires_at: float) -> None: ...
    def lease_drop(self, holder: str) -> None: ...
    def lease_purge(self, now: float) -> int:
        """Delete expired process leases; returns how many."""
        ...

    # client session leases
    def put_session(self, row: SessionRow) -> None: ...
    def get_session(self, session_id: str) -> SessionRow | None: ...
    def renew_session(self, session_id: str, principal_id: str, now: float) -> SessionRow | None:
        """Extend an open session of ``principal_id`` to ``now + lease_s`` atomically
        (two replicas renewing at once cannot lose an update); None if there is none."""
        ...
    def list_sessions(self) -> list[SessionRow]: ...
    def count_sessions(self, principal_id: str) -> int:
        """Rows of ``principal_id`` (open, lapsed but kept, closed not yet swept)."""
        ...
    def delete_sessions(self, session_ids: Sequence[str]) -> int: ...

    # sandboxes evicted with a lost node (tombstones)
    def put_lost(self, rows: Sequence[LostSandboxRow], keep: int) -> None:
        """Upsert ``rows``, then delete the oldest (by ``lost_at``) beyond ``keep``."""
        ...
    def list_lost(self, limit: int) -> list[LostSandboxRow]:
        """The newest ``limit`` tombstones, oldest first."""
        ...
    def prune_lost(self, older_than: float) -> int:
        """Delete tombstones lost before ``older_than``; returns how many."""
        ...

    # drained edge nodes (issue 16, scale stream)
    def put_drain(self, row: NodeDrainRow) -> None:
        """Record ``row`` (a node already drained keeps its first ``drained_at``)."""
        ...
    def delete_drain(self, node: str) -> bool: ...
    def list_drains(self) -> list[NodeDrainRow]: ...

    # images pinned on nodes (issue 17, blob stream)
    def put_pin(self, row: ImagePinRow) -> None:
        """Record ``row`` (a pin already there keeps its first ``pinned_at``)."""
        ...
    def delete_pin(self, node: str, image: str) -> bool: ...
    def list_pins(self, node: str | None = None) -> list[ImagePinRow]:
        """The pins of ``node`` (None: of every node), by node then image."""
        ...

    def table_rows(self) -> dict[str, int]:
        """Row count of every table (what retention keeps bounded; for metrics/tests)."""
        ...
    def reclaim_space(self, pages: int) -> None:
        """Give up to ``pages`` pages freed by deletes back to the filesystem."""
        ...

    def close(self) -> None: ...


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs and error messages)."""
    import urllib.parse
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparseable store URL>"
    if parts.password is None:
        out = url
    else:
        netloc = parts.netloc.rsplit("@", 1)
        user = netloc[0].split(":", 1)[0]
        out = urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}"))
    # a password may also ride in the query string (?password=...)
    return re.sub(r"(password=)[^&]*", r"\1***", out, flags=re.IGNORECASE)


def open_store(url: str) -> StateStore:
    """Open the state store named by ``url``:

    - ``sqlite:///abs/path.sqlite`` or a bare path: :class:`~dsec.control.store.sqlite.
      SqliteStore` (one machine; the embedded default);
    - ``postgresql://user[:password]@host[:port]/db[?...]`` (or ``postgres://``):
      :class:`~dsec.control.store.postgres.PostgresStore`, which several apiserver
      replicas share.

    Anything else is an :class:`~dsec.errors.InvalidArgument` naming the accepted forms.
    The password never appears in a message."""
    from dsec.errors import InvalidArgument
    if not isinstance(url, str) or not url.strip():
        raise InvalidArgument("empty state store URL: pass sqlite:///path/control.sqlite "
                              "or postgresql://user@host/db")
    scheme, sep, rest = url.partition("://")
    if not sep:
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", url) and not url.startswith(("./", "/")):
            raise InvalidArgument(
                f"state store URL {redact_url(url)!r} has no '//' after its scheme: use "
                "sqlite:///abs/path.sqlite or postgresql://user@host/db")
        from dsec.control.store.sqlite import SqliteStore
        return SqliteStore(url)
    scheme = scheme.lower()
    if scheme == "sqlite":
        if not rest or rest == "/":
            raise InvalidArgument(f"state store URL {url!r} names no file: use "
                                  "sqlite:///abs/path.sqlite (three slashes, then the path)")
        from dsec.control.store.sqlite import SqliteStore
        path = rest if rest == ":memory:" else (rest if rest.startswith("/") else "/" + rest)
        return SqliteStore(path)
    if scheme in ("postgresql", "postgres"):
        from dsec.control.store.postgres import PostgresStore
        return PostgresStore(url)
    raise InvalidArgument(
        f"unknown state store scheme {scheme!r} in {redact_url(url)!r}: use "
        "sqlite:///abs/path.sqlite (one machine) or postgresql://user@host/db (replicas)")
