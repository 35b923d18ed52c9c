"""Prometheus metrics of the apiserver (exposed at ``/metrics`` via prometheus-client).

One :class:`ApiMetrics` per apiserver instance with its own ``CollectorRegistry`` so several
apiservers in one process (tests, LocalCluster) never collide. Labels are bounded: the
route *template* (``/v1/sandboxes/{id}``), never the concrete path, so a scan of random
ids cannot blow up the series count.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

__all__ = ["CONTENT_TYPE_LATEST", "ApiMetrics"]

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0, 30.0)


class ApiMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("dsec_api_requests_total", "API requests by route and status",
                                ("route", "method", "status"), registry=r)
        self.latency = Histogram("dsec_api_request_seconds", "API request latency by route",
                                 ("route", "method"), buckets=_LATENCY_BUCKETS, registry=r)
        self.creations = Counter("dsec_sandbox_creations_total",
                                 "sandboxes created (rate() of this is creations/s)",
                                 ("backend",), registry=r)
        self.create_failures = Counter("dsec_sandbox_create_failures_total",
                                       "failed creates by error code", ("code",), registry=r)
        self.placement_retries = Counter(
            "dsec_placement_retries_total",
            "times placement picked again because the chosen edge refused", registry=r)
        self.idempotent_replays = Counter(
            "dsec_idempotent_replays_total", "creates answered from the Idempotency-Key cache",
            registry=r)
        self.rate_limited = Counter("dsec_rate_limited_total", "requests refused with 429",
                                    registry=r)
        self.swept = Counter("dsec_sweeper_destroyed_total",
                             "sandboxes destroyed by the leak sweeper", ("reason",), registry=r)
        self.sandboxes = Gauge("dsec_sandboxes", "live sandboxes by state (from edge heartbeats)",
                               ("state",), registry=r)
        self.nodes = Gauge("dsec_nodes", "edge nodes known to the apiserver", ("health",),
                           registry=r)
        self.warm_pool_hit_rate = Gauge(
            "dsec_warm_pool_hit_rate", "fraction of fncall handouts served warm (per node)",
            ("node",), registry=r)
        self.warm_pool_handouts = Gauge(
            "dsec_warm_pool_handouts", "fncall handouts since the edge started, warm (hit) "
            "or cold (miss), as the edge's heartbeat reports them", ("node", "outcome"),
            registry=r)
        self.warm_pool_ready = Gauge("dsec_warm_pool_ready", "warm fncall workers ready now",
                                     ("node",), registry=r)
        self.registry_sandboxes = Gauge(
            "dsec_registry_sandboxes", "live sandboxes in the control plane's registry "
            "(what GET /v1/sandboxes lists)", registry=r)
        # issue 19: the SDK's default path (the gateway) counted and timed like REST
        # (op: the catalogue row; outcome: "ok" or the error code, a bounded set)
        self.gateway_calls = Counter("dsec_gateway_calls_total",
                                     "Aether gateway calls by operation and outcome",
                                     ("op", "outcome"), registry=r)
        self.gateway_latency = Histogram("dsec_gateway_call_seconds",
                                         "Aether gateway call latency by operation",
                                         ("op",), buckets=_LATENCY_BUCKETS, registry=r)
        # the per-tenant reply budget (dsec.control.replybudget): bytes held now, all
        # tenants together (a tenant label would be unbounded), and calls refused
        self.reply_budget_bytes = Gauge(
            "dsec_reply_budget_bytes", "bytes of large unary replies reserved or not yet "
            "read by their clients, all tenants", registry=r)
        self.reply_budget_refused = Counter(
            "dsec_reply_budget_refused_total", "calls refused (429) after waiting for room "
            "in their tenant's reply budget", registry=r)
        self._refreshers: list[Callable[[ApiMetrics], None]] = []

    def on_scrape(self, fn: Callable[[ApiMetrics], None]) -> None:
        """Register a callback that refreshes gauges right before exposition."""
        self._refreshers.append(fn)

    def render(self) -> bytes:
        for fn in self._refreshers:
            fn(self)
        return generate_latest(self.registry)
