"""Identifiers that carry meaning.

A :data:`SandboxId` encodes the :data:`NodeId` of the edge that owns the sandbox
(``sb-<12 hex>-<node>``), so any apiserver replica or SDK can route an operation to the
right edge from the id alone, without a lookup (DESIGN.md, "the two planes").
"""

from __future__ import annotations

import re
import secrets
from typing import NewType

from dsec.errors import InvalidArgument

__all__ = [
    "ImageRef",
    "NodeId",
    "ProjectPath",
    "SandboxId",
    "new_sandbox_id",
    "node_of",
    "parse_node_id",
    "parse_project_path",
    "parse_sandbox_id",
    "project_ancestors",
]

NodeId = NewType("NodeId", str)
SandboxId = NewType("SandboxId", str)
ProjectPath = NewType("ProjectPath", str)
ImageRef = NewType("ImageRef", str)

_NODE_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_TOKEN_LEN = 12
_SANDBOX_RE = re.compile(rf"sb-([0-9a-f]{{{_TOKEN_LEN}}})-(.+)")
_PROJECT_PART_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")


def parse_node_id(text: str) -> NodeId:
    """Validate a node id: lowercase letters, digits and inner dashes, at most 63 chars."""
    if not isinstance(text, str) or not _NODE_RE.fullmatch(text):
        raise InvalidArgument(
            f"invalid node id {text!r}: use 1-63 lowercase letters, digits and inner '-'"
        )
    return NodeId(text)


def new_sandbox_id(node: NodeId, token: str | None = None) -> SandboxId:
    """A fresh sandbox id owned by ``node``; ``token`` (12 hex) is for deterministic tests."""
    tok = secrets.token_hex(_TOKEN_LEN // 2) if token is None else token
    return SandboxId(f"sb-{tok}-{node}")


def parse_sandbox_id(text: str) -> SandboxId:
    """Validate ``text`` as a sandbox id (``sb-<12 hex>-<node id>``)."""
    m = _SANDBOX_RE.fullmatch(text) if isinstance(text, str) else None
    if m is None or not _NODE_RE.fullmatch(m.group(2)):
        raise InvalidArgument(
            f"invalid sandbox id {text!r}: expected 'sb-<12 hex digits>-<node id>'"
        )
    return SandboxId(text)


def node_of(sandbox_id: str) -> NodeId:
    """The node that owns ``sandbox_id`` (validates the id)."""
    parse_sandbox_id(sandbox_id)
    return NodeId(sandbox_id[4 + _TOKEN_LEN :])


def parse_project_path(text: str) -> ProjectPath:
    """Validate a project path such as ``org/team/exp1`` (1-16 levels)."""
    parts = text.split("/") if isinstance(text, str) else []
    if not parts or len(parts) > 16 or not all(_PROJECT_PART_RE.fullmatch(p) for p in parts):
        raise InvalidArgument(
            f"invalid project path {text!r}: use '/'-separated lowercase names like 'org/team/exp1'"
        )
    return ProjectPath(text)


def project_ancestors(path: ProjectPath) -> list[ProjectPath]:
    """``org/team/exp1`` -> ``[org, org/team, org/team/exp1]`` (root first, self last)."""
    parts = path.split("/")
    return [ProjectPath("/".join(parts[: i + 1])) for i in range(len(parts))]
