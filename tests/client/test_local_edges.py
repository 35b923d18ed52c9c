"""LocalCluster with edges in processes of their own: the supervisor restarts a crashed
edge (which re-adopts its sandboxes), gives up on a crash loop with a clear report, and
``start_edge`` brings a given-up edge back."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from dsec.cluster.local import LocalCluster
from dsec.control.supervisor import RestartPolicy


def _until(what: str, cond: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            v = cond()
        except Exception:  # noqa: BLE001 - the edge may be restarting meanwhile
            v = None
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_crash_restart_crash_loop_and_manual_start() -> None:
    policy = RestartPolicy(first_delay_s=0.05, crash_loop_crashes=3, crash_loop_window_s=60)
    with LocalCluster(edges=1, gateway=False, edge_processes=True, restart=policy) as cl, \
            cl.client(session_lease_s=None) as c:
        sb = c.sandboxes.create(detached=True)
        pids = []
        for n in range(1, 3):
            pids.append(cl.kill_edge("edge-0"))
            _until(f"restart {n}", lambda n=n: cl.edge_states() == {"edge-0": "running"}
                   and cl.runtime.processes["edge-0"].sup.restarts == n)
            assert _until("the sandbox to answer", lambda: sb.exec("echo up")).stdout == b"up\n"
        assert len(set(pids)) == 2
        cl.kill_edge("edge-0")
        _until("the crash loop verdict", lambda: cl.edge_states() == {"edge-0": "failed"})
        (_, node, level, msg), *_ = [r for r in cl.runtime.reports if r[2] == "error"]
        assert (node, level) == ("edge-0", "error")
        assert msg.startswith("edge edge-0 crashed 3 times within 60s (last: killed by "
                              "SIGKILL); not restarting it")
        assert "edge-0.log" in msg   # the report quotes the end of the edge's log
        time.sleep(0.3)
        assert cl.edge_states() == {"edge-0": "failed"}   # it stays down
        cl.start_edge("edge-0")
        assert cl.edge_states() == {"edge-0": "running"}
        assert _until("the sandbox again", lambda: sb.exec("echo back")).stdout == b"back\n"
