"""A1 (red21a): root inside a gvisor sandbox renames /dev/.dsec (the directory holding the
read-only binds of the exec filter helper, its seccomp program and the timeout-kill
busybox) and plants its own files there. Every later exec then runs the tenant's
"nsexec" in place of the filter helper: with no seccomp filter (Seccomp: 0), and the
timeout kill runs the tenant's "busybox": a timed-out command keeps running.

The read-only bind mounts stop writes to the files, not a rename of their parent
directory (a Sentry tmpfs directory, mode 0777) out of the way.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator

import pytest

from dsec.edge.backends import make_backend
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.wire.spec import ExecRequest, SandboxSpec
from tests.edge.container.conftest import _cleanup
from tests.security.conftest import _rmdir_everywhere, new_sid

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)"),
              pytest.mark.skipif(shutil.which("runsc") is None,
                                 reason="needs runsc (make setup installs it)")]

PLANT = ("mv /dev/.dsec /dev/.x && mkdir /dev/.dsec && "
         "printf '#!/bin/sh\\nshift 2\\nexec \"$@\"\\n' > /dev/.dsec/nsexec && "
         "printf '#!/bin/sh\\nexit 0\\n' > /dev/.dsec/busybox && "
         "chmod 755 /dev/.dsec/nsexec /dev/.dsec/busybox && echo planted")


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


async def _sh(b: ContainerBackend, sid: str, cmd: str, timeout_s: float = 20) -> tuple[int, str]:
    r = await b.exec(sid, ExecRequest(shell=cmd, timeout_s=timeout_s))
    return r.exit_code, (r.stdout + r.stderr).decode(errors="replace")


async def test_sandbox_root_cannot_replace_the_exec_filter_helper(
        backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SandboxSpec(backend="container", memory_bytes=256 << 20,
                                          pids_max=64))
    assert await _sh(backend, sid, "grep Seccomp: /proc/self/status") == (0, "Seccomp:\t2\n")
    code, out = await _sh(backend, sid, PLANT)
    # the rename itself may be refused (the fix): then nothing below can be subverted
    if code == 0 and "planted" in out:
        code, out = await _sh(backend, sid, "grep Seccomp: /proc/self/status")
        assert "Seccomp:\t2" in out, (
            f"after the tenant swapped /dev/.dsec, an exec ran without the seccomp "
            f"filter: {out!r}")
        r = await backend.exec(sid, ExecRequest(shell="sleep 300", timeout_s=1))
        assert r.timed_out
        await asyncio.sleep(0.5)
        _, ps = await _sh(backend, sid, "ps")
        assert "sleep 300" not in ps, f"a timed-out command survived its timeout kill:\n{ps}"
