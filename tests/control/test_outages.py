"""Errors during outages say what happened, through REST and the Aether gateway alike:

- an edge the apiserver cannot reach is ``503 edge_unreachable`` naming the node (not
  ``no_capacity ... ask for less``), and never the caller's own ``ConnectionLost``;
- an exec whose edge link dropped says whether the command may have run;
- a sandbox its node restarted without is written off (``destroyed``, ``node_lost``,
  ``sandbox_lost`` on use), not "never existed here".
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from dsec.cluster.local import LocalCluster
from dsec.control.api.plane import PlaneConfig
from dsec.errors import ConnectionLost, EdgeUnreachable, SandboxLost, Unavailable
from dsec.wire import ops
from dsec.wire.calls import ExecCall


@pytest.fixture
def cluster(cluster_store: str | None) -> Iterator[LocalCluster]:
    # a long node TTL: the edge stays "healthy but unreachable" for the whole test
    with LocalCluster(edges=1, plane=PlaneConfig(node_ttl_s=600.0), store=cluster_store) as cl:
        yield cl


def _h(cl: LocalCluster) -> dict[str, str]:
    return {"authorization": f"Bearer {cl.api_key}"}


def _create(cl: LocalCluster) -> str:
    r = httpx.post(f"{cl.url}/v1/sandboxes", json={}, headers=_h(cl), timeout=30)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def test_an_unreachable_edge_is_reported_as_such(cluster: LocalCluster) -> None:
    sid = _create(cluster)
    cluster.stop_edge("edge-0")
    # create: 503 edge_unreachable naming the node, not "no capacity, ask for less"
    r = httpx.post(f"{cluster.url}/v1/sandboxes", json={}, headers=_h(cluster), timeout=30)
    assert r.status_code == 503, r.text
    err = r.json()
    assert err["code"] == "edge_unreachable" and "edge-0" in err["message"], err
    assert "ask for less" not in err["message"]
    # exec on its sandbox: the link was down before the call, so it did not run
    r = httpx.post(f"{cluster.url}/v1/sandboxes/{sid}/exec", json={"argv": ["true"]},
                   headers=_h(cluster), timeout=30)
    assert r.status_code == 503 and r.json()["code"] == "edge_unreachable", r.text
    assert r.json()["detail"]["may_have_run"] is False
    assert "was not carried out" in r.json()["message"]
    # the same through the gateway: EdgeUnreachable, not the client's ConnectionLost
    with cluster.client(protocol="aether", session_lease_s=None, create_retry_s=0) as c:
        with pytest.raises(EdgeUnreachable, match="edge-0") as ei:
            c.sandboxes.create()
        assert not isinstance(ei.value, ConnectionLost)
        with pytest.raises(EdgeUnreachable) as ei:   # GET asks the edge
            c.sandboxes.get(sid)
        assert not isinstance(ei.value, ConnectionLost)
        with pytest.raises(EdgeUnreachable) as ei:
            c._run(c._a.call(ops.EXEC, ExecCall(id=sid, req=_req()), timeout=30))
        assert ei.value.detail["may_have_run"] is False
    cluster.start_edge("edge-0")


def _req() -> Any:
    from dsec.wire.spec import ExecRequest
    return ExecRequest(argv=("true",))


def test_no_healthy_node_is_unavailable_not_no_capacity(cluster_store: str | None) -> None:
    with LocalCluster(edges=1, store=cluster_store, plane=PlaneConfig(node_ttl_s=1.0,
                                                 heartbeat_interval_s=0.2)) as cl:
        cl.stop_edge("edge-0")
        deadline = time.monotonic() + 30
        while True:   # until the watcher expired the node
            r = httpx.post(f"{cl.url}/v1/sandboxes", json={}, headers=_h(cl), timeout=30)
            if r.json()["code"] != "edge_unreachable" or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 503 and r.json()["code"] == "unavailable", r.text
        assert "no healthy node" in r.json()["message"]
        with (cl.client(protocol="aether", session_lease_s=None, create_retry_s=0) as c,
              pytest.raises(Unavailable, match="no healthy node")):
            c.sandboxes.create()


@pytest.mark.store_kinds("sqlite")   # the edge link, whatever the store
@pytest.mark.parametrize("door", ["rest", "gateway"])
def test_an_exec_cut_off_by_the_edge_link_may_have_run(cluster: LocalCluster,
                                                      door: str) -> None:
    sid = _create(cluster)
    out: dict[str, Any] = {}

    def run() -> None:
        if door == "rest":
            r = httpx.post(f"{cluster.url}/v1/sandboxes/{sid}/exec",
                           json={"shell": "sleep 20"}, headers=_h(cluster), timeout=60)
            out["status"], out["body"] = r.status_code, r.json()
            return
        with cluster.client(protocol="aether", session_lease_s=None) as c:
            try:
                c.sandboxes.get(sid).exec("sleep 20")
            except BaseException as exc:  # noqa: BLE001 - inspected below
                out["exc"] = exc
    t = threading.Thread(target=run)
    t.start()
    time.sleep(1.0)              # the command is running on the edge now
    cluster.stop_edge("edge-0")
    t.join(60)
    try:
        if door == "rest":
            assert out["status"] == 503 and out["body"]["code"] == "edge_unreachable", out
            assert out["body"]["detail"]["may_have_run"] is True
            assert "the command may have run" in out["body"]["message"]
        else:
            exc = out["exc"]
            assert isinstance(exc, EdgeUnreachable) and not isinstance(exc, ConnectionLost)
            assert exc.detail["may_have_run"] is True and "may have run" in exc.message
    finally:
        cluster.start_edge("edge-0")


def test_a_sandbox_its_node_restarted_without_is_lost_not_unknown(
        cluster: LocalCluster) -> None:
    sid = _create(cluster)
    other = _create(cluster)
    cluster.stop_edge("edge-0")
    # the node comes back without this one (its journal lost it: a crash, a bad disk)
    journal = os.path.join(cluster.state_dir, "edges", "edge-0", "sandboxes.jsonl")
    with open(journal) as f:
        kept = [line for line in f if sid not in line]
    with open(journal, "w") as f:
        f.writelines(kept)
    cluster.start_edge("edge-0")
    deadline = time.monotonic() + 30
    while True:  # 503 edge_unreachable until the apiserver reconnected (its next poll)
        r = httpx.get(f"{cluster.url}/v1/sandboxes/{sid}", headers=_h(cluster), timeout=30)
        if r.status_code != 503 or time.monotonic() > deadline:
            break
        assert r.json()["code"] == "edge_unreachable", r.text
        time.sleep(0.1)
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "destroyed" and r.json()["reason"] == "node_lost", r.json()
    ev = httpx.get(f"{cluster.url}/v1/sandboxes/{sid}/events", headers=_h(cluster)).json()
    assert "restarted without it" in ev["items"][-1]["detail"], ev
    r = httpx.post(f"{cluster.url}/v1/sandboxes/{sid}/exec", json={"argv": ["true"]},
                   headers=_h(cluster), timeout=30)
    assert r.status_code == 409 and r.json()["code"] == "sandbox_lost", r.text
    assert "lost with its node" in r.json()["message"]
    assert "never existed" not in r.text
    with cluster.client(protocol="aether", session_lease_s=None) as c:
        with pytest.raises(SandboxLost, match="lost with its node"):
            c.sandboxes.get(sid).exec("true")
        assert c.sandboxes.get(sid).state == "destroyed"
        # the other sandbox came back with the node and works
        assert c.sandboxes.get(other).exec("echo ok").stdout == b"ok\n"
    assert httpx.delete(f"{cluster.url}/v1/sandboxes/{sid}",
                        headers=_h(cluster)).status_code == 204
    listed = httpx.get(f"{cluster.url}/v1/sandboxes", headers=_h(cluster)).json()["items"]
    assert sid not in {i["id"] for i in listed} and other in {i["id"] for i in listed}
