"""The one interface every sandbox backend implements (simulated, fncall, container, runc, vm).

The :class:`~dsec.edge.node.EdgeNode` owns lifecycle, admission and events; a backend only
does the work. Backends report deaths they notice on their own (OOM kill, init exited,
worker crashed) through the ``sink`` given to :meth:`Backend.watch`, so the node can
record a final event with the reason.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from dsec.ids import SandboxId
from dsec.wire.spec import (
    BackendName,
    ExecChunk,
    ExecRequest,
    ExecResult,
    FileInfo,
    PauseStats,
    SandboxSpec,
    SandboxStats,
    SnapshotInfo,
)

__all__ = ["Backend", "DeathSink", "Leftover", "ReconcilingBackend", "SnapshotBackend"]

# sink(sandbox_id, reason, detail). A reason in lifecycle.FINAL_REASONS ("oom",
# "backend_crash", "exited", ...) means the sandbox is dead; a reason in
# lifecycle.NOTICE_REASONS ("oom_kill": one process was OOM-killed) means it lives on.
DeathSink = Callable[[SandboxId, str, str], None]


@runtime_checkable
class Backend(Protocol):
    name: str

    def watch(self, sink: DeathSink) -> None:
        """Register where to report sandboxes that died on their own."""

    async def create(self, sid: SandboxId, spec: SandboxSpec) -> None:
        """Make the sandbox exec-ready. On failure, leave nothing behind and raise."""

    async def adopt(self, sid: SandboxId, spec: SandboxSpec) -> bool:
        """After an edge restart: take back a sandbox created earlier; False if it is gone."""

    async def exec(self, sid: SandboxId, req: ExecRequest) -> ExecResult: ...

    def exec_stream(self, sid: SandboxId, req: ExecRequest) -> AsyncIterator[ExecChunk | ExecResult]:
        """Yield output chunks as they come, then exactly one final ExecResult
        (whose stdout/stderr are empty: the data went out as chunks)."""

    async def read_file(self, sid: SandboxId, path: str, *, offset: int = 0,
                        length: int | None = None) -> bytes: ...

    async def write_file(self, sid: SandboxId, path: str, data: bytes, *, mode: int = 0o644,
                         append: bool = False) -> None: ...

    async def list_dir(self, sid: SandboxId, path: str) -> list[FileInfo]: ...

    async def stat(self, sid: SandboxId, path: str) -> FileInfo: ...

    async def mkdir(self, sid: SandboxId, path: str, *, parents: bool = True) -> None: ...

    async def remove(self, sid: SandboxId, path: str, *, recursive: bool = False) -> None: ...

    async def pause(self, sid: SandboxId) -> PauseStats: ...

    async def resume(self, sid: SandboxId) -> None:
        """Thaw a paused sandbox. A cheap no-op for one that is not paused: the node
        calls it on every sandbox it adopts as running (a crash mid-pause or mid-snapshot
        can leave one frozen)."""

    async def destroy(self, sid: SandboxId) -> None:
        """Kill everything and release every resource; idempotent."""

    async def stats(self, sid: SandboxId) -> SandboxStats: ...

    async def close(self) -> None:
        """Node shutdown: release backend-wide resources (pools, helper processes)."""


@runtime_checkable
class SnapshotBackend(Protocol):
    """Optional capability: pack_diff snapshots (container, simulated).

    The node checks for it with ``isinstance(backend, SnapshotBackend)`` and answers
    ``Conflict`` for backends without it (fncall). Snapshot refs are ``sha256:<hex>``
    (a unique prefix of >= 12 hex digits is accepted); unknown ones raise
    ``ImageNotFound``. ``create(spec)`` with ``spec.snapshot`` starts from one.
    """

    async def snapshot(self, sid: SandboxId, *, strip: tuple[str, ...] = (),
                       max_bytes: int | None = None) -> SnapshotInfo:
        """Capture what ``sid`` changed since its previous snapshot (or since its image);
        an unchanged sandbox returns the previous snapshot with ``unchanged=True``.
        Works on running and paused sandboxes and leaves the state as it was. A new
        layer over ``max_bytes`` is refused with ``QuotaExceeded`` and not stored."""

    async def snapshots(self) -> list[SnapshotInfo]:
        """Every snapshot this backend can start sandboxes from."""

    async def snapshot_info(self, ref: str) -> SnapshotInfo: ...

    async def delete_snapshot(self, ref: str) -> SnapshotInfo:
        """Remove one; ``InUse`` while a sandbox runs from it or a snapshot builds on it."""


@dataclass(frozen=True, slots=True)
class Leftover:
    """What a backend found (and removed) on the host for a sandbox the node does not own."""

    sandbox_id: str
    backend: BackendName               # the backend's name
    what: str                          # e.g. "directory, 5 cgroup(s), 1 process(es)"
    spec: SandboxSpec | None = None    # as recorded on the host, if it was


@runtime_checkable
class ReconcilingBackend(Protocol):
    """Optional capability of backends that leave state on the host (container, runc,
    fncall): after a crash the node's journal and the host may disagree.

    At start, once the node has adopted what its journal holds, it calls
    :meth:`reconcile` with the ids it owns; the backend removes every trace of any other
    sandbox (processes, cgroups, mounts, directories, runtime state) and says what it
    removed, so the node can record a tombstone with the reason. :meth:`discard` does the
    same for one id the node has no record of (``destroy`` of such an id)."""

    async def reconcile(self, keep: AbstractSet[str]) -> list[Leftover]: ...

    async def discard(self, sid: SandboxId) -> Leftover | None: ...


async def replay_as_stream(res: ExecResult) -> AsyncIterator[ExecChunk | ExecResult]:
    """``exec_stream`` for backends that only learn the output at the end: the captured
    output as (at most) two chunks, then the result with its output moved out."""
    if res.stdout:
        yield ExecChunk(stream="stdout", data=res.stdout)
    if res.stderr:
        yield ExecChunk(stream="stderr", data=res.stderr)
    res.stdout = res.stderr = b""
    yield res
