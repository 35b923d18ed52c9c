"""Hostile API clients against a real in-process cluster (apiserver + edges over Unix
sockets + SQLite): another project's ids and snapshots, key minting, odd path params.

Principals: ``alice`` (member of ``teama``) owns the data; ``bob`` administers his own
project ``teamb``; ``mallory`` is a member of ``teamc``. Nobody but the bootstrap
superuser should reach ``teama``'s sandboxes or snapshots.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator

import httpx
import pytest

from dsec.client.local import LocalCluster
from tests.security.conftest import _rmdir_everywhere


class Tenants:
    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.alice = cluster.create_key("alice", "teama", "member")
        self.bob = cluster.create_key("bob", "teamb", "admin")
        self.mallory = cluster.create_key("mallory", "teamc", "member")
        self.http = httpx.Client(base_url=cluster.url, timeout=30)

    def h(self, key: str) -> dict[str, str]:
        return {"authorization": f"Bearer {key}"}

    def new_sandbox(self, key: str, project: str) -> str:
        r = self.http.post("/v1/sandboxes", json={"project": project, "image": "base"},
                           headers=self.h(key))
        assert r.status_code == 201, r.text
        return str(r.json()["id"])


@pytest.fixture(scope="module")
def sim() -> Iterator[Tenants]:
    with LocalCluster(edges=1) as cl:
        t = Tenants(cl)
        try:
            yield t
        finally:
            t.http.close()


@pytest.fixture(scope="module")
def ct() -> Iterator[Tenants]:
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    with LocalCluster(edges=1, backend="container") as cl:
        t = Tenants(cl)
        root_dir = os.path.abspath(os.path.join(cl.state_dir, "container", "edge-0"))
        try:
            yield t
        finally:
            t.http.close()
    # The cluster leaves its edge's (empty) parent cgroups behind; remove them.
    _rmdir_everywhere("dsec-" + hashlib.sha1(root_dir.encode()).hexdigest()[:10])


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="SECURITY HOLE (critical): POST /v1/keys lets the admin "
                   "of ANY project mint a key for an EXISTING principal - including the "
                   "bootstrap superuser 'admin' (plane.py ControlPlane.create_key: "
                   "get_principal() succeeds, then iam.create_key(req.name)); the key is "
                   "superuser everywhere: full cluster takeover")
def test_project_admin_cannot_mint_a_superuser_key(sim: Tenants) -> None:
    r = sim.http.post("/v1/keys", json={"name": "admin", "project": "teamb", "role": "reader"},
                      headers=sim.h(sim.bob))
    if r.status_code != 201:
        return
    stolen = r.json()["api_key"]
    info = sim.http.get("/v1/info", headers=sim.h(stolen)).json()
    assert info["principal"] != "admin" and info.get("role") != "admin", info


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="SECURITY HOLE (critical): the same create_key path "
                   "mints a key for a principal of another project (alice of teama) to the "
                   "admin of teamb, who then acts as alice on teama's sandboxes")
def test_project_admin_cannot_impersonate_another_projects_principal(sim: Tenants) -> None:
    sid = sim.new_sandbox(sim.alice, "teama")
    r = sim.http.post("/v1/keys", json={"name": "alice", "project": "teamb", "role": "reader"},
                      headers=sim.h(sim.bob))
    if r.status_code != 201:
        return
    as_alice = r.json()["api_key"]
    got = sim.http.get(f"/v1/sandboxes/{sid}", headers=sim.h(as_alice))
    assert got.status_code == 404, "bob now reads teama's sandbox as alice"


def test_foreign_sandbox_ids_answer_exactly_like_missing_ones(sim: Tenants) -> None:
    sid = sim.new_sandbox(sim.alice, "teama")
    missing = sid[:3] + ("0" if sid[3] != "0" else "1") + sid[4:]
    me = sim.h(sim.mallory)

    def calls(target: str) -> list[httpx.Response]:
        c = sim.http
        return [
            c.get(f"/v1/sandboxes/{target}", headers=me),
            c.delete(f"/v1/sandboxes/{target}", headers=me),
            c.post(f"/v1/sandboxes/{target}/exec", json={"argv": ["true"]}, headers=me),
            c.post(f"/v1/sandboxes/{target}/exec/stream", json={"argv": ["true"]}, headers=me),
            c.get(f"/v1/sandboxes/{target}/files", params={"path": "/etc/passwd"}, headers=me),
            c.put(f"/v1/sandboxes/{target}/files", params={"path": "/x"}, content=b"x",
                  headers=me),
            c.delete(f"/v1/sandboxes/{target}/files", params={"path": "/x"}, headers=me),
            c.get(f"/v1/sandboxes/{target}/files/list", params={"path": "/"}, headers=me),
            c.get(f"/v1/sandboxes/{target}/files/stat", params={"path": "/"}, headers=me),
            c.post(f"/v1/sandboxes/{target}/files/mkdir", params={"path": "/d"}, headers=me),
            c.post(f"/v1/sandboxes/{target}/pause", headers=me),
            c.post(f"/v1/sandboxes/{target}/resume", headers=me),
            c.post(f"/v1/sandboxes/{target}/snapshot", headers=me),
            c.get(f"/v1/sandboxes/{target}/events", headers=me),
        ]
    for real, fake in zip(calls(sid), calls(missing)):
        assert real.status_code == fake.status_code == 404, (real.request.url, real.text)
        assert real.json()["message"].replace(sid, "X") == fake.json()["message"].replace(
            missing, "X")
    listed = sim.http.get("/v1/sandboxes", params={"limit": 1000}, headers=me).json()["items"]
    assert sid not in [i["id"] for i in listed]
    owner = sim.http.get(f"/v1/sandboxes/{sid}", headers=sim.h(sim.alice)).json()
    assert owner["state"] == "running"  # untouched by all of the above


@pytest.mark.parametrize("raw_id", [
    "..%2F..%2F..%2Fetc%2Fpasswd", "sb-" + "a" * 5000, "%00", "sb-%E2%80%AE-edge-0",
    "sb-000000000000-..%2Fedge-0", "sb-000000000000-edge-0%0d%0aX-Evil:%201",
])
def test_hostile_path_params_get_clean_json_errors(sim: Tenants, raw_id: str) -> None:
    for method, suffix in (("GET", ""), ("POST", "/pause"), ("GET", "/files?path=../../etc/x")):
        r = sim.http.request(method, f"/v1/sandboxes/{raw_id}{suffix}", headers=sim.h(sim.bob))
        assert 400 <= r.status_code < 500, (raw_id, r.status_code, r.text[:200])
        body = r.json()
        assert body["code"] and "Traceback" not in r.text and "x-evil" not in r.headers


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="SECURITY HOLE: GET /v1/images (plane.py list_images) "
                   "lists every layer of the shared layer store to any reader, including "
                   "other projects' snapshot layers with their digests and labels "
                   "(dsec.io/project, dsec.io/sandbox)")
def test_images_do_not_list_other_projects_snapshots(ct: Tenants) -> None:
    sid = ct.new_sandbox(ct.alice, "teama")
    snap = ct.http.post(f"/v1/sandboxes/{sid}/snapshot", headers=ct.h(ct.alice)).json()["id"]
    items = ct.http.get("/v1/images", headers=ct.h(ct.mallory)).json()["items"]
    assert snap not in [i["digest"] for i in items]


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="SECURITY HOLE: a sandbox may be created from ANY "
                   "snapshot id (service.py build_spec passes req.snapshot through; placement "
                   "only checks that a node holds it; no role check on the snapshot's "
                   "project), so another project reads the snapshot's files - e.g. an "
                   "episode's answers")
def test_other_projects_snapshot_cannot_seed_a_sandbox(ct: Tenants) -> None:
    sid = ct.new_sandbox(ct.alice, "teama")
    r = ct.http.post(f"/v1/sandboxes/{sid}/exec", headers=ct.h(ct.alice),
                     json={"shell": "mkdir -p /workspace && echo 42-secret > /workspace/answer"})
    assert r.json()["exit_code"] == 0, r.text
    snap = ct.http.post(f"/v1/sandboxes/{sid}/snapshot", headers=ct.h(ct.alice)).json()["id"]
    r = ct.http.post("/v1/sandboxes", json={"project": "teamc", "snapshot": snap},
                     headers=ct.h(ct.mallory))
    if r.status_code != 201:
        return
    got = ct.http.get(f"/v1/sandboxes/{r.json()['id']}/files",
                      params={"path": "/workspace/answer"}, headers=ct.h(ct.mallory))
    assert b"42-secret" not in got.content, "mallory read teama's snapshot"


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="weakness (info leak): error messages name host paths "
                   "(e.g. image_not_found: 'no image named x:latest in <state_dir>/layers', "
                   "from dsec.image's resolver) to any API client")
def test_errors_do_not_reveal_host_paths(ct: Tenants) -> None:
    r = ct.http.post("/v1/sandboxes", json={"project": "teamc", "image": "no-such-image"},
                     headers=ct.h(ct.mallory))
    assert 400 <= r.status_code < 500
    assert ct.cluster.state_dir not in r.text, r.text


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="weakness (node DoS): a create with \"pids_max\": null is accepted "
                   "(types.py CreateSandboxRequest, spec.py validate) and gives the sandbox no "
                   "pids limit at all; with kernel.pid_max=32768 one fork bomb can take every "
                   "pid on its node. Cap it server-side (quota) instead of letting clients "
                   "opt out")
def test_clients_cannot_opt_out_of_the_fork_bomb_guard(sim: Tenants) -> None:
    r = sim.http.post("/v1/sandboxes", json={"project": "teamc", "pids_max": None},
                      headers=sim.h(sim.mallory))
    assert r.status_code == 400 or r.json()["spec"].get("pids_max") is not None, r.text
