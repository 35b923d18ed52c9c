"""``LocalCluster``: a whole dsec cluster on this machine, for tests and notebooks.

``with LocalCluster(edges=2, backend="simulated") as cluster: client = cluster.client()``

Three topologies, one interface:

- default: the cluster runs on a private event-loop thread of this process: the
  apiserver on a loopback port, the gateway, the control plane and N edges, each edge
  served over Aether on its own Unix socket under the state dir. Tests reach into it
  (``cluster.runtime.nodes`` are the :class:`~dsec.edge.node.EdgeNode` objects);
- ``edge_processes=True``: the apiserver as above, each edge a supervised ``dsec edge``
  process, as under ``dsec up``: ``stop_edge`` kills the process (a machine dying),
  ``start_edge`` starts it again, ``kill_edge`` crashes it and the supervisor restarts it;
- ``subprocess=True``: ``dsec up`` itself in a child process (what a notebook wants when
  its own loop must stay free; edges are processes of their own there too), found through
  the child's ``local.json``.

Capacity: the edges measure the machine and overcommit it (see ``dsec up``); pass
``cpu_milli``/``memory_bytes``/``overcommit=Overcommit(...)`` to size it by hand (a
simulated-backend load test creating thousands of 512 MiB sandboxes needs that).
Either way, leaving the ``with`` block destroys every sandbox and removes a temporary
state dir.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import tempfile
import threading
import time
from typing import Any, Self

from dsec.client.sync import drain_tasks
from dsec.cluster import DSEC_ARGV
from dsec.errors import InvalidArgument, TransportError
from dsec.rmtree import remove_tree

__all__ = ["LocalCluster"]


async def _call(fn: Any) -> Any:
    return fn()


def _up_flags(config: dict[str, Any]) -> list[str]:
    """``dsec up`` flags for the ClusterConfig fields a subprocess cluster understands."""
    flags: list[str] = []
    for key, flag in (("cpu_milli", "--cpu-milli"), ("memory_bytes", "--memory-bytes"),
                      ("disk_bytes", "--disk-bytes"),
                      ("edge_max_sandboxes", "--max-sandboxes"),
                      ("disk_default_bytes", "--disk-default"),
                      ("disk_pool_bytes", "--disk-pool")):
        if config.get(key) is not None:
            flags += [flag, str(config[key])]
    oc = config.get("overcommit")
    if oc is not None:
        flags += ["--cpu-overcommit", repr(oc.cpu), "--memory-overcommit", repr(oc.memory)]
    for key, flag in (("net_uplink", "--net-uplink"), ("net_egress", "--net-egress"),
                      ("net_pool", "--net-pool"), ("net_link", "--net-link"),
                      ("store", "--store"), ("blob_store", "--blob-store"),
                      ("e2b", "--e2b")):
        if config.get(key) is not None:
            flags += [flag, str(config[key])]
    for up in config.get("net_dns_upstream") or ():
        flags += ["--net-dns-upstream", str(up)]
    if config.get("tiers"):   # the tiers' backends are named as the tiers (TIER_BACKENDS)
        flags += ["--tiers", ",".join(config["tiers"])]
    unknown = set(config) - {"tiers", "cpu_milli", "memory_bytes", "disk_bytes", "edge_max_sandboxes",
                             "overcommit", "disk_default_bytes", "disk_pool_bytes",
                             "net_uplink", "net_egress", "net_pool", "net_dns_upstream",
                             "net_link", "store", "blob_store", "e2b"}
    if unknown:
        raise InvalidArgument(f"LocalCluster(subprocess=True) cannot pass {sorted(unknown)} "
                              "to `dsec up`; drop them or use subprocess=False")
    return flags


class LocalCluster:
    def __init__(self, *, edges: int = 1, backend: str = "simulated",
                 state_dir: str | None = None, subprocess: bool = False,
                 edge_processes: bool = False, gateway: bool = True,
                 rate_per_s: float | None = None, start_timeout_s: float = 30.0,
                 **config: Any) -> None:
        self.edges = edges
        self.backend = backend
        self._tmp = state_dir is None
        self.state_dir = state_dir or tempfile.mkdtemp(prefix="dsec-local-")
        self._subprocess = subprocess
        self._edge_processes = edge_processes
        self._gateway = gateway
        self._rate = rate_per_s
        self._timeout = start_timeout_s
        self._config = config
        self.url = ""
        self.api_key = ""
        self.gateway: str | None = None
        #: the E2B-compatible API's URL (``e2b="HOST:PORT"``), else None
        self.e2b_url: str | None = None
        self._proc: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.runtime: Any = None

    # ------------------------------------------------------------------ start
    def start(self) -> Self:
        try:
            if self._subprocess:
                self._start_process()
            else:
                self._start_thread()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_thread(self) -> None:
        import uvloop

        from dsec.cluster.runtime import ClusterConfig, ClusterRuntime
        from dsec.control.ratelimit import RateLimitConfig

        cfg = ClusterConfig(state_dir=self.state_dir, listen="127.0.0.1:0",
                            gateway="tcp:127.0.0.1:0" if self._gateway else None,
                            backend=self.backend, edges=self.edges, write_local=False,
                            edge_processes=self._edge_processes,
                            rate=RateLimitConfig(rate_per_s=self._rate, burst=max(1.0, (self._rate or 1) * 2)),
                            **self._config)
        loop = self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name="dsec-local-cluster",
                                        daemon=True)
        self._thread.start()
        rt = ClusterRuntime(cfg)
        asyncio.run_coroutine_threadsafe(rt.start(), loop).result(self._timeout)
        self.runtime = rt
        self.url, self.api_key, self.gateway = rt.url, rt.admin_key, rt.gateway_address
        self.e2b_url = rt.e2b_url

    def _start_process(self) -> None:
        from dsec.statedir import read_local

        cmd = [*DSEC_ARGV, "up",
               "--state-dir", self.state_dir, "--listen", "127.0.0.1:0",
               "--backend", self.backend, "--edges", str(self.edges), "--quiet",
               *_up_flags(self._config)]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE)
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            local = read_local(self.state_dir)
            if local is not None and local.get("pid") == self._proc.pid:
                self.url, self.api_key = local["url"], local["api_key"]
                self.gateway = local.get("gateway")
                self.e2b_url = local.get("e2b")
                return
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace")[-2000:]
                raise TransportError(f"`dsec up` exited with {self._proc.returncode}: {err}")
            time.sleep(0.05)
        raise TransportError(f"`dsec up` did not come up within {self._timeout}s")

    # ------------------------------------------------------------------ use
    def client(self, **kw: Any) -> Any:
        from dsec.client.sync import Client
        return Client(self.url, self.api_key, **{"gateway": self.gateway, **kw})

    def async_client(self, **kw: Any) -> Any:
        from dsec.client.core import AsyncClient
        return AsyncClient(self.url, self.api_key, **{"gateway": self.gateway, **kw})

    def create_key(self, name: str, project: str, role: str = "member") -> str:
        """A new principal with ``role`` on ``project``; returns its API key."""
        import httpx
        r = httpx.post(f"{self.url}/v1/keys", json={"name": name, "project": project,
                                                    "role": role},
                       headers={"authorization": f"Bearer {self.api_key}"})
        if r.status_code != 201:
            raise InvalidArgument(f"could not create key {name!r}: {r.text}")
        return str(r.json()["api_key"])

    # ------------------------------------------------------------- edge outages
    def stop_edge(self, node_id: str) -> None:
        """Stop one edge as if its machine died: with ``edge_processes=True`` its process
        is killed (SIGKILL) and not restarted; in-process, it stops serving. Its
        sandboxes stay behind, and the control plane expires the node after
        ``PlaneConfig.node_ttl_s`` (pass ``plane=PlaneConfig(...)`` to shorten it)."""
        self._on_loop(self._rt().stop_edge(node_id))

    def start_edge(self, node_id: str) -> None:
        """Bring a stopped edge back; it re-adopts its sandboxes from its journal."""
        self._on_loop(self._rt().start_edge(node_id))

    def kill_edge(self, node_id: str, signum: int = signal.SIGKILL) -> int:
        """Crash one edge process (``edge_processes=True``) behind its supervisor's back,
        which restarts it; returns the pid killed."""
        rt = self._rt()
        return int(self._on_loop(_call(lambda: rt.kill_edge(node_id, signum))))

    def edge_states(self) -> dict[str, str]:
        """Local edge -> "running", "restarting", "failed", "stopped", ..."""
        return dict(self._on_loop(_call(self._rt().edge_states)))

    def _rt(self) -> Any:
        if self.runtime is None:
            raise InvalidArgument("stop_edge/start_edge/kill_edge need a running "
                                  "LocalCluster with subprocess=False")
        return self.runtime

    def _on_loop(self, coro: Any, timeout: float = 30.0) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        """Stop the cluster and remove a state dir this made. Each step runs even when
        one before it failed (a runtime stop that raised or timed out used to skip the
        rest: the loop thread, the child process and the temp state dir were left)."""
        try:
            self._stop_runtime()
        finally:
            try:
                self._stop_loop()
            finally:
                try:
                    self._stop_process()
                finally:
                    if self._tmp and os.path.isdir(self.state_dir):
                        remove_tree(self.state_dir)  # a mount left below is reported

    def _stop_runtime(self) -> None:
        if self.runtime is not None and self._loop is not None:
            try:
                asyncio.run_coroutine_threadsafe(self.runtime.stop(), self._loop).result(30)
            finally:
                self.runtime = None

    def _stop_loop(self) -> None:
        if self._loop is not None:
            if self._loop.is_running():
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(drain_tasks(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=10)
            if not self._loop.is_running():
                self._loop.close()
            self._loop = None

    def _stop_process(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.send_signal(signal.SIGTERM)
                try:
                    self._proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            if self._proc.stderr is not None:
                self._proc.stderr.close()
            self._proc = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
