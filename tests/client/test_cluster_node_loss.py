"""Node loss end to end: a LocalCluster of 2 edges, one edge stopped and brought back.

The watcher TTL is short here (0.6 s, polls every 0.1 s) so the test takes seconds; the
behaviour is the production one: eviction with reason node_lost visible through the API,
quota released, creates go to the survivor, and the returning edge destroys (never
resurrects) what was evicted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from dsec.cluster.local import LocalCluster
from dsec.control.api.plane import PlaneConfig


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    # Edges in processes of their own: stop_edge kills one with SIGKILL (its machine
    # died) and start_edge starts a fresh process on its journal.
    # A machine so large that packing does not pull the creates onto one edge: both
    # edges must hold several of them.
    with LocalCluster(edges=2, gateway=False, edge_processes=True,
                      cpu_milli=10**8, memory_bytes=1 << 46,
                      # TTL 2 s: with 0.6 s a live edge process on a loaded 2-core
                      # machine missed it now and then (the test then saw edge-0 lost)
                      plane=PlaneConfig(heartbeat_interval_s=0.1, node_ttl_s=2.0,
                                        reconnect_interval_s=0.1)) as cl:
        yield cl


def _until(what: str, cond: Callable[[], Any], timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _health(http: httpx.Client) -> dict[str, bool]:
    # NodeView omits defaults: "healthy" is absent when true
    return {n["id"]: n.get("healthy", True) for n in http.get("/v1/nodes").json()["items"]}


def _listed(http: httpx.Client, **params: Any) -> set[str]:
    ids: set[str] = set()
    cursor = None
    while True:
        q = {"limit": 2, **params, **({"cursor": cursor} if cursor else {})}
        page = http.get("/v1/sandboxes", params=q).json()
        ids |= {i["id"] for i in page["items"]}
        cursor = page["next_cursor"]
        if cursor is None:
            return ids


def test_lost_node_is_evicted_and_its_sandboxes_are_destroyed_on_return(
        cluster: LocalCluster) -> None:
    h = {"authorization": f"Bearer {cluster.api_key}"}
    with httpx.Client(base_url=cluster.url, headers=h) as http:
        assert http.put("/v1/quotas/team", json={"max_sandboxes": 100}).status_code == 200
        # With a short TTL, an edge process still starting on a loaded machine can be
        # unhealthy for a moment, and placement rightly avoids it: start from both healthy.
        _until("both edges healthy", lambda: _health(http) == {"edge-0": True, "edge-1": True})
        made = [http.post("/v1/sandboxes", json={"project": "team/a", "labels": {"t": "x"}})
                for _ in range(12)]
        by_node: dict[str, list[str]] = {}
        for r in made:
            assert r.status_code == 201, r.text
            by_node.setdefault(r.json()["node"], []).append(r.json()["id"])
        # an edge that missed its 2 s TTL under load for a moment is rightly passed over
        # (a full run once placed all 12 on one): more, while both are healthy, until
        # placement has used both - at most 24 in all
        while set(by_node) != {"edge-0", "edge-1"} and len(made) < 24:
            _until("both edges healthy",
                   lambda: _health(http) == {"edge-0": True, "edge-1": True})
            r = http.post("/v1/sandboxes", json={"project": "team/a", "labels": {"t": "x"}})
            assert r.status_code == 201, r.text
            made.append(r)
            by_node.setdefault(r.json()["node"], []).append(r.json()["id"])
        assert set(by_node) == {"edge-0", "edge-1"}, "placement should use both edges"
        n = len(made)
        lost, kept = by_node["edge-1"], by_node["edge-0"]
        assert _listed(http, label="t=x") == set(lost) | set(kept)
        assert http.get("/v1/projects/team").json()["usage"]["sandboxes"] == n

        cluster.stop_edge("edge-1")
        # Creates while edge-1 is silent: before expiry placement may still pick it, the
        # unreachable edge is excluded and the create retried on edge-0.
        fresh = [http.post("/v1/sandboxes", json={"project": "team/a"}) for _ in range(4)]
        assert [r.status_code for r in fresh] == [201] * 4, [r.text for r in fresh]
        assert {r.json()["node"] for r in fresh} == {"edge-0"}

        _until("edge-1's sandboxes to leave the list",
               lambda: _listed(http, label="t=x") == set(kept))
        for sid in lost:
            info = http.get(f"/v1/sandboxes/{sid}").json()
            assert (info["state"], info["reason"]) == ("destroyed", "node_lost"), info
            last = http.get(f"/v1/sandboxes/{sid}/events").json()["items"][-1]
            assert (last["to_state"], last["reason"]) == ("destroyed", "node_lost")
            assert "edge-1" in last["detail"]
        # exec on an evicted sandbox is a clear conflict; delete stays idempotent
        r = http.post(f"/v1/sandboxes/{lost[0]}/exec", json={"argv": ["true"]})
        assert r.status_code == 409 and "node_lost" in r.json()["message"]
        assert http.delete(f"/v1/sandboxes/{lost[0]}").status_code == 204
        assert http.get("/v1/projects/team").json()["usage"]["sandboxes"] == n - len(lost) + 4
        assert _health(http) == {"edge-0": True, "edge-1": False}
        after = [http.post("/v1/sandboxes", json={"project": "team/a"}).json()["node"]
                 for _ in range(4)]
        assert after == ["edge-0"] * 4

        # The node comes back (its journal re-adopts the sandboxes it had): the control
        # plane reconnects, and the watcher has every evicted sandbox destroyed there.
        cluster.start_edge("edge-1")

        async def edge_states() -> dict[str, tuple[str, str]]:
            from dsec.edge.service import EdgeClient

            sock = f"unix:{cluster.state_dir}/edges/edge-1.sock"
            async with await EdgeClient.connect(sock) as edge:
                return {s: (i.state, i.reason) for s in lost if (i := await edge.get(s))}

        _until("the returned edge to destroy the evicted sandboxes", lambda: all(
            v == ("destroyed", "node_lost") for v in cluster._on_loop(edge_states()).values()))
        _until("edge-1 healthy again", lambda: _health(http)["edge-1"])
        # not resurrected: the list and the quota still count only the survivors
        assert _listed(http, label="t=x") == set(kept)
        assert http.get("/v1/projects/team").json()["usage"]["sandboxes"] == n - len(lost) + 8
        events = http.get(f"/v1/sandboxes/{lost[1]}/events").json()["items"]
        assert events[-1]["reason"] == "node_lost"


def test_placement_sees_which_node_holds_an_image() -> None:
    """Edge heartbeats carry the images a node holds; creates ask for their image's refs,
    so placement's locality term favours the node that already has them."""
    from dsec.control.placement import PlacementRequest

    with LocalCluster(edges=2, gateway=False,
                      plane=PlaneConfig(heartbeat_interval_s=0.1)) as cl, \
            cl.client(session_lease_s=None) as c:
        sb = c.sandboxes.create(image="rare-image", backend="simulated")
        holder = sb.info.node
        plane = cl.runtime.plane
        _until("a heartbeat listing the image",
               lambda: "rare-image" in plane.edges[holder].images)
        other = next(n for n in plane.edges if n != holder)
        plain = PlacementRequest(cpu_milli=1000, memory_bytes=1 << 29)
        wants = PlacementRequest(cpu_milli=1000, memory_bytes=1 << 29, layers=("rare-image",))
        assert plane.placement.score(holder, wants) > plane.placement.score(holder, plain)
        assert plane.placement.score(other, wants) == plane.placement.score(other, plain)
        sb.kill()
