"""A3: the gVisor (and runc) tiers put a command's environment on a host command line.

docs/host-security.md: "Command lines carry no key or token (tested)"; for the container
tier "their environment [...] stay closed"; and "gVisor's and the vm tier's guest
processes are not host processes: the host sees only runsc-sandbox/QEMU command lines, no
tenant data". But the runsc (and runc) driver passes every env entry of an exec as
``--env KEY=VALUE`` (and the argv) on the ``runsc exec`` / ``runc exec`` command line - a
host process that lives as long as the command (for a background exec, the detached
waiter ``_charge_waiter`` moves into the sandbox's cgroup lives until it ends). Its
/proc/<pid>/cmdline is 0444: every host user reads the tenant's secrets (an API token in
env) without hidepid - which docs present as only the native tier's argv exposure.
The secure behaviour: no env value reaches a host command line (pass the process spec as
a 0600 file: ``runsc exec --process FILE`` / ``runc exec --process FILE``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator

import pytest

from dsec.edge.backends import make_backend
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import SPEC, _cleanup
from tests.security.conftest import _rmdir_everywhere, new_sid
from tests.security.hx_hardening.probe_user import run_as

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)"),
              pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv")]

#: as a host user: the command lines (never the environ) that hold the marker
READ = r"""
import os, sys
hits = []
for pid in os.listdir("/proc"):
    if not pid.isdigit() or int(pid) == os.getpid():
        continue
    try:
        line = open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        continue
    if sys.argv[1].encode() in line:
        hits.append(line.replace(b"\0", b" ")[:300].decode(errors="replace"))
print(len(hits))
for h in hits:
    print(h)
"""


@pytest.fixture(params=["gvisor", "runc", "native"])
async def backend(request: pytest.FixtureRequest, tmp_path: object,
                  images_dir: str) -> AsyncIterator[ContainerBackend]:
    if request.param != "native" and \
            shutil.which("runsc" if request.param == "gvisor" else "runc") is None:
        pytest.skip(f"needs {request.param}")
    root = os.path.join(str(tmp_path), request.param)
    if request.param == "gvisor":
        b = make_backend("gvisor", root_dir=root, images=DirectoryImages(images_dir))
    else:
        b = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir),
                             runtime="native" if request.param == "native" else "runc")
    assert isinstance(b, ContainerBackend)
    try:
        yield b
    finally:
        await _cleanup(b)
        _rmdir_everywhere(f"dsec-{b.cgroup_name}")


@pytest.mark.parametrize("background", [True, False], ids=["background", "foreground"])
async def test_host_users_cannot_read_a_commands_env_from_host_command_lines(
        backend: ContainerBackend, background: bool) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    secret = f"sk-live-red22a-{os.getpid()}-{int(background)}"
    req = ExecRequest(argv=("sleep", "4"), env={"API_TOKEN": secret}, timeout_s=20,
                      background=background)
    running = asyncio.ensure_future(backend.exec(sid, req))
    try:
        if background:
            assert (await running).exit_code == 0
        else:
            await asyncio.sleep(1.5)              # the command runs: look now
        code, out = await asyncio.to_thread(run_as, 4242, READ, secret)
    finally:
        if not running.done():
            await running
    assert code == 0, out
    n, *lines = out.splitlines()
    assert n == "0", ("a host user (uid 4242) reads the command's env value on host "
                      "command lines:\n" + "\n".join(lines))
