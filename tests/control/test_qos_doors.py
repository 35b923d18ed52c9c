"""A project restricted to best-effort (quota ``qos_ls: false``) gets "be" for a create
naming no class and a refusal for one asking "ls", at every door: raw REST, the raw
Aether gateway, both SDK transports (create and create_many); an edge reached directly
applies its own NodeConfig.qos_be_only. The node reports what its kernel offers QoS
(core scheduling: this VM's kernel lacks it)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from dsec import LocalCluster
from dsec.aether import connect
from dsec.edge.client import EdgeClient
from dsec.edge.qos import core_sched_available
from dsec.errors import PermissionDenied
from dsec.wire import ops
from dsec.wire.calls import CreateSandbox
from dsec.wire.spec import SandboxInfo, SandboxSpec
from tests.edge.conftest import make_node

BE_ONLY = "default/batch"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(edges=1) as cl:
        r = httpx.put(f"{cl.url}/v1/quotas/{BE_ONLY}", json={"qos_ls": False},
                      headers={"authorization": f"Bearer {cl.api_key}"}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["quota"]["qos_ls"] is False
        yield cl


def _rest(cl: LocalCluster, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{cl.url}/v1/sandboxes", json=body, timeout=60,
                      headers={"authorization": f"Bearer {cl.api_key}"})


def test_rest(cluster: LocalCluster) -> None:
    r = _rest(cluster, {"project": BE_ONLY, "qos": "ls"})
    assert r.status_code == 403, r.text
    assert "qos='ls' is refused" in r.text and "qos_ls=false" in r.text
    r = _rest(cluster, {"project": BE_ONLY})
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["qos"] == "be"
    r = _rest(cluster, {"project": BE_ONLY + "/sub", "qos": "be"})   # a subproject: bound
    assert r.status_code == 201 and r.json()["spec"]["qos"] == "be"
    assert _rest(cluster, {"project": BE_ONLY + "/sub", "qos": "ls"}).status_code == 403
    r = _rest(cluster, {"project": "default/free"})                 # elsewhere: ls
    assert r.status_code == 201 and r.json()["spec"]["qos"] == "ls"


def test_gateway(cluster: LocalCluster) -> None:
    async def go(spec: SandboxSpec) -> SandboxInfo:
        assert cluster.gateway is not None
        conn = await connect(cluster.gateway, token=cluster.api_key)
        try:
            info: SandboxInfo = await conn.call(ops.CREATE.api_method, CreateSandbox(spec=spec),
                                                response_type=SandboxInfo, timeout=60)
            return info
        finally:
            await conn.close()
    with pytest.raises(PermissionDenied, match="qos_ls=false"):
        cluster._on_loop(go(SandboxSpec(project=BE_ONLY, qos="ls")), timeout=60)
    assert cluster._on_loop(go(SandboxSpec(project=BE_ONLY)), timeout=60).spec.qos == "be"


@pytest.mark.parametrize("transport", ["http", "aether"])
def test_sdk(cluster: LocalCluster, transport: str) -> None:
    with cluster.client(protocol=transport) as c:
        with pytest.raises(PermissionDenied, match="qos_ls=false"):
            c.sandboxes.create(project=BE_ONLY, qos="ls", detached=True)
        sb = c.sandboxes.create(project=BE_ONLY, detached=True)
        assert sb.info.spec.qos == "be"
        assert c.sandboxes.create(project="default", detached=True).info.spec.qos == "ls"
        with pytest.raises(PermissionDenied, match="qos_ls=false"):
            c.sandboxes.create_many([{"qos": "ls"}], project=BE_ONLY, detached=True)
        [many] = c.sandboxes.create_many(1, project=BE_ONLY, detached=True)
        assert many.info.spec.qos == "be"
        assert sb.stats().qos == "be"


def test_node_info_reports_core_scheduling(cluster: LocalCluster) -> None:
    async def go() -> dict[str, bool]:
        async with await EdgeClient.connect(
                f"unix:{cluster.state_dir}/edges/edge-0.sock") as edge:
            return (await edge.info()).qos
    qos = cluster._on_loop(go(), timeout=60)
    assert qos["core_sched"] is core_sched_available()
    assert set(qos) == {"core_sched", "cpu_idle", "psi", "io_weight"}


async def test_edge_door() -> None:
    node = make_node(qos_be_only=("batch",))
    await node.start()
    try:
        with pytest.raises(PermissionDenied, match="qos='ls' is refused on node n1"):
            await node.create(SandboxSpec(project="batch/x", qos="ls"))
        assert node.list() == [] or all(i.state != "running" for i in node.list())
        assert (await node.create(SandboxSpec(project="batch/x"))).spec.qos == "be"
        assert (await node.create(SandboxSpec(project="other"))).spec.qos == "ls"
    finally:
        await node.close()


def test_cli(cluster: LocalCluster) -> None:
    import json

    from click.testing import CliRunner

    from dsec.cli.main import cli

    env = {"DSEC_URL": cluster.url, "DSEC_API_KEY": cluster.api_key}
    r = CliRunner().invoke(cli, ["sandbox", "create", "--project", BE_ONLY, "--qos", "ls"],
                           env=env)
    assert r.exit_code != 0 and "qos_ls=false" in r.output, r.output
    r = CliRunner().invoke(cli, ["sandbox", "create", "--project", BE_ONLY, "-n", "2",
                                 "--cpu-quota", "1.5", "--json"], env=env)
    assert r.exit_code == 0, r.output
    made = json.loads(r.output)
    assert [m["spec"]["qos"] for m in made] == ["be", "be"]
    assert {m["spec"]["cpu_quota_milli"] for m in made} == {1500}
