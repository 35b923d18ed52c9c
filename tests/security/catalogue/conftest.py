"""Red-team fixtures for issue 13 (the operation catalogue): one LocalCluster per module,
tenants with keys of their own, and raw calls through every door (REST as raw HTTP, the
Aether gateway and the edge as raw msgpack bodies), never through a client that would
check the request first."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from dsec.aether import connect

try:
    from dsec.cluster.local import LocalCluster
except ImportError:     # main before i13e moved it (to run these against the old code)
    from dsec.client.local import LocalCluster  # type: ignore[no-redef,import-not-found,unused-ignore]
from dsec.errors import DsecError

__all__ = ["Answer", "Doors", "LocalCluster", "Tenant"]


@dataclass
class Answer:
    door: str
    status: int          # HTTP status, or the DsecError's http_status at an Aether door
    code: str            # "ok" or the error code
    message: str
    value: Any = None


@dataclass
class Tenant:
    name: str
    project: str
    key: str

    @property
    def h(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}


class Doors:
    def __init__(self, cl: LocalCluster) -> None:
        self.cl = cl
        self.admin = Tenant("admin", "default", cl.api_key)

    def tenant(self, name: str, project: str, role: str = "member") -> Tenant:
        r = httpx.post(f"{self.cl.url}/v1/keys", headers=self.admin.h, timeout=60,
                       json={"name": name, "project": project, "role": role})
        assert r.status_code == 201, r.text
        return Tenant(name, project, r.json()["api_key"])

    def rest(self, method: str, path: str, t: Tenant, **kw: Any) -> Answer:
        r = httpx.request(method, f"{self.cl.url}{path}", headers={**t.h, **kw.pop(
            "headers", {})}, timeout=120, **kw)
        if r.status_code >= 400:
            body = r.json()
            return Answer("rest", r.status_code, body.get("code", "?"),
                          body.get("message", ""))
        value = r.json() if r.content and r.headers.get("content-type", "").startswith(
            "application/json") else r.content
        return Answer("rest", r.status_code, "ok", "", value)

    def gateway(self, method: str, body: Any, t: Tenant) -> Answer:
        async def go() -> Answer:
            assert self.cl.gateway is not None
            conn = await connect(self.cl.gateway, token=t.key)
            try:
                v = await conn.call(method, body, response_type=Any, timeout=120)
                return Answer("gateway", 200, "ok", "", v)
            except DsecError as exc:
                return Answer("gateway", exc.http_status, exc.code, exc.message)
            finally:
                await conn.close()
        return self.cl._on_loop(go(), timeout=180)   # type: ignore[no-any-return]

    def edge(self, method: str, body: Any) -> Answer:
        from dsec.edge.client import EdgeClient

        async def go() -> Answer:
            client = await EdgeClient.connect(f"unix:{self.cl.state_dir}/edges/edge-0.sock")
            try:
                v = await client.conn.call(method, body, response_type=Any, timeout=120)
                return Answer("edge", 200, "ok", "", v)
            except DsecError as exc:
                return Answer("edge", exc.http_status, exc.code, exc.message)
            finally:
                await client.close()
        return self.cl._on_loop(go(), timeout=180)   # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(edges=1) as cl:
        yield cl


@pytest.fixture(scope="module")
def doors(cluster: LocalCluster) -> Doors:
    return Doors(cluster)
