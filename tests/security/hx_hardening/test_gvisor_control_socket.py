"""gVisor's control socket is no door for other host users (hx, "every local user is
hostile").

runsc binds each sandbox's control server on the *abstract* Unix socket
``@runsc-sandbox.<id>`` in the network namespace of whoever ran ``runsc run``. Abstract
sockets have no file mode: any process in that netns may connect. The Sentry's server
lets in peers whose uid equals its own getuid() - and the Sentry runs as 65534 in a user
namespace where every unmapped host uid also reads as 65534 - so, with runsc started in
the host netns, *every* host user could call ``containerManager.ExecuteAsync`` (a root
shell in the sandbox), ``Processes``, ``Checkpoint`` (all its memory into a file of
theirs). The driver now runs every runsc command in a private network namespace of the
edge (container/runsc.py), so the name does not exist where host users are.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import AsyncIterator

import pytest

from dsec.edge.backends import make_backend
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from tests.edge.container.conftest import SPEC, _cleanup
from tests.security.conftest import _rmdir_everywhere, new_sid, sh
from tests.security.hx_hardening.probe_user import UNPRIVILEGED_UIDS, run_as

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)"),
              pytest.mark.skipif(shutil.which("runsc") is None or shutil.which("setpriv")
                                 is None, reason="needs runsc and setpriv (make setup)")]

#: connect to the sandbox's control socket and call a read-only method
CALL = r"""
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(5)
try:
    s.connect("\0runsc-sandbox." + sys.argv[1] + "\0")
except OSError as e:
    print("refused", e.errno); sys.exit(0)
s.sendall(json.dumps({"method": "containerManager.Processes", "arg": sys.argv[1]}).encode())
try:
    print("answered", s.recv(65536).decode(errors="replace"))
except OSError as e:
    print("closed", e)
"""


@pytest.fixture
async def backend(tmp_path: object, images_dir: str) -> AsyncIterator[ContainerBackend]:
    b = make_backend("gvisor", root_dir=os.path.join(str(tmp_path), "groot"),
                     images=DirectoryImages(images_dir))
    assert isinstance(b, ContainerBackend)
    try:
        yield b
    finally:
        await _cleanup(b)
        _rmdir_everywhere(f"dsec-{b.cgroup_name}")


async def test_host_users_cannot_reach_a_gvisor_sandboxs_control_server(
        backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    assert await sh(backend, sid, "echo up") == (0, "up\n")   # the edge's own path works
    for uid in UNPRIVILEGED_UIDS:
        code, out = run_as(uid, CALL, sid)
        assert code == 0, out
        assert out.startswith("refused"), (uid, out)
    # and the edge keeps driving it (exec, then destroy) through the private netns
    assert await sh(backend, sid, "echo still") == (0, "still\n")


def test_the_probe_does_reach_a_listener_in_the_host_netns(tmp_path: object) -> None:
    """The probe is able to fail: a root-owned abstract listener in the host netns (what
    runsc's was) answers an unprivileged peer."""
    import socket
    import threading
    name = f"runsc-sandbox.hx-{os.getpid()}"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind("\0" + name + "\0")
    srv.listen(1)

    def answer() -> None:
        c, _ = srv.accept()
        c.recv(4096)
        c.sendall(json.dumps({"success": True}).encode())
        c.close()
    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        code, out = run_as(UNPRIVILEGED_UIDS[1], CALL, f"hx-{os.getpid()}")
        assert code == 0 and out.startswith("answered"), out
    finally:
        srv.close()
        t.join(5)


SIGNAL = r"""
import os, sys
try:
    os.kill(int(sys.argv[1]), 0); print("may signal")
except PermissionError:
    print("EPERM")
"""


@pytest.mark.parametrize("uid", [
    4242,
    pytest.param(65534, marks=pytest.mark.xfail(
        strict=True, reason="known, not fixed (docs/host-security.md): runsc 2022 runs the "
        "Sentry and its ptrace stubs as host uid 65534 (hard-coded), so a host process "
        "running as nobody may kill or stop them")),
])
async def test_host_users_cannot_signal_the_sentry(backend: ContainerBackend,
                                                   uid: int) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    pids = backend.governor.pids(backend.box(sid).cg)
    assert pids
    for pid in pids:
        code, out = run_as(uid, SIGNAL, str(pid))
        assert (code, out.strip()) == (0, "EPERM"), (uid, pid, out)


async def test_a_sandbox_an_older_edge_started_stays_drivable(
        backend: ContainerBackend) -> None:
    """Upgrade: a sandbox whose ``runsc run`` ran in the host netns (an edge before the
    control namespace) keeps its socket there; the new driver finds it and runs that
    sandbox's runsc commands where it can connect, new ones in the namespace."""
    drv = backend._runsc
    assert drv is not None
    old_sid = new_sid()
    drv._launcher = lambda args=(): []   # type: ignore[method-assign]  # the old driver
    try:
        await backend.create(old_sid, SPEC)
    finally:
        del drv._launcher                     # back to the class's
    drv._legacy_known.clear()                 # as a restarted edge: nothing known
    _, out = run_as(4242, CALL, old_sid)
    assert out.startswith("answered"), out    # (what the upgrade cannot take back)
    assert await sh(backend, old_sid, "echo old") == (0, "old\n")
    assert drv._legacy_known.get(old_sid) is True
    sid = new_sid()
    await backend.create(sid, SPEC)
    assert await sh(backend, sid, "echo new") == (0, "new\n")
    assert run_as(4242, CALL, sid)[1].startswith("refused")


async def test_an_unmarked_sandbox_is_not_driven_at_a_host_users_socket(
        backend: ContainerBackend) -> None:
    """Red team 22 A1, the fallback: a sandbox with no mark (an edge that ran ``runsc
    run`` in the control namespace but wrote none, before the mark existed) and a host
    user's socket under its control name in the host netns: the name alone is not
    trusted (its inode is not the Sentry's), so the commands stay in the namespace."""
    import select
    import subprocess

    from dsec.edge.backends.container.runsc import CONTROL_MARK
    from tests.security.redteam22.test_a_gvisor_legacy_spoof import LISTEN

    drv = backend._runsc
    assert drv is not None
    sid = new_sid()
    await backend.create(sid, SPEC)
    os.unlink(os.path.join(drv.state_root, f"{sid}{CONTROL_MARK}"))
    py = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "python3"
    spy = subprocess.Popen(  # noqa: ASYNC220 - a spy left running beside the test
        ["setpriv", "--reuid=4242", "--regid=4242", "--clear-groups", "--inh-caps=-all",
         py, "-I", "-c", LISTEN, sid], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        cwd="/")
    try:
        assert spy.stdout is not None
        assert spy.stdout.readline().startswith(b"bound")
        drv._legacy_known.clear()                 # as a restarted edge: nothing known
        drv._host_sockets = None
        assert await sh(backend, sid, "echo new") == (0, "new\n")
        assert drv._legacy_known.get(sid) is False
        got = b""
        if select.select([spy.stdout], [], [], 1.0)[0]:
            got = os.read(spy.stdout.fileno(), 65536)
        assert b"GOT" not in got, got[:300]
    finally:
        spy.kill()
        spy.wait()
