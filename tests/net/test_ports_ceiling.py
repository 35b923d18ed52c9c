"""A project whose network ceiling is ``none`` (its own or an ancestor's) exposes no
port (red team 14, noticed): refused with PermissionDenied naming the ceiling at every
door of the apiserver (REST, the Aether gateway, the SDK over both transports), and a
URL handed out before the ceiling was narrowed stops working at the proxy route. The
edge reached directly knows no project ceilings: the apiserver is the check.

One in-process cluster on the simulated backend (it records exposed ports; connecting
is the container backend's, tests/net/test_expose.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from dsec import LocalCluster
from dsec.aether import connect
from dsec.client.sync import Client
from dsec.errors import DsecError, PermissionDenied

T = 30.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(edges=1) as cl:
        for path, quota in (("sealed", {"network": {"mode": "none"}}),
                            ("sealed/team", {}),
                            ("later", {"network": {"mode": "open"}})):
            r = httpx.put(f"{cl.url}/v1/quotas/{path}", json=quota, timeout=T,
                          headers={"authorization": f"Bearer {cl.api_key}"})
            assert r.status_code == 200, r.text
        yield cl


def _rest(cl: LocalCluster, key: str, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, f"{cl.url}{path}", timeout=T,
                         headers={"authorization": f"Bearer {key}"}, **kw)


def _gateway(cl: LocalCluster, key: str, method: str, body: Any) -> Any:
    async def run() -> Any:
        assert cl.gateway is not None
        conn = await connect(cl.gateway, token=key)
        try:
            return await conn.call(method, body, timeout=T)
        finally:
            await conn.close()
    return cl._on_loop(run(), timeout=T)


def _create(cl: LocalCluster, key: str, project: str) -> str:
    r = _rest(cl, key, "POST", "/v1/sandboxes", json={"project": project})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


@pytest.mark.parametrize("project", ["sealed", "sealed/team"])
def test_no_door_exposes_a_port_under_a_none_ceiling(cluster: LocalCluster,
                                                     project: str) -> None:
    key = cluster.create_key(f"ports-{project.replace('/', '-')}", project, "member")
    sid = _create(cluster, key, project)
    r = _rest(cluster, key, "POST", f"/v1/sandboxes/{sid}/ports", json={"port": 8000})
    assert r.status_code == 403 and r.json()["code"] == "permission_denied", r.text
    msg = r.json()["message"]
    assert "network ceiling 'none' of project 'sealed'" in msg, msg
    with pytest.raises(DsecError) as gw:
        _gateway(cluster, key, "api.port_expose", {"id": sid, "port": 8000})
    assert gw.value.code == "permission_denied" and gw.value.message == msg
    for transport in ("http", "aether"):
        with (Client(cluster.url, key, gateway=cluster.gateway, protocol=transport) as c,
              pytest.raises(PermissionDenied, match="network ceiling 'none'")):
            c.sandboxes.get(sid).ports.expose(8000)
    listed = _rest(cluster, key, "GET", f"/v1/sandboxes/{sid}/ports")
    assert listed.status_code == 200 and listed.json()["items"] == [], "nothing exposed"


def test_a_url_stops_working_once_the_ceiling_is_narrowed_to_none(
        cluster: LocalCluster) -> None:
    key = cluster.create_key("ports-later", "later", "member")
    sid = _create(cluster, key, "later")
    r = _rest(cluster, key, "POST", f"/v1/sandboxes/{sid}/ports", json={"port": 8000})
    assert r.status_code == 201, r.text
    url = r.json()["url"]
    # exposed under an open ceiling: the URL is honoured (the simulated backend then
    # answers that it has no network namespace: 400, past every check of the apiserver)
    before = httpx.get(f"{cluster.url}{url}" if url.startswith("/") else url, timeout=T)
    assert before.status_code == 400, before.text
    r = _rest(cluster, cluster.api_key, "PUT", "/v1/quotas/later",
              json={"network": {"mode": "none"}})
    assert r.status_code == 200, r.text
    after = httpx.get(f"{cluster.url}{url}" if url.startswith("/") else url, timeout=T)
    assert after.status_code == 403, after.text
    assert "network ceiling 'none' of project 'later'" in after.json()["message"]
    # the member's key at the proxy route: the same
    plain = (f"{cluster.url}{url}" if url.startswith("/") else url).split("?")[0]
    by_key = httpx.get(plain, headers={"authorization": f"Bearer {key}"}, timeout=T)
    assert by_key.status_code == 403, by_key.text
