"""Faults: kill -9 of an edge with live sandboxes on slots, a dead DNS upstream.

The router netns and its slots are held by the edge's fds, so a killed edge takes them
with it: nothing is left in the kernel, and a sandbox that outlives its edge is cut off
(fail closed) and says so (``network_lost``) after the restart adopts it.
"""

from __future__ import annotations

import os
import signal

import pytest

from dsec.edge.client import EdgeClient
from dsec.errors import Conflict
from dsec.net.testinternet import ALLOWED, Internet
from dsec.wire.calls import NetworkUpdateOnNode
from dsec.wire.netpolicy import NetworkPolicy
from dsec.wire.spec import SandboxSpec

from .test_edge_door import destroy_all, no_uplink_peers, start_edge, stop_edge

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]


async def test_kill_9_of_the_edge_cuts_its_sandboxes_off_and_leaves_nothing(
        tmp_path: object, internet: Internet) -> None:
    root = str(tmp_path)
    proc, sock = await start_edge(root, internet)
    try:
        async with await EdgeClient.connect(f"unix:{sock}", timeout=30) as c:
            info = await c.create(SandboxSpec(
                backend="container", memory_bytes=128 << 20,
                network=NetworkPolicy(mode="policy", allow=(f"{ALLOWED}:80/tcp",))))
            r = await c.exec(info.id, f"echo hi | nc -w 2 {ALLOWED} 80")
            assert r.stdout.decode().startswith(f"ok {ALLOWED}:80")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        os.unlink(sock)  # the dead edge's socket file (start_edge waits for a new one)
        # the router (held by the dead edge's fds) is gone with its uplink
        assert await no_uplink_peers(internet) == []
    except BaseException:
        await destroy_all(sock)
        raise
    finally:
        stop_edge(proc)
    proc, sock = await start_edge(root, internet)
    try:
        async with await EdgeClient.connect(f"unix:{sock}", timeout=30) as c:
            # adopted, running, and cut off: its eth0 died with the old router
            r = await c.exec(info.id, f"ls /sys/class/net; echo hi | nc -w 2 {ALLOWED} 80; "
                             "echo end")
            out = r.stdout.decode()
            assert out.split()[0] == "lo" and f"ok {ALLOWED}" not in out, out
            with pytest.raises(Conflict, match="lost its network when the edge restarted"):
                await c.network_update(NetworkUpdateOnNode(id=info.id, policy=NetworkPolicy(
                    mode="policy", allow=(f"{ALLOWED}:80/tcp", f"{ALLOWED}:443/tcp"))))
            # a new sandbox gets a slot of the new router
            new = await c.create(SandboxSpec(
                backend="container", memory_bytes=128 << 20,
                network=NetworkPolicy(mode="policy", allow=(f"{ALLOWED}:80/tcp",))))
            r = await c.exec(new.id, f"echo hi | nc -w 2 {ALLOWED} 80")
            assert r.stdout.decode().startswith(f"ok {ALLOWED}:80")
            await c.destroy(info.id)
            await c.destroy(new.id)
    finally:
        await destroy_all(sock)
        stop_edge(proc)
    assert await no_uplink_peers(internet) == []
