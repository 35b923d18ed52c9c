"""Prometheus metrics after real calls (issue 19), and the Grafana dashboard built on
them: every metric ``deploy/grafana/dsec.json`` queries is in a real scrape of the
apiserver's ``/metrics`` or an edge's (``dsec edge --metrics-listen``).

The gateway counts and times every call (``dsec_gateway_calls_total{op,outcome}``,
``dsec_gateway_call_seconds``); the edge its operations (create, exec, pause, resume,
destroy: ``dsec_edge_operation_seconds{op}``), sandboxes by state, OOM kills and its
layer store."""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dsec import LocalCluster
from dsec.edge.metrics import EdgeMetrics, serve_metrics
from dsec.errors import SandboxNotFound

DASHBOARD = os.path.join(os.path.dirname(__file__), "..", "deploy", "grafana", "dsec.json")


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


@pytest.fixture(scope="module")
def scrapes() -> Iterator[tuple[dict[str, list[tuple[dict[str, str], float]]],
                                dict[str, list[tuple[dict[str, str], float]]]]]:
    """(apiserver samples, edge samples) after real calls over the gateway and REST."""
    with LocalCluster(edges=1) as cl:
        assert cl._loop is not None and cl.runtime is not None
        node = cl.runtime.nodes[0]
        em = EdgeMetrics(live=lambda: node.live_count, node=node)
        server = asyncio.run_coroutine_threadsafe(
            serve_metrics("127.0.0.1:0", em.render), cl._loop).result(10)
        port = server.sockets[0].getsockname()[1]
        try:
            with cl.client(protocol="aether") as c:
                sb = c.sandboxes.create()
                sb.exec("echo hi")
                list(sb.exec_stream("echo s"))
                sb.pause()
                sb.resume()
                sb.set_timeout(600)
                with pytest.raises(SandboxNotFound):
                    c.sandboxes.get("sb-000000000000-edge-0")
                sb.kill()
            with cl.client(protocol="http") as c:
                c.sandboxes.create().kill()
            api = httpx.get(f"{cl.url}/metrics", timeout=30).text
            edge = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        finally:
            cl._loop.call_soon_threadsafe(server.close)
        yield _samples(api), _samples(edge)


def _value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str,
           **labels: str) -> float:
    return sum(v for lab, v in samples.get(name, [])
               if all(lab.get(k) == want for k, want in labels.items()))


def test_gateway_calls_are_counted_by_op_and_outcome_and_timed(scrapes) -> None:  # type: ignore[no-untyped-def]
    api, _ = scrapes
    assert _value(api, "dsec_gateway_calls_total", op="create", outcome="ok") == 1
    assert _value(api, "dsec_gateway_calls_total", op="exec", outcome="ok") == 1
    assert _value(api, "dsec_gateway_calls_total", op="exec_stream", outcome="ok") == 1
    assert _value(api, "dsec_gateway_calls_total", op="set_timeout", outcome="ok") == 1
    assert _value(api, "dsec_gateway_calls_total", op="get",
                  outcome="sandbox_not_found") == 1
    assert _value(api, "dsec_gateway_call_seconds_count", op="exec") == 1
    assert _value(api, "dsec_gateway_call_seconds_sum", op="create") > 0
    # the REST create went through REST, not the gateway
    assert _value(api, "dsec_api_requests_total", route="/v1/sandboxes", method="POST") >= 1


def test_edge_operations_states_oom_and_layers(scrapes) -> None:  # type: ignore[no-untyped-def]
    _, edge = scrapes
    for op, n in (("create", 2), ("exec", 1), ("exec_stream", 1), ("pause", 1),
                  ("resume", 1), ("destroy", 2)):
        assert _value(edge, "dsec_edge_operation_seconds_count", op=op) == n, op
        assert _value(edge, "dsec_edge_operation_seconds_bucket", op=op, le="+Inf") == n
    assert _value(edge, "dsec_edge_operation_errors_total", op="exec") == 0
    states = {lab["state"] for lab, _ in edge["dsec_edge_sandboxes_by_state"]}
    assert {"running", "paused", "creating"} <= states
    assert "dsec_edge_oom_kills_total" in edge
    assert {lab["result"] for lab, _ in edge["dsec_edge_layer_puts_total"]} == {"hit", "miss"}


def test_every_metric_the_dashboard_queries_is_in_a_real_scrape(scrapes) -> None:  # type: ignore[no-untyped-def]
    api, edge = scrapes
    with open(DASHBOARD) as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    names = {n for e in exprs for n in re.findall(r"\bdsec_[a-z0-9_]+", e)}
    assert len(names) >= 12, names
    missing = sorted(n for n in names if n not in api and n not in edge)
    assert missing == [], f"the dashboard queries metrics no scrape has: {missing}"
    # and every panel has a query (a panel with none shows nothing)
    assert all(p.get("targets") for p in dash["panels"] if p["type"] != "row")
