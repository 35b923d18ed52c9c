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

import pytest

from dsec.cluster.compose import api_service
from dsec.control.api.plane import ControlPlane, PlaneConfig
from dsec.control.metrics import ApiMetrics
from dsec.control.store import open_store
from dsec.edge.admission import Capacity
from dsec.edge.backends import make_backend
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.edge.service import EdgeClient, serve_edge
from dsec.errors import ConnectionLost, EdgeUnreachable
from dsec.ids import NodeId
from dsec.wire.api import CreateSandboxRequest
from tests.control.conftest import FakeClock


class Apiserver:
    """One apiserver generation: store connection, control plane, service, edge link."""

    def __init__(self, db: str | Path, clock: FakeClock) -> None:
        self.store = open_store(str(db))
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


async def test_a_keyed_create_noted_on_a_lost_node_is_written_off_and_placed_anew(
        tmp_path: Path, store_url: str) -> None:
    """A create under an Idempotency-Key noted its sandbox on e0 and was cut off (the
    link failed after the request left). While e0 is only silent the retry must wait for
    that sandbox (it may come into being); once e0 is lost the retry is answered from
    e1, the noted id is written off (GET: destroyed/node_lost), e0's link is aborted,
    and if e0 returns having carried the create out after all, that sandbox is destroyed
    there, not recorded. (Found by tests/cluster/test_hosts_partition.py: retries pinned
    to the lost host until they failed, and a sandbox made for nobody after the heal.)"""
    from dsec.control.idempotency import IdempotencyCache, request_fingerprint
    from dsec.ids import new_sandbox_id

    nodes, servers = {}, {}
    for name in ("e0", "e1"):
        n = nodes[name] = EdgeNode(NodeConfig(node_id=name, capacity=Capacity(
            cpu_milli=10**6, memory_bytes=1 << 40, max_sandboxes=100)),
            {"simulated": make_backend("simulated")})
        await n.start()
        servers[name] = await serve_edge(n, f"unix:{tmp_path / name}.sock")
    clock = FakeClock(time.time())
    api = Apiserver(store_url, clock)
    try:
        for name in ("e0", "e1"):
            link = await EdgeClient.connect(f"unix:{tmp_path / name}.sock")
            api.plane.add_edge(name, f"unix:{tmp_path / name}.sock", link)
        key = api.plane.bootstrap_admin()
        admin = api.service.authenticate(f"Bearer {key}")
        await api.plane.tick()
        req = CreateSandboxRequest(project="team", labels={"k": "1"})
        scoped = IdempotencyCache.scoped(admin.id, "k-cut")
        claim = api.service.idempotency.begin(scoped, request_fingerprint(req)).claim
        assert claim is not None
        sid = new_sandbox_id(NodeId("e0"))
        claim.note(sid)                                       # the first attempt asked e0,
        api.service.idempotency.abort(scoped, ConnectionLost("cut"))   # then lost its link
        e0_link = api.plane.edges["e0"].link
        await servers.pop("e0").close()                       # e0 drops off the network
        with pytest.raises(EdgeUnreachable):                  # silent, not lost: wait
            await api.service.create(admin, req, idempotency_key="k-cut")
        clock.t += 11.0
        await api.plane.tick()                                # ... and is lost
        assert {n.id: n.status for n in api.plane.nodes()}["e0"] == "lost"
        assert e0_link.conn.closed                            # its link was aborted
        info = await api.service.create(admin, req, idempotency_key="k-cut")
        assert info.node == "e1" and info.id != sid
        gone = await api.service.get(admin, sid)
        assert (gone.state, gone.reason) == ("destroyed", "node_lost")
        again = await api.service.create(admin, req, idempotency_key="k-cut")
        assert again.id == info.id                            # the key's one answer
        # e0 returns, having made the noted sandbox after all: destroyed there
        await nodes["e0"].create(api.service.build_spec(admin, req), sandbox_id=sid)
        servers["e0"] = await serve_edge(nodes["e0"], f"unix:{tmp_path / 'e0'}.sock")
        for _ in range(3):
            await api.plane.tick()
        got = nodes["e0"].get(sid)
        assert (got.state, got.reason) == ("destroyed", "node_lost"), got
        assert sid not in api.plane.registry.ids_on("e0")
    finally:
        await api.close()
        for s in servers.values():
            await s.close()
        for n in nodes.values():
            await n.close()
