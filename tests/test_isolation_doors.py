"""``isolation=`` through every door (issue 21): raw REST, the raw Aether gateway, the SDK
(sync over both transports, async, create_many) and the CLI; the sandbox lands on the
node offering the tier's backend, and says its tier in get, list and stats. A tier no
node offers, and a tier that disagrees with the backend named beside it, are refused
with a 400 that says what is offered and what to change.

The cluster: one local edge offering only ``simulated`` (the container tier's stand-in)
and a second edge, ``tier-0``, offering ``simulated`` and a fake ``gvisor`` backend (the
simulated backend registered under that name: what is under test here is the routing,
not gVisor; tests/edge/gvisor/ tests the real one)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
from click.testing import CliRunner

from dsec import LocalCluster
from dsec.aether import connect
from dsec.cli.main import cli
from dsec.client.core import AsyncClient
from dsec.edge.admission import Capacity
from dsec.edge.backends.simulated import NodeLatencyProfile, SimulatedBackend
from dsec.edge.client import EdgeClient
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.edge.service import serve_edge
from dsec.errors import InvalidArgument, QuotaExceeded
from dsec.rl.access import LoopThread
from dsec.wire import ops
from dsec.wire.calls import CreateSandbox
from dsec.wire.spec import SandboxInfo, SandboxSpec

TIER_NODE = "tier-0"


class Tiered:
    def __init__(self, cluster: LocalCluster, edge_address: str) -> None:
        self.cluster = cluster
        self.edge_address = edge_address

    def rest(self, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.cluster.url}/v1/sandboxes", json=body, timeout=60,
                          headers={"authorization": f"Bearer {self.cluster.api_key}"})

    def cli(self, *args: str) -> tuple[int, str]:
        r = CliRunner().invoke(cli, list(args), catch_exceptions=False, env={
            "DSEC_URL": self.cluster.url, "DSEC_API_KEY": self.cluster.api_key})
        return r.exit_code, r.output


@pytest.fixture(scope="module")
def tiered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tiered]:
    sock = os.path.join(str(tmp_path_factory.mktemp("tier")), "tier.sock")
    lt = LoopThread(name="tier-edge")

    async def start() -> tuple[EdgeNode, Any]:
        node = EdgeNode(NodeConfig(node_id=TIER_NODE, capacity=Capacity(
            cpu_milli=64_000, memory_bytes=1 << 40, max_sandboxes=100)), {
            "simulated": SimulatedBackend(profile=NodeLatencyProfile.zero()),
            "gvisor": SimulatedBackend(profile=NodeLatencyProfile.zero())})
        await node.start()
        return node, await serve_edge(node, f"unix:{sock}")

    node, server = lt.run(start(), 30)
    try:
        with LocalCluster(edges=1, remote_edges={TIER_NODE: f"unix:{sock}"}) as cl:
            with cl.client(protocol="http") as c:   # both edges heard from (heartbeats)
                for _ in range(200):
                    if "gvisor" in {b for n in c.nodes() for b in n.backends}:
                        break
                    time.sleep(0.05)
            yield Tiered(cl, f"unix:{sock}")
    finally:
        lt.run(server.close(), 30)
        lt.run(node.close(), 30)
        lt.close()


def _is_gvisor(info: SandboxInfo, door: str) -> None:
    assert (info.node, info.spec.backend, info.spec.isolation) == (
        TIER_NODE, "gvisor", "gvisor"), (door, info)


def test_isolation_reaches_the_tiers_node_through_every_door(tiered: Tiered) -> None:
    cl = tiered.cluster
    r = tiered.rest({"isolation": "gvisor"})
    assert r.status_code == 201, r.text
    _is_gvisor(msgspec.convert(r.json(), SandboxInfo), "rest")

    async def gateway() -> SandboxInfo:
        assert cl.gateway is not None
        conn = await connect(cl.gateway, token=cl.api_key)
        try:
            info: SandboxInfo = await conn.call(
                ops.CREATE.api_method, CreateSandbox(spec=SandboxSpec(isolation="gvisor")),
                response_type=SandboxInfo, timeout=60)
            return info
        finally:
            await conn.close()
    _is_gvisor(cl._on_loop(gateway(), timeout=60), "gateway")

    for transport in ("http", "aether"):
        with cl.client(protocol=transport) as c:
            sb = c.sandboxes.create(isolation="gvisor", detached=True)
            _is_gvisor(sb.info, f"sdk-{transport}")
            assert sb.isolation == "gvisor"
            assert sb.stats().isolation == "gvisor"
            for sb in c.sandboxes.create_many(2, isolation="gvisor", detached=True):
                _is_gvisor(sb.info, f"sdk-many-{transport}")
            [sb] = c.sandboxes.create_many([{"isolation": "gvisor"}], detached=True)
            _is_gvisor(sb.info, f"sdk-many-dict-{transport}")

    async def sdk_async() -> SandboxInfo:
        async with AsyncClient(cl.url, cl.api_key, gateway=cl.gateway,
                               session_lease_s=None) as ac:
            sb = await ac.sandboxes.create(isolation="gvisor")
            assert sb.isolation == "gvisor"
            return (await ac.sandboxes.get(sb.id)).info
    _is_gvisor(cl._on_loop(sdk_async(), timeout=60), "sdk-async")

    code, out = tiered.cli("sandbox", "create", "--isolation", "gvisor", "--json")
    assert code == 0, out
    [made] = json.loads(out)
    _is_gvisor(msgspec.convert(made, SandboxInfo), "cli")
    code, out = tiered.cli("sandbox", "get", made["id"])
    head, row = out.splitlines()[:2]
    assert code == 0 and row.split()[head.split().index("ISOLATION")] == "gvisor", out

    with cl.client(protocol="http") as c:   # listings carry the tier of each
        tiers = {sb.id: sb.isolation for sb in c.sandboxes.list()}
    assert tiers[made["id"]] == "gvisor"
    assert set(tiers.values()) <= {"gvisor", "container"}


def test_the_container_tier_and_no_tier_stay_on_the_default_backend(tiered: Tiered) -> None:
    with tiered.cluster.client(protocol="http") as c:
        for kw in ({"isolation": "container"}, {}):
            sb = c.sandboxes.create(detached=True, **kw)
            assert (sb.info.spec.backend, sb.isolation) == ("simulated", "container"), kw


def test_a_tier_no_node_offers_is_refused_saying_what_is(tiered: Tiered) -> None:
    r = tiered.rest({"isolation": "vm"})
    assert r.status_code == 400, r.text
    msg = r.json()["message"]
    assert "isolation 'vm' (backend 'vm') is not offered by any node" in msg, msg
    assert "gvisor (gvisor)" in msg and "simulated (container)" in msg, msg
    assert "--tiers vm" in msg, msg
    with tiered.cluster.client(protocol="aether") as c, pytest.raises(
            InvalidArgument, match="isolation 'vm'.*not offered"):
        c.sandboxes.create(isolation="vm", detached=True)
    code, out = tiered.cli("sandbox", "create", "--isolation", "vm")
    assert code != 0 and "not offered" in out, out
    code, out = tiered.cli("sandbox", "create", "--isolation", "kvm")
    assert code == 2 and "'kvm' is not one of" in out, out


def test_a_tier_and_a_backend_that_disagree_are_refused_at_every_door(
        tiered: Tiered) -> None:
    r = tiered.rest({"isolation": "gvisor", "backend": "simulated"})
    assert r.status_code == 400, r.text
    assert "that backend gives isolation 'container'" in r.text, r.text
    r = tiered.rest({"isolation": "hypervisor"})   # not a tier: refused by the schema
    assert r.status_code == 400 and "isolation" in r.text, r.text
    with tiered.cluster.client(protocol="aether") as c, pytest.raises(
            InvalidArgument, match="picks backend 'vm'"):
        c.sandboxes.create(isolation="vm", backend="simulated", detached=True)


def test_the_openapi_schema_lists_the_tiers(tiered: Tiered) -> None:
    doc = httpx.get(f"{tiered.cluster.url}/openapi.json", timeout=30).json()
    body = doc["components"]["schemas"]["CreateSandboxRequest"]["properties"]["isolation"]
    assert "container" in json.dumps(body) and "gvisor" in json.dumps(body)
    assert "vm" in json.dumps(body)


def test_a_projects_quota_can_forbid_a_tier(tiered: Tiered) -> None:
    code, out = tiered.cli("quota", "set", "tierq", "--tier", "gvisor=0", "--sandboxes", "10")
    assert code == 0 and "gvisor<=0" in out, out
    with tiered.cluster.client(protocol="aether") as c:
        with pytest.raises(QuotaExceeded, match="'tierq' does not allow isolation tier "
                           "'gvisor'"):
            c.sandboxes.create(isolation="gvisor", project="tierq", detached=True)
        c.sandboxes.create(isolation="container", project="tierq", detached=True)
        code, out = tiered.cli("quota", "set", "tierq", "--tier", "gvisor=none")
        assert code == 0 and "gvisor" not in out, out
        sb = c.sandboxes.create(isolation="gvisor", project="tierq", detached=True)
        assert sb.info.node == TIER_NODE
    code, out = tiered.cli("project", "get", "tierq", "--json")
    assert code == 0 and json.loads(out)["quota"]["max_sandboxes"] == 10, out


def test_an_edge_reached_directly_resolves_and_refuses_tiers_the_same_way(
        tiered: Tiered) -> None:
    async def direct() -> None:
        async with await EdgeClient.connect(tiered.edge_address) as edge:
            info = await edge.create(isolation="gvisor")
            assert (info.spec.backend, info.spec.isolation) == ("gvisor", "gvisor")
            info = await edge.create()          # the node's default backend and its tier
            assert (info.spec.backend, info.spec.isolation) == ("simulated", "container")
            with pytest.raises(InvalidArgument, match=r"isolation 'vm' \(backend 'vm'\) is "
                               "not offered by node tier-0; offered: gvisor \\(gvisor\\)"):
                await edge.create(isolation="vm")
    tiered.cluster._on_loop(direct(), timeout=60)


def test_listings_filter_by_tier_at_every_door(tiered: Tiered) -> None:
    with tiered.cluster.client(protocol="aether") as c:
        g = c.sandboxes.create(isolation="gvisor", labels={"lf": "1"}, detached=True)
        k = c.sandboxes.create(isolation="container", labels={"lf": "1"}, detached=True)
        for transport in ("aether", "http"):
            with tiered.cluster.client(protocol=transport) as t:
                assert [s.id for s in t.sandboxes.list(labels={"lf": "1"},
                                                       isolation="gvisor")] == [g.id]
                assert [s.id for s in t.sandboxes.list(labels={"lf": "1"},
                                                       isolation="container")] == [k.id]
                assert t.sandboxes.list(labels={"lf": "1"}, isolation="vm") == []
    r = httpx.get(f"{tiered.cluster.url}/v1/sandboxes", params={"isolation": "kvm"},
                  headers={"authorization": f"Bearer {tiered.cluster.api_key}"}, timeout=30)
    assert r.status_code == 400 and "isolation" in r.text, r.text
    code, out = tiered.cli("sandbox", "ls", "--isolation", "gvisor", "--label", "lf=1", "-q")
    assert code == 0 and out.split() == [g.id], out
