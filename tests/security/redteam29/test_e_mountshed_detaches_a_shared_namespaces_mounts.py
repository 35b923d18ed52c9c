"""Red team 28 F's fix makes dsec.mountshed refuse PID 1's mount namespace and make its
``/`` private before detaching. That guards the host's namespace only. Run (by hand, by
a wrapper, by a unit that does not add ``unshare``) in any *other* namespace that other
processes live in - a systemd service's (dsec-apiserver.service has ProtectSystem=strict
and PrivateTmp=yes: its own mount namespace), a container's, a ``nsenter -m`` into one -
it still detaches every non-system mount there, under every process of that namespace,
and makes that whole namespace private as a side effect. Its docstring's precondition
("the first process in its namespace") is not checked.

Repro: a holder process sits in a private mount namespace with a tmpfs mounted at a
directory of tmp_path; `nsenter -t HOLDER -m -- python -m dsec.mountshed -- true`; the
tmpfs is gone from the holder's namespace.

Severity: low (operator-run tool, not reachable by a tenant; but the fix's claim - a
namespace that shared mounts with its caller is safe - holds only for PID 1's).

Fix: make mountshed make its own namespace: ``unshare(CLONE_NEWNS)`` first thing, then
the private remount, then detach and exec - whatever namespace it was started in is
never touched (the bootstrap's outer ``unshare --mount`` stays, it is harmless).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.root]

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "src")


def test_e_mountshed_leaves_a_namespace_it_shares_alone(tmp_path: object) -> None:
    mp = os.path.join(str(tmp_path), "mnt")
    os.mkdir(mp)
    holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--",
                               "sh", "-c", f"mount -t tmpfs rt29 {mp} && exec sleep 60"])
    try:
        pid = str(holder.pid)
        for _ in range(50):
            if os.readlink(f"/proc/{pid}/exe").endswith("sleep"):
                break
            time.sleep(0.05)

        def mounted() -> bool:
            r = subprocess.run(["nsenter", "-t", pid, "-m", "--", "findmnt", "-n", mp],
                               capture_output=True, text=True, check=False)
            return r.returncode == 0
        assert mounted(), "setup: the holder's tmpfs is not mounted"
        env = dict(os.environ, PYTHONPATH=os.path.abspath(SRC))
        r = subprocess.run(["nsenter", "-t", pid, "-m", "--", sys.executable, "-m",
                            "dsec.mountshed", "--", "true"], env=env,
                           capture_output=True, text=True, check=False)
        still = mounted()
        assert still, (
            f"dsec.mountshed run in another process's (non-PID-1) mount namespace "
            f"(exit {r.returncode}, stderr {r.stderr.strip()[:200]!r}) detached that "
            f"process's tmpfs at {mp}: it only refuses PID 1's namespace")
    finally:
        holder.kill()
        holder.wait()
