"""The operation catalogue: one row per operation, every door built from it.

A row (:class:`Op`) says what an operation is once: its name, its request and reply
types, the least role it needs on the target's project, whether repeating it is safe,
which doors serve it (the edge's Aether router, the apiserver's Aether gateway, REST)
and, for REST, its method, path and how the request maps onto path, query, headers and
body (:class:`Rest`). The doors, the OpenAPI document, the SDK transports and the docs
read the rows instead of spelling each operation out again; ``docs/host-security.md`` is
the recipe for adding one.

Where the edge's request or reply differs from the API's, the row says so
(``edge_request``/``edge_reply``): the control plane adds fields a caller must never set
(the id it chose for a sandbox, the destroy reason, the snapshot room left in the
quota), answers from its own registry (``list``: the API pages, the edge answers every
match) or merges what several edges hold (snapshots: the edge's ``SnapshotInfo``, the
API's ``SnapshotView`` with every holding node).

Pure data: no I/O. A row's type arguments are written on its annotation
(``EXEC: Op[ExecCall, ExecResult]``) so mypy knows what ``call(EXEC, body)`` returns;
``tests/wire/test_ops.py`` checks each annotation against the row it describes.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Final, Generic, Literal, TypeVar

from dsec.wire.api import (
    CreateKeyRequest,
    CreateKeyResponse,
    EventList,
    FileList,
    ImageList,
    ImagePinList,
    ImagePinView,
    ImagePromoteRequest,
    ImagePruned,
    ImagePullRequest,
    ImagePushed,
    ImagePushRequest,
    ImageTagRequest,
    ImageView,
    Info,
    KeyList,
    NodeList,
    NodeView,
    ProjectList,
    ProjectView,
    Role,
    SandboxList,
    SessionView,
    SnapshotList,
    SnapshotView,
)
from dsec.wire.calls import (
    CreateMany,
    CreateManyOnNode,
    CreateOnNode,
    CreateSandbox,
    DestroyMany,
    DestroyOnNode,
    Empty,
    ExecCall,
    ExecMany,
    FeedRequest,
    FileRef,
    HeartbeatRequest,
    ImagePrune,
    ImageRef,
    ImageUpload,
    KeyQuery,
    KeyRef,
    ListRequest,
    ListSandboxes,
    Mkdir,
    NetworkUpdate,
    NetworkUpdateOnNode,
    NodeRef,
    ProjectRef,
    QuotaSet,
    ReadFile,
    Remove,
    ResumeOnNode,
    SandboxRef,
    SessionOpen,
    SessionRef,
    SnapshotCall,
    SnapshotOnNode,
    SnapshotQuery,
    SnapshotRef,
    WriteFile,
)
from dsec.wire.cluster import (
    JoinedNodeList,
    JoinTokenCreate,
    JoinTokenList,
    JoinTokenRevoke,
    JoinTokenView,
    NodeMigration,
)
from dsec.wire.files import FileEvent, ReadStream, Rename, Watch, WatchEnd, WriteStream
from dsec.wire.layers import (
    ImagePin,
    ImagePinRef,
    LayerChain,
    LayerFetch,
    LayerFetched,
    LayerGrant,
    LayerGranted,
    LayerPut,
    LayerRef,
    LayerStored,
    NodePins,
    PinSet,
)
from dsec.wire.lifetime import SetTimeout
from dsec.wire.node import EventFeed, Heartbeat, NodeInfo
from dsec.wire.outcome import Batch
from dsec.wire.ports import (
    ExposedPort,
    ExposedPortList,
    PortConnect,
    PortExpose,
    PortRecord,
    PortRecordList,
    PortRef,
)
from dsec.wire.process import (
    ProcessInfo,
    ProcessInput,
    ProcessList,
    ProcessRef,
    ProcessRunItem,
    ProcessSignal,
    PtyResize,
)
from dsec.wire.spec import (
    ExecChunk,
    ExecRequest,
    ExecResult,
    FileInfo,
    NetworkView,
    PauseStats,
    SandboxInfo,
    SandboxStats,
    SnapshotInfo,
)

__all__ = [
    "ALL_DOORS",
    "ALL_OPS",
    "API_DOORS",
    "BY_NAME",
    "CLUSTER_NODES",
    "CLUSTER_NODE_REVOKE",
    "CLUSTER_TOKENS",
    "CLUSTER_TOKEN_CREATE",
    "CLUSTER_TOKEN_REVOKE",
    "CREATE",
    "CREATE_KEY",
    "CREATE_MANY",
    "DESTROY",
    "DESTROY_MANY",
    "EDGE_OPS",
    "EVENTS",
    "EXEC",
    "EXEC_DEADLINE_MARGIN_S",
    "EXEC_MANY",
    "EXEC_STREAM",
    "FEED",
    "FILE_READ_STREAM",
    "FILE_RENAME",
    "FILE_WATCH",
    "FILE_WRITE_STREAM",
    "GATEWAY_OPS",
    "GET",
    "HEARTBEAT",
    "IMAGES",
    "IMAGE_BUILD",
    "IMAGE_DELETE",
    "IMAGE_GET",
    "IMAGE_IMPORT",
    "IMAGE_PIN",
    "IMAGE_PINS",
    "IMAGE_PROMOTE",
    "IMAGE_PUSH",
    "IMAGE_TAG",
    "IMAGE_UNPIN",
    "INFO",
    "KEYS",
    "LAYER_CHAIN",
    "LAYER_FETCH",
    "LAYER_GET",
    "LAYER_GRANT",
    "LAYER_PUT",
    "LIST",
    "LIST_DIR",
    "MKDIR",
    "NETWORK_GET",
    "NETWORK_UPDATE",
    "NODES",
    "NODE_DRAIN",
    "NODE_INFO",
    "NODE_MIGRATE",
    "NODE_PINS",
    "NODE_UNDRAIN",
    "PAUSE",
    "PORT_CLOSE",
    "PORT_CONNECT",
    "PORT_EXPOSE",
    "PORT_LIST",
    "PROCESS_CLOSE_STDIN",
    "PROCESS_CONNECT",
    "PROCESS_INPUT",
    "PROCESS_LIST",
    "PROCESS_RUN",
    "PROCESS_SIGNAL",
    "PROCESS_START",
    "PROJECTS",
    "PROJECT_GET",
    "PTY_RESIZE",
    "QUOTA_SET",
    "READ_FILE",
    "REMOVE",
    "REST_OPS",
    "RESUME",
    "REVOKE_KEY",
    "SESSION_CLOSE",
    "SESSION_OPEN",
    "SESSION_RENEW",
    "SET_TIMEOUT",
    "SNAPSHOT",
    "SNAPSHOTS",
    "SNAPSHOT_DELETE",
    "SNAPSHOT_GET",
    "STAT",
    "STATS",
    "USE_CLIENT_DEFAULT",
    "WRITE_FILE",
    "Deadline",
    "Door",
    "Op",
    "Rest",
    "StreamOp",
    "Target",
    "TunnelOp",
    "UploadOp",
    "UseClientDefault",
    "exec_deadline",
    "path_params",
]

Req = TypeVar("Req")
Rep = TypeVar("Rep")
Item = TypeVar("Item")

Door = Literal["edge", "gateway", "rest"]
ALL_DOORS: Final[frozenset[Door]] = frozenset({"edge", "gateway", "rest"})
API_DOORS: Final[frozenset[Door]] = frozenset({"gateway", "rest"})
_EDGE: Final[frozenset[Door]] = frozenset({"edge"})
_REST: Final[frozenset[Door]] = frozenset({"rest"})

Target = Literal["sandbox", "snapshot", "project", "node", "cluster", "self"]
"""What a request names, and so where the apiserver checks ``role``:

- ``sandbox``: the request has ``id`` (a sandbox id); routed to the id's edge, ``role``
  checked on the sandbox's project.
- ``snapshot``: the request has ``id`` (a snapshot ref); visibility from its project.
- ``project``: the request names a project (or none: the key's default project).
- ``node``: an edge's own operation, called by the control plane only.
- ``cluster``: any authenticated caller.
- ``self``: the caller's own sessions and keys.
"""


class UseClientDefault(enum.Enum):
    """A call's timeout left unsaid: the client's configured request timeout applies."""

    TOKEN = 0


USE_CLIENT_DEFAULT: Final = UseClientDefault.TOKEN
Deadline = float | None | UseClientDefault
"""A request deadline in seconds; None waits forever; USE_CLIENT_DEFAULT: the client's."""

# How much longer than a command's own timeout a caller waits for its answer (the edge
# kills the process group at the timeout and reaps it before answering).
EXEC_DEADLINE_MARGIN_S = 30.0


def exec_deadline(req: ExecRequest) -> float | None:
    """How long to wait for an exec's answer: the command timeout plus a margin (None: no
    command timeout, so no deadline either). A link's default request deadline would
    otherwise cut off any command running longer."""
    if req.background:
        return EXEC_DEADLINE_MARGIN_S
    return None if req.timeout_s is None else req.timeout_s + EXEC_DEADLINE_MARGIN_S


def _exec_call_deadline(body: ExecCall) -> float | None:
    return exec_deadline(body.req)


def _exec_many_deadline(body: ExecMany) -> float | None:
    """The longest item's deadline (None if any item waits forever)."""
    longest = 0.0
    for call in body.calls:
        d = exec_deadline(call.req)
        if d is None:
            return None
        longest = max(longest, d)
    return longest


@dataclass(frozen=True, slots=True, kw_only=True)
class Rest:
    """The REST binding of a row.

    ``path`` names request fields in braces (``{id}``; ``{ref:path}`` matches slashes).
    ``query`` and ``headers`` map request fields to parameter and header names (a
    ``list`` field repeats its parameter; a ``dict[str, str]`` field repeats it as
    ``key=value``). ``body`` is ``"*"`` (the remaining fields as one JSON object), the
    name of the one field that is the body (JSON, or raw bytes for a ``bytes`` field),
    or None. ``body_limit`` names the :class:`RestConfig` cap on the body's size.
    ``reply`` is how the answer is written: JSON, raw bytes, NDJSON lines (a stream
    operation) or nothing (``status`` 204).
    """

    method: Literal["GET", "POST", "PUT", "DELETE"]
    path: str
    operation_id: str
    status: int = 200
    query: Mapping[str, str] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    body: str | None = None
    body_limit: Literal["json", "exec", "file", "image"] = "json"
    reply: Literal["json", "raw", "ndjson", "empty"] = "json"
    tag: str = "sandboxes"


_PATH_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::path)?\}")


def path_params(path: str) -> tuple[str, ...]:
    """The request fields a REST path names: ``/v1/images/{ref:path}`` -> ``("ref",)``."""
    return tuple(_PATH_PARAM.findall(path))


def _q(*names: str, **renamed: str) -> dict[str, str]:
    """Query parameters: fields carried under their own name, or ``field="param"``."""
    return {**{n: n for n in names}, **renamed}


@dataclass(frozen=True, slots=True, eq=False)
class Op(Generic[Req, Rep]):
    """One operation. ``request`` is its one request type at the API doors (REST, the
    gateway, both SDK transports); ``reply`` the type expression of its answer (a
    struct, ``bytes``, ``None`` or ``Batch[T]``). Rows are singletons: equal only to
    themselves, hashable by identity."""

    name: str
    request: type[Req]
    reply: Any
    _: KW_ONLY
    summary: str
    #: the least role on the target's project; None: the policy is the apiserver's own
    #: (written next to the row)
    role: Role | None
    target: Target
    #: safe to repeat after a lost connection (the SDK retries it; REST verbs follow)
    idempotent: bool
    doors: frozenset[Door]
    edge_request: Any = None      # the edge's request type when it differs from `request`
    edge_reply: Any = None        # the edge's reply type when it differs from `reply`
    rest: Rest | None = None      # None: not on REST
    batch_of: Op[Any, Any] | None = None   # this op is `batch_of` in bulk, items in order
    #: how long a caller waits for the answer, from the request (exec: the command
    #: timeout plus a margin); None: the caller's default request deadline
    deadline: Callable[[Any], float | None] | None = None

    # Derived once per row (a door reads them on every call; measured: building
    # f"edge.{name}" per call cost ~0.3 us of an 18 us edge get).
    api_method: str = field(init=False, repr=False)        # the gateway's Aether method
    edge_method: str = field(init=False, repr=False)       # the edge's Aether method
    edge_type: Any = field(init=False, repr=False)         # the request type the edge decodes
    edge_reply_type: Any = field(init=False, repr=False)   # the reply type the edge answers
    #: the edge takes `request` and answers `reply` (no edge_request/edge_reply)
    edge_plain: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        derived = {
            "api_method": f"api.{self.name}",
            "edge_method": f"edge.{self.name}",
            "edge_type": self.request if self.edge_request is None else self.edge_request,
            "edge_reply_type": self.reply if self.edge_reply is None else self.edge_reply,
            "edge_plain": self.edge_request is None and self.edge_reply is None,
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @property
    def effect(self) -> bool:
        """A lost link leaves "it may have happened" (the error says so)."""
        return not self.idempotent


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class StreamOp(Op[Req, Rep], Generic[Req, Item, Rep]):
    """An operation that streams ``item`` bodies (Aether STREAM frames, NDJSON lines)
    before its final ``reply``."""

    item: type[Item]


@dataclass(frozen=True, slots=True, eq=False)
class TunnelOp(Op[Req, Rep]):
    """A duplex operation: after the request, raw bytes flow both ways on the stream
    (Aether DUPLEX, per-stream credit; docs/aether.md) until the reply ends it."""


@dataclass(frozen=True, slots=True, eq=False)
class UploadOp(Op[Req, Rep]):
    """An operation whose REST body is a raw byte stream (an image tar): the handler
    gets the request and the chunks."""


# ======================================================================== the table
# Sandbox operations: served by the edge, forwarded by the apiserver (every door).

CREATE: Op[CreateSandbox, SandboxInfo] = Op(
    "create", CreateSandbox, SandboxInfo, summary="Create a sandbox",
    # not idempotent: a retry is made safe by its idempotency key, not by repeating
    role="member", target="project", idempotent=False, doors=ALL_DOORS,
    edge_request=CreateOnNode,
    rest=Rest(method="POST", path="/v1/sandboxes", operation_id="createSandbox", status=201,
              query=_q("session"), headers={"idempotency_key": "Idempotency-Key"},
              body="spec"))

CREATE_MANY: Op[CreateMany, Batch[SandboxInfo]] = Op(
    "create_many", CreateMany, Batch[SandboxInfo],
    summary="Create many sandboxes in one request (each item succeeds or fails alone)",
    role="member", target="project", idempotent=False, doors=ALL_DOORS,
    edge_request=CreateManyOnNode,
    rest=Rest(method="POST", path="/v1/batch/create", operation_id="createSandboxes",
              body="*"))

GET: Op[SandboxRef, SandboxInfo] = Op(
    "get", SandboxRef, SandboxInfo, summary="Get a sandbox",
    role="reader", target="sandbox", idempotent=True, doors=ALL_DOORS,
    rest=Rest(method="GET", path="/v1/sandboxes/{id}", operation_id="getSandbox"))

LIST: Op[ListSandboxes, SandboxList] = Op(
    "list", ListSandboxes, SandboxList, summary="List sandboxes",
    # reader on `project` when given, else only what the key may see. The edge answers
    # every match unpaged (the control plane's view of a node; the API pages its registry)
    role="reader", target="project", idempotent=True, doors=ALL_DOORS,
    edge_request=ListRequest, edge_reply=list[SandboxInfo],
    rest=Rest(method="GET", path="/v1/sandboxes", operation_id="listSandboxes",
              query=_q("project", "state", "limit", "cursor", "node", "isolation",
                     labels="label")))

DESTROY: Op[SandboxRef, None] = Op(
    "destroy", SandboxRef, None, summary="Destroy a sandbox (idempotent)",
    role="member", target="sandbox", idempotent=True, doors=ALL_DOORS,
    edge_request=DestroyOnNode, edge_reply=SandboxInfo,
    rest=Rest(method="DELETE", path="/v1/sandboxes/{id}", operation_id="deleteSandbox",
              status=204, reply="empty"))

EXEC: Op[ExecCall, ExecResult] = Op(
    "exec", ExecCall, ExecResult, summary="Run a command",
    role="member", target="sandbox", idempotent=False, doors=ALL_DOORS,
    deadline=_exec_call_deadline,
    rest=Rest(method="POST", path="/v1/sandboxes/{id}/exec", operation_id="execSandbox",
              body="req", body_limit="exec"))

EXEC_MANY: Op[ExecMany, Batch[ExecResult]] = Op(
    "exec_many", ExecMany, Batch[ExecResult],
    summary="Run many commands in one request (each item succeeds or fails alone)",
    role="member", target="sandbox", idempotent=False, doors=ALL_DOORS,
    batch_of=EXEC, deadline=_exec_many_deadline,
    rest=Rest(method="POST", path="/v1/batch/exec", operation_id="execMany", body="*",
              body_limit="exec"))

EXEC_STREAM: StreamOp[ExecCall, ExecChunk, ExecResult] = StreamOp(
    "exec_stream", ExecCall, ExecResult, item=ExecChunk,
    summary="Run a command, streaming its output",
    role="member", target="sandbox", idempotent=False, doors=ALL_DOORS,
    deadline=_exec_call_deadline,
    rest=Rest(method="POST", path="/v1/sandboxes/{id}/exec/stream",
              operation_id="execSandboxStream", body="req", body_limit="exec",
              reply="ndjson"))

READ_FILE: Op[ReadFile, bytes] = Op(
    "read_file", ReadFile, bytes, summary="Read a file (raw bytes)",
    role="reader", target="sandbox", idempotent=True, doors=ALL_DOORS,
    rest=Rest(method="GET", path="/v1/sandboxes/{id}/files", operation_id="readFile",
              query=_q("path", "offset", "length", "user"), reply="raw"))

WRITE_FILE: Op[WriteFile, None] = Op(
    "write_file", WriteFile, None,
    summary="Write a file (raw bytes body; empty: an empty file)",
    # the first piece truncates: the SDK retries only pieces that do not append
    role="member", target="sandbox", idempotent=False, doors=ALL_DOORS,
    rest=Rest(method="PUT", path="/v1/sandboxes/{id}/files", operation_id="writeFile",
              query=_q("path", "mode", "append", "user"), body="data", body_limit="file",
              status=204, reply="empty"))

LIST_DIR: Op[FileRef, FileList] = Op(
    "list_dir", FileRef, FileList, summary="List a directory",
    role="reader", target="sandbox", idempotent=True, doors=ALL_DOORS,
    rest=Rest(method="GET", path="/v1/sandboxes/{id}/files/list", operation_id="listFiles",
              query=_q("path", "user")))

STAT: Op[FileRef, FileInfo] = Op(
    "stat", FileRef, FileInfo, summary="Stat a path",
    role="reader", target="sandbox", idempotent=True, doors=ALL_DOORS,
    rest=Rest(method="GET", path="/v1/sandboxes/{id}/files/stat", operation_id="statFile",
              query=_q("path", "user")))

MKDIR: Op[Mkdir, None] = Op(
    "mkdir", Mkdir, None, summary="Create a directory",
    role="member", target="sandbox", idempotent=True, doors=ALL_DOORS,
    rest=Rest(method="POST", path="/v1/sandboxes/{id}/files/mkdir", operation_id="mkdir",
              query=_q("path", "parents", "user"), status=204, reply="empty"))

REMOVE: Op[Remove, None] = Op(
    "remove", Remove, None, summary="Remove a file or directory",
    # a repeat after success answers NotFound: not idempotent, so never retried blindly
    role="member", target="sandbox", idempotent=False, doors=ALL_DOORS,
    rest=Rest(method="DELETE", path="/v1/sandboxes/{id}/files", operation_id="removeFile",
              query=_q("path", "recursive", "user"), status=204, reply="empty"))

PAUSE: Op[SandboxRef, PauseStats] = Op(
    "pause", SandboxRef, PauseStats, summary="Pause (freeze, give memory back)",
    role="member", target="sandbox", idempotent=False, doors=ALL_DOORS,
    rest=Rest(method="POST", path="/v1/sandboxes/{id}/pause", operation_id="pauseSandbox"))

RESUME: Op[SandboxRef, SandboxInfo] = Op(
    "resume", SandboxRef, SandboxInfo, summary="Resume",
    role="member", target="sandbox", idempotent=False, doors=ALL_DOORS,
    edge_request=ResumeOnNode,
    rest=Rest(method="POST", path="/v1/sandboxes/{id}/resume", operation_id="resumeSandbox"))

STATS: Op[SandboxRef, SandboxStats] = Op(
    "stats", SandboxRef, SandboxStats, summary="Resource use now (memory, cpu, pids, disk)",
    role="reader", target="sandbox", idempotent=True, doors=ALL_DOORS,
    rest=Rest(method="GET", path="/v1/sandboxes/{id}/stats", operation_id="sandboxStats"))

EVENTS: Op[SandboxRef, EventList] = Op(
    "events", SandboxRef, EventList, summary="Lifecycle events",
    role="reader", target="sandbox", idempotent=True, doors=ALL_DOORS,
    rest=Rest(method="GET", path="/v1/sandboxes/{id}/events", operation_id="sandboxEvents"))

SNAPSHOT: Op[SnapshotCall, SnapshotView] = Op(
    "snapshot", SnapshotCall, SnapshotView,
    summary="Snapshot the sandbox's changes since its last snapshot (pack_diff); "
            "unchanged -> that snapshot",
    role="member", target="sandbox", idempotent=False, doors=ALL_DOORS,
    edge_request=SnapshotOnNode, edge_reply=SnapshotInfo,
    rest=Rest(method="POST", path="/v1/sandboxes/{id}/snapshot",
              operation_id="snapshotSandbox", query=_q("strip"), status=201))

SNAPSHOTS: Op[SnapshotQuery, SnapshotList] = Op(
    "snapshots", SnapshotQuery, SnapshotList, summary="Snapshots visible to this key",
    # reader on `project` when given, else only what the key may see
    role="reader", target="project", idempotent=True, doors=ALL_DOORS,
    edge_reply=list[SnapshotInfo],
    rest=Rest(method="GET", path="/v1/snapshots", operation_id="listSnapshots",
              query=_q("project", "sandbox_id"), tag="snapshots"))

SNAPSHOT_GET: Op[SnapshotRef, SnapshotView] = Op(
    "snapshot_get", SnapshotRef, SnapshotView,
    summary="One snapshot and the nodes holding it",
    # visible with any role on the snapshot's project
    role="reader", target="snapshot", idempotent=True, doors=ALL_DOORS,
    edge_reply=SnapshotInfo,
    rest=Rest(method="GET", path="/v1/snapshots/{id}", operation_id="getSnapshot",
              tag="snapshots"))

SNAPSHOT_DELETE: Op[SnapshotRef, None] = Op(
    "snapshot_delete", SnapshotRef, None,
    summary="Delete a snapshot (409 in_use while a sandbox runs from it or a snapshot "
            "builds on it)",
    # answers nothing at every API door (REST's 204; the gateway and the SDK over either
    # transport alike); the edge answers what it deleted (the apiserver's bookkeeping)
    role="member", target="snapshot", idempotent=False, doors=ALL_DOORS,
    edge_reply=SnapshotInfo,
    rest=Rest(method="DELETE", path="/v1/snapshots/{id}", operation_id="deleteSnapshot",
              status=204, reply="empty", tag="snapshots"))

# Node operations: the edge's own, called by the control plane only.

NODE_INFO: Op[Empty, NodeInfo] = Op(
    "node_info", Empty, NodeInfo, summary="The node: id, backends, capacity, methods",
    role=None, target="node", idempotent=True, doors=_EDGE)

HEARTBEAT: Op[HeartbeatRequest, Heartbeat] = Op(
    "heartbeat", HeartbeatRequest, Heartbeat,
    summary="Usage now and, optionally, a brief of every sandbox",
    role=None, target="node", idempotent=True, doors=_EDGE)

FEED: Op[FeedRequest, EventFeed] = Op(
    "feed", FeedRequest, EventFeed, summary="Node-wide lifecycle events after a cursor",
    role=None, target="node", idempotent=True, doors=_EDGE)

DESTROY_MANY: Op[DestroyMany, Batch[SandboxInfo]] = Op(
    "destroy_many", DestroyMany, Batch[SandboxInfo],
    summary="Destroy many sandboxes (the watcher's evictions, reconcile)",
    role=None, target="node", idempotent=True, doors=_EDGE)

# Management-plane operations: the gateway and REST, no edge. role=None: the policy is
# the apiserver's (who may see or change what is decided there, per operation).

INFO: Op[Empty, Info] = Op(
    "info", Empty, Info, summary="Who am I, server version, gateway address",
    role=None, target="cluster", idempotent=True, doors=API_DOORS,
    rest=Rest(method="GET", path="/v1/info", operation_id="info", tag="meta"))

NODES: Op[Empty, NodeList] = Op(
    "nodes", Empty, NodeList, summary="Edge nodes with usage",
    # any role anywhere
    role=None, target="cluster", idempotent=True, doors=API_DOORS,
    rest=Rest(method="GET", path="/v1/nodes", operation_id="listNodes", tag="nodes"))

SESSION_OPEN: Op[SessionOpen, SessionView] = Op(
    "session_open", SessionOpen, SessionView,
    summary="Open a client session lease (crash-safe sandboxes)",
    role=None, target="self", idempotent=False, doors=API_DOORS,
    rest=Rest(method="POST", path="/v1/sessions", operation_id="openSession", status=201,
              query=_q("lease_s"), tag="sessions"))

SESSION_RENEW: Op[SessionRef, SessionView] = Op(
    "session_renew", SessionRef, SessionView, summary="Renew a session lease",
    role=None, target="self", idempotent=True, doors=API_DOORS,
    rest=Rest(method="POST", path="/v1/sessions/{id}/renew", operation_id="renewSession",
              tag="sessions"))

SESSION_CLOSE: Op[SessionRef, None] = Op(
    "session_close", SessionRef, None,
    summary="End a session now: its sandboxes are destroyed",
    role=None, target="self", idempotent=True, doors=API_DOORS,
    rest=Rest(method="DELETE", path="/v1/sessions/{id}", operation_id="closeSession",
              status=204, reply="empty", tag="sessions"))

CREATE_KEY: Op[CreateKeyRequest, CreateKeyResponse] = Op(
    "create_key", CreateKeyRequest, CreateKeyResponse,
    summary="Create an API key: for a new principal with a role on a project (admin of "
            "that project), or an extra key of the caller's own; keys of other existing "
            "principals only by a superuser",
    role=None, target="self", idempotent=False, doors=API_DOORS,
    rest=Rest(method="POST", path="/v1/keys", operation_id="createKey", status=201,
              body="*", tag="admin"))

REVOKE_KEY: Op[KeyRef, None] = Op(
    "revoke_key", KeyRef, None,
    summary="Revoke an API key by its id (your own keys; a superuser: any "
            "non-superuser's)",
    role=None, target="self", idempotent=True, doors=API_DOORS,
    rest=Rest(method="DELETE", path="/v1/keys/{id}", operation_id="revokeKey", status=204,
              reply="empty", tag="admin"))

PROJECTS: Op[Empty, ProjectList] = Op(
    "projects", Empty, ProjectList, summary="Projects with quotas and usage",
    # the projects the key administers
    role=None, target="project", idempotent=True, doors=API_DOORS,
    rest=Rest(method="GET", path="/v1/projects", operation_id="listProjects", tag="admin"))

PROJECT_GET: Op[ProjectRef, ProjectView] = Op(
    "project_get", ProjectRef, ProjectView, summary="A project's quota and usage",
    # any role on the project sees its quota and usage (Admin.get_project, since the
    # first IAM); setting one is quota_set's admin
    role="reader", target="project", idempotent=True, doors=API_DOORS,
    rest=Rest(method="GET", path="/v1/projects/{path:path}", operation_id="getProject",
              tag="admin"))

QUOTA_SET: Op[QuotaSet, ProjectView] = Op(
    "quota_set", QuotaSet, ProjectView, summary="Set a project's quota (admin)",
    role="admin", target="project", idempotent=True, doors=API_DOORS,
    rest=Rest(method="PUT", path="/v1/quotas/{path:path}", operation_id="setQuota",
              body="quota", tag="admin"))

IMAGES: Op[Empty, ImageList] = Op(
    "images", Empty, ImageList,
    summary="Image layers of the cluster's layer store visible to this key "
            "(cluster-wide ones and those of its projects)",
    role=None, target="project", idempotent=True, doors=API_DOORS,
    rest=Rest(method="GET", path="/v1/images", operation_id="listImages", tag="images"))

IMAGE_GET: Op[ImageRef, ImageView] = Op(
    "image_get", ImageRef, ImageView,
    summary="One image by [project/]name[:tag] or digest (a bare name: the key's project "
            "first, then cluster-wide)",
    role=None, target="project", idempotent=True, doors=API_DOORS,
    rest=Rest(method="GET", path="/v1/images/{ref:path}", operation_id="getImage",
              tag="images"))

IMAGE_TAG: Op[ImageTagRequest, ImageView] = Op(
    "image_tag", ImageTagRequest, ImageView,
    summary="Point a name ([project/]name[:tag]) at a layer (write right on the name's "
            "namespace; the layer must belong to it, an ancestor project or be "
            "cluster-wide)",
    # write right on the namespace: member of the project, superuser for cluster-wide
    role=None, target="project", idempotent=True, doors=API_DOORS,
    rest=Rest(method="POST", path="/v1/images/tag", operation_id="tagImage", body="*",
              tag="images"))

IMAGE_DELETE: Op[ImageRef, None] = Op(
    "image_delete", ImageRef, None,
    summary="Delete a name (and its layer when nothing else names or uses it), or by "
            "digest a layer and all its names (write right on the namespaces; 409 in_use "
            "while a sandbox or snapshot uses it)",
    role=None, target="project", idempotent=False, doors=API_DOORS,
    rest=Rest(method="DELETE", path="/v1/images/{ref:path}", operation_id="deleteImage",
              status=204, reply="empty", tag="images"))

# Uploads stream up to gigabytes: REST only until chunked uploads come to Aether.
IMAGE_BUILD: UploadOp[ImageUpload, ImageList] = UploadOp(
    "image_build", ImageUpload, ImageList,
    summary="Build a layer from an uploaded tar (raw body)",
    role=None, target="project", idempotent=False, doors=_REST,
    rest=Rest(method="POST", path="/v1/images", operation_id="buildImage", status=201,
              query=_q("name", "kind", "tag"), body_limit="image", tag="images"))

IMAGE_IMPORT: UploadOp[ImageUpload, ImageList] = UploadOp(
    "image_import", ImageUpload, ImageList,
    summary="Import an OCI image (docker save tarball or OCI layout tar, raw body)",
    role=None, target="project", idempotent=False, doors=_REST,
    rest=Rest(method="POST", path="/v1/images/import", operation_id="importImage",
              status=201, query=_q("name", "kind", "tag"), body_limit="image", tag="images"))

# Network (issue 14): a sandbox's egress policy, served by its edge, every door.

NETWORK_GET: Op[SandboxRef, NetworkView] = Op(
    "network_get", SandboxRef, NetworkView,
    summary="A sandbox's egress policy as enforced, its generation and denied counts",
    role="reader", target="sandbox", idempotent=True, doors=ALL_DOORS,
    rest=Rest(method="GET", path="/v1/sandboxes/{id}/network",
              operation_id="getSandboxNetwork", tag="network"))

NETWORK_UPDATE: Op[NetworkUpdate, NetworkView] = Op(
    "network_update", NetworkUpdate, NetworkView,
    summary="Replace a live sandbox's egress policy atomically (cuts flows it no longer "
            "allows)",
    # role None: member on the sandbox's project AND within the project's network
    # ceilings (every ancestor's), whose deny entries the apiserver adds for the edge.
    # Idempotent: the edge changes nothing for a policy equal to the live one.
    role=None, target="sandbox", idempotent=True, doors=ALL_DOORS,
    edge_request=NetworkUpdateOnNode,
    rest=Rest(method="PUT", path="/v1/sandboxes/{id}/network",
              operation_id="updateSandboxNetwork", body="policy",
              query=_q("expect_generation"), tag="network"))


# Exposed ports (issue 14, docs/networking.md): the edge keeps the port records; the
# apiserver mints URLs and tokens from them and proxies HTTP/WebSocket over port_connect.
PORT_EXPOSE: Op[PortExpose, ExposedPort] = Op(
    "port_expose", PortExpose, ExposedPort,
    summary="Reach a port inside the sandbox through the apiserver (HTTP and WebSocket): "
            "its URL and URL token",
    # member on the sandbox's project; the apiserver mints the URL token from the edge's
    # PortRecord (its generation: closing the port kills every URL)
    role="member", target="sandbox", idempotent=True, doors=ALL_DOORS,
    edge_reply=PortRecord,
    rest=Rest(method="POST", path="/v1/sandboxes/{id}/ports", operation_id="exposePort",
              status=201, body="*", tag="ports"))

PORT_LIST: Op[SandboxRef, ExposedPortList] = Op(
    "port_list", SandboxRef, ExposedPortList,
    summary="Exposed ports of a sandbox, with their URLs",
    # member, not reader: the answer holds URL tokens, which are credentials
    role="member", target="sandbox", idempotent=True, doors=ALL_DOORS,
    edge_reply=PortRecordList,
    rest=Rest(method="GET", path="/v1/sandboxes/{id}/ports", operation_id="listPorts",
              tag="ports"))

PORT_CLOSE: Op[PortRef, None] = Op(
    "port_close", PortRef, None,
    summary="Close an exposed port (its URLs and open tunnels end)",
    role="member", target="sandbox", idempotent=True, doors=ALL_DOORS,
    rest=Rest(method="DELETE", path="/v1/sandboxes/{id}/ports/{port}",
              operation_id="closePort", status=204, reply="empty", tag="ports"))

# The edge's duplex row: its REST form is the apiserver's proxy route
# /v1/proxy/{id}/{port}/{path} (control/proxy.py), which calls only this.
PORT_CONNECT: TunnelOp[PortConnect, None] = TunnelOp(
    "port_connect", PortConnect, None,
    summary="A duplex byte stream to an exposed port (the apiserver's proxy)",
    role="member", target="sandbox", idempotent=False, doors=_EDGE)

# Issue 15: the layer store's garbage collection. A superuser's: the store is one for
# every project, and what is garbage is decided across all of them (a layer one project
# built may stand under another's image); per project there is nothing to collect that
# `image_delete` does not already remove.
IMAGE_PRUNE: Op[ImagePrune, ImagePruned] = Op(
    "image_prune", ImagePrune, ImagePruned,
    summary="Remove the layers nothing references (no name, no snapshot or image on "
            "them, not mounted, not held by a build); superuser only; dry_run only says",
    role=None, target="cluster", idempotent=True, doors=API_DOORS,
    rest=Rest(method="POST", path="/v1/images/prune", operation_id="pruneImages",
              body="*", tag="images"))


# Issue 15: images pulled from OCI registries into the layer store the node's sandboxes
# read (the apiserver's, shared with its edges; docs/images.md "Pulling from registries").
IMAGE_PULL: Op[ImagePullRequest, ImageList] = Op(
    "image_pull", ImagePullRequest, ImageList,
    summary="Pull an image from an OCI registry into the layer store (one layer per OCI "
            "layer, the image first; write right on the target namespace)",
    # write right on the namespace, as image_build: member of the project, superuser
    # for a cluster-wide name
    role=None, target="project", idempotent=True, doors=API_DOORS,
    rest=Rest(method="POST", path="/v1/images/pull", operation_id="pullImage", status=201,
              body="*", tag="images"))


IMAGE_PROMOTE: Op[ImagePromoteRequest, ImageView] = Op(
    "image_promote", ImagePromoteRequest, ImageView,
    summary="Name a built image: its step layers (a snapshot chain) on its base become a "
            "named image of the project with the build's config",
    # write right on the target's namespace (member), and the snapshot must be its own
    role=None, target="project", idempotent=True, doors=API_DOORS,
    rest=Rest(method="POST", path="/v1/images/promote", operation_id="promoteImage",
              body="*", tag="images"))


# Issue 16 (Operations): draining an edge before maintenance. A superuser's: a node serves
# every project, so taking it out of placement is decided across all of them. Stored
# (node_drains), so every replica and a restarted apiserver keep honouring it.
NODE_DRAIN: Op[NodeRef, NodeView] = Op(
    "node_drain", NodeRef, NodeView,
    summary="Drain an edge node: no new sandboxes are placed on it; those it holds run "
            "until they end (superuser only)",
    role=None, target="cluster", idempotent=True, doors=API_DOORS,
    rest=Rest(method="POST", path="/v1/nodes/{id}/drain", operation_id="drainNode",
              tag="nodes"))

NODE_UNDRAIN: Op[NodeRef, NodeView] = Op(
    "node_undrain", NodeRef, NodeView,
    summary="Undrain an edge node: placement may use it again (superuser only)",
    role=None, target="cluster", idempotent=True, doors=API_DOORS,
    rest=Rest(method="DELETE", path="/v1/nodes/{id}/drain", operation_id="undrainNode",
              tag="nodes"))
# Issue 16: layers move between nodes (docs/layers.md). The edge's own rows, called by the
# control plane only, which relays a holder's layer_get into a receiver's layer_put.
LAYER_CHAIN: Op[LayerRef, LayerChain] = Op(
    "layer_chain", LayerRef, LayerChain,
    summary="A layer's manifest and those of every layer below it, lowest first",
    role=None, target="node", idempotent=True, doors=_EDGE)

LAYER_GET: TunnelOp[LayerRef, None] = TunnelOp(
    "layer_get", LayerRef, None,
    summary="A layer file's bytes (duplex: the holder writes them and half-closes)",
    role=None, target="node", idempotent=True, doors=_EDGE)

LAYER_PUT: TunnelOp[LayerPut, LayerStored] = TunnelOp(
    "layer_put", LayerPut, LayerStored,
    summary="Take in a layer (duplex: its bytes follow the manifest); checked against "
            "the manifest's size and the digest before it is published",
    role=None, target="node", idempotent=True, doors=_EDGE)

# The API's face of layer transfer: creates fetch what their node lacks by themselves;
# this warms a node ahead (before a burst, before draining another). A superuser's: a
# node's store is every project's and a fetch fills its disk (role None: the policy is
# ControlPlane.fetch_layer's).
LAYER_FETCH: Op[LayerFetch, LayerFetched] = Op(
    "layer_fetch", LayerFetch, LayerFetched,
    summary="Copy a layer and every layer below it onto a node from a node holding them "
            "(superuser only)",
    role=None, target="cluster", idempotent=True, doors=API_DOORS,
    rest=Rest(method="POST", path="/v1/nodes/{node}/layers", operation_id="fetchLayer",
              body="*", tag="nodes"))

# Issue 16: cluster administration (join tokens, joined nodes) at every door, not REST
# only. A superuser's (role None: the policy is ApiService's): a token admits a machine
# into every project's placement, and revoking a node writes off its sandboxes.
CLUSTER_TOKENS: Op[Empty, JoinTokenList] = Op(
    "cluster_tokens", Empty, JoinTokenList,
    summary="List join tokens (superuser only)",
    role=None, target="cluster", idempotent=True, doors=API_DOORS,
    rest=Rest(method="GET", path="/v1/cluster/tokens", operation_id="clusterTokens",
              tag="cluster"))

CLUSTER_TOKEN_CREATE: Op[JoinTokenCreate, JoinTokenView] = Op(
    "cluster_token_create", JoinTokenCreate, JoinTokenView,
    summary="Create a join token (superuser only; its secret is shown once)",
    role=None, target="cluster", idempotent=False, doors=API_DOORS,
    rest=Rest(method="POST", path="/v1/cluster/tokens", operation_id="clusterTokenCreate",
              status=201, body="*", tag="cluster"))

CLUSTER_TOKEN_REVOKE: Op[JoinTokenRevoke, None] = Op(
    "cluster_token_revoke", JoinTokenRevoke, None,
    summary="Revoke a join token, and with nodes=true every node that joined with it "
            "(superuser only)",
    role=None, target="cluster", idempotent=True, doors=API_DOORS,
    rest=Rest(method="DELETE", path="/v1/cluster/tokens/{id}",
              operation_id="clusterTokenRevoke", query=_q("nodes"), status=204,
              reply="empty", tag="cluster"))

CLUSTER_NODES: Op[Empty, JoinedNodeList] = Op(
    "cluster_nodes", Empty, JoinedNodeList,
    summary="List the edges that joined with a token (superuser only)",
    role=None, target="cluster", idempotent=True, doors=API_DOORS,
    rest=Rest(method="GET", path="/v1/cluster/nodes", operation_id="clusterNodes",
              tag="cluster"))

CLUSTER_NODE_REVOKE: Op[NodeRef, None] = Op(
    "cluster_node_revoke", NodeRef, None,
    summary="Revoke a joined node: its certificate is refused at every replica and its "
            "sandboxes are written off (superuser only)",
    role=None, target="cluster", idempotent=True, doors=API_DOORS,
    rest=Rest(method="POST", path="/v1/cluster/nodes/{id}/revoke",
              operation_id="clusterNodeRevoke", status=204, reply="empty", tag="cluster"))

# Issue 16 (Operations): `dsec node drain ID --migrate`. A superuser's, like the drain: it
# snapshots every project's sandboxes on the node and starts them elsewhere. Safe to
# repeat (its progress is stored; the new sandboxes are created under keys).
NODE_MIGRATE: Op[NodeRef, NodeMigration] = Op(
    "node_migrate", NodeRef, NodeMigration,
    summary="Move every sandbox off a drained node: snapshot it, start it from the "
            "snapshot on another node, end the original (reason migrated, naming the new "
            "id); superuser only",
    role=None, target="cluster", idempotent=True, doors=API_DOORS,
    rest=Rest(method="POST", path="/v1/nodes/{id}/migrate", operation_id="migrateNode",
              tag="nodes"))


# Issue 17: images pushed to the cluster's blob store, where nodes that lack a layer read
# it (lazily, 256 KiB at a time, or whole). The store is the operator's (--blob-store):
# a caller names an image, never a store URL. Write right on the image's namespace, as a
# tag (member of its project; superuser for a cluster-wide layer).
IMAGE_PUSH: Op[ImagePushRequest, ImagePushed] = Op(
    "image_push", ImagePushRequest, ImagePushed,
    summary="Push an image (its layer and every layer below it, with chunk tables and "
            "manifests) to the cluster's blob store; layers already there are skipped",
    role=None, target="project", idempotent=True, doors=API_DOORS,
    rest=Rest(method="POST", path="/v1/images/push", operation_id="pushImage",
              body="*", tag="images"))

# Issue 17: an image kept fully cached on chosen nodes (their lazy layers fetch it whole
# and never evict it). An operator's (role None, the policy is ControlPlane.pin_image's:
# a superuser only), stored in the state store so every replica answers the same pins.
IMAGE_PIN: Op[ImagePin, ImagePinView] = Op(
    "image_pin", ImagePin, ImagePinView,
    summary="Keep an image (every layer of it, pushed to the blob store) fully cached on "
            "a node (superuser only)",
    role=None, target="cluster", idempotent=True, doors=API_DOORS,
    rest=Rest(method="POST", path="/v1/nodes/{node}/pins", operation_id="pinImage",
              body="*", tag="nodes"))

IMAGE_UNPIN: Op[ImagePinRef, None] = Op(
    "image_unpin", ImagePinRef, None,
    summary="Stop keeping an image fully cached on a node (superuser only)",
    role=None, target="cluster", idempotent=False, doors=API_DOORS,
    rest=Rest(method="DELETE", path="/v1/nodes/{node}/pins/{image}",
              operation_id="unpinImage", status=204, reply="empty", tag="nodes"))

IMAGE_PINS: Op[NodePins, ImagePinList] = Op(
    "image_pins", NodePins, ImagePinList,
    summary="The images pinned on a node (superuser only)",
    role=None, target="cluster", idempotent=True, doors=API_DOORS,
    rest=Rest(method="GET", path="/v1/nodes/{node}/pins", operation_id="listImagePins",
              tag="nodes"))

# Issue 17: the control plane hands a node its image pins (the whole set, again after
# the node restarted: Heartbeat.pins_gen); the edge applies them off its loop.
NODE_PINS: Op[PinSet, Empty] = Op(
    "node_pins", PinSet, Empty,
    summary="Make the node's pinned images exactly this set (control plane only)",
    role=None, target="node", idempotent=True, doors=_EDGE)

# Issue 19 (Files): files of any size in pieces, rename and watch (dsec.wire.files). The
# stream rows are duplex (raw bytes under per-stream credit: bounded memory on every hop,
# however big the file and however slow the reader); their REST forms are hand-written
# routes (a streamed raw body each way), the gateway serves them as duplex methods.
FILE_READ_STREAM: TunnelOp[ReadStream, FileInfo] = TunnelOp(
    "file_read_stream", ReadStream, FileInfo,
    summary="Read a file of any size as a byte stream (the reply: the file as opened)",
    role="reader", target="sandbox", idempotent=True, doors=ALL_DOORS,
    rest=Rest(method="GET", path="/v1/sandboxes/{id}/files/content",
              operation_id="readFileStream", query=_q("path", "offset", "length", "user"),
              reply="raw"))

FILE_WRITE_STREAM: TunnelOp[WriteStream, FileInfo] = TunnelOp(
    "file_write_stream", WriteStream, FileInfo,
    summary="Replace a file atomically with a byte stream of any size (a temporary file "
            "renamed into place once every byte arrived)",
    # the whole content each time: repeating it leaves the same file
    role="member", target="sandbox", idempotent=True, doors=ALL_DOORS,
    rest=Rest(method="PUT", path="/v1/sandboxes/{id}/files/content",
              operation_id="writeFileStream", query=_q("path", "mode", "size", "user")))

FILE_RENAME: Op[Rename, FileInfo] = Op(
    "file_rename", Rename, FileInfo,
    summary="Rename (move) a file or directory inside the sandbox",
    # a repeat after success answers NotFound (src is gone): not idempotent
    role="member", target="sandbox", idempotent=False, doors=ALL_DOORS,
    rest=Rest(method="POST", path="/v1/sandboxes/{id}/files/rename",
              operation_id="renameFile", body="*"))

FILE_WATCH: StreamOp[Watch, FileEvent, WatchEnd] = StreamOp(
    "file_watch", Watch, WatchEnd, item=FileEvent,
    summary="Watch a directory: create/write/remove/rename/chmod events (inotify)",
    role="reader", target="sandbox", idempotent=True, doors=ALL_DOORS,
    rest=Rest(method="GET", path="/v1/sandboxes/{id}/files/watch",
              operation_id="watchFiles", query=_q("path", "recursive", "timeout_s"),
              reply="ndjson"))

# Issue 19, lifetimes: move a sandbox's deadline (its TTL clock stops while paused).
SET_TIMEOUT: Op[SetTimeout, SandboxInfo] = Op(
    "set_timeout", SetTimeout, SandboxInfo,
    summary="Set a sandbox's lifetime: end it timeout_s from now (extend: add to it)",
    role="member", target="sandbox", idempotent=False, doors=ALL_DOORS,
    rest=Rest(method="POST", path="/v1/sandboxes/{id}/timeout", operation_id="setTimeout",
              body="*"))

# Issue 17 (red team 17 F1): the control plane hands a node the manifests of the pushed
# layers it may read lazily (before a create, a snapshot relay, the pins); a node never
# takes a layer's meaning or chunk hashes from the blob store itself.
LAYER_GRANT: Op[LayerGrant, LayerGranted] = Op(
    "layer_grant", LayerGrant, LayerGranted,
    summary="Record layers this node reads lazily from the blob store, by the control "
            "plane's manifests (control plane only)",
    role=None, target="node", idempotent=True, doors=_EDGE)

# Issue 19 (cli19): `dsec key ls`.
KEYS: Op[KeyQuery, KeyList] = Op(
    "keys", KeyQuery, KeyList,
    summary="API keys of a principal, never their secrets (your own; a superuser: any "
            "non-superuser's)",
    role=None, target="self", idempotent=True, doors=API_DOORS,
    rest=Rest(method="GET", path="/v1/keys", operation_id="listKeys", query=_q("principal"),
              tag="admin"))


# Issue 19: processes and terminals (dsec.wire.process, dsec.edge.processes). The edge
# keeps each sandbox's process table (bounded output rings, stdin pipes, ptys); every
# door forwards these by the sandbox's project. process_connect follows a process until
# it exits, however long: no deadline.
def _no_deadline(body: object) -> float | None:
    return None


PROCESS_START: Op[ExecCall, ProcessInfo] = Op(
    "process_start", ExecCall, ProcessInfo,
    summary="Start a background process (output kept in a bounded ring for "
            "process_connect; stdin kept open with stdin_open; a terminal with pty)",
    role="member", target="sandbox", idempotent=False, doors=ALL_DOORS,
    rest=Rest(method="POST", path="/v1/sandboxes/{id}/processes",
              operation_id="startProcess", status=201, body="req", body_limit="exec",
              tag="processes"))

PROCESS_LIST: Op[SandboxRef, ProcessList] = Op(
    "process_list", SandboxRef, ProcessList,
    summary="The sandbox's processes started with process_start (running and ended)",
    role="reader", target="sandbox", idempotent=True, doors=ALL_DOORS,
    rest=Rest(method="GET", path="/v1/sandboxes/{id}/processes",
              operation_id="listProcesses", tag="processes"))

PROCESS_CONNECT: StreamOp[ProcessRef, ExecChunk, ExecResult] = StreamOp(
    "process_connect", ProcessRef, ExecResult, item=ExecChunk,
    summary="A process's output: what its ring holds, then live output until it exits, "
            "then its exit",
    role="reader", target="sandbox", idempotent=True, doors=ALL_DOORS,
    deadline=_no_deadline,
    rest=Rest(method="GET", path="/v1/sandboxes/{id}/processes/{pid}/output",
              operation_id="connectProcess", reply="ndjson", tag="processes"))

# Issue 20: start + connect in one edge call (an E2B `commands.run` was two: start, then
# connect). Starts exactly as process_start (same admission, ring, durability, role);
# the stream is a process_connect's, with the process's entry as its first item. The
# reader going away ends the reader, not the process.
PROCESS_RUN: StreamOp[ExecCall, ProcessRunItem, ExecResult] = StreamOp(
    "process_run", ExecCall, ExecResult, item=ProcessRunItem,
    summary="Start a background process and follow it: its entry (pid) first, then its "
            "output, then its exit (process_start + process_connect in one call)",
    role="member", target="sandbox", idempotent=False, doors=ALL_DOORS,
    deadline=_no_deadline,
    rest=Rest(method="POST", path="/v1/sandboxes/{id}/processes/run",
              operation_id="runProcess", body="req", body_limit="exec", reply="ndjson",
              tag="processes"))

PROCESS_INPUT: Op[ProcessInput, None] = Op(
    "process_input", ProcessInput, None,
    summary="Write bytes to a process's stdin (or its terminal)",
    role="member", target="sandbox", idempotent=False, doors=ALL_DOORS,
    rest=Rest(method="POST", path="/v1/sandboxes/{id}/processes/{pid}/stdin",
              operation_id="writeProcessStdin", status=204, body="data",
              body_limit="exec", reply="empty", tag="processes"))

PROCESS_CLOSE_STDIN: Op[ProcessRef, None] = Op(
    "process_close_stdin", ProcessRef, None,
    summary="Close a process's stdin (it reads end of file)",
    role="member", target="sandbox", idempotent=True, doors=ALL_DOORS,
    rest=Rest(method="DELETE", path="/v1/sandboxes/{id}/processes/{pid}/stdin",
              operation_id="closeProcessStdin", status=204, reply="empty",
              tag="processes"))

PROCESS_SIGNAL: Op[ProcessSignal, None] = Op(
    "process_signal", ProcessSignal, None,
    summary="Send a signal to a process's process group",
    role="member", target="sandbox", idempotent=False, doors=ALL_DOORS,
    rest=Rest(method="POST", path="/v1/sandboxes/{id}/processes/{pid}/signal",
              operation_id="signalProcess", status=204, body="*", reply="empty",
              tag="processes"))

PTY_RESIZE: Op[PtyResize, None] = Op(
    "pty_resize", PtyResize, None,
    summary="Resize a PTY process's terminal (its foreground group gets SIGWINCH)",
    role="member", target="sandbox", idempotent=True, doors=ALL_DOORS,
    rest=Rest(method="POST", path="/v1/sandboxes/{id}/processes/{pid}/resize",
              operation_id="resizePty", status=204, body="*", reply="empty",
              tag="processes"))

ALL_OPS: Final[tuple[Op[Any, Any], ...]] = (
    CREATE, CREATE_MANY, GET, LIST, DESTROY, EXEC, EXEC_MANY, EXEC_STREAM,
    READ_FILE, WRITE_FILE, LIST_DIR, STAT, MKDIR, REMOVE, PAUSE, RESUME, STATS, EVENTS,
    SNAPSHOT, SNAPSHOTS, SNAPSHOT_GET, SNAPSHOT_DELETE,
    NODE_INFO, HEARTBEAT, FEED, DESTROY_MANY,
    INFO, NODES, SESSION_OPEN, SESSION_RENEW, SESSION_CLOSE, CREATE_KEY, REVOKE_KEY,
    PROJECTS, PROJECT_GET, QUOTA_SET, IMAGES, IMAGE_GET, IMAGE_TAG, IMAGE_DELETE,
    IMAGE_BUILD, IMAGE_IMPORT,
    NETWORK_GET, NETWORK_UPDATE,
    PORT_EXPOSE, PORT_LIST, PORT_CONNECT, PORT_CLOSE,
    IMAGE_PRUNE,
    IMAGE_PULL,
    IMAGE_PROMOTE,
    NODE_DRAIN,
    NODE_UNDRAIN,
    LAYER_CHAIN,
    LAYER_GET,
    LAYER_PUT,
    LAYER_FETCH,
    IMAGE_PUSH,
    IMAGE_PIN,
    IMAGE_UNPIN,
    IMAGE_PINS,
    CLUSTER_TOKENS,
    CLUSTER_TOKEN_CREATE,
    CLUSTER_TOKEN_REVOKE,
    CLUSTER_NODES,
    CLUSTER_NODE_REVOKE,
    NODE_MIGRATE,
    NODE_PINS,
    FILE_READ_STREAM,
    FILE_WRITE_STREAM,
    FILE_RENAME,
    FILE_WATCH,
    SET_TIMEOUT,
    LAYER_GRANT,
    KEYS,
    PROCESS_START,
    PROCESS_LIST,
    PROCESS_CONNECT,
    PROCESS_INPUT,
    PROCESS_CLOSE_STDIN,
    PROCESS_SIGNAL,
    PTY_RESIZE,
    PROCESS_RUN,
)
BY_NAME: Final[Mapping[str, Op[Any, Any]]] = {op.name: op for op in ALL_OPS}
EDGE_OPS: Final[tuple[Op[Any, Any], ...]] = tuple(op for op in ALL_OPS if "edge" in op.doors)
GATEWAY_OPS: Final[tuple[Op[Any, Any], ...]] = tuple(
    op for op in ALL_OPS if "gateway" in op.doors)
REST_OPS: Final[tuple[Op[Any, Any], ...]] = tuple(op for op in ALL_OPS if "rest" in op.doors)
