"""Fixtures: a real EdgeNode with the simulated backend, reached through EdgeAccess."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dsec.edge.admission import Capacity
from dsec.edge.backends.simulated import SimulatedBackend
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.rl.access import EdgeAccess, LoopThread


async def _start_node(node_id: str) -> EdgeNode:
    node = EdgeNode(NodeConfig(node_id=node_id, capacity=Capacity(
        cpu_milli=1_000_000, memory_bytes=1 << 40, max_sandboxes=10_000)), SimulatedBackend())
    return await node.start()


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    try:
        yield lt
    finally:
        lt.close()


@pytest.fixture
def sim_nodes(loop_thread: LoopThread) -> Iterator[dict[str, EdgeNode]]:
    nodes: dict[str, EdgeNode] = {}
    try:
        for nid in ("rl-a", "rl-b"):
            nodes[nid] = loop_thread.run(_start_node(nid))
        yield nodes
    finally:
        for n in nodes.values():
            loop_thread.run(n.close())


@pytest.fixture
def sim_access(sim_nodes: dict[str, EdgeNode], loop_thread: LoopThread) -> EdgeAccess:
    return EdgeAccess(sim_nodes, loop_thread)
