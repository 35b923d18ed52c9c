"""Every field of a sandbox spec arrives, whichever door creates the sandbox.

One spec with every field set away from its default goes in through raw REST, the raw
Aether gateway (``api.create``), both SDK transports (``create(spec=...)``, sync and async,
and the create keywords), the RL toolkit's ClientAccess and EdgeAccess, and EdgeClient
straight to the edge; the sandbox each makes reports that very spec. (ClientAccess rebuilt
create keywords from a hand-kept field list and dropped ``user_namespace``: a sandbox asked
to map root inside to an unprivileged host uid got real root instead. It now passes the
spec whole.) A spec that leaves ``backend``/``project``/``ttl_s`` to the server gets the
server's, and nothing else changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from dsec import LocalCluster
from dsec.aether import connect
from dsec.client.core import AsyncClient
from dsec.edge.client import EdgeClient
from dsec.rl.access import ClientAccess, EdgeAccess, LoopThread
from dsec.wire import ops
from dsec.wire.calls import CreateSandbox
from dsec.wire.spec import NetworkPolicy, SandboxInfo, SandboxSpec

SAMPLE = SandboxSpec(
    image="python", workspace="ws:1", toolkits=("tk:1", "tk:2"), backend="simulated",
    isolation="container",  # the simulated backend stands in for the container tier
    cpu_milli=1500, memory_bytes=256 << 20, disk_bytes=1 << 30, pids_max=512, priority=7,
    labels={"team": "rl"}, project="default/sub", ttl_s=3600.0, ttl_action="pause",
    idle_timeout_s=600.0,
    idle_action="pause", env={"E": "1"},
    network=NetworkPolicy(mode="allowlist", allow=("example.com:443",)), allow_nested=True,
    user_namespace=True, cwd="/srv", user="1000:1000", build_step="b" * 64, qos="be",
    cpu_quota_milli=2500)


def test_the_sample_sets_every_field() -> None:
    """A field added to SandboxSpec must be added here (or this fails): that is what keeps
    the round trips below covering every field."""
    def default(f: msgspec.structs.FieldInfo) -> Any:
        return f.default_factory() if f.default is msgspec.NODEFAULT else f.default
    same = [f.name for f in msgspec.structs.fields(SandboxSpec)
            if getattr(SAMPLE, f.name) == default(f)]
    # snapshot: a sandbox from a snapshot takes the snapshot's image (test below)
    assert same == ["snapshot"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(edges=1) as cl:
        yield cl


def _sdk_kwargs(spec: SandboxSpec) -> dict[str, Any]:
    """The SDK's create keywords for ``spec``, written out here (not derived)."""
    return {"image": spec.image, "workspace": spec.workspace, "toolkits": list(spec.toolkits),
            "snapshot": spec.snapshot, "backend": spec.backend, "isolation": spec.isolation,
            "cpu": spec.cpu_milli / 1000,
            "memory": spec.memory_bytes, "disk": spec.disk_bytes, "pids_max": spec.pids_max,
            "priority": spec.priority, "labels": spec.labels, "project": spec.project,
            "ttl": spec.ttl_s, "ttl_action": spec.ttl_action,
            "idle_timeout": spec.idle_timeout_s,
            "idle_action": spec.idle_action, "env": spec.env, "network": spec.network,
            "allow_nested": spec.allow_nested, "user_namespace": spec.user_namespace,
            "cwd": spec.cwd, "user": spec.user, "build_step": spec.build_step,
            "qos": spec.qos, "cpu_quota": None if spec.cpu_quota_milli is None
            else spec.cpu_quota_milli / 1000}


def _edge_address(cluster: LocalCluster) -> str:
    return f"unix:{cluster.state_dir}/edges/edge-0.sock"


def _through_every_door(cluster: LocalCluster, spec: SandboxSpec) -> dict[str, SandboxSpec]:
    got: dict[str, SandboxSpec] = {}
    r = httpx.post(f"{cluster.url}/v1/sandboxes", json=msgspec.to_builtins(spec),
                   headers={"authorization": f"Bearer {cluster.api_key}"}, timeout=60)
    assert r.status_code == 201, r.text
    with cluster.client(protocol="http") as c:
        got["rest"] = c.sandboxes.get(r.json()["id"]).info.spec

    async def gateway() -> SandboxInfo:
        assert cluster.gateway is not None
        conn = await connect(cluster.gateway, token=cluster.api_key)
        try:
            info: SandboxInfo = await conn.call(ops.CREATE.api_method, CreateSandbox(spec=spec),
                                                response_type=SandboxInfo, timeout=60)
            return info
        finally:
            await conn.close()
    got["gateway"] = cluster._on_loop(gateway(), timeout=60).spec
    for transport in ("http", "aether"):
        with cluster.client(protocol=transport) as c:
            sb = c.sandboxes.create(**_sdk_kwargs(spec), detached=True)
            got[f"sdk-keywords-{transport}"] = c.sandboxes.get(sb.id).info.spec
            sb = c.sandboxes.create(spec=spec, detached=True)
            got[f"sdk-spec-{transport}"] = c.sandboxes.get(sb.id).info.spec
            [sb] = c.sandboxes.create_many([spec], detached=True)
            got[f"sdk-many-{transport}"] = c.sandboxes.get(sb.id).info.spec
            access = ClientAccess(c, detached=True)
            sid = access.create(spec)
            got[f"client-access-{transport}"] = c.sandboxes.get(sid).info.spec

        async def sdk_async(transport: str = transport) -> SandboxSpec:
            async with AsyncClient(cluster.url, cluster.api_key, gateway=cluster.gateway,
                                   protocol=transport, session_lease_s=None) as ac:
                sb = await ac.sandboxes.create(spec=spec)
                return (await ac.sandboxes.get(sb.id)).info.spec
        got[f"sdk-async-{transport}"] = cluster._on_loop(sdk_async(), timeout=60)

    async def edge_client() -> SandboxSpec:
        async with await EdgeClient.connect(_edge_address(cluster)) as edge:
            return (await edge.get((await edge.create(spec)).id)).spec
    got["edge-client"] = cluster._on_loop(edge_client(), timeout=60)
    lt = LoopThread(name="spec-doors")
    try:
        edge = lt.run(EdgeClient.connect(_edge_address(cluster)), 60)
        try:
            sid = EdgeAccess({"edge-0": edge}, lt).create(spec)
            got["edge-access"] = lt.run(edge.get(sid), 60).spec
        finally:
            lt.run(edge.close(), 60)
    finally:
        lt.close()
    return got


def test_every_spec_field_arrives_through_every_door(cluster: LocalCluster) -> None:
    got = _through_every_door(cluster, SAMPLE)
    assert set(got) == {"rest", "gateway", "edge-client", "edge-access"} | {
        f"{how}-{t}" for t in ("http", "aether")
        for how in ("sdk-keywords", "sdk-spec", "sdk-many", "sdk-async", "client-access")}
    for door, spec in got.items():
        lost = {f: (getattr(spec, f), getattr(SAMPLE, f)) for f in SandboxSpec.__struct_fields__
                if getattr(spec, f) != getattr(SAMPLE, f)}
        assert not lost, f"{door} changed fields (got, sent): {lost}"


def test_a_spec_from_a_snapshot_arrives_through_every_door(cluster: LocalCluster) -> None:
    with cluster.client(protocol="http") as c:
        snap = c.sandboxes.create(detached=True).snapshot()
    from_snapshot = msgspec.structs.replace(SAMPLE, image="base", workspace=None, toolkits=(),
                                            snapshot=snap.id)
    for door, spec in _through_every_door(cluster, from_snapshot).items():
        assert spec.snapshot == snap.id, door
        assert spec == from_snapshot, door


def test_what_a_spec_leaves_unset_is_the_servers_and_nothing_else_changes(
        cluster: LocalCluster) -> None:
    """backend, project and ttl_s left None: the apiserver's default backend, the key's
    project and the server TTL at the API doors, the node's default backend and the
    "default" project at an edge reached directly; every other field as sent."""
    unset = msgspec.structs.replace(SAMPLE, backend=None, project=None, ttl_s=None)
    got = _through_every_door(cluster, unset)
    for door, spec in got.items():
        if door.startswith("edge"):
            want = msgspec.structs.replace(unset, backend="simulated", project="default")
        else:
            assert spec.ttl_s is not None and spec.ttl_s > 0, door
            want = msgspec.structs.replace(unset, backend="simulated", project="default",
                                           ttl_s=spec.ttl_s)
        assert spec == want, (door, spec)


def test_spec_and_create_keywords_at_once_are_refused(cluster: LocalCluster) -> None:
    from dsec.errors import InvalidArgument
    with cluster.client(protocol="http") as c, pytest.raises(
            InvalidArgument, match="spec= and keywords that set memory_bytes"):
        c.sandboxes.create(spec=SAMPLE, memory="1GiB")
