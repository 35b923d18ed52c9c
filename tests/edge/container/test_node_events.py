"""The container backend under a real EdgeNode: what a client sees as events."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator

import pytest

from dsec.edge.admission import Capacity
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.wire.spec import ExecRequest, SandboxEvent, SandboxSpec

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
    # the usage at that moment, by kind (issue 22): rss was what hit the limit here
    m = re.search(r"rss=(\d+) cache=(\d+) shm=(\d+) bytes, qos=ls", notices[0].detail)
    assert m is not None, notices[0].detail
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


async def _notices(node: EdgeNode, sid: str, reason: str, *, want: int = 1,
                   wait_s: float = 5.0) -> list[SandboxEvent]:
    deadline = asyncio.get_running_loop().time() + wait_s
    while True:
        got = [e for e in node.events(sid) if e.reason == reason]
        if len(got) >= want or asyncio.get_running_loop().time() > deadline:
            return got
        await asyncio.sleep(0.02)


async def test_pids_limit_hit_is_a_rate_limited_notice(node: EdgeNode) -> None:
    info = await node.create(SandboxSpec(backend="container", pids_max=24))
    bomb = "i=0; while [ $i -lt 60 ]; do sleep 30 & i=$((i+1)); done"
    r = await node.exec(info.id, ExecRequest(shell=bomb, timeout_s=30))
    assert b"can't fork" in r.stderr, r  # the shell gives up at the limit
    notices = await _notices(node, info.id, "pids_limit")
    assert len(notices) == 1  # reported by the time the exec returned
    ev = notices[0]
    assert ev.from_state == ev.to_state == "running"
    assert "limit of 24" in ev.detail and "pids_max" in ev.detail, ev.detail
    # more refused forks within the interval: folded, not one event per fork
    for _ in range(3):
        await node.exec(info.id, ExecRequest(shell="sleep 30 & sleep 30 & true", timeout_s=30))
    assert len([e for e in node.events(info.id) if e.reason == "pids_limit"]) == 1
    assert node.get(info.id).state == "running"


async def test_background_fork_bomb_is_noticed_without_another_exec(
        tmp_path: object, images_dir: str) -> None:
    backend = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                               images=DirectoryImages(images_dir), limits_poll_s=0.1)
    n = EdgeNode(NodeConfig(node_id="t1", capacity=Capacity(
        cpu_milli=64_000, memory_bytes=64 << 30, max_sandboxes=8)), backend)
    await n.start()
    try:
        info = await n.create(SandboxSpec(backend="container", pids_max=16))
        await n.exec(info.id, ExecRequest(shell="f(){ f|f& }; f", background=True))
        notices = await _notices(n, info.id, "pids_limit")
        assert len(notices) == 1 and "limit of 16" in notices[0].detail
    finally:
        await n.close()
        await _cleanup(backend)


async def test_tmpfs_holding_the_memory_is_a_notice_with_a_way_out(node: EdgeNode) -> None:
    """/tmp is a tmpfs sized memory_bytes: filled, it holds the whole memory limit and
    every new process is OOM-killed with no output while the sandbox stays "running".
    The notice says so; the way out (the file API needs no process inside) works."""
    info = await node.create(SandboxSpec(backend="container", memory_bytes=64 << 20))
    await node.exec(info.id, ExecRequest(
        shell="dd if=/dev/zero of=/tmp/fill bs=1M count=200", timeout_s=60))
    needs_8m = ExecRequest(argv=("dd", "if=/dev/zero", "of=/dev/null", "bs=8M", "count=1"),
                           timeout_s=30)
    wedged = await node.exec(info.id, needs_8m)
    assert wedged.exit_code == 128 + 9, wedged  # OOM-killed: /tmp holds the memory
    notices = await _notices(node, info.id, "tmpfs_full")
    assert len(notices) == 1, node.events(info.id)
    assert "file API" in notices[0].detail and "/tmp" in notices[0].detail
    assert node.get(info.id).state == "running"
    assert (await node.stats(info.id)).memory_tmpfs_bytes > 48 << 20
    await node.remove(info.id, "/tmp/fill")
    assert (await node.exec(info.id, needs_8m)).exit_code == 0
