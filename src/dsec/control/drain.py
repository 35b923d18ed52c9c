"""Drained edge nodes: taken out of placement by an administrator before maintenance.

``dsec node drain ID`` records the node in the state store (``node_drains``); every
apiserver replica excludes drained nodes from placement, and the sandboxes already on a
drained node keep running until they end (their edge still serves them). The record
outlives an apiserver restart and is shared by replicas over one store; each replica
re-reads it at most every ``refresh_s`` (a drain made on one replica binds the others
within that time, as quotas do), and at once on the replica that made it.

Moving the sandboxes off (``--migrate``: snapshot, start from the snapshot elsewhere,
end the original) is :mod:`dsec.control.migrate`; see docs/deploy.md "Draining an edge".
"""

from __future__ import annotations

from collections.abc import Callable

from dsec.control.store import NodeDrainRow, StateStore

__all__ = ["Drains"]


class Drains:
    """This replica's copy of the drained nodes (the store is the truth)."""

    def __init__(self, store: StateStore, *, clock: Callable[[], float],
                 refresh_s: float) -> None:
        self._store = store
        self._clock = clock
        self._refresh_s = refresh_s
        self._rows: dict[str, NodeDrainRow] = {}
        self._read_at = float("-inf")
        self._nodes: frozenset[str] = frozenset()

    def _fresh(self) -> None:
        now = self._clock()
        if now - self._read_at < self._refresh_s:
            return
        self._read_at = now
        self._set(self._store.list_drains())

    def _set(self, rows: list[NodeDrainRow]) -> None:
        self._rows = {r.node: r for r in rows}
        self._nodes = frozenset(self._rows)

    def nodes(self) -> frozenset[str]:
        """The drained node ids (what placement must not pick)."""
        self._fresh()
        return self._nodes

    def get(self, node: str) -> NodeDrainRow | None:
        self._fresh()
        return self._rows.get(node)

    def drain(self, node: str, *, by: str) -> NodeDrainRow:
        """Drain ``node`` (again: unchanged, its first ``drained_at`` kept). Durable
        before it returns: the store row is written, then this copy re-read."""
        self._store.put_drain(NodeDrainRow(node=node, drained_at=self._clock(), by=by))
        self._read_at = self._clock()
        self._set(self._store.list_drains())
        row = self._rows.get(node)
        assert row is not None, f"drain of {node} was written but not read back"
        return row

    def undrain(self, node: str) -> bool:
        """Undrain ``node``; False if it was not drained."""
        gone = self._store.delete_drain(node)
        self._read_at = self._clock()
        self._set(self._store.list_drains())
        return gone
