"""The shared vocabulary: every record that crosses a door, and (issue 13) the catalogue
of operations built from them.

This is the ground floor above :mod:`dsec.errors` and :mod:`dsec.ids`: it imports
``msgspec`` and the standard library, nothing that does I/O, so the SDK, the control
plane, the edge and the Aether protocol all speak it without importing each other.

- :mod:`dsec.wire.spec`: the sandbox spec, its records (info, events, exec, files,
  snapshots) and every ``MAX_*`` limit.
- :mod:`dsec.wire.calls`: the request bodies of the edge methods.
- :mod:`dsec.wire.node`: what a node says about itself (info, heartbeats, event feed).
- :mod:`dsec.wire.outcome`: errors as data and batch items.
- :mod:`dsec.wire.api`: the REST/gateway types of the management plane.
"""

from __future__ import annotations

from dsec.wire.outcome import ErrorBody
from dsec.wire.spec import (
    ExecChunk,
    ExecRequest,
    ExecResult,
    FileInfo,
    NetworkPolicy,
    PauseStats,
    SandboxEvent,
    SandboxInfo,
    SandboxSpec,
    SandboxStats,
    SnapshotInfo,
)

__all__ = [
    "ErrorBody",
    "ExecChunk",
    "ExecRequest",
    "ExecResult",
    "FileInfo",
    "NetworkPolicy",
    "PauseStats",
    "SandboxEvent",
    "SandboxInfo",
    "SandboxSpec",
    "SandboxStats",
    "SnapshotInfo",
]
