"""The largest sandbox this cluster could ever hold: refuse the impossible at create time.

Placement answers "no node has room *now*" (``NoCapacity``, 503: retry later). A request
larger than every node's whole capacity is a different answer: no retry can help, the
caller must ask for less. :class:`Ceiling` keeps each node's size (from its heartbeats:
capacity after overcommit, and the physical machine before it) and raises
:class:`~dsec.errors.Unsatisfiable` (400) with the largest offer, so both doors (REST and
the Aether gateway, which share ``ApiService.create``) refuse it the same way before a
quota charge or a placement attempt is made. The edge checks the same rule on its own
capacity (``ResourcePool.check_fits``) for callers that reach it directly.

Pure: no I/O. A check walks the distinct node sizes offering the backend (a cluster has
few distinct machine shapes), largest memory first, so the usual answer is the first.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsec.errors import Unsatisfiable
from dsec.wire.node import Resources, describe_request, format_amount, too_big

__all__ = ["Ceiling", "NodeSize"]


@dataclass(frozen=True, slots=True)
class NodeSize:
    """What one node could hold if it were empty."""

    node: str
    backends: frozenset[str]
    capacity: Resources                 # after overcommit (what admission uses)
    physical: Resources | None = None   # before overcommit, when the edge reports it


class Ceiling:
    """Node sizes by node; :meth:`check` refuses a request no node could ever hold."""

    def __init__(self) -> None:
        self._nodes: dict[str, NodeSize] = {}
        self._by_backend: dict[str, list[NodeSize]] = {}

    def update(self, size: NodeSize) -> None:
        """Record ``size`` (from a heartbeat); O(1) when nothing changed."""
        if self._nodes.get(size.node) != size:
            self._nodes[size.node] = size
            self._by_backend.clear()

    def remove(self, node: str) -> None:
        if self._nodes.pop(node, None) is not None:
            self._by_backend.clear()

    def _sizes(self, backend: str) -> list[NodeSize]:
        sizes = self._by_backend.get(backend)
        if sizes is None:
            seen: dict[tuple[Resources, Resources | None], NodeSize] = {}
            for s in self._nodes.values():
                if backend in s.backends:
                    seen.setdefault((s.capacity, s.physical), s)
            sizes = self._by_backend[backend] = sorted(
                seen.values(), key=lambda s: (-s.capacity.memory_bytes, -s.capacity.cpu_milli,
                                              s.node))
        return sizes

    def check(self, *, backend: str, cpu_milli: int, memory_bytes: int,
              disk_bytes: int | None = None) -> None:
        """Return if some node offering ``backend`` could hold the request when empty
        (or no node has reported yet: nothing is known to refuse on); otherwise raise
        :class:`Unsatisfiable` naming the resource, the request and the largest offer."""
        sizes = self._sizes(backend)
        if not sizes:
            return
        for s in sizes:
            if not too_big(s.capacity, s.physical, cpu_milli=cpu_milli,
                           memory_bytes=memory_bytes, disk_bytes=disk_bytes):
                return
        # No single node fits. Name a resource that no node has enough of, with the
        # node that offers the most of it; else the request only fails as a whole.
        for field in ("memory_bytes", "cpu_milli", "disk_bytes"):
            want = {"cpu_milli": cpu_milli, "memory_bytes": memory_bytes,
                    "disk_bytes": disk_bytes}[field]
            if want is None:
                continue
            best = max(sizes, key=lambda s: _amount(s.capacity, field))
            over = [o for o in too_big(best.capacity, best.physical, cpu_milli=cpu_milli,
                                       memory_bytes=memory_bytes, disk_bytes=disk_bytes)
                    if o[0] == field]
            if over:
                _, has, _, most = over[0]
                pooled = field != "disk_bytes"
                raise Unsatisfiable(
                    f"{describe_request(field, want)} is more than any node of this cluster "
                    f"could ever hold (largest: {best.node} with {has}"
                    f"{' for all its sandboxes' if pooled else ''}); ask for at most "
                    f"{format_amount(field, most)}",
                    field=field, requested=want, most=most, node=best.node)
        offers = "; ".join(
            f"{s.node}: {format_amount('cpu_milli', s.capacity.cpu_milli)}, "
            f"{format_amount('memory_bytes', s.capacity.memory_bytes)}" for s in sizes[:5])
        raise Unsatisfiable(
            f"no single node of this cluster could ever hold "
            f"{describe_request('cpu_milli', cpu_milli)} and "
            f"{describe_request('memory_bytes', memory_bytes)} together ({offers}); "
            "ask for less of one of them", field="memory_bytes", requested=memory_bytes)


def _amount(r: Resources, field: str) -> int:
    value = getattr(r, field)
    return int(value) if value is not None else -1
