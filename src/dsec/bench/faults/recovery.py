"""Faults part ``recovery``: an SDK create in flight while the apiserver is killed (-9) and
restarted on the same state dir and ports.

Each round starts ``dsec up`` (simulated backend, creates take 0.9 s so the kill lands
between the create's idempotency claim and its answer), starts one SDK create, kills the
process with SIGKILL 0.3 s later, starts it again at once, and times the create from the
kill to its success. Recorded:

- ``faults_create_across_apiserver_restart_s``: seconds from the kill to the create's
  answer (p50 and max over the rounds; REST and the Aether gateway alternate). It is the
  restart plus one 0.9 s create: the restarted apiserver sees the dead one's process is
  gone (same machine) and takes its idempotency claim over at once; an apiserver on
  another machine would wait for the dead one's lease (3 s) instead. Measured while
  writing this: 2.1 s (restart 1.1 s) on the loaded 2-core dev VM, 3.8 s before the
  same-machine check (the lease wait);
- ``faults_apiserver_restart_s``: kill to the restarted apiserver answering (p50);
- ``faults_restart_failed_creates`` and ``faults_restart_duplicate_sandboxes``: creates
  that raised, and sandboxes beyond one per create (targets: 0).
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any

from dsec.bench import BenchContext
from dsec.bench.faults import part
from dsec.cluster import DSEC_ARGV
from dsec.rmtree import remove_tree

if TYPE_CHECKING:
    from dsec.client.core import WireProtocol

__all__ = ["restart_round"]

_CREATE_S = 0.9     # the paper-microvm profile's create latency
_KILL_AFTER_S = 0.3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Up:
    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.port, self.gw_port = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.gateway = f"tcp:127.0.0.1:{self.gw_port}"
        self.key = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        from dsec.statedir import read_local

        cmd = [*DSEC_ARGV, "up",
               "--state-dir", self.state_dir, "--listen", f"127.0.0.1:{self.port}",
               "--gateway", self.gateway, "--backend", "simulated",
               "--profile", "paper-microvm", "--quiet"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            local = read_local(self.state_dir)
            if local is not None and local.get("pid") == self.proc.pid:
                self.key = str(local["api_key"])
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"dsec up exited with {self.proc.returncode}")
            time.sleep(0.02)
        raise RuntimeError(f"dsec up did not come up within {timeout}s")

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def restart_round(transport: WireProtocol) -> dict[str, Any]:
    """One round (see the module docstring); returns its timings and counts."""
    import httpx

    from dsec.client.sync import Client

    state = tempfile.mkdtemp(prefix="dsec-bench-recovery-")
    up = _Up(os.path.join(state, "state"))
    out: dict[str, Any] = {}
    try:
        up.start()
        label = os.urandom(4).hex()
        done: dict[str, Any] = {}

        def create() -> None:
            try:
                with Client(up.url, up.key, protocol=transport, gateway=up.gateway,
                            session_lease_s=None, timeout=30, create_retry_s=120) as c:
                    done["id"] = c.sandboxes.create(labels={"bench": label}).id
            except Exception as exc:  # noqa: BLE001 - counted as a failed create
                done["error"] = exc
            done["at"] = time.monotonic()
        t = threading.Thread(target=create, daemon=True)
        t.start()
        time.sleep(_KILL_AFTER_S)
        killed = time.monotonic()
        up.kill9()
        up.start()
        out["restart_s"] = time.monotonic() - killed
        t.join(300)
        out["failed"] = 0 if "id" in done else 1
        out["create_s"] = done.get("at", time.monotonic()) - killed
        deadline = time.monotonic() + 30
        listed: list[Any] = []
        while time.monotonic() < deadline:   # the restarted registry learns from heartbeats
            r = httpx.get(f"{up.url}/v1/sandboxes", params={"label": f"bench={label}"},
                          headers={"authorization": f"Bearer {up.key}"}, timeout=30)
            listed = r.json().get("items", [])
            if listed:
                break
            time.sleep(0.2)
        out["duplicates"] = max(0, len(listed) - 1)
    finally:
        up.stop()
        remove_tree(state)
    return out


@part("recovery")
def recovery(ctx: BenchContext) -> None:
    rounds = ctx.scale(6, 2)
    runs = [restart_round("aether" if i % 2 == 0 else "http") for i in range(rounds)]
    create = [r["create_s"] for r in runs]
    ctx.record("faults_create_across_apiserver_restart_s", statistics.median(create), "s",
               pct="p50", rounds=rounds, kill="SIGKILL", transports="aether+http",
               create_latency_s=_CREATE_S)
    ctx.record("faults_create_across_apiserver_restart_s", max(create), "s", pct="max",
               rounds=rounds, kill="SIGKILL", transports="aether+http",
               create_latency_s=_CREATE_S)
    ctx.record("faults_apiserver_restart_s", statistics.median(r["restart_s"] for r in runs),
               "s", pct="p50", rounds=rounds)
    ctx.record("faults_restart_failed_creates", sum(r["failed"] for r in runs), "count",
               rounds=rounds)
    ctx.record("faults_restart_duplicate_sandboxes", sum(r["duplicates"] for r in runs),
               "count", rounds=rounds)
    ctx.note("faults_create_across_apiserver_restart_s: from the SIGKILL to the answer of "
             "a create that was in flight: the restart, then the takeover of the dead "
             "apiserver's idempotency claim (at once: its process is gone; another machine "
             "would wait for its 3 s lease), then one simulated 0.9 s create.")
