"""Red team, issue 15 stream ic: kill -9 mid ``dsec image bootstrap debian``. Uses the local
apt repository ``make debian-repo`` keeps under /var/cache/dsec/debian, served on loopback.
Run with PYTHONPATH=<ic tree>/src. Every mount it provokes is under its own tmp dir and is
unmounted in ``finally``."""

from __future__ import annotations

import functools
import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.root, pytest.mark.slow]


def _mounts_under(path: str, pid: str = "self") -> list[str]:
    out = []
    with open(f"/proc/{pid}/mountinfo") as f:
        for line in f:
            mp = line.split()[4].replace("\\040", " ")
            if mp == path or mp.startswith(path + "/"):
                out.append(mp)
    return out


def _session_mounts_under(path: str, sid: int) -> list[str]:
    """The mounts under ``path`` any process of session ``sid`` sees (the bootstrap
    may run mmdebstrap in a mount namespace of its own: its mounts exist there)."""
    out: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getsid(int(pid)) != sid:
                continue
            out.update(_mounts_under(path, pid))
        except (OSError, ProcessLookupError):
            continue
    return sorted(out)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.mark.parametrize("victim", ["group", "dsec"])
def test_kill_9_mid_bootstrap_leaves_mounts_of_host_dirs_in_the_store(
        tmp_path: Path, victim: str) -> None:
    """Fault: the bootstrapping process tree (dsec + mmdebstrap: the OOM killer, a
    service stop killing its cgroup) dies with -9 while mmdebstrap (root mode, real root)
    has proc, sysfs, a devpts and BIND MOUNTS OF HOST PATHS (``/dev/shm``, ``/dev/null``,
    ``/dev/zero``, ...) inside the target, which lives in the store's
    ``tmp/<owner>-bootstrap-*``. They stay for good; and the next store open "reclaims"
    the dead owner's scratch with ``shutil.rmtree(ignore_errors=True)``, which walks
    INTO them: through the bind of the host's /dev/shm it deletes every other process's
    POSIX shared memory and semaphores (see
    test_store_reclaim_walks_into_mount_points, which shows the walk on a tmpfs of ours;
    this test never lets the reclaim run over host binds).

    Safe: the bootstrap's mounts die with it (mmdebstrap run in a private mount
    namespace, ``unshare -m --propagation private``), so a kill leaves no mount.
    Observed: mounts of host paths remain under the store."""
    from dsec.image.bootstrap import BootstrapPlan, repo_dir

    plan = BootstrapPlan.parse(suite="bookworm", include="python3,python3-pytest")
    repo = repo_dir(plan)
    if not os.path.exists(os.path.join(repo, ".complete")):
        pytest.fail(f"no local Debian repo at {repo}: run `make debian-repo` (setup)")
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                          functools.partial(_Quiet, directory=repo))
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    store = str(tmp_path / "store")
    proc = None
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from dsec.cli.main import main; main()", "image",
             "--root", store, "bootstrap", "debian", "--suite", "bookworm", "--include",
             "python3,python3-pytest", "--mirror",
             f"http://127.0.0.1:{srv.server_address[1]}/", "--trusted"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 120
        while not any(m.endswith("/dev/shm") for m in _session_mounts_under(store, proc.pid)) \
                and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, "the bootstrap ended before its mounts were seen"
        if victim == "group":
            os.killpg(proc.pid, signal.SIGKILL)  # the whole tree, as a cgroup kill does
        else:
            os.kill(proc.pid, signal.SIGKILL)    # dsec alone: its helpers must follow
        proc.wait()
        gone_by = time.monotonic() + 10
        while _session_mounts_under(store, proc.pid) and time.monotonic() < gone_by:
            time.sleep(0.05)
        assert _session_mounts_under(store, proc.pid) == [], "the helpers outlived dsec"
        time.sleep(0.5)
        left = _mounts_under(store)
        host_shm = os.stat("/dev/shm").st_dev
        binds = [m for m in left if os.stat(m).st_dev == host_shm]
        assert left == [], (f"{len(left)} mounts left under the store by the killed bootstrap "
                            f"(host /dev/shm bound at {binds}): {left[:6]}")
        from dsec.image import LayerStore
        LayerStore(store)                        # the next open reclaims the dead scratch
        assert os.listdir(os.path.join(store, "tmp")) == []
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for mp in sorted(_mounts_under(store), key=len, reverse=True):
            subprocess.run(["umount", "-l", mp], check=False, capture_output=True)
        srv.shutdown()
        srv.server_close()


def test_store_reclaim_walks_into_mount_points(tmp_path: Path) -> None:
    """The reclaim half of the above, on a tmpfs of our own: a dead process's scratch
    entry holding a mount point. ``LayerStore._reclaim_scratch`` rmtree()s it across the
    mount (deleting what the mounted filesystem holds) and leaves the mount behind.

    Safe: the reclaim never crosses a mount point (compare st_dev, or umount first:
    ``umount -R`` of what is under a dead entry) and reports what it could not remove.
    Observed: the file on the mounted tmpfs is deleted and the mount stays."""
    from dsec import ownership
    from dsec.image import LayerStore

    store = str(tmp_path / "store")
    LayerStore(store)
    child = subprocess.Popen(["true"])
    child.wait()                                 # a pid that is gone
    dead = f"{ownership.token().split('.')[0]}.{child.pid}.1"
    assert ownership.token_alive(dead) is False
    mnt = os.path.join(store, "tmp", f"{dead}-bootstrap-x", "root", "dev", "shm")
    os.makedirs(mnt)
    # the "host's /dev/shm": a tmpfs of ours, bound into the dead entry as mmdebstrap does
    host_shm = str(tmp_path / "host-shm")
    os.makedirs(host_shm)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "rt15shm", host_shm], check=True)
    try:
        subprocess.run(["mount", "--bind", host_shm, mnt], check=True)
        with open(os.path.join(mnt, "other-process-shm"), "w") as f:
            f.write("in use by someone else\n")
        LayerStore(store)                        # reclaims the dead entry
        survived = os.path.exists(os.path.join(host_shm, "other-process-shm"))
        still = _mounts_under(store)
        assert survived and not still, (
            f"the reclaim deleted files inside a mounted filesystem (survived={survived}) "
            f"and left its mount: {still}")
        assert not os.path.exists(os.path.join(store, "tmp", f"{dead}-bootstrap-x"))
    finally:
        for mp in sorted(_mounts_under(store), key=len, reverse=True):
            subprocess.run(["umount", "-l", mp], check=False, capture_output=True)
        subprocess.run(["umount", "-l", host_shm], check=False, capture_output=True)
