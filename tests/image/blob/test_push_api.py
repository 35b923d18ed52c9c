"""images.push at every door (REST, the Aether gateway, both SDK transports) against a
real cluster whose operator set --blob-store: the namespace rules of a tag, idempotent,
what lands in the store is what a node reads; and `dsec image push` on the host."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from dsec import Client, LocalCluster
from dsec.errors import Conflict, ImageNotFound, InvalidArgument, NotFound, PermissionDenied
from dsec.image.blob import open_blobstore
from dsec.image.blob.push import read_remote_layer

DOORS = ("aether", "http")


@dataclass
class World:
    cluster: LocalCluster
    blob_url: str
    alice: str              # admin of teama
    bob: str                # member of teamb
    http: httpx.Client

    def client(self, key: str, door: str) -> Client:
        return Client(self.cluster.url, key, gateway=self.cluster.gateway, protocol=door,
                      session_lease_s=None)


def _tree(root: str, files: dict[str, bytes]) -> str:
    for rel, data in files.items():
        p = os.path.join(root, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)
    return root


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    work = tempfile.mkdtemp(prefix="dsec-pushapi-")
    url = f"file://{work}/blobs"
    try:
        with LocalCluster(edges=1, blob_store=url) as cl, \
                httpx.Client(base_url=cl.url, timeout=60) as http:
            yield World(cl, url, cl.create_key("alice", "teama", "admin"),
                        cl.create_key("bob", "teamb", "member"), http)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_push_at_every_door_with_the_namespace_rules(world: World,
                                                     tmp_path: os.PathLike[str]) -> None:
    blob = open_blobstore(world.blob_url)
    with world.client(world.alice, "http") as c:
        v = c.images.build(_tree(os.path.join(str(tmp_path), "t"), {
            "data/x": os.urandom(600_000)}), name="teama/app")
    for i, door in enumerate(DOORS):
        with world.client(world.alice, door) as c:
            res = c.images.push("teama/app")
            assert res.digest == v.digest and res.store == world.blob_url
            assert [p.digest for p in res.layers] == [v.digest]
            assert res.layers[0].uploaded is (i == 0)          # idempotent
            assert res.bytes_uploaded == (v.size_bytes if i == 0 else 0)
            assert c.images.push(v.digest, verify=True).bytes_uploaded == 0
        m, table = read_remote_layer(blob, v.digest)
        assert m.digest == v.digest and table.size == v.size_bytes
        with world.client(world.bob, door) as c, \
                pytest.raises(ImageNotFound):                # bob does not see it
            c.images.push("teama/app")
    # a cluster-wide layer: a superuser's to push
    with world.client(world.cluster.api_key, "http") as root:
        w = root.images.build(_tree(os.path.join(str(tmp_path), "w"), {"a": b"1"}),
                              name="tools")
    for door in DOORS:
        with world.client(world.alice, door) as c, \
                pytest.raises(PermissionDenied, match="superuser"):
            c.images.push("tools")
    with world.client(world.cluster.api_key, "aether") as root:
        assert root.images.push("tools").layers[0].digest == w.digest
    # raw REST: the same rule, the same words; a store URL in the body is not a field
    r = world.http.post("/v1/images/push", json={"ref": "tools"},
                        headers={"authorization": f"Bearer {world.alice}"})
    assert r.status_code == 403 and r.json()["code"] == "permission_denied", r.text
    r = world.http.post("/v1/images/push", json={"ref": "teama/app",
                                                 "store": "http://169.254.169.254/"},
                        headers={"authorization": f"Bearer {world.alice}"})
    assert r.status_code == 400, r.text


def test_no_blob_store_configured_is_a_conflict(world: World) -> None:
    images = world.cluster.runtime.plane.images
    saved, images.blob_store = images.blob_store, None
    try:
        for door in DOORS:
            with world.client(world.cluster.api_key, door) as c, \
                    pytest.raises(Conflict, match="--blob-store"):
                c.images.push(c.images.list()[0].digest)
    finally:
        images.blob_store = saved


def test_cli_push_on_the_host(tmp_path: os.PathLike[str]) -> None:
    from dsec.image import LayerStore

    store = LayerStore(os.path.join(str(tmp_path), "layers"))
    m = store.add_tree(_tree(os.path.join(str(tmp_path), "t"), {"f": os.urandom(5000)}),
                       kind="base", name="thing")
    url = f"file://{tmp_path}/blobs"
    cmd = [sys.executable, "-c", "from dsec.cli.main import main; main()", "image",
           "--root", store.root, "push", "thing", "--blob-store", url, "--json"]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["digest"] == m.digest and res["layers"][0]["uploaded"] is True
    again = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                                      check=True).stdout)
    assert again["bytes_uploaded"] == 0
    bad = subprocess.run([*cmd[:-3], "--blob-store", "ftp://x/y"], check=False,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown scheme" in bad.stderr


def test_pin_at_every_door_superuser_only_and_pushed_first(
        world: World, tmp_path: os.PathLike[str]) -> None:
    with world.client(world.alice, "http") as c:
        v = c.images.build(_tree(os.path.join(str(tmp_path), "p"), {
            "f": os.urandom(10_000)}), name="teama/pinme")
    for door in DOORS:
        with world.client(world.cluster.api_key, door) as root:
            with pytest.raises(InvalidArgument, match="push the image first"):
                root.images.pin("teama/pinme", node="edge-0")
            root.images.push("teama/pinme")
            p = root.images.pin("teama/pinme", node="edge-0")
            assert (p.node, p.image, p.ref, p.layers) == ("edge-0", v.digest,
                                                          "teama/pinme", [v.digest])
            again = root.images.pin("teama/pinme", node="edge-0")       # idempotent
            assert again.pinned_at == p.pinned_at
            assert [x.image for x in root.images.pins("edge-0")] == [v.digest]
            with pytest.raises(NotFound, match="no edge node"):
                root.images.pin("teama/pinme", node="edge-9")
            root.images.unpin(v.digest, node="edge-0")
            assert root.images.pins("edge-0") == []
            with pytest.raises(NotFound, match="not pinned"):
                root.images.unpin(v.digest, node="edge-0")
            # the next door starts from an image that is not in the store
            open_blobstore(world.blob_url).delete(f"layers/sha256/{v.digest[7:]}.manifest")
        with world.client(world.alice, door) as c:               # an admin of teama
            with pytest.raises(PermissionDenied, match="superuser"):
                c.images.pin("teama/pinme", node="edge-0")
            with pytest.raises(PermissionDenied, match="superuser"):
                c.images.pins("edge-0")
    r = world.http.get("/v1/nodes/edge-0/pins",
                       headers={"authorization": f"Bearer {world.alice}"})
    assert r.status_code == 403 and r.json()["code"] == "permission_denied", r.text
    # the pin is a row of the state store: every replica, and a restart, see it
    with world.client(world.cluster.api_key, "http") as root:
        root.images.push("teama/pinme")
        root.images.pin("teama/pinme", node="edge-0")
    rows = world.cluster.runtime.plane.pins_for("edge-0")
    assert [(r.image, r.layers) for r in rows] == [(v.digest, (v.digest,))]
    with world.client(world.cluster.api_key, "http") as root:
        root.images.unpin(v.digest, node="edge-0")


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_pin_rows_in_both_stores(kind: str, request: pytest.FixtureRequest,
                                 tmp_path: os.PathLike[str]) -> None:
    from dsec.control.store import ImagePinRow, open_store

    url = (f"sqlite:///{tmp_path}/s.sqlite" if kind == "sqlite"
           else request.getfixturevalue("pg_dsn"))
    store = open_store(url)
    try:
        a = ImagePinRow(node="n1", image="sha256:" + "a" * 64, ref="x", pinned_at=1.0,
                        layers=("sha256:" + "b" * 64, "sha256:" + "a" * 64), by="root")
        store.put_pin(a)
        store.put_pin(ImagePinRow(node="n1", image=a.image, ref="y", layers=(),
                                  pinned_at=2.0))              # again: the first kept
        store.put_pin(ImagePinRow(node="n2", image=a.image, ref="x", layers=a.layers,
                                  pinned_at=3.0))
        assert store.list_pins("n1") == [a]
        assert [r.node for r in store.list_pins()] == ["n1", "n2"]
        assert store.delete_pin("n1", a.image) and not store.delete_pin("n1", a.image)
        assert store.list_pins("n1") == [] and store.table_rows()["image_pins"] == 1
    finally:
        store.close()
