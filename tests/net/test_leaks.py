"""Nothing of a sandbox's network outlives it, and nothing of the router outlives the edge.

Counted, not assumed: router links, nft set elements of every slot, conntrack entries in
the router netns, open fds of this process, slot states - all back to their starting
values after many create/destroy cycles with policies; and a router whose process is
killed -9 takes every link, netns and nft object with it (they are held by its fds).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from dsec.edge.backends.container.disk import loops_of
from dsec.edge.client import EdgeClient
from dsec.net import netns
from dsec.net.kernel import Nft
from dsec.net.router import Router
from dsec.net.testinternet import ALLOWED, Internet, links_in

from .test_edge_door import no_uplink_peers, shut, start_edge
from .test_edge_exit import left_on_host
from .test_egress_hostile import Env, env, images_dir, policy
from .test_net_faults import kill9, probe, spec

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

__all__ = ["env", "images_dir"]


def kernel_census(fd: int, nft: Nft) -> dict[str, int]:
    """What the router netns held by ``fd`` holds: slot links, nft chains, sets and set
    elements of the table, conntrack entries of the pool."""
    table = nft("list table inet dsec")
    elements = sum(len(m.group(1).split(",")) for m in re.finditer(
        r"elements = \{([^}]*)\}", table) if m.group(1).strip())
    with netns.entered(fd), open("/proc/thread-self/net/nf_conntrack") as f:
        conntrack = sum(1 for line in f if "10.213." in line)
    return {
        "links": sum(1 for n in links_in(fd) if n.startswith("dsv")),
        "chains": len(re.findall(r"^\s*chain ", table, re.MULTILINE)),
        "sets": len(re.findall(r"^\s*(?:set|map) ", table, re.MULTILINE)),
        "elements": elements,
        "conntrack": conntrack,
    }


def census(router: Router, root: str) -> dict[str, int]:
    return {
        **kernel_census(router.fd, router.nft),
        "fds": len(os.listdir("/proc/self/fd")),
        "mounts": len(left_on_host(root)),
        "assigned": router.table.count("assigned"),
        "draining": router.table.count("draining"),
    }


@pytest.mark.slow
async def test_create_destroy_cycles_leave_nothing(env: Env) -> None:
    env.router.ensure_free(8)
    sid = await env.create(policy(f"{ALLOWED}:80/tcp"))  # warm: image, zygote, pool
    await env.backend.destroy(sid)
    # the never/private sets are the base table's: their elements are the baseline
    before = census(env.router, env.backend.root_dir)
    n = int(os.environ.get("DSEC_TEST_NET_CYCLES", "300"))
    for i in range(n):
        sid = await env.create(policy(f"{ALLOWED}:80/tcp", "203.0.113.16/30:80/tcp",
                                      "allowed.test:80/tcp" if i % 2 else "198.51.100.7:443/tcp"))
        if i % 50 == 0:  # some of them with traffic, so conntrack has entries to lose
            assert (await env.tool(sid, "tcp", ALLOWED, "80", "x")).startswith("OK")
        await env.backend.destroy(sid)
    after = census(env.router, env.backend.root_dir)
    # conntrack entries of dead flows time out in the kernel (their marks are dead
    # generations already); what must not grow is everything else
    conntrack_after = after.pop("conntrack")
    conntrack_before = before.pop("conntrack")
    # a recycled slot's objects are its own: no chain or set was added for a tenant
    assert after == before, (before, after)
    assert conntrack_after <= conntrack_before + n // 50 + 1
    assert env.net.by_sandbox == {} and env.net.by_slot == {} and env.net.policies == {}
    assert env.net.pins.expiry == {} and env.net.denied.owners == {}
    # slots were recycled, not rebuilt per sandbox
    assert env.router.stats.built <= 16


_CHILD = """
import os, sys, time
from dsec.net.router import Router, RouterConfig
from dsec.net.uplink import NetnsUplink
from dsec.net.nftwire import Dest4, SlotPolicy
fd = os.open(sys.argv[1], os.O_RDONLY)
r = Router.create(RouterConfig(pool_min=8), NetnsUplink(fd, "nbkill0"))
r.refill()
s = r.take()
r.load(s, SlotPolicy(allow4=(Dest4.of("203.0.113.1/32", "tcp", (80, 80)),)))
r.take()  # half-way through a create: taken, nothing loaded
print("ready", flush=True)
time.sleep(600)
"""


def test_kill_9_of_the_router_process_leaves_nothing(internet: Internet) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, f"/proc/{os.getpid()}/fd/{internet.fd}"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        assert "nbkill0" in links_in(internet.fd)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        # the router netns held only by the dead process's fds: gone, and with it the
        # uplink veth (its peer here), every slot veth and every nft object
        deadline = time.monotonic() + 15
        while "nbkill0" in links_in(internet.fd) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "nbkill0" not in links_in(internet.fd)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def edge_census(pid: int, pin: str, root: str) -> dict[str, int]:
    """What a ``dsec edge`` (pid) and its pinned router hold, seen from outside. Slots
    are the pool's (each one link and one fd of the edge; the pool refills to its size
    after a restart), so fds are counted net of them."""
    fd = netns.open_pinned(pin)
    assert fd is not None
    nft = Nft(fd)
    try:
        k = kernel_census(fd, nft)
    finally:
        nft.close()
        os.close(fd)
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return {"elements": k["elements"], "fds_not_slots": fds - k["links"],
            "mounts": len(left_on_host(root)), "conntrack": k["conntrack"]}


async def test_kill_9_with_live_sandboxes_restart_and_destroy_leave_nothing(
        tmp_path: object, internet: Internet) -> None:
    """A real edge: counts after a warm create/destroy; 10 live sandboxes with policies
    (some with traffic) at a kill -9; after the restart adopted them and every one was
    destroyed the counts are the warm ones again; after a stop nothing is left at all."""
    root = str(tmp_path)
    pin = os.path.join(root, "state", "net", "router")
    proc, sock = await start_edge(root, internet)
    try:
        async with await EdgeClient.connect(f"unix:{sock}", timeout=30) as c:
            sid = (await c.create(spec(f"{ALLOWED}:80/tcp"))).id
            await c.destroy(sid)
            await asyncio.sleep(0.5)  # the background refill
            before = edge_census(proc.pid, pin, root)
            ids = []
            for i in range(10):
                ids.append((await c.create(spec(f"{ALLOWED}:80/tcp", "allowed.test:443/tcp",
                                                f"198.51.100.{i}/32:22/tcp"))).id)
                if i % 3 == 0:
                    assert await probe(c, ids[-1], ALLOWED)
        kill9(proc, sock)
        proc, sock = await start_edge(root, internet)
        async with await EdgeClient.connect(f"unix:{sock}", timeout=30) as c:
            assert sorted(i.id for i in await c.list()) == sorted(ids)
            for sid in ids:
                await c.destroy(sid)
            # as warm as the first edge was (a create opens its image's fds, lazily)
            await c.destroy((await c.create(spec(f"{ALLOWED}:80/tcp"))).id)
            await asyncio.sleep(0.5)
            after = edge_census(proc.pid, pin, root)
        conntrack = after.pop("conntrack"), before.pop("conntrack")
        assert after == before, (before, after)
        assert conntrack[0] <= conntrack[1] + 4  # dead flows time out in the kernel
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        # the kernel detaches an autoclear loop device after the pool's unmount from a
        # workqueue (6.x loop driver): give it a moment under load, then nothing may remain
        left = left_on_host(root)
        for _ in range(50):
            if not left:
                break
            await asyncio.sleep(0.1)
            left = left_on_host(root)
        assert left == [] and not os.path.exists(pin)
        assert not loops_of(os.path.join(root, "state", "container", "pool.img"))
        assert await no_uplink_peers(internet) == []
    finally:
        await shut(proc, sock)
