"""Request bodies of the edge methods on Aether (msgspec msgpack structs).

Method names are ``edge.<operation>``; :mod:`dsec.edge.service` binds them to an
:class:`~dsec.edge.node.EdgeNode` and :class:`~dsec.edge.service.EdgeClient` calls them.
Replies are records of :mod:`dsec.wire.spec`, :mod:`dsec.wire.node` and, for batches,
:mod:`dsec.wire.outcome` (one outcome per item).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from dsec.errors import InvalidArgument
from dsec.ids import parse_node_id
from dsec.wire.api import PRINCIPAL_PATTERN, CreateSandboxRequest, QuotaBody
from dsec.wire.netpolicy import NetworkPolicy
from dsec.wire.node import MAX_FEED_EVENTS, MAX_LIST_PAGE
from dsec.wire.spec import (
    ExecRequest,
    Isolation,
    SandboxSpec,
    SandboxState,
    check_batch,
    check_file_user,
    check_id,
    check_idempotency_key,
    check_isolation,
    check_label_filter,
    check_mode,
    check_path,
    check_read_range,
    check_reason,
    check_strip,
)

__all__ = [
    "Command",
    "CreateMany",
    "CreateManyOnNode",
    "CreateOnNode",
    "CreateRequest",
    "CreateSandbox",
    "DestroyMany",
    "DestroyOnNode",
    "DestroyRequest",
    "Empty",
    "ExecCall",
    "ExecMany",
    "FeedRequest",
    "FileRef",
    "HeartbeatRequest",
    "ImagePrune",
    "ImageRef",
    "ImageUpload",
    "KeyQuery",
    "KeyRef",
    "ListRequest",
    "ListSandboxes",
    "Mkdir",
    "NetworkUpdate",
    "NetworkUpdateOnNode",
    "NodeRef",
    "ProjectRef",
    "QuotaSet",
    "ReadFile",
    "ReadFileRequest",
    "Remove",
    "ResumeOnNode",
    "ResumeReason",
    "SandboxRef",
    "SessionOpen",
    "SessionRef",
    "SnapshotCall",
    "SnapshotOnNode",
    "SnapshotQuery",
    "SnapshotRef",
    "SnapshotRequest",
    "WriteFile",
    "WriteFileRequest",
    "create_of",
    "exec_request",
    "rest_form",
]

Command = ExecRequest | str | Sequence[str]
MAX_GENERATION = 2**62          # a policy generation (a uint32 ct mark per slot, and more)


def exec_request(cmd: Command, **kw: Any) -> ExecRequest:
    """``"echo hi"`` -> shell, ``["echo", "hi"]`` -> argv, an ExecRequest as is (no kw)."""
    if isinstance(cmd, ExecRequest):
        if kw:
            raise InvalidArgument("pass options inside the ExecRequest, not as keywords")
        return cmd
    if isinstance(cmd, str):
        return ExecRequest(shell=cmd, **kw)
    if isinstance(cmd, Sequence) and all(isinstance(a, str) for a in cmd):
        return ExecRequest(argv=tuple(cmd), **kw)
    raise InvalidArgument(f"a command is a shell string, a list of strings or an ExecRequest, "
                          f"not {type(cmd).__name__}")


class _Call(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """A request body: an unknown field is refused, naming it, at every door (an edge
    that silently dropped a field it does not know, say a new network-policy rule, would
    run the request without it).

    A request validates itself in ``__post_init__`` (construction, ``replace``,
    ``convert`` and every decode, at every door), so one that exists is within its
    limits; the Aether router and the REST decoder answer what it raised unchanged.
    Batches do not validate their items here: each item succeeds or fails on its own."""


class SandboxRef(_Call, kw_only=True):
    """Operations on one sandbox that take nothing else (get, pause, stats, ...)."""

    id: str

    def __post_init__(self) -> None:
        check_id(self.id)


class Empty(_Call, kw_only=True):
    """The body of an operation that takes no arguments (info, nodes, projects, ...)."""


# ------------------------------------------------------------------ create
class CreateSandbox(_Call, kw_only=True):
    """``create`` at the API doors: the spec as the caller wrote it, the client session
    whose lease the sandbox lives under, and the key that makes a retry safe."""

    spec: SandboxSpec = SandboxSpec()
    session: str | None = None          # client session lease; see docs/api.md "Sweeper"
    idempotency_key: str | None = None  # same key within 5 min -> the same sandbox

    def __post_init__(self) -> None:
        check_idempotency_key(self.idempotency_key)
        spec = self.spec.validate()
        if spec is not self.spec:   # the network policy in canonical form
            msgspec.structs.force_setattr(self, "spec", spec)


def create_of(req: CreateSandboxRequest | CreateSandbox, *,
              idempotency_key: str | None = None) -> CreateSandbox:
    """REST's flat create body (:class:`~dsec.wire.api.CreateSandboxRequest`: the spec's
    fields and ``session`` side by side) as the catalogue's :class:`CreateSandbox`. Every
    field of :class:`SandboxSpec` is taken by name from the spec's own field list, never
    from a hand-kept one: a field added to the spec and not to the REST body fails here
    (and in ``tests/test_catalogue.py``), it is never silently dropped."""
    if isinstance(req, CreateSandbox):
        if idempotency_key is None or idempotency_key == req.idempotency_key:
            return req
        return msgspec.structs.replace(req, idempotency_key=idempotency_key)
    given = {name: getattr(req, name) for name in SandboxSpec.__struct_fields__}
    given["toolkits"] = tuple(given["toolkits"])
    return CreateSandbox(spec=SandboxSpec(**given), session=req.session,
                         idempotency_key=idempotency_key)


def rest_form(req: CreateSandbox) -> CreateSandboxRequest:
    """The inverse of :func:`create_of` (the idempotency key aside): REST's flat body of
    the same request, field by field from the spec's own field list. The apiserver
    fingerprints a keyed create in this form (``idempotency.request_fingerprint``), so a
    request is one request whichever door it came through, and the fingerprint of a
    REST body is what it was before the catalogue's form existed."""
    given: dict[str, Any] = {name: getattr(req.spec, name)
                             for name in SandboxSpec.__struct_fields__}
    given["toolkits"] = list(given["toolkits"])
    return CreateSandboxRequest(**given, session=req.session)


class CreateOnNode(_Call, kw_only=True):
    """``edge.create``: a spec the control plane resolved, and the id it chose;
    ``ceiling_deny``: the deny entries of the project's network ceilings (every
    ancestor's), enforced with the sandbox's own (the control plane sets them)."""

    spec: SandboxSpec
    sandbox_id: str | None = None       # pre-chosen id (must name this node); None = new

    ceiling_deny: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.sandbox_id is not None:
            check_id(self.sandbox_id, "sandbox_id")
        _check_ceiling_deny(self.ceiling_deny)


def _check_ceiling_deny(entries: tuple[str, ...]) -> None:
    if entries:
        NetworkPolicy(mode="policy", deny=entries).validate("ceiling")


class CreateMany(_Call, kw_only=True):
    """``create_many`` at the API doors: one spec per sandbox, in order; one
    idempotency key per item (a retried batch makes nothing twice)."""

    items: list[SandboxSpec]
    session: str | None = None
    idempotency_keys: list[str] | None = None

    def __post_init__(self) -> None:
        check_batch(len(self.items), "items")
        if self.idempotency_keys is not None:
            if len(self.idempotency_keys) != len(self.items):
                raise InvalidArgument(
                    f"idempotency_keys has {len(self.idempotency_keys)} keys for "
                    f"{len(self.items)} items: give one per item, or none",
                    field="idempotency_keys")
            for key in self.idempotency_keys:
                check_idempotency_key(key)


class CreateManyOnNode(_Call, kw_only=True):
    """``edge.create_many``: resolved specs, created concurrently on the node."""

    specs: list[SandboxSpec]

    def __post_init__(self) -> None:
        check_batch(len(self.specs), "specs")


class ListSandboxes(_Call, kw_only=True):
    """``list``: filters, then a page of at most ``limit`` sandboxes sorted by id
    (``cursor``: the ``next_cursor`` of the previous page). ``node``: only the
    sandboxes the registry places on that node (an index, so a filtered page costs
    O(page), not a scan of every sandbox)."""

    project: str | None = None
    labels: dict[str, str] = {}
    state: SandboxState | None = None
    limit: int = 100
    cursor: str | None = None
    node: str | None = None
    # only sandboxes of this isolation tier (issue 21): their backend gives it
    isolation: Isolation | None = None

    def __post_init__(self) -> None:
        check_label_filter(self.labels)
        if self.node is not None:
            parse_node_id(self.node)
        if self.isolation is not None:
            check_isolation(self.isolation)


class SnapshotCall(_Call, kw_only=True):
    """``snapshot`` at the API doors: pack_diff sandbox ``id``, leaving out the path
    patterns in ``strip``."""

    id: str
    strip: list[str] = []

    def __post_init__(self) -> None:
        check_id(self.id)
        check_strip(self.strip)


class SnapshotOnNode(_Call, kw_only=True):
    """``edge.snapshot``: pack_diff sandbox ``id``; ``strip`` path patterns left out;
    ``max_bytes``: the most the new layer may take (the project's remaining snapshot
    storage quota, from the control plane; None: only the sandbox's own bound)."""

    id: str
    strip: list[str] = []
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        check_id(self.id)
        check_strip(self.strip)


class SnapshotRef(_Call, kw_only=True):
    """``snapshot_get`` / ``snapshot_delete``: a snapshot ref (sha256:...)."""

    id: str

    def __post_init__(self) -> None:
        check_id(self.id)


class SnapshotQuery(_Call, kw_only=True):
    """``snapshots``: list, optionally only one project's or one sandbox's."""

    project: str | None = None
    sandbox_id: str | None = None

    def __post_init__(self) -> None:
        if self.sandbox_id is not None:
            check_id(self.sandbox_id, "sandbox_id")


class DestroyOnNode(_Call, kw_only=True):
    """``edge.destroy``: the reason and detail go into the sandbox's last event (the
    control plane sets them; a caller of the API only names the sandbox)."""

    id: str
    reason: str = "requested"
    detail: str = ""

    def __post_init__(self) -> None:
        check_id(self.id)
        check_reason(self.reason)
        check_reason(self.detail, "detail")


#: Why a paused sandbox was resumed, as its ``resuming``/``running`` events say:
#: ``requested`` - a caller asked for it (``resume()``); ``auto_resume`` - an operation
#: that needs it running (a write, an exec: docs/sdk.md "Paused sandboxes") woke it,
#: whether the edge did so itself or the control plane did first, within the quota.
ResumeReason = Literal["requested", "auto_resume"]


class ResumeOnNode(_Call, kw_only=True):
    """``edge.resume``: the control plane says why (a caller of the API only names the
    sandbox: its explicit resume is always ``requested``)."""

    id: str
    reason: ResumeReason = "requested"

    def __post_init__(self) -> None:
        check_id(self.id)


class DestroyMany(_Call, kw_only=True):
    ids: list[str]
    reason: str = "requested"

    def __post_init__(self) -> None:
        check_batch(len(self.ids), "ids")
        check_reason(self.reason)


class ExecCall(_Call, kw_only=True):
    id: str
    req: ExecRequest

    def __post_init__(self) -> None:
        check_id(self.id)


class ExecMany(_Call, kw_only=True):
    calls: list[ExecCall]

    def __post_init__(self) -> None:
        check_batch(len(self.calls), "calls")


class ReadFile(_Call, kw_only=True):
    """``read_file``: ``length`` bytes from ``offset`` (None: to the end, at most
    ``MAX_FILE_READ_BYTES``)."""

    id: str
    path: str
    offset: int = 0
    length: int | None = None
    # the sandbox user the call runs as (its rights, checked by the kernel); None: root
    user: str | None = None

    def __post_init__(self) -> None:
        check_file_user(self.user)
        check_id(self.id)
        check_path(self.path)
        check_read_range(self.offset, self.length)


class WriteFile(_Call, kw_only=True):
    """``write_file``: replace the file with ``data`` (or add it at the end)."""

    id: str
    path: str
    data: bytes
    mode: int = 0o644
    append: bool = False
    # the sandbox user the call runs as (its rights, checked by the kernel); None: root
    user: str | None = None

    def __post_init__(self) -> None:
        check_file_user(self.user)
        check_id(self.id)
        check_path(self.path)
        check_mode(self.mode)


class FileRef(_Call, kw_only=True):
    """``list_dir`` and ``stat``: a path in sandbox ``id``."""

    id: str
    path: str
    # the sandbox user the call runs as (its rights, checked by the kernel); None: root
    user: str | None = None

    def __post_init__(self) -> None:
        check_file_user(self.user)
        check_id(self.id)
        check_path(self.path)


class Mkdir(_Call, kw_only=True):
    """``mkdir``: create ``path`` (and its missing parents unless ``parents`` is false)."""

    id: str
    path: str
    parents: bool = True
    # the sandbox user the call runs as (its rights, checked by the kernel); None: root
    user: str | None = None

    def __post_init__(self) -> None:
        check_file_user(self.user)
        check_id(self.id)
        check_path(self.path)


class Remove(_Call, kw_only=True):
    """``remove``: a file, an empty directory, or with ``recursive`` a whole tree."""

    id: str
    path: str
    recursive: bool = False
    # the sandbox user the call runs as (its rights, checked by the kernel); None: root
    user: str | None = None

    def __post_init__(self) -> None:
        check_file_user(self.user)
        check_id(self.id)
        check_path(self.path)


class ListRequest(_Call, kw_only=True):
    """``edge.list`` today: every match, unpaged."""

    state: SandboxState | None = None
    project: str | None = None
    labels: dict[str, str] = {}

    def __post_init__(self) -> None:
        check_label_filter(self.labels)


class FeedRequest(_Call, kw_only=True):
    after: int = 0              # sequence number of the last event already seen
    limit: int = 1000           # 1..MAX_FEED_EVENTS

    def __post_init__(self) -> None:
        if not 1 <= self.limit <= MAX_FEED_EVENTS:
            raise InvalidArgument(f"feed limit={self.limit} must be 1..{MAX_FEED_EVENTS}",
                                  field="limit")


class HeartbeatRequest(_Call, kw_only=True):
    include_sandboxes: bool = True
    #: the ``Heartbeat.images_gen`` the caller holds: an edge whose images are still
    #: that set answers ``images_same`` instead of the list (None: send the list)
    images_gen: int | None = None
    #: the page of the sandbox list: ids after ``list_after``, at most ``list_limit``
    #: (1..MAX_LIST_PAGE), in id order (Heartbeat.list_more: more follow)
    list_after: str = ""
    list_limit: int = MAX_LIST_PAGE

    def __post_init__(self) -> None:
        if not 1 <= self.list_limit <= MAX_LIST_PAGE:
            raise InvalidArgument(f"heartbeat list_limit={self.list_limit} must be "
                                  f"1..{MAX_LIST_PAGE}", field="list_limit")
        if len(self.list_after) > 256:
            raise InvalidArgument("heartbeat list_after is longer than any sandbox id "
                                  "(256 characters)", field="list_after")


# ------------------------------------------------------------------ network
class NetworkUpdate(_Call, kw_only=True):
    """``network_update``: replace sandbox ``id``'s egress policy, live and atomically
    (flows the new policy forbids are cut). ``expect_generation``: compare-and-set, a
    ``Conflict`` when the sandbox's policy generation is another (None: unconditional).
    The policy validates itself here, at every door, and travels in canonical form."""

    id: str
    policy: NetworkPolicy
    expect_generation: int | None = None

    def __post_init__(self) -> None:
        check_id(self.id)
        policy = self.policy.validate("policy")
        if policy is not self.policy:
            msgspec.structs.force_setattr(self, "policy", policy)
        g = self.expect_generation
        if g is not None and not 0 <= g <= MAX_GENERATION:
            raise InvalidArgument(f"expect_generation={g} must be within 0..{MAX_GENERATION} "
                                  "(a generation network_get gave)", field="expect_generation",
                                  limit=MAX_GENERATION)


class NetworkUpdateOnNode(NetworkUpdate, kw_only=True):
    """``edge.network_update``: the control plane adds ``ceiling_deny``, the deny
    entries of the project's network ceilings (callers never set it)."""

    ceiling_deny: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        NetworkUpdate.__post_init__(self)
        _check_ceiling_deny(self.ceiling_deny)


# ------------------------------------------------------- management plane only
class SessionOpen(_Call, kw_only=True):
    """``session_open``: a client session lease of ``lease_s`` seconds."""

    lease_s: float = 60.0


class SessionRef(_Call, kw_only=True):
    """``session_renew`` / ``session_close``."""

    id: str

    def __post_init__(self) -> None:
        check_id(self.id)


class KeyRef(_Call, kw_only=True):
    """``revoke_key``: the ``key_id`` :class:`~dsec.wire.api.CreateKeyResponse` gave."""

    id: str

    def __post_init__(self) -> None:
        check_id(self.id)


class KeyQuery(_Call, kw_only=True):
    """``keys``: the API keys of ``principal`` (``None``: the caller's own)."""

    principal: str | None = None

    def __post_init__(self) -> None:
        if self.principal is not None and not re.fullmatch(PRINCIPAL_PATTERN, self.principal):
            raise InvalidArgument(f"invalid principal {self.principal[:60]!r}: 1-128 "
                                  "lowercase letters, digits and '_.@-'", field="principal")


class NodeRef(_Call, kw_only=True):
    """``node_drain`` / ``node_undrain``: an edge node by its id (``dsec node ls``)."""

    id: str

    def __post_init__(self) -> None:
        check_id(self.id)


class ProjectRef(_Call, kw_only=True):
    """``project_get``: a project path (``team/sub``)."""

    path: str


class QuotaSet(_Call, kw_only=True):
    """``quota_set``: the quota on project ``path`` (replaces the previous one)."""

    path: str
    quota: QuotaBody


class ImageRef(_Call, kw_only=True):
    """``image_get`` / ``image_delete``: ``[project/]name[:tag]`` or a digest."""

    ref: str


class ImagePrune(_Call, kw_only=True):
    """``image_prune``: remove the layers nothing references (``dry_run``: only say
    which)."""

    dry_run: bool = False


class ImageUpload(_Call, kw_only=True):
    """``image_build`` / ``image_import``: where the uploaded layer is named; the tar
    itself streams as the request body."""

    name: str
    kind: Literal["base", "workspace", "toolkit"] = "base"
    tag: str = "latest"


# The names these types had before issue 13 (their wire form is unchanged).
CreateRequest = CreateOnNode
DestroyRequest = DestroyOnNode
SnapshotRequest = SnapshotOnNode
ReadFileRequest = ReadFile
WriteFileRequest = WriteFile
