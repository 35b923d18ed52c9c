"""Red-team kill -9 tests of a real ``dsec edge --backend container`` at the moments
the durability tests do not hit: mid-pause (the cgroup frozen, the answer not given),
and an edge restarted in another cgroup than the one that made its sandboxes. What the
edge reports must be what the host does, and nothing may be left on the host."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec.bench.faults._edge import EdgeProcess
from dsec.edge.spec import SandboxSpec
from dsec.errors import DsecError

pytestmark = pytest.mark.root

SPEC = SandboxSpec(backend="container", memory_bytes=64 << 20, pids_max=64)


@pytest.fixture
async def edge(tmp_path: object, images_dir: str) -> AsyncIterator[EdgeProcess]:
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    e = EdgeProcess(os.path.join(str(tmp_path), "edge"), images_dir, node_id="rtd")
    try:
        yield e
    finally:
        await e.wipe()
        left = e.census()
        assert left.sandboxes() == set(), f"host still holds {left.counts()}"


def _freezer_state(edge: EdgeProcess, sid: str) -> str:
    for d in edge.census().cgroups.get(sid, ()):
        if os.path.exists(os.path.join(d, "freezer.state")):
            return Path(d, "freezer.state").read_text().strip()
        if os.path.exists(os.path.join(d, "cgroup.freeze")):
            return "FROZEN" if Path(d, "cgroup.freeze").read_text().strip() == "1" else "THAWED"
    raise AssertionError(f"no freezer cgroup for {sid}")


async def test_kill_9_mid_pause_leaves_no_running_sandbox_frozen(edge: EdgeProcess) -> None:
    """kill -9 after the freeze of a pause and before its answer: the journal still says
    ``running`` (the pause was never acknowledged), and the restarted edge adopted the
    sandbox as running while its cgroup stayed frozen - every process in it (a server,
    a background job) stopped for good, with ``running`` reported, until some exec
    happened to thaw it."""
    rnd = random.Random(8)
    await edge.start()
    sid = ""
    for attempt in range(20):
        sid = f"sb-{rnd.getrandbits(48):012x}-{edge.node_id}"
        async with await edge.client() as c:
            await c.create(SPEC, sandbox_id=sid)
            await c.exec(sid, "i=0; while :; do i=$((i+1)); echo $i > /count; "
                              "sleep 0.02; done", background=True)
            while (await c.exec(sid, "test -s /count")).exit_code != 0:
                await asyncio.sleep(0.01)
            pause = asyncio.ensure_future(c.pause(sid))
            while _freezer_state(edge, sid) != "FROZEN" and not pause.done():
                await asyncio.sleep(0.0005)
            edge.kill9()
            try:
                await pause
                answered = True
            except DsecError:
                answered = False
        await edge.start()
        if not answered:
            break
        async with await edge.client() as c:  # the answer won the race: try again
            await c.destroy(sid)
    else:
        pytest.fail("the pause was answered before every kill")
    assert attempt < 19
    async with await edge.client() as c:
        info = await c.get(sid)
        assert info.state in ("running", "paused")
        if info.state == "running":
            first = await c.read_file(sid, "/count")
            await asyncio.sleep(0.3)
            assert await c.read_file(sid, "/count") != first, (
                "adopted as running, but its processes are frozen")
            assert _freezer_state(edge, sid) == "THAWED"
        else:
            assert _freezer_state(edge, sid) == "FROZEN"
