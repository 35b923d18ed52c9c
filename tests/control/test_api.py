"""The REST apiserver against a real in-process cluster (edges over Unix sockets, SQLite)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from dsec.cluster.local import LocalCluster


@pytest.fixture(scope="module")
def cluster(module_cluster_store: str | None) -> Iterator[LocalCluster]:
    with LocalCluster(edges=2, store=module_cluster_store) as cl:
        yield cl


@pytest.fixture(scope="module")
def http(cluster: LocalCluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.url,
                      headers={"authorization": f"Bearer {cluster.api_key}"}) as c:
        yield c


def _count(http: httpx.Client, **params: Any) -> int:
    return len(http.get("/v1/sandboxes", params={"limit": 1000, **params}).json()["items"])


def _on_loop(cluster: LocalCluster, coro: Any) -> Any:
    assert cluster._loop is not None
    return asyncio.run_coroutine_threadsafe(coro, cluster._loop).result(10)


def test_create_get_exec_files_delete(http: httpx.Client) -> None:
    r = http.post("/v1/sandboxes", json={"image": "base", "cpu_milli": 500,
                                         "labels": {"t": "crud"}, "ttl_s": 600})
    assert r.status_code == 201, r.text
    sb = r.json()
    assert sb["state"] == "running" and sb["spec"]["ttl_s"] == 600
    sid = sb["id"]
    assert http.get(f"/v1/sandboxes/{sid}").json()["id"] == sid
    r = http.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["echo", "hi there"]})
    assert r.json()["stdout"] == "hi there\n" and r.json()["exit_code"] == 0
    r = http.post(f"/v1/sandboxes/{sid}/exec", json={"shell": "cat", "stdin": "piped"})
    assert r.json()["stdout"] == "piped"
    blob = bytes(range(256)) * 10
    assert http.put(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/b.bin"},
                    content=blob).status_code == 204
    r = http.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/b.bin"})
    assert r.content == blob and r.headers["content-type"] == "application/octet-stream"
    assert http.get(f"/v1/sandboxes/{sid}/files/stat",
                    params={"path": "/tmp/b.bin"}).json()["size"] == len(blob)
    names = [f["name"] for f in http.get(f"/v1/sandboxes/{sid}/files/list",
                                          params={"path": "/tmp"}).json()["items"]]
    assert names == ["b.bin"]
    assert http.delete(f"/v1/sandboxes/{sid}/files",
                       params={"path": "/tmp/b.bin"}).status_code == 204
    assert http.get(f"/v1/sandboxes/{sid}/files",
                    params={"path": "/tmp/b.bin"}).status_code == 404
    assert http.post(f"/v1/sandboxes/{sid}/pause").status_code == 200
    assert http.get(f"/v1/sandboxes/{sid}").json()["state"] == "paused"
    assert http.post(f"/v1/sandboxes/{sid}/resume").json()["state"] == "running"
    assert http.delete(f"/v1/sandboxes/{sid}").status_code == 204
    assert http.delete(f"/v1/sandboxes/{sid}").status_code == 204  # idempotent
    states = [e["to_state"] for e in http.get(f"/v1/sandboxes/{sid}/events").json()["items"]]
    assert states[-1] == "destroyed" and "paused" in states


def test_exec_stream_is_ndjson_with_a_final_line(http: httpx.Client) -> None:
    sid = http.post("/v1/sandboxes", json={}).json()["id"]
    with http.stream("POST", f"/v1/sandboxes/{sid}/exec/stream",
                     json={"shell": "echo one; echo two; exit 4"}) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(x) for x in r.iter_lines() if x]
    out = "".join(x["data"] for x in lines[:-1] if x.get("stream") == "stdout")
    assert out == "one\ntwo\n"
    assert lines[-1]["exit_code"] == 4 and "stream" not in lines[-1]
    http.delete(f"/v1/sandboxes/{sid}")


def test_list_filters_and_pagination(http: httpx.Client) -> None:
    ids = [http.post("/v1/sandboxes", json={"labels": {"page": "yes"}}).json()["id"]
           for _ in range(7)]
    http.post(f"/v1/sandboxes/{ids[0]}/pause")
    seen: list[str] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"label": "page=yes", "limit": 3}
        if cursor:
            params["cursor"] = cursor
        page = http.get("/v1/sandboxes", params=params).json()
        assert len(page["items"]) <= 3
        seen += [i["id"] for i in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert sorted(seen) == sorted(ids) and len(seen) == len(set(seen))
    paused = http.get("/v1/sandboxes", params={"label": "page=yes", "state": "paused"}).json()
    assert [i["id"] for i in paused["items"]] == [ids[0]]
    assert http.get("/v1/sandboxes", params={"cursor": "garbage!"}).status_code == 400
    for i in ids:
        http.delete(f"/v1/sandboxes/{i}")


def test_list_node_filter_at_every_door(cluster: LocalCluster, http: httpx.Client) -> None:
    """``list`` takes ``node`` (the registry's per-node index; red team 19, A9): REST
    ``?node=``, the SDK over the Aether gateway, paged, and a malformed node is a 400."""
    ids = [http.post("/v1/sandboxes", json={"labels": {"bynode": "yes"}}).json()["id"]
           for _ in range(6)]
    try:
        every = http.get("/v1/sandboxes", params={"label": "bynode=yes",
                                                  "limit": 1000}).json()["items"]
        nodes = {n["id"] for n in http.get("/v1/nodes").json()["items"]}
        assert len(nodes) == 2 and {i["node"] for i in every} <= nodes, nodes
        for node in nodes:
            want = sorted(i["id"] for i in every if i["node"] == node)
            seen: list[str] = []
            cursor = None
            while True:
                params: dict[str, Any] = {"label": "bynode=yes", "node": node, "limit": 1}
                if cursor:
                    params["cursor"] = cursor
                page = http.get("/v1/sandboxes", params=params).json()
                seen += [i["id"] for i in page["items"]]
                assert all(i["node"] == node for i in page["items"])
                cursor = page["next_cursor"]
                if cursor is None:
                    break
            assert seen == want
            with cluster.client(session_lease_s=None) as c:
                got = sorted(s.id for s in c.sandboxes.list(labels={"bynode": "yes"},
                                                            node=node))
            assert got == want
        assert http.get("/v1/sandboxes", params={"node": "nosuch"}).json()["items"] == []
        bad = http.get("/v1/sandboxes", params={"node": "Not A Node!"})
        assert bad.status_code == 400 and "node" in bad.text, bad.text
    finally:
        for i in ids:
            http.delete(f"/v1/sandboxes/{i}")
    gone = http.get("/v1/sandboxes", params={"label": "bynode=yes", "node": every[0]["node"]})
    assert gone.json()["items"] == []          # unindexed with the sandbox


def test_idempotency_key_returns_the_same_sandbox(http: httpx.Client) -> None:
    before = _count(http, label="idem=1")
    body = {"labels": {"idem": "1"}}
    a = http.post("/v1/sandboxes", json=body, headers={"Idempotency-Key": "abc-1"})
    b = http.post("/v1/sandboxes", json=body, headers={"Idempotency-Key": "abc-1"})
    assert a.status_code == b.status_code == 201
    assert a.json()["id"] == b.json()["id"]
    assert _count(http, label="idem=1") == before + 1
    c = http.post("/v1/sandboxes", json={"labels": {"idem": "2"}},
                  headers={"Idempotency-Key": "abc-1"})
    assert c.status_code == 409 and c.json()["code"] == "conflict"
    assert _count(http, label="idem=2") == 0


@pytest.mark.parametrize("body,needle", [
    (b"{not json", "malformed JSON"),
    (b'{"cpu_milli": "lots"}', "$.spec.cpu_milli"),
    (b'{"imagee": "base"}', "unknown field `imagee`"),
    (b'{"memory_bytes": -5}', "memory_bytes"),
    (b'{"backend": "quantum"}', "backend"),
    (b"[]", "Expected `object`"),
    (b"", "empty request body"),
])
def test_bad_create_bodies_are_400_and_create_nothing(http: httpx.Client, body: bytes,
                                                      needle: str) -> None:
    before = _count(http)
    r = http.post("/v1/sandboxes", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["code"] == "invalid_argument" and needle in err["message"]
    assert err["request_id"] and "Traceback" not in r.text
    assert _count(http) == before


def test_huge_bodies_and_huge_argv(http: httpx.Client) -> None:
    before = _count(http)
    r = http.post("/v1/sandboxes", content=b'{"image":"' + b"x" * (5 << 20) + b'"}')
    assert r.status_code == 413 and r.json()["code"] == "payload_too_large"
    sid = http.post("/v1/sandboxes", json={}).json()["id"]
    big = json.dumps({"argv": ["echo", "a" * (17 << 20)]})
    r = http.post(f"/v1/sandboxes/{sid}/exec", content=big)
    assert r.status_code == 413
    r = http.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["echo"] + ["a" * 1000] * 2000})
    assert r.status_code == 400 and "argv+env" in r.json()["message"]
    r = http.post(f"/v1/sandboxes/{sid}/exec", json={"argv": []})
    assert r.status_code == 400
    assert _count(http) == before + 1
    http.delete(f"/v1/sandboxes/{sid}")


def test_auth_and_project_isolation(cluster: LocalCluster, http: httpx.Client) -> None:
    assert httpx.get(f"{cluster.url}/v1/sandboxes").status_code == 401
    r = httpx.get(f"{cluster.url}/v1/sandboxes",
                  headers={"authorization": "Bearer dsk_0000000000000000_" + "a" * 43})
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
    assert httpx.get(f"{cluster.url}/v1/sandboxes",
                     headers={"authorization": "Basic x"}).status_code == 401
    mine = http.post("/v1/sandboxes", json={"project": "default"}).json()["id"]
    other_key = cluster.create_key("mallory", "other", "member")
    reader_key = cluster.create_key("rita", "default", "reader")
    with httpx.Client(base_url=cluster.url,
                      headers={"authorization": f"Bearer {other_key}"}) as mallory:
        for method, path in [("GET", f"/v1/sandboxes/{mine}"),
                             ("POST", f"/v1/sandboxes/{mine}/pause"),
                             ("DELETE", f"/v1/sandboxes/{mine}"),
                             ("GET", f"/v1/sandboxes/{mine}/events")]:
            r = mallory.request(method, path)
            assert r.status_code == 404, (method, path, r.text)
        nonexistent = mine.replace(mine[3:15], "000000000000")
        # "someone else's" reads exactly like "never existed"
        assert (mallory.get(f"/v1/sandboxes/{nonexistent}").json()["message"]
                .replace(nonexistent, "ID")
                == mallory.get(f"/v1/sandboxes/{mine}").json()["message"].replace(mine, "ID"))
        assert mallory.post("/v1/sandboxes", json={"project": "default"}).status_code == 403
        r = mallory.post("/v1/sandboxes", json={})  # default project: its own
        assert r.status_code == 201 and r.json()["spec"]["project"] == "other"
        assert mine not in [i["id"] for i in mallory.get("/v1/sandboxes").json()["items"]]
    with httpx.Client(base_url=cluster.url,
                      headers={"authorization": f"Bearer {reader_key}"}) as rita:
        assert rita.get(f"/v1/sandboxes/{mine}").status_code == 200
        r = rita.post(f"/v1/sandboxes/{mine}/exec", json={"shell": "true"})
        assert r.status_code == 403 and r.json()["code"] == "permission_denied"
        assert rita.put("/v1/quotas/default", json={"max_sandboxes": 1}).status_code == 403
    assert http.get(f"/v1/sandboxes/{mine}").json()["state"] == "running"
    for bogus in ("nope", "sb-zzzzzzzzzzzz-edge-0", "sb-000000000000-edge-9"):
        r = http.get(f"/v1/sandboxes/{bogus}")
        assert r.status_code == 404 and r.json()["code"] == "sandbox_not_found"
    http.delete(f"/v1/sandboxes/{mine}")


def test_quota_is_enforced_before_create(http: httpx.Client) -> None:
    r = http.put("/v1/quotas/team/q", json={"max_sandboxes": 1})
    assert r.status_code == 200 and r.json()["quota"]["max_sandboxes"] == 1
    a = http.post("/v1/sandboxes", json={"project": "team/q"})
    assert a.status_code == 201
    b = http.post("/v1/sandboxes", json={"project": "team/q/sub"})
    assert b.status_code == 429 and b.json()["code"] == "quota_exceeded"
    assert http.get("/v1/projects/team/q").json()["usage"]["sandboxes"] == 1
    assert http.put("/v1/quotas/team/q", json={"max_sandboxez": 1}).status_code == 400
    http.delete(f"/v1/sandboxes/{a.json()['id']}")
    assert http.post("/v1/sandboxes", json={"project": "team/q"}).status_code == 201


def test_resume_is_admitted_by_the_quota_through_every_door(cluster: LocalCluster,
                                                            http: httpx.Client) -> None:
    """Red team 19, B3: pause A, create B in the CPU A gave back; resuming A (REST, the
    Aether gateway through the SDK, a file write or process start that would resume it)
    is refused with 429 naming the project and what to free; the refused resume holds
    nothing (usage unchanged) and A stays paused; once B is gone A resumes."""
    from dsec.errors import QuotaExceeded

    assert http.put("/v1/quotas/team/rq", json={"cpu_milli": 1000}).status_code == 200
    body = {"project": "team/rq", "cpu_milli": 1000}
    a = http.post("/v1/sandboxes", json=body).json()["id"]
    assert http.post(f"/v1/sandboxes/{a}/pause").status_code in (200, 204)
    b = http.post("/v1/sandboxes", json=body).json()["id"]
    r = http.post(f"/v1/sandboxes/{a}/resume")
    assert r.status_code == 429 and r.json()["code"] == "quota_exceeded", r.text
    msg = r.json()["message"]
    assert f"cannot resume sandbox {a}" in msg and "'team/rq'" in msg, msg
    assert "pause or destroy another sandbox" in msg, msg
    for path, req in ((f"/v1/sandboxes/{a}/files?path=/x.txt", "put"),
                      (f"/v1/sandboxes/{a}/files/content?path=/y.txt&size=1", "put"),
                      (f"/v1/sandboxes/{a}/processes", "post")):
        got = (http.put(path, content=b"x") if req == "put"
               else http.post(path, json={"argv": ["sleep", "1"]}))
        assert got.status_code == 429, (path, got.status_code, got.text)
    with cluster.client() as c, pytest.raises(QuotaExceeded, match="cannot resume"):
        c.sandboxes.get(a).resume()
    assert http.get("/v1/projects/team/rq").json()["usage"]["cpu_milli"] == 1000
    assert http.get(f"/v1/sandboxes/{a}").json()["state"] == "paused"
    http.delete(f"/v1/sandboxes/{b}")
    assert http.post(f"/v1/sandboxes/{a}/resume").status_code == 200
    assert http.get("/v1/projects/team/rq").json()["usage"]["cpu_milli"] == 1000
    http.delete(f"/v1/sandboxes/{a}")


def test_ttl_from_create_is_reaped_by_the_edge(http: httpx.Client) -> None:
    sid = http.post("/v1/sandboxes", json={"ttl_s": 0.3, "labels": {"ttl": "1"}}).json()["id"]
    deadline = time.monotonic() + 10
    while http.get(f"/v1/sandboxes/{sid}").json()["state"] != "destroyed":
        assert time.monotonic() < deadline, "TTL never fired"
        time.sleep(0.1)
    assert http.get(f"/v1/sandboxes/{sid}").json()["reason"] == "ttl"
    # The list is served by the control plane's registry: the edge's event feed (read on
    # the next heartbeat poll) removes the reaped sandbox from it, and from quota usage.
    while _count(http, label="ttl=1"):
        assert time.monotonic() < deadline, "the reaped sandbox stayed in the list"
        time.sleep(0.1)


def test_sweeper_destroys_sandboxes_of_a_closed_session(cluster: LocalCluster,
                                                       http: httpx.Client) -> None:
    ses = http.post("/v1/sessions", params={"lease_s": 30}).json()
    kept = http.post("/v1/sandboxes", json={"session": ses["id"]}).json()["id"]
    free = http.post("/v1/sandboxes", json={}).json()["id"]
    plane = cluster.runtime.plane
    assert _on_loop(cluster, plane.sweep()) == []
    assert http.post(f"/v1/sessions/{ses['id']}/renew").status_code == 200
    assert http.delete(f"/v1/sessions/{ses['id']}").status_code == 204
    assert (kept, "session_closed") in _on_loop(cluster, plane.sweep())
    assert http.get(f"/v1/sandboxes/{kept}").json()["state"] == "destroyed"
    assert http.get(f"/v1/sandboxes/{free}").json()["state"] == "running"
    assert http.post("/v1/sessions", params={"lease_s": 1}).status_code == 400
    http.delete(f"/v1/sandboxes/{free}")


def test_nodes_metrics_openapi_healthz(cluster: LocalCluster, http: httpx.Client) -> None:
    nodes = http.get("/v1/nodes").json()["items"]
    assert sorted(n["id"] for n in nodes) == ["edge-0", "edge-1"]
    assert all(n["max_sandboxes"] > 0 for n in nodes)
    assert httpx.get(f"{cluster.url}/healthz").json() == {"status": "ok"}
    text = httpx.get(f"{cluster.url}/metrics").text
    assert 'dsec_api_requests_total{method="GET",route="/v1/sandboxes/{id}",status="200"}' in text
    assert "dsec_sandbox_creations_total" in text and 'dsec_sandboxes{state="running"}' in text
    doc = httpx.get(f"{cluster.url}/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    for p in ("/v1/sandboxes", "/v1/sandboxes/{id}", "/v1/sandboxes/{id}/exec",
              "/v1/sandboxes/{id}/exec/stream", "/v1/sandboxes/{id}/files", "/v1/nodes",
              "/v1/quotas/{path}"):
        assert p in doc["paths"], p
    assert "CreateSandboxRequest" in doc["components"]["schemas"]
    assert http.get("/v1/nope").status_code == 404
    r = http.patch("/v1/sandboxes")
    assert r.status_code == 405 and r.json()["code"] == "method_not_allowed"
    assert r.headers["allow"] == "GET, HEAD, POST"


@pytest.mark.serial  # a token bucket refilled by wall time: beside other tests 8 requests took >0.5 s each and none was refused
def test_rate_limit_answers_429_with_retry_after(cluster_store: str | None) -> None:
    with LocalCluster(edges=1, rate_per_s=2.0, gateway=False, store=cluster_store) as cl:
        h = {"authorization": f"Bearer {cl.api_key}"}
        codes = [httpx.get(f"{cl.url}/v1/sandboxes", headers=h) for _ in range(8)]
        limited = [r for r in codes if r.status_code == 429]
        assert limited, [r.status_code for r in codes]
        assert limited[0].json()["code"] == "rate_limited"
        assert int(limited[0].headers["retry-after"]) >= 1


def test_schemathesis_finds_no_5xx(cluster: LocalCluster) -> None:
    import schemathesis

    schema = schemathesis.openapi.from_url(cluster.url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert len(ops) >= 20
    failures: list[tuple[str, str, int, str]] = []
    auth = {"Authorization": f"Bearer {cluster.api_key}"}
    for op in ops:
        _fuzz_operation(op, cluster.url, auth, failures)
    assert failures == []


def _fuzz_operation(op: Any, url: str, auth: dict[str, str],
                    failures: list[tuple[str, str, int, str]]) -> None:
    """Run a few generated cases of one operation, recording any 5xx reply in `failures`.

    A function of its own so the hypothesis test binds this `op`, not the loop variable."""
    from hypothesis import HealthCheck, Phase, given, settings

    @given(case=op.as_strategy())
    @settings(max_examples=8, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        r = case.call(base_url=url, headers=auth)
        if r.status_code >= 500:
            failures.append((op.method, op.path, r.status_code, r.text[:200]))
    run()


def test_images_build_from_upload_and_list(http: httpx.Client) -> None:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"print('tool')\n"
        info = tarfile.TarInfo("opt/tool.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    r = http.post("/v1/images", params={"name": "mytool", "kind": "toolkit"},
                  content=buf.getvalue())
    assert r.status_code == 201, r.text
    made = r.json()["items"][0]
    assert made["ref"] == "mytool:latest" and made["digest"].startswith("sha256:")
    refs = [i["ref"] for i in http.get("/v1/images").json()["items"]]
    assert "mytool:latest" in refs
    bad = tarfile.TarInfo("../escape")
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w") as tar:
        bad.size = 1
        tar.addfile(bad, io.BytesIO(b"x"))
    r = http.post("/v1/images", params={"name": "evil"}, content=evil.getvalue())
    assert 400 <= r.status_code < 500 and r.json()["code"] in ("unsafe_archive", "image_error",
                                                               "invalid_argument")
    assert http.post("/v1/images", params={"name": "x"}, content=b"").status_code == 400
    assert http.post("/v1/images", content=b"abc").status_code == 400


def test_get_fast_path_matches_the_rest_of_the_api(cluster: LocalCluster,
                                                  http: httpx.Client) -> None:
    """GET /v1/sandboxes/{id} is served by the raw-ASGI fast path: same auth, errors,
    request ids and headers as every other route."""
    sid = http.post("/v1/sandboxes", json={}).json()["id"]
    r = http.get(f"/v1/sandboxes/{sid}", headers={"x-request-id": "trace-7"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-7"
    assert r.headers["content-type"] == "application/json" and r.json()["id"] == sid
    anon = httpx.get(f"{cluster.url}/v1/sandboxes/{sid}")
    assert anon.status_code == 401 and anon.json()["code"] == "unauthenticated"
    assert anon.json()["request_id"] == anon.headers["x-request-id"]
    bad = http.get("/v1/sandboxes/not-an-id")
    assert bad.status_code == 404 and bad.json()["code"] == "sandbox_not_found"
    assert http.get(f"/v1/sandboxes/{sid}/nope").status_code == 404   # falls through
    assert http.head(f"/v1/sandboxes/{sid}").status_code == 200        # Starlette route
    http.delete(f"/v1/sandboxes/{sid}")
