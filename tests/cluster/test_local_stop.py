"""LocalCluster.stop leaves nothing even when a step of it fails: temp state dirs
(/tmp/dsec-local-*) of clusters whose runtime stop raised were found on the CI machine."""

from __future__ import annotations

import os
import threading

import pytest

from dsec.cluster.local import LocalCluster


def test_a_failing_runtime_stop_still_stops_the_loop_and_removes_the_state_dir() -> None:
    # threads of other clusters this worker process holds (a session-scoped fixture's,
    # under xdist) are not this test's: only the threads this cluster started must go
    before = set(threading.enumerate())
    c = LocalCluster(backend="simulated").start()
    state_dir, loop_thread = c.state_dir, c._thread
    assert os.path.isdir(state_dir) and loop_thread is not None
    real_stop = c.runtime.stop

    async def broken_stop(**kw: object) -> None:
        await real_stop(**kw)  # (really stopped: nothing of the runtime is left either)
        raise RuntimeError("runtime stop failed")

    c.runtime.stop = broken_stop
    with pytest.raises(RuntimeError, match="runtime stop failed"):
        c.stop()
    assert not os.path.exists(state_dir)
    loop_thread.join(timeout=10)
    assert not loop_thread.is_alive()
    assert "dsec-local-cluster" not in {t.name for t in set(threading.enumerate()) - before}
