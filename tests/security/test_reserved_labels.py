"""Labels in dsec's own domains are the platform's: refused on create at every door
(red team 15, F7: a member's ``build.dsec.io/step`` label forged an image build's step
cache entry). Raw REST (single and batch), the raw Aether gateway (single and many) and
the edge reached directly (single and many), each bypassing the SDK's own checks; then
that nothing was made, and that the caller-settable exceptions and ``build_step`` pass."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import msgspec
import pytest

from dsec import LocalCluster
from dsec.aether import connect
from dsec.edge.client import EdgeClient
from dsec.errors import InvalidArgument
from dsec.wire import ops
from dsec.wire.spec import SandboxInfo, SandboxSpec, reserved_label


class _RawCreate(msgspec.Struct, kw_only=True):
    """The wire shapes of the create calls without their constructors' checks (the
    types validate on construction as on decode: a hostile client skips that)."""
    spec: SandboxSpec


class _RawMany(msgspec.Struct, kw_only=True):
    items: list[SandboxSpec]


class _RawManyOnNode(msgspec.Struct, kw_only=True):
    specs: list[SandboxSpec]


FORGED = ["build.dsec.io/step", "build.dsec.io/run", "dsec.io/project", "dsec.io/sandbox",
          "x.dsec.io/anything", "BUILD.DSEC.IO/step", "dsec.io./image"]


def test_reserved_label_is_the_dsec_domains_less_the_caller_settable_ones() -> None:
    assert all(reserved_label(k) for k in FORGED)
    assert not any(reserved_label(k) for k in (
        "dsec.io/session", "dsec.io/build", "dsec.io/build-run", "team", "example.com/x",
        "notdsec.io/x", "dsec.iox/y", "a/dsec.io/b"))


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(edges=1) as cl:
        yield cl


def _count(cluster: LocalCluster) -> int:
    with cluster.client() as c:
        return len(c.sandboxes.list())


@pytest.mark.parametrize("key", ["build.dsec.io/step", "dsec.io/project", "x.dsec.io/a"])
def test_a_reserved_label_is_refused_at_every_door(cluster: LocalCluster, key: str) -> None:
    spec = SandboxSpec(labels={key: "a" * 64}, backend="simulated")  # not validated here
    before = _count(cluster)
    refused: dict[str, str] = {}
    hdr = {"authorization": f"Bearer {cluster.api_key}"}
    body = msgspec.to_builtins(spec)
    r = httpx.post(f"{cluster.url}/v1/sandboxes", json=body, headers=hdr, timeout=60)
    refused["rest"] = f"{r.status_code} {r.text}"
    r = httpx.post(f"{cluster.url}/v1/batch/create", json={"items": [body]}, headers=hdr,
                   timeout=60)
    refused["rest-batch"] = f"{r.status_code} {r.text}"

    async def gateway() -> None:
        assert cluster.gateway is not None
        conn = await connect(cluster.gateway, token=cluster.api_key)
        try:
            for name, op, req in (("gateway", ops.CREATE, _RawCreate(spec=spec)),
                                  ("gateway-many", ops.CREATE_MANY,
                                   _RawMany(items=[spec]))):
                try:
                    got = await conn.call(op.api_method, req, timeout=60)
                    refused[name] = f"answered {got!r}"
                except InvalidArgument as exc:
                    refused[name] = f"400 {exc}"
        finally:
            await conn.close()

    async def edge() -> None:
        async with await EdgeClient.connect(
                f"unix:{cluster.state_dir}/edges/edge-0.sock") as ec:
            spec_p = msgspec.structs.replace(spec, project="default")
            try:
                info: SandboxInfo = await ec._edge(ops.CREATE, _RawCreate(spec=spec_p), 60)
                refused["edge"] = f"answered {info.id}"
            except InvalidArgument as exc:
                refused["edge"] = f"400 {exc}"
            reply = await ec._edge(ops.CREATE_MANY, _RawManyOnNode(specs=[spec_p]), 60)
            [res] = reply.results()
            refused["edge-many"] = (f"400 {res}" if isinstance(res, InvalidArgument)
                                    else f"answered {res!r}")
    cluster._on_loop(gateway(), timeout=60)
    cluster._on_loop(edge(), timeout=60)
    assert set(refused) == {"rest", "rest-batch", "gateway", "gateway-many", "edge",
                            "edge-many"}
    for door, what in refused.items():
        if door in ("rest-batch", "gateway-many"):   # per-item errors in a batch answer
            assert "invalid_argument" in what and "'id'" not in what \
                and '"id"' not in what, (door, what[:300])
            assert key in what, (door, what[:300])
        else:
            assert what.startswith("400"), f"{door} accepted label {key}: {what[:300]}"
            assert key in what, (door, what[:300])
    assert _count(cluster) == before


def test_the_caller_labels_and_build_step_pass(cluster: LocalCluster) -> None:
    with cluster.client() as c:
        sb = c.sandboxes.create(labels={"dsec.io/build": "step", "dsec.io/build-run": "ab",
                                        "team": "x"}, build_step="c" * 64)
        try:
            assert sb.info.spec.build_step == "c" * 64
        finally:
            sb.kill()
        with pytest.raises(InvalidArgument, match="build_step"):
            c.sandboxes.create(build_step="not-a-key")
