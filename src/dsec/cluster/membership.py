"""Dynamic edge membership: every apiserver replica dials every joined edge.

The apiserver's edges are its static ``--edge`` flags plus the rows of the ``nodes``
table that are not revoked (:mod:`dsec.control.store.membership`). :class:`Membership`
re-reads the table every ``interval_s`` (a SELECT of a few rows; replicas on PostgreSQL
see each other's joins and revocations within that interval) and brings the control
plane in step:

- a new row: dialled over mutual TLS (:class:`EdgeTls`: the CA pinned, the node id as
  the TLS hostname, the certificate's fingerprint checked against the denylist right
  after the handshake, the edge's hello checked to name the same node) and added to the
  plane, which then polls it like any local edge (heartbeats, the TTL, reconciliation);
- a row whose address changed (the edge rejoined from elsewhere): its link is closed,
  and the plane's reconnect dials the new address;
- a revoked row: the edge is removed from the plane, its link cut, and every sandbox
  recorded on it written off with reason ``node_revoked`` (an event each).

The denylist (every fingerprint ever revoked) is shared by all :class:`EdgeTls` of the
process, so a reconnect to a revoked edge is refused even between two re-reads.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass, field
from typing import Any

from dsec.cluster.ca import ClusterCA, cert_fingerprint
from dsec.errors import ConnectionLost, DsecError, PermissionDenied

__all__ = ["EdgeTls", "Membership", "Unreachable"]

log = logging.getLogger("dsec.cluster.membership")

# How often each replica re-reads the nodes table. 1 s: a join or revocation reaches
# every replica within about a second plus one dial; the read is one indexed SELECT.
SYNC_INTERVAL_S = 1.0


@dataclass(slots=True)
class EdgeTls:
    """How the apiserver dials joined edge ``node_id`` (see :meth:`EdgeClient.connect`)."""

    node_id: str
    context: ssl.SSLContext
    denied: set[str] = field(default_factory=set)   # shared: revoked fingerprints

    def check_peer(self, der: bytes) -> None:
        fp = cert_fingerprint(der)
        if fp in self.denied:
            raise PermissionDenied(f"edge {self.node_id} presented a revoked certificate "
                                   f"(sha256 {fp[:16]}...): refused")


class Unreachable:
    """The connection of an edge that could not be dialled: every call fails with a
    clear error, and ``closed`` makes the control plane's poll keep redialling it."""

    closed = True

    def __init__(self, node: str, address: str, why: str) -> None:
        self._why = f"edge {node} at {address} is unreachable: {why}"

    async def call(self, *_: Any, **__: Any) -> Any:
        raise ConnectionLost(self._why)

    def stream(self, *_: Any, **__: Any) -> Any:
        raise ConnectionLost(self._why)

    async def close(self) -> None:
        return None


class Membership:
    """Keeps ``plane.edges`` in step with the ``nodes`` table (module docstring)."""

    def __init__(self, store: Any, plane: Any, ca: ClusterCA, *,
                 static: frozenset[str] = frozenset(),
                 interval_s: float = SYNC_INTERVAL_S, dial_timeout_s: float = 5.0) -> None:
        self.store = store
        self.plane = plane
        self.context = ca.client_context()
        self.static = static
        self.interval_s = interval_s
        self.dial_timeout_s = dial_timeout_s
        self.denied: set[str] = set()
        self.clients: list[Any] = []
        self._warned: set[str] = set()

    async def sync(self) -> None:
        """One re-read of the table, carried out."""
        rows = self.store.list_nodes()
        self.denied.clear()
        self.denied.update(self.store.revoked_fingerprints())
        new: list[Any] = []
        for row in rows:
            if row.node_id in self.static:
                if row.node_id not in self._warned:
                    self._warned.add(row.node_id)
                    log.warning("joined node %s has the id of a static edge of this "
                                "apiserver: ignored here", row.node_id)
                continue
            e = self.plane.edges.get(row.node_id)
            if row.revoked:
                if e is not None and e.tls is not None and not e.revoked:
                    await self.plane.revoke_edge(
                        row.node_id, reason="node_revoked",
                        detail=f"node {row.node_id} was revoked from the cluster "
                               "(`dsec cluster node revoke`); its sandboxes are written off")
                continue
            if e is None or (e.revoked and e.tls is not None):
                new.append(row)          # new, or the id joined again after a revocation
            elif e.tls is not None and e.address != row.address:
                log.info("joined edge %s moved from %s to %s", row.node_id, e.address,
                         row.address)
                e.address = row.address
                e.retry_at = 0.0
                try:
                    await e.link.close()   # the plane's next poll dials the new address
                except DsecError:
                    pass
        # dialled at once: one unreachable edge must not hold up the others' joins
        await asyncio.gather(*(self._add(row) for row in new))

    async def _add(self, row: Any) -> None:
        from dsec.edge.client import EdgeClient

        tls = EdgeTls(row.node_id, self.context, self.denied)
        try:
            async with asyncio.timeout(self.dial_timeout_s):
                client = await EdgeClient.connect(row.address, tls=tls)
        except (DsecError, TimeoutError) as exc:
            log.warning("joined edge %s at %s is not reachable yet (%s); will keep trying",
                        row.node_id, row.address, exc)
            client = EdgeClient(Unreachable(row.node_id, row.address, str(exc)))  # type: ignore[arg-type]
        self.clients.append(client)
        self.plane.add_edge(row.node_id, row.address, client, tls=tls)
        log.info("joined edge %s at %s added", row.node_id, row.address)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sync()
            except Exception:
                log.exception("membership re-read failed; trying again in %.1fs",
                              self.interval_s)
