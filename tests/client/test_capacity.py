"""Real node capacity through every door: a request no node could ever hold is a 400
(``Unsatisfiable``) at REST, at the Aether gateway and at the edge, distinct from the
503 of a cluster that is full right now; and nothing is charged or left behind."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from dsec.cluster.local import LocalCluster
from dsec.edge.admission import Overcommit
from dsec.errors import NoCapacity, Unsatisfiable

GiB = 1 << 30


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    # A 2-core, 8 GiB machine overcommitted 2x (cpu) and 1.5x (memory): the one edge
    # admits 4 cores and 12 GiB.
    with LocalCluster(edges=1, cpu_milli=2000, memory_bytes=8 * GiB, disk_bytes=64 * GiB,
                      overcommit=Overcommit(cpu=2, memory=1.5)) as cl:
        yield cl


def _settle(cluster: LocalCluster) -> None:
    """Poll the edge now: placement sees a destroy at the next heartbeat (1 s)."""
    cluster._on_loop(cluster.runtime.plane.poll_edges())


def test_nodes_advertise_the_real_machine(cluster: LocalCluster) -> None:
    with cluster.client(session_lease_s=None) as c:
        (node,) = c.nodes()
    assert (node.cpu_milli_total, node.memory_bytes_total) == (4000, 12 * GiB)


def test_rest_refuses_the_impossible_with_400_and_the_full_with_503(
        cluster: LocalCluster) -> None:
    h = {"authorization": f"Bearer {cluster.api_key}"}
    with httpx.Client(base_url=cluster.url, headers=h, timeout=30) as http:
        before = http.get("/v1/projects/default").json()["usage"]
        r = http.post("/v1/sandboxes", json={"memory_bytes": 1 << 40})
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["code"] == "unsatisfiable"
        assert body["message"] == (
            "memory=1 TiB is more than any node of this cluster could ever hold (largest: "
            "edge-0 with 8 GiB x overcommit 1.5 = 12 GiB for all its sandboxes); ask for "
            "at most 12 GiB")
        r = http.post("/v1/sandboxes", json={"cpu_milli": 5000})
        assert r.status_code == 400 and "cpu=5 cores" in r.json()["message"], r.text
        r = http.post("/v1/sandboxes", json={"disk_bytes": 100 * GiB})
        assert r.status_code == 400 and "disk=100 GiB" in r.json()["message"], r.text
        assert http.get("/v1/projects/default").json()["usage"] == before   # nothing held
        # The whole node is fine ...
        whole = http.post("/v1/sandboxes", json={"cpu_milli": 4000, "memory_bytes": GiB})
        assert whole.status_code == 201, whole.text
        try:
            # ... and then the same small request is "full right now", a 503.
            r = http.post("/v1/sandboxes", json={"cpu_milli": 1000})
            assert r.status_code == 503 and r.json()["code"] == "no_capacity", r.text
        finally:
            assert http.delete(f"/v1/sandboxes/{whole.json()['id']}").status_code == 204
            _settle(cluster)


def test_the_gateway_refuses_the_same_way(cluster: LocalCluster) -> None:
    with cluster.client(protocol="aether", session_lease_s=None) as c:
        with pytest.raises(Unsatisfiable, match=r"memory=1 TiB .* ask for at most 12 GiB"):
            c.sandboxes.create(memory="1TiB")
        with pytest.raises(Unsatisfiable, match="memory=13 GiB"):   # one batch, per item
            c.sandboxes.create_many([{"memory": "1GiB"}, {"memory": "13GiB"}])
        assert c.sandboxes.list() == []   # all or nothing: the 1 GiB one was destroyed
        _settle(cluster)
        with pytest.raises(NoCapacity):
            big = c.sandboxes.create(cpu=4)
            try:
                c.sandboxes.create(cpu=1)
            finally:
                big.kill()


def test_the_edge_refuses_the_same_way(cluster: LocalCluster) -> None:
    from dsec.edge.service import EdgeClient

    async def go() -> None:
        sock = f"unix:{cluster.state_dir}/edges/edge-0.sock"
        async with await EdgeClient.connect(sock) as edge:
            with pytest.raises(Unsatisfiable, match=r"node edge-0 could ever hold .* 12 GiB"):
                await edge.create(memory_bytes=1 << 40)
            with pytest.raises(Unsatisfiable, match="disk=100 GiB"):
                await edge.create(disk_bytes=100 * GiB)
            assert (await edge.info()).capacity.memory_bytes == 12 * GiB
    asyncio.run(go())
