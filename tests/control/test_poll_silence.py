"""A poll that timed out is silence only if the apiserver really listened (issue 12).

Two ways a healthy node used to be written off without dying: its link was busy with a
tenant's flood (the poll's reply queued behind other replies that kept arriving), or
the apiserver's own event loop could not run (CPU-heavy work, a starved process) while
the poll's deadline ran. Pure tests of the classification and the stall meter, and the
control plane against a real edge whose process stalls mid-poll.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import uvloop

from dsec.control.watcher import StallMeter, link_failure_cause
from dsec.edge.admission import Capacity
from dsec.edge.backends import make_backend
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.edge.service import EdgeClient, serve_edge
from dsec.errors import ConnectionLost, Overloaded, RequestTimeout
from dsec.wire.api import CreateSandboxRequest
from tests.control.conftest import FakeClock
from tests.control.test_node_reachability import _apiserver, _close


def test_a_timeout_is_silence_only_if_nothing_was_heard_and_this_side_listened() -> None:
    late = RequestTimeout("no reply within 5s")
    assert link_failure_cause(late) == "silent"
    assert link_failure_cause(late, heard=True) == "answered"
    assert link_failure_cause(late, stalled=True) == "blind"
    assert link_failure_cause(late, heard=True, stalled=True) == "answered"
    # a closed or refused link is silence whatever else happened
    gone = ConnectionLost("connection reset by peer")
    assert link_failure_cause(gone, heard=True, stalled=True) == "silent"
    assert link_failure_cause(Overloaded("refused")) == "answered"


def test_the_stall_meter_counts_late_ticks_and_an_overdue_one_within_a_window() -> None:
    m = StallMeter(0.1)
    assert m.stalled(0.0, 10.0) == 0.0
    m.tick(0.0)
    m.tick(0.1)
    m.tick(0.2)
    assert m.stalled(0.0, 0.2) == 0.0
    m.tick(3.3)                                  # 3 s late: [0.3, 3.3] the loop did not run
    assert abs(m.stalled(0.0, 3.3) - 3.0) < 1e-9
    assert abs(m.stalled(2.3, 3.3) - 1.0) < 1e-9  # only the part inside the window
    assert m.stalled(3.3, 3.35) == 0.0
    # no tick since 3.3: by 5.4 the loop has been stalled since 3.4
    assert abs(m.stalled(3.3, 5.4) - 2.0) < 1e-9
    m.tick(3.4)
    m.tick(200.0)                                 # old samples are dropped
    assert abs(m.stalled(150.0, 200.0) - 50.0) < 1e-6


@pytest.mark.store_kinds("sqlite")   # a loop stall (6 s), whatever the store
def test_a_poll_that_times_out_while_this_process_stalls_holds_the_node(
        tmp_path: Path, store_url: str) -> None:
    """The edge and the apiserver share one process and one loop (``dsec up``, on
    uvloop); the loop stalls for 6 s (here: the heartbeat handler blocks it, as any
    CPU-heavy request or a starved process would). uvloop runs due timers before I/O, so
    the poll's 5 s deadline fires before its reply is read: before the fix that was
    silence, and with the node TTL passed the node was lost and its sandboxes
    destroyed."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_stalled_poll(tmp_path, store_url))


async def _stalled_poll(tmp_path: Path, store_url: str) -> None:
    node = EdgeNode(NodeConfig(node_id="e0", capacity=Capacity(
        cpu_milli=10**6, memory_bytes=1 << 40, max_sandboxes=100)),
        {"simulated": make_backend("simulated")})
    await node.start()
    addr = f"unix:{tmp_path / 'e0.sock'}"
    server = await serve_edge(node, addr)
    clock = FakeClock(time.time())
    store, plane, service = _apiserver(store_url, clock, ttl=3.0)
    try:
        plane.add_edge("e0", addr, await EdgeClient.connect(addr))
        admin = service.authenticate(f"Bearer {plane.bootstrap_admin()}")
        await plane.start()                       # the stall meter runs from here
        ids = {(await service.create(admin, CreateSandboxRequest(project="team"))).id
               for _ in range(3)}
        await plane.tick()
        await asyncio.sleep(0.3)                  # a few stall-meter ticks

        real = node.heartbeat

        def stalls(**kw: Any) -> Any:
            time.sleep(6.0)                       # the whole process makes no progress
            return real(**kw)

        node.heartbeat = stalls  # type: ignore[method-assign]
        clock.t += 4.0                            # past the 3 s TTL since the last poll
        await plane.tick()
        node.heartbeat = real  # type: ignore[method-assign]
        (view,) = plane.nodes()
        assert view.status != "lost", view
        assert not plane.watcher.is_expired("e0")
        assert "stalled" in view.problem, view.problem
        assert all(plane.lost(i) is None for i in ids)
        clock.t += 1.0
        await plane.tick()
        (view,) = plane.nodes()
        assert (view.status, view.healthy) == ("healthy", True)
        assert {node.get(i).state for i in ids} == {"running"}
    finally:
        await _close(store, plane, service)
        await server.close()
        await node.close()
