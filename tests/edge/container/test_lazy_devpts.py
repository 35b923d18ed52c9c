"""Issue 22, ``lazy_devpts``: a sandbox gets its devpts instance (one superblock, which
costs every memory cgroup on the host a shrinker slot) only when the edge first runs a
command on a terminal. Checked: none before (and /dev/ptmx dangles: the documented
trade), the first pty exec mounts the sandbox's OWN instance (nosuid, noexec; not another
sandbox's), later ones reuse it (no stacking, also when two race), and a hostile /dev/pts
(a symlink out of /dev) is refused without mounting anything anywhere."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest

from dsec.edge.admission import Capacity
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.wire.spec import ExecChunk, ExecRequest, ExecResult, PtySize, SandboxSpec

from .conftest import _cleanup

pytestmark = pytest.mark.root

SPEC = SandboxSpec(backend="container", memory_bytes=128 << 20, pids_max=128)


@pytest.fixture
async def node(tmp_path: object, images_dir: str) -> AsyncIterator[EdgeNode]:
    backend = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                               images=DirectoryImages(images_dir), lazy_devpts=True)
    cfg = NodeConfig(node_id="t1", capacity=Capacity(cpu_milli=64_000, memory_bytes=64 << 30,
                                                     max_sandboxes=64))
    n = EdgeNode(cfg, backend)
    await n.start()
    try:
        yield n
    finally:
        await n.close()
        await _cleanup(backend)


async def _sh(node: EdgeNode, sid: str, cmd: str) -> str:
    r = await node.exec(sid, ExecRequest(shell=cmd))
    return (r.stdout + r.stderr).decode()


async def _pty_tty(node: EdgeNode, sid: str) -> str:
    """Run `tty` on a terminal through the process table; its output."""
    info = await node.processes.start(sid, ExecRequest(argv=("/bin/sh", "-c", "tty"),
                                                       pty=PtySize(cols=80, rows=24)))
    out = bytearray()

    async def run() -> None:
        async for item in node.processes.connect(sid, info.pid):
            if isinstance(item, ExecChunk):
                out.extend(item.data)
            elif isinstance(item, ExecResult):
                return
    await asyncio.wait_for(run(), 20)
    return out.decode(errors="replace")


def _devpts(mountinfo: str) -> list[list[str]]:
    return [ln.split() for ln in mountinfo.splitlines() if " - devpts " in ln]


async def test_first_pty_exec_mounts_the_sandbox_s_own_devpts(node: EdgeNode) -> None:
    a = (await node.create(SPEC)).id
    b = (await node.create(SPEC)).id
    before = await _sh(node, a, "cat /proc/self/mountinfo; ls -A /dev/pts; "
                                "[ -e /dev/ptmx ] || echo no-ptmx")
    assert _devpts(before) == [] and "no-ptmx" in before, before
    assert "/dev/pts/" in await _pty_tty(node, a)
    mi = await _sh(node, a, "cat /proc/self/mountinfo")
    [pts] = _devpts(mi)
    assert pts[4] == "/dev/pts" and {"nosuid", "noexec"} <= set(pts[5].split(",")), pts
    # two more pty execs at once: still one instance (the lock; no stacking)
    outs = await asyncio.gather(_pty_tty(node, a), _pty_tty(node, a))
    assert all("/dev/pts/" in o for o in outs), outs
    assert len(_devpts(await _sh(node, a, "cat /proc/self/mountinfo"))) == 1
    # the other sandbox: none yet; then its own instance, not a's superblock
    assert _devpts(await _sh(node, b, "cat /proc/self/mountinfo")) == []
    assert "/dev/pts/" in await _pty_tty(node, b)
    [pts_b] = _devpts(await _sh(node, b, "cat /proc/self/mountinfo"))
    assert pts_b[2] != pts[2], (pts, pts_b)
    # a's terminal numbers are its own: b's devpts lists only b's open ptys
    assert (await _sh(node, b, "ls /dev/pts")).split() == ["ptmx"]


async def test_a_hostile_dev_pts_is_refused_and_nothing_is_mounted(node: EdgeNode) -> None:
    sid = (await node.create(SPEC)).id
    out = await _sh(node, sid, "rmdir /dev/pts && mkdir /tmp/x && ln -s /tmp/x /dev/pts "
                               "&& echo swapped")
    assert "swapped" in out, out
    with pytest.raises(Exception, match="dev/pts"):
        await _pty_tty(node, sid)
    mi = await _sh(node, sid, "cat /proc/self/mountinfo")
    assert _devpts(mi) == [], mi
    # put back as a plain directory: the next pty exec mounts there and works
    await _sh(node, sid, "rm /dev/pts && mkdir /dev/pts")
    assert "/dev/pts/" in await _pty_tty(node, sid)
