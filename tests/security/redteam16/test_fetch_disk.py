"""Red team 16 (move): the receiving edge's free-space reserve is check-then-act.

``EdgeLayers._receive`` refuses a layer bigger than the store filesystem's free space
less ``HOST_RESERVE_BYTES`` (256 MiB: "the state dir's SQLite and journals live there
too") - measured once, before a byte is written. Two fetches of different layers onto
the same node at once both pass the check against the same free space and then write
both: the filesystem fills to ENOSPC, through the reserve, and whatever else writes
there at that moment (the edge's journal) fails too.

Real processes and a real (small) filesystem: two ``dsec edge`` processes with the
container backend behind one apiserver (as test_hostile_holder.py); edge b's layer store
is on a 540 MiB tmpfs this test mounts (and unmounts); the two layers (280 MiB each) are
built in a's store; the fetches go through the superuser REST door at the same instant.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from dsec.cluster.local import LocalCluster
from dsec.image import LayerStore, ensure_busybox_base
from tests.security.redteam16.test_hostile_holder import DSEC, TIMEOUT, Edge, _port

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

TMPFS_MIB = 540
LAYER_MIB = 280
RESERVE = 256 << 20


@pytest.fixture
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, LayerStore, str]]:
    base = str(tmp_path_factory.mktemp("rt16disk"))
    state = os.path.join(base, "api")
    layers = os.path.join(state, "layers")
    os.makedirs(layers, mode=0o700)
    api_store = LayerStore(layers)
    layer = ensure_busybox_base(api_store)
    if "base:latest" not in api_store.refs():
        api_store.tag(layer.digest, "base")
    small = os.path.join(base, "b-fs")
    os.makedirs(small)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MIB}m,mode=0700", "rt16",
                    small], check=True)
    token_file = os.path.join(base, "token")
    token = secrets.token_hex(16)
    with open(token_file, "w") as f:
        f.write(token)
    edges = {}
    for node, store in (("a", layers), ("b", os.path.join(small, "layers"))):
        addr = f"tcp:127.0.0.1:{_port()}"
        st = os.path.join(base, node)
        edges[node] = Edge(node, addr, [
            *DSEC, "edge", "--listen", addr, "--node-id", node, "--backend", "container",
            "--state-dir", st, "--layer-store", store, "--token-file", token_file,
            "--max-sandboxes", "2", "--log-level", "warning"], st)
    try:
        for e in edges.values():
            e.start()
        with LocalCluster(edges=0, backend="container", state_dir=state,
                          remote_edges={n: e.addr for n, e in edges.items()},
                          edge_token=token.encode()) as cl:
            deadline = time.monotonic() + TIMEOUT
            while True:
                r = httpx.get(f"{cl.url}/v1/nodes", timeout=TIMEOUT,
                              headers={"authorization": f"Bearer {cl.api_key}"})
                nodes = r.json()["items"]
                if len(nodes) == 2 and all(n.get("status", "healthy") == "healthy"
                                           for n in nodes):
                    break
                assert time.monotonic() < deadline, nodes
                time.sleep(0.2)
            yield cl, api_store, small
    finally:
        for e in edges.values():
            e.stop()
        subprocess.run(["umount", "-l", small], check=False)


def test_two_fetches_at_once_never_eat_the_receivers_disk_reserve(
        rig: tuple[LocalCluster, LayerStore, str], tmp_path: object) -> None:
    """Safe: whatever the concurrency, the store filesystem keeps its reserve: each
    fetch is admitted against free space less what admitted fetches will still write,
    so the second is refused with capacity_exceeded (or waits) and nothing hits ENOSPC."""
    cl, a_store, small = rig
    digests = []
    for i in range(2):
        tree = os.path.join(str(tmp_path), f"t{i}")
        os.makedirs(os.path.join(tree, "opt"))
        with open(os.path.join(tree, "opt", "blob"), "wb") as f:
            f.writelines(os.urandom(1 << 20) for _ in range(LAYER_MIB))
        digests.append(a_store.add_tree(tree, kind="toolkit").digest)
    low = [1 << 62]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            st = os.statvfs(small)
            low[0] = min(low[0], st.f_bavail * st.f_frsize)
            time.sleep(0.001)

    answers: dict[str, httpx.Response] = {}
    go = threading.Barrier(2)

    def fetch(d: str) -> None:
        go.wait()
        answers[d] = httpx.post(f"{cl.url}/v1/nodes/b/layers", timeout=TIMEOUT * 3,
                                json={"digest": d, "source": "a"},
                                headers={"authorization": f"Bearer {cl.api_key}"})

    w = threading.Thread(target=watch)
    w.start()
    ts = [threading.Thread(target=fetch, args=(d,)) for d in digests]
    try:
        for t in ts:
            t.start()
        for t in ts:
            t.join(TIMEOUT * 3)
    finally:
        stop.set()
        w.join()
    got = {d[:19]: (r.status_code, r.json().get("code")) for d, r in answers.items()}
    for r in answers.values():
        assert r.status_code == 200 or r.json().get("code") == "capacity_exceeded", got
    assert low[0] >= RESERVE, (
        f"the receiver's store filesystem went down to {low[0] >> 20} MiB free (reserve "
        f"{RESERVE >> 20} MiB); answers {got}")
