"""A test run killed with -9 runs no finally: the next one reaps what it left (its
apiserver processes, its namespaces with their veths and bridge), and leaves alone the
clusters whose owner still runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dsec.cluster.hosts import reap
from dsec.ownership import start_time
from tests.conftest import requires_root

pytestmark = requires_root

_CHILD = """
import sys, time
from dsec.cluster.hosts import HostCluster, HostsConfig
hc = HostCluster(HostsConfig(state_dir=sys.argv[1], hosts=2, backends=("simulated",),
                             default_backend="simulated"), records_dir=sys.argv[2])
hc.start()
print(hc.id, *[p for p in hc.processes().values()], flush=True)
time.sleep(600)
"""


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                         check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_reap_removes_what_a_killed_run_left(tmp_path: Path) -> None:
    records = str(tmp_path / "records")
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path / "st"), records],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        line = child.stdout.readline().split()
        assert line, "the child cluster did not start"
        cid, pids = line[0], [int(p) for p in line[1:]]
        mine = {n for n in _netns() if n.startswith(cid)}
        assert len(mine) == 4                     # hub, one replica, two hosts
        # while its owner runs, a cluster is never touched
        assert reap(records) == []
        assert {n for n in _netns() if n.startswith(cid)} == mine
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        done = reap(records)
        assert len(done) == 1 and done[0].startswith(cid), done
        assert not {n for n in _netns() if n.startswith(cid)}
        end = time.monotonic() + 10
        while any(start_time(p, running=True) for p in pids) and time.monotonic() < end:
            time.sleep(0.05)
        assert [p for p in pids if start_time(p, running=True)] == []
        assert os.listdir(records) == []
        assert reap(records) == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        reap(records)
