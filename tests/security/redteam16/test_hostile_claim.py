"""Red team 16 (join x move): a compromised edge that holds nothing claims another
project's snapshot, and the control plane believes it.

``ApiService._find_snapshot`` asks every edge ``get_snapshot(id)`` and takes the *first*
answer's project for the access check; placement then sends the create to the node that
really holds the snapshot. So one lying edge hands any snapshot id to any project, and
the sandbox boots on the honest holder with the victim's files.

Real processes: an apiserver (LocalCluster) with an honest container edge ``a`` and the
hostile edge ``0h`` (the real ``dsec edge``, simulated backend, one patch in its own
process: hostile_edge.py); ``0h`` is listed first.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dsec.client.sync import Client
from dsec.cluster.local import LocalCluster
from dsec.errors import DsecError
from dsec.image import LayerStore, ensure_busybox_base
from tests.security.redteam16.test_hostile_holder import DSEC, TIMEOUT, Edge, _port

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

HOSTILE = [DSEC[0], "-m", "tests.security.redteam16.hostile_edge"]


class HostileEdge(Edge):
    def start(self) -> None:
        env = {**os.environ, "RT16_SNAPSHOT_PROJECT": "tenant16c",
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[3]),
                                              os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, env=env)


@pytest.fixture
def cl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    base = str(tmp_path_factory.mktemp("rt16claim"))
    state = os.path.join(base, "api")
    layers = os.path.join(state, "layers")
    os.makedirs(layers, mode=0o700)
    api_store = LayerStore(layers)
    layer = ensure_busybox_base(api_store)
    if "base:latest" not in api_store.refs():
        api_store.tag(layer.digest, "base")
    token_file = os.path.join(base, "token")
    token = secrets.token_hex(16)
    with open(token_file, "w") as f:
        f.write(token)
    h_addr, a_addr = f"tcp:127.0.0.1:{_port()}", f"tcp:127.0.0.1:{_port()}"
    edges = {
        "0h": HostileEdge("0h", h_addr, [
            *HOSTILE, "edge", "--listen", h_addr, "--node-id", "0h", "--backend",
            "simulated", "--state-dir", os.path.join(base, "0h"), "--token-file", token_file,
            "--log-level", "warning"], os.path.join(base, "0h")),
        "a": Edge("a", a_addr, [
            *DSEC, "edge", "--listen", a_addr, "--node-id", "a", "--backend", "container",
            "--state-dir", os.path.join(base, "a"), "--layer-store", layers,
            "--token-file", token_file, "--max-sandboxes", "4", "--log-level", "warning"],
            os.path.join(base, "a")),
    }
    try:
        for e in edges.values():
            e.start()
        with LocalCluster(edges=0, backend="container", state_dir=state,
                          remote_edges={n: e.addr for n, e in edges.items()},
                          edge_token=token.encode()) as c:
            deadline = time.monotonic() + TIMEOUT
            while True:
                r = httpx.get(f"{c.url}/v1/nodes", timeout=TIMEOUT,
                              headers={"authorization": f"Bearer {c.api_key}"})
                nodes = r.json()["items"]
                if len(nodes) == 2 and all(n.get("status", "healthy") == "healthy"
                                           for n in nodes):
                    break
                assert time.monotonic() < deadline, [(n["id"], n.get("problem")) for n in nodes]
                time.sleep(0.2)
            yield c
    finally:
        for e in edges.values():
            e.stop()


def test_an_edge_that_holds_nothing_cannot_hand_a_snapshot_to_another_project(
        cl: LocalCluster) -> None:
    """Safe: the project of a snapshot is the control plane's record (the snapshot
    charge written when it was taken), so tenant16c's admin gets NotFound for
    victim16c's snapshot whatever an edge answers."""
    key = cl.create_key("rt16-tenant-c", "tenant16c", "admin")
    payload = secrets.token_hex(8)
    with cl.client(protocol="http") as c:
        src = c.sandboxes.create(project="victim16c", backend="container")
        assert src.info.node == "a"
        assert src.exec(f"mkdir -p /srv && echo {payload} > /srv/secret").exit_code == 0
        snap = src.snapshot()
        src.kill()
    for protocol in ("http", "aether"):
        with Client(cl.url, key, gateway=cl.gateway, protocol=protocol) as t:
            try:
                sb = t.sandboxes.create(project="tenant16c", snapshot=snap.id)
            except DsecError:
                continue            # refused: the safe outcome
            try:
                r = sb.exec("cat /srv/secret")
                assert payload.encode() not in r.stdout, (
                    f"tenant16c's admin ({protocol}) booted victim16c's snapshot on node "
                    f"{sb.info.node} because edge 0h, which never held it, said it was "
                    "tenant16c's")
            finally:
                sb.kill()
