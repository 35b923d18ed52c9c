"""kill -9 of ``dsec up`` with the fncall backend: an acknowledged sandbox (and the
files in its work dir) comes back like a container one does (red-team of issue 12)."""

from __future__ import annotations

import os
import signal

from .test_up_crash import _start


def test_fncall_sandboxes_survive_kill_9_of_dsec_up(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``dsec edge --state-dir`` keeps fncall work dirs in ``<state-dir>/fncall``, but
    ``dsec up`` built its fncall backends with a fresh temp dir per process: after a
    kill -9 every answered fncall sandbox ended ``node_lost`` at the next start and its
    files were deleted with the dead process's temp dir."""
    from dsec import Client

    state = str(tmp_path / "st")
    p = None
    try:
        p, local = _start(state, backend="fncall")
        with Client(local["url"], local["api_key"], session_lease_s=None) as c:
            sb = c.sandboxes.create(detached=True)
            sb.files.write("/kept.txt", b"still here")
            sid = sb.id
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        p, local = _start(state, backend="fncall")
        with Client(local["url"], local["api_key"], session_lease_s=None) as c:
            again = c.sandboxes.get(sid)
            assert (again.state, again.info.reason) == ("running", "adopted"), again.info
            assert again.files.read("/kept.txt") == b"still here"
            again.kill()
    finally:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


def test_fncall_sandboxes_survive_an_in_process_edge_restart(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The same for edges in the runtime's own process (LocalCluster's default): the
    restarted edge built a fresh fncall temp dir, so every sandbox ended ``node_lost``
    and the old work dirs were deleted."""
    from dsec import Client
    from dsec.cluster.local import LocalCluster

    with LocalCluster(backend="fncall", gateway=False, state_dir=str(tmp_path / "st")) as cl, \
            Client(cl.url, cl.api_key, session_lease_s=None) as c:
        sb = c.sandboxes.create(detached=True)
        sb.files.write("/kept.txt", b"still here")
        cl.stop_edge("edge-0")
        cl.start_edge("edge-0")
        again = c.sandboxes.get(sb.id)
        assert again.state == "running", again.info
        assert again.files.read("/kept.txt") == b"still here"
        again.kill()
