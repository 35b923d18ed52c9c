"""Cluster administration (join tokens, joined nodes) at every door (issue 16): the
catalogue's ``cluster_*`` rows answer the same through REST, the SDK over HTTP, the SDK
over the Aether gateway and the CLI (``--url``); a superuser's everywhere. A real
cluster (apiserver, gateway, cluster CA, state store of each kind); the joined node is
joined for real through the authority's join (CSR signed, token spent)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from dsec.client.sync import Client
from dsec.cluster.ca import new_node_key
from dsec.cluster.join import join_request
from dsec.cluster.local import LocalCluster
from dsec.errors import NotFound, PermissionDenied

DSEC = [sys.executable, "-c", "from dsec.cli.main import main; main()"]


@pytest.fixture
def cluster(tmp_path: Path, cluster_store: str | None) -> Iterator[LocalCluster]:
    with LocalCluster(edges=1, state_dir=str(tmp_path / "state"), store=cluster_store) as c:
        yield c


def _cli(c: LocalCluster, *args: str) -> str:
    run = subprocess.run([*DSEC, "cluster", *args, "--url", c.url], capture_output=True,
                         text=True, timeout=60, check=False, env={**os.environ, "DSEC_API_KEY": c.api_key})
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_tokens_and_nodes_at_every_door(cluster: LocalCluster) -> None:
    c = cluster
    assert c.gateway is not None
    auth = c.runtime.join_authority
    h = {"authorization": f"Bearer {c.api_key}"}
    with Client(c.url, c.api_key, protocol="http") as sdk, \
            Client(c.url, c.api_key, protocol="aether") as gw:
        # a token made at each door is listed at every door
        made = {
            "rest": httpx.post(f"{c.url}/v1/cluster/tokens", headers=h, timeout=30,
                               json={"ttl_s": 600, "uses": 2, "description": "r"}).json(),
            "sdk": sdk.create_join_token(ttl_s=600, description="s"),
            "gateway": gw.create_join_token(ttl_s=600, description="g"),
        }
        ids = {made["rest"]["id"], made["sdk"].id, made["gateway"].id}
        assert made["sdk"].token and made["gateway"].token and made["rest"]["token"]
        assert made["gateway"].token.split(".")[0] == made["gateway"].id
        cli = _cli(c, "token", "create", "--ttl", "10m", "--description", "c")
        ids.add(cli.strip().split(".")[0])
        listed = [
            {t["id"] for t in httpx.get(f"{c.url}/v1/cluster/tokens", headers=h,
                                        timeout=30).json()["items"]},
            {t.id for t in sdk.join_tokens()}, {t.id for t in gw.join_tokens()},
            {line.split()[0] for line in _cli(c, "token", "list").splitlines()},
        ]
        assert all(got == ids for got in listed), (ids, listed)
        assert all(t.token is None for t in gw.join_tokens())     # the secret: once
        # a node joins with the REST door's token (two uses): it is listed everywhere
        _, csr = new_node_key("far-1")
        auth.join(join_request(made["rest"]["token"], node_id="far-1", csr=csr.decode(),
                               address="tcp:127.0.0.1:7443", nonce=auth.challenge().nonce))
        assert [n.node_id for n in sdk.joined_nodes()] == ["far-1"]
        assert [n.node_id for n in gw.joined_nodes()] == ["far-1"]
        assert '"far-1"' in _cli(c, "node", "list")
        # revoked through the gateway: the store says so at every door
        gw.revoke_joined_node("far-1")
        assert [n.revoked for n in sdk.joined_nodes()] == [True]
        with pytest.raises(NotFound):
            gw.revoke_joined_node("nobody")
        # tokens revoked at each door
        gw.revoke_join_token(made["sdk"].id)
        sdk.revoke_join_token(made["gateway"].id, nodes=True)
        r = httpx.delete(f"{c.url}/v1/cluster/tokens/{made['rest']['id']}",
                         params={"nodes": "false"}, headers=h, timeout=30)
        assert r.status_code == 204, r.text
        _cli(c, "token", "revoke", cli.strip().split(".")[0])
        assert all(t.revoked for t in gw.join_tokens())
        with pytest.raises(NotFound):
            sdk.revoke_join_token("0" * 12)


def test_only_a_superuser_administers_the_cluster_at_every_door(
        cluster: LocalCluster) -> None:
    c = cluster
    r = httpx.post(f"{c.url}/v1/keys", json={"name": "alice", "project": "default",
                                             "role": "admin"},
                   headers={"authorization": f"Bearer {c.api_key}"}, timeout=30)
    assert r.status_code in (200, 201), r.text
    alice = r.json()["api_key"]      # a project admin, not a superuser
    with Client(c.url, alice, protocol="http") as sdk, \
            Client(c.url, alice, protocol="aether") as gw:
        for client in (sdk, gw):
            calls: list[Callable[[], object]] = [
                client.create_join_token, client.join_tokens, client.joined_nodes,
                functools.partial(client.revoke_join_token, "0" * 12),
                functools.partial(client.revoke_joined_node, "far-1")]
            for call in calls:
                with pytest.raises(PermissionDenied):
                    call()
    anon = httpx.get(f"{c.url}/v1/cluster/tokens", timeout=30)
    assert anon.status_code == 401
    r = httpx.post(f"{c.url}/v1/cluster/tokens", json={},
                   headers={"authorization": f"Bearer {alice}"}, timeout=30)
    assert r.status_code == 403, r.text
    assert c.runtime.join_authority.list_tokens() == []
