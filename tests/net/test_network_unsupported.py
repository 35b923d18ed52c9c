"""A policy a backend cannot enforce is refused, clearly, before anything is made (plan-14
§8 "backends"): runc sandboxes make their own network namespace off the router's slots,
fncall workers have loopback only. Refused at create and at network_update, through the
backend, the edge door, REST and the Aether gateway; nothing is left (no sandbox, no slot,
no directory, no registry row).

The simulated backend accepts policies on purpose: its sandboxes have no network at all,
so a recorded policy is vacuously held, and the control plane's tests run on it."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from dsec import LocalCluster
from dsec.aether import connect
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.backends.container.backend import network_refusal
from dsec.errors import DsecError, InvalidArgument
from dsec.ids import NodeId, new_sandbox_id
from dsec.net.attach import SandboxNetwork
from dsec.net.router import Router
from dsec.wire.netpolicy import NetworkPolicy
from dsec.wire.spec import SandboxSpec

from ..edge.container.conftest import (
    _cleanup,
    images_dir,  # noqa: F401 - a fixture
)

OPEN = NetworkPolicy(mode="open")
POLICY = NetworkPolicy(mode="policy", allow=("allowed.test:80/tcp",)).validate()


def test_network_refusal_table() -> None:
    assert network_refusal("none", runtime="runc", router=False) is None
    assert network_refusal("open", runtime="native", router=True) is None
    runc = network_refusal("policy", runtime="runc", router=True)
    assert runc is not None and "runtime='runc'" in runc and "network mode 'none'" in runc
    bare = network_refusal("open", runtime="native", router=False)
    assert bare is not None and "--net-uplink" in bare


@pytest.fixture
async def runc_on_router(tmp_path: Any, images_dir: str,  # noqa: F811 - the fixture
                         router: Router) -> AsyncIterator[ContainerBackend]:
    if os.geteuid() != 0 or shutil.which("runc") is None:
        pytest.fail("needs root and runc (make setup installs runc)")
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "rroot"),
                         images=DirectoryImages(images_dir), runtime="runc",
                         network=SandboxNetwork(router))
    try:
        yield b
    finally:
        await _cleanup(b)


async def test_runc_refuses_policies_before_anything_is_made(
        runc_on_router: ContainerBackend, router: Router) -> None:
    b = runc_on_router
    free = router.table.count("free"), router.table.count("assigned")
    for net in (OPEN, POLICY):
        sid = new_sandbox_id(NodeId("t1"))
        with pytest.raises(InvalidArgument, match=r"runtime='runc'") as ei:
            await b.create(sid, SandboxSpec(backend="runc", memory_bytes=128 << 20,
                                            network=net))
        assert ei.value.detail.get("field") == "network"
        assert b.sandbox_ids() == []
        assert not os.path.exists(os.path.join(b.root_dir, "sandboxes", sid))
        assert (router.table.count("free"), router.table.count("assigned")) == free
    # a runc sandbox without a policy runs; asking it for one later is refused too
    sid = new_sandbox_id(NodeId("t1"))
    await b.create(sid, SandboxSpec(backend="runc", memory_bytes=128 << 20))
    spec = SandboxSpec(backend="runc", memory_bytes=128 << 20, network=OPEN)
    with pytest.raises(InvalidArgument, match=r"runtime='runc'"):
        await b.check_network(sid, spec, ())
    with pytest.raises(InvalidArgument, match=r"runtime='runc'"):
        await b.set_network(sid, spec, (), 2)
    assert b.box(sid).spec.net.net_mode == "none"
    assert (router.table.count("free"), router.table.count("assigned")) == free


@pytest.fixture(scope="module")
def fncall_cluster() -> Iterator[LocalCluster]:
    with LocalCluster(edges=1, backend="fncall") as cl:
        yield cl


def _edge(cl: LocalCluster, method: str, body: Any) -> Any:
    async def run() -> Any:
        conn = await connect(f"unix:{cl.state_dir}/edges/edge-0.sock")
        try:
            return await conn.call(method, body, timeout=30)
        finally:
            await conn.close()
    return cl._on_loop(run(), timeout=30)


def _gateway(cl: LocalCluster, method: str, body: Any) -> Any:
    async def run() -> Any:
        assert cl.gateway is not None
        conn = await connect(cl.gateway, token=cl.api_key)
        try:
            return await conn.call(method, body, timeout=30)
        finally:
            await conn.close()
    return cl._on_loop(run(), timeout=30)


def test_fncall_refuses_policies_at_every_door(fncall_cluster: LocalCluster) -> None:
    cl = fncall_cluster
    want = "the fncall backend has no network beyond loopback"
    auth = {"authorization": f"Bearer {cl.api_key}"}
    for net in ({"mode": "open"}, {"mode": "policy", "allow": ["allowed.test:80/tcp"]}):
        r = httpx.post(f"{cl.url}/v1/sandboxes", headers=auth, timeout=30,
                       json={"backend": "fncall", "network": net})
        assert r.status_code == 400 and want in r.json()["message"], r.text
        with pytest.raises(InvalidArgument, match=want):
            _gateway(cl, "api.create", {"spec": {"backend": "fncall", "network": net}})
        with pytest.raises(InvalidArgument, match=want):
            _edge(cl, "edge.create", {"spec": {"backend": "fncall", "network": net}})
    listed = httpx.get(f"{cl.url}/v1/sandboxes", headers=auth, timeout=30).json()
    assert listed["items"] == [], listed  # nothing made, at any door
    # update of a loopback-only fncall sandbox to a policy: refused the same way
    r = httpx.post(f"{cl.url}/v1/sandboxes", headers=auth, timeout=30,
                   json={"backend": "fncall"})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    try:
        u = httpx.put(f"{cl.url}/v1/sandboxes/{sid}/network", headers=auth, timeout=30,
                      json={"mode": "open"})
        upd = "the fncall backend on node edge-0 enforces no network policy but 'none'"
        assert u.status_code == 400 and upd in u.json()["message"], u.text
        with pytest.raises(DsecError, match=upd):
            _gateway(cl, "api.network_update", {"id": sid, "policy": {"mode": "open"}})
        g = httpx.get(f"{cl.url}/v1/sandboxes/{sid}/network", headers=auth, timeout=30)
        assert g.json()["policy"].get("mode", "none") == "none", g.text
    finally:
        httpx.delete(f"{cl.url}/v1/sandboxes/{sid}", headers=auth, timeout=30)


async def test_runc_refuses_policies_at_the_edge_door(runc_on_router: ContainerBackend,
                                                      router: Router, tmp_path: Any) -> None:
    """The same refusal through a node's Aether door (what the apiserver's REST and
    gateway doors reach for a runc node), create and update, word for word."""
    from dsec.edge.node import EdgeNode, NodeConfig
    from dsec.edge.service import serve_edge

    from ..edge.conftest import BIG

    node = EdgeNode(NodeConfig(node_id="n1", capacity=BIG), {"runc": runc_on_router})
    await node.start()
    server = await serve_edge(node, f"unix:{tmp_path}/e.sock")
    conn = await connect(f"unix:{tmp_path}/e.sock")
    try:
        with pytest.raises(InvalidArgument, match=r"runtime='runc'"):
            await conn.call("edge.create", {"spec": {
                "backend": "runc", "memory_bytes": 128 << 20, "network": {"mode": "open"}}},
                timeout=30)
        assert node.list() == [] and runc_on_router.sandbox_ids() == []
        info = await conn.call("edge.create", {"spec": {
            "backend": "runc", "memory_bytes": 128 << 20}}, timeout=30)
        with pytest.raises(InvalidArgument, match=r"runtime='runc'"):
            await conn.call("edge.network_update", {"id": info["id"], "policy": {
                "mode": "policy", "allow": ["allowed.test:80/tcp"]}}, timeout=30)
        assert node.network_get(info["id"]).generation == 1
        assert router.table.count("assigned") == 0
        await conn.call("edge.destroy", {"id": info["id"]}, timeout=30)
    finally:
        await conn.close()
        await server.close()
        await node.close()
