"""Fixtures: a real EdgeNode with the simulated backend, reached through EdgeAccess."""

from __future__ import annotations

import contextlib
import os
import tempfile
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


@contextlib.contextmanager
def container_edge(node_id: str) -> Iterator[tuple[EdgeAccess, EdgeNode]]:
    """A real EdgeNode on the container backend (busybox base image), reached through
    EdgeAccess; everything it made (sandboxes, cgroups, dirs) is gone afterwards."""
    from dsec.edge.backends.container import ContainerBackend, DirectoryImages
    from dsec.edge.backends.container.testimage import build_busybox_root

    tmp = tempfile.TemporaryDirectory(prefix=f"dsec-{node_id}-")
    build_busybox_root(os.path.join(tmp.name, "images", "base"))
    lt = LoopThread()
    holder: dict[str, ContainerBackend] = {}

    async def start() -> EdgeNode:
        b = ContainerBackend(root_dir=os.path.join(tmp.name, "root"),
                             images=DirectoryImages(os.path.join(tmp.name, "images")))
        holder["backend"] = b
        node = EdgeNode(NodeConfig(node_id=node_id, capacity=Capacity(
            cpu_milli=1_000_000, memory_bytes=1 << 40, max_sandboxes=1000)), {"container": b})
        return await node.start()

    try:
        node = lt.run(start())
        yield EdgeAccess({node_id: node}, lt), node
        for info in node.list():
            if info.state not in ("destroyed", "failed"):
                lt.run(node.destroy(info.id))
        lt.run(node.close())
    finally:
        b = holder.get("backend")
        if b is not None:
            for sid in b.sandbox_ids():
                with contextlib.suppress(Exception):  # keep cleaning up the rest
                    lt.run(b.destroy(sid))
            lt.run(b.close())
            b.governor.remove_base()
        lt.close()
        tmp.cleanup()
