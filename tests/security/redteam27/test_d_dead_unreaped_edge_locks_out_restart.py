"""Red team 26 F/I's fix: `claim_cgroup_name` refuses a name bound to the same root dir
by a *live* process. "Live" is `process_identity` = `start_time(pid)` without
`running=True`: a zombie - an edge killed -9 (or crashed) that its parent has not
reaped yet - still has its /proc/<pid>/stat and counts as alive. Its root lock (flock)
was released at its death, so the restarted backend takes the lock and is then refused
`InUse` ("held by a live backend") by a process that is dead: the restart fails until
someone reaps the corpse. An edge whose parent died is reparented to PID 1 or a child
subreaper; a supervisor that restarts before it reaps (or a PID 1 that reaps late, as in
many containers) locks the node out. (For the container backend the check is moot
anyway: it holds the root lock already when it claims.)

Repro: a child process starts a ContainerBackend on a root and is SIGKILLed; not yet
reaped, a new ContainerBackend on that root is refused.

Fix: `running=True` in the claim's liveness check (a zombie holds nothing) - and for
the container backend, which holds the root lock, skip the live-owner check entirely.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from tests.edge.container.conftest import _cleanup

pytestmark = [pytest.mark.root]

CHILD = """
import os, sys, time
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
b = ContainerBackend(root_dir=sys.argv[1], images=DirectoryImages(sys.argv[2]))
print("ready", flush=True)
time.sleep(600)
"""


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read()
    return raw[raw.rfind(b")") + 2:].split()[0].decode()


async def test_restart_after_a_crash_not_yet_reaped(tmp_path: object,
                                                    hog_images: str) -> None:
    root = os.path.join(str(tmp_path), "root")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.Popen([sys.executable, "-c", CHILD, root, hog_images],  # noqa: ASYNC220
                         stdout=subprocess.PIPE, env=env)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
        os.kill(p.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _state(p.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)  # noqa: ASYNC251
        assert _state(p.pid) == "Z"
        err = None
        b = None
        try:
            b = ContainerBackend(root_dir=root, images=DirectoryImages(hog_images))
        except Exception as exc:  # noqa: BLE001
            err = exc
        finally:
            if b is not None:
                await _cleanup(b)
        assert err is None, (
            f"the edge on {root} died (pid {p.pid}, a zombie not yet reaped: its root lock "
            f"is free); the restarted backend was refused: {err!r}")
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
        # the killed child's base cgroups and claim
        b2 = ContainerBackend(root_dir=root, images=DirectoryImages(hog_images))
        await _cleanup(b2)
