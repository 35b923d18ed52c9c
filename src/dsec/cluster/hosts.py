"""A multi-host dsec cluster on one machine: test hosts as network namespaces.

What ``dsec up --hosts N`` and the cross-host fault tests run (issue 16). Topology, all
of it in namespaces this module creates and deletes (nothing is added to the root
network namespace but loopback listeners):

```
 root netns: SDK clients ──► 127.0.0.1:R (REST) / :G (gateway)   relays in this process
                                  │ (a socket made inside the replica's netns)
 ┌──────── <id>-hub: bridge br0 (no address) ─────────────────────────────┐
 │  <id>-a0  10.251.0.2  dsec apiserver (listens 127.0.0.1:R, :G there)    │
 │  <id>-a1  10.251.0.3  dsec apiserver (a replica over the same store)    │
 │  <id>-h0  10.251.0.10 dsec edge tcp:10.251.0.10:7000 (own state, layers)│
 │  <id>-h1  10.251.0.11 ...                                               │
 └────────────────────────────────────────────────────────────────────────┘
```

- Every member namespace has one veth into the hub's bridge and an address of its own;
  the apiserver replicas dial the edges across the bridge over TCP with mutual TLS
  (each edge joined with a token of its own), exactly as they would across machines. A link cut (:meth:`cut`) is the
  member's ``eth0`` going down: packets vanish, nothing is refused, as in a partition.
- Why the apiservers sit in namespaces of their own, not in the root one: routing
  10.251.0.0/24 from the root namespace needs an interface and a route there, which
  every concurrent test run on the machine would share (and collide on). Here each
  cluster's addresses are private to its own namespaces, so two clusters may use the
  same ones. The SDK reaches a replica through a relay in this process that listens on
  loopback in the root namespace and connects from inside a replica's namespace to the
  same port on its loopback; so the URL and gateway address a replica advertises are
  right from the root namespace too. With several replicas the relay is their one
  address: it takes them in turn and skips one that refuses (a load balancer's job).
- Each host runs a real supervised ``dsec edge`` process (:class:`EdgeProcess`, entered
  into its namespace by ``nsenter --net``: only the network namespace changes, so its
  mounts, cgroups and layer store are the machine's, as on a real host), with its own
  state dir, layer store and container root; a crashed edge is restarted and re-adopts
  its sandboxes (a restart rejoins with the key it kept, no token). The harness also
  keeps one relay per edge (the "admin door") so it can list and destroy sandboxes on a
  host even while that host is cut off; it dials through it as the apiserver does (the
  cluster CA's client certificate, the node id checked).
- Ownership: before it creates anything, the cluster records the names it will use in
  ``/run/dsec/hosts/<id>.json`` with an owner file (:mod:`dsec.ownership`). Everything
  is removed in :meth:`HostCluster.stop`; :func:`reap` removes what a killed run left
  (its processes, namespaces and the mounts under its state dir), and every new cluster
  calls it first.

How edges are attached to the apiservers is :func:`attach_edge` alone: ``dsec edge
--join URL`` with a single-use join token per edge (``$DSEC_JOIN_TOKEN``, never argv),
minted through replica 0's REST door; the replicas learn the edges from the store's
``nodes`` table (docs/cluster.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Self, TypeVar

from dsec import ownership
from dsec.client.sync import drain_tasks
from dsec.cluster import DSEC_ARGV
from dsec.cluster.edge_process import EdgePaths, EdgeProcess
from dsec.control.supervisor import RestartPolicy
from dsec.edge.backends import LAYERED
from dsec.errors import InvalidArgument, TransportError
from dsec.net import netns

__all__ = ["Attachment", "HostCluster", "HostsConfig", "attach_edge", "reap", "serve"]

log = logging.getLogger("dsec.hosts")

T = TypeVar("T")

NETNS_PREFIX = "dsec-t-"
NETNS_DIR = "/run/netns"
RECORDS_DIR = "/run/dsec/hosts"
EDGE_PORT = 7000
MAX_HOSTS = 64
MAX_REPLICAS = 8
# How long one relay waits for a replica or edge to accept: a cut link never answers,
# and a client must see the failure within its own timeout.
RELAY_CONNECT_S = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class HostsConfig:
    """One multi-host cluster. Sizes are per host (each edge admits this much)."""

    state_dir: str
    hosts: int = 3
    replicas: int = 1
    # Backends every edge offers; the apiserver's default for creates that name none.
    backends: tuple[str, ...] = ("container", "simulated")
    default_backend: str = "container"
    # Silent this long -> a host is lost (`dsec apiserver --node-ttl`).
    node_ttl_s: float = 10.0
    # The state store all replicas share: None = SQLite in the apiservers' state dir.
    # A PostgreSQL URL once the `pg` stream's `dsec apiserver --store` exists.
    store: str | None = None
    subnet: str = "10.251.0.0/24"
    cpus_per_host: float = 2.0
    memory_per_host: int = 8 << 30
    cpu_overcommit: float = 8.0
    memory_overcommit: float = 4.0
    max_sandboxes_per_host: int = 1000
    disk_pool_bytes: int = 1 << 30        # each host's sparse container disk pool
    disk_default_bytes: int = 256 << 20
    restart: RestartPolicy = field(default_factory=lambda: RestartPolicy(first_delay_s=0.1))
    simulated_profile: str = "zero"
    # The loopback port clients use (the REST relay; 0 picks a free one): the replicas
    # listen on the same port inside their namespaces.
    rest_port: int = 0


@dataclass(frozen=True, slots=True)
class Attachment:
    """How one edge joins the apiservers: what the edge and each apiserver get."""

    edge_argv: tuple[str, ...]
    apiserver_argv: tuple[str, ...]
    edge_env: tuple[tuple[str, str], ...] = ()


def attach_edge(node: str, address: str, *, token: str, apiserver_url: str) -> Attachment:
    """The one place that says how an edge is attached (plan-16 "Edge membership"): the
    edge joins with ``--join apiserver_url`` and its own single-use join ``token`` (in
    its environment), serving mutual TLS on ``address``; the apiservers get no flags
    (membership comes from the store's ``nodes`` table). ``apiserver_url`` is replica
    0's REST address on the bridge, which the hosts reach (the replicas are started, and
    serve, before any edge). The same as :func:`dsec.cluster.join.edge_join_args`, with
    the token minted over REST (the replicas are other processes owning the store)."""
    del node
    return Attachment(edge_argv=("--listen", f"tcp:{address}", "--join", apiserver_url),
                      apiserver_argv=(), edge_env=(("DSEC_JOIN_TOKEN", token),))


# --------------------------------------------------------------------------- netns
def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise TransportError(f"`ip {' '.join(args)}` failed ({r.returncode}): "
                             f"{r.stderr.strip() or r.stdout.strip()}")


def _netns_path(name: str) -> str:
    return os.path.join(NETNS_DIR, name)


def _delete_netns(name: str) -> bool:
    if not os.path.exists(_netns_path(name)):
        return False
    r = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True,
                       check=False)
    if r.returncode != 0:
        log.warning("could not delete netns %s: %s", name, r.stderr.strip())
        return False
    return True


def _netns_inode(name: str) -> int | None:
    try:
        return os.stat(_netns_path(name)).st_ino
    except OSError:
        return None


def _pids_in(inodes: set[int]) -> list[int]:
    """Processes whose network namespace is one of ``inodes``."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if os.stat(f"/proc/{d}/ns/net").st_ino in inodes:
                out.append(int(d))
        except OSError:
            continue
    return out


def _kill_all(pids: Sequence[int], deadline_s: float = 5.0) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and any(
            ownership.start_time(p, running=True) is not None for p in pids):
        time.sleep(0.02)


def _unmount_under(root: str) -> int:
    """Lazily unmount every mount at or below ``root`` (deepest first)."""
    from dsec.rmtree import unescape_mountinfo

    root = os.path.realpath(root)
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            target = unescape_mountinfo(line.split()[4])
            if target == root or target.startswith(root + "/"):
                found.append(target)
    for target in sorted(found, key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True, check=False)
    return len(found)


# -------------------------------------------------------------------------- records
def _record_path(cluster_id: str, records_dir: str) -> str:
    return os.path.join(records_dir, f"{cluster_id}.json")


def _write_record(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _remove_record(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    ownership.disown(path)


def _teardown(netns_names: Sequence[str], state_dir: str | None) -> list[str]:
    """Kill every process in the namespaces, delete them, unmount under the state dir."""
    done = []
    inodes = {i for i in (_netns_inode(n) for n in netns_names) if i is not None}
    pids = _pids_in(inodes) if inodes else []
    if pids:
        _kill_all(pids)
        done.append(f"killed {len(pids)} process(es)")
    gone = [n for n in netns_names if _delete_netns(n)]
    if gone:
        done.append(f"deleted netns {', '.join(gone)}")
    if state_dir and os.path.isdir(state_dir):
        n = _unmount_under(state_dir)
        if n:
            done.append(f"unmounted {n} mount(s) under {state_dir}")
    return done


def reap(records_dir: str = RECORDS_DIR) -> list[str]:
    """Remove what clusters whose owner process is dead left behind (a test run killed
    with -9 runs no finally): their processes, network namespaces (and with them every
    veth and the bridge) and mounts under their state dirs. A record whose owner still
    runs, or that this user did not write, is left alone. Returns what was done."""
    out: list[str] = []
    try:
        names = sorted(os.listdir(records_dir))
    except FileNotFoundError:
        return out
    for name in names:
        if not name.endswith(".json"):
            continue
        path = os.path.join(records_dir, name)
        if ownership.owner_alive(path) is not False:
            continue
        try:
            with open(path) as f:
                rec = json.load(f)
            spaces = [str(n) for n in rec.get("netns", [])
                      if str(n).startswith(NETNS_PREFIX)]
        except (OSError, ValueError):
            continue
        what = _teardown(spaces, rec.get("state_dir"))
        _remove_record(path)
        out.append(f"{name[:-5]}: {'; '.join(what) or 'nothing left'}")
    return out


# --------------------------------------------------------------------------- relay
def _socket_in(fd: int) -> socket.socket:
    with netns.entered(fd):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    return s


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


class Relay:
    """A loopback listener in this process's netns whose connections are carried to the
    first target (a netns fd, host, port) that accepts, round-robin among them."""

    def __init__(self, targets: Sequence[tuple[int, str, int]], *, name: str) -> None:
        self.targets = list(targets)
        self.name = name
        self.port = 0
        self._next = 0
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self, port: int = 0) -> int:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        loop = asyncio.get_running_loop()
        n = len(self.targets)
        start = self._next
        self._next = (self._next + 1) % max(n, 1)
        for k in range(n):
            fd, host, port = self.targets[(start + k) % n]
            s = _socket_in(fd)
            try:
                async with asyncio.timeout(RELAY_CONNECT_S):
                    await loop.sock_connect(s, (host, port))
                return await asyncio.open_connection(sock=s)
            except (OSError, TimeoutError):
                s.close()
        return None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            peer = await self._connect()
            if peer is None:
                writer.close()
                return
            pr, pw = peer
            with contextlib.suppress(Exception):
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                psock = pw.get_extra_info("socket")
                if psock is not None:
                    psock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await asyncio.gather(_pipe(reader, pw), _pipe(pr, writer))
        finally:
            self._conns.discard(task)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for t in list(self._conns):
            t.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)


# ------------------------------------------------------------------------ loop thread
class _LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="dsec-hosts",
                                        daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self.loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(drain_tasks(), self.loop).result(5)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        if not self.loop.is_running():
            self.loop.close()


# --------------------------------------------------------------------------- members
@dataclass(slots=True)
class _Member:
    name: str          # netns name
    address: str       # on the bridge
    veth: str          # its veth's name in the hub
    fd: int = -1       # the netns, held open


@dataclass(slots=True)
class _Replica:
    member: _Member
    argv: list[str]
    log_file: str
    proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        p = self.proc
        return p.pid if p is not None and p.poll() is None else None


class HostCluster:
    """``with HostCluster(cfg) as hc: Client(hc.url, hc.admin_key)``. Sync methods, run
    on a private event-loop thread (the edges' supervisors and the relays live there)."""

    def __init__(self, config: HostsConfig, *, records_dir: str = RECORDS_DIR) -> None:
        if not 1 <= config.hosts <= MAX_HOSTS:
            raise InvalidArgument(f"hosts={config.hosts} must be within 1..{MAX_HOSTS}")
        if not 1 <= config.replicas <= MAX_REPLICAS:
            raise InvalidArgument(f"replicas={config.replicas} must be within "
                                  f"1..{MAX_REPLICAS}")
        net = ipaddress.IPv4Network(config.subnet)
        if net.num_addresses < 16 + config.hosts:
            raise InvalidArgument(f"subnet {config.subnet} is too small for "
                                  f"{config.hosts} hosts; use a /24")
        self.config = config
        self.id = NETNS_PREFIX + secrets.token_hex(4)
        self.records_dir = records_dir
        self.state_dir = os.path.realpath(config.state_dir)
        base = int(net.network_address)
        self.prefixlen = net.prefixlen
        self.hub = f"{self.id}-hub"
        self.replica_members = [
            _Member(f"{self.id}-a{k}", str(ipaddress.IPv4Address(base + 2 + k)), f"va{k}")
            for k in range(config.replicas)]
        self.host_members = [
            _Member(f"{self.id}-h{i}", str(ipaddress.IPv4Address(base + 16 + i)), f"vh{i}")
            for i in range(config.hosts)]
        self.node_ids = [f"h{i}" for i in range(config.hosts)]
        self.url = ""
        self.gateway = ""
        self.admin_key = ""
        self.edges: dict[str, EdgeProcess] = {}
        self.replicas: list[_Replica] = []
        # the replicas' state dir (store, their local.json); the cluster's own local.json
        # (the relay's address) is in state_dir, where Client() and the CLI look
        self.api_dir = os.path.join(self.state_dir, "api")
        self._bridge_url = ""
        self._lt: _LoopThread | None = None
        self._rest: Relay | None = None
        self._gw: Relay | None = None
        self._doors: dict[str, Relay] = {}   # node -> relay to its edge (admin door)
        self._tls: Any = None                # the cluster CA's client context (doors)
        self._record = _record_path(self.id, records_dir)
        self._created: list[str] = []        # netns created, in order
        self._lock_fd = -1

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> HostCluster:
        """Build the namespaces, start the edges and the replicas; undone if it fails."""
        for what in reap(self.records_dir):
            log.warning("reaped a cluster a killed run left: %s", what)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _members(self) -> list[_Member]:
        return [*self.replica_members, *self.host_members]

    def _start(self) -> None:
        from dsec.statedir import ensure_private_dir

        ensure_private_dir(self.state_dir)
        self._lock_state_dir()
        os.makedirs(self.records_dir, mode=0o700, exist_ok=True)
        # Intent first: a run killed from here on is found by reap().
        _write_record(self._record, {
            "netns": [self.hub, *(m.name for m in self._members())],
            "state_dir": self.state_dir, "pid": os.getpid()})
        ownership.claim(self._record)
        self._make_network()
        self._lt = _LoopThread()
        self._lt.run(self._start_async())

    def _lock_state_dir(self) -> None:
        """One cluster per state dir, ``dsec up``'s lock file (its replicas' store and
        local.json, its hosts' journals are this process's)."""
        import fcntl

        from dsec.cluster.runtime import LOCK_FILE
        from dsec.errors import InUse

        fd = os.open(os.path.join(self.state_dir, LOCK_FILE),
                     os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            raise InUse(f"another dsec up runs on state dir {self.state_dir}; stop it or "
                        "pass another --state-dir", state_dir=self.state_dir) from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _make_network(self) -> None:
        _ip("netns", "add", self.hub)
        self._created.append(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        _ip("-n", self.hub, "link", "set", "lo", "up")
        for m in self._members():
            _ip("netns", "add", m.name)
            self._created.append(m.name)
            _ip("-n", self.hub, "link", "add", m.veth, "type", "veth", "peer", "name",
                "eth0", "netns", m.name)
            _ip("-n", self.hub, "link", "set", m.veth, "master", "br0", "up")
            _ip("-n", m.name, "addr", "add", f"{m.address}/{self.prefixlen}", "dev", "eth0")
            _ip("-n", m.name, "link", "set", "eth0", "up")
            _ip("-n", m.name, "link", "set", "lo", "up")
            m.fd = os.open(_netns_path(m.name), os.O_RDONLY | os.O_CLOEXEC)

    def _host_dir(self, node: str) -> str:
        return os.path.join(self.state_dir, "hosts", node)

    def _edge_argv(self, i: int, att: Attachment) -> list[str]:
        cfg, m, node = self.config, self.host_members[i], self.node_ids[i]
        d = self._host_dir(node)
        argv = ["nsenter", f"--net={_netns_path(m.name)}", "--", *DSEC_ARGV, "edge",
                *att.edge_argv, "--state-dir", os.path.join(d, "edge"), "--node-id", node,
                "--cpus", repr(cfg.cpus_per_host), "--memory", str(cfg.memory_per_host),
                "--cpu-overcommit", repr(cfg.cpu_overcommit),
                "--memory-overcommit", repr(cfg.memory_overcommit),
                "--max-sandboxes", str(cfg.max_sandboxes_per_host),
                "--label", f"dsec.io/host={node}", "--log-level", "warning"]
        for b in cfg.backends:
            argv += ["--backend", b]
        if len(self.host_members) > 1:
            # emulated hosts share one kernel's pid table (red team 21, A5)
            argv += ["--pids-share", repr(1 / len(self.host_members))]
        if cfg.simulated_profile != "zero":
            argv += ["--profile", cfg.simulated_profile]
        if any(b in LAYERED for b in cfg.backends):
            argv += ["--layer-store", os.path.join(d, "layers"),
                     "--disk-pool", str(cfg.disk_pool_bytes),
                     "--disk-default", str(cfg.disk_default_bytes)]
        return argv

    def _replica_argv(self, m: _Member, rest_port: int, gw_port: int) -> list[str]:
        """REST on the replica's bridge address (the hosts reach it there: ``--join``);
        the gateway on its loopback, the address it advertises, which the relay of the
        same port in the root namespace makes right for clients there too."""
        cfg = self.config
        argv = [*DSEC_ARGV, "apiserver", "--state-dir", self.api_dir,
                "--listen", f"{m.address}:{rest_port}", "--gateway", f"tcp:127.0.0.1:{gw_port}",
                "--backend", cfg.default_backend, "--node-ttl", repr(cfg.node_ttl_s),
                "--quiet"]
        if cfg.store is not None:
            argv += ["--store", cfg.store]
        return argv

    async def _join_token(self, node: str) -> str:
        """A single-use join token for ``node``, minted by a replica (superuser REST)."""
        import httpx

        async with httpx.AsyncClient(base_url=self.url, timeout=30, headers={
                "authorization": f"Bearer {self.admin_key}"}) as http:
            r = await http.post("/v1/cluster/tokens", json={
                "ttl_s": 600, "uses": 1, "description": f"dsec up --hosts: {node}"})
        if r.status_code != 201:
            raise TransportError(f"could not mint a join token for host {node}: HTTP "
                                 f"{r.status_code} {r.text[:300]}")
        return str(r.json()["token"])

    def _layers(self) -> None:
        """The busybox base in every host's store and the apiservers' (it builds to the
        same digest everywhere, so the name the apiserver resolves is each host's)."""
        from dsec.image import LayerStore, ensure_busybox_base

        for d in [self.api_dir, *(self._host_dir(n) for n in self.node_ids)]:
            store = LayerStore(os.path.join(d, "layers"))
            base = ensure_busybox_base(store)
            if "base:latest" not in store.refs():
                store.tag(base.digest, "base")

    async def _start_async(self) -> None:
        os.makedirs(self.api_dir, mode=0o700, exist_ok=True)
        for node in self.node_ids:
            os.makedirs(self._host_dir(node), mode=0o700, exist_ok=True)
        if any(b in LAYERED for b in self.config.backends):
            await asyncio.to_thread(self._layers)
        # The relays first: their ports are the ones the replicas listen on in their
        # namespaces, so the addresses a replica advertises work from here too.
        # The relays first: their ports are the ones the replicas listen on in their
        # namespaces, so the gateway address a replica advertises works from here too.
        self._rest = Relay([], name="rest")
        self._gw = Relay([], name="gateway")
        rest, gw = await self._rest.start(self.config.rest_port), await self._gw.start()
        self._rest.targets = [(m.fd, m.address, rest) for m in self.replica_members]
        self._gw.targets = [(m.fd, "127.0.0.1", gw) for m in self.replica_members]
        self._bridge_url = f"http://{self.replica_members[0].address}:{rest}"
        # The replicas before the edges (an edge that joins needs an apiserver to join;
        # one named by --edge that does not serve yet is dialled again on every poll),
        # one after the other: the first bootstraps the admin key, the rest reuse it.
        for k, m in enumerate(self.replica_members):
            self.replicas.append(_Replica(m, self._replica_argv(m, rest, gw),
                                          os.path.join(self.state_dir, f"apiserver-{k}.log")))
        for k in range(len(self.replicas)):
            await self._start_replica(k)
        self.url = f"http://127.0.0.1:{rest}"
        self.gateway = f"tcp:127.0.0.1:{gw}"
        for i, node in enumerate(self.node_ids):
            m = self.host_members[i]
            door = self._doors[node] = Relay([(m.fd, m.address, EDGE_PORT)], name=node)
            await door.start()
            d = self._host_dir(node)
            paths = EdgePaths(socket=os.path.join(d, "edge.sock"),
                              state_dir=os.path.join(d, "edge"),
                              pid_file=os.path.join(d, "edge.pid"),
                              log_file=os.path.join(d, "edge.log"))
            att = attach_edge(node, f"{m.address}:{EDGE_PORT}",
                              token=await self._join_token(node),
                              apiserver_url=self._bridge_url)
            self.edges[node] = EdgeProcess(node, self._edge_argv(i, att), paths,
                                           policy=self.config.restart,
                                           env=dict(att.edge_env))
            self.edges[node].begin()
        await asyncio.gather(*(p.started() for p in self.edges.values()))
        await self._until_healthy()
        self._write_local()

    async def _until_healthy(self, timeout: float = 60.0) -> None:
        """Until every replica reports every host healthy (its first heartbeat)."""
        import httpx

        end = time.monotonic() + timeout
        want = set(self.node_ids)
        async with httpx.AsyncClient(base_url=self.url, timeout=10, headers={
                "authorization": f"Bearer {self.admin_key}"}) as http:
            ok = 0
            while ok < 2 * len(self.replicas):   # the relay takes the replicas in turn
                try:
                    r = await http.get("/v1/nodes")
                    items = r.json()["items"] if r.status_code == 200 else []
                    healthy = {n["id"] for n in items if n.get("healthy", True)}
                except (httpx.HTTPError, ValueError, KeyError):
                    healthy = set()
                ok = ok + 1 if want <= healthy else 0
                if ok == 0 and time.monotonic() > end:
                    raise TransportError(f"the hosts {sorted(want - healthy)} did not become "
                                         f"healthy within {timeout:g}s; see "
                                         f"{self.state_dir}/hosts/*/edge.log")
                if ok == 0:
                    await asyncio.sleep(0.1)

    def _write_local(self) -> None:
        """``state_dir/local.json`` as ``dsec up`` writes it, with the relay's addresses
        (Client() and the CLI find the cluster there)."""
        from dsec.statedir import LOCAL_FILE

        path = os.path.join(self.state_dir, LOCAL_FILE)
        _write_record(path, {"url": self.url, "gateway": self.gateway,
                             "api_key": self.admin_key, "pid": os.getpid(),
                             "state_dir": self.state_dir})

    async def _start_replica(self, k: int, timeout: float = 60.0) -> None:
        from dsec.statedir import read_local

        r = self.replicas[k]
        if r.pid is not None:
            return
        out = os.open(r.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                      0o600)
        try:
            r.proc = subprocess.Popen(  # noqa: ASYNC220 - returns at once (exec, no wait)
                ["nsenter", f"--net={_netns_path(r.member.name)}", "--", *r.argv],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
        finally:
            os.close(out)
        end = time.monotonic() + timeout
        while True:
            local = read_local(self.api_dir) or {}
            if local.get("pid") == r.proc.pid:   # written once it serves
                self.admin_key = str(local["api_key"])
                return
            if r.proc.poll() is not None or time.monotonic() > end:
                from dsec.cluster.edge_process import log_tail

                self._kill_replica(k)
                raise TransportError(f"apiserver replica {k} did not start; the end of "
                                     f"{r.log_file}:\n{log_tail(r.log_file)}")
            await asyncio.sleep(0.05)

    def _kill_replica(self, k: int, signum: int = signal.SIGKILL, wait_s: float = 15.0) -> None:
        r = self.replicas[k]
        if r.proc is None:
            return
        if r.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                r.proc.send_signal(signum)
            try:
                r.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()

    def stop(self) -> None:
        """Destroy every sandbox on every host, stop the replicas and edges, delete the
        namespaces and the record. Safe to call twice or after a failed start."""
        if self._lt is not None:
            lt, self._lt = self._lt, None
            try:
                lt.run(self._stop_async(), timeout=120)
            except Exception:
                log.exception("stopping the host cluster %s failed; tearing down", self.id)
            finally:
                lt.stop()
        for k in range(len(self.replicas)):
            self._kill_replica(k)
        for m in self._members():
            if m.fd >= 0:
                os.close(m.fd)
                m.fd = -1
        what = _teardown(self._created, None)
        self._created.clear()
        if what:
            log.debug("teardown of %s: %s", self.id, what)
        _remove_record(self._record)
        from dsec.statedir import LOCAL_FILE, read_local

        local = read_local(self.state_dir)
        if local is not None and local.get("pid") == os.getpid():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.state_dir, LOCAL_FILE))
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    async def _stop_async(self) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(60):
                await self._destroy_everything()
        for k in range(len(self.replicas)):
            await asyncio.to_thread(self._kill_replica, k, signal.SIGTERM)
        await asyncio.gather(*(p.stop() for p in self.edges.values()),
                             return_exceptions=True)
        for relay in [self._rest, self._gw, *self._doors.values()]:
            if relay is not None:
                await relay.close()

    async def _destroy_everything(self) -> None:
        """Through each edge's admin door (reachable on a cut host too): an edge keeps
        its sandboxes across a stop, so they are destroyed first."""
        for node in self.node_ids:
            self._heal(node)
        await asyncio.gather(*(self._destroy_on(n) for n in self.node_ids),
                             return_exceptions=True)

    async def _destroy_on(self, node: str) -> None:
        proc = self.edges.get(node)
        if proc is None or not proc.ever_ready:
            return
        if proc.state != "running":
            await proc.start()
        async with await self.edge_client(node) as edge:
            ids = [i.id for i in await edge.list()]
            if ids:
                await edge.destroy_many(ids, reason="shutdown")

    # -------------------------------------------------------------- what tests use
    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the cluster's loop thread (where the edge doors are)."""
        assert self._lt is not None, "the cluster is not running"
        return self._lt.run(coro, timeout)

    async def edge_client(self, node: str) -> Any:
        """An Aether client of ``node``'s edge, through its admin door (the caller closes
        it)."""
        from dsec.cluster.ca import load_ca
        from dsec.cluster.membership import EdgeTls
        from dsec.edge.client import EdgeClient

        if self._tls is None:
            self._tls = load_ca(os.path.join(self.api_dir, "cluster")).client_context()
        return await EdgeClient.connect(f"tcp:127.0.0.1:{self._doors[node].port}",
                                        tls=EdgeTls(node, self._tls), timeout=10)

    def edge_ids(self, node: str) -> list[str]:
        """The live sandboxes ``node``'s edge holds now (its own word, not the
        apiserver's)."""
        async def ids() -> list[str]:
            async with await self.edge_client(node) as edge:
                return [str(i.id) for i in await edge.list()
                        if i.state not in ("destroyed", "failed")]
        return self.run(ids(), timeout=30)

    def edge_states(self, node: str, ids: Sequence[str]) -> dict[str, tuple[str, str]]:
        """``id -> (state, reason)`` as ``node``'s edge knows them (absent: unknown)."""
        from dsec.errors import NotFound

        async def states() -> dict[str, tuple[str, str]]:
            out = {}
            async with await self.edge_client(node) as edge:
                for sid in ids:
                    try:
                        i = await edge.get(sid)
                    except NotFound:
                        continue
                    out[sid] = (str(i.state), i.reason)
            return out
        return self.run(states(), timeout=60)

    def host_of(self, sandbox_id: str) -> str:
        """The node a sandbox id names (``sb-<token>-<node>``)."""
        return sandbox_id.split("-", 2)[2]

    def cut(self, node: str) -> None:
        """Partition ``node``: its link goes down; packets to and from it vanish."""
        _ip("-n", self.host_members[self.node_ids.index(node)].name, "link", "set", "eth0",
            "down")

    def heal(self, node: str) -> None:
        self._heal(node)

    def _heal(self, node: str) -> None:
        _ip("-n", self.host_members[self.node_ids.index(node)].name, "link", "set", "eth0",
            "up")

    def kill_edge(self, node: str) -> int:
        """kill -9 ``node``'s edge process; its supervisor restarts it. Returns the pid."""
        proc = self.edges[node]
        pid = proc.pid
        if pid is None or not proc.kill(signal.SIGKILL):
            raise InvalidArgument(f"edge {node} is not running ({proc.state})")
        return pid

    def wait_edge(self, node: str, old_pid: int, timeout: float = 60.0) -> int:
        """Wait until ``node``'s edge serves again as a process other than ``old_pid``
        (after :meth:`kill_edge`); returns its pid."""
        proc = self.edges[node]

        async def back() -> int:
            async with asyncio.timeout(timeout):
                while True:
                    await proc.wait_state("running", timeout=timeout)
                    pid = proc.pid
                    if pid is not None and pid != old_pid:
                        return pid
                    await asyncio.sleep(0.02)
        return self.run(back(), timeout=timeout + 5)

    def kill_replica(self, k: int) -> int:
        """kill -9 apiserver replica ``k`` (not restarted). Returns its pid."""
        pid = self.replicas[k].pid
        if pid is None:
            raise InvalidArgument(f"replica {k} is not running")
        self._kill_replica(k)
        return pid

    def start_replica(self, k: int) -> None:
        self.run(self._start_replica(k), timeout=90)

    def client(self, **kw: Any) -> Any:
        """An SDK client of this cluster (through the relay; keyword arguments go to
        :class:`dsec.Client`)."""
        from dsec.client.sync import Client

        return Client(self.url, self.admin_key, **kw)

    def processes(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {n: p.pid for n, p in self.edges.items()}
        out.update({f"apiserver-{k}": r.pid for k, r in enumerate(self.replicas)})
        return out


def serve(config: HostsConfig, *, started: Callable[[HostCluster], None],
          stopping: Callable[[HostCluster], None] = lambda hc: None) -> None:
    """``dsec up --hosts N``: run a host cluster in the foreground until SIGINT/SIGTERM
    (handlers in before the start, so a Ctrl-C during it is not lost), then stop it:
    every sandbox destroyed, every namespace and process gone."""
    stop = threading.Event()
    old = {sig: signal.signal(sig, lambda *_: stop.set())
           for sig in (signal.SIGINT, signal.SIGTERM)}
    hc = HostCluster(config)
    try:
        hc.start()
        started(hc)
        while not stop.wait(1.0):
            pass
        stopping(hc)
    finally:
        hc.stop()
        for sig, h in old.items():
            signal.signal(sig, h)


@contextlib.contextmanager
def running(config: HostsConfig) -> Iterator[HostCluster]:
    """``with running(cfg) as hc:`` — a started :class:`HostCluster`, stopped after."""
    hc = HostCluster(config)
    hc.start()
    try:
        yield hc
    finally:
        hc.stop()


def wait_for(cond: Callable[[], bool], timeout: float, what: str,
             interval: float = 0.1) -> None:
    """Poll ``cond`` until true; raise with ``what`` after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not within {timeout:g}s")
        time.sleep(interval)

