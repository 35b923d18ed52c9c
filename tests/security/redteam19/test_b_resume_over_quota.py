"""Red team B (issue 19, lifetimes/quota): pause-resume cycling runs a project past its
CPU quota.

A paused sandbox holds no CPU quota (``QuotaPolicy.paused_counts_cpu = False``), so a
member pauses sandbox A, creates B in the CPU A gave back, and resumes A: nothing
checks the quota on a resume (``QuotaIndex.check_resume`` exists and is called by no
one; ``ApiService.resume`` only relists). The project then runs 2 cores under a 1-core
quota, and every further pause/create/resume round adds one more. The same hole is in
every door that resumes: REST/gateway ``resume``, an exec/file call on a paused sandbox
(the edge resumes it transparently, the control plane never asked), and E2B's
``connect``.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from dsec.cluster.local import LocalCluster


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(edges=1) as cl:
        yield cl


def test_b_resume_cannot_exceed_the_cpu_quota(cluster: LocalCluster) -> None:
    cl = cluster
    admin = {"authorization": f"Bearer {cl.api_key}"}
    with httpx.Client(base_url=cl.url, timeout=30) as http:
        r = http.put("/v1/quotas/rq", json={"cpu_milli": 1000}, headers=admin)
        assert r.status_code == 200, r.text
        key = cl.create_key("rq-member", "rq", "member")
        h = {"authorization": f"Bearer {key}"}

        def create() -> httpx.Response:
            return http.post("/v1/sandboxes", json={"project": "rq", "image": "base",
                                                    "cpu_milli": 1000}, headers=h)
        a = create()
        assert a.status_code == 201, a.text
        assert create().status_code == 429          # the quota holds: one core
        sa = a.json()["id"]
        assert http.post(f"/v1/sandboxes/{sa}/pause", headers=h).status_code in (200, 204)
        b = create()                                  # A's core, given back by the pause
        assert b.status_code == 201, b.text
        resumed = http.post(f"/v1/sandboxes/{sa}/resume", headers=h)
        usage = http.get("/v1/projects/rq", headers=admin).json()
        running = [s["id"] for s in http.get("/v1/sandboxes", params={"project": "rq"},
                                              headers=h).json()["items"]
                   if s["state"] == "running"]
        assert resumed.status_code == 429, (
            f"resume answered {resumed.status_code}: project rq (cpu quota 1000m) now runs "
            f"{running} = {len(running) * 1000}m; usage {usage}")


def test_b_an_exec_cannot_resume_past_the_cpu_quota(cluster: LocalCluster) -> None:
    """The other door: an exec on a paused sandbox resumes it at the edge (transparent
    resume), which the control plane's quota never sees either."""
    cl = cluster
    admin = {"authorization": f"Bearer {cl.api_key}"}
    with httpx.Client(base_url=cl.url, timeout=30) as http:
        assert http.put("/v1/quotas/rq2", json={"cpu_milli": 1000},
                        headers=admin).status_code == 200
        key = cl.create_key("rq2-member", "rq2", "member")
        h = {"authorization": f"Bearer {key}"}
        body = {"project": "rq2", "image": "base", "cpu_milli": 1000}
        sa = http.post("/v1/sandboxes", json=body, headers=h).json()["id"]
        assert http.post(f"/v1/sandboxes/{sa}/pause", headers=h).status_code in (200, 204)
        assert http.post("/v1/sandboxes", json=body, headers=h).status_code == 201
        r = http.post(f"/v1/sandboxes/{sa}/exec", json={"argv": ["true"]}, headers=h)
        state = http.get(f"/v1/sandboxes/{sa}", headers=h).json()["state"]
        assert r.status_code != 400, r.text                  # the request itself is valid
        assert not (r.status_code == 200 and state == "running"), (
            f"exec on paused {sa} answered {r.status_code} and left it {state}: project "
            "rq2 (cpu quota 1000m) runs two 1000m sandboxes")
