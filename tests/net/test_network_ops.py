"""The network rows through every door (plan-14 §11.4): a sandbox's egress policy set at
create and changed live through REST, the Aether gateway, the SDK over both transports
and the edge; who may read and change it (reader, member, another project's admin); the
project network ceilings of every ancestor binding creates and updates alike, with
their deny entries carried to the edge; the node's own ceiling at the edge door; and
update durable before acknowledged, the same policy twice one change.

One in-process cluster on the simulated backend (the kernel's part, the router's sets,
is N-B's tests/net/test_router.py and test_egress_hostile.py)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from dsec import LocalCluster
from dsec.aether import connect
from dsec.client.sync import Client
from dsec.edge.backends.simulated import SimulatedBackend
from dsec.edge.journal import JOURNAL
from dsec.edge.service import serve_edge
from dsec.errors import (
    BackendError,
    Conflict,
    DsecError,
    InvalidArgument,
    PermissionDenied,
)
from dsec.ids import SandboxId
from dsec.wire import ops
from dsec.wire.calls import NetworkUpdate
from dsec.wire.netpolicy import NetworkPolicy
from dsec.wire.spec import NetworkView, SandboxSpec

from ..edge.conftest import make_node

TIMEOUT = 30.0
PYPI = ("pypi.org:443/tcp", "*.pythonhosted.org:443")


# ==================================================================== the world
class Doors:
    """One cluster and a caller's key: each door as a function of (op, body)."""

    def __init__(self, cl: LocalCluster, key: str) -> None:
        self.cl, self.key = cl, key

    def rest(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(method, f"{self.cl.url}{path}", timeout=TIMEOUT,
                             headers={"authorization": f"Bearer {self.key}"}, **kw)

    def gateway(self, method: str, body: Any) -> Any:
        async def run() -> Any:
            assert self.cl.gateway is not None
            conn = await connect(self.cl.gateway, token=self.key)
            try:
                return await conn.call(method, body, timeout=TIMEOUT)
            finally:
                await conn.close()
        return self.cl._on_loop(run(), timeout=TIMEOUT)

    def refusal(self, door: str, method: str, path: str, json: Any,
                gw: tuple[str, Any]) -> tuple[int, str, str]:
        """(status, code, message) of a request expected to fail, at REST or gateway."""
        if door == "rest":
            r = self.rest(method, path, json=json)
            assert r.status_code >= 400, r.text
            body = r.json()
            return r.status_code, body["code"], body["message"]
        try:
            self.gateway(*gw)
        except DsecError as exc:
            return exc.http_status, exc.code, exc.message
        raise AssertionError(f"the gateway accepted {gw}")


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(edges=1) as cl:
        admin = Doors(cl, cl.api_key)
        # lab: open, minus a range every descendant is denied; lab/team: pypi only
        for path, quota in (
                ("lab", {"network": {"mode": "open", "deny": ["198.51.100.0/24"]}}),
                ("lab/team", {"network": {"mode": "policy", "allow": list(PYPI) + [
                    "203.0.113.0/24"]}})):
            r = admin.rest("PUT", f"/v1/quotas/{path}", json=quota)
            assert r.status_code == 200, r.text
        yield cl


@pytest.fixture(scope="module")
def admin(cluster: LocalCluster) -> Doors:
    return Doors(cluster, cluster.api_key)


@pytest.fixture(scope="module")
def member(cluster: LocalCluster) -> Doors:
    return Doors(cluster, cluster.create_key("net-member", "lab/team", "member"))


def _edge_call(cl: LocalCluster, op: Any, body: Any) -> Any:
    async def run() -> Any:
        conn = await connect(f"unix:{cl.state_dir}/edges/edge-0.sock")
        try:
            return await conn.call(op.edge_method, body, timeout=TIMEOUT,
                                   response_type=op.edge_reply_type)
        finally:
            await conn.close()
    return cl._on_loop(run(), timeout=TIMEOUT)


def _create(d: Doors, network: Any = None, project: str = "default") -> str:
    body: dict[str, Any] = {"project": project}
    if network is not None:
        body["network"] = network
    r = d.rest("POST", "/v1/sandboxes", json=body)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


# ================================================================ create + get
def test_a_create_without_network_gets_the_cluster_default_none(admin: Doors) -> None:
    sid = _create(admin)
    r = admin.rest("GET", f"/v1/sandboxes/{sid}/network")
    assert r.status_code == 200, r.text
    view = msgspec.json.decode(r.content, type=NetworkView)
    assert view.policy == NetworkPolicy() and view.generation == 1
    info = admin.rest("GET", f"/v1/sandboxes/{sid}").json()
    assert info["spec"]["network"] == {}, "stored resolved: mode none"


def test_create_with_each_mode_through_every_door(cluster: LocalCluster, admin: Doors) -> None:
    """REST, the raw gateway, the SDK over both transports and the raw edge: each sandbox
    reads back the canonical policy it was created with."""
    want = {
        "none": NetworkPolicy(),
        "open": NetworkPolicy(mode="open", allow=("10.1.0.0/16:5432/tcp",),
                              deny=("203.0.113.9",)),
        "policy": NetworkPolicy(mode="policy", allow=PYPI + ("[2001:db8::/32]:443/udp",),
                                deny=("files.pythonhosted.org",), max_connections=64),
    }
    raw = {k: msgspec.to_builtins(v) for k, v in want.items()}
    raw["policy"]["allow"] = ["PyPI.org:443/TCP", "*.pythonhosted.org:443", "pypi.org:443/tcp",
                              "[2001:DB8::]/32:443/udp"]                    # not canonical
    made: dict[str, str] = {}
    for mode, policy in want.items():
        made[f"rest-{mode}"] = _create(admin, raw[mode])
        info = admin.gateway("api.create", {"spec": {"network": raw[mode]}})
        made[f"gateway-{mode}"] = info["id"]
        with cluster.client(protocol="http") as c:
            made[f"sdk-http-{mode}"] = c.sandboxes.create(network=policy).id
        with cluster.client(protocol="aether") as c:
            made[f"sdk-aether-{mode}"] = c.sandboxes.create(
                network="none" if mode == "none" else policy).id
        einfo = _edge_call(cluster, ops.CREATE, {"spec": {
            "network": raw[mode], "backend": "simulated", "project": "default"}})
        made[f"edge-{mode}"] = einfo.id
    for name, sid in made.items():
        mode = name.rsplit("-", 1)[1]
        view = msgspec.json.decode(admin.rest("GET", f"/v1/sandboxes/{sid}/network").content,
                                   type=NetworkView)
        assert view.policy == want[mode], name
        assert view.policy.allow == want[mode].allow, f"{name}: canonical, de-duplicated"


async def test_the_sdk_reads_and_updates_over_both_transports(cluster: LocalCluster) -> None:
    for transport in ("http", "aether"):
        async with cluster.async_client(protocol=transport) as c:
            sb = await c.sandboxes.create()
            v0 = await sb.network.get()
            assert v0.policy.net_mode == "none"
            v1 = await sb.network.update(allow=["PyPI.org:443/tcp"])
            assert v1.policy == NetworkPolicy(mode="policy", allow=("pypi.org:443/tcp",))
            assert v1.generation == v0.generation + 1
            again = await sb.network.update(allow=["pypi.org:443/tcp"])
            assert again.generation == v1.generation, "the same policy is no change"
            v2 = await sb.network.update(mode="none")
            assert v2.policy == NetworkPolicy() and v2.generation == v1.generation + 1
            with pytest.raises(Conflict, match="generation"):
                await sb.network.update(allow=["pypi.org"], expect_generation=v1.generation)
            v3 = await sb.network.update("open", expect_generation=v2.generation)
            assert v3.policy.net_mode == "open"
            await sb.kill()
    with cluster.client(protocol="aether") as c:
        sb = c.sandboxes.create()
        assert sb.network.update(allow=["pypi.org"]).policy.allow == ("pypi.org",)
        assert sb.network.get().policy.allow == ("pypi.org",)
        sb.kill()


def test_update_through_rest_gateway_and_edge(cluster: LocalCluster, admin: Doors) -> None:
    sid = _create(admin)
    r = admin.rest("PUT", f"/v1/sandboxes/{sid}/network", json={
        "mode": "policy", "allow": ["Example.COM:443"]})
    assert r.status_code == 200, r.text
    assert r.json()["policy"]["allow"] == ["example.com:443"]
    gen = r.json()["generation"]
    r = admin.rest("PUT", f"/v1/sandboxes/{sid}/network", params={"expect_generation": 1},
                   json={"mode": "none"})
    assert r.status_code == 409 and r.json()["code"] == "conflict", r.text
    got = admin.gateway("api.network_update", {"id": sid, "policy": {"mode": "open"},
                                               "expect_generation": gen})
    assert got["policy"] == {"mode": "open"} and got["generation"] == gen + 1
    view = _edge_call(cluster, ops.NETWORK_UPDATE, {"id": sid, "policy": {"mode": "none"}})
    assert isinstance(view, NetworkView) and view.generation == gen + 2
    assert admin.gateway("api.network_get", {"id": sid})["generation"] == gen + 2


# ================================================================ who may
def test_a_reader_reads_and_may_not_change(cluster: LocalCluster, admin: Doors) -> None:
    sid = _create(admin)
    reader = Doors(cluster, cluster.create_key("net-reader", "default", "reader"))
    assert reader.rest("GET", f"/v1/sandboxes/{sid}/network").status_code == 200
    assert reader.gateway("api.network_get", {"id": sid})["generation"] == 1
    got = {door: reader.refusal(door, "PUT", f"/v1/sandboxes/{sid}/network",
                                {"mode": "open"}, ("api.network_update", {
                                    "id": sid, "policy": {"mode": "open"}}))
           for door in ("rest", "gateway")}
    assert {(s, c) for s, c, _ in got.values()} == {(403, "permission_denied")}, got
    assert len({m for _, _, m in got.values()}) == 1, got
    assert admin.gateway("api.network_get", {"id": sid})["generation"] == 1, "unchanged"


def test_another_projects_admin_sees_no_sandbox(cluster: LocalCluster, admin: Doors) -> None:
    sid = _create(admin)
    stranger = Doors(cluster, cluster.create_key("net-stranger", "elsewhere", "admin"))
    for door in ("rest", "gateway"):
        for method, path, json, gw in (
                ("GET", f"/v1/sandboxes/{sid}/network", None, ("api.network_get",
                                                               {"id": sid})),
                ("PUT", f"/v1/sandboxes/{sid}/network", {"mode": "open"},
                 ("api.network_update", {"id": sid, "policy": {"mode": "open"}}))):
            status, code, _ = stranger.refusal(door, method, path, json, gw)
            assert (status, code) == (404, "sandbox_not_found"), (door, method)
    assert admin.gateway("api.network_get", {"id": sid})["policy"] == {}


# ================================================================ ceilings
def test_a_member_cannot_exceed_the_project_ceiling(member: Doors) -> None:
    """Create and update alike, at REST and the gateway, word for word; checked before
    anything is made (no sandbox appears)."""
    before = len(member.rest("GET", "/v1/sandboxes", params={"project": "lab/team"}
                             ).json()["items"])
    beyond = {"mode": "policy", "allow": ["pypi.org:443/tcp", "github.com:443/tcp"]}
    got = {door: member.refusal(door, "POST", "/v1/sandboxes",
                                {"project": "lab/team", "network": beyond},
                                ("api.create", {"spec": {"project": "lab/team",
                                                         "network": beyond}}))
           for door in ("rest", "gateway")}
    msgs = {m for _, _, m in got.values()}
    assert {(s, c) for s, c, _ in got.values()} == {(403, "permission_denied")}, got
    assert len(msgs) == 1, got
    msg = msgs.pop()
    assert msg.startswith("network.allow[1] 'github.com:443/tcp' is outside the network "
                          "ceiling of project 'lab/team'"), msg
    with (pytest.raises(PermissionDenied, match=r"network\.allow\[1\] 'github.com:443/tcp'"),
          Client(member.cl.url, member.key, gateway=member.cl.gateway,
                 protocol="aether") as c):
        c.sandboxes.create(project="lab/team", network=NetworkPolicy(**beyond))
    after = len(member.rest("GET", "/v1/sandboxes", params={"project": "lab/team"}
                            ).json()["items"])
    assert after == before, "a refused create made nothing"
    # within it: made; then an update beyond it is refused at both doors alike
    sid = _create(member, {"mode": "policy", "allow": ["pypi.org:443/tcp"]}, "lab/team")
    got = {door: member.refusal(door, "PUT", f"/v1/sandboxes/{sid}/network", {"mode": "open"},
                                ("api.network_update", {"id": sid, "policy": {"mode": "open"}}))
           for door in ("rest", "gateway")}
    assert {(s, c) for s, c, _ in got.values()} == {(403, "permission_denied")}, got
    assert len({m for _, _, m in got.values()}) == 1
    assert "policy.mode 'open' is outside the network ceiling of project 'lab/team'" in \
        next(iter(got.values()))[2]
    ok = member.rest("PUT", f"/v1/sandboxes/{sid}/network",
                     json={"mode": "policy", "allow": ["files.pythonhosted.org:443/tcp",
                                                       "203.0.113.7:8080"]})
    assert ok.status_code == 200, ok.text


def test_the_ceiling_deny_of_an_ancestor_reaches_the_edge(cluster: LocalCluster,
                                                          member: Doors) -> None:
    sid = _create(member, {"mode": "policy", "allow": ["203.0.113.0/25"]}, "lab/team")
    view = member.gateway("api.network_get", {"id": sid})
    assert view["ceiling_deny"] == ["198.51.100.0/24"], "lab's deny, added under lab/team"
    up = member.gateway("api.network_update", {"id": sid, "policy": {"mode": "none"}})
    assert up["ceiling_deny"] == ["198.51.100.0/24"]


def test_an_ancestor_ceiling_binds_under_a_wider_own_one(cluster: LocalCluster,
                                                         admin: Doors) -> None:
    """lab/open has an open ceiling of its own, but lab's (open, without private ranges)
    still binds it; and only an admin of the parent may set a project's ceiling."""
    r = admin.rest("PUT", "/v1/quotas/lab/open", json={"network": {
        "mode": "open", "allow": ["10.0.0.0/8"]}})
    assert r.status_code == 200, r.text
    assert r.json()["quota"]["network"] == {"mode": "open", "allow": ["10.0.0.0/8"]}
    lab_admin = Doors(cluster, cluster.create_key("net-lab-admin", "lab", "admin"))
    sub_admin = Doors(cluster, cluster.create_key("net-sub-admin", "lab/open", "admin"))
    ask = {"mode": "open", "allow": ["10.1.2.0/24:5432/tcp"]}
    status, code, msg = sub_admin.refusal("rest", "POST", "/v1/sandboxes",
                                          {"project": "lab/open", "network": ask}, ("", None))
    assert (status, code) == (403, "permission_denied")
    assert "outside the network ceiling of project 'lab'" in msg, msg
    # lab/open's own admin may not widen lab/open's ceiling; lab's admin may
    status, code, msg = sub_admin.refusal("rest", "PUT", "/v1/quotas/lab/open", {
        "network": {"mode": "open", "allow": ["10.0.0.0/8", "172.16.0.0/12"]}}, ("", None))
    assert (status, code) == (403, "permission_denied") and "parent project 'lab'" in msg
    r = lab_admin.rest("PUT", "/v1/quotas/lab/open", json={"network": {"mode": "open"}})
    assert r.status_code == 200, r.text
    # a ceiling is validated where it enters, with the field named
    bad = admin.rest("PUT", "/v1/quotas/lab/open", json={"network": {
        "mode": "policy", "allow": ["10.0.0.5/8"]}})
    assert bad.status_code == 400 and bad.json()["detail"]["field"] == \
        "quota.network.allow[0]", bad.text


# ================================================================ the edge door
async def test_the_node_ceiling_binds_at_the_edge_door(tmp_path: Any) -> None:
    """An edge reached directly (its own Aether socket) is never asked for more than
    ``--net-max``: create and update refused with the entry named."""
    node = make_node(net_max=NetworkPolicy(mode="policy", allow=("pypi.org",)).validate())
    async with node:
        server = await serve_edge(node, f"unix:{tmp_path}/e.sock")
        conn = await connect(f"unix:{tmp_path}/e.sock")
        try:
            with pytest.raises(PermissionDenied, match=r"network.allow\[0\] 'github.com' is "
                               r"outside the network ceiling of node n1"):
                await conn.call("edge.create", {"spec": {"network": {
                    "mode": "policy", "allow": ["github.com"]}}}, timeout=TIMEOUT)
            assert node.list() == [], "nothing made"
            info = await conn.call("edge.create", {"spec": {"network": {
                "mode": "policy", "allow": ["pypi.org"]}}}, timeout=TIMEOUT)
            with pytest.raises(PermissionDenied, match=r"policy.mode 'open' is outside"):
                await conn.call("edge.network_update", {"id": info["id"], "policy": {
                    "mode": "open"}}, timeout=TIMEOUT)
            assert node.network_get(info["id"]).generation == 1
        finally:
            await conn.close()
            await server.close()


def _journal_puts(state: str) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    with open(os.path.join(state, JOURNAL), "rb") as f:
        for line in f.read().splitlines():
            rec = msgspec.json.decode(line) if line.strip() else None
            if rec and rec[0] == "put":
                out[rec[1]] = rec
    return out


class _Refusing(SimulatedBackend):
    """A backend whose kernel refuses the next policy (a set full, ENOMEM)."""

    refuse = False

    async def set_network(self, sid: SandboxId, spec: SandboxSpec,
                          ceiling_deny: tuple[str, ...], generation: int) -> None:
        if self.refuse:
            raise OSError(12, "Cannot allocate memory")
        await super().set_network(sid, spec, ceiling_deny, generation)


async def test_update_is_durable_before_it_is_answered_and_survives_a_restart(
        tmp_path: Any) -> None:
    state = str(tmp_path / "state")
    backend = _Refusing()
    async with make_node(backend, state_dir=state) as node:
        sid = (await node.create(SandboxSpec(network=NetworkPolicy(mode="none")),
                                 ceiling_deny=("198.51.100.0/24",))).id
        view = await node.network_update(sid, NetworkPolicy(mode="policy", allow=PYPI),
                                         ceiling_deny=("198.51.100.0/24",))
        rec = _journal_puts(state)[sid]        # on disk the moment it answered
        assert rec[3]["network"] == {"mode": "policy", "allow": list(PYPI)}
        assert rec[6:8] == [view.generation, ["198.51.100.0/24"]]
        # a backend refusal: the journal goes back to the old policy, nothing changes
        backend.refuse = True
        with pytest.raises(BackendError, match="Cannot allocate memory"):
            await node.network_update(sid, NetworkPolicy(mode="open"))
        backend.refuse = False
        assert node.network_get(sid) == view
        rec = _journal_puts(state)[sid]
        assert rec[3]["network"]["mode"] == "policy" and rec[6] == view.generation
    # the edge restarts (the simulated sandboxes live in the backend object): re-adopted
    # with the policy, its generation and the ceiling's denies
    async with make_node(backend, state_dir=state) as again:
        assert again.network_get(sid) == view


async def test_a_backend_without_policy_enforcement_refuses_all_but_none() -> None:
    """fncall (and the container backend until the router lands) enforce no egress
    policy: a create or update asking for one is refused, never run without it."""
    class NoNetwork(SimulatedBackend):
        set_network = None  # type: ignore[assignment]

    async with make_node(NoNetwork()) as node:
        sid = (await node.create(SandboxSpec())).id
        with pytest.raises(InvalidArgument, match="enforces no network policy but 'none'"):
            await node.network_update(sid, NetworkPolicy(mode="open"))
        assert node.network_get(sid).generation == 1
        v = await node.network_update(sid, NetworkPolicy(mode="loopback"))
        assert v.generation == 1, "loopback is none: no change"


async def test_concurrent_updates_of_one_sandbox_serialise() -> None:
    async with make_node() as node:
        sid = (await node.create(SandboxSpec())).id
        views = await asyncio.gather(*(node.network_update(
            sid, NetworkPolicy(mode="policy", allow=(f"h{i}.example.com",)))
            for i in range(8)))
        assert sorted(v.generation for v in views) == list(range(2, 10))
        last = max(views, key=lambda v: v.generation)
        assert node.network_get(sid) == last


def test_the_rows_hold_their_policies(cluster: LocalCluster) -> None:
    """The update row's REST body is the policy alone; its refusals name policy.*."""
    assert ops.NETWORK_UPDATE.rest is not None and ops.NETWORK_UPDATE.rest.body == "policy"
    with pytest.raises(InvalidArgument, match=r"^policy\.allow\[0\]"):
        NetworkUpdate(id="sb-0123456789ab-n1", policy=NetworkPolicy(mode="policy",
                                                                    allow=("x..y",)))


# ================================================================ defaults
def test_the_cluster_default_is_a_setting_and_a_ceiling_still_binds_it(
        tmp_path: Any) -> None:
    """`dsec up --net-default open`: a create naming no network gets it (resolved and
    stored); one naming "none" keeps none; under a project whose ceiling is narrower the
    default is refused like any ask, naming the mode."""
    with LocalCluster(edges=1, net_default=NetworkPolicy(mode="open")) as cl:
        d = Doors(cl, cl.api_key)
        sid = _create(d)
        assert d.gateway("api.network_get", {"id": sid})["policy"] == {"mode": "open"}
        assert d.rest("GET", f"/v1/sandboxes/{sid}").json()["spec"]["network"] == {
            "mode": "open"}
        assert d.gateway("api.network_get", {"id": _create(d, {"mode": "none"})})["policy"] == {}
        assert d.rest("PUT", "/v1/quotas/closed", json={"network": {"mode": "none"}}
                      ).status_code == 200
        status, code, msg = d.refusal("rest", "POST", "/v1/sandboxes", {"project": "closed"},
                                      ("", None))
        assert (status, code) == (403, "permission_denied")
        assert msg.startswith("network.mode 'open' is outside the network ceiling of "
                              "project 'closed'"), msg
        assert d.gateway("api.network_get", {"id": _create(d, {"mode": "none"}, "closed")})[
            "policy"] == {}


async def test_an_edge_reached_directly_resolves_its_own_default() -> None:
    async with make_node(net_default=NetworkPolicy(mode="open")) as node:
        info = await node.create(SandboxSpec())
        assert info.spec.network == NetworkPolicy(mode="open")
        info = await node.create(SandboxSpec(network=NetworkPolicy()))
        assert info.spec.network == NetworkPolicy()


def test_the_net_flags_parse_a_mode_or_a_policy_file(tmp_path: Any) -> None:
    import click

    from dsec.cli.edge import NET_POLICY
    assert NET_POLICY.convert("none", None, None) == NetworkPolicy()
    assert NET_POLICY.convert("open", None, None) == NetworkPolicy(mode="open")
    f = tmp_path / "p.json"
    f.write_text('{"mode": "policy", "allow": ["PyPI.org:443"]}')
    assert NET_POLICY.convert(f"@{f}", None, None) == NetworkPolicy(
        mode="policy", allow=("pypi.org:443",))
    f.write_text('{"mode": "policy", "allow": ["pypi..org"]}')
    with pytest.raises(click.BadParameter, match="empty label"):
        NET_POLICY.convert(f"@{f}", None, None)
    with pytest.raises(click.BadParameter, match="not a policy"):
        NET_POLICY.convert("everything", None, None)
