"""Trusted claims (issue 16): a joined node's heartbeat is checked against what the
control plane knows. A hostile edge (a real edge over Aether whose heartbeat lies, as
root on a joined host can make it) claiming to hold another project's snapshot, or a
project's name, attracts nothing: placement and the layer relay do not believe it until
the control plane put the layer there; its capacity claim is clamped to the size it
registered with. The same edge taken at its word (trusted: this host's) shows the
difference. A real state store of each kind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from dsec.control.api.plane import ControlPlane, PlaneConfig
from dsec.control.claims import clamp_capacity, trusted_layers
from dsec.control.metrics import ApiMetrics
from dsec.control.store import SnapshotChargeRow, open_store
from dsec.edge.client import EdgeClient
from dsec.wire.node import Resources
from tests.control.conftest import served_edge

VICTIM = "sha256:" + "a" * 64          # project victim's snapshot, taken on e0
OPEN = "sha256:" + "c" * 64            # a digest the control plane has no record of


def _lying(node: Any, claims: dict[str, Any]) -> None:
    """Make ``node``'s heartbeat claim ``claims["images"]`` and ``claims["capacity"]``."""
    real = node.heartbeat

    def heartbeat(**kw: Any) -> Any:
        hb = real(**kw)
        out = msgspec.structs.replace(hb, images=[*hb.images, *claims["images"]],
                                      images_same=False, images_gen=hb.images_gen + 1)
        if claims.get("capacity") is not None:
            out = msgspec.structs.replace(out, capacity=claims["capacity"])
        return out
    node.heartbeat = heartbeat


async def test_a_hostile_edge_attracts_nothing_it_was_not_given(tmp_path: Path,
                                                               store_url: str) -> None:
    store = open_store(store_url)
    plane = ControlPlane.open(store, metrics=ApiMetrics(), config=PlaneConfig())
    store.put_snapshot_charge(SnapshotChargeRow(id=VICTIM, project="victim", node="e0",
                                                size_bytes=1, kind="snapshot"))
    links = []
    try:
        async with served_edge(tmp_path, node="e0") as e0, \
                served_edge(tmp_path, node="h1") as h1, \
                served_edge(tmp_path, node="t2") as t2:
            claims = {"images": [VICTIM, "victim/app:latest", OPEN, "base:latest"]}
            _lying(h1.node, claims)
            _lying(t2.node, claims)
            for name, edge, trusted in (("e0", e0, True), ("h1", h1, False),
                                        ("t2", t2, True)):
                link = await EdgeClient.connect(edge.addr)
                links.append(link)
                plane.add_edge(name, edge.addr, link, trusted=trusted)
            await plane.poll_edges()
            registered = plane.edges["h1"].heartbeat.capacity
            # the joined (checked) node: the victim's snapshot and a project's name are
            # not believed; what attracts no one's data is kept
            assert plane.edges["h1"].images >= {OPEN, "base:latest"}
            assert VICTIM not in plane.edges["h1"].images
            assert "victim/app:latest" not in plane.edges["h1"].images
            assert "h1" not in plane._holders(VICTIM)
            # the same lie from a node taken at its word is believed (what changed)
            assert VICTIM in plane.edges["t2"].images and "t2" in plane._holders(VICTIM)
            # the control plane puts the layer there (the relay): now it is believed
            plane._copied_layer("h1", VICTIM)
            await plane.poll_edges()
            assert VICTIM in plane.edges["h1"].images
            # a capacity claim above the registered size is clamped, every field
            claims["capacity"] = Resources(cpu_milli=registered.cpu_milli * 100,
                                           memory_bytes=registered.memory_bytes * 100,
                                           sandboxes=registered.sandboxes * 100,
                                           disk_bytes=None)
            await plane.poll_edges()
            got = plane.edges["h1"].heartbeat.capacity
            assert (got.cpu_milli, got.memory_bytes, got.sandboxes) == (
                registered.cpu_milli, registered.memory_bytes, registered.sandboxes)
            view = {v.id: v for v in plane.nodes()}["h1"]
            assert view.cpu_milli_total == registered.cpu_milli
            assert view.max_sandboxes == registered.sandboxes
            assert plane.edges["t2"].heartbeat.capacity.cpu_milli == \
                registered.cpu_milli * 100
    finally:
        await plane.close()
        for link in links:
            await link.close()
        store.close()


def test_the_claim_rules() -> None:
    reg = Resources(cpu_milli=1000, memory_bytes=1 << 30, sandboxes=10, disk_bytes=1 << 30)
    small = Resources(cpu_milli=500, memory_bytes=1 << 29, sandboxes=5, disk_bytes=1 << 20)
    assert clamp_capacity(small, reg) == small
    assert clamp_capacity(small, None) == small
    big = Resources(cpu_milli=10**6, memory_bytes=1 << 40, sandboxes=10**5, disk_bytes=None)
    assert clamp_capacity(big, reg) == reg
    assert clamp_capacity(big, None) == big
    projects = {VICTIM: "victim"}
    got = trusted_layers([VICTIM, OPEN, "base:latest", "teamb/app:1"],
                         granted=lambda d: False, project_of=projects.get)
    assert got == {OPEN, "base:latest"}
    assert VICTIM in trusted_layers([VICTIM], granted=lambda d: True,
                                    project_of=projects.get)


def test_the_registered_capacity_is_the_first_recorded_until_the_node_joins_again(
        tmp_path: Path) -> None:
    """Every replica reads the one recorded size (first writer wins); revoking a node and
    joining it again (a machine that really grew) starts the registration over."""
    from dsec.control.store.membership import JoinTokenRow, NodeRow

    store = open_store(f"sqlite://{tmp_path / 'state.db'}")
    try:
        assert store.register_capacity("h1", '{"a": 1}', 1.0) == '{"a": 1}'
        assert store.register_capacity("h1", '{"a": 100}', 2.0) == '{"a": 1}'
        other = open_store(f"sqlite://{tmp_path / 'state.db'}")    # another replica
        try:
            assert other.register_capacity("h1", '{"a": 100}', 3.0) == '{"a": 1}'
        finally:
            other.close()
        for tok in ("t0000000001", "t0000000002"):
            store.put_join_token(JoinTokenRow(id=tok, secret_hash=b"x", uses=1,
                                              expires_at=1e12))
        row = NodeRow(node_id="h1", address="tcp:127.0.0.1:1", cert_fingerprint="0",
                      token_id="t0000000001", joined_at=4.0)
        assert store.join_node("t0000000001", b"x", 4.0, row) == ""
        assert store.register_capacity("h1", '{"a": 100}', 5.0) == '{"a": 100}'
        assert store.revoke_node("h1", 6.0)
        assert store.join_node("t0000000002", b"x", 7.0, msgspec.structs.replace(
            row, token_id="t0000000002", cert_fingerprint="1")) == ""
        assert store.register_capacity("h1", '{"a": 200}', 8.0) == '{"a": 200}'
    finally:
        store.close()
