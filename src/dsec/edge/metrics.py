"""Prometheus metrics of one edge (``dsec edge --metrics-listen HOST:PORT``).

The apiserver's ``/metrics`` (control/metrics.py) is the cluster's view; what only an edge
knows lives here, in a registry of its own:

- ``dsec_net_denied_packets_total{sandbox_id}``: packets each sandbox's egress policy
  dropped since it got its slot (the slot counters the container backend reads every
  ``denied_poll_s``, so at most that stale). A destroyed sandbox's series disappears with
  it: the collector yields only sandboxes that hold a slot now.
- ``dsec_net_dns_refused_total``: names the node's resolver refused (not allowlisted,
  rebinding, rate limits), all sandboxes together.
- ``dsec_edge_sandboxes``: sandboxes this edge runs.

Collected on the edge's event loop (the server below is an asyncio one), where the
counters' owners are changed, so a scrape never reads them mid-update. Labels are
bounded by the node's sandbox cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dsec.errors import InvalidArgument

__all__ = ["EdgeMetrics", "denied_samples", "serve_metrics"]

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES: Final = 8192
REQUEST_TIMEOUT_S: Final = 5.0


def denied_samples(owners: Mapping[int, tuple[str, int, int]]) -> list[tuple[str, int]]:
    """``(sandbox_id, packets denied since it got its slot)`` from a DenyReporter's
    ``owners`` (slot -> (sandbox, counter at assignment, counter last read)); pure."""
    return sorted((sid, max(0, last - base)) for sid, base, last in owners.values())


class _Collector(Collector):
    def __init__(self, m: EdgeMetrics) -> None:
        self.m = m

    def collect(self) -> Iterator[Any]:
        net, resolver = self.m.network, self.m.resolver
        denied = CounterMetricFamily(
            "dsec_net_denied_packets", "packets a sandbox's egress policy dropped since it "
            "started (read every denied_poll_s)", labels=["sandbox_id"])
        if net is not None:
            for sid, n in denied_samples(net.denied.owners):
                denied.add_metric([sid], n)
        yield denied
        yield CounterMetricFamily(
            "dsec_net_dns_refused", "DNS names the node's resolver refused",
            value=resolver.stats.refused if resolver is not None else 0)
        yield GaugeMetricFamily("dsec_edge_sandboxes", "sandboxes this edge runs",
                                value=self.m.live())


class EdgeMetrics:
    """The edge's registry. ``network`` is the container backend's SandboxNetwork (or
    None), ``resolver`` the node's Resolver (or None), ``live`` counts its sandboxes."""

    def __init__(self, *, network: Any = None, resolver: Any = None,
                 live: Callable[[], int] = lambda: 0) -> None:
        self.network, self.resolver, self.live = network, resolver, live
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def serve_metrics(listen: str, render: Callable[[], bytes]) -> asyncio.Server:
    """A minimal HTTP/1.0 server for ``GET /metrics`` on ``HOST:PORT`` (no framework:
    one route, one short answer per connection; the request is bounded in size and
    time so an idle or endless peer holds nothing)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise InvalidArgument(f"--metrics-listen {listen!r}: use HOST:PORT, e.g. "
                              "127.0.0.1:9470", field="metrics_listen")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            line = head.split(b"\r\n", 1)[0].split()
            if len(line) >= 2 and line[0] == b"GET" and line[1].split(b"?")[0] == b"/metrics":
                body, status, ctype = render(), b"200 OK", CONTENT_TYPE_LATEST.encode()
            else:
                body, status, ctype = b"only GET /metrics here\n", b"404 Not Found", b"text/plain"
            writer.write(b"HTTP/1.0 " + status + b"\r\nContent-Type: " + ctype
                         + b"\r\nContent-Length: " + str(len(body)).encode()
                         + b"\r\nConnection: close\r\n\r\n" + body)
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    return await asyncio.start_server(handle, host.strip("[]"), int(port),
                                      limit=MAX_REQUEST_BYTES)
