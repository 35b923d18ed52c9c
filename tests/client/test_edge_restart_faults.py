"""Faults of supervised edge processes (``dsec up``'s topology) as a client sees them:
an edge killed with -9 mid-operation, an edge that hangs. Every answer names the outage
for what it is and says whether the operation may have happened; no sandbox is lost
to a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator

import pytest

from dsec.cluster.local import LocalCluster
from dsec.control.api.plane import PlaneConfig
from dsec.errors import EdgeUnreachable, Unavailable


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(edges=1, edge_processes=True, cpu_milli=8000,
                      memory_bytes=8 << 30) as c:
        yield c


@pytest.mark.parametrize("transport", ["http", "aether"])
def test_a_streamed_exec_cut_by_an_edge_crash_says_the_command_may_have_run(
        cluster: LocalCluster, transport: str) -> None:
    """kill -9 of the edge while a command streams: the caller gets EdgeUnreachable
    (not its own ConnectionLost) with ``may_have_run`` True, through REST's NDJSON stream
    as through the gateway (REST's error line used to drop the detail)."""
    async def run() -> None:
        async with cluster.async_client(protocol=transport, session_lease_s=None) as c:
            sb = await c.sandboxes.create(memory="16MiB", cpu=0.01)
            loop = asyncio.get_running_loop()
            loop.call_later(1.0, cluster.kill_edge, "edge-0")
            seen = []
            with pytest.raises(EdgeUnreachable) as err:
                async for item in sb.exec_stream(["sleep", "30"], timeout=60):
                    seen.append(item)
            assert seen == [], seen                  # cut before it finished
            assert err.value.detail.get("may_have_run") is True, err.value.detail
            assert "may have run" in err.value.message
    asyncio.run(run())
    deadline = time.monotonic() + 30
    while cluster.edge_states()["edge-0"] != "running" and time.monotonic() < deadline:
        time.sleep(0.05)


def _wait(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def short_ttl() -> Iterator[LocalCluster]:
    with LocalCluster(edges=1, edge_processes=True, cpu_milli=8000, memory_bytes=8 << 30,
                      plane=PlaneConfig(node_ttl_s=6.0, poll_timeout_s=1.5)) as c:
        yield c


def test_a_hung_edge_is_restarted_before_its_node_is_lost(short_ttl: LocalCluster) -> None:
    """An edge process that stops answering without dying (SIGSTOP here; a deadlocked
    loop, a stuck disk) used to stay "running" for its supervisor: after the node-loss
    TTL the control plane wrote every sandbox off (node_lost) and destroyed them when
    the edge woke up. `dsec up` knows the process is local and restarts it (re-adopting
    its sandboxes from its journal) before the TTL, as it would after a crash."""
    cluster = short_ttl
    with cluster.client(session_lease_s=None) as c:
        sbs = [c.sandboxes.create(memory="16MiB", cpu=0.01) for _ in range(3)]
        pid = cluster.runtime.processes["edge-0"].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            # hung for twice the TTL: it must have been replaced, not waited out
            _wait(lambda: cluster.runtime.processes["edge-0"].pid not in (None, pid), 20,
                  "the hung edge to be replaced")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        _wait(lambda: cluster.edge_states()["edge-0"] == "running", 30, "the restart")
        time.sleep(2 * 6.0)
        for sb in sbs:
            info = c.sandboxes.get(sb.id).info
            assert info.state == "running", (sb.id, info.state, info.reason)
        assert [n.status for n in c.nodes()] == ["healthy"]


def test_an_edge_restart_slower_than_the_ttl_loses_no_sandbox(
        short_ttl: LocalCluster) -> None:
    """A supervised restart that takes longer than the node-loss TTL (re-adopting many
    sandboxes on a loaded machine; here the new process is held stopped) is a restart,
    not a lost node: the control plane holds the node while its supervisor brings it
    back, instead of writing its sandboxes off and destroying them when it returns."""
    cluster = short_ttl
    with cluster.client(session_lease_s=None) as c:
        sbs = [c.sandboxes.create(memory="16MiB", cpu=0.01) for _ in range(3)]
        old = cluster.kill_edge("edge-0")
        proc = cluster.runtime.processes["edge-0"]
        _wait(lambda: proc.pid not in (None, old), 20, "the restart to begin")
        new = proc.pid
        assert new is not None
        os.kill(new, signal.SIGSTOP)            # the restart takes 2x the TTL
        try:
            time.sleep(6.0)
            # meanwhile a create is told the node is out for now, not "ask for less"
            with cluster.client(session_lease_s=None, create_retry_s=0) as once, \
                    pytest.raises(Unavailable) as err:
                once.sandboxes.create(memory="16MiB", cpu=0.01)
            assert "ask for less" not in err.value.message, err.value.message
            time.sleep(6.0)
        finally:
            os.kill(new, signal.SIGCONT)
        _wait(lambda: cluster.edge_states()["edge-0"] == "running", 60, "the restart")
        _wait(lambda: [n.status for n in c.nodes()] == ["healthy"], 30, "a healthy node")
        for sb in sbs:
            info = c.sandboxes.get(sb.id).info
            assert info.state == "running", (sb.id, info.state, info.reason)
