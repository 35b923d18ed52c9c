"""Request bodies of the edge methods on Aether (msgspec msgpack structs).

Method names are ``edge.<operation>``; :mod:`dsec.edge.service` binds them to an
:class:`~dsec.edge.node.EdgeNode` and :class:`~dsec.edge.service.EdgeClient` calls them.
Replies are records of :mod:`dsec.wire.spec`, :mod:`dsec.wire.node` and, for batches,
:mod:`dsec.wire.outcome` (one outcome per item).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from dsec.errors import InvalidArgument
from dsec.wire.spec import ExecRequest, SandboxSpec, SandboxState

__all__ = [
    "METHODS",
    "Command",
    "CreateMany",
    "CreateRequest",
    "DestroyMany",
    "DestroyRequest",
    "ExecCall",
    "ExecMany",
    "FeedRequest",
    "FileRequest",
    "HeartbeatRequest",
    "ListRequest",
    "ReadFileRequest",
    "SandboxRef",
    "SnapshotQuery",
    "SnapshotRef",
    "SnapshotRequest",
    "WriteFileRequest",
    "exec_request",
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


class HeartbeatRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    include_sandboxes: bool = True


# Every method the edge service exposes (the service checks it registers exactly these).
METHODS: tuple[str, ...] = (
    "edge.info", "edge.create", "edge.create_many", "edge.get", "edge.list", "edge.events",
    "edge.feed", "edge.exec", "edge.exec_many", "edge.exec_stream", "edge.read_file",
    "edge.write_file", "edge.list_dir", "edge.stat", "edge.mkdir", "edge.remove",
    "edge.pause", "edge.resume", "edge.destroy", "edge.destroy_many", "edge.stats",
    "edge.heartbeat", "edge.snapshot", "edge.snapshots", "edge.snapshot_get",
    "edge.snapshot_delete",
)
