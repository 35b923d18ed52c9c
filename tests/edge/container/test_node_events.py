"""The container backend under a real EdgeNode: what a client sees as events."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest

from dsec.edge.admission import Capacity
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.edge.spec import ExecRequest, SandboxSpec

from .conftest import _cleanup

pytestmark = pytest.mark.root


@pytest.fixture
async def node(tmp_path: object, images_dir: str) -> AsyncIterator[EdgeNode]:
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    backend = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                               images=DirectoryImages(images_dir))
    cfg = NodeConfig(node_id="t1", capacity=Capacity(cpu_milli=64_000, memory_bytes=64 << 30,
                                                     max_sandboxes=64))
    n = EdgeNode(cfg, backend)
    await n.start()
    try:
        yield n
    finally:
        await n.close()
        await _cleanup(backend)


async def test_oom_kill_inside_is_an_event_and_the_sandbox_keeps_running(node: EdgeNode) -> None:
    info = await node.create(SandboxSpec(backend="container", memory_bytes=64 << 20))
    r = await node.exec(info.id, ExecRequest(
        shell="head -c 500m /dev/zero | tail > /dev/null; echo survived", timeout_s=60))
    assert b"survived" in r.stdout
    for _ in range(200):
        notices = [e for e in node.events(info.id) if e.reason == "oom_kill"]
        if notices:
            break
        await asyncio.sleep(0.01)
    assert len(notices) == 1
    assert notices[0].from_state == notices[0].to_state == "running"
    assert "memory limit of 67108864" in notices[0].detail
    assert node.get(info.id).state == "running"
    r = await node.exec(info.id, ExecRequest(argv=("echo", "ok")))
    assert r.stdout == b"ok\n"


async def test_init_killed_from_outside_ends_with_a_final_event(node: EdgeNode) -> None:
    info = await node.create(SandboxSpec(backend="container"))
    backend = node.backends["container"]
    assert isinstance(backend, ContainerBackend)
    init_pid = backend.init_pid(info.id)
    os.kill(init_pid, 9)
    for _ in range(300):
        if node.get(info.id).state == "destroyed":
            break
        await asyncio.sleep(0.01)
    last = node.events(info.id)[-1]
    assert (last.to_state, last.reason) == ("destroyed", "backend_crash")
    assert f"pid {init_pid}" in last.detail
