"""Red team 16 (move): a compromised edge that holds a layer decides what it *means*.

A layer's digest is the sha256 of its EROFS file only; its manifest (``stack``,
``parent``, ``namespace``, labels) travels beside it, from the holder, and nothing
checks it against anything but itself. The receiving edge stores the holder's
manifest as its own, and the control plane asks edges which project owns a snapshot.

Setup (as tests/edge/test_layer_move.py): two real ``dsec edge`` processes with the
container backend on loopback TCP, behind one apiserver. ``a`` is the compromised host:
its operator (root there) edits the files of its own layer store, nothing else. ``b``
is an honest edge with its own store.
"""

from __future__ import annotations

import io
import os
import secrets
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import msgspec
import pytest

from dsec.client.sync import Client
from dsec.cluster.local import LocalCluster
from dsec.edge.backends.container.linux import MNT_DETACH, umount2
from dsec.errors import DsecError
from dsec.image import LayerStore, ensure_busybox_base
from dsec.image.manifest import LayerManifest

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

DSEC = [sys.executable, "-c", "from dsec.cli.main import main; main()"]
TIMEOUT = 60.0


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Edge:
    node: str
    addr: str
    argv: list[str]
    state: str
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        pool = os.path.join(self.state, "container", "pool")
        if os.path.ismount(pool):
            umount2(pool, MNT_DETACH)


@dataclass
class Rig:
    cl: LocalCluster
    a_store: LayerStore      # the compromised holder's store (edge a's, on its disk)
    b_store: LayerStore
    n: int = 0

    def rest(self, method: str, path: str, key: str | None = None,
             **kw: object) -> httpx.Response:
        return httpx.request(method, f"{self.cl.url}{path}", timeout=TIMEOUT,  # type: ignore[arg-type]
                             headers={"authorization": f"Bearer {key or self.cl.api_key}"},
                             **kw)

    def toolkit(self) -> str:
        """A fresh toolkit only on ``a`` (creates naming it prefer ``a``)."""
        self.n += 1
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            data = os.urandom(1024)
            info = tarfile.TarInfo(f"opt/rt{self.n}/data")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        name = f"rt16tool{self.n}"
        r = self.rest("POST", "/v1/images", params={"name": name, "kind": "toolkit"},
                      content=buf.getvalue())
        assert r.status_code == 201, r.text
        digest = r.json()["items"][0]["digest"]
        plane = self.cl._rt().plane
        deadline = time.monotonic() + TIMEOUT
        while digest not in plane.edges["a"].images:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        return name

    def tamper(self, digest: str, **changes: object) -> LayerManifest:
        """What a's operator does: rewrite the manifest file of ``digest`` in a's store."""
        m = self.a_store.get(digest)
        forged = msgspec.structs.replace(m, **changes)
        path = os.path.join(self.a_store.root, "manifests",
                            digest.removeprefix("sha256:") + ".json")
        with open(path, "wb") as f:
            f.write(msgspec.json.encode(forged))
        return m

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + TIMEOUT
        while True:
            nodes = self.rest("GET", "/v1/nodes").json()["items"]
            if len(nodes) == 2 and all(n.get("status", "healthy") == "healthy"
                                       for n in nodes):
                return
            assert time.monotonic() < deadline, nodes
            time.sleep(0.2)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    base = str(tmp_path_factory.mktemp("rt16move"))
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
    edges = {}
    b_layers = os.path.join(base, "b-layers")
    for node, store in (("a", layers), ("b", b_layers)):
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
            r = Rig(cl, api_store, LayerStore(b_layers))
            r.wait_healthy()
            yield r
    finally:
        for e in edges.values():
            e.stop()


def _snapshot_on_a(rig: Rig, c: Client, project: str, payload: str) -> tuple[str, object]:
    tool = rig.toolkit()
    sb = c.sandboxes.create(project=project, toolkits=[tool])
    assert sb.info.node == "a"
    r = sb.exec(f"mkdir -p /srv && echo {payload} > /srv/secret")
    assert r.exit_code == 0, r
    snap = sb.snapshot()
    assert not rig.b_store.has(snap.id)
    return snap.id, sb


def test_a_holder_cannot_change_which_layers_a_snapshot_stands_on(rig: Rig) -> None:
    """a's operator adds a layer of its own (a trojaned /bin/sh, here /etc/rt16-pwned)
    under the victim's snapshot in a's manifest; a create placed on b fetches the
    snapshot from a. Safe: b stores the snapshot over the layers it was taken on (the
    stack is part of what the digest or the control plane's record pins), never over
    layers the holder named; the sandbox on b has no file of a's choosing."""
    with rig.cl.client(protocol="http") as c:
        snap, src = _snapshot_on_a(rig, c, "victim16", secrets.token_hex(8))
        src.kill()  # type: ignore[attr-defined]
        # a's operator: a layer of its own in a's store, slipped under the snapshot
        evil_dir = os.path.join(str(rig.cl.state_dir), "evil-tree")
        os.makedirs(os.path.join(evil_dir, "etc"), exist_ok=True)
        with open(os.path.join(evil_dir, "etc", "rt16-pwned"), "w") as f:
            f.write("a's operator was here\n")
        evil = rig.a_store.add_tree(evil_dir, kind="toolkit")
        honest = rig.tamper(snap, stack=(evil.digest, *rig.a_store.get(snap).stack))
        # a is full: the next create from the snapshot goes to b, which fetches it from a
        tool = rig.toolkit()
        full = [c.sandboxes.create(project="victim16", toolkits=[tool]) for _ in range(2)]
        try:
            assert [x.info.node for x in full] == ["a", "a"]
            try:
                sb = c.sandboxes.create(project="victim16", snapshot=snap)
            except DsecError:
                sb = None          # refused: the safe outcome
            if sb is not None:
                try:
                    assert sb.info.node == "b"
                    r = sb.exec("test -e /etc/rt16-pwned && echo PWNED || echo clean")
                    assert r.stdout.strip() == b"clean", (
                        "the sandbox on b runs over a layer the holder slipped under the "
                        "snapshot")
                finally:
                    sb.kill()
        finally:
            for x in full:
                x.kill()
    if rig.b_store.has(snap):
        assert rig.b_store.get(snap).stack == honest.stack, (
            "b stored the holder's word for what the snapshot stands on")


def test_an_edge_cannot_hand_another_projects_snapshot_to_a_tenant(rig: Rig) -> None:
    """a's operator relabels the victim project's snapshot as project ``tenant16``'s in
    a's store. Safe: the control plane knows which project a snapshot belongs to from
    its own record (the snapshot charge written when it was taken), not from an edge's
    answer: ``tenant16``'s admin gets NotFound, as for any snapshot of another project."""
    key = rig.cl.create_key("rt16-tenant", "tenant16", "admin")
    payload = secrets.token_hex(8)
    with rig.cl.client(protocol="http") as c:
        snap, src = _snapshot_on_a(rig, c, "victim16b", payload)
        src.kill()  # type: ignore[attr-defined]
    rig.tamper(snap, namespace="tenant16")
    for protocol in ("http", "aether"):
        with Client(rig.cl.url, key, gateway=rig.cl.gateway, protocol=protocol) as t:
            try:
                sb = t.sandboxes.create(project="tenant16", snapshot=snap)
            except DsecError:
                continue            # refused: the safe outcome
            try:
                r = sb.exec("cat /srv/secret")
                assert payload.encode() not in r.stdout, (
                    f"tenant16's admin ({protocol}) booted victim16b's snapshot and read "
                    "its files, on an edge's word that it was tenant16's")
            finally:
                sb.kill()
