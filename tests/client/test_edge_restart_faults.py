"""Faults of supervised edge processes (``dsec up``'s topology) as a client sees them:
an edge killed with -9 mid-operation, an edge that hangs. Every answer names the outage
for what it is and says whether the operation may have happened; no sandbox is lost
to a restart.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from dsec.client.local import LocalCluster
from dsec.errors import EdgeUnreachable


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
        async with cluster.async_client(transport=transport, session_lease_s=None) as c:
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
