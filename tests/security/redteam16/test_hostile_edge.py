"""Red team 16 (join): what a joined edge (valid token, valid certificate, its host
compromised) can do to sandboxes on *other* edges through its own heartbeat.

The control plane takes a heartbeat's sandbox list at its word: it never checks that
a listed sandbox id names the node that sent it (``sb-<hex>-<node>``). The watcher
keeps that list as the node's sandboxes; when the node goes silent past the TTL it
evicts and tombstones *every* listed id; the honest node that really runs one of them
then lists it, finds it tombstoned, and destroys it.

Real processes: an in-process apiserver runtime (as tests/cluster/test_join.py), two
``dsec edge --join`` processes (simulated backend) on loopback, mutual TLS. The hostile
edge is the real edge with one patch in its own process (hostile_edge.py).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from dsec.cluster.runtime import ClusterConfig, ClusterRuntime
from dsec.control.api.plane import PlaneConfig
from tests.cluster.test_join import EdgeProc, eventually, free_port, healthy

HOSTILE = [sys.executable, "-m", "tests.security.redteam16.hostile_edge"]


class HostileEdge(EdgeProc):
    def start(self, *args: str, env: dict[str, str] | None = None) -> HostileEdge:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*HOSTILE, "edge", "--listen", self.listen, "--state-dir",
                 str(self.state_dir), "--backend", "simulated", "--log-level", "info",
                 *args], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                env={**os.environ, **(env or {}),
                     "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[3]),
                                                    os.environ.get("PYTHONPATH", "")])})
        return self


async def test_a_joined_edge_cannot_get_another_nodes_sandboxes_destroyed(
        tmp_path: Path) -> None:
    """h lists v's sandbox in its heartbeat, then goes silent (kill -9) past the TTL.
    Safe: the control plane ignores (and logs) listed ids that do not name the sending
    node; v's sandbox keeps running, is never written off nor destroyed."""
    cfg = ClusterConfig(state_dir=str(tmp_path / "cp"), listen="127.0.0.1:0", gateway=None,
                        edges=0, write_local=False,
                        plane=PlaneConfig(heartbeat_interval_s=0.3, node_ttl_s=3.0,
                                          poll_timeout_s=1.0, reconnect_interval_s=0.3))
    rt = await ClusterRuntime(cfg).start()
    claim = tmp_path / "claim"
    v = EdgeProc(tmp_path / "v", f"tcp:127.0.0.1:{free_port()}")
    h = HostileEdge(tmp_path / "h", f"tcp:127.0.0.1:{free_port()}")
    try:
        async with httpx.AsyncClient(base_url=rt.url, timeout=30.0, headers={
                "authorization": f"Bearer {rt.admin_key}"}) as http:
            tokens = []
            for _ in range(2):
                r = await http.post("/v1/cluster/tokens", json={"ttl_s": 600, "uses": 1})
                assert r.status_code == 201, r.text
                tokens.append(r.json()["token"])
            v.start("--join", rt.url, "--node-id", "v1", env={"DSEC_JOIN_TOKEN": tokens[0]})
            await v.serving()
            await eventually(lambda: healthy(rt, "v1"), 30, "v1 healthy")
            r = await http.post("/v1/sandboxes", json={"image": "base",
                                                       "project": "victim"})
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
            assert sid.endswith("-v1")
            # the compromised host joins with its own token and lists v1's sandbox
            claim.write_text(sid + "\n")
            h.start("--join", rt.url, "--node-id", "h1",
                    env={"DSEC_JOIN_TOKEN": tokens[1], "RT16_CLAIM": str(claim),
                         "RT16_PROJECT": "victim"})
            await h.serving()
            await eventually(lambda: healthy(rt, "h1"), 30, "h1 healthy")
            await asyncio.sleep(1.0)               # a few heartbeats listing sid
            assert h.proc is not None
            h.proc.send_signal(signal.SIGKILL)     # silent: the TTL runs out
            deadline = time.monotonic() + 12.0
            while time.monotonic() < deadline:
                await asyncio.sleep(0.5)
                r = await http.get(f"/v1/sandboxes/{sid}")
                assert r.status_code == 200, r.text
                assert r.json()["state"] == "running", (
                    f"v1's sandbox was {r.json()['state']} ({r.json().get('reason')}) "
                    "because h1, another node, listed it and went silent")
            r = await http.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["true"]})
            assert r.status_code == 200, r.text
    finally:
        await h.stop()
        await v.stop()
        await rt.stop(keep=True)


async def test_a_joined_edge_cannot_fill_another_projects_quota_with_phantoms(
        tmp_path: Path) -> None:
    """h1 lists 3 sandbox ids of its *own* node (no other node's id needed) and, asked
    about them, says they are running sandboxes of project ``victim`` - there are none.
    Safe: a sandbox the control plane did not create (no create record, no catch-up
    event) is not charged to a project on an edge's word: victim's admin still creates
    within its quota of 3, and its listing shows only its own sandboxes."""
    cfg = ClusterConfig(state_dir=str(tmp_path / "cp"), listen="127.0.0.1:0", gateway=None,
                        edges=0, write_local=False,
                        plane=PlaneConfig(heartbeat_interval_s=0.3, node_ttl_s=30.0,
                                          poll_timeout_s=1.0, reconnect_interval_s=0.3))
    rt = await ClusterRuntime(cfg).start()
    v = EdgeProc(tmp_path / "v", f"tcp:127.0.0.1:{free_port()}")
    h = HostileEdge(tmp_path / "h", f"tcp:127.0.0.1:{free_port()}")
    try:
        async with httpx.AsyncClient(base_url=rt.url, timeout=30.0, headers={
                "authorization": f"Bearer {rt.admin_key}"}) as http:
            r = await http.put("/v1/quotas/victim", json={"max_sandboxes": 3})
            assert r.status_code == 200, r.text
            tokens = []
            for _ in range(2):
                r = await http.post("/v1/cluster/tokens", json={"ttl_s": 600, "uses": 1})
                tokens.append(r.json()["token"])
            v.start("--join", rt.url, "--node-id", "v1", env={"DSEC_JOIN_TOKEN": tokens[0]})
            h.start("--join", rt.url, "--node-id", "h1",
                    env={"DSEC_JOIN_TOKEN": tokens[1], "RT16_PHANTOMS": "3",
                         "RT16_PROJECT": "victim"})
            await v.serving()
            await h.serving()
            await eventually(lambda: healthy(rt, "v1") and healthy(rt, "h1"), 30,
                             "both healthy")
            await asyncio.sleep(2.0)          # a few heartbeats and probes
            r = await http.get("/v1/sandboxes", params={"project": "victim"})
            listed = [s["id"] for s in r.json()["items"]]
            r = await http.post("/v1/sandboxes", json={"image": "base", "project": "victim",
                                                       "backend": "simulated"})
            assert r.status_code == 201, (
                f"victim cannot create ({r.status_code} {r.json().get('code')}): its quota "
                f"is taken by h1's phantoms {listed}")
            assert all(not i.endswith("-h1") for i in listed), listed
    finally:
        await h.stop()
        await v.stop()
        await rt.stop(keep=True)
