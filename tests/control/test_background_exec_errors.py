"""A background exec naming a program, user or working directory the sandbox does not
have is the caller's mistake: a 4xx ``cannot_run`` with a short message at every door
(REST, the Aether gateway through the SDK, the edge directly), as the foreground exec of
the same command reports it (exit 127/126), never a 500. Real container sandboxes."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest

from dsec.cluster.local import LocalCluster
from dsec.edge.service import EdgeClient
from dsec.errors import CannotRun
from dsec.wire.spec import ExecRequest

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

MISTAKES = [  # (request fields, what the message names, foreground exit code)
    ({"argv": ["/no/such/program"]}, "execve", 127),
    ({"argv": ["sleep", "1"], "user": "ghost"}, "unknown user 'ghost'", 126),
    ({"argv": ["sleep", "1"], "cwd": "/no/such/dir"}, "chdir /no/such/dir", 126),
]


@pytest.fixture(scope="module")
def cluster(module_cluster_store: str | None) -> Iterator[LocalCluster]:
    with LocalCluster(edges=1, backend="container", store=module_cluster_store) as cl:
        yield cl


@pytest.fixture(scope="module")
def sid(cluster: LocalCluster) -> str:
    r = httpx.post(f"{cluster.url}/v1/sandboxes", json={"backend": "container",
                                                        "memory_bytes": 256 << 20},
                   headers={"authorization": f"Bearer {cluster.api_key}"}, timeout=60)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


@pytest.mark.parametrize("fields,names,code", MISTAKES, ids=["program", "user", "cwd"])
def test_background_exec_mistakes_are_4xx_at_every_door(
        cluster: LocalCluster, sid: str, fields: dict[str, object], names: str,
        code: int) -> None:
    h = {"authorization": f"Bearer {cluster.api_key}"}
    # foreground: a result with the exit code a shell would give
    fg = httpx.post(f"{cluster.url}/v1/sandboxes/{sid}/exec", json=fields, headers=h,
                    timeout=60)
    assert fg.status_code == 200 and fg.json()["exit_code"] == code, fg.text
    # background, REST
    r = httpx.post(f"{cluster.url}/v1/sandboxes/{sid}/exec",
                   json={**fields, "background": True}, headers=h, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["code"] == "cannot_run" and names in err["message"], err
    assert f"exits {code}" in err["message"] and err["detail"]["exit_code"] == code
    assert len(err["message"]) < 500
    # background, Aether gateway (the SDK's default door)
    req = ExecRequest(**{**fields, "argv": tuple(fields["argv"]),  # type: ignore[arg-type]
                         "background": True})
    with cluster.client(protocol="aether", session_lease_s=None) as c:
        sb = c.sandboxes.get(sid)
        with pytest.raises(CannotRun, match=names):
            sb.exec(list(req.argv), background=True, user=req.user, cwd=req.cwd)

    # background, the edge itself
    async def edge() -> str:
        client = await EdgeClient.connect(f"unix:{cluster.state_dir}/edges/edge-0.sock")
        try:
            await client.exec(sid, req)
        except CannotRun as exc:
            return exc.message
        finally:
            await client.close()
        return "no error"
    assert names in cluster._on_loop(edge(), timeout=60)
    # the sandbox is fine afterwards
    ok = httpx.post(f"{cluster.url}/v1/sandboxes/{sid}/exec",
                    json={"argv": ["sleep", "0"], "background": True}, headers=h, timeout=60)
    assert ok.status_code == 200 and ok.json()["pid"] > 1, ok.text
