"""F5: a joined node's capacity clamp (R16-6) compares each heartbeat with "the size it
registered with", but that size is only the first heartbeat *this apiserver process*
heard (``EdgeEntry.registered``, in memory): on another replica, or after a restart or
rolling upgrade, the hostile node's first heartbeat is taken as its registration, so it
claims 100x and placement believes it (and sends it every project's sandboxes). The
registered size must live where every replica reads it (the joined-node record)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from dsec.control.api.plane import ControlPlane, PlaneConfig
from dsec.control.metrics import ApiMetrics
from dsec.control.store import open_store
from dsec.edge.client import EdgeClient
from dsec.wire.node import Resources
from tests.control.conftest import served_edge


def _claiming(node: Any, claims: dict[str, Any]) -> None:
    real = node.heartbeat

    def heartbeat(**kw: Any) -> Any:
        hb = real(**kw)
        if claims.get("capacity") is not None:
            hb = msgspec.structs.replace(hb, capacity=claims["capacity"])
        return hb
    node.heartbeat = heartbeat


async def test_a_joined_nodes_capacity_clamp_survives_a_restart_or_another_replica(
        tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path / 'state.db'}"
    claims: dict[str, Any] = {}
    async with served_edge(tmp_path, node="h1") as h1:
        _claiming(h1.node, claims)
        store = open_store(url)
        plane = ControlPlane.open(store, metrics=ApiMetrics(), config=PlaneConfig())
        link = await EdgeClient.connect(h1.addr)
        try:
            plane.add_edge("h1", h1.addr, link, trusted=False)
            await plane.poll_edges()
            registered = plane.edges["h1"].heartbeat.capacity
        finally:
            await plane.close()
            await link.close()
            store.close()
        # the node now claims 100x, and the apiserver it talks to is a fresh process
        claims["capacity"] = Resources(cpu_milli=registered.cpu_milli * 100,
                                       memory_bytes=registered.memory_bytes * 100,
                                       sandboxes=registered.sandboxes * 100,
                                       disk_bytes=None)
        store = open_store(url)
        plane = ControlPlane.open(store, metrics=ApiMetrics(), config=PlaneConfig())
        link = await EdgeClient.connect(h1.addr)
        try:
            plane.add_edge("h1", h1.addr, link, trusted=False)
            await plane.poll_edges()
            got = plane.edges["h1"].heartbeat.capacity
            assert (got.cpu_milli, got.sandboxes) == (registered.cpu_milli,
                                                      registered.sandboxes), (
                f"after a restart the joined node's claim of {got.cpu_milli} mCPU / "
                f"{got.sandboxes} sandboxes was believed (registered: "
                f"{registered.cpu_milli} / {registered.sandboxes})")
        finally:
            await plane.close()
            await link.close()
            store.close()
