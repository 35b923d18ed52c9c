"""Red team 26 G's fix retires a memory group that has no member left but still holds a
task, and "the limits timer" retries its removal. The timer starts only when a sandbox
is watched (`_watch_box`); reconcile retires groups but starts nothing. So an edge
restarted with no sandbox to adopt, whose reconcile finds a group still held by a task
(a member's process still exiting, a straggler), keeps that group - a memcg and its
shrinker map, its name never reused - for as long as no sandbox is created, long after
the task is gone.

Repro: a grouped backend creates a member; a stray task sits in its group's memory
cgroup; the backend is closed (its member left for adoption); a new backend on the root
adopts nothing and reconciles (the member is a leftover: removed; the group retired);
the stray exits; 4 x limits_poll_s later the group's cgroup is still there.

Fix: reconcile (and every retire) starts the limits timer when a group is pending or
retired (`_poll_limits` already reschedules itself for them).
"""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from tests.edge.container.conftest import _cleanup, new_sid

from .conftest import spec

pytestmark = [pytest.mark.root]


async def test_retired_group_is_removed_after_a_restart(tmp_path: object,
                                                        hog_images: str) -> None:
    root = os.path.join(str(tmp_path), "root")
    b1 = ContainerBackend(root_dir=root, images=DirectoryImages(hog_images),
                          memory_group_size=2, limits_poll_s=0.25)
    stray = None
    b2 = None
    try:
        sid = new_sid()
        await b1.create(sid, spec("p", 64))
        gdir = b1.memory_group_of(sid)
        assert gdir
        stray = subprocess.Popen(["sleep", "60"])  # noqa: ASYNC220
        with open(os.path.join(gdir, "cgroup.procs"), "w") as f:  # noqa: ASYNC230
            f.write(str(stray.pid))
        await b1.close()
        b2 = ContainerBackend(root_dir=root, images=DirectoryImages(hog_images),
                              memory_group_size=2, limits_poll_s=0.25)
        await b2.reconcile(set())
        stray.kill()
        stray.wait()
        await asyncio.sleep(1.0)
        assert not os.path.isdir(gdir), (
            f"group {os.path.basename(gdir)} retired at reconcile (a stray task held it) "
            f"is still there 1 s (4 x limits_poll_s) after the task exited: the limits "
            f"timer never started (no sandbox); retired={b2._memgroups.groups.get(gdir)}")
    finally:
        if stray is not None and stray.poll() is None:
            stray.kill()
            stray.wait()
        for b in (b2, b1):
            if b is not None:
                await _cleanup(b)
        if "gdir" in locals() and os.path.isdir(gdir):
            os.rmdir(gdir)
