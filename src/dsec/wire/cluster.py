"""Cluster administration's vocabulary (issue 16): join tokens and joined edge nodes, as
the catalogue's ``cluster_*`` rows carry them through every door (REST, the Aether
gateway, both SDK transports). The join and rejoin requests themselves are the edges'
(anonymous, :mod:`dsec.cluster.join`)."""

from __future__ import annotations

import msgspec

from dsec.wire.calls import _Call
from dsec.wire.spec import check_id

__all__ = ["JoinTokenCreate", "JoinTokenList", "JoinTokenRevoke", "JoinTokenView",
           "JoinedNode", "JoinedNodeList", "Migrated", "NodeMigration"]


class JoinTokenCreate(_Call, kw_only=True):
    """``cluster_token_create``: a token good for ``uses`` joins within ``ttl_s``."""

    ttl_s: float = 86400.0
    uses: int = 1
    description: str = ""


class JoinTokenView(msgspec.Struct, frozen=True, kw_only=True):
    """A join token as stored; ``token`` (the secret, ``<id>.<secret>.<ca-sha256>``) only
    in the answer to its creation."""

    id: str
    uses: int
    used: int
    created_at: float
    expires_at: float
    revoked: bool
    description: str
    token: str | None = None


class JoinTokenList(msgspec.Struct, kw_only=True):
    items: list[JoinTokenView]


class JoinTokenRevoke(_Call, kw_only=True):
    """``cluster_token_revoke``: no more joins with token ``id``; ``nodes``: also revoke
    every node that joined with it (their sandboxes are written off)."""

    id: str
    nodes: bool = False

    def __post_init__(self) -> None:
        check_id(self.id)


class JoinedNode(msgspec.Struct, frozen=True, kw_only=True):
    """An edge that joined with a token: where the replicas dial it, its certificate."""

    node_id: str
    address: str
    cert_fingerprint: str
    token_id: str
    joined_at: float
    revoked: bool


class JoinedNodeList(msgspec.Struct, kw_only=True):
    items: list[JoinedNode]


class Migrated(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One sandbox of a drained node: moved (``new_id`` runs from ``snapshot_id`` on
    another node; the original ended with reason ``migrated``) or not (``error`` says why:
    it stays where it is, and another run tries again)."""

    sandbox_id: str
    new_id: str | None = None
    snapshot_id: str | None = None
    error: str = ""


class NodeMigration(msgspec.Struct, kw_only=True):
    """``node_migrate``: what moved off ``node``."""

    node: str
    items: list[Migrated]
