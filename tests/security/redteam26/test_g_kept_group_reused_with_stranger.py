"""A memory group whose last member left while a task still held its cgroup (a task
the kernel keeps in D state past the teardown's wait, or anything else holding it busy)
is "kept (reconcile removes it once empty)" and dropped from the table. But reconcile
runs only at the next edge start, nothing retries it meanwhile (a sandbox's own
leftovers have ``_remove_later``), and group names are *reused*: the next create of
that project and class computes the same name (the lowest index free in the table),
``Governor.create`` ``makedirs(exist_ok=True)`` it, and the new sandbox's memory
cgroup is the kept one - shared with the stray task, whose memory is charged against
the new sandbox's limit, which ``_set_group_limit`` sets to the new sandbox's alone.

Repro (fault injection: a host process holds the group's memory cgroup busy): both
members destroyed; a new sandbox of the project lands in the kept cgroup with the
stray task in it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import AsyncIterator

import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from tests.edge.container.conftest import _cleanup, new_sid

from .conftest import read, spec

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]


@pytest.fixture
async def grouped(tmp_path: object, images_dir: str) -> AsyncIterator[ContainerBackend]:
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                         images=DirectoryImages(images_dir), memory_group_size=2)
    try:
        yield b
    finally:
        await _cleanup(b)


async def test_a_kept_group_is_never_handed_to_a_new_sandbox(
        grouped: ContainerBackend) -> None:
    b = grouped
    a, a2, c = new_sid(), new_sid(), new_sid()
    await b.create(a, spec("p", 64))
    await b.create(a2, spec("p", 64))
    kept = b.box(a).cg.dirs["memory"]
    stray = subprocess.Popen(["sleep", "600"])  # noqa: ASYNC220 - the fault: a stray task
    try:
        with open(os.path.join(kept, "cgroup.procs"), "w") as f:  # noqa: ASYNC230
            f.write(str(stray.pid))
        await b.destroy(a)
        await b.destroy(a2)
        assert os.path.isdir(kept)                      # busy: kept
        await b.create(c, spec("p", 64))
        mine = b.box(c).cg.dirs["memory"]
        tasks = {int(p) for p in read(os.path.join(mine, "cgroup.procs")).split()}
        assert (mine != kept, stray.pid in tasks) == (True, False), (
            f"new sandbox {c} got the kept group cgroup {kept} (stray task "
            f"{stray.pid} inside: {stray.pid in tasks})")
    finally:
        stray.kill()
        stray.wait()
        await b.destroy(c)
        with contextlib.suppress(OSError):
            os.rmdir(kept)
