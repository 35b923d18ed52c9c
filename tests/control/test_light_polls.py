"""Polls between full sandbox lists (PlaneConfig.sandbox_list_interval_s): the light
heartbeat plus the event feed keep the node's sandbox list without asking the edge for
all of it, so a poll costs O(changes), not O(live sandboxes) (issue 16, the cluster
bench's 50-100k slowdown). A real edge over Aether; the clock is injected."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dsec.control.api.plane import ControlPlane, PlaneConfig
from dsec.control.metrics import ApiMetrics
from dsec.control.store import open_store
from dsec.edge.client import EdgeClient
from dsec.wire.spec import SandboxSpec
from tests.control.conftest import FakeClock, served_edge


class CountingLink:
    """The real edge link, counting the heartbeats that asked for the whole list."""

    def __init__(self, link: EdgeClient) -> None:
        self._link = link
        self.full = 0

    async def heartbeat(self, *, include_sandboxes: bool = False, **kw: Any) -> Any:
        self.full += include_sandboxes
        return await self._link.heartbeat(include_sandboxes=include_sandboxes, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._link, name)


async def test_light_polls_follow_the_feed_and_list_on_schedule(tmp_path: Path,
                                                                store_url: str) -> None:
    clock = FakeClock()
    store = open_store(store_url)
    plane = ControlPlane.open(store, metrics=ApiMetrics(), clock=clock,
                              config=PlaneConfig(sandbox_list_interval_s=60.0))
    async with served_edge(tmp_path, node="e0") as edge:
        link = CountingLink(await EdgeClient.connect(edge.addr))
        plane.add_edge("e0", edge.addr, link)  # type: ignore[arg-type]
        try:
            a = [await edge.node.create(SandboxSpec(backend="simulated")) for _ in range(3)]
            await plane.poll_edges()                  # first poll: the whole list
            e = plane.edges["e0"]
            assert link.full == 1 and {s.id for s in e.live} == {i.id for i in a}
            listed = e.live

            clock.t += 1
            await plane.poll_edges()                  # nothing changed: light, same tuple
            assert link.full == 1 and e.live is listed

            await edge.node.destroy(a[0].id)
            await edge.node.pause(a[1].id)
            b = await edge.node.create(SandboxSpec(backend="simulated"))
            clock.t += 1
            await plane.poll_edges()                  # light: the feed's end and pause
            assert link.full == 1
            assert {s.id: s.paused for s in e.live} == {a[1].id: True, a[2].id: False}
            view = {n.id: n for n in plane.nodes()}["e0"]
            assert view.sandboxes == 3                # the heartbeat's own count is fresh
            assert plane.watcher.validate_state() is None

            clock.t += 60                             # the interval passed: a full list
            await plane.poll_edges()
            assert link.full == 2
            assert {s.id for s in e.live} == {a[1].id, a[2].id, b.id}
            # learnt from the list, as before; made behind the control plane's back (no
            # record of it in the store), it is quarantined, not charged (red team 16 F10)
            assert b.id not in plane.registry and b.id in plane.quarantined("e0")
        finally:
            await plane.close()
            await link.close()
            store.close()


async def test_default_lists_every_5_s_and_0_at_every_poll(tmp_path: Path,
                                                           store_url: str) -> None:
    """The default: a full list at the first poll, then light polls until 5 s passed
    (another replica's sandboxes come from the store watch, not from these lists);
    0 lists at every poll."""
    clock = FakeClock()
    store = open_store(store_url)
    plane = ControlPlane.open(store, metrics=ApiMetrics(), clock=clock)
    every = ControlPlane.open(store, metrics=ApiMetrics(), clock=clock,
                              config=PlaneConfig(sandbox_list_interval_s=0.0))
    async with served_edge(tmp_path, node="e0") as edge:
        link = CountingLink(await EdgeClient.connect(edge.addr))
        link0 = CountingLink(await EdgeClient.connect(edge.addr))
        plane.add_edge("e0", edge.addr, link)  # type: ignore[arg-type]
        every.add_edge("e0", edge.addr, link0)  # type: ignore[arg-type]
        try:
            for _ in range(5):
                await plane.poll_edges()
                await every.poll_edges()
                clock.t += 1
            assert link.full == 1 and link0.full == 5
            await plane.poll_edges()                  # 5 s since the first list
            assert link.full == 2
        finally:
            await plane.close()
            await every.close()
            await link.close()
            await link0.close()
            store.close()
