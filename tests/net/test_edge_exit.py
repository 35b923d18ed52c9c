"""What a real ``dsec edge`` leaves on the host when it stops: nothing of its state dir.

Everything the edge mounts or attaches under its state dir - the btrfs disk pool and its
loop device, the router netns pin, EROFS layer mounts - is released on every clean exit
(SIGTERM, SIGINT, also one that arrives while it is still starting), as long as no
sandbox is left to adopt. After kill -9 with live sandboxes the next edge finds what
the dead one left (a pool still mounted, or only still attached to its loop device) and
reuses it; destroying everything and stopping then leaves nothing.
"""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import subprocess
import time

import pytest

from dsec.edge.backends.container.census import cgroup_name_of
from dsec.edge.backends.container.disk import loops_of
from dsec.edge.client import EdgeClient
from dsec.image.mount import RUN_ROOT
from dsec.net.testinternet import ALLOWED, Internet
from dsec.wire.netpolicy import NetworkPolicy
from dsec.wire.spec import SandboxSpec

from .test_edge_door import no_uplink_peers, shut, start_edge, stop_edge

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]


def left_on_host(root: str, *elsewhere: str) -> list[str]:
    """Mounts under ``root`` (and under ``elsewhere``: an edge's layer mount roots) and
    loop devices backed by files under it."""
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f
                  if line.split()[4].startswith((root, *elsewhere))]
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    return mounts + [x for x in loops if root in x]


def layer_roots(pid: int) -> list[str]:
    """The layer mount roots (/run/dsec/m*) a running edge claimed (their owner files)."""
    out = []
    for name in os.listdir(RUN_ROOT):
        if name.endswith(".owner"):
            try:
                with open(os.path.join(RUN_ROOT, name)) as f:
                    owner = f.read().split()
            except OSError:
                continue
            if owner and owner[0] == str(pid):
                out.append(os.path.join(RUN_ROOT, name.removesuffix(".owner")) + "/")
    return out


def cgroups_of(root: str) -> list[str]:
    """The container backend's cgroup dirs (every hierarchy) of the edge at ``root``."""
    name = cgroup_name_of(os.path.join(root, "state", "container"))
    return [d for d in glob.glob(f"/sys/fs/cgroup/*/dsec*{name}*")
            + glob.glob(f"/sys/fs/cgroup/*/*/dsec*{name}*") if os.path.isdir(d)]


def cleanup(root: str) -> None:
    """A failed test must not leave its mounts behind it (other tests run here)."""
    for m in reversed(left_on_host(root)):
        if m.startswith("/"):
            subprocess.run(["umount", "-l", m], check=False)
    for dev in loops_of(os.path.join(root, "state", "container", "pool.img")):
        subprocess.run(["losetup", "-d", dev], check=False)


async def stop_leaves_nothing(proc: subprocess.Popen[bytes], sig: int, root: str,
                              internet: Internet, *more_roots: str) -> None:
    layers = [*layer_roots(proc.pid), *more_roots]
    assert layers and cgroups_of(root)
    proc.send_signal(sig)
    assert proc.wait(30) == 0
    # The pool's loop device is detached with its last mount - by the kernel, once the
    # last mount namespace holding the filesystem is gone, which a sandbox killed just
    # before may still be tearing down under load (LOOP_CLR_FD on a busy device marks it
    # to go then: disk.close). So it must be gone within a few seconds, not at once.
    deadline = time.monotonic() + 10
    while left_on_host(root, *layers) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert left_on_host(root, *layers) == []
    assert cgroups_of(root) == []
    assert await no_uplink_peers(internet) == []


async def use(sock: str) -> None:
    async with await EdgeClient.connect(f"unix:{sock}", timeout=30) as c:
        a = await c.create(SandboxSpec(backend="container", memory_bytes=128 << 20,
                                       network=NetworkPolicy(mode="policy",
                                                             allow=(f"{ALLOWED}:80/tcp",))))
        b = await c.create(SandboxSpec(backend="container", memory_bytes=128 << 20))
        assert (await c.exec(a.id, "echo hi")).stdout == b"hi\n"
        await c.destroy(a.id)
        await c.destroy(b.id)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_a_stop_leaves_nothing(tmp_path: object, internet: Internet, sig: int) -> None:
    root = str(tmp_path)
    proc, sock = await start_edge(root, internet)
    try:
        await use(sock)
        assert left_on_host(root)  # the pool, the router pin, the layer mounts
        await stop_leaves_nothing(proc, sig, root, internet)
    finally:
        await shut(proc, sock)
        cleanup(root)


@pytest.mark.parametrize("at", ["state/net/router", "state/container/pool"])
async def test_a_stop_while_starting_leaves_nothing(tmp_path: object, internet: Internet,
                                                    at: str) -> None:
    """SIGTERM the moment the start has made ``at``: the start unwinds, releasing all."""
    root = str(tmp_path)
    proc, _sock = await start_edge(root, internet, wait=False)
    try:
        for _ in range(2000):
            if os.path.exists(os.path.join(root, at)) or proc.poll() is not None:
                break
            await asyncio.sleep(0.002)
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError("the edge did not stop: "
                                 + proc.stderr.read().decode()[-4000:]) from None  # type: ignore[union-attr]
        assert rc in (0, 128 + signal.SIGTERM), proc.stderr.read().decode()  # type: ignore[union-attr]
        assert left_on_host(root) == [] and cgroups_of(root) == []
        assert await no_uplink_peers(internet) == []
    finally:
        stop_edge(proc)
        cleanup(root)


async def test_kill_9_then_restart_then_stop_leaves_nothing(
        tmp_path: object, internet: Internet) -> None:
    root = str(tmp_path)
    pool = os.path.join(root, "state", "container", "pool")
    image = pool + ".img"
    proc, sock = await start_edge(root, internet)
    try:
        async with await EdgeClient.connect(f"unix:{sock}", timeout=30) as c:
            for _ in range(2):
                sid = (await c.create(SandboxSpec(
                    backend="container", memory_bytes=128 << 20, network=NetworkPolicy(
                        mode="policy", allow=(f"{ALLOWED}:80/tcp",))))).id
                await c.exec(sid, "echo x > /root/file")
        dead_layers = layer_roots(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        os.unlink(sock)
        # the dead edge's pool, unmounted here: its live sandboxes' mount namespaces
        # still hold the filesystem, so its loop device stays attached
        assert os.path.ismount(pool) and loops_of(image)
        subprocess.run(["umount", pool], check=True)  # noqa: ASYNC221 - ~ms, test only
        assert not os.path.ismount(pool) and loops_of(image)
        proc, sock = await start_edge(root, internet)
        async with await EdgeClient.connect(f"unix:{sock}", timeout=30) as c:
            ids = [i.id for i in await c.list()]
            assert len(ids) == 2  # adopted on the reused device: their disks are there
            assert len(loops_of(image)) == 1
            for sid in ids:
                assert (await c.exec(sid, "cat /root/file")).stdout == b"x\n"
                await c.destroy(sid)
        await stop_leaves_nothing(proc, signal.SIGTERM, root, internet, *dead_layers)
    finally:
        await shut(proc, sock)
        cleanup(root)
