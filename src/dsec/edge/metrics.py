"""Prometheus metrics of one edge (``dsec edge --metrics-listen HOST:PORT``).

The apiserver's ``/metrics`` (control/metrics.py) is the cluster's view; what only an edge
knows lives here, in a registry of its own:

- ``dsec_net_denied_packets_total{sandbox_id}``: packets each sandbox's egress policy
  dropped since it got its slot (the slot counters the container backend reads every
  ``denied_poll_s``, so at most that stale). A destroyed sandbox's series disappears with
  it: the collector yields only sandboxes that hold a slot now.
- ``dsec_net_dns_refused_total``: names the node's resolver refused (not allowlisted,
  rebinding, rate limits), all sandboxes together.
- ``dsec_edge_sandboxes``: sandboxes this edge runs; ``dsec_edge_sandboxes_by_state``.
- ``dsec_edge_operation_seconds{op}`` (histogram) and ``dsec_edge_operation_errors_total``:
  create, pause, resume, exec, exec_stream, destroy as the node ran them (issue 19);
  ``dsec_edge_oom_kills_total``, ``dsec_edge_notices_total{reason}``; the layer store:
  ``dsec_edge_layers_stored``, ``dsec_edge_layer_store_bytes``,
  ``dsec_edge_layer_puts_total{result="hit|miss"}``.
- ``dsec_lazy_*`` (with ``--blob-store``: layers read lazily, issue 17): chunk reads that
  hit the node's chunk cache and that missed (``dsec_lazy_chunk_hit_ratio``: hits over
  both), bytes fetched from the blob store and bytes served, the latency of each ranged
  fetch (histogram), retries, chunks that failed their sha256, reads failed with EIO,
  the chunk cache's size and daemon restarts, the blob store's circuit breaker (open,
  times opened, fetches failed at once) and late chunks of abandoned reads. Read from the FUSE daemon's stats file
  (written every 0.5 s), summed over daemons that died, so the counters never go back.

Who may scrape: with a token (``dsec edge --metrics-token-file``; ``dsec up
--edge-metrics-port`` makes one, ``<state-dir>/metrics.token``, 0600) only a request with
``Authorization: Bearer <token>`` (Prometheus: ``authorization: {credentials_file: ...}``)
gets the metrics, any other a 401 - a loopback port is open to every host user, and the
series name the node's sandboxes and what they do. Without one (``--metrics-public``,
asked for explicitly) anyone who reaches the port reads them.

Collected on the edge's event loop (the server below is an asyncio one), where the
counters' owners are changed, so a scrape never reads them mid-update. Labels are
bounded by the node's sandbox cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from dsec.aether.limits import Admission, ProcessBudget, ServerLimits, process_budget
from dsec.edge.usage import OP_BUCKETS, OpTimings
from dsec.errors import InvalidArgument
from dsec.statedir import create_private_file

__all__ = ["OP_BUCKETS", "EdgeMetrics", "OpTimings", "authorized", "denied_samples",
           "lazy_families", "node_families", "read_token", "serve_metrics"]

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES: Final = 8192
#: a scraper sends its request head at once: 1 s to deliver it, 5 s to take the answer
HEAD_TIMEOUT_S: Final = 1.0
REQUEST_TIMEOUT_S: Final = 5.0
#: What the listener lets its peers hold (REDTEAM-14b #7: it held every idle peer, 375-573
#: of 1,500, in an edge whose fd limit is raised to the hard limit). Every connection is
#: "pending" until it is answered (there is no authentication); a scraper needs one at a
#: time, so 64 at once (16 per address) is ample; beyond them a peer gets a 503 and is
#: closed at once. Accepted connections count in the process's shared fd budget beside
#: the Aether listeners' (aether/limits.py), so this door cannot take their share either.
METRICS_LIMITS: Final = ServerLimits(max_connections=64, max_connections_per_peer=16,
                                     max_pending=64, max_pending_per_peer=16,
                                     auth_timeout_s=HEAD_TIMEOUT_S)
#: a rendering is reused this long (a scrape flood would otherwise run generate_latest
#: over every sandbox of the edge, on its loop, for each request)
RENDER_CACHE_S: Final = 1.0


def node_families(t: OpTimings, states: Mapping[str, int],
                  layers: tuple[int, int, int, int] | None) -> Iterator[Any]:
    """The node's own families (pure): operation durations and failures, sandboxes by
    state, notices (OOM kills among them), and the layer store (``layers``: layers
    stored, their bytes, puts answered from the store, puts that had to transfer)."""
    h = HistogramMetricFamily("dsec_edge_operation_seconds", "duration of the edge's "
                              "operations on sandboxes (create, pause, resume, exec, "
                              "destroy), from the request to the answer", labels=["op"])
    for op in sorted(t.counts):
        acc, buckets = 0, []
        for b, n in zip([*map(str, t.buckets), "+Inf"], t.counts[op], strict=True):
            acc += n
            buckets.append((b, float(acc)))
        h.add_metric([op], buckets, sum_value=t.sums[op])
    yield h
    e = CounterMetricFamily("dsec_edge_operation_errors", "edge operations that failed",
                            labels=["op"])
    for op in sorted(t.counts):
        e.add_metric([op], float(t.errors.get(op, 0)))
    yield e
    g = GaugeMetricFamily("dsec_edge_sandboxes_by_state", "sandboxes of this edge by "
                          "lifecycle state", labels=["state"])
    for state in ("creating", "running", "pausing", "paused", "resuming", "destroying",
                  "failed"):
        g.add_metric([state], float(states.get(state, 0)))
    yield g
    yield CounterMetricFamily("dsec_edge_oom_kills", "OOM kills inside this edge's "
                              "sandboxes (oom_kill notices: each one or more processes)",
                              value=float(t.notices.get("oom_kill", 0)))
    nf = CounterMetricFamily("dsec_edge_notices", "sandbox notices by reason (events of a "
                             "sandbox that lives on: oom_kill, pids_limit, disk_full, ...)",
                             labels=["reason"])
    for reason in sorted(t.notices):
        nf.add_metric([reason], float(t.notices[reason]))
    yield nf
    stored, nbytes, hits, misses = layers if layers is not None else (0, 0, 0, 0)
    yield GaugeMetricFamily("dsec_edge_layers_stored", "image layers held whole in this "
                            "node's layer store", value=float(stored))
    yield GaugeMetricFamily("dsec_edge_layer_store_bytes", "bytes of the layers held in "
                            "this node's layer store", value=float(nbytes))
    lc = CounterMetricFamily("dsec_edge_layer_puts", "layers sent to this node (layer_put):"
                             " already in its store (hit) or transferred (miss)",
                             labels=["result"])
    lc.add_metric(["hit"], float(hits))
    lc.add_metric(["miss"], float(misses))
    yield lc


def authorized(head: bytes, token: bytes | None) -> bool:
    """Whether a request head carries ``Authorization: Bearer <token>`` (pure; compared
    in constant time; always True without a token)."""
    if token is None:
        return True
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"authorization":
            scheme, _, cred = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and hmac.compare_digest(cred.strip(), token):
                return True
    return False


def read_token(path: str, *, create: bool = False) -> bytes:
    """The scrape token in ``path`` (surrounding whitespace dropped). Refused unless
    only its owner (this user or root) may read it and it holds 16+ characters.
    ``create``: a missing file is made first (0600, a random token), so a unit or
    DaemonSet can name a file in its state dir that the first start fills - whole or not
    at all, and an empty one a crash left while it was made is made again
    (:func:`dsec.statedir.create_private_file`; red team 22 A4: it was a crash loop)."""
    if create:
        import secrets
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
            create_private_file(path, lambda: (secrets.token_urlsafe(32) + "\n").encode())
        except OSError as exc:
            raise InvalidArgument(f"--metrics-token-file {path}: cannot create it: "
                                  f"{exc.strerror or exc}", field="metrics_token_file") from exc
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidArgument(f"--metrics-token-file {path}: {exc.strerror or exc}",
                              field="metrics_token_file") from exc
    try:
        st = os.fstat(fd)
        data = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o077:
        raise InvalidArgument(f"--metrics-token-file {path} is mode {st.st_mode & 0o777:o} "
                              f"owned by uid {st.st_uid}: other users could read or swap "
                              "the token; chmod 600 it, owned by this user",
                              field="metrics_token_file")
    if len(data) < 16 or any(c <= 32 or c > 126 for c in data):
        made = (" (or remove the file: the edge makes a new token at its next start; "
                "give it to the scrapers)") if create else ""
        raise InvalidArgument(f"--metrics-token-file {path}: holds {len(data)} bytes; the "
                              "token must be 16 or more printable characters without "
                              f"spaces{made}", field="metrics_token_file")
    return data


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
        node = self.m.node
        if node is not None:
            yield from node_families(node.timings, node.state_counts(), node.layer_counts())
        if self.m.lazy is not None:
            yield from lazy_families(self.m.lazy.stats(), self.m.lazy.restarts)


def lazy_families(st: Mapping[str, Any], restarts: int) -> Iterator[Any]:
    """The ``dsec_lazy_*`` metric families from a lazy layer daemon's stats (pure)."""
    def counter(name: str, doc: str, key: str) -> CounterMetricFamily:
        return CounterMetricFamily(name, doc, value=float(st.get(key, 0)))

    hits, misses = float(st.get("chunk_hits", 0)), float(st.get("chunk_misses", 0))
    yield counter("dsec_lazy_chunk_hits", "chunk reads served from the node's chunk cache",
                  "chunk_hits")
    yield counter("dsec_lazy_chunk_misses", "chunk reads that had to fetch (or wait for a "
                  "fetch)", "chunk_misses")
    yield GaugeMetricFamily("dsec_lazy_chunk_hit_ratio", "chunk cache hits / chunk reads "
                            "(1 when nothing was read yet)",
                            value=hits / (hits + misses) if hits + misses else 1.0)
    yield counter("dsec_lazy_bytes_fetched", "bytes fetched from the blob store, verified",
                  "bytes_fetched")
    yield counter("dsec_lazy_bytes_read", "bytes the FUSE daemon served", "bytes_read")
    yield counter("dsec_lazy_fetch_retries", "ranged fetches retried after a failure",
                  "retries")
    yield counter("dsec_lazy_verify_failures", "fetched chunks that failed their sha256",
                  "verify_failures")
    yield counter("dsec_lazy_failed_reads", "reads answered EIO (blob store unreachable "
                  "past the retry budget, or corrupt chunks)", "failed_reads")
    yield GaugeMetricFamily("dsec_lazy_cache_bytes", "bytes in the node's chunk cache",
                            value=float(st.get("cache_bytes", 0)))
    yield GaugeMetricFamily("dsec_lazy_store_circuit_open", "1 while the blob store's "
                            "circuit breaker is open or probing (misses fail with EIO at "
                            "once), 0 when closed",
                            value=0.0 if st.get("breaker_state", "closed") == "closed"
                            else 1.0)
    yield counter("dsec_lazy_store_circuit_opens", "times the blob store was found down "
                  "(breaker opened)", "breaker_opens")
    yield counter("dsec_lazy_fast_failed_fetches", "fetches failed at once: the breaker was "
                  "open", "fast_failed_runs")
    yield counter("dsec_lazy_late_chunks", "chunks a blob read given up at the retry "
                  "budget wrote later (counted into the chunk cache's budget)",
                  "late_chunks")
    yield CounterMetricFamily("dsec_lazy_daemon_restarts", "times the lazy layer FUSE "
                              "daemon died and was restarted", value=float(restarts))
    bounds, counts = st.get("fetch_bounds") or [], st.get("fetch_buckets") or []
    h = HistogramMetricFamily("dsec_lazy_fetch_seconds", "latency of one ranged fetch from "
                              "the blob store")
    if bounds and len(counts) == len(bounds) + 1:
        acc, buckets = 0, []
        for b, c in zip([*map(str, bounds), "+Inf"], counts, strict=True):
            acc += c
            buckets.append((b, float(acc)))
        h.add_metric([], buckets, sum_value=float(st.get("fetch_seconds_sum", 0.0)))
    yield h


class EdgeMetrics:
    """The edge's registry. ``network`` is the container backend's SandboxNetwork (or
    None), ``resolver`` the node's Resolver (or None), ``live`` counts its sandboxes,
    ``lazy`` the node's :class:`~dsec.edge.lazy.layers.LazyLayers` (or None)."""

    def __init__(self, *, network: Any = None, resolver: Any = None,
                 live: Callable[[], int] = lambda: 0, lazy: Any = None,
                 node: Any = None) -> None:
        self.network, self.resolver, self.live = network, resolver, live
        self.lazy = lazy
        self.node = node        # the EdgeNode: its timings, states and layer store
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def serve_metrics(listen: str, render: Callable[[], bytes], *,
                        limits: ServerLimits = METRICS_LIMITS,
                        budget: ProcessBudget | None = None,
                        clock: Callable[[], float] | None = None,
                        token: bytes | None = None) -> asyncio.Server:
    """A minimal HTTP/1.0 server for ``GET /metrics`` on ``HOST:PORT`` (no framework:
    one route, one short answer per connection; the request is bounded in size and
    time, and the connections in number (``limits``, admitted like every other listener
    of the process: :class:`dsec.aether.limits.Admission`), so an idle or endless peer
    holds nothing). ``token``: the bearer token a scrape must carry (None: none asked;
    the module docstring says when that is acceptable)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise InvalidArgument(f"--metrics-listen {listen!r}: use HOST:PORT, e.g. "
                              "127.0.0.1:9470", field="metrics_listen")
    adm = Admission(limits, budget if budget is not None else process_budget(),
                    name=f"metrics listener {listen}")
    now = clock if clock is not None else asyncio.get_running_loop().time
    cache: list[tuple[float, bytes]] = []
    head_timeout = limits.auth_timeout_s or HEAD_TIMEOUT_S

    def rendered() -> bytes:
        t = now()
        if cache and t - cache[0][0] < RENDER_CACHE_S:
            return cache[0][1]
        body = render()
        cache[:] = [(t, body)]
        return body

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) and peername else "?"
        refused = adm.admit(peer)
        if refused is not None:
            adm.stats.refuse(refused[0])
            body = refused[1].encode() + b"\n"
            with contextlib.suppress(ConnectionError, RuntimeError):
                writer.write(b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain"
                             b"\r\nContent-Length: " + str(len(body)).encode()
                             + b"\r\nConnection: close\r\n\r\n" + body)
            writer.transport.abort()  # closed now: a refused peer holds no fd
            return
        try:
            async with asyncio.timeout(head_timeout):
                head = await reader.readuntil(b"\r\n\r\n")
            line = head.split(b"\r\n", 1)[0].split()
            extra = b""
            if not authorized(head, token):
                body = (b"a bearer token is needed (Authorization: Bearer <the edge's "
                        b"--metrics-token-file>)\n")
                status, ctype = b"401 Unauthorized", b"text/plain"
                extra = b"WWW-Authenticate: Bearer\r\n"
            elif len(line) >= 2 and line[0] == b"GET" and \
                    line[1].split(b"?")[0] == b"/metrics":
                body, status, ctype = rendered(), b"200 OK", CONTENT_TYPE_LATEST.encode()
            else:
                body, status, ctype = b"only GET /metrics here\n", b"404 Not Found", b"text/plain"
            writer.write(b"HTTP/1.0 " + status + b"\r\n" + extra + b"Content-Type: " + ctype
                         + b"\r\nContent-Length: " + str(len(body)).encode()
                         + b"\r\nConnection: close\r\n\r\n" + body)
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError):
            pass
        finally:
            adm.release(peer, established=False)
            writer.close()
            with contextlib.suppress(ConnectionError, TimeoutError):
                async with asyncio.timeout(1.0):
                    await writer.wait_closed()

    return await asyncio.start_server(handle, host.strip("[]"), int(port),
                                      limit=MAX_REQUEST_BYTES)
