"""Fixtures for edge tests: a node over the simulated backend with a fake clock."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest

from dsec.edge.admission import Capacity
from dsec.edge.backends.simulated import SimulatedBackend
from dsec.edge.clock import FakeClock
from dsec.edge.node import EdgeNode, NodeConfig

BIG = Capacity(cpu_milli=10**9, memory_bytes=2**60, max_sandboxes=10**6)


def make_node(backend: object | None = None, *, clock: FakeClock | None = None,
              capacity: Capacity = BIG, state_dir: str | None = None,
              node_id: str = "n1", **cfg: object) -> EdgeNode:
    clock = clock or FakeClock()
    backend = backend or SimulatedBackend(clock=clock)
    config = NodeConfig(node_id=node_id, capacity=capacity, state_dir=state_dir, **cfg)  # type: ignore[arg-type]
    return EdgeNode(config, backend, clock=clock, rng=random.Random(7))  # type: ignore[arg-type]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def node(clock: FakeClock) -> AsyncIterator[EdgeNode]:
    n = make_node(clock=clock)
    await n.start()
    try:
        yield n
    finally:
        await n.close()
