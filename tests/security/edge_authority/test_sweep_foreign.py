"""The session sweeper destroys a sandbox on the node its id names: an edge listing
another node's sandbox under a dead session must not get it destroyed there (red team
16, F3's class, in the sweeper). The edge links are fakes (the boundary the sweeper
talks through); the plane, its store and the sweeper's plan are real.

The sweeper does not list edges (it visits lapsed sessions in the registry, and the
quarantined sandboxes the heartbeats showed without a record): the edges' listings
reach it through a poll, as in a running apiserver."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dsec.control.api.plane import ControlPlane, PlaneConfig
from dsec.control.metrics import ApiMetrics
from dsec.control.store.sqlite import SqliteStore
from dsec.control.sweeper import SESSION_LABEL
from dsec.wire.node import EventFeed, Heartbeat, Resources, SandboxBrief
from dsec.wire.spec import SandboxInfo, SandboxSpec


class _Link:
    def __init__(self, infos: list[SandboxInfo]) -> None:
        self.infos = infos
        self.destroyed: list[str] = []

    async def list(self) -> list[SandboxInfo]:
        return self.infos

    async def heartbeat(self, **kw: Any) -> Heartbeat:
        res = Resources(cpu_milli=1000, memory_bytes=1 << 30, sandboxes=100)
        return Heartbeat(node="x", time=2.0, capacity=res, usage=res, counts={},
                         backends=["simulated"], sandboxes=[
                             SandboxBrief(i.id, i.state, "p", 0, 0, 0)
                             for i in sorted(self.infos, key=lambda i: i.id)])

    async def feed(self, after: int = 0, limit: int = 1000, **kw: Any) -> EventFeed:
        return EventFeed(events=[], next=0)

    async def get(self, sid: str, **kw: Any) -> SandboxInfo:
        return next(i for i in self.infos if i.id == sid)

    async def destroy(self, sid: str, **kw: Any) -> None:
        self.destroyed.append(sid)


def _info(sid: str, node: str, session: str) -> SandboxInfo:
    return SandboxInfo(id=sid, node=node, state="running",
                       spec=SandboxSpec(project="p", labels={SESSION_LABEL: session}),
                       created_at=1.0, last_active_at=1.0)


async def test_an_edge_cannot_get_another_nodes_sandbox_swept(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "control.sqlite"))
    plane = ControlPlane.open(store, metrics=ApiMetrics(),
                              config=PlaneConfig(unknown_session_grace_s=0.0))
    victim = "sb-0123456789ab-v1"
    mine = "sb-0123456789ab-h1"
    v1 = _Link([])
    h1 = _Link([_info(victim, "h1", "no-such-session"), _info(mine, "h1", "no-such-session")])
    plane.add_edge("v1", "unix:/nonexistent", v1)   # type: ignore[arg-type]
    plane.add_edge("h1", "unix:/nonexistent", h1)   # type: ignore[arg-type]
    await plane.poll_edges()        # h1's listing: its own unrecorded one quarantined
    assert plane.quarantined() == [mine]
    done = await plane.sweep()
    assert v1.destroyed == [], "h1 listed v1's sandbox and the sweeper destroyed it on v1"
    assert [sid for sid, _ in done] == [mine]       # its own dead-session sandbox: swept
    assert h1.destroyed == [mine]
    store.close()
