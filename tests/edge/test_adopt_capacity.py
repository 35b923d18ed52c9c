"""An edge restart re-adopts every live sandbox of its journal, whatever its capacity
says now. The capacity is re-measured at each start (`dsec up` splits the machine among
``--edges``, reads MemTotal and the cgroup limit, applies ``--memory-overcommit``): a
node restarted smaller - a balloon took memory back, a cgroup limit was lowered, `dsec
up --keep` came back with more edges or less overcommit - used to destroy running
sandboxes ("no capacity after restart") in journal order until the rest fitted. A
reservation limit is for new creates: adopted sandboxes are over it, and the node admits
nothing new until enough of them are gone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.edge.admission import Capacity
from dsec.edge.backends.simulated import NodeLatencyProfile, SimulatedBackend
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.errors import CapacityExceeded, Unsatisfiable
from dsec.wire.spec import SandboxSpec

GIB = 1 << 30


def _node(state: Path, memory: int, cpu: int = 64_000, n: int = 100) -> EdgeNode:
    return EdgeNode(NodeConfig(node_id="n0", state_dir=str(state), capacity=Capacity(
        cpu_milli=cpu, memory_bytes=memory, max_sandboxes=n)),
        {"simulated": SimulatedBackend(profile=NodeLatencyProfile.zero())})


@pytest.mark.parametrize("smaller", [
    {"memory": 2 * GIB},                    # less memory than the live ones hold
    {"memory": 512 << 20},                  # less than even one of them holds
    {"memory": 8 * GIB, "cpu": 1000},       # fewer cores
    {"memory": 8 * GIB, "n": 2},            # a lower sandbox cap
])
async def test_a_node_restarted_smaller_keeps_every_live_sandbox(
        tmp_path: Path, smaller: dict[str, int]) -> None:
    node = await _node(tmp_path, 8 * GIB).start()
    made = [await node.create(SandboxSpec(memory_bytes=GIB, cpu_milli=1000))
            for _ in range(4)]
    paused = made[0].id
    await node.pause(paused)
    await node.close()

    node = await _node(tmp_path, **smaller).start()
    try:
        live = {i.id: i.state for i in node.list()}
        gone = {i.id: node.get(i.id) for i in made if i.id not in live}
        assert set(live) == {i.id for i in made}, {
            sid: (g.state, g.reason) for sid, g in gone.items()}
        assert live[paused] == "paused"
        for info in made:
            reasons = [e.reason for e in node.events(info.id)]
            assert "node_lost" not in reasons, reasons
        # over its capacity now: new creates wait until enough are gone
        with pytest.raises((CapacityExceeded, Unsatisfiable)):
            await node.create(SandboxSpec(memory_bytes=GIB, cpu_milli=1000))
        for info in made:
            await node.destroy(info.id)
        assert node.pool.usage().sandboxes == 0
    finally:
        await node.close()
