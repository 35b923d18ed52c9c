"""Request and reply bodies of every edge method on Aether (msgspec msgpack structs).

Method names are ``edge.<operation>``; :mod:`dsec.edge.service` binds them to an
:class:`~dsec.edge.node.EdgeNode` and :class:`~dsec.edge.service.EdgeClient` calls them.
Batched replies carry one :class:`Outcome` per item, so one bad item never hides the
results of the others. Heartbeats use ``array_like`` briefs because a node with 100k
sandboxes sends 100k of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from dsec.aether.messages import ErrorBody, error_body
from dsec.edge.admission import Resources
from dsec.edge.spec import (
    ExecRequest,
    ExecResult,
    SandboxEvent,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
)
from dsec.errors import DsecError, InvalidArgument, error_from_wire

__all__ = [
    "METHODS",
    "Command",
    "CreateMany",
    "CreateManyReply",
    "CreateRequest",
    "DestroyMany",
    "DestroyRequest",
    "EventFeed",
    "ExecCall",
    "ExecMany",
    "ExecManyReply",
    "ExecOutcome",
    "FeedRequest",
    "FileRequest",
    "Heartbeat",
    "HeartbeatRequest",
    "InfoOutcome",
    "ListRequest",
    "NodeInfo",
    "Outcome",
    "PoolStats",
    "ReadFileRequest",
    "SandboxBrief",
    "SandboxRef",
    "SnapshotQuery",
    "SnapshotRef",
    "SnapshotRequest",
    "WriteFileRequest",
    "exec_request",
    "outcome_error",
]

Command = ExecRequest | str | Sequence[str]


def exec_request(cmd: Command, **kw: object) -> ExecRequest:
    """``"echo hi"`` -> shell, ``["echo", "hi"]`` -> argv, an ExecRequest as is (no kw)."""
    if isinstance(cmd, ExecRequest):
        if kw:
            raise InvalidArgument("pass options inside the ExecRequest, not as keywords")
        return cmd
    if isinstance(cmd, str):
        return ExecRequest(shell=cmd, **kw)  # type: ignore[arg-type]
    if isinstance(cmd, Sequence) and all(isinstance(a, str) for a in cmd):
        return ExecRequest(argv=tuple(cmd), **kw)  # type: ignore[arg-type]
    raise InvalidArgument(f"a command is a shell string, a list of strings or an ExecRequest, "
                          f"not {type(cmd).__name__}")


class CreateRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    spec: SandboxSpec
    sandbox_id: str | None = None       # pre-chosen id (must name this node); None = new


class CreateMany(msgspec.Struct, kw_only=True):
    specs: list[SandboxSpec]


class Outcome(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One item of a batch: ``error`` set, or the value in the typed subclass field."""

    error: ErrorBody | None = None


class InfoOutcome(Outcome, kw_only=True, omit_defaults=True):
    info: SandboxInfo | None = None


class ExecOutcome(Outcome, kw_only=True, omit_defaults=True):
    result: ExecResult | None = None


class CreateManyReply(msgspec.Struct, kw_only=True):
    items: list[InfoOutcome]


class SandboxRef(msgspec.Struct, kw_only=True):
    id: str


class SnapshotRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``edge.snapshot``: pack_diff sandbox ``id``; ``strip`` path patterns left out;
    ``max_bytes``: the most the new layer may take (the project's remaining snapshot
    storage quota, from the control plane; None: only the sandbox's own bound)."""

    id: str
    strip: list[str] = []
    max_bytes: int | None = None


class SnapshotRef(msgspec.Struct, kw_only=True):
    """``edge.snapshot_get`` / ``edge.snapshot_delete``: a snapshot ref (sha256:...)."""

    id: str


class SnapshotQuery(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``edge.snapshots``: list, optionally only one project's or one sandbox's."""

    project: str | None = None
    sandbox_id: str | None = None


class DestroyRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    reason: str = "requested"
    detail: str = ""


class DestroyMany(msgspec.Struct, kw_only=True, omit_defaults=True):
    ids: list[str]
    reason: str = "requested"


class ExecCall(msgspec.Struct, kw_only=True):
    id: str
    req: ExecRequest


class ExecMany(msgspec.Struct, kw_only=True):
    calls: list[ExecCall]


class ExecManyReply(msgspec.Struct, kw_only=True):
    items: list[ExecOutcome]


class ReadFileRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    path: str
    offset: int = 0
    length: int | None = None


class WriteFileRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    path: str
    data: bytes
    mode: int = 0o644
    append: bool = False


class FileRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """list_dir, stat, mkdir and remove: a path and the one flag that applies."""

    id: str
    path: str
    parents: bool = True        # mkdir
    recursive: bool = False     # remove


class ListRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    state: SandboxState | None = None
    project: str | None = None
    labels: dict[str, str] = {}


class FeedRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    after: int = 0              # sequence number of the last event already seen
    limit: int = 1000


class EventFeed(msgspec.Struct, kw_only=True):
    """Node-wide events after ``FeedRequest.after``. ``next`` is the cursor for the next
    read; ``lost`` counts events that fell out of the bounded feed before being read."""

    events: list[SandboxEvent]
    next: int
    lost: int = 0


class SandboxBrief(msgspec.Struct, array_like=True, frozen=True):
    """What the control plane needs per sandbox to rebuild its view from heartbeats."""

    id: str
    state: SandboxState
    project: str
    priority: int
    cpu_milli: int
    memory_bytes: int


class HeartbeatRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    include_sandboxes: bool = True


class PoolStats(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """A backend's warm pool (fncall): handouts served warm (``hits``) or cold
    (``misses``) since the edge started, the pool's target ``size`` and how many workers
    are warm now (``ready``)."""

    hits: int = 0
    misses: int = 0
    size: int = 0
    ready: int = 0


class Heartbeat(msgspec.Struct, kw_only=True, omit_defaults=True):
    node: str
    time: float
    capacity: Resources
    usage: Resources
    counts: dict[str, int]          # live sandboxes by state
    labels: dict[str, str] = {}
    images: list[str] = []          # image refs present on the node
    backends: list[str] = []
    feed_seq: int = 0               # last event sequence number (see EventFeed)
    sandboxes: list[SandboxBrief] | None = None
    pools: dict[str, PoolStats] = {}    # backend name -> warm-pool stats (optional capability)
    physical: Resources | None = None   # the machine before overcommit (capacity / physical)


class NodeInfo(msgspec.Struct, kw_only=True):
    node: str
    backends: list[str]
    capacity: Resources
    labels: dict[str, str]
    methods: list[str]
    physical: Resources | None = None


# Every method the edge service exposes (the service checks it registers exactly these).
METHODS: tuple[str, ...] = (
    "edge.info", "edge.create", "edge.create_many", "edge.get", "edge.list", "edge.events",
    "edge.feed", "edge.exec", "edge.exec_many", "edge.exec_stream", "edge.read_file",
    "edge.write_file", "edge.list_dir", "edge.stat", "edge.mkdir", "edge.remove",
    "edge.pause", "edge.resume", "edge.destroy", "edge.destroy_many", "edge.stats",
    "edge.heartbeat", "edge.snapshot", "edge.snapshots", "edge.snapshot_get",
    "edge.snapshot_delete",
)


def outcome_error(exc: BaseException) -> ErrorBody:
    return error_body(exc)


def outcome_value(o: Outcome, value: object) -> object:
    """The value of a batch item, or the DsecError it carried."""
    if o.error is not None:
        e: DsecError = error_from_wire(o.error.code, o.error.message, o.error.detail)
        return e
    return value


def labels_match(have: Mapping[str, str], want: Mapping[str, str]) -> bool:
    return all(have.get(k) == v for k, v in want.items())
