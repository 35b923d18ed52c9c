"""The container bench cleans up after a run that was killed (issue 22: a failed 10,000
run left 9,997 sandboxes running): a bench process killed with -9 while its sandboxes run
leaves them, and the next run's sweep removes them (processes, cgroups, directories)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dsec.bench import BenchContext
from dsec.bench.container import _sweep_dead_runs
from dsec.edge.backends.container.census import cgroup_name_of, take_census

pytestmark = pytest.mark.root

_RUN = r"""
import asyncio, os, sys, tempfile
from dsec import ownership
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.backends.container.testimage import build_busybox_root
from dsec.ids import NodeId, new_sandbox_id
from dsec.wire.spec import SandboxSpec

async def main():
    work = tempfile.mkdtemp(prefix="dsec-bench-container-", dir=sys.argv[1])
    ownership.claim(work)
    build_busybox_root(os.path.join(work, "images", "base"))
    b = ContainerBackend(root_dir=os.path.join(work, "native"),
                         images=DirectoryImages(os.path.join(work, "images")))
    for _ in range(3):
        await b.create(new_sandbox_id(NodeId("bench")),
                       SandboxSpec(backend="container", memory_bytes=32 << 20))
    print(work, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_a_killed_runs_sandboxes_are_removed_by_the_next_run(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    base = str(tmp_path)
    p = subprocess.Popen([sys.executable, "-c", _RUN, base], stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None
        work = p.stdout.readline().decode().strip()
        assert work, "the run did not start"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    root = os.path.join(work, "native")
    left = take_census(root, cgroup_name_of(root))
    assert len(left.sandboxes()) == 3 and len(left.tasks) == 3   # still running
    ctx = BenchContext("container")
    asyncio.run(_sweep_dead_runs(ctx, base))
    after = take_census(root, cgroup_name_of(root))
    assert after.sandboxes() == set(), after.counts()
    assert not os.path.exists(work)
    assert any("removed 3 sandboxes" in n for n in ctx.notes), ctx.notes
