"""A1: a host user makes the edge talk to *their* socket instead of the Sentry's.

After an edge restart the gVisor driver decides per sandbox whether its control socket
is "legacy" (in the host netns) by looking for the name ``@runsc-sandbox.<id>@`` in the
host's ``/proc/net/unix`` (RunscDriver._legacy). Abstract names are free for anyone to
bind, and sandbox ids are not secret on the host (docs/host-security.md: cgroup dirs,
mountinfo). So an unprivileged host user binds ``@runsc-sandbox.<id>`` in the host netns
for a sandbox the new edge started (its real socket is in control.netns); after the
edge restarts (re-adopts it) the driver takes the attacker's name for the Sentry's, drops
the ``nsenter`` and runs ``runsc exec`` against it: the attacker receives the exec
request - argv, env (the tenant's secrets) and the donated stdio fds - and can answer it
with anything; ``runsc kill``/``delete`` go to the attacker too.
The secure behaviour: a sandbox started in the control namespace is never driven in the
host's, whatever names a host user binds there.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
from collections.abc import AsyncIterator

import pytest

from dsec.edge.backends import make_backend
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import SPEC, _cleanup
from tests.security.conftest import _rmdir_everywhere, new_sid

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)"),
              pytest.mark.skipif(shutil.which("runsc") is None or shutil.which("setpriv")
                                 is None, reason="needs runsc and setpriv (make setup)")]

#: as a host user: bind the sandbox's control name in the host netns, log each request
#: (with how many fds came along) and answer it "success" (urpc), as the Sentry would
LISTEN = r"""
import socket, sys, json
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind("\0runsc-sandbox." + sys.argv[1] + "\0")
s.listen(8)
print("bound", flush=True)
s.settimeout(20)
try:
    while True:
        c, _ = s.accept()
        c.settimeout(3)
        while True:
            try:
                msg, anc, flags, addr = c.recvmsg(65536, socket.CMSG_SPACE(64*4))
            except OSError:
                break
            if not msg:
                break
            nfds = sum(len(d)//4 for lvl, t, d in anc if t == socket.SCM_RIGHTS)
            print("GOT", nfds, "fds", msg[:3000], flush=True)
            c.sendall(json.dumps({"success": True, "result": None}).encode())
        c.close()
except OSError:
    pass
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


async def test_a_host_user_cannot_capture_an_adopted_sandboxs_runsc_commands(
        backend: ContainerBackend) -> None:
    drv = backend._runsc
    assert drv is not None
    sid = new_sid()
    await backend.create(sid, SPEC)
    py = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "python3"
    spy = subprocess.Popen(  # noqa: ASYNC220 - a spy left running beside the test
        ["setpriv", "--reuid=4242", "--regid=4242", "--clear-groups", "--inh-caps=-all",
         py, "-I", "-c", LISTEN, sid],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd="/")
    try:
        assert spy.stdout is not None
        assert spy.stdout.readline().startswith(b"bound")
        # what a restarted edge knows of its sandboxes' sockets: nothing (its state is new)
        drv._legacy_known.clear()
        drv._host_sockets = None
        r = await backend.exec(sid, ExecRequest(
            shell="echo $SECRET", env={"SECRET": "tenant-secret-4242"}, timeout_s=20))
        got = b""
        if select.select([spy.stdout], [], [], 4.0)[0]:
            got = os.read(spy.stdout.fileno(), 65536)
        # (seen on the current code: Signal, then ExecuteAsync with argv, envv holding
        # SECRET=tenant-secret-4242 and 3 stdio fds, then WaitPID; the forged answers
        # make the tenant's exec "succeed" with empty output)
        assert b"GOT" not in got, \
            f"a host user (uid 4242) received the edge's runsc requests: {got[:600]!r}"
        assert "nsenter" in drv._launcher([sid])[:1], \
            "the driver now runs this sandbox's runsc commands in the host netns"
        assert (r.exit_code, r.stdout) == (0, b"tenant-secret-4242\n")
    finally:
        spy.kill()
        spy.wait()
