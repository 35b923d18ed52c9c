"""Found while fixing A3 (fxa): an exec's ``user`` is a host uid on the native and runc
tiers (no user namespace), so the host user with that uid reads the exec's environ (its
env and the sandbox's spec env) and may ptrace it (no Yama on this host). Known, not
fixed (docs/host-security.md "An exec's user is a host uid"): strict xfail for those
tiers; gVisor (Sentry tasks, not host processes) and the native tier with
``user_namespace=True`` (4242 inside is 100000+4242 on the host) are the passing controls.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator

import msgspec
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

#: as a host user: the environ of any process holding the marker
READ = r"""
import os, sys
hits = []
for pid in os.listdir("/proc"):
    if not pid.isdigit():
        continue
    try:
        data = open(f"/proc/{pid}/environ", "rb").read()
    except OSError:
        continue
    if sys.argv[1].encode() in data:
        hits.append(pid)
print(len(hits))
"""

_KNOWN = pytest.mark.xfail(strict=True, reason="known, not fixed (docs/host-security.md): "
                           "no user namespace on the native/runc tiers")


@pytest.fixture(params=[pytest.param("native", marks=_KNOWN),
                        pytest.param("runc", marks=_KNOWN), "gvisor", "native-userns"])
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
                             runtime=request.param.removesuffix("-userns"))
    assert isinstance(b, ContainerBackend)
    try:
        yield b
    finally:
        await _cleanup(b)
        _rmdir_everywhere(f"dsec-{b.cgroup_name}")


async def test_a_exec_user_uid_is_not_a_host_users(backend: ContainerBackend) -> None:
    sid = new_sid()
    userns = "native-userns" in str(backend.root_dir)
    await backend.create(sid, msgspec.structs.replace(SPEC, user_namespace=userns))
    secret = f"sk-live-fxa-{os.getpid()}"
    r = await backend.exec(sid, ExecRequest(argv=("sleep", "5"), env={"API_TOKEN": secret},
                                            user="4242:4242", background=True))
    assert r.exit_code == 0
    await asyncio.sleep(0.3)
    code, out = await asyncio.to_thread(run_as, 4242, READ, secret)
    assert code == 0, out
    assert out.strip() == "0", "host uid 4242 reads the environ of a sandbox exec run as 4242"
