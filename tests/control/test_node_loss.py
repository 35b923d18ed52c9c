"""Node loss across an apiserver restart: the eviction records (tombstones) live in the
state store, so a node that returns to a *freshly restarted* apiserver is still told to
destroy what was written off with it, and nothing is recorded as live again.

Real pieces: one edge served over Aether on a Unix socket (it keeps running, with its
sandboxes, while its socket is down - a partition), two ControlPlane + ApiService
generations over one SQLite file. The plane's clock is injected to expire the node.
"""

from __future__ import annotations

import time
from pathlib import Path

from dsec.cluster.compose import api_service
from dsec.control.api.plane import ControlPlane, PlaneConfig
from dsec.control.metrics import ApiMetrics
from dsec.control.store import open_store
from dsec.edge.admission import Capacity
from dsec.edge.backends import make_backend
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.edge.service import EdgeClient, serve_edge
from dsec.wire.api import CreateSandboxRequest
from tests.control.conftest import FakeClock


class Apiserver:
    """One apiserver generation: store connection, control plane, service, edge link."""

    def __init__(self, db: str, clock: FakeClock) -> None:
        self.store = open_store(db)
        self.plane = ControlPlane.open(self.store, metrics=ApiMetrics(), clock=clock,
                                       config=PlaneConfig(node_ttl_s=10.0,
                                                          reconnect_interval_s=0.0))
        self.service = api_service(self.store, self.plane)
        self.link: EdgeClient | None = None

    async def connect(self, addr: str) -> None:
        self.link = await EdgeClient.connect(addr)
        self.plane.add_edge("e0", addr, self.link)

    async def close(self) -> None:
        await self.service.idempotency.close()
        await self.plane.close()
        e = self.plane.edges.get("e0")
        if e is not None:
            await e.link.close()
        self.store.close()


async def test_a_returning_node_destroys_what_was_evicted_even_after_an_apiserver_restart(
        tmp_path: Path, store_url: str) -> None:
    node = EdgeNode(NodeConfig(node_id="e0", capacity=Capacity(
        cpu_milli=10**6, memory_bytes=1 << 40, max_sandboxes=100)),
        {"simulated": make_backend("simulated")})
    await node.start()
    addr = f"unix:{tmp_path / 'e0.sock'}"
    server = await serve_edge(node, addr)
    clock = FakeClock(time.time())
    db = store_url
    first = Apiserver(db, clock)
    second: Apiserver | None = None
    try:
        await first.connect(addr)
        key = first.plane.bootstrap_admin()
        admin = first.service.authenticate(f"Bearer {key}")
        await first.plane.tick()
        made = [await first.service.create(admin, CreateSandboxRequest(project="team"))
                for _ in range(3)]
        ids = {i.id for i in made}
        assert ids <= set(first.plane.registry.ids_on("e0"))

        # The node drops off the network (its sandboxes keep running) and is expired.
        await server.close()
        clock.t += 11.0
        await first.plane.tick()
        assert not set(first.plane.registry.ids_on("e0")) & ids
        for sid in ids:
            info = await first.service.get(admin, sid)
            assert (info.state, info.reason) == ("destroyed", "node_lost")
            assert node.get(sid).state == "running"     # the edge has not heard of it

        # The apiserver restarts (its watcher and memory start empty), then the node
        # comes back: the tombstones from the store must have them destroyed there.
        await first.close()
        server = await serve_edge(node, addr)
        second = Apiserver(db, clock)
        await second.connect(addr)
        assert {sid for sid in ids if second.plane.lost(sid) is not None} == ids
        await second.plane.tick()
        for sid in ids:
            got = node.get(sid)
            assert (got.state, got.reason) == ("destroyed", "node_lost"), got
        assert not set(second.plane.registry.ids_on("e0")) & ids
        admin2 = second.service.authenticate(f"Bearer {key}")
        listed, _ = second.plane.list_sandboxes(admin2, project=None, labels={},
                                                state=None, after="", limit=100)
        assert not {i.id for i in listed} & ids
        assert second.plane.quota.usage("team").sandboxes == 0
        events = await second.service.events(admin2, made[0].id)
        assert (events[-1].to_state, events[-1].reason) == ("destroyed", "node_lost")
        # and a sandbox created after the return is live as usual
        fresh = await second.service.create(admin2, CreateSandboxRequest(project="team"))
        await second.plane.tick()
        assert fresh.id in second.plane.registry.ids_on("e0")
    finally:
        if second is not None:
            await second.close()
        else:
            await first.close()
        await server.close()
        await node.close()
