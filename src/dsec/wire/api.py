"""Wire types of the REST API (JSON) and the Aether gateway (msgpack).

These msgspec structs are the single source of truth: request bodies are decoded with them
(strictly: an unknown field is a 400 naming the field), responses are encoded from them,
and ``/openapi.json`` is generated from them by :mod:`dsec.control.api.openapi`.
Edge records (:class:`~dsec.wire.spec.SandboxInfo`, ``SandboxEvent``, ``FileInfo``) are
re-used as they are so the edge and the API cannot drift apart.

Byte payloads: file contents travel as raw ``application/octet-stream`` bodies. Command
output in the JSON exec result is text when it is valid UTF-8 and base64 otherwise
(``encoding`` says which), so the common case costs no base64.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Final, Literal

import msgspec

from dsec.errors import InvalidArgument
from dsec.wire.spec import (
    DEFAULT_CPU_MILLI,
    DEFAULT_MEMORY_BYTES,
    DEFAULT_PIDS_MAX,
    MAX_ARG_BYTES,
    MAX_ARGV_BYTES,
    MAX_ARGV_ITEMS,
    MAX_CPU_MILLI,
    MAX_CWD_BYTES,
    MAX_DISK_BYTES,
    MAX_ENV_ITEMS,
    MAX_EXEC_TIMEOUT_S,
    MAX_HIDE_ENTRIES,
    MAX_MEMORY_BYTES,
    MAX_OUTPUT_CAP_BYTES,
    MAX_PRIORITY,
    MAX_STDIN_BYTES,
    MAX_TTL_S,
    MAX_USER_BYTES,
    MIN_PRIORITY,
    BackendName,
    FileInfo,
    IdleAction,
    Isolation,
    NetworkPolicy,
    PtySize,
    QosClass,
    SandboxEvent,
    SandboxInfo,
    SandboxState,
)

__all__ = [
    "GATEWAY_PROTOCOL",
    "MAX_ARGV_BYTES",
    "MAX_QUOTA",
    "MAX_STDIN_BYTES",
    "PRINCIPAL_PATTERN",
    "PROJECT_PATTERN",
    "ROLE_RANK",
    "SNAPSHOT_PATTERN",
    "ApiError",
    "CreateKeyRequest",
    "CreateKeyResponse",
    "CreateSandboxRequest",
    "Encoding",
    "EventList",
    "ExecBody",
    "ExecCallBody",
    "ExecManyBody",
    "ExecOutput",
    "ExecStreamLine",
    "FileList",
    "ImageList",
    "ImagePinList",
    "ImagePinView",
    "ImagePromoteRequest",
    "ImagePruned",
    "ImagePullRequest",
    "ImagePushRequest",
    "ImagePushed",
    "ImageTagRequest",
    "ImageView",
    "Info",
    "KeyList",
    "KeyView",
    "NodeList",
    "NodeView",
    "ProjectList",
    "ProjectView",
    "PushedLayerView",
    "QuotaBody",
    "Role",
    "SandboxList",
    "SessionView",
    "SnapshotList",
    "SnapshotView",
    "TierQuota",
    "role_on",
]

Encoding = Literal["utf-8", "base64"]
#: An IAM role a principal holds on a project (and so on every project under it).
Role = Literal["admin", "member", "reader"]
#: How strong each role is: a role allows everything a weaker one does.
ROLE_RANK: Final[Mapping[Role, int]] = {"reader": 1, "member": 2, "admin": 3}


def role_on(roles: Mapping[str, Role], project: str, *, superuser: bool = False) -> Role | None:
    """The strongest role held on ``project`` or any of its ancestors (roles inherit
    downward): ``roles`` maps a project path to the role bound there; a superuser is an
    admin everywhere. None: no role there, the project is not the caller's to see. The
    one implementation the apiserver's callers and IAM both use."""
    if superuser:
        return "admin"
    best: Role | None = None
    end = -1
    while True:
        end = project.find("/", end + 1)
        r = roles.get(project if end < 0 else project[:end])
        if r is not None and (best is None or ROLE_RANK[r] > ROLE_RANK[best]):
            best = r
        if end < 0:
            return best

# The exec limits live with ExecRequest (dsec.wire.spec), which every door validates
# with; re-exported here for callers of the API types. In the schema below they appear
# as ``extra_json_schema`` only, so the one validator (and its messages) stays the rule.


def _doc(**schema: object) -> msgspec.Meta:
    """A limit documented in the OpenAPI schema, enforced by the shared validators."""
    return msgspec.Meta(extra_json_schema=schema)


ArgStr = Annotated[str, _doc(maxLength=MAX_ARG_BYTES,
                             description="at most MAX_ARG_BYTES UTF-8 bytes, no NUL")]

# Identifier patterns the server enforces (dsec.ids, dsec.control.iam), for the schema.
_PART = r"[a-z0-9][a-z0-9_.-]{0,62}"
PROJECT_PATTERN = rf"^{_PART}(?:/{_PART}){{0,15}}$"
SNAPSHOT_PATTERN = r"^sha256:[0-9a-f]{12,64}$"
PRINCIPAL_PATTERN = r"^[a-z0-9][a-z0-9_.@-]{0,127}$"
PIDS_MAX_CEILING = 16_384     # ApiConfig.pids_max_ceiling's default

Project = Annotated[str, _doc(pattern=PROJECT_PATTERN)]


# Bounded ints: a JSON number beyond 64 bits would otherwise pass decoding and fail later
# when the body is re-encoded as msgpack for the edge (found by the schemathesis test).
# Fields with tighter server bounds (cpu_milli, memory_bytes, ...) are checked by
# SandboxSpec.validate before anything is encoded, and only documented below.
I32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    pass


class ApiError(msgspec.Struct, kw_only=True):
    """Every error response: a stable machine ``code`` (from ``dsec.errors``), a message
    that says what happened and what to change, and the request id to quote in reports."""

    code: str
    message: str
    request_id: str
    detail: dict[str, str | int | float | bool | None] = {}


def _int(lo: int, hi: int) -> msgspec.Meta:
    """An int the server checks to be within lo..hi (SandboxSpec.validate, with its own
    message, before anything is encoded for the edge), documented as such. No decode
    constraint: msgspec's ge/le would override the schema and word the error apart."""
    return _doc(minimum=lo, maximum=hi)


# Seconds the server wants in (0, MAX_TTL_S] (SandboxSpec.validate).
PositiveSeconds = Annotated[float, _doc(exclusiveMinimum=0, maximum=MAX_TTL_S)]


class CreateSandboxRequest(_Strict):
    """Body of ``POST /v1/sandboxes``. Units are in the names; ``null`` means none.
    The bounds in the schema are what the server checks (SandboxSpec.validate and the
    apiserver's pids_max ceiling, 16,384 by default; ``null`` only where it is off)."""

    image: Annotated[str, _doc(minLength=1)] = "base"
    workspace: str | None = None
    toolkits: list[str] = []
    snapshot: Annotated[str, _doc(pattern=SNAPSHOT_PATTERN)] | None = None
    backend: BackendName | None = None   # default: the server's default backend
    # isolation tier (docs/isolation.md): picks the backend when backend is null; with
    # both, they must agree. null: the backend's tier
    isolation: Isolation | None = None
    cpu_milli: Annotated[int, _int(1, MAX_CPU_MILLI)] = DEFAULT_CPU_MILLI
    memory_bytes: Annotated[int, _int(1 << 20, MAX_MEMORY_BYTES)] = DEFAULT_MEMORY_BYTES
    disk_bytes: Annotated[int, _int(1 << 20, MAX_DISK_BYTES)] | None = None
    pids_max: Annotated[int, _int(1, PIDS_MAX_CEILING)] | None = DEFAULT_PIDS_MAX
    priority: Annotated[int, _int(MIN_PRIORITY, MAX_PRIORITY)] = 0
    labels: Annotated[dict[str, Annotated[str, _doc(maxLength=1024)]], _doc(
        propertyNames={"minLength": 1, "maxLength": 253})] = {}
    project: Project | None = None      # default: the key's default project
    # default: the server's default TTL (6 h)
    ttl_s: PositiveSeconds | None = None
    ttl_action: IdleAction = "destroy"  # "pause": the TTL pauses instead (E2B's autoPause)
    idle_timeout_s: PositiveSeconds | None = None
    idle_action: IdleAction = "destroy"
    env: Annotated[dict[str, str], _doc(propertyNames={"pattern": "^[^=\\x00]+$"})] = {}
    network: NetworkPolicy | None = None   # default: the server's --net-default ("none")
    allow_nested: bool = False
    user_namespace: bool = False        # root inside = unprivileged uid on the host
    cwd: str | None = None              # every exec's default (default: the image's)
    user: str | None = None             # every exec's default user (default: the image's)
    # an image build step's cache key (dsec.image.build.step_key); see docs/images.md
    build_step: Annotated[str, _doc(pattern="^[0-9a-f]{64}$")] | None = None
    # QoS class (docs/container.md "QoS classes"); null: "ls" unless the project's quota
    # says qos_ls=false, then "be"
    qos: QosClass | None = None
    cpu_quota_milli: Annotated[int, _int(1, MAX_CPU_MILLI)] | None = None
    session: str | None = None          # client session lease; see docs/api.md "Sweeper"


class SandboxList(msgspec.Struct, kw_only=True):
    items: list[SandboxInfo]
    next_cursor: str | None = None


class ExecBody(_Strict):
    """Body of ``POST /v1/sandboxes/{id}/exec``: exactly one of ``argv`` / ``shell``.
    argv (or shell) and env together: at most 1 MiB of UTF-8 (``MAX_ARGV_BYTES``)."""

    argv: Annotated[list[ArgStr], _doc(minItems=1, maxItems=MAX_ARGV_ITEMS)] | None = None
    shell: ArgStr | None = None
    env: Annotated[dict[str, str], _doc(maxProperties=MAX_ENV_ITEMS)] = {}
    cwd: Annotated[str, _doc(minLength=1, maxLength=MAX_CWD_BYTES)] | None = None
    user: Annotated[str, _doc(minLength=1, maxLength=MAX_USER_BYTES)] | None = None
    stdin: str = ""                     # at most MAX_STDIN_BYTES once decoded
    stdin_encoding: Encoding = "utf-8"
    # the *command* timeout (kills the process group)
    timeout_s: Annotated[float, _doc(exclusiveMinimum=0, maximum=MAX_EXEC_TIMEOUT_S)] | \
        None = 60.0
    output_cap_bytes: Annotated[int, _doc(minimum=0, maximum=MAX_OUTPUT_CAP_BYTES)] = 1 << 20
    background: bool = False
    # top-level entries of the sandbox root the command's tree can never reach (Landlock);
    # ExecRequest.hide. Carried here so the REST door cannot drop the protection silently.
    hide: Annotated[list[str], _doc(maxItems=MAX_HIDE_ENTRIES)] = []
    # processes (issue 19; process_start takes them, plain exec refuses them)
    pty: PtySize | None = None
    stdin_open: bool = False
    tag: str | None = None


class ExecOutput(msgspec.Struct, kw_only=True):
    """A finished command. ``timed_out``: the command timeout fired and the process
    group was killed (this is a result, not an error)."""

    exit_code: int
    stdout: str = ""
    stderr: str = ""
    encoding: Encoding = "utf-8"
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    duration_s: float = 0.0
    pid: int | None = None
    oom_killed: bool = False        # issue 19: the OOM killer struck while it ran


class ExecCallBody(_Strict):
    """One item of ``POST /v1/batch/exec``: sandbox ``id`` and its command in the exec
    JSON form (:class:`ExecBody`, as ``POST .../exec`` takes it). Documents the
    catalogue's ``ExecCall`` (dsec.wire.calls) as REST carries it."""

    id: str
    req: ExecBody


class ExecManyBody(_Strict):
    """Body of ``POST /v1/batch/exec``; each item answers as ``POST .../exec`` does
    (:class:`ExecOutput`)."""

    calls: list[ExecCallBody]


class ExecStreamLine(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One NDJSON line of ``POST /v1/sandboxes/{id}/exec/stream``: output chunks
    (``stream`` + ``data``), then exactly one line with ``exit_code`` (or ``error``)."""

    stream: Literal["stdout", "stderr"] | None = None
    data: str | None = None
    encoding: Encoding = "utf-8"
    exit_code: int | None = None
    timed_out: bool = False
    duration_s: float | None = None
    error: ApiError | None = None
    oom_killed: bool = False        # on the exit_code line (issue 19)


class EventList(msgspec.Struct, kw_only=True):
    items: list[SandboxEvent]


class FileList(msgspec.Struct, kw_only=True):
    items: list[FileInfo]


class SnapshotView(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A pack_diff snapshot. ``id`` (``sha256:<hex>``) goes into ``create(snapshot=)``;
    ``nodes`` are the edges that hold it (a sandbox from it is placed on one of them);
    ``unchanged``: nothing changed since the previous snapshot, which this is."""

    id: str
    sandbox_id: str = ""
    node: str = ""
    nodes: list[str] = []
    project: str = ""
    parent: str | None = None
    image: str = ""
    workspace: str | None = None
    toolkits: list[str] = []
    backend: str = ""
    size_bytes: int = 0
    created_at: float = 0.0
    unchanged: bool = False
    # the image build step this layer records (dsec.image.build's cache key), if any
    build_step: str = ""
    # the image layers the chain applies to, highest first (with ``parent``: what the
    # sandbox ran on; a build checks both on a cached step)
    stack: list[str] = []


class SnapshotList(msgspec.Struct, kw_only=True):
    items: list[SnapshotView]


class ImageView(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A layer in the cluster's layer store, as the calling key may see it.

    ``ref``: its first name visible to the key (``[project/]name:tag``), else its digest;
    ``refs``: every name visible to the key that points at it. ``namespace``: the project
    the layer belongs to, ``null`` for a cluster-wide layer (written by a superuser only);
    ``owner``: who built it (an API principal, or ``host:<user>`` for ``dsec image`` on
    the host), ``null`` when not recorded (snapshots, older layers)."""

    ref: str
    namespace: str | None          # always present: null = cluster-wide
    owner: str | None              # always present: null = not recorded
    refs: list[str] = []
    digest: str = ""
    kind: str = ""
    size_bytes: int = 0
    created_at: float = 0.0
    labels: dict[str, str] = {}
    # Special files left out of the tree by the one rule (docs/images.md, "Special
    # files"): {"devices": n, "sockets": m}, absent when none.
    skipped: dict[str, int] = {}


class ImageTagRequest(_Strict):
    """Body of ``POST /v1/images/tag``: point name ``target`` at the layer ``source``
    names. ``target`` is ``[project/]name[:tag]`` (bare: cluster-wide, superuser only)."""

    source: Annotated[str, msgspec.Meta(min_length=1, max_length=1200)]
    target: Annotated[str, msgspec.Meta(min_length=1, max_length=1200)]


class ImagePullRequest(_Strict):
    """Body of ``POST /v1/images/pull``: pull the registry image ``ref``
    (``host[:port]/repo[:tag|@sha256:...]``) into the layer store, named ``name``
    (``[project/]name[:tag]``) or, without one, by its registry ref
    (``<project>/<host-port_repo>:<tag>``; ``project`` None: cluster-wide, superuser only).
    ``platform`` (``os/arch[/variant]``) picks from an image index (default: the node's);
    ``insecure`` allows plain HTTP; ``creds`` is ``user:password`` for the registry (never
    stored or echoed)."""

    ref: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=1200)] | None = None
    project: Annotated[str, msgspec.Meta(min_length=1, max_length=1100)] | None = None
    platform: Annotated[str, msgspec.Meta(min_length=3, max_length=100)] | None = None
    insecure: bool = False
    creds: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)] | None = None
class ImagePromoteRequest(_Strict):
    """Body of ``POST /v1/images/promote``: name a built image. ``top``: the build's top
    snapshot (its step layers, one chain), ``base``: the image the build started from
    (its digest or a name), ``target``: ``[project/]name[:tag]`` in the project the build
    ran in; the image config (as an OCI config's Env, WorkingDir, User, Entrypoint, Cmd,
    Labels) becomes the image's, honoured by every create as a pulled image's.
    ``squash``: flatten the base in too (one standalone layer)."""

    top: Annotated[str, msgspec.Meta(min_length=1, max_length=1200)]
    base: Annotated[str, msgspec.Meta(min_length=1, max_length=1200)]
    target: Annotated[str, msgspec.Meta(min_length=1, max_length=1200)]
    env: Annotated[dict[str, str], msgspec.Meta(max_length=4096)] = {}
    workdir: Annotated[str, msgspec.Meta(max_length=4096)] | None = None
    user: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    entrypoint: Annotated[list[str], msgspec.Meta(max_length=4096)] = []
    cmd: Annotated[list[str], msgspec.Meta(max_length=4096)] = []
    labels: Annotated[dict[str, str], msgspec.Meta(max_length=256)] = {}
    # True: the whole image (base layers and steps) flattened into one standalone layer
    # (a template as Modal/E2B keep them: one layer, nothing shared); False (default):
    # the steps as one layer over the base's own layers, which stay shared on disk and
    # in every node's mount cache with every other image on that base
    squash: bool = False


class ImagePushRequest(_Strict):
    """Body of ``POST /v1/images/push``: push the image ``ref`` (its layer and every layer
    below it, each with its chunk table and manifest) to the apiserver's blob store - the
    one its operator configured (``--blob-store``); a caller never names a store URL.
    ``verify``: read back layers the store already has and check every chunk."""

    ref: Annotated[str, msgspec.Meta(min_length=1, max_length=1200)]
    verify: bool = False


class PushedLayerView(msgspec.Struct, kw_only=True):
    digest: str
    size_bytes: int
    chunk_size: int
    uploaded: bool                     # False: the store already had it whole


class ImagePushed(msgspec.Struct, kw_only=True):
    """What ``image_push`` published: the layers lowest first, what went up."""

    ref: str
    digest: str
    store: str                         # the blob store's URL (no credentials in it)
    layers: list[PushedLayerView]
    bytes_uploaded: int
    seconds: float


class ImagePinView(msgspec.Struct, kw_only=True):
    node: str
    image: str                         # the image's (top layer's) digest
    ref: str                           # as the operator named it
    layers: list[str]                  # every layer of it, lowest first
    pinned_at: float
    by: str                            # the principal id that pinned it


class ImagePinList(msgspec.Struct, kw_only=True):
    items: list[ImagePinView]


class ImageList(msgspec.Struct, kw_only=True):
    items: list[ImageView]


class ImagePruned(msgspec.Struct, kw_only=True):
    """What ``image_prune`` removed (or, ``dry_run``, would): the layers' digests, kinds,
    namespaces and sizes, and what the store keeps."""

    removed: list[ImageView]
    freed_bytes: int
    kept_layers: int
    kept_bytes: int
    dry_run: bool = False


class NodeView(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    address: str = ""
    healthy: bool = True
    # healthy | unreachable (the apiserver failed to use its link, or the node answers
    # with errors: held, sandboxes kept) | silent (no answer; lost after the node TTL) |
    # lost (expired: its sandboxes were evicted) | revoked (a joined node revoked from the
    # cluster: its sandboxes were written off); problem says what happened.
    status: str = "healthy"
    problem: str = ""
    backends: list[str] = []
    cpu_milli_total: int = 0
    cpu_milli_used: int = 0
    memory_bytes_total: int = 0
    memory_bytes_used: int = 0
    max_sandboxes: int = 0
    sandboxes: int = 0
    by_state: dict[str, int] = {}
    labels: dict[str, str] = {}
    last_heartbeat: float = 0.0
    # drained by an administrator (``dsec node drain``): no new placements; the
    # sandboxes it holds run until they end
    drained: bool = False
    drained_at: float = 0.0


class NodeList(msgspec.Struct, kw_only=True):
    items: list[NodeView]


# A quota is a non-negative 64-bit int: every door (msgpack over Aether) carries it. One
# beyond 2**63 - 1, once stored, made every Aether read of the project fail.
MAX_QUOTA = 2**63 - 1
NonNegative = Annotated[int, _doc(minimum=0, maximum=MAX_QUOTA)]


class TierQuota(_Strict):
    """Limits on one isolation tier's sandboxes in a project subtree (``null``: none);
    ``max_sandboxes: 0`` forbids the tier (e.g. no microVMs for a project)."""

    max_sandboxes: NonNegative | None = None
    cpu_milli: NonNegative | None = None
    memory_bytes: NonNegative | None = None

    def __post_init__(self) -> None:
        for name in ("max_sandboxes", "cpu_milli", "memory_bytes"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_QUOTA:
                raise InvalidArgument(f"tier quota {name}={str(v)[:40]} is out of range: use "
                                      f"0..{MAX_QUOTA} or null (no limit)", field=name,
                                      limit=MAX_QUOTA)


class QuotaBody(_Strict):
    """A quota on a project (and, through the tree, on its descendants). ``null`` = none.
    ``network``: the project's network ceiling, the most open egress policy its sandboxes
    (and its subprojects') may ask for; its ``deny`` entries are added to every policy
    under it. Set, like the rest, by an admin of the parent project."""

    max_sandboxes: NonNegative | None = None
    cpu_milli: NonNegative | None = None
    memory_bytes: NonNegative | None = None
    snapshot_bytes: NonNegative | None = None   # stored bytes of the subtree's snapshots
    # bytes of the layers the subtree's image names reach, shared layers counted fully
    # (docs/images.md, "Per-project storage"); checked whenever a name is set
    image_bytes: NonNegative | None = None
    network: NetworkPolicy | None = None
    # May a create naming a registry image (``image="reg.example.com/app:1"``) pull it
    # on first use? ``null``: as the nearest ancestor says; nowhere said: yes (the
    # creator is a member, who may pull with images.pull anyway; docs/images.md).
    registry_pull: bool | None = None
    # May the subtree's sandboxes be latency-sensitive (qos "ls")? ``false``: only
    # best-effort ("be"; a create naming no class gets it, one asking "ls" is refused).
    # ``null``: as the nearest ancestor says; nowhere said: yes (docs/container.md).
    qos_ls: bool | None = None
    # Per isolation tier (issue 21): the tier's sandboxes in the subtree, whatever backend
    # runs them; e.g. {"vm": {"max_sandboxes": 0}} forbids microVMs (docs/isolation.md)
    tiers: dict[Isolation, TierQuota] = {}

    def __post_init__(self) -> None:
        for name in _QUOTA_COUNTS:
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_QUOTA:
                raise InvalidArgument(f"quota {name}={str(v)[:40]} is out of range: use "
                                      f"0..{MAX_QUOTA} or null (no limit)", field=name,
                                      limit=MAX_QUOTA)
        if self.network is not None:   # validated at every door, stored canonical
            self.network = self.network.validate("quota.network")

    @classmethod
    def clamped(cls, *, network: NetworkPolicy | None = None,
                registry_pull: bool | None = None, qos_ls: bool | None = None,
                tiers: Mapping[Isolation, TierQuota] | None = None,
                **counts: int | None) -> QuotaBody:
        """A quota read back from storage, each count clamped into 0..MAX_QUOTA: an
        out-of-range value an older release stored (it checked no bound) reads as the
        nearest value every door can carry, instead of failing the project's readers."""
        return cls(network=network, registry_pull=registry_pull, qos_ls=qos_ls,
                   tiers=dict(tiers or {}), **{k: None if v is None else min(max(v, 0), MAX_QUOTA)
                      for k, v in counts.items()})


_QUOTA_COUNTS = ("max_sandboxes", "cpu_milli", "memory_bytes", "snapshot_bytes",
                 "image_bytes")


class ProjectView(msgspec.Struct, kw_only=True, omit_defaults=True):
    path: str
    quota: QuotaBody | None = None
    usage: dict[str, int] = {}


class ProjectList(msgspec.Struct, kw_only=True):
    items: list[ProjectView]


class CreateKeyRequest(_Strict):
    """``existing``: the caller (a superuser) means to grant ``role`` on ``project`` to a
    principal that already exists, and every key that principal already has gains it.
    Without it, naming an existing principal is a ``409``: principal ids are one
    cluster-wide namespace that project admins create names in, so an unasked-for grant
    could land on a name a tenant pre-created and holds keys for."""

    name: Annotated[str, _doc(pattern=PRINCIPAL_PATTERN)]
    project: Project
    role: Role = "member"
    existing: bool = False


class CreateKeyResponse(msgspec.Struct, kw_only=True):
    """``api_key`` is shown exactly once; only its hash is stored. ``key_id`` names the
    key for ``DELETE /v1/keys/{key_id}``."""

    name: str
    project: str
    role: Role
    api_key: str
    key_id: str = ""


class KeyView(msgspec.Struct, kw_only=True):
    """An API key as ``keys`` lists it: its id (the 16 hex digits after ``dsk_``), whose
    it is, when it was made and whether it is revoked. Never the secret (only its hash
    is stored)."""

    key_id: str
    principal: str
    created_at: float = 0.0
    revoked: bool = False


class KeyList(msgspec.Struct, kw_only=True):
    items: list[KeyView] = []


class SessionView(msgspec.Struct, kw_only=True):
    """A client session lease: sandboxes created with ``session`` are destroyed by the
    sweeper once the lease has not been renewed for ``lease_s`` seconds."""

    id: str
    lease_s: float
    expires_at: float


#: The version of the apiserver's Aether gateway methods and bodies (the ``api.<op>``
#: rows of :mod:`dsec.wire.ops`), advertised as ``Info.gateway_protocol``: an SDK that
#: speaks another one uses REST instead. 1: before issue 13 (the API key in every body,
#: per-op structs); 2: the catalogue (key once per connection, the rows' request types).
GATEWAY_PROTOCOL: Final = 2


class Info(msgspec.Struct, kw_only=True, omit_defaults=True):
    version: str
    gateway: str | None = None           # Aether gateway address for the SDK fast path
    gateway_protocol: int | None = None  # GATEWAY_PROTOCOL of that gateway
    principal: str | None = None
    project: str | None = None
    role: Role | None = None
    default_ttl_s: float | None = None
    default_backend: str | None = None


StateFilter = SandboxState
