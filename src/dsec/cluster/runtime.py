"""A complete single-machine cluster: what ``dsec up``, ``dsec apiserver`` and
``LocalCluster`` run.

Pieces: the SQLite state store under ``state_dir``, the control plane (IAM, quotas,
registry, placement, heartbeats, sweeper), the REST apiserver on uvicorn and the Aether
gateway, and the edges. The apiserver reaches every edge only through its socket, exactly
as it would across machines. Where the edges run is the topology:

- ``edge_processes=True`` (``dsec up``): each of ``edges`` local nodes is a ``dsec edge``
  process of its own on ``state_dir/edges/<node>.sock``, supervised
  (:mod:`dsec.cluster.edge_process`): restarted on a crash with backoff (it re-adopts
  its sandboxes from its journal, well within the node-loss TTL, so the control plane
  never declares the node lost), given up on after a crash loop, with a report. An edge
  crash is then one node's problem, never the apiserver's;
- ``edge_processes=False``: the edges run in this process (tests that reach into an
  :class:`~dsec.edge.node.EdgeNode`);
- ``remote_edges`` (``dsec apiserver``): edges this process does not run, by address.

Each local edge's capacity is measured from the machine (cores, memory, the state dir's
filesystem; see :func:`dsec.edge.admission.measure_host`), split evenly among the local
edges (together they admit what the machine does) and multiplied by ``overcommit``.

``local.json`` in the state dir records how to reach the cluster
(``{"url", "gateway", "api_key", "pid", "state_dir"}``, mode 0600); the SDK and CLI read it
when neither ``DSEC_URL`` nor ``url=`` is given. The default state dir is
``$DSEC_STATE_DIR``, else ``~/.dsec``. ``up.lock`` in the state dir is held while local
edges run, so two ``dsec up`` cannot share one state dir, and the next ``dsec up`` after a
kill -9 knows that any edge process still recorded in ``edges/<node>.pid`` was left behind
(it stops it gracefully, so its sandboxes are adopted by the fresh edge).

Stopping destroys every sandbox (reason ``shutdown``) so nothing is left behind — no
process, mount or cgroup — unless ``keep`` is set, in which case sandboxes stay and the
edges re-adopt them at the next start (from their journals). A ``dsec up`` killed with -9
cannot do either: its edges stop when they notice (the kernel sends them SIGTERM), keep
their sandboxes, and the next ``dsec up`` re-adopts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import secrets
import signal
import socket
import stat
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

from dsec.aether.limits import ServerLimits
from dsec.cluster import DSEC_ARGV
from dsec.cluster.compose import api_service
from dsec.cluster.edge_process import EdgePaths, EdgeProcess, reclaim_orphan
from dsec.cluster.membership import Unreachable as _Unreachable
from dsec.control.api.http_limits import HttpLimits
from dsec.control.api.plane import ControlPlane, PlaneConfig
from dsec.control.api.service import ApiConfig, ApiService
from dsec.control.apiserver import RestConfig, build_app
from dsec.control.metrics import ApiMetrics
from dsec.control.ratelimit import RateLimitConfig
from dsec.control.supervisor import RestartPolicy
from dsec.edge.admission import (
    Capacity,
    HostResources,
    Overcommit,
    bound_disk,
    measure_host,
    plan_capacity,
)
from dsec.edge.backends import DISK_POOLED, LAYERED
from dsec.edge.backends.container.disk import MIN_POOL_BYTES, POOL_SIZE_ENV, pool_size_for
from dsec.errors import DsecError, InUse, InvalidArgument, TransportError
from dsec.ids import parse_node_id
from dsec.logs import AUDIT_FILE, AuditLog
from dsec.statedir import (
    LOCAL_FILE,
    create_private_file,
    ensure_private_dir,
    read_local,
    write_private_file,
)
from dsec.wire.netpolicy import NetworkPolicy

__all__ = ["ClusterConfig", "ClusterRuntime"]

log = logging.getLogger("dsec.cluster")

LOCK_FILE = "up.lock"
# Bounds of the steps of stopping (SIGTERM: a rolling upgrade, docs/deploy.md). Serving
# drains in-flight requests and idle kept-alive connections (their keep-alive timeout:
# 5 s) with a margin; every later step (closing the service, the plane's loops, the
# store's pool and LISTEN connection) normally takes milliseconds, and one that overruns
# its bound is logged and left behind, so a replica always exits.
HTTP_DRAIN_S = 8.0
STOP_STEP_S = 10.0
# How long a restarted edge process takes to serve again: measured 0.3-0.8 s (Python
# start-up, imports, journal re-adoption) on the 2-core dev VM under load; doubled.
EDGE_RESTART_BUDGET_S = 2.0


@dataclass(slots=True, kw_only=True)
class ClusterConfig:
    """What to run. ``listen`` is ``HOST:PORT`` for REST (port 0 picks a free one)."""

    state_dir: str
    listen: str = "127.0.0.1:8470"
    # The state store's URL (dsec.control.store.open_store): sqlite:///path or
    # postgresql://... (what apiserver replicas share). None: <state_dir>/control.sqlite.
    store: str | None = None
    gateway: str | None = "tcp:127.0.0.1:0"   # Aether gateway address; None = off
    backend: str = "simulated"                # default backend for creates
    # Isolation tiers (issue 21) every local edge offers besides ``backend`` and the
    # simulated one: backend names, e.g. ("gvisor", "vm") (`dsec up --tiers gvisor,vm`).
    # A create with isolation="vm" is placed on an edge offering "vm".
    tiers: tuple[str, ...] = ()
    edges: int = 1                            # local edges to run (0: remote_edges only)
    # Each local edge in its own supervised `dsec edge` process (False: in this process,
    # for tests that reach into an EdgeNode).
    edge_processes: bool = True
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    # Edges this process does not run (`dsec apiserver`): node id -> unix:PATH|tcp:H:P.
    remote_edges: Mapping[str, str] = field(default_factory=dict)
    edge_token: bytes | None = None           # Aether token for tcp: remote edges
    # The machine the local edges share; None = measured (cores, memory, disk of the
    # state dir's filesystem). Split evenly among the local edges, then overcommitted.
    cpu_milli: int | None = None
    memory_bytes: int | None = None
    disk_bytes: int | None = None
    overcommit: Overcommit = field(default_factory=Overcommit)
    edge_max_sandboxes: int = 100_000
    keep: bool = False
    rate: RateLimitConfig = field(default_factory=RateLimitConfig)
    # Requests that fail to authenticate, per client address (key-guessing floods -> 429).
    anon_rate: RateLimitConfig = field(default_factory=lambda: RateLimitConfig(
        rate_per_s=20.0, burst=100.0, max_keys=100_000))
    # /metrics: None = open to loopback clients only (dsec up listens on 127.0.0.1 by
    # default); a token = 'Authorization: Bearer <token>' required from anywhere.
    # `dsec up` takes it from $DSEC_METRICS_TOKEN.
    metrics_token: str | None = field(
        default_factory=lambda: os.environ.get("DSEC_METRICS_TOKEN") or None)
    default_ttl_s: float | None = 6 * 3600.0
    plane: PlaneConfig = field(default_factory=PlaneConfig)
    # What peers may hold on the Aether listeners (gateway, edge sockets) and on REST:
    # connection caps per listener and per address, deadlines, frame sizes (issue 12).
    listener_limits: ServerLimits = field(default_factory=ServerLimits)
    http_limits: HttpLimits = field(default_factory=HttpLimits)
    write_local: bool = True
    access_log: bool = False
    # Container sandboxes' disk: the cap of a sandbox created without disk_bytes, and the
    # size of each edge's btrfs disk pool when first made (None: 90% of the state dir
    # filesystem's free space; sparse, so it takes host space only as it fills).
    disk_default_bytes: int = 10 << 30
    disk_pool_bytes: int | None = None
    # The layer store's budget (`--image-store-budget`): bytes, "off" to clear it, None to
    # leave what the store records (LayerStore.set_budget).
    image_store_budget: int | Literal["off"] | None = None
    # The apiserver's per-tenant budget of unread replies (`--reply-budget`): bytes, "off"
    # for none, None for ApiConfig's default (4 GiB; dsec.control.replybudget).
    reply_budget: int | Literal["off"] | None = None
    # Latency profile of the simulated backend: "zero", or "paper[-container|-fncall|
    # -microvm]" (slow creates widen the crash windows the fault tests aim at).
    simulated_profile: str = "zero"
    # The egress policy of a create that names none (`dsec up --net-default`); the
    # apiserver resolves it, so edges always get a policy.
    net_default: NetworkPolicy = field(default_factory=NetworkPolicy)
    # Registries the apiserver pulls images from for its callers (images.pull, first-use
    # pulls): host[:port] patterns (fnmatch), None = any but loopback, link-local and
    # private addresses (dsec.image.egress). A pull connects from the
    # apiserver's host to the host a caller names: restrict it where that reaches
    # internal services (docs/images.md "Pulling from registries").
    registries: tuple[str, ...] | None = None
    # Further host[:port] patterns a listed registry's redirects and token realms may
    # reach (its blob CDN, its auth service); no ref may name them. Every other hop is
    # refused without being contacted (red team F16).
    registry_blob_hosts: tuple[str, ...] = ()
    # [blob] The blob store layers are pushed to (`images.push`) and read from by nodes
    # that lack them (`--blob-store`, dsec.image.blob): an operator's URL, trusted as
    # given; passed on to the local edges. None: no blob store.
    blob_store: str | None = None
    # [life] the local edge processes' --log-level and --log-format (dsec up's own; their
    # output goes to DIR/edges/<node>.log)
    edge_log_level: str = "warning"
    edge_log_format: str = "text"
    # [life] local edge i serves its Prometheus metrics on 127.0.0.1:<port + i>
    # (`dsec up --edge-metrics-port`; None: off)
    edge_metrics_port: int | None = None
    # [lazy2] The LRU budget of each local edge process's chunk cache in bytes
    # (`dsec edge --lazy-cache-bytes`; None: the edge's default, no limit).
    lazy_cache_bytes: int | None = None
    # The network flags every local edge process gets (`dsec edge --net-*`; `dsec up`
    # takes the same): node ceiling, uplink (None: no router, policy 'none' only), the
    # host uplink's egress device, the slot pool and the resolver's upstreams.
    net_max: NetworkPolicy | None = None
    net_uplink: str | None = None
    #: the first edge's uplink /30; edge i gets the i-th /30 after it (each its own)
    net_link: str = "169.254.213.0/30"
    net_egress: str | None = None
    net_pool: str = "10.213.0.0/16"
    net_dns_upstream: tuple[str, ...] = ()
    # [join] Edges on other hosts join with a token (docs/cluster.md "Joining hosts"):
    # the cluster CA lives in cluster_dir (None: <state_dir>/cluster; made on first
    # start), the join routes are served and every joined edge is dialled. False: only
    # the edges given here.
    join: bool = True
    cluster_dir: str | None = None
    #: ``--net-ipv6`` of every edge: "auto" (IPv6 where the uplink has it) or "off"
    net_ipv6: str = "auto"
    # [e2b] The E2B-compatible API (dsec.control.e2b, docs/e2b.md) on its own listener,
    # HOST:PORT (port 0 picks one); None: off. ``e2b_domain`` routes
    # {port}-{id}.{domain} host names to envd; ``e2b_tls_*`` serve it over TLS.
    e2b: str | None = None
    e2b_domain: str | None = None
    e2b_tls_cert: str | None = None
    e2b_tls_key: str | None = None


#: the edges' metrics scrape token in the state dir (dsec up --edge-metrics-port)
METRICS_TOKEN_FILE = "metrics.token"


def metrics_token_file(state_dir: str) -> str:
    """``<state_dir>/metrics.token`` (made once, 0600, random): the bearer token the
    edges' metrics listeners ask of a scraper (dsec.edge.metrics)."""
    path = os.path.join(state_dir, METRICS_TOKEN_FILE)
    # whole or not at all; an empty one a crash left is made again (red team 22 A4)
    create_private_file(path, lambda: (secrets.token_urlsafe(32) + "\n").encode())
    return path


def check_key_file(path: str, st: os.stat_result) -> None:
    """Refuse a key file another user owns or others may read (pure but for the message;
    hx): ``port-token.key`` forges every exposed port's URL token, and with any E2B
    access token it opens the API key sealed in it (docs/host-security.md). Group read is
    let through (a Kubernetes Secret mounted with an fsGroup) with a warning."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in (0, os.geteuid()) or mode & 0o007:
        raise InvalidArgument(
            f"{path} is mode {mode:o}, owned by uid {st.st_uid}: any host user who can "
            "read it forges exposed ports' URLs and opens E2B access tokens into API "
            "keys; chown it to this user and chmod 600 it (or remove it: the URLs and "
            "E2B tokens handed out change)")
    if mode & 0o070:
        logging.getLogger(__name__).warning(
            "%s is readable by its group (mode %o): the group's members can forge port "
            "URLs and open E2B tokens; chmod 600 it unless that group is this service's",
            path, mode)


def _port_token_key(state_dir: str) -> bytes:
    """The key of exposed ports' URL tokens (docs/ports.md), made once and kept in the
    (0700) state dir, 0600: a restarted apiserver still honours the URLs it handed out.
    Written whole to a temporary file and linked into place, so a crash never leaves a
    short key, and two processes starting at once agree on one; an empty one (a crash of
    an older version) is made again: no URL was ever signed with it
    (:func:`dsec.statedir.create_private_file`)."""
    path = os.path.join(state_dir, "port-token.key")
    create_private_file(path, lambda: secrets.token_bytes(32))
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        check_key_file(path, os.fstat(fd))
        key = os.read(fd, 64)
    finally:
        os.close(fd)
    if len(key) != 32:
        raise InvalidArgument(f"{path} holds {len(key)} bytes, not a 32-byte key; remove it "
                              "(the URLs of exposed ports change)")
    return key


def _reply_budget(cfg: ClusterConfig) -> int | None:
    """ApiConfig's reply_budget_bytes from ``--reply-budget`` (unset: its default)."""
    if cfg.reply_budget is None:
        return ApiConfig().reply_budget_bytes
    return None if cfg.reply_budget == "off" else cfg.reply_budget


def _host_paths(state_dir: str) -> tuple[str, ...]:
    """The spellings of ``state_dir`` an error message may carry, longest first."""
    paths = {os.path.abspath(state_dir), os.path.realpath(state_dir)}
    return tuple(sorted((p for p in paths if p not in ("", "/")), key=len, reverse=True))


class ClusterRuntime:
    """Start with ``await rt.start()``; ``rt.url``, ``rt.gateway_address`` and
    ``rt.admin_key`` are then set. ``await rt.stop()`` tears it down."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.url = ""
        self.gateway_address: str | None = None
        self.admin_key = ""
        self.metrics = ApiMetrics()
        self.plane: ControlPlane | None = None
        self.service: ApiService | None = None
        self.host: HostResources | None = None
        self.capacity: Capacity | None = None   # of each local edge
        self._pool_default: int | None = None   # each local edge's disk pool (_pool_share)
        self.node_ids: list[str] = [f"edge-{i}" for i in range(config.edges)]
        self.nodes: list[Any] = []            # EdgeNode (in-process edges)
        self.processes: dict[str, EdgeProcess] = {}   # supervised edge processes
        #: recent supervisor reports (time, node, level, message), newest last
        self.reports: deque[tuple[float, str, str, str]] = deque(maxlen=20)
        self._edge_servers: list[Any] = []
        self._clients: list[Any] = []
        self._gateway: Any = None
        self._uvicorn: Any = None
        self.e2b: Any = None          # [e2b] dsec.control.e2b.E2BServer when serving
        self.e2b_url: str | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self._http_sock: socket.socket | None = None
        self._store: Any = None
        self.http_admission: Any = None       # the REST listener's Admission (counters)
        self._images: Any = None              # StoreImages shared by in-process container edges
        self._mounts: Any = None              # its MountCache (one per process)
        self._lock_fd = -1
        self._bg: set[asyncio.Task[None]] = set()
        self.join_authority: Any = None       # [join] dsec.cluster.join.JoinAuthority
        self.membership: Any = None           # [join] dsec.cluster.membership.Membership

    # ------------------------------------------------------------------ start
    async def start(self) -> ClusterRuntime:
        from dsec.control.store import open_store
        from dsec.control.store.sqlite import SqliteStore

        given = self.config.state_dir
        # 0700 even when it existed: see dsec.statedir (keys, env, every tenant's layers);
        # its real path from then on, so nobody can swap a symlink on the way to it.
        cfg = self.config = replace(self.config, state_dir=ensure_private_dir(given))
        try:
            if not 0 <= cfg.edges <= 64 or (cfg.edges == 0 and not cfg.remote_edges
                                            and not cfg.join):
                raise InvalidArgument(f"edges={cfg.edges} must be within 1..64 (or 0 with "
                                      "remote edges given, or edges that join)")
            for node in cfg.remote_edges:
                parse_node_id(node)
                if node in self.node_ids:
                    raise InvalidArgument(f"remote edge {node!r} clashes with a local edge")
            if cfg.edges and cfg.edge_processes:
                worst = cfg.restart.first_delay_s + EDGE_RESTART_BUDGET_S
                if worst >= cfg.plane.node_ttl_s:
                    log.warning(
                        "a crashed edge is restarted after %.1fs and takes up to ~%.1fs to "
                        "serve again, but the node-loss TTL is %.1fs: the control plane "
                        "may write its sandboxes off first; raise node_ttl_s or lower "
                        "restart.first_delay_s", cfg.restart.first_delay_s,
                        EDGE_RESTART_BUDGET_S, cfg.plane.node_ttl_s)
            if cfg.net_uplink is not None and cfg.edges and not cfg.edge_processes:
                raise InvalidArgument("net_uplink needs edge processes (the router and its "
                                      "resolver live in `dsec edge`), not in-process edges")
            if cfg.edges:
                self._lock_state_dir()
                self._size_edges()
                if cfg.edge_processes:
                    await self._begin_edge_processes()
                else:
                    await self._start_edges()
            # The edge processes boot (~0.3 s of Python start-up and re-adoption) while
            # this process opens its store and loads the HTTP stack.
            import uvicorn  # noqa: F401 - imported now to overlap with the edges' start

            self._store = (SqliteStore(os.path.join(cfg.state_dir, "control.sqlite"))
                           if cfg.store is None else open_store(cfg.store))
            plane = self.plane = ControlPlane.open(self._store, metrics=self.metrics,
                                                   config=cfg.plane)
            await asyncio.gather(*(p.started() for p in self.processes.values()))
            for node in self.node_ids:
                await self._add_edge(plane, node, f"unix:{self._sock(node)}", None)
            for node, addr in cfg.remote_edges.items():
                await self._add_edge(plane, node, addr, cfg.edge_token)
            if cfg.join:
                await self._start_membership(plane)
            loop = asyncio.get_running_loop()
            service = self.service = api_service(
                self._store, plane, rate=cfg.rate, anon_rate=cfg.anon_rate, clock=loop.time,
                config=ApiConfig(default_ttl_s=cfg.default_ttl_s, default_backend=cfg.backend,
                                 redact_paths=_host_paths(given),
                                 port_token_key=_port_token_key(cfg.state_dir),
                                 net_default=cfg.net_default,
                                 reply_budget_bytes=_reply_budget(cfg)))
            service.joins = self.join_authority     # the cluster_* rows (None: no CA)
            # issue 19: admin actions, durable, 0600 in the state dir (dsec.logs)
            service.audit = AuditLog(os.path.join(cfg.state_dir, AUDIT_FILE))
            plane.layer_dir = os.path.join(cfg.state_dir, "layers")
            if self._layered():
                # the base's names in the state store's tag table too (every replica's)
                await asyncio.to_thread(self._ensure_base_layer, plane.images.layers())
            plane.images.registries = cfg.registries
            plane.images.registry_blob_hosts = cfg.registry_blob_hosts
            plane.images.blob_store = cfg.blob_store
            if cfg.image_store_budget is not None:
                from dsec.image import LayerStore

                LayerStore(plane.layer_dir).set_budget(
                    None if cfg.image_store_budget == "off" else cfg.image_store_budget)
            await plane.start()
            if self.processes:
                self._background(self._mind_edges(), "dsec-edge-minder")
            self.admin_key = self._admin_key(plane)
            if cfg.gateway is not None:
                from dsec.control.gateway import serve_gateway
                self._gateway = await serve_gateway(service, plane, cfg.gateway,
                                                    limits=self.config.listener_limits)
                self.gateway_address = service.gateway_address = str(self._gateway.address)
            await self._start_http(service, plane)
            if cfg.write_local:
                self._write_local()
        except BaseException:
            # A start that failed destroys nothing: the sandboxes edges re-adopted from a
            # `--keep` run stay for the next attempt.
            await self.stop(keep=True)
            raise
        return self

    async def _start_membership(self, plane: ControlPlane) -> None:
        """[join] The cluster CA (made if absent), the join authority behind the join
        routes, and the first read of the joined edges (then re-read in the background)."""
        from dsec.cluster.ca import init_ca
        from dsec.cluster.join import JoinAuthority
        from dsec.cluster.membership import Membership

        cfg = self.config
        ca, created = init_ca(cfg.cluster_dir or os.path.join(cfg.state_dir, "cluster"))
        if created:
            log.info("cluster CA created in %s (sha256 %s)", ca.dir, ca.fingerprint)
        static = frozenset(self.node_ids) | set(cfg.remote_edges)
        self.join_authority = JoinAuthority(self._store, ca, reserved=static)
        self.membership = Membership(self._store, plane, ca, static=static)
        await self.membership.sync()
        self._background(self.membership.run(), "dsec-membership")

    async def _add_edge(self, plane: ControlPlane, node: str, addr: str,
                        token: bytes | None) -> None:
        """Register an edge with the control plane. One that cannot be dialled yet (a
        remote edge still starting) is registered anyway: the plane redials it on every
        poll, and it becomes healthy with its first heartbeat."""
        from dsec.edge.client import EdgeClient

        try:
            client = await EdgeClient.connect(addr, token=token)
        except DsecError as exc:
            if node in self.node_ids:
                raise
            log.warning("edge %s at %s is not reachable yet (%s); will keep trying", node,
                        addr, exc)
            client = EdgeClient(cast(Any, _Unreachable(node, addr, str(exc))))
        self._clients.append(client)
        plane.add_edge(node, addr, client, token=token)

    def _lock_state_dir(self) -> None:
        """One ``dsec up`` per state dir: its edges' journals, sockets and pid files are
        this process's. The lock dies with the process, so after a kill -9 the next
        start takes it and knows leftover edge processes are orphans."""
        path = os.path.join(self.config.state_dir, LOCK_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise InUse(f"another dsec up (pid {owner}) runs on state dir "
                        f"{self.config.state_dir}; stop it or pass another --state-dir",
                        state_dir=self.config.state_dir) from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _size_edges(self) -> None:
        cfg = self.config
        measured = measure_host(cfg.state_dir)
        sources = dict(measured.sources)
        for name, given in (("cpu", cfg.cpu_milli), ("memory", cfg.memory_bytes),
                            ("disk", cfg.disk_bytes)):
            if given is not None:
                sources[name] = "given"
        self.host = HostResources(
            cpu_milli=cfg.cpu_milli or measured.cpu_milli,
            memory_bytes=cfg.memory_bytes or measured.memory_bytes,
            disk_bytes=cfg.disk_bytes or measured.disk_bytes, sources=sources)
        self.capacity = plan_capacity(self.host, overcommit=cfg.overcommit,
                                      max_sandboxes=cfg.edge_max_sandboxes, share=cfg.edges)

    def _sock(self, node_id: str) -> str:
        return os.path.join(self.config.state_dir, "edges", f"{node_id}.sock")

    def _local_backends(self) -> list[str]:
        return sorted({"simulated", self.config.backend, *self.config.tiers})

    def _layered(self) -> bool:
        """A local edge runs a backend that starts sandboxes from the layer store."""
        return any(b in LAYERED for b in self._local_backends())

    def _ensure_base_layer(self, store: Any = None) -> None:
        """``base`` (busybox) in the cluster's layer store, built on first use (~0.1 s) so
        ``dsec up --backend container`` works on a fresh machine; done once here, so
        edges never race to build it."""
        from dsec.image import LayerStore, ensure_busybox_base

        if store is None:
            store = LayerStore(os.path.join(self.config.state_dir, "layers"))
        base = ensure_busybox_base(store)
        if "base:latest" not in store.refs():
            store.tag(base.digest, "base")

    # ------------------------------------------------------- edge processes
    def _edge_argv(self, node: str) -> list[str]:
        cfg, cap = self.config, self.capacity
        assert cap is not None and cap.physical is not None
        paths = EdgePaths.under(cfg.state_dir, node)
        argv = [*DSEC_ARGV, "edge", "--listen", f"unix:{paths.socket}",
                "--state-dir", paths.state_dir, "--node-id", node,
                "--cpu-milli", str(cap.physical.cpu_milli),
                "--memory-bytes", str(cap.physical.memory_bytes),
                "--cpu-overcommit", repr(cfg.overcommit.cpu),
                "--memory-overcommit", repr(cfg.overcommit.memory),
                "--max-sandboxes", str(cap.max_sandboxes), "--log-level", cfg.edge_log_level,
                "--log-format", cfg.edge_log_format]
        if cfg.edge_metrics_port is not None and node in self.node_ids:
            argv += ["--metrics-listen",
                     f"127.0.0.1:{cfg.edge_metrics_port + self.node_ids.index(node)}",
                     "--metrics-token-file", metrics_token_file(cfg.state_dir)]
        if cap.disk_bytes is not None:
            argv += ["--disk-bytes", str(cap.disk_bytes)]
        for b in self._local_backends():
            argv += ["--backend", b]
        if cfg.simulated_profile != "zero":
            argv += ["--profile", cfg.simulated_profile]
        if self._layered():
            argv += ["--layer-store", os.path.join(cfg.state_dir, "layers"),
                     "--disk-default", str(cfg.disk_default_bytes)]
            for b in self._local_backends():
                if b in LAYERED:
                    argv += ["--backend-opt",
                             f"{b}.root_dir={os.path.join(cfg.state_dir, b, node)}"]
            pool = self._pool_share()
            if pool is not None:
                argv += ["--disk-pool", str(pool)]
        if cfg.edges > 1:
            # the host's pid budget split between its edges, as the disk pool (red team
            # 21, A5): each edge's tiers otherwise budget the whole host
            argv += ["--pids-share", repr(1 / cfg.edges)]
        if cfg.blob_store is not None:
            argv += ["--blob-store", cfg.blob_store]      # never carries a secret (refused)
            if cfg.lazy_cache_bytes is not None:
                argv += ["--lazy-cache-bytes", str(cfg.lazy_cache_bytes)]
        return argv + self._net_argv(self.node_ids.index(node))

    def _net_argv(self, index: int = 0) -> list[str]:
        """The edges' network flags. Policies travel as JSON files in the (0700) state
        dir, written whole before the edges start: the same spelling `dsec edge` reads."""
        cfg = self.config
        argv = ["--net-default", self._policy_arg("net-default", cfg.net_default)]
        if cfg.net_max is not None:
            argv += ["--net-max", self._policy_arg("net-max", cfg.net_max)]
        if cfg.net_uplink is not None:
            first = ipaddress.IPv4Network(cfg.net_link)
            link = ipaddress.IPv4Network((int(first.network_address) + 4 * index, 30))
            argv += ["--net-uplink", cfg.net_uplink, "--net-pool", cfg.net_pool,
                     "--net-link", str(link)]
            if cfg.net_egress is not None:
                argv += ["--net-egress", cfg.net_egress]
            for u in cfg.net_dns_upstream:
                argv += ["--net-dns-upstream", u]
            argv += ["--net-ipv6", cfg.net_ipv6]
        return argv

    def _policy_arg(self, name: str, policy: NetworkPolicy) -> str:
        if policy.mode in ("none", "open") and not policy.allow and not policy.deny:
            return policy.mode
        import msgspec

        path = os.path.join(self.config.state_dir, f"{name}.json")
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600),
                  "wb") as f:
            f.write(msgspec.json.encode(policy))
        os.replace(tmp, path)
        return f"@{path}"

    def _pool_share(self) -> int | None:
        """Each local edge's disk pool size: ``disk_pool_bytes`` if given, else the
        default pool (half the state filesystem's free space, at most 64 GiB) split over
        the edges - measured once here. Each edge deciding for itself took half of what
        was free *then*, so N edges starting together reserved N halves (the pools are
        preallocated) and the last ones failed to start. None: the edges' own default
        ($DSEC_DISK_POOL_BYTES, which they inherit)."""
        cfg = self.config
        if cfg.disk_pool_bytes is not None:
            return cfg.disk_pool_bytes
        if os.environ.get(POOL_SIZE_ENV):
            return None
        if self._pool_default is None:
            vfs = os.statvfs(cfg.state_dir)
            self._pool_default = max(MIN_POOL_BYTES,
                                     pool_size_for(vfs.f_bavail * vfs.f_frsize) // cfg.edges)
        return self._pool_default

    def _on_report(self, node: str, level: str, message: str) -> None:
        self.reports.append((time.time(), node, level, message))

    def _on_ready(self, node: str) -> None:
        """A (re)started edge serves again: have the control plane redial it now rather
        than at its next poll, so a crashed edge is back in well under a second."""
        plane = self.plane
        entry = plane.edges.get(node) if plane is not None else None
        if plane is None or entry is None:
            return
        entry.retry_at = 0.0
        self._background(plane.poll_edges(), "dsec-edge-redial")

    def _background(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _mind_edges(self) -> None:
        """What only the supervisor of local edge processes can tell the control plane,
        which otherwise sees nothing but a silent node and writes it off after
        ``node_ttl_s`` (destroying its sandboxes when it returns):

        - an edge being restarted (after a crash, or by :meth:`start_edge`) is coming
          back: the node is held (:meth:`ControlPlane.hold_edge`) for as long as the
          restart takes, also past the TTL (re-adopting many sandboxes on a loaded
          machine); a crash loop that gives up stops the hold;
        - an edge whose process runs but is silent (a poll timed out or was refused
          with nothing else heard from it) and has not answered a heartbeat for half the
          TTL is hung (stopped, deadlocked, stuck in the kernel): it is killed, so its
          supervisor restarts it and it re-adopts its sandboxes from its journal, as
          after a crash, instead of being written off. An edge that answers with errors
          or late (busy), or that this apiserver cannot reach for a reason of its own
          (``answered``, ``blind``), is alive and left alone."""
        plane = self.plane
        assert plane is not None
        cfg = self.config.plane
        hang_s = max(cfg.node_ttl_s / 2, 3 * cfg.heartbeat_interval_s)
        period = min(1.0, cfg.node_ttl_s / 10)
        last = time.monotonic()
        while True:
            await asyncio.sleep(period)
            now, woke_late = time.monotonic(), time.monotonic() - last > 3 * period + 1.0
            last = now
            if woke_late:
                # This process itself was stopped or starved: the edges' silence is its
                # own. Let the control plane poll them again before judging any.
                continue
            for node, proc in list(self.processes.items()):
                e = plane.edges.get(node)
                if e is None:
                    continue
                try:
                    if proc.ever_ready and proc.state in ("starting", "backoff"):
                        await plane.hold_edge(
                            node, f"edge {node} is being restarted by dsec up "
                                  f"(restart {proc.sup.restarts})", 2 * cfg.node_ttl_s)
                    elif (proc.state == "running" and proc.ready_at is not None
                          and proc.clock() - proc.ready_at > hang_s
                          and e.failure == "silent" and e.heartbeat is not None
                          and plane.clock() - e.last_seen > hang_s):
                        why = (f"edge {node} (pid {proc.pid}) has not answered a heartbeat "
                               f"for {plane.clock() - e.last_seen:.1f}s though its process "
                               "runs: killing it so it restarts and re-adopts its "
                               f"sandboxes before the node-loss TTL ({cfg.node_ttl_s:g}s)")
                        log.warning("%s", why)
                        self._on_report(node, "warning", why)
                        if proc.kill(signal.SIGKILL):
                            await plane.hold_edge(node, f"edge {node} was hung; dsec up "
                                                  "is restarting it", 2 * cfg.node_ttl_s)
                except Exception:
                    log.exception("minding edge %s failed", node)

    async def _begin_edge_processes(self) -> None:
        cfg = self.config
        os.makedirs(os.path.join(cfg.state_dir, "edges"), mode=0o700, exist_ok=True)
        for node in self.node_ids:
            paths = EdgePaths.under(cfg.state_dir, node)
            what = await reclaim_orphan(paths)
            if what is not None:
                log.warning("%s: %s", node, what)
                self._on_report(node, "warning", what)
            proc = self.processes[node] = EdgeProcess(
                node, self._edge_argv(node), paths, policy=cfg.restart,
                on_report=self._on_report, on_ready=self._on_ready)
            proc.begin()
        if self._layered():
            # While the edges boot: they need the base layer only at their first create,
            # which cannot come before this runtime serves.
            await asyncio.to_thread(self._ensure_base_layer)

    # ------------------------------------------------------ in-process edges
    async def _start_edges(self) -> None:
        if self._layered():
            await asyncio.to_thread(self._ensure_base_layer)
        for node_id in self.node_ids:
            node, server = await self._run_edge(node_id)
            self.nodes.append(node)
            self._edge_servers.append(server)

    async def _run_edge(self, node_id: str) -> tuple[Any, Any]:
        """Start edge ``node_id`` in this process (adopting what its journal in the
        state dir holds) and serve it on its Unix socket."""
        from dsec.edge.backends import make_backend
        from dsec.edge.governor import pids_split
        from dsec.edge.node import EdgeNode, NodeConfig
        from dsec.edge.service import serve_edge

        assert self.capacity is not None
        # the host's pid budget split between its edges and their tiers (red team 21, A5)
        shares = pids_split(self._local_backends(), 1 / max(1, self.config.edges))
        backends = {n: make_backend(n, **self._backend_opts(n, node_id),
                                    **({"pids_share": shares[n]} if n in shares else {}))
                    for n in self._local_backends()}
        node = EdgeNode(NodeConfig(
            node_id=node_id, capacity=bound_disk(self.capacity, backends.values()),
            state_dir=os.path.join(self.config.state_dir, "edges", node_id),
            layer_store=os.path.join(self.config.state_dir, "layers")), backends)
        await node.start()
        try:
            server = await serve_edge(node, f"unix:{self._sock(node_id)}",
                                      limits=self.config.listener_limits)
        except BaseException:
            await node.close()
            raise
        return node, server

    def _backend_opts(self, name: str, node_id: str) -> dict[str, Any]:
        """Per-backend options of an in-process edge. The container backend gets a root
        dir per edge and the cluster's layer store (``state_dir/layers``, where ``dsec
        image build`` and ``POST /v1/images`` put layers and where snapshots are
        written), resolved by :class:`~dsec.edge.backends.container.images.StoreImages`. In-process edges
        share one store and one mount cache, so a layer is mounted once per process and
        every local edge can start sandboxes from every snapshot. fncall work dirs live
        beside the edge's journal, as ``dsec edge --state-dir`` keeps them, so a
        restarted edge adopts its fncall sandboxes (a temp dir per process lost every
        one of them at each restart)."""
        if name == "fncall":
            return {"root": os.path.join(self.config.state_dir, "edges", node_id, "fncall")}
        if name == "simulated":
            from dsec.edge.backends.simulated import NodeLatencyProfile
            prof = self.config.simulated_profile
            if prof == "zero":
                return {"profile": NodeLatencyProfile.zero()}
            kind = prof.removeprefix("paper").lstrip("-") or "container"
            if kind not in ("container", "fncall", "microvm"):
                raise InvalidArgument(f"simulated_profile={prof!r}: use 'zero' or "
                                      "'paper[-container|-fncall|-microvm]'")
            return {"profile": NodeLatencyProfile.paper(kind)}  # type: ignore[arg-type]
        if name not in LAYERED:
            return {}
        from dsec.edge.backends.container.images import StoreImages
        from dsec.image import LayerStore, MountCache

        if self._images is None:
            self._mounts = MountCache()
            self._images = StoreImages(
                LayerStore(os.path.join(self.config.state_dir, "layers")), self._mounts)
        # every tier of every in-process edge: one images object (issue 21)
        opts: dict[str, Any] = {
            "root_dir": os.path.join(self.config.state_dir, name, node_id),
            "images": self._images}
        if name in DISK_POOLED:
            # the edge's share split among its pooled tiers, as `dsec edge` does
            pooled = sum(1 for b in self._local_backends() if b in DISK_POOLED)
            share = self._pool_share()
            opts |= {"default_disk_bytes": self.config.disk_default_bytes,
                     "disk_pool_bytes": share if share is None or pooled < 2
                     else max(MIN_POOL_BYTES, share // pooled)}
        return opts

    # --------------------------------------------------------- edge outages
    def _check_node(self, node_id: str) -> None:
        if node_id not in self.node_ids:
            raise InvalidArgument(f"no local edge {node_id!r} in this cluster; edges: "
                                  f"{self.node_ids}")

    async def stop_edge(self, node_id: str) -> None:
        """Simulate losing a machine: the edge stops at once (its process is killed with
        SIGKILL and not restarted; an in-process edge stops serving and closes), leaving
        its sandboxes and journal in place, as a crashed or partitioned node would. The
        control plane notices by missing heartbeats (``PlaneConfig.node_ttl_s``)."""
        self._check_node(node_id)
        proc = self.processes.get(node_id)
        if proc is not None:
            await proc.stop(grace_s=0)
            return
        i = self.node_ids.index(node_id)
        server = self._edge_servers[i]
        if server is None:
            return
        self._edge_servers[i] = None
        await server.close()
        await self.nodes[i].close()

    async def start_edge(self, node_id: str) -> None:
        """Bring a stopped (or crash-looped) edge back on the same socket; it re-adopts
        its sandboxes from its journal, and the control plane reconnects on its next
        poll."""
        self._check_node(node_id)
        proc = self.processes.get(node_id)
        if proc is not None:
            await proc.start()
            return
        i = self.node_ids.index(node_id)
        if self._edge_servers[i] is not None:
            return
        node, server = await self._run_edge(node_id)
        self.nodes[i] = node
        self._edge_servers[i] = server

    def kill_edge(self, node_id: str, signum: int = signal.SIGKILL) -> int:
        """Crash an edge process (kill -9 by default) behind its supervisor's back; the
        supervisor restarts it. Returns the pid killed."""
        self._check_node(node_id)
        proc = self.processes.get(node_id)
        if proc is None:
            raise InvalidArgument("kill_edge needs edges in their own processes "
                                  "(edge_processes=True)")
        pid = proc.pid
        if pid is None or not proc.kill(signum):
            raise InvalidArgument(f"edge {node_id} is not running (it is {proc.state})")
        return pid

    def edge_states(self) -> dict[str, str]:
        """Local edge -> "running", "restarting", "failed", ... (for status lines)."""
        out: dict[str, str] = {}
        for node in self.node_ids:
            proc = self.processes.get(node)
            if proc is not None:
                out[node] = {"backoff": "restarting", "starting": "starting"}.get(
                    proc.state, proc.state)
            elif self.nodes:
                i = self.node_ids.index(node)
                out[node] = "running" if self._edge_servers[i] is not None else "stopped"
        return out

    def _admin_key(self, plane: ControlPlane) -> str:
        old = read_local(self.config.state_dir)
        if old and isinstance(old.get("api_key"), str):
            try:
                plane.iam.authenticate(old["api_key"])
                return str(old["api_key"])
            except DsecError:
                pass
        return plane.bootstrap_admin()

    async def _start_http(self, service: ApiService, plane: ControlPlane) -> None:
        cfg = self.config
        host, _, port_s = cfg.listen.rpartition(":")
        if not host or not port_s.isdigit():
            raise InvalidArgument(f"--listen {cfg.listen!r} must be HOST:PORT, e.g. "
                                  "127.0.0.1:8470 (port 0 picks a free port)")
        sock = socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), int(port_s)))
        except OSError as exc:
            sock.close()
            raise TransportError(f"cannot listen on {cfg.listen}: {exc.strerror or exc}; "
                                 "pick another --listen port") from exc
        sock.listen(1024)
        sock.setblocking(False)
        port = sock.getsockname()[1]
        self.url = f"http://{host}:{port}"
        extra: tuple[Any, ...] = ()
        if self.join_authority is not None:
            from dsec.cluster.join import join_routes
            extra = tuple(join_routes(self.join_authority, service))
        app = build_app(service, plane, RestConfig(metrics_token=cfg.metrics_token,
                                                   extra_routes=extra))
        from dsec.control.api.http_limits import uvicorn_server
        # The runtime owns SIGINT/SIGTERM (`dsec up` stops the whole cluster on them):
        # the server installs no handlers of its own.
        server, self.http_admission = uvicorn_server(
            app, cfg.http_limits, name=f"REST listener {cfg.listen}",
            access_log=cfg.access_log)
        self._uvicorn = server
        self._http_sock = sock if sock.family in (socket.AF_INET, socket.AF_INET6) else None
        self._serve_task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if self._serve_task.done():
                self._serve_task.result()
                raise TransportError(f"the HTTP server on {cfg.listen} stopped at start-up")
            await asyncio.sleep(0.005)
        if cfg.e2b is not None:   # [e2b]
            from dsec.control.e2b import E2BConfig, start_e2b
            self.e2b = await start_e2b(service, cfg.e2b, config=E2BConfig(
                domain=cfg.e2b_domain), tls_cert=cfg.e2b_tls_cert,
                tls_key=cfg.e2b_tls_key, limits=cfg.http_limits)
            self.e2b_url = self.e2b.url

    def _write_local(self) -> None:
        path = os.path.join(self.config.state_dir, LOCAL_FILE)
        # fsynced before the rename: after a power loss an empty local.json lost the
        # admin key to clients (a new one was bootstrapped)
        write_private_file(path, json.dumps(
            {"url": self.url, "gateway": self.gateway_address,
             "api_key": self.admin_key, "pid": os.getpid(),
             "state_dir": self.config.state_dir,
             **({"e2b": self.e2b_url} if self.e2b_url else {})}).encode())  # [e2b]

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, int]:
        """Live sandboxes by state over the local edges (in-process: exact; edge
        processes: as of the control plane's last heartbeat from each)."""
        counts: dict[str, int] = {}
        if self.nodes:
            per_node = [n.counts() for n in self.nodes]
        elif self.plane is not None:
            per_node = [e.heartbeat.counts for e in self.plane.edges.values()
                        if e.heartbeat is not None]
        else:
            per_node = []
        for c in per_node:
            for st, n in c.items():
                counts[st] = counts.get(st, 0) + n
        return counts

    async def refresh(self) -> None:
        """Poll every edge once now (so :meth:`status` is current)."""
        if self.plane is not None and not self.nodes:
            with contextlib.suppress(Exception):
                await self.plane.poll_edges()

    # ------------------------------------------------------------------- stop
    async def stop(self, *, keep: bool | None = None) -> None:
        """Stop serving, then destroy sandboxes (unless ``keep``, default the config's)
        and stop the edges."""
        keep = self.config.keep if keep is None else keep
        if self.e2b is not None:   # [e2b]
            await _bounded("stopping the E2B listener", self.e2b.stop(), HTTP_DRAIN_S)
            self.e2b = None
        if self._uvicorn is not None:
            if self._http_sock is not None:
                from dsec.control.api.http_limits import drain_accept_queue
                await _bounded("accepting the queued connections",
                               drain_accept_queue(self._http_sock), 1.0)
            self._uvicorn.should_exit = True
            if self._serve_task is not None:
                # in-flight requests, and idle kept-alive connections until their
                # keep-alive timeout (GuardedHttpProtocol.shutdown)
                await _bounded("draining the REST listener", self._serve_task, HTTP_DRAIN_S)
            self._uvicorn = None
            self._http_sock = None
        if self._gateway is not None:
            await _bounded("closing the gateway", self._gateway.close(), STOP_STEP_S)
            self._gateway = None
        if self.service is not None:
            await _bounded("stopping keyed creates", self.service.close(), STOP_STEP_S)
            await _bounded("closing the idempotency cache",
                           self.service.idempotency.close(), STOP_STEP_S)
            if self.service.audit is not None:
                self.service.audit.close()
        for t in self._bg:
            t.cancel()
        await _bounded("stopping background tasks",
                       asyncio.gather(*self._bg, return_exceptions=True), STOP_STEP_S)
        if self.plane is not None:
            await _bounded("closing the control plane", self.plane.close(), STOP_STEP_S)
            for e in self.plane.edges.values():   # links the plane redialled itself
                with contextlib.suppress(Exception):
                    await e.link.close()
        for c in self._clients + (self.membership.clients if self.membership else []):
            with contextlib.suppress(Exception):
                await c.close()
        self._clients.clear()
        if self.processes:
            await asyncio.gather(*(self._stop_process(p, keep)
                                   for p in self.processes.values()), return_exceptions=True)
            self.processes.clear()
        await self._stop_inprocess_edges(keep)
        if self._mounts is not None:
            with contextlib.suppress(Exception):
                self._mounts.close()
            self._mounts = self._images = None
        if self._store is not None:
            # a thread: closing a PostgreSQL store joins its LISTEN thread and its pool's
            # workers (each bounded at 5 s by the store); SQLite closes at once
            await _bounded("closing the state store", asyncio.to_thread(self._store.close),
                           STOP_STEP_S)
            self._store = None
        if self.config.write_local:
            with contextlib.suppress(FileNotFoundError):
                data = read_local(self.config.state_dir)
                if data is not None and data.get("pid") == os.getpid():
                    os.unlink(os.path.join(self.config.state_dir, LOCAL_FILE))
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    async def _stop_process(self, proc: EdgeProcess, keep: bool) -> None:
        """Destroy the edge's sandboxes through it (unless ``keep``; an edge that is down
        is started once more for that, so nothing is leaked), then stop it gracefully."""
        from dsec.edge.client import EdgeClient

        if not keep and proc.ever_ready:
            try:
                if proc.state != "running":
                    await proc.start()
                async with await EdgeClient.connect(f"unix:{proc.paths.socket}",
                                                    timeout=120) as edge:
                    ids = [i.id for i in await edge.list()]
                    if ids:
                        await edge.destroy_many(ids, reason="shutdown")
            except DsecError as exc:
                log.error("could not destroy the sandboxes of edge %s: %s; they stay in its "
                          "journal for the next start", proc.node, exc)
        await proc.stop()

    async def _stop_inprocess_edges(self, keep: bool) -> None:
        stopped = {self.nodes[i].node_id for i, s in enumerate(self._edge_servers)
                   if s is None and i < len(self.nodes)}
        for s in self._edge_servers:
            if s is None:
                continue
            with contextlib.suppress(Exception):
                await s.close()
        self._edge_servers.clear()
        for node in self.nodes:
            if node.node_id in stopped:
                if keep:
                    continue  # closed by stop_edge; its journal keeps its sandboxes
                # Adopt what it left behind so it can be destroyed, not leaked.
                node, server = await self._run_edge(node.node_id)
                await server.close()
            if not keep:
                ids = [i.id for i in node.list()]
                if ids:
                    await node.destroy_many(ids, reason="shutdown")
            await node.close()
        self.nodes.clear()


async def _bounded(what: str, step: Any, bound_s: float) -> None:
    """Await one step of stopping for at most ``bound_s``: one that overruns is cancelled,
    logged with its bound and left behind (never awaited again: a step that swallows its
    cancel must not hold the process), one that fails is logged. Stopping goes on either
    way, so SIGTERM ends the process within the sum of the bounds."""
    task = asyncio.ensure_future(step)
    t0 = time.monotonic()
    done, _ = await asyncio.wait({task}, timeout=bound_s)
    took = time.monotonic() - t0
    if not done:
        task.cancel()
        log.warning("stopping: %s did not finish within %gs; left behind, going on", what,
                    bound_s)
        return
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("stopping: %s failed after %.1fs: %s", what, took, exc)
    elif took > 1.0:
        log.info("stopping: %s took %.1fs", what, took)
