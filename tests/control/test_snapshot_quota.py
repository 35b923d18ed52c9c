"""The per-project snapshot storage quota (``snapshot_bytes``): checked against every
ancestor, enforced at both doors (REST and the Aether gateway), usage rises with each
recorded snapshot and falls when one is deleted, a refused snapshot leaves no layer."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from dsec import Client, LocalCluster
from dsec.control.quota import Quota, QuotaIndex
from dsec.errors import QuotaExceeded


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
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(edges=1) as cl:
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
        with cluster.client(transport=door) as c:
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
