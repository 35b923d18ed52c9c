"""An edge is a network peer, never the authority on ids, projects or snapshots (red team
16: F3, F10, F2, found on the `join` branch, in code that was already on main).

Real processes: the apiserver (LocalCluster with static ``remote_edges``, REST + the
Aether gateway) dials two ``dsec edge`` processes (simulated backend) over TCP with the
cluster's token. The hostile one is the real edge patched in its own process
(hostile_edge.py): what root on its host can make it say. Every check goes through REST
and through the SDK over the gateway.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsec.client.sync import Client
from dsec.cluster.local import LocalCluster
from dsec.control.api.plane import PlaneConfig
from dsec.errors import ImageNotFound, NotFound

ROOT = str(Path(__file__).resolve().parents[3])
EDGE = [sys.executable, "-c", "from dsec.cli.main import main; main()"]
HOSTILE = [sys.executable, "-m", "tests.security.edge_authority.hostile_edge"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Cluster:
    cl: LocalCluster
    procs: dict[str, subprocess.Popen[bytes]]

    def sdk(self, key: str) -> Client:
        """The SDK over the Aether gateway, as ``key``."""
        return Client(self.cl.url, key, gateway=self.cl.gateway, protocol="aether")

    def http(self, key: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.cl.url, timeout=30.0, headers={
            "authorization": f"Bearer {key or self.cl.api_key}"})


def _until(what: str, ok: Callable[[], bool], timeout: float = 30.0,
           extra: Callable[[], object] = lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {extra()}"
        time.sleep(0.2)


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """start(hostile_env, plane=...) -> Cluster: honest edge ``v1`` and hostile edge
    ``a0`` (first in the apiserver's edge list), both serving before the apiserver."""
    made: list[Cluster] = []

    def go(hostile_env: dict[str, str], **plane: Any) -> Cluster:
        token = secrets.token_hex(16)
        token_file = tmp_path / "token"
        token_file.write_text(token)
        addrs = {"a0": f"tcp:127.0.0.1:{_port()}", "v1": f"tcp:127.0.0.1:{_port()}"}
        procs: dict[str, subprocess.Popen[bytes]] = {}
        for node, addr in addrs.items():
            argv = HOSTILE if node == "a0" else EDGE
            log = open(tmp_path / f"{node}.log", "ab")   # noqa: SIM115 - closed by Popen's exit
            procs[node] = subprocess.Popen(
                [*argv, "edge", "--listen", addr, "--node-id", node, "--backend",
                 "simulated", "--state-dir", str(tmp_path / node), "--token-file",
                 str(token_file), "--log-level", "info"], stdin=subprocess.DEVNULL,
                stdout=log, stderr=log,
                env={**os.environ, **(hostile_env if node == "a0" else {}), "HOSTILE_FULL": "1",
                     "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
            log.close()
        cfg = PlaneConfig(**{"heartbeat_interval_s": 0.3, "poll_timeout_s": 1.0,
                             "reconnect_interval_s": 0.3, **plane})
        for node, addr in addrs.items():   # serving before the apiserver dials them
            port = int(addr.rsplit(":", 1)[1])
            _until(f"edge {node} listening", lambda p=port: _listening(p))
        cl = LocalCluster(edges=0, remote_edges=addrs, edge_token=token.encode(),
                          plane=cfg, state_dir=str(tmp_path / "api")).start()
        c = Cluster(cl, procs)
        made.append(c)
        with c.http() as h:
            _until("both edges healthy", lambda: sorted(
                n["id"] for n in h.get("/v1/nodes").json()["items"] if n.get("healthy", True)
            ) == ["a0", "v1"], extra=lambda: h.get("/v1/nodes").json())
        return c

    try:
        yield go
    finally:
        for c in made:
            c.cl.stop()
            for p in c.procs.values():
                if p.poll() is None:
                    p.terminate()
                p.wait(30)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _on_v1(h: httpx.Client, project: str, **extra: Any) -> str:
    """A sandbox of ``project`` on the honest edge (creates landing on a0 are removed)."""
    for _ in range(40):
        r = h.post("/v1/sandboxes", json={"project": project, "backend": "simulated",
                                          **extra})
        assert r.status_code == 201, r.text
        sid = str(r.json()["id"])
        if sid.endswith("-v1"):
            return sid
        assert h.delete(f"/v1/sandboxes/{sid}").status_code in (200, 204)
    raise AssertionError("placement never chose v1")


def test_an_edge_cannot_get_another_nodes_sandbox_written_off(
        start: Callable[..., Cluster], tmp_path: Path) -> None:
    """F3: a0 lists v1's sandbox in its heartbeat, then goes silent (kill -9) past the
    TTL. Safe: ids that do not name the sending node are ignored (and logged); v1's
    sandbox keeps running, is never written off, and no edge destroys it."""
    claim = tmp_path / "claim"
    c = start({"HOSTILE_CLAIM": str(claim), "HOSTILE_PROJECT": "victim"}, node_ttl_s=2.0)
    with c.http() as h:
        sid = _on_v1(h, "victim")
        claim.write_text(sid + "\n")
        time.sleep(1.5)                          # a few heartbeats listing v1's sandbox
        c.procs["a0"].send_signal(signal.SIGKILL)
        c.procs["a0"].wait(10)
        _until("a0 written off as lost", lambda: any(
            n["id"] == "a0" and n.get("status", "healthy") == "lost"
            for n in h.get("/v1/nodes").json()["items"]), 20)
        time.sleep(1.5)                          # v1 polled again: would destroy it
        r = h.get(f"/v1/sandboxes/{sid}")
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "running", (
            f"v1's sandbox is {r.json()['state']} ({r.json().get('reason')}): a0 listed "
            "it and went silent")
        listed = [s["id"] for s in h.get("/v1/sandboxes",
                                         params={"project": "victim"}).json()["items"]]
        assert sid in listed
    with c.sdk(c.cl.api_key) as sdk:                   # the SDK over the gateway agrees
        assert sdk.sandboxes.get(sid).info.state == "running"
        r2 = sdk.sandboxes.get(sid).exec("true")
        assert r2.exit_code == 0


def test_an_edge_cannot_charge_phantom_sandboxes_to_a_project(
        start: Callable[..., Cluster]) -> None:
    """F10: a0 lists three ids of its own node and says they are running sandboxes of
    project ``victim`` (there are none). Safe: a sandbox the control plane has no record
    of is not charged on an edge's word: victim still creates within its quota of 3, and
    no listing (REST, SDK over the gateway, superuser's) shows the phantoms."""
    c = start({"HOSTILE_PHANTOMS": "3", "HOSTILE_PROJECT": "victim"}, node_ttl_s=30.0)
    phantoms = {f"sb-{i:012x}-a0" for i in (1, 2, 3)}
    with c.http() as h:
        r = h.put("/v1/quotas/victim", json={"max_sandboxes": 3})
        assert r.status_code == 200, r.text
        time.sleep(2.0)                          # heartbeats and reconciles listing them
        every = {s["id"] for s in h.get("/v1/sandboxes").json()["items"]}
        assert not every & phantoms, every
        usage = h.get("/v1/projects/victim").json()
        made = []
        for _ in range(3):
            r = h.post("/v1/sandboxes", json={"project": "victim", "backend": "simulated"})
            assert r.status_code == 201, (
                f"victim cannot create ({r.status_code} {r.json().get('code')}): its quota "
                f"is taken by a0's phantoms (usage {usage})")
            made.append(r.json()["id"])
        listed = {s["id"] for s in h.get("/v1/sandboxes",
                                         params={"project": "victim"}).json()["items"]}
        assert listed == set(made)
    key = c.cl.create_key("victim-admin", "victim", "admin")
    with c.sdk(key) as sdk:
        assert {s.id for s in sdk.sandboxes.list(project="victim")} == set(made)
    runtime = c.cl.runtime
    assert runtime is not None
    assert set(runtime.plane.quarantined("a0")) == phantoms   # held aside, not charged


def test_an_edge_cannot_hand_another_projects_snapshot_to_a_tenant(
        start: Callable[..., Cluster], tmp_path: Path) -> None:
    """F2: victim's snapshot S is on v1. a0 (asked first) holds nothing but answers any
    snapshot id as project ``tenant``'s. Safe: the control plane's record (the charge
    row written when S was taken: project victim, node v1) decides: tenant's admin can
    neither see S nor boot it (REST, SDK over the gateway), and victim still can."""
    listed = tmp_path / "snaps"
    c = start({"HOSTILE_SNAPSHOT_PROJECT": "tenant", "HOSTILE_SNAPSHOTS": str(listed)},
              node_ttl_s=30.0)
    victim = c.cl.create_key("victim-admin", "victim", "admin")
    tenant = c.cl.create_key("tenant-admin", "tenant", "admin")
    with c.http(victim) as vh:
        sid = _on_v1(vh, "victim")
        r = vh.put(f"/v1/sandboxes/{sid}/files", params={"path": "/srv/secret"},
                   content=b"victim's secret")
        assert r.status_code in (200, 204), r.text
        r = vh.post(f"/v1/sandboxes/{sid}/snapshot", json={})
        assert r.status_code in (200, 201), r.text
        snap = r.json()["id"]
    listed.write_text(snap + "\n")
    with c.http(tenant) as th:
        r = th.get(f"/v1/snapshots/{snap}")
        assert r.status_code == 404, r.text
        assert snap not in {s["id"] for s in th.get("/v1/snapshots").json()["items"]}
        r = th.post("/v1/sandboxes", json={"project": "tenant", "snapshot": snap,
                                           "backend": "simulated"})
        assert r.status_code == 404, (
            f"tenant booted victim's snapshot ({r.status_code}: {r.text}) on a0's word")
    with c.sdk(tenant) as sdk:
        with pytest.raises(NotFound):
            sdk.snapshots.get(snap)
        with pytest.raises(ImageNotFound):
            sdk.sandboxes.create(project="tenant", snapshot=snap, backend="simulated")
        assert snap not in {s.id for s in sdk.snapshots.list()}
    with c.sdk(victim) as sdk:     # the owner still can
        view = sdk.snapshots.get(snap)
        assert view.project == "victim"
        sb = sdk.sandboxes.create(project="victim", snapshot=snap, backend="simulated")
        assert sb.files.read("/srv/secret") == b"victim's secret"
        sb.kill()
