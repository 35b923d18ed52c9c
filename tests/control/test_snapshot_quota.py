"""The per-project snapshot storage quota (``snapshot_bytes``): checked against every
ancestor, enforced at both doors (REST and the Aether gateway), usage rises with each
recorded snapshot and falls when one is deleted, a refused snapshot leaves no layer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from dsec import Client, LocalCluster
from dsec.control.api.service import Caller
from dsec.control.quota import Quota, QuotaIndex
from dsec.edge.node import EdgeNode
from dsec.errors import QuotaExceeded
from dsec.wire.api import CreateSandboxRequest, QuotaBody
from tests.control.conftest import Replica, replica, served_edge


def test_snapshot_room_is_the_least_over_the_ancestor_chain() -> None:
    q = QuotaIndex()
    assert q.snapshot_room("org/team") is None
    q.set_quota("org", Quota(snapshot_bytes=1000))
    q.set_quota("org/team", Quota(snapshot_bytes=600))
    assert q.add_snapshot("s1", "org/other", 300)
    assert q.snapshot_room("org/team") == 600
    assert q.add_snapshot("s2", "org/team", 500)
    assert not q.add_snapshot("s2", "org/team", 500)          # charged once
    assert q.snapshot_room("org/team") == 100                 # team: 600 - 500
    assert q.snapshot_room("org/other") == 200                # org: 1000 - 800
    with pytest.raises(QuotaExceeded, match="project 'org' .*snapshot_bytes"):
        q.check_snapshot("org/other", 201)
    assert q.usage("org").snapshot_bytes == 800
    assert q.remove_snapshot("s2") == 500 and q.remove_snapshot("s2") == 0
    assert q.usage("org").snapshot_bytes == 300 and q.snapshot_room("org/team") == 600


@pytest.fixture(scope="module")
def cluster(module_cluster_store: str | None) -> Iterator[LocalCluster]:
    with LocalCluster(edges=1, store=module_cluster_store) as cl:
        yield cl


@pytest.mark.parametrize("door", ["http", "aether"])
def test_snapshot_over_the_project_quota_is_refused_at_every_door(
        cluster: LocalCluster, door: str) -> None:
    project = f"snapq-{door}"
    admin = httpx.Client(base_url=cluster.url,
                         headers={"Authorization": f"Bearer {cluster.api_key}"})
    try:
        r = admin.put(f"/v1/quotas/{project}", json={"snapshot_bytes": 1000})
        assert r.status_code == 200, r.text
        with cluster.client(protocol=door) as c:
            assert isinstance(c, Client)
            sb = c.sandboxes.create(image="base", project=project)
            try:
                sb.exec(f"write /workspace/a {'x' * 600}")
                s1 = sb.snapshot()
                assert s1.size == 600
                view = admin.get(f"/v1/projects/{project}").json()
                assert view["usage"]["snapshot_bytes"] == 600
                assert view["quota"]["snapshot_bytes"] == 1000
                before = [s.id for s in c.snapshots.list(sandbox_id=sb.id)]
                sb.exec(f"write /workspace/b {'y' * 500}")     # the next layer: 1100 > 1000
                with pytest.raises(QuotaExceeded, match="over the limit of 400 bytes"):
                    sb.snapshot()
                assert [s.id for s in c.snapshots.list(sandbox_id=sb.id)] == before
                assert admin.get(f"/v1/projects/{project}").json()["usage"][
                    "snapshot_bytes"] == 600
                c.snapshots.delete(s1.id)                      # usage falls ...
                assert admin.get(f"/v1/projects/{project}").json()["usage"][
                    "snapshot_bytes"] == 0
                sb.exec("rm /workspace/b")
                sb.exec(f"write /workspace/c {'z' * 300}")
                s2 = sb.snapshot()                             # ... and 900 fits again
                assert s2.size == 900 and s2.parent is None    # a full one: s1 is gone
                assert admin.get(f"/v1/projects/{project}").json()["usage"][
                    "snapshot_bytes"] == s2.size
                # a used-up quota refuses before the edge is asked
                admin.put(f"/v1/quotas/{project}", json={"snapshot_bytes": s2.size})
                sb.exec("write /workspace/d z")
                with pytest.raises(QuotaExceeded, match="snapshot_bytes"):
                    sb.snapshot()
            finally:
                sb.kill()
    finally:
        admin.close()


# ------------------------------------------------------------- two apiserver replicas
@pytest.fixture
async def replicas(tmp_path: Path, store_url: str
                   ) -> AsyncIterator[tuple[list[Replica], EdgeNode, str]]:
    """Two apiserver replicas (ControlPlane + ApiService each) over one SQLite store and
    one simulated edge over Aether; project ``default`` has snapshot_bytes=1000, set
    before the second replica opens (so both know the quota itself)."""
    async with served_edge(tmp_path, max_sandboxes=100) as edge:
        node, addr = edge.node, edge.addr
        reps: list[Replica] = []
        key = ""
        try:
            for i in range(2):   # one store file, two connections
                r = await replica(store_url, addr)
                reps.append(r)
                if i == 0:
                    key = r.plane.bootstrap_admin()
                    admin = r.service.authenticate(f"Bearer {key}")
                    r.plane.set_quota(admin, admin.default_project,
                                      QuotaBody(snapshot_bytes=1000))
            yield reps, node, key
        finally:
            for r in reps:
                await r.close()


async def _sandbox_with(r: Replica, caller: Caller, size: int) -> str:
    info = await r.service.create(caller, CreateSandboxRequest())
    await r.service.write_file(caller, info.id, "/workspace/data", b"x" * size, 0o644, False)
    return info.id


async def test_replicas_share_one_snapshot_quota(
        replicas: tuple[list[Replica], EdgeNode, str]) -> None:
    """Each replica's quota index knew only the charges it made itself (and those in the
    store when it opened): two replicas each let a project store a full snapshot_bytes
    quota, and a snapshot deleted through one replica stayed charged on the other."""
    (a, b), _, key = replicas
    ca, cb = (r.service.authenticate(f"Bearer {key}") for r in (a, b))
    project = ca.default_project
    s1 = await a.service.snapshot(ca, await _sandbox_with(a, ca, 600))
    assert s1.size_bytes == 600
    with pytest.raises(QuotaExceeded, match="over the limit of 400 bytes"):   # 600 + 600
        await b.service.snapshot(cb, await _sandbox_with(b, cb, 600))
    assert sum(c.size_bytes for c in a.store.list_snapshot_charges()) == 600
    for r in (a, b):
        assert r.plane.get_project(ca, project).usage["snapshot_bytes"] == 600
    await b.service.delete_snapshot(cb, s1.id)       # the room comes back on both
    for r in (a, b):
        assert r.plane.get_project(ca, project).usage["snapshot_bytes"] == 0
    assert (await a.service.snapshot(ca, await _sandbox_with(a, ca, 900))).size_bytes == 900


async def test_concurrent_snapshots_on_two_replicas_stay_within_the_quota(
        replicas: tuple[list[Replica], EdgeNode, str]) -> None:
    (a, b), _, key = replicas
    ca, cb = (r.service.authenticate(f"Bearer {key}") for r in (a, b))
    x, y = await _sandbox_with(a, ca, 600), await _sandbox_with(b, cb, 600)
    got = await asyncio.gather(a.service.snapshot(ca, x), b.service.snapshot(cb, y),
                               return_exceptions=True)
    assert sorted(type(g).__name__ for g in got) == ["QuotaExceeded", "SnapshotView"], got
    assert sum(c.size_bytes for c in a.store.list_snapshot_charges()) == 600
    views = [g for g in got if not isinstance(g, BaseException)]
    snaps = await a.link.snapshots()
    assert [s.id for s in snaps] == [v.id for v in views]   # the refused one was deleted
