"""Exposed ports across edges: the apiserver reaches a sandbox on another host's edge
over that edge's Aether link (TCP with the cluster's token), not over any route to the
sandbox. Two ``dsec edge`` processes listen on TCP; the apiserver (LocalCluster with
``remote_edges``) dials them; a port of a sandbox on each is reached through the one
apiserver URL."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from dsec.cluster.local import LocalCluster
from dsec.edge.backends.container.linux import MNT_DETACH, umount2
from dsec.image import LayerStore, ensure_busybox_base

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

DSEC = [sys.executable, "-c", "from dsec.cli.main import main; main()"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def two_edges(tmp_path: object) -> Iterator[LocalCluster]:
    base = str(tmp_path)
    state = os.path.join(base, "api")
    layers = os.path.join(state, "layers")
    os.makedirs(layers, mode=0o700)
    store = LayerStore(layers)
    layer = ensure_busybox_base(store)
    if "base:latest" not in store.refs():
        store.tag(layer.digest, "base")
    token = secrets.token_hex(16)
    token_file = os.path.join(base, "token")
    with open(token_file, "w") as f:
        f.write(token)
    addrs = {n: f"tcp:127.0.0.1:{_port()}" for n in ("h1", "h2")}
    procs = [subprocess.Popen(
        [*DSEC, "edge", "--listen", addr, "--node-id", node, "--backend", "container",
         "--state-dir", os.path.join(base, node), "--layer-store", layers,
         "--token-file", token_file, "--max-sandboxes", "1", "--log-level", "warning"],
        stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for node, addr in addrs.items()]
    try:
        with LocalCluster(edges=0, backend="container", state_dir=state,
                          remote_edges=addrs, edge_token=token.encode()) as cl:
            yield cl
    finally:
        for p in procs:
            p.terminate()
            p.wait(60)
        for node in addrs:   # the edges keep their disk pool mounted for adoption
            for sub in ("pool", "scratch"):   # (+ the shared scratch tmpfs, issue 22)
                pool = os.path.join(base, node, "container", sub)
                if os.path.ismount(pool):
                    umount2(pool, MNT_DETACH)


def test_ports_of_sandboxes_on_two_tcp_edges_through_one_apiserver(
        two_edges: LocalCluster) -> None:
    cl = two_edges
    with cl.client(protocol="http") as c:
        deadline = time.monotonic() + 60
        while not all(n.healthy for n in c.nodes()) or len(c.nodes()) < 2:
            assert time.monotonic() < deadline, c.nodes()
            time.sleep(0.2)
        made = {}
        for i in range(2):       # one sandbox per edge (--max-sandboxes 1)
            sb = c.sandboxes.create(project=f"p/{i}")
            made[sb.info.node] = sb
        assert set(made) == {"h1", "h2"}
        try:
            for node, sb in made.items():
                r = sb.exec(f"mkdir -p /tmp/w && echo on-{node} > /tmp/w/index.html && "
                            "httpd -p 127.0.0.1:8000 -h /tmp/w", timeout=10)
                assert r.exit_code == 0, r
            for node, sb in made.items():
                url = sb.ports.expose(8000)
                assert httpx.get(url, timeout=20).text == f"on-{node}\n"
        finally:
            for sb in made.values():
                sb.kill()
