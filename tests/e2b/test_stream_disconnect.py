"""A client that goes away ends its stream's reader on the edge, through the real
listener (uvicorn) and the stock SDK: ``handle.disconnect()`` on a running command
leaves the process running (as envd's) and its ``process_connect`` follower is gone
from the edge's process table within a second or two (the writer's disconnect watcher,
dsec.control.e2b.stream)."""

from __future__ import annotations

import time

import pytest

from dsec import LocalCluster
from dsec.bench._e2b_calls import E2BTarget

pytestmark = pytest.mark.root


def _followers(cl: LocalCluster, sid: str, pid: int) -> int:
    for node in cl.runtime.nodes:
        table = node.processes._tables.get(sid)
        if table and pid in table:
            return len(table[pid].followers)
    raise AssertionError(f"process {pid} of {sid} is in no edge's process table")


def test_disconnect_ends_the_edge_reader_and_not_the_process(
        e2b_cluster: LocalCluster, e2b_target: E2BTarget) -> None:
    from e2b import Sandbox

    sb = Sandbox.create(e2b_target.template, timeout=120, **e2b_target.opts())
    try:
        handle = sb.commands.run("sleep 600", background=True)
        deadline = time.monotonic() + 5
        while _followers(e2b_cluster, sb.sandbox_id, handle.pid) != 1:
            assert time.monotonic() < deadline, "the stream never followed the process"
            time.sleep(0.02)
        handle.disconnect()
        deadline = time.monotonic() + 5
        while _followers(e2b_cluster, sb.sandbox_id, handle.pid) != 0:
            assert time.monotonic() < deadline, (
                "the client disconnected but the edge still streams to it")
            time.sleep(0.05)
        assert handle.pid in [p.pid for p in sb.commands.list()]   # still running
        assert sb.commands.kill(handle.pid)
    finally:
        sb.kill()
