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

from dsec.cluster.local import LocalCluster
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


def test_project_admin_cannot_mint_a_superuser_key(sim: Tenants) -> None:
    # Was a hole (critical): POST /v1/keys minted a key for any EXISTING principal,
    # including the bootstrap superuser, to the admin of any project.
    r = sim.http.post("/v1/keys", json={"name": "admin", "project": "teamb", "role": "reader"},
                      headers=sim.h(sim.bob))
    assert r.status_code == 403 and r.json()["code"] == "permission_denied", r.text
    assert "dsk_" not in r.text
    # not even another superuser's key: only "admin" itself mints keys for "admin"
    info = sim.http.get("/v1/info", headers=sim.h(sim.bob)).json()
    assert info["principal"] == "bob" and info["role"] == "admin"


def test_project_admin_cannot_impersonate_another_projects_principal(sim: Tenants) -> None:
    # Was a hole (critical): the same path minted alice's key to teamb's admin.
    sid = sim.new_sandbox(sim.alice, "teama")
    r = sim.http.post("/v1/keys", json={"name": "alice", "project": "teamb", "role": "reader"},
                      headers=sim.h(sim.bob))
    assert r.status_code == 409 and r.json()["code"] == "conflict", r.text
    assert "dsk_" not in r.text
    # nothing was granted to alice in teamb either
    roles = sim.http.get("/v1/projects", headers=sim.h(sim.alice)).json()["items"]
    assert "teamb" not in [p["path"] for p in roles]
    got = sim.http.get(f"/v1/sandboxes/{sid}", headers=sim.h(sim.bob))
    assert got.status_code == 404


def test_project_admin_creates_new_principals_only_inside_its_subtree(sim: Tenants) -> None:
    r = sim.http.post("/v1/keys", json={"name": "carol", "project": "teamb/exp1",
                                        "role": "member"}, headers=sim.h(sim.bob))
    assert r.status_code == 201, r.text
    carol = r.json()["api_key"]
    assert sim.http.get("/v1/info", headers=sim.h(carol)).json()["principal"] == "carol"
    sim.new_sandbox(carol, "teamb/exp1")
    for project in ("teama", "teamb-x", "default"):
        r = sim.http.post("/v1/keys", json={"name": f"dave-{project}", "project": project,
                                            "role": "reader"}, headers=sim.h(sim.bob))
        assert r.status_code == 403, (project, r.text)
    # a member is no admin: it creates no principals, not even in its own project
    r = sim.http.post("/v1/keys", json={"name": "erin", "project": "teama", "role": "reader"},
                      headers=sim.h(sim.alice))
    assert r.status_code == 403, r.text
    # and bob cannot hand out a second key for carol (an existing principal) either
    r = sim.http.post("/v1/keys", json={"name": "carol", "project": "teamb/exp1",
                                        "role": "member"}, headers=sim.h(sim.bob))
    assert r.status_code == 409, r.text


def test_a_principal_mints_and_revokes_its_own_keys_only(sim: Tenants) -> None:
    h = sim.h(sim.mallory)
    r = sim.http.post("/v1/keys", json={"name": "mallory", "project": "teamc",
                                        "role": "member"}, headers=h)
    assert r.status_code == 201, r.text
    extra, extra_id = r.json()["api_key"], r.json()["key_id"]
    assert extra.startswith(f"dsk_{extra_id}_")
    assert sim.http.get("/v1/info", headers=sim.h(extra)).json()["principal"] == "mallory"
    # an own extra key grants nothing: no role escalation through it
    r = sim.http.post("/v1/keys", json={"name": "mallory", "project": "teamc", "role": "admin"},
                      headers=h)
    assert r.status_code == 403, r.text
    r = sim.http.post("/v1/keys", json={"name": "mallory", "project": "teama",
                                        "role": "reader"}, headers=h)
    assert r.status_code == 403, r.text
    # someone else's key id answers exactly like a key id that does not exist
    bob_key_id = sim.bob.split("_")[1]
    other = sim.http.delete(f"/v1/keys/{bob_key_id}", headers=h)
    missing = sim.http.delete("/v1/keys/0123456789abcdef", headers=h)
    assert other.status_code == missing.status_code == 404
    assert other.json()["message"].replace(bob_key_id, "X") == \
        missing.json()["message"].replace("0123456789abcdef", "X")
    assert sim.http.get("/v1/info", headers=sim.h(sim.bob)).status_code == 200
    # revoked: stops working at once on this apiserver (its auth cache is told)
    assert sim.http.delete(f"/v1/keys/{extra_id}", headers=h).status_code == 204
    r = sim.http.get("/v1/info", headers=sim.h(extra))
    assert r.status_code == 401 and "revoked" in r.json()["message"], r.text
    assert sim.http.get("/v1/info", headers=h).status_code == 200   # the other key works


def test_superuser_mints_and_revokes_for_others_but_not_for_superusers(sim: Tenants) -> None:
    admin = sim.h(sim.cluster.api_key)
    r = sim.http.post("/v1/keys", json={"name": "mallory", "project": "teamc/sub",
                                        "role": "admin", "existing": True}, headers=admin)
    assert r.status_code == 201, r.text
    key, key_id = r.json()["api_key"], r.json()["key_id"]
    assert sim.http.get("/v1/projects/teamc/sub", headers=sim.h(key)).status_code == 200
    assert sim.http.delete(f"/v1/keys/{key_id}", headers=admin).status_code == 204
    assert sim.http.get("/v1/info", headers=sim.h(key)).status_code == 401
    # the bootstrap superuser may mint its own extra key, and revoke it
    r = sim.http.post("/v1/keys", json={"name": "admin", "project": "default",
                                        "role": "admin"}, headers=admin)
    assert r.status_code == 201, r.text
    assert sim.http.delete(f"/v1/keys/{r.json()['key_id']}", headers=admin).status_code == 204


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


def test_images_do_not_list_other_projects_snapshots(ct: Tenants) -> None:
    # Was a hole: GET /v1/images listed every layer, other projects' snapshots included.
    sid = ct.new_sandbox(ct.alice, "teama")
    snap = ct.http.post(f"/v1/sandboxes/{sid}/snapshot", headers=ct.h(ct.alice)).json()["id"]
    items = ct.http.get("/v1/images", headers=ct.h(ct.mallory)).json()["items"]
    assert snap not in [i["digest"] for i in items]
    assert [i for i in items if i["kind"] == "base"]           # shared layers still listed
    assert not [i for i in items if i["labels"].get("dsec.io/project") == "teama"]
    mine = ct.http.get("/v1/images", headers=ct.h(ct.alice)).json()["items"]
    assert snap in [i["digest"] for i in mine]


def test_other_projects_snapshot_cannot_seed_a_sandbox(ct: Tenants) -> None:
    # Was a hole: a create from ANY snapshot id booted another project's files.
    sid = ct.new_sandbox(ct.alice, "teama")
    r = ct.http.post(f"/v1/sandboxes/{sid}/exec", headers=ct.h(ct.alice),
                     json={"shell": "mkdir -p /workspace && echo 42-secret > /workspace/answer"})
    assert r.json()["exit_code"] == 0, r.text
    snap = ct.http.post(f"/v1/sandboxes/{sid}/snapshot", headers=ct.h(ct.alice)).json()["id"]
    missing = "sha256:" + ("0" if snap[7] != "0" else "1") + snap[8:]
    answers = []
    for ref in (snap, missing, snap[:19]):
        r = ct.http.post("/v1/sandboxes", json={"project": "teamc", "snapshot": ref},
                         headers=ct.h(ct.mallory))
        assert r.status_code == 404 and r.json()["code"] == "image_not_found", r.text
        answers.append(r.json()["message"].replace(ref[:80], "X"))
    assert answers[0] == answers[1] == answers[2], answers
    listed = ct.http.get("/v1/sandboxes", params={"project": "teamc", "limit": 1000},
                         headers=ct.h(ct.mallory)).json()["items"]
    assert not [i for i in listed if i["spec"].get("snapshot")], "nothing was created"
    # the owner still boots it (a reader of teama could too)
    r = ct.http.post("/v1/sandboxes", json={"project": "teama", "snapshot": snap},
                     headers=ct.h(ct.alice))
    assert r.status_code == 201, r.text
    got = ct.http.get(f"/v1/sandboxes/{r.json()['id']}/files",
                      params={"path": "/workspace/answer"}, headers=ct.h(ct.alice))
    assert got.content == b"42-secret\n"


def test_errors_do_not_reveal_host_paths(ct: Tenants) -> None:
    for body in ({"project": "teamc", "image": "no-such-image"},
                 {"project": "teamc", "image": "sha256:0123456789abcdef"},
                 {"project": "teamc", "toolkits": ["nope"]}):
        r = ct.http.post("/v1/sandboxes", json=body, headers=ct.h(ct.mallory))
        assert 400 <= r.status_code < 500, r.text
        assert ct.cluster.state_dir not in r.text, r.text
        assert os.path.realpath(ct.cluster.state_dir) not in r.text, r.text
    assert r.json()["code"] == "image_not_found" and "'nope'" in r.json()["message"], r.text


def test_clients_cannot_opt_out_of_the_fork_bomb_guard(sim: Tenants) -> None:
    # Was a weakness: "pids_max": null gave the sandbox no pids limit at all.
    r = sim.http.post("/v1/sandboxes", json={"project": "teamc", "pids_max": None},
                      headers=sim.h(sim.mallory))
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "invalid_argument" and "16384" in r.json()["message"]
    r = sim.http.post("/v1/sandboxes", json={"project": "teamc", "pids_max": 10**6},
                      headers=sim.h(sim.mallory))
    assert r.status_code == 400, r.text
    r = sim.http.post("/v1/sandboxes", json={"project": "teamc", "pids_max": 16384},
                      headers=sim.h(sim.mallory))
    assert r.status_code == 201 and r.json()["spec"]["pids_max"] == 16384, r.text


def test_session_ids_cannot_be_claimed_or_renewed_by_strangers(sim: Tenants) -> None:
    # Session ids appear in sandbox labels; whoever owns a session decides when its
    # sandboxes are swept. A renew used to re-register an unknown id for the caller.
    r = sim.http.post("/v1/sessions", params={"lease_s": 30}, headers=sim.h(sim.alice))
    assert r.status_code == 201, r.text
    ses = r.json()["id"]
    unknown = "ses-0123456789abcdef"
    for sid in (ses, unknown):
        for method, path in (("POST", f"/v1/sessions/{sid}/renew"),
                             ("DELETE", f"/v1/sessions/{sid}")):
            r = sim.http.request(method, path, headers=sim.h(sim.mallory))
            assert r.status_code == 404, (method, path, r.text)
    # the unknown id was not registered for anyone, not even when its "owner" renews
    assert sim.http.post(f"/v1/sessions/{unknown}/renew",
                         headers=sim.h(sim.alice)).status_code == 404
    assert sim.cluster.runtime.plane.store.get_session(unknown) is None
    row = sim.cluster.runtime.plane.store.get_session(ses)
    assert row is not None and row.principal_id == "alice" and not row.closed
    assert sim.http.post(f"/v1/sessions/{ses}/renew",
                         headers=sim.h(sim.alice)).status_code == 200
    assert sim.http.delete(f"/v1/sessions/{ses}", headers=sim.h(sim.alice)).status_code == 204


def test_metrics_answer_loopback_clients_only_by_default(sim: Tenants) -> None:
    from dsec.control.apiserver import RestConfig, build_app

    rt = sim.cluster.runtime
    app = build_app(rt.service, rt.plane, RestConfig())

    async def scrape(client: tuple[str, int]) -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=client)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as c:
            return await c.get("/metrics")
    assert sim.cluster._on_loop(scrape(("127.0.0.1", 5000))).status_code == 200
    assert sim.cluster._on_loop(scrape(("::1", 5000))).status_code == 200
    far = sim.cluster._on_loop(scrape(("192.0.2.7", 5000)))
    assert far.status_code == 403 and "metrics_token" in far.json()["message"], far.text
    assert "dsec_api_requests_total" not in far.text


def test_failed_auth_is_rate_limited_per_client_address_and_metrics_token() -> None:
    from dsec.control.ratelimit import RateLimitConfig

    with LocalCluster(edges=1, gateway=False, metrics_token="metrics-secret-1",
                      anon_rate=RateLimitConfig(rate_per_s=0.01, burst=6)) as cl:
        admin = {"authorization": f"Bearer {cl.api_key}"}
        with httpx.Client(base_url=cl.url, timeout=30) as http:
            ok = http.get("/metrics", headers={"authorization": "Bearer metrics-secret-1"})
            assert ok.status_code == 200 and "dsec_api_requests_total" in ok.text
            no = http.get("/metrics")
            assert no.status_code == 401 and no.json()["code"] == "unauthenticated"
            assert http.get("/v1/info", headers=admin).status_code == 200   # known good
            fresh = cl.create_key("fresh", "team", "member")                # never used
            guess = {"authorization": "Bearer dsk_0123456789abcdef_" + "A" * 43}
            codes = [http.get("/v1/info", headers=guess).status_code for _ in range(8)]
            assert codes[:5] == [401] * 5 and codes[5:] == [429] * 3, codes
            r = http.get("/v1/info", headers=guess)
            assert r.json()["code"] == "rate_limited" and int(r.headers["retry-after"]) >= 1
            # the raw-ASGI GET fast path and requests without any key are limited too
            assert http.get("/v1/sandboxes/sb-000000000000-edge-0",
                            headers=guess).status_code == 429
            assert http.get("/v1/sandboxes").status_code == 429
            # a key that worked from here before carries on; an unseen one waits, as
            # does a metrics scrape (its failures share the address's budget)
            assert http.get("/v1/info", headers=admin).status_code == 200
            assert http.get("/v1/info",
                            headers={"authorization": f"Bearer {fresh}"}).status_code == 429
            assert http.get("/metrics", headers={
                "authorization": "Bearer metrics-secret-1"}).status_code == 429
