"""Red team 19, B5: every sandbox process starts with RLIMIT_NOFILE = SANDBOX_NOFILE (soft
= hard), whatever the edge's own raised limit (``dsec.nofile.raise_nofile``): its init,
a command on the per-exec path, one forked by the exec helper, a pty command; and no
sandbox process can raise it. (The end-to-end repro through a cluster is
tests/security/redteam19/test_b_file_table.py.)"""

from __future__ import annotations

import asyncio
import os
import resource
import time

import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.backends.container.linux import SANDBOX_NOFILE
from dsec.wire.spec import ExecRequest, PtySize

from .conftest import SPEC, _cleanup, new_sid

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

LIMITS = "echo $(ulimit -Sn) $(ulimit -Hn); grep 'open files' /proc/1/limits"


async def test_sandbox_processes_do_not_inherit_the_edges_raised_nofile(
        tmp_path: object, images_dir: str) -> None:
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    # the edge's situation: a soft limit raised far above the sandbox's (root may)
    big = max(before[1], 8 * SANDBOX_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (big, big))
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                         images=DirectoryImages(images_dir))
    try:
        sid = new_sid()
        await b.create(sid, SPEC)
        want = f"{SANDBOX_NOFILE} {SANDBOX_NOFILE}"
        init = f"Max open files {SANDBOX_NOFILE} {SANDBOX_NOFILE} files"
        r = await b.exec(sid, ExecRequest(shell=LIMITS))     # the per-exec path
        assert r.exit_code == 0, r.stderr
        lines = r.stdout.decode().splitlines()
        assert lines[0] == want and lines[1].split() == init.split(), lines
        deadline = time.monotonic() + 10
        while not b.box(sid).helper and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert b.box(sid).helper
        for user in (None, "agent"):                          # forked by the helper
            r = await b.exec(sid, ExecRequest(shell=LIMITS, user=user))
            assert r.exit_code == 0, r.stderr
            assert r.stdout.decode().splitlines()[0] == want, r.stdout
        r = await b.exec(sid, ExecRequest(shell="ulimit -Sn", pty=PtySize(rows=24, cols=80)))
        assert r.stdout.decode().split()[0] == str(SANDBOX_NOFILE), r.stdout
        # the sandbox's root cannot raise it (no CAP_SYS_RESOURCE)
        r = await b.exec(sid, ExecRequest(shell=f"ulimit -Hn {SANDBOX_NOFILE * 4}"))
        assert r.exit_code != 0, r.stdout
        # the edge's own limit is untouched
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (big, big)
    finally:
        await _cleanup(b)
        resource.setrlimit(resource.RLIMIT_NOFILE, before)
