"""Snapshots through the apiserver and the SDK (sync + async, REST + gateway), simulated
edges: routing to the node that holds a snapshot, list/get/delete, InUse, visibility."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dsec import AsyncClient, Client, InUse, LocalCluster
from dsec.client.core import Snapshot
from dsec.errors import ImageNotFound, InvalidArgument, PermissionDenied


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(edges=3) as cl:
        yield cl


@pytest.fixture(params=["http", "aether"])
def client(request: pytest.FixtureRequest, cluster: LocalCluster) -> Iterator[Client]:
    with cluster.client(protocol=request.param) as c:
        yield c


def test_snapshot_chain_and_restore_on_the_holding_node(client: Client) -> None:
    with client.sandboxes.create(image="base", toolkits=["tools"]) as sb:
        sb.exec("write /workspace/a one; mkdir /workspace/d; write /workspace/d/b two")
        s1 = sb.snapshot()
        assert isinstance(s1, Snapshot) and s1.id.startswith("sha256:")
        assert s1.parent is None and s1.size == 6 and s1.created > 0
        assert s1.nodes == [sb.info.node] and s1.sandbox_id == sb.id
        assert s1.view.toolkits == ["tools"] and not s1.unchanged
        again = sb.snapshot()
        assert again == s1 and again.unchanged
        sb.exec("rm /workspace/a; write /workspace/c three; write /workspace/k.pyc x")
        s2 = sb.snapshot(strip=["*.pyc"])
        assert s2.parent == s1.id

        # Three edges, but every create from the snapshot lands where it lives.
        clones = [client.sandboxes.create(snapshot=s2) for _ in range(6)]
        try:
            for cl in clones:
                assert cl.info.node == sb.info.node
                assert cl.files.read("/workspace/c") == b"three"
                assert cl.files.read("/workspace/d/b") == b"two"
                assert not cl.files.exists("/workspace/a")
                assert not cl.files.exists("/workspace/k.pyc")
            by_id = client.sandboxes.create(snapshot=s1.id[:20])  # a unique prefix works
            assert by_id.files.read("/workspace/a") == b"one"
            by_id.kill()

            listed = [s.id for s in client.snapshots.list(sandbox_id=sb.id)]
            assert listed == [s1.id, s2.id]
            assert client.snapshots.get(s2.id).parent == s1.id
            with pytest.raises(InUse, match="in use by sandbox"):
                client.snapshots.delete(s2)
            with pytest.raises(InUse, match="builds on it"):
                client.snapshots.delete(s1.id)
        finally:
            for cl in clones:
                cl.kill()
        client.snapshots.delete(s2)
        client.snapshots.delete(s1)
        assert client.snapshots.list(sandbox_id=sb.id) == []
        with pytest.raises(ImageNotFound):
            client.snapshots.get(s1.id)
        # a deleted snapshot answers like one that never existed (or another project's)
        with pytest.raises(ImageNotFound, match="no snapshot .* visible to this API key"):
            client.sandboxes.create(snapshot=s1)


def test_events_record_the_snapshot(client: Client) -> None:
    with client.sandboxes.create() as sb:
        sb.pause()
        snap = sb.snapshot()
        assert sb.refresh().state == "paused"
        ev = [e for e in sb.events() if e.reason == "snapshot"]
        assert len(ev) == 1 and ev[0].from_state == ev[0].to_state == "paused"
        assert ev[0].detail == snap.id
        client.snapshots.delete(snap)


def test_rest_routes_and_errors(cluster: LocalCluster) -> None:
    h = {"authorization": f"Bearer {cluster.api_key}"}
    with httpx.Client(base_url=cluster.url, headers=h, timeout=30) as http:
        sb = http.post("/v1/sandboxes", json={"image": "base"}).json()
        sid = sb["id"]
        http.post(f"/v1/sandboxes/{sid}/exec", json={"shell": "write /workspace/x 1"})
        r = http.post(f"/v1/sandboxes/{sid}/snapshot", params=[("strip", "*.log")])
        assert r.status_code == 201, r.text
        snap = r.json()
        assert snap["nodes"] == [sb["node"]] and snap.get("parent") is None
        assert http.get(f"/v1/snapshots/{snap['id']}").json()["id"] == snap["id"]
        assert snap["id"] in [s["id"] for s in http.get("/v1/snapshots").json()["items"]]
        r = http.post("/v1/sandboxes", json={"snapshot": snap["id"]})
        assert r.status_code == 201 and r.json()["node"] == sb["node"]
        clone = r.json()["id"]
        r = http.delete(f"/v1/snapshots/{snap['id']}")
        assert r.status_code == 409 and r.json()["code"] == "in_use"
        r = http.post(f"/v1/sandboxes/{sid}/snapshot", params=[("strip", "")])
        assert r.status_code == 400 and "strip pattern" in r.json()["message"]
        assert http.delete(f"/v1/sandboxes/{clone}").status_code == 204
        assert http.delete(f"/v1/snapshots/{snap['id']}").status_code == 204
        assert http.get(f"/v1/snapshots/{snap['id']}").status_code == 404
        assert http.get("/v1/snapshots/latest").status_code == 400
        r = http.post("/v1/sandboxes", json={"snapshot": "sha256:" + "0" * 64})
        assert r.status_code == 404 and r.json()["code"] == "image_not_found"
        assert http.delete(f"/v1/sandboxes/{sid}").status_code == 204


def test_other_projects_cannot_see_or_delete(cluster: LocalCluster) -> None:
    mallory = cluster.create_key("mallory", "elsewhere", "member")
    reader = cluster.create_key("rita", "default", "reader")
    with cluster.client() as c, Client(cluster.url, mallory) as m, \
            Client(cluster.url, reader) as r, c.sandboxes.create() as sb:
        snap = sb.snapshot()
        assert snap.id not in [s.id for s in m.snapshots.list()]
        with pytest.raises(ImageNotFound):
            m.snapshots.get(snap.id)
        with pytest.raises(ImageNotFound):
            m.snapshots.delete(snap.id)
        assert r.snapshots.get(snap.id).id == snap.id
        with pytest.raises(PermissionDenied):
            r.snapshots.delete(snap.id)
        with pytest.raises(PermissionDenied):
            r.sandboxes.get(sb.id).snapshot()
        c.snapshots.delete(snap)


async def test_async_client(cluster: LocalCluster) -> None:
    async with AsyncClient(cluster.url, cluster.api_key) as c:
        sb = await c.sandboxes.create()
        try:
            await sb.exec("write /workspace/f async")
            snap = await sb.snapshot()
            clone = await c.sandboxes.create(snapshot=snap)
            assert await clone.files.read("/workspace/f") == b"async"
            await clone.kill()
            assert [s.id for s in await c.snapshots.list(sandbox_id=sb.id)] == [snap.id]
            await c.snapshots.delete(snap)
            with pytest.raises(InvalidArgument):
                await sb.snapshot(strip="*.pyc")  # type: ignore[arg-type]
        finally:
            await sb.kill()


def test_container_cluster_toolkit_and_snapshot_flow(tmp_path: Path) -> None:
    """The user flow on `dsec up --backend container`: build a toolkit with the CLI into
    the cluster's layer store, start from base + toolkit, change files, snapshot, start
    new sandboxes from the snapshot (two edges share one machine's store)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    from click.testing import CliRunner

    from dsec.cli.main import cli

    tools = tmp_path / "tools"
    (tools / "opt/mytools").mkdir(parents=True)
    (tools / "opt/mytools/hello").write_text("from the toolkit\n")
    with LocalCluster(edges=2, backend="container") as cl:
        r = CliRunner().invoke(cli, ["image", "--root", os.path.join(cl.state_dir, "layers"),
                                     "build", str(tools), "--kind", "toolkit", "--name",
                                     "mytools", "-q"])
        assert r.exit_code == 0, r.output
        with cl.client() as c:
            sb = c.sandboxes.create(image="base", toolkits=["mytools"])
            assert sb.exec("cat /opt/mytools/hello").stdout == b"from the toolkit\n"
            sb.exec("echo mine > /root/x && rm /opt/mytools/hello && ln -s /root/x /root/l")
            snap = sb.snapshot()
            assert snap.view.toolkits == ["mytools"] and snap.parent is None
            clone = c.sandboxes.create(snapshot=snap)
            out = clone.exec("cat /root/l; ls -A /opt/mytools; readlink /root/l").stdout
            assert out == b"mine\n/root/x\n"
            with pytest.raises(InUse):
                c.snapshots.delete(snap)
            clone.kill()
            sb.kill()
            c.snapshots.delete(snap)
            assert snap.id not in [s.id for s in c.snapshots.list()]
