"""Layers and snapshots move between nodes (issue 16): two real ``dsec edge`` processes
(container backend) on loopback TCP with their own state dirs, behind one apiserver
(LocalCluster with ``remote_edges``). Edge ``a`` shares the apiserver's layer store (the
machine images are built on); edge ``b`` has a store of its own, as on another host. A
create placed on ``b`` fetches what it lacks from ``a`` through the apiserver's relay.
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from dsec.client.sync import Client
from dsec.cluster.local import LocalCluster
from dsec.edge.backends.container.linux import MNT_DETACH, umount2
from dsec.errors import NotFound, PermissionDenied
from dsec.image import LayerStore, ensure_busybox_base
from dsec.image.manifest import LayerManifest
from dsec.wire import ops
from dsec.wire.layers import LayerFetch

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
    store: str
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)

    def wait_listening(self) -> None:
        """Until the edge accepts connections (it opens its store before it listens)."""
        host, port = self.addr.removeprefix("tcp:").rsplit(":", 1)
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                return
            except OSError:
                assert time.monotonic() < deadline, f"edge {self.node} did not come back"
                time.sleep(0.05)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for sub in ("pool", "scratch"):   # kept mounted for adoption (scratch: issue 22)
            pool = os.path.join(self.state, "container", sub)
            if os.path.ismount(pool):
                umount2(pool, MNT_DETACH)


@dataclass
class Move:
    cl: LocalCluster
    a: Edge
    b: Edge
    api_store: LayerStore
    b_store: LayerStore
    base: LayerManifest
    tmp: str
    _n: list[int] = field(default_factory=lambda: [0])

    def rest(self, method: str, path: str, key: str | None = None, **kw: object
             ) -> httpx.Response:
        return httpx.request(method, f"{self.cl.url}{path}", timeout=TIMEOUT,  # type: ignore[arg-type]
                             headers={"authorization": f"Bearer {key or self.cl.api_key}"},
                             **kw)

    def toolkit(self, size: int = 4096) -> LayerManifest:
        """A fresh toolkit layer in the apiserver's store (so on ``a`` only)."""
        self._n[0] += 1
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            data = os.urandom(size)
            info = tarfile.TarInfo(f"opt/tool{self._n[0]}/data")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        r = self.rest("POST", "/v1/images", params={"name": f"tool{self._n[0]}",
                                                    "kind": "toolkit"},
                      content=buf.getvalue())
        assert r.status_code == 201, r.text
        m = self.api_store.get(r.json()["items"][0]["digest"])
        self.reported("a", m.digest)
        return m

    def reported(self, node: str, digest: str) -> None:
        """Wait until ``node``'s heartbeat lists ``digest`` (placement knows holders from
        heartbeats; a layer made a moment ago is not known to be anywhere yet)."""
        plane = self.cl._rt().plane
        deadline = time.monotonic() + TIMEOUT
        while digest not in plane.edges[node].images:
            assert time.monotonic() < deadline
            time.sleep(0.05)

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + TIMEOUT
        while True:
            nodes = self.rest("GET", "/v1/nodes").json()["items"]
            if len(nodes) == 2 and all(n.get("healthy", True) and n.get("status", "healthy") == "healthy" for n in nodes):
                return
            assert time.monotonic() < deadline, nodes
            time.sleep(0.2)

    def fill_a(self, c: Client) -> list[object]:
        """Take both of a's slots (sandboxes with a toolkit only a holds)."""
        self.toolkit()
        made = [c.sandboxes.create(toolkits=[f"tool{self._n[0]}"]) for _ in range(2)]
        assert [sb.info.node for sb in made] == ["a", "a"]
        return made

    def b_leftovers(self) -> list[str]:
        return sorted(os.listdir(os.path.join(self.b_store.root, "tmp")))


@pytest.fixture(scope="module")
def move(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Move]:
    base = str(tmp_path_factory.mktemp("move"))
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
    for node, store, cap in (("a", layers, "2"), ("b", os.path.join(base, "b-layers"), "2")):
        addr = f"tcp:127.0.0.1:{_port()}"
        st = os.path.join(base, node)
        edges[node] = Edge(node, addr, [
            *DSEC, "edge", "--listen", addr, "--node-id", node, "--backend", "container",
            "--state-dir", st, "--layer-store", store, "--token-file", token_file,
            "--max-sandboxes", cap, "--log-level", "warning"], st, store)
    try:
        for e in edges.values():
            e.start()
        with LocalCluster(edges=0, backend="container", state_dir=state,
                          remote_edges={n: e.addr for n, e in edges.items()},
                          edge_token=token.encode()) as cl:
            m = Move(cl, edges["a"], edges["b"], api_store,
                     LayerStore(edges["b"].store), layer, base)
            m.wait_healthy()
            yield m
    finally:
        for e in edges.values():
            e.stop()


def test_placement_picks_the_holder_when_both_have_room(move: Move) -> None:
    tool = move.toolkit()
    assert not move.b_store.has(tool.digest)
    with move.cl.client(protocol="http") as c:
        made = []
        try:
            for _ in range(2):
                made.append(c.sandboxes.create(toolkits=[f"tool{move._n[0]}"]))
            assert [sb.info.node for sb in made] == ["a", "a"]
        finally:
            for sb in made:
                sb.kill()
    assert not move.b_store.has(tool.digest)       # nothing moved


def test_an_image_only_on_a_starts_on_b(move: Move) -> None:
    tool = move.toolkit(size=3 << 20)
    name = f"tool{move._n[0]}"
    assert not move.b_store.has(tool.digest)
    with move.cl.client(protocol="http") as c:
        full = move.fill_a(c)
        try:
            sb = c.sandboxes.create(toolkits=[name])
            try:
                assert sb.info.node == "b"
                r = sb.exec(f"wc -c < /opt/{name}/data && cat /bin/busybox | wc -c")
                assert r.exit_code == 0, r
                assert r.stdout.split()[0] == str(3 << 20).encode()
            finally:
                sb.kill()
        finally:
            for x in full:
                x.kill()  # type: ignore[attr-defined]
    # b holds the layers now, checked as a's: the same bytes under the same digest
    for m in (tool, move.base):
        assert move.b_store.get(m.digest).size_bytes == m.size_bytes
    assert move.b_leftovers() == []


def test_a_snapshot_taken_on_a_starts_on_b_with_the_same_files(move: Move) -> None:
    with move.cl.client(protocol="http") as c:
        full = move.fill_a(c)
        src = full[0]
        try:
            payload = secrets.token_hex(64)
            r = src.exec(f"mkdir -p /srv/w && echo {payload} > /srv/w/f && "  # type: ignore[attr-defined]
                         "ln -s f /srv/w/l && rm /bin/true")
            assert r.exit_code == 0, r
            snap = src.snapshot()  # type: ignore[attr-defined]
            assert not move.b_store.has(snap.id)
            sb = c.sandboxes.create(snapshot=snap.id)     # a is full: b, which fetches
            try:
                assert sb.info.node == "b"
                r = sb.exec("cat /srv/w/l; test -e /bin/true && echo still || echo gone")
                assert r.exit_code == 0, r
                assert r.stdout.split() == [payload.encode(), b"gone"]
            finally:
                sb.kill()
        finally:
            for x in full:
                x.kill()  # type: ignore[attr-defined]
    got = move.b_store.get(snap.id)
    assert got.kind == "snapshot" and got.stack
    assert move.b_leftovers() == []


def test_a_corrupted_layer_is_refused_and_leaves_nothing(move: Move) -> None:
    tool = move.toolkit(size=2 << 20)
    path = move.api_store.layer_path(tool)
    with open(path, "r+b") as f:           # the holder's copy rots on its disk
        f.seek(tool.size_bytes // 2)
        byte = f.read(1)
        f.seek(tool.size_bytes // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    try:
        r = move.rest("POST", "/v1/nodes/b/layers", json={"digest": tool.digest})
        assert r.status_code == 400 and r.json()["code"] == "corrupt_layer", r.text
        assert "corrupted or forged" in r.json()["message"]
        assert not move.b_store.has(tool.digest)
        assert not os.path.exists(move.b_store.layer_path(tool))
        assert move.b_leftovers() == []
    finally:
        with open(path, "r+b") as f:
            f.seek(tool.size_bytes // 2)
            f.write(byte)
    with move.cl.client(protocol="aether") as c:       # the SDK over the gateway
        got = c.fetch_layer("b", tool.digest)
    assert got.copied == [tool.digest] and got.bytes == tool.size_bytes
    assert move.b_store.has(tool.digest)


def test_tenants_cannot_fetch_nor_boot_another_projects_snapshot(move: Move) -> None:
    """A project's admin cannot make a node fetch (REST, gateway, SDK alike), nor start
    a sandbox from another project's snapshot by its digest: nothing moves."""
    tool = move.toolkit()
    key = move.cl.create_key("move-tenant", "tenant", "admin")
    body = LayerFetch(node="b", digest=tool.digest)
    r = move.rest("POST", "/v1/nodes/b/layers", key=key, json={"digest": tool.digest})
    assert r.status_code == 403 and "superuser" in r.json()["message"], r.text
    for protocol in ("aether", "http"):
        with Client(move.cl.url, key, gateway=move.cl.gateway, protocol=protocol) as c, \
                pytest.raises(PermissionDenied, match="superuser"):
            c.fetch_layer("b", tool.digest)
        with Client(move.cl.url, key, gateway=move.cl.gateway, protocol=protocol) as c, \
                pytest.raises(PermissionDenied, match="superuser"):
            c.call(ops.LAYER_FETCH, body)
    assert not move.b_store.has(tool.digest)
    with move.cl.client(protocol="http") as c:
        move.toolkit()                    # only on a, which the sandbox goes to
        src = c.sandboxes.create(project="other", toolkits=[f"tool{move._n[0]}"])
        try:
            assert src.info.node == "a"
            src.exec("echo secret > /srv/s")
            snap = src.snapshot()
            with Client(move.cl.url, key, gateway=move.cl.gateway, protocol="aether") as t, \
                    pytest.raises(NotFound):
                t.sandboxes.create(project="tenant", snapshot=snap.id)
        finally:
            src.kill()
    assert not move.b_store.has(snap.id)


def test_kill_9_of_the_receiving_edge_mid_fetch_leaves_no_partial_layer(move: Move) -> None:
    tool = move.toolkit(size=160 << 20)
    b = move.b
    answer: dict[str, httpx.Response] = {}

    def fetch() -> None:
        answer["r"] = move.rest("POST", "/v1/nodes/b/layers", json={"digest": tool.digest})

    t = threading.Thread(target=fetch)
    t.start()
    try:
        deadline = time.monotonic() + TIMEOUT
        while not any(n.endswith(".erofs") for n in move.b_leftovers()):
            assert time.monotonic() < deadline and "r" not in answer, answer
            time.sleep(0.002)
        b.kill9()
        t.join(TIMEOUT)
        assert answer["r"].status_code >= 400, answer["r"].text   # never "done"
        assert any(n.endswith(".erofs") for n in move.b_leftovers())  # the half it left
        assert not move.b_store.has(tool.digest)
    finally:
        if b.proc is not None and b.proc.poll() is not None:
            b.start()
    b.wait_listening()
    assert move.b_leftovers() == []          # reconciled at the edge's start
    move.wait_healthy()
    assert not move.b_store.has(tool.digest)
    # and a fetch after the restart completes
    deadline = time.monotonic() + TIMEOUT
    while True:
        r = move.rest("POST", "/v1/nodes/b/layers", json={"digest": tool.digest})
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)                     # the apiserver's link to b reconnecting
    assert r.status_code == 200, r.text
    assert r.json()["copied"] == [tool.digest]
    with contextlib.suppress(Exception):
        move.b_store.remove(tool.digest)    # 160 MiB: not kept for the next tests

