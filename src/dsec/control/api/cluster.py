"""A complete single-machine cluster in one asyncio program: what ``dsec up`` and
``LocalCluster`` run.

Pieces: the SQLite state store under ``state_dir``, the control plane (IAM, quotas,
registry, placement, heartbeats, sweeper), N edge nodes each served over Aether on a Unix
socket (``state_dir/edges/<node>.sock``), the REST apiserver on uvicorn and the Aether
gateway. The apiserver reaches the edges only through their sockets, exactly as it would
across machines.

``local.json`` in the state dir records how to reach the cluster
(``{"url", "gateway", "api_key", "pid", "state_dir"}``, mode 0600); the SDK and CLI read it
when neither ``DSEC_URL`` nor ``url=`` is given. The default state dir is
``$DSEC_STATE_DIR``, else ``~/.dsec``.

Stopping destroys every sandbox (reason ``shutdown``) so nothing is left behind — no
process, mount or cgroup — unless ``keep`` is set, in which case sandboxes stay and the
edges re-adopt them at the next start (from their journals).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from dsec.aether.limits import ServerLimits
from dsec.control.api.http_limits import HttpLimits
from dsec.control.api.plane import ControlPlane, IamAuthority, PlaneConfig
from dsec.control.api.service import ApiConfig, ApiService
from dsec.control.apiserver import RestConfig, build_app
from dsec.control.idempotency import IdempotencyCache
from dsec.control.metrics import ApiMetrics
from dsec.control.ratelimit import RateLimitConfig, RateLimiter
from dsec.errors import DsecError, InvalidArgument, TransportError
from dsec.statedir import ensure_private_dir

__all__ = ["LOCAL_FILE", "ClusterConfig", "ClusterRuntime", "default_state_dir", "read_local"]

log = logging.getLogger("dsec.cluster")

LOCAL_FILE = "local.json"


def default_state_dir() -> str:
    return os.environ.get("DSEC_STATE_DIR") or os.path.join(os.path.expanduser("~"), ".dsec")


def read_local(state_dir: str | None = None) -> dict[str, Any] | None:
    """The ``local.json`` of a running ``dsec up`` (None if absent or unreadable)."""
    path = os.path.join(state_dir or default_state_dir(), LOCAL_FILE)
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@dataclass(slots=True, kw_only=True)
class ClusterConfig:
    """What to run. ``listen`` is ``HOST:PORT`` for REST (port 0 picks a free one)."""

    state_dir: str
    listen: str = "127.0.0.1:8470"
    gateway: str | None = "tcp:127.0.0.1:0"   # Aether gateway address; None = off
    backend: str = "simulated"                # default backend for creates
    edges: int = 1
    # Per-edge *reservation* ceilings for admission and placement. Agent sandboxes idle
    # most of the time, so reservations are heavily overcommitted; the real limits are the
    # per-sandbox cgroups. max_sandboxes is the ceiling that binds in practice.
    edge_cpu_milli: int = 100_000_000
    edge_memory_bytes: int = 64 << 40
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


def _plus_one(n: int | None) -> int | None:
    # uvicorn answers 503 once len(connections) >= limit_concurrency, counting the one
    # asking: one more than the admitted maximum lets every admitted connection be served.
    return None if n is None else n + 1


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
        self.nodes: list[Any] = []            # EdgeNode
        self._edge_servers: list[Any] = []
        self._clients: list[Any] = []
        self._gateway: Any = None
        self._uvicorn: Any = None
        self._serve_task: asyncio.Task[None] | None = None
        self._store: Any = None
        self.http_admission: Any = None       # the REST listener's Admission (counters)
        self._images: Any = None              # StoreImages shared by container edges
        self._mounts: Any = None              # its MountCache (one per process)

    # ------------------------------------------------------------------ start
    async def start(self) -> ClusterRuntime:
        from dsec.control.store.sqlite import SqliteStore
        from dsec.edge.service import EdgeClient

        cfg = self.config
        # 0700 even when it existed: see dsec.statedir (keys, env, every tenant's layers).
        ensure_private_dir(cfg.state_dir)
        try:
            await self._start_edges()
            self._store = SqliteStore(os.path.join(cfg.state_dir, "control.sqlite"))
            plane = self.plane = ControlPlane.open(self._store, metrics=self.metrics,
                                                   config=cfg.plane)
            for node in self.nodes:
                addr = f"unix:{self._sock(node.node_id)}"
                client = await EdgeClient.connect(addr)
                self._clients.append(client)
                plane.add_edge(node.node_id, addr, client)
            loop = asyncio.get_running_loop()
            service = self.service = ApiService(
                authority=IamAuthority(plane.iam, self._store), directory=plane, placer=plane,
                quotas=plane, limiter=RateLimiter(cfg.rate, clock=loop.time),
                idempotency=IdempotencyCache(clock=time.time, store=self._store),
                metrics=self.metrics,
                config=ApiConfig(default_ttl_s=cfg.default_ttl_s, default_backend=cfg.backend,
                                 redact_paths=_host_paths(cfg.state_dir)),
                clock=loop.time,
                anon_limiter=RateLimiter(cfg.anon_rate, clock=loop.time), images=plane)
            plane.service = service
            plane.layer_dir = os.path.join(cfg.state_dir, "layers")
            await plane.start()
            self.admin_key = self._admin_key(plane)
            if cfg.gateway is not None:
                from dsec.control.gateway import serve_gateway
                self._gateway = await serve_gateway(service, plane, cfg.gateway,
                                                    limits=cfg.listener_limits)
                self.gateway_address = str(self._gateway.address)
            await self._start_http(service, plane)
            if cfg.write_local:
                self._write_local()
        except BaseException:
            await self.stop()
            raise
        return self

    def _sock(self, node_id: str) -> str:
        return os.path.join(self.config.state_dir, "edges", f"{node_id}.sock")

    async def _start_edges(self) -> None:
        cfg = self.config
        if not 1 <= cfg.edges <= 64:
            raise InvalidArgument(f"edges={cfg.edges} must be within 1..64")
        for i in range(cfg.edges):
            node, server = await self._run_edge(f"edge-{i}")
            self.nodes.append(node)
            self._edge_servers.append(server)

    async def _run_edge(self, node_id: str) -> tuple[Any, Any]:
        """Start edge ``node_id`` (adopting what its journal in the state dir holds) and
        serve it on its Unix socket."""
        from dsec.edge.admission import Capacity
        from dsec.edge.backends import make_backend
        from dsec.edge.node import EdgeNode, NodeConfig
        from dsec.edge.service import serve_edge

        cfg = self.config
        names = {"simulated", cfg.backend}
        backends = {n: make_backend(n, **self._backend_opts(n, node_id))
                    for n in sorted(names)}
        node = EdgeNode(NodeConfig(
            node_id=node_id,
            capacity=Capacity(cpu_milli=cfg.edge_cpu_milli,
                              memory_bytes=cfg.edge_memory_bytes,
                              max_sandboxes=cfg.edge_max_sandboxes),
            state_dir=os.path.join(cfg.state_dir, "edges", node_id)), backends)
        await node.start()
        try:
            server = await serve_edge(node, f"unix:{self._sock(node_id)}",
                                      limits=cfg.listener_limits)
        except BaseException:
            await node.close()
            raise
        return node, server

    # --------------------------------------------------------- edge outages (tests)
    def _edge_index(self, node_id: str) -> int:
        for i, n in enumerate(self.nodes):
            if n.node_id == node_id:
                return i
        raise InvalidArgument(f"no edge {node_id!r} in this cluster; edges: "
                              f"{[n.node_id for n in self.nodes]}")

    async def stop_edge(self, node_id: str) -> None:
        """Simulate losing a machine: stop serving edge ``node_id`` and close it, leaving
        its sandboxes and journal in place (as a crashed or partitioned node would). The
        control plane notices by missing heartbeats (``PlaneConfig.node_ttl_s``)."""
        i = self._edge_index(node_id)
        server = self._edge_servers[i]
        if server is None:
            return
        self._edge_servers[i] = None
        await server.close()
        await self.nodes[i].close()

    async def start_edge(self, node_id: str) -> None:
        """Bring a stopped edge back on the same socket; it re-adopts its sandboxes from
        its journal, and the control plane reconnects on its next poll."""
        i = self._edge_index(node_id)
        if self._edge_servers[i] is not None:
            return
        node, server = await self._run_edge(node_id)
        self.nodes[i] = node
        self._edge_servers[i] = server

    def _backend_opts(self, name: str, node_id: str) -> dict[str, Any]:
        """Per-backend options. The container backend gets a root dir per edge and the
        cluster's layer store (``state_dir/layers``, where ``dsec image build`` and
        ``POST /v1/images`` put layers and where snapshots are written), resolved by
        :class:`~dsec.image.resolver.StoreImages`. All edges of this process share one
        store and one mount cache, so a layer is mounted once per machine and every local
        edge can start sandboxes from every snapshot. ``base`` is the busybox base layer,
        built on first start (~0.1 s) so ``dsec up --backend container`` works on a fresh
        machine."""
        if name == "fncall":
            # Work dirs beside the edge's journal (as `dsec edge --state-dir` does): a
            # restarted edge adopts its fncall sandboxes. A temp dir per process lost
            # every one of them at each restart.
            return {"root": os.path.join(self.config.state_dir, "edges", node_id, "fncall")}
        if name != "container":
            return {}
        from dsec.image import LayerStore, MountCache, ensure_busybox_base
        from dsec.image.resolver import StoreImages

        if self._images is None:
            store = LayerStore(os.path.join(self.config.state_dir, "layers"))
            base = ensure_busybox_base(store)
            if "base:latest" not in store.refs():
                store.tag(base.digest, "base")
            self._mounts = MountCache()
            self._images = StoreImages(store, self._mounts)
        return {"root_dir": os.path.join(self.config.state_dir, "container", node_id),
                "images": self._images,
                "default_disk_bytes": self.config.disk_default_bytes,
                "disk_pool_bytes": self.config.disk_pool_bytes}

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
        import uvicorn

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
        app = build_app(service, plane, RestConfig(gateway_address=self.gateway_address,
                                                   metrics_token=cfg.metrics_token))
        from dsec.control.api.http_limits import guarded_protocol
        protocol, self.http_admission = guarded_protocol(cfg.http_limits,
                                                         name=f"REST listener {cfg.listen}")
        ucfg = uvicorn.Config(app, loop="none", http=protocol, lifespan="off",
                              proxy_headers=False, server_header=False,
                              access_log=cfg.access_log, log_level="warning",
                              limit_concurrency=_plus_one(
                                  cfg.http_limits.connections.max_connections))
        server = self._uvicorn = uvicorn.Server(ucfg)
        # The runtime owns SIGINT/SIGTERM (`dsec up` stops the whole cluster on them):
        # uvicorn must not swap in its own handlers while it serves on the main thread.
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign, assignment]
        self._serve_task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if self._serve_task.done():
                self._serve_task.result()
                raise TransportError(f"the HTTP server on {cfg.listen} stopped at start-up")
            await asyncio.sleep(0.005)

    def _write_local(self) -> None:
        path = os.path.join(self.config.state_dir, LOCAL_FILE)
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"url": self.url, "gateway": self.gateway_address,
                       "api_key": self.admin_key, "pid": os.getpid(),
                       "state_dir": self.config.state_dir}, f)
        os.replace(tmp, path)

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            for st, c in n.counts().items():
                counts[st] = counts.get(st, 0) + c
        return counts

    # ------------------------------------------------------------------- stop
    async def stop(self) -> None:
        """Stop serving, then destroy sandboxes (unless ``keep``) and close the edges."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            if self._serve_task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._serve_task, 5.0)
            self._uvicorn = None
        if self._gateway is not None:
            await self._gateway.close()
            self._gateway = None
        if self.service is not None:
            await self.service.idempotency.close()
        if self.plane is not None:
            await self.plane.close()
        for c in self._clients:
            with contextlib.suppress(Exception):
                await c.close()
        self._clients.clear()
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
                if self.config.keep:
                    continue  # closed by stop_edge; its journal keeps its sandboxes
                # Adopt what it left behind so it can be destroyed, not leaked.
                node, server = await self._run_edge(node.node_id)
                await server.close()
            if not self.config.keep:
                ids = [i.id for i in node.list()]
                if ids:
                    await node.destroy_many(ids, reason="shutdown")
            await node.close()
        self.nodes.clear()
        if self._mounts is not None:
            with contextlib.suppress(Exception):
                self._mounts.close()
            self._mounts = self._images = None
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.close()
            self._store = None
        if self.config.write_local:
            with contextlib.suppress(FileNotFoundError):
                data = read_local(self.config.state_dir)
                if data is not None and data.get("pid") == os.getpid():
                    os.unlink(os.path.join(self.config.state_dir, LOCAL_FILE))

