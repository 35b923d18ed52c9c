"""``/metrics`` scraped from a real cluster whose edge runs the fncall backend: per-route
request counts and latencies, sandboxes by state, creations, placement retries, and the
warm-pool hit rate the edge reports in its heartbeat."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dsec.cluster.local import LocalCluster
from dsec.control.api.plane import PlaneConfig


@pytest.fixture(scope="module")
def cluster(module_cluster_store: str | None) -> Iterator[LocalCluster]:
    with LocalCluster(edges=1, backend="fncall", gateway=False, store=module_cluster_store,
                      plane=PlaneConfig(heartbeat_interval_s=0.1)) as cl:
        yield cl


def _samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_report_routes_states_creations_and_the_warm_pool(
        cluster: LocalCluster) -> None:
    h = {"authorization": f"Bearer {cluster.api_key}"}
    with httpx.Client(base_url=cluster.url, headers=h, timeout=60) as http:
        sb = http.post("/v1/sandboxes", json={"backend": "fncall"}).json()
        paused = http.post("/v1/sandboxes", json={"backend": "simulated"}).json()["id"]
        assert http.post(f"/v1/sandboxes/{paused}/pause").status_code == 200
        for i in range(3):
            r = http.post(f"/v1/sandboxes/{sb['id']}/exec", json={"shell": f"print({i})"})
            assert r.json()["stdout"] == f"{i}\n", r.text
        for _ in range(5):
            assert http.get(f"/v1/sandboxes/{sb['id']}").status_code == 200
        assert http.get("/v1/sandboxes/sb-000000000000-edge-0").status_code == 404
        # wait for a heartbeat poll that carries the three handouts
        rt = cluster.runtime

        async def handouts() -> int:
            await rt.plane.poll_edges()
            hb = rt.plane.edges["edge-0"].heartbeat
            return sum(p.hits + p.misses for p in hb.pools.values())
        assert cluster._on_loop(handouts()) >= 3
        m = _samples(cluster.url)
    get = ("route", "/v1/sandboxes/{id}"), ("method", "GET")
    assert m[("dsec_api_requests_total", tuple(sorted((*get, ("status", "200")))))] == 5
    assert m[("dsec_api_requests_total", tuple(sorted((*get, ("status", "404")))))] == 1
    assert m[("dsec_api_request_seconds_count", tuple(sorted(get)))] == 6
    assert m[("dsec_sandbox_creations_total", (("backend", "fncall"),))] == 1
    assert m[("dsec_sandbox_creations_total", (("backend", "simulated"),))] == 1
    assert m[("dsec_sandboxes", (("state", "running"),))] == 1
    assert m[("dsec_sandboxes", (("state", "paused"),))] == 1
    assert m[("dsec_registry_sandboxes", ())] == 2
    assert ("dsec_placement_retries_total", ()) in m
    hits = m[("dsec_warm_pool_handouts", (("node", "edge-0"), ("outcome", "hit")))]
    misses = m[("dsec_warm_pool_handouts", (("node", "edge-0"), ("outcome", "miss")))]
    assert hits + misses >= 3
    rate = m[("dsec_warm_pool_hit_rate", (("node", "edge-0"),))]
    assert rate == pytest.approx(hits / (hits + misses))


def test_placement_retries_count_refusals(cluster: LocalCluster) -> None:
    """An edge that refuses (here: unreachable) makes placement pick again, counted."""
    rt = cluster.runtime
    before = _samples(cluster.url).get(("dsec_placement_retries_total", ()), 0.0)

    class Refusing:
        async def create(self, spec: object) -> object:
            from dsec.errors import TransportError
            raise TransportError("edge unreachable (test)")

    entry = rt.plane.edges["edge-0"]

    async def swap(link: object) -> object:
        old, entry.link = entry.link, link
        return old
    real = cluster._on_loop(swap(Refusing()))
    try:
        r = httpx.post(f"{cluster.url}/v1/sandboxes", json={},
                       headers={"authorization": f"Bearer {cluster.api_key}"})
        # reported as the outage it is, not as a lack of capacity ("ask for less")
        assert r.status_code == 503 and r.json()["code"] == "edge_unreachable", r.text
        assert "edge-0" in r.json()["message"] and "ask for less" not in r.text
    finally:
        cluster._on_loop(swap(real))
    after = _samples(cluster.url)[("dsec_placement_retries_total", ())]
    assert after > before
