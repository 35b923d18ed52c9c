"""Wire types of the REST API (JSON) and the Aether gateway (msgpack).

These msgspec structs are the single source of truth: request bodies are decoded with them
(strictly: an unknown field is a 400 naming the field), responses are encoded from them,
and ``/openapi.json`` is generated from them by :mod:`dsec.control.api.openapi`.
Edge records (:class:`~dsec.edge.spec.SandboxInfo`, ``SandboxEvent``, ``FileInfo``) are
re-used as they are so the edge and the API cannot drift apart.

Byte payloads: file contents travel as raw ``application/octet-stream`` bodies. Command
output in the JSON exec result is text when it is valid UTF-8 and base64 otherwise
(``encoding`` says which), so the common case costs no base64.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from dsec.edge.spec import (
    BackendName,
    FileInfo,
    IdleAction,
    NetworkPolicy,
    SandboxEvent,
    SandboxInfo,
    SandboxState,
)

__all__ = [
    "MAX_ARGV_BYTES",
    "MAX_STDIN_BYTES",
    "ApiError",
    "CreateKeyRequest",
    "CreateKeyResponse",
    "CreateSandboxRequest",
    "Encoding",
    "EventList",
    "ExecBody",
    "ExecOutput",
    "ExecStreamLine",
    "FileList",
    "ImageList",
    "ImageTagRequest",
    "ImageView",
    "Info",
    "NodeList",
    "NodeView",
    "ProjectList",
    "ProjectView",
    "QuotaBody",
    "SandboxList",
    "SessionView",
    "SnapshotList",
    "SnapshotView",
]

Encoding = Literal["utf-8", "base64"]
Role = Literal["admin", "member", "reader"]

# Linux refuses an execve whose argv+envp exceed ARG_MAX (2 MiB with the default 8 MiB
# stack); we refuse earlier with a clear 400 instead of an opaque E2BIG from the edge.
MAX_ARGV_BYTES = 1 << 20
MAX_STDIN_BYTES = 8 << 20


# Bounded ints: a JSON number beyond 64 bits would otherwise pass decoding and fail later
# when the body is re-encoded as msgpack for the edge (found by the schemathesis test).
I32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]
U63 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=10**9)]


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    pass


class ApiError(msgspec.Struct, kw_only=True):
    """Every error response: a stable machine ``code`` (from ``dsec.errors``), a message
    that says what happened and what to change, and the request id to quote in reports."""

    code: str
    message: str
    request_id: str
    detail: dict[str, str | int | float | bool | None] = {}


class CreateSandboxRequest(_Strict):
    """Body of ``POST /v1/sandboxes``. Units are in the names; ``null`` means none."""

    image: str = "base"
    workspace: str | None = None
    toolkits: list[str] = []
    snapshot: str | None = None
    backend: BackendName | None = None   # default: the server's default backend
    cpu_milli: U63 = 1000
    memory_bytes: U63 = 512 * 2**20
    disk_bytes: U63 | None = None
    pids_max: U63 | None = 1024
    priority: I32 = 0
    labels: dict[str, str] = {}
    project: str | None = None          # default: the key's default project
    ttl_s: Seconds | None = None        # default: the server's default TTL (6 h)
    idle_timeout_s: Seconds | None = None
    idle_action: IdleAction = "destroy"
    env: dict[str, str] = {}
    network: NetworkPolicy = NetworkPolicy()
    allow_nested: bool = False
    user_namespace: bool = False        # root inside = unprivileged uid on the host
    session: str | None = None          # client session lease; see docs/api.md "Sweeper"


class SandboxList(msgspec.Struct, kw_only=True):
    items: list[SandboxInfo]
    next_cursor: str | None = None


class ExecBody(_Strict):
    """Body of ``POST /v1/sandboxes/{id}/exec``: exactly one of ``argv`` / ``shell``."""

    argv: list[str] | None = None
    shell: str | None = None
    env: dict[str, str] = {}
    cwd: str | None = None
    user: str | None = None
    stdin: str = ""
    stdin_encoding: Encoding = "utf-8"
    timeout_s: Seconds | None = 60.0    # the *command* timeout (kills the process group)
    output_cap_bytes: U63 = 1 << 20
    background: bool = False


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


class ImageTagRequest(_Strict):
    """Body of ``POST /v1/images/tag``: point name ``target`` at the layer ``source``
    names. ``target`` is ``[project/]name[:tag]`` (bare: cluster-wide, superuser only)."""

    source: Annotated[str, msgspec.Meta(min_length=1, max_length=1200)]
    target: Annotated[str, msgspec.Meta(min_length=1, max_length=1200)]


class ImageList(msgspec.Struct, kw_only=True):
    items: list[ImageView]


class NodeView(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    address: str = ""
    healthy: bool = True
    # healthy | unreachable (the apiserver failed to use its link, or the node answers
    # with errors: held, sandboxes kept) | silent (no answer; lost after the node TTL) |
    # lost (expired: its sandboxes were evicted); problem says what happened.
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


class NodeList(msgspec.Struct, kw_only=True):
    items: list[NodeView]


class QuotaBody(_Strict):
    """A quota on a project (and, through the tree, on its descendants). ``null`` = none."""

    max_sandboxes: int | None = None
    cpu_milli: int | None = None
    memory_bytes: int | None = None
    snapshot_bytes: int | None = None      # stored bytes of the subtree's snapshots


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

    name: str
    project: str
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


class SessionView(msgspec.Struct, kw_only=True):
    """A client session lease: sandboxes created with ``session`` are destroyed by the
    sweeper once the lease has not been renewed for ``lease_s`` seconds."""

    id: str
    lease_s: float
    expires_at: float


class Info(msgspec.Struct, kw_only=True, omit_defaults=True):
    version: str
    gateway: str | None = None           # Aether gateway address for the SDK fast path
    principal: str | None = None
    project: str | None = None
    role: Role | None = None
    default_ttl_s: float | None = None
    default_backend: str | None = None


StateFilter = SandboxState
