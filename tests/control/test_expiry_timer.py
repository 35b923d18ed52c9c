"""Node loss has its own timer: a partitioned edge (its poll hangs: no reset, no answer)
is written off ``node_ttl_s`` after its last answer, while the other edges keep being
polled; before, every poll round waited for the slowest poll (up to ``poll_timeout_s``)
and expiry waited for the round. A poll in flight on a link that keeps carrying other
replies (a busy edge) still holds the node (issue 12). The links are fakes (the boundary
the plane polls through); the plane, its loops, store and watcher are real."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from dsec.control.api.plane import ControlPlane, PlaneConfig
from dsec.control.metrics import ApiMetrics
from dsec.control.store.sqlite import SqliteStore
from dsec.errors import Timeout
from dsec.wire.node import EventFeed, Heartbeat, Resources


class _Conn:
    closed = False

    def __init__(self) -> None:
        self.last_received = 0.0


class _Link:
    """Answers heartbeats until ``hang`` is set; then its polls never return. With
    ``chatty`` its connection keeps receiving other replies meanwhile."""

    def __init__(self, node: str, *, chatty: bool = False) -> None:
        self.node = node
        self.hang = asyncio.Event()
        self.heartbeats = 0
        self.conn = _Conn() if chatty else None

    async def heartbeat(self, *, timeout: float | None = None, **kw: Any) -> Heartbeat:
        if self.hang.is_set():      # no answer: the call's deadline passes, as on a link
            try:
                await asyncio.wait_for(asyncio.Event().wait(), timeout)
            except TimeoutError:
                raise Timeout(f"edge {self.node} did not answer within {timeout}s") from None
        self.heartbeats += 1
        res = Resources(cpu_milli=1000, memory_bytes=1 << 30, sandboxes=100)
        return Heartbeat(node=self.node, time=time.time(), capacity=res, usage=Resources(),
                         counts={}, backends=["simulated"], sandboxes=[])

    async def feed(self, after: int = 0, limit: int = 1000, **kw: Any) -> EventFeed:
        return EventFeed(events=[], next=0)

    async def close(self) -> None:
        return None


async def _plane(tmp_path: Path, links: list[_Link]) -> ControlPlane:
    plane = ControlPlane.open(SqliteStore(str(tmp_path / "control.sqlite")),
                              metrics=ApiMetrics(),
                              config=PlaneConfig(heartbeat_interval_s=0.1, node_ttl_s=0.5,
                                                 poll_timeout_s=60.0))
    for link in links:
        plane.add_edge(link.node, f"unix:/nonexistent/{link.node}", link)  # type: ignore[arg-type]
    await plane.start()
    return plane


async def test_a_partitioned_edge_is_lost_at_its_ttl_while_the_others_are_polled(
        tmp_path: Path) -> None:
    ok, cut = _Link("ok"), _Link("cut")
    plane = await _plane(tmp_path, [ok, cut])
    try:
        cut.hang.set()
        seen = ok.heartbeats
        for _ in range(100):            # well under the 60 s poll deadline
            if plane.watcher.is_expired("cut"):
                break
            await asyncio.sleep(0.05)
        assert plane.watcher.is_expired("cut"), "the silent edge was not expired"
        assert not plane.watcher.is_expired("ok")
        assert ok.heartbeats > seen, "the hung poll held up the other edge's polls"
        assert {v.id: v.status for v in plane.nodes()} == {"ok": "healthy", "cut": "lost"}
    finally:
        await plane.close()
        plane.store.close()


async def test_a_busy_edge_whose_poll_is_in_flight_is_held_not_lost(tmp_path: Path) -> None:
    busy = _Link("busy", chatty=True)
    plane = await _plane(tmp_path, [busy])

    async def replies() -> None:        # its link keeps carrying other calls' replies
        loop = asyncio.get_running_loop()
        while True:
            assert busy.conn is not None
            busy.conn.last_received = loop.time()
            await asyncio.sleep(0.05)
    chat = asyncio.create_task(replies())
    try:
        busy.hang.set()
        await asyncio.sleep(2.0)        # four TTLs with its poll in flight
        assert not plane.watcher.is_expired("busy")
    finally:
        chat.cancel()
        await plane.close()
        plane.store.close()
