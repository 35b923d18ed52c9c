"""Records the control-plane modules share.

:class:`SandboxRecord` is the management plane's summary of one sandbox: enough to
charge quotas, to evict it when its node is lost and to pick preemption victims. It is
self-contained on purpose (the edge has its own richer ``SandboxInfo``); the apiserver
converts between them. ``spec`` (optional) is the create request as the edge accepted it:
the registry keeps it so ``GET /v1/sandboxes`` (list, filter by labels) is answered from
the control plane without asking every edge.
"""

from __future__ import annotations

from typing import Any

import msgspec

from dsec.wire.spec import DEFAULT_CPU_MILLI, DEFAULT_MEMORY_BYTES, SandboxSpec

__all__ = ["SandboxRecord"]


class SandboxRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One live sandbox as the control plane sees it.

    Fields: ``id`` (sandbox id, encodes the node), ``node`` (owning edge), ``project``
    (path such as ``org/team/exp1``), ``backend`` (edge backend name), ``cpu_milli`` and
    ``memory_bytes`` (the reservation), ``priority`` (higher wins preemption),
    ``created_at`` (seconds, the caller's clock), ``paused`` (frozen, memory handed back),
    ``spec`` (the full spec, for listing; None where only the summary is known).
    """

    id: str
    node: str
    project: str
    backend: str = "simulated"
    cpu_milli: int = DEFAULT_CPU_MILLI
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    priority: int = 0
    created_at: float = 0.0
    paused: bool = False
    spec: SandboxSpec | None = None

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SandboxRecord:
        return msgspec.convert(d, cls)
