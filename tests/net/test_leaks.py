"""Nothing of a sandbox's network outlives it, and nothing of the router outlives the edge.

Counted, not assumed: router links, nft set elements of every slot, conntrack entries in
the router netns, open fds of this process, slot states - all back to their starting
values after many create/destroy cycles with policies; and a router whose process is
killed -9 takes every link, netns and nft object with it (they are held by its fds).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from dsec.net import netns
from dsec.net.router import Router
from dsec.net.testinternet import ALLOWED, Internet, links_in

from .test_egress_hostile import Env, env, images_dir, policy

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

__all__ = ["env", "images_dir"]


def census(router: Router) -> dict[str, int]:
    table = router.nft("list table inet dsec")
    elements = sum(len(m.group(1).split(",")) for m in re.finditer(
        r"elements = \{([^}]*)\}", table) if m.group(1).strip())
    with netns.entered(router.fd), open("/proc/thread-self/net/nf_conntrack") as f:
        conntrack = sum(1 for line in f if "10.213." in line)
    return {
        "links": sum(1 for n in links_in(router.fd) if n.startswith("dsv")),
        "elements": elements,
        "conntrack": conntrack,
        "fds": len(os.listdir("/proc/self/fd")),
        "assigned": router.table.count("assigned"),
        "draining": router.table.count("draining"),
    }


@pytest.mark.slow
async def test_create_destroy_cycles_leave_nothing(env: Env) -> None:
    env.router.ensure_free(8)
    sid = await env.create(policy(f"{ALLOWED}:80/tcp"))  # warm: image, zygote, pool
    await env.backend.destroy(sid)
    # the never/private sets are the base table's: their elements are the baseline
    before = census(env.router)
    n = int(os.environ.get("DSEC_TEST_NET_CYCLES", "300"))
    for i in range(n):
        sid = await env.create(policy(f"{ALLOWED}:80/tcp", "203.0.113.16/30:80/tcp",
                                      "allowed.test:80/tcp" if i % 2 else "198.51.100.7:443/tcp"))
        if i % 50 == 0:  # some of them with traffic, so conntrack has entries to lose
            assert (await env.tool(sid, "tcp", ALLOWED, "80", "x")).startswith("OK")
        await env.backend.destroy(sid)
    after = census(env.router)
    # conntrack entries of dead flows time out in the kernel (their marks are dead
    # generations already); what must not grow is everything else
    conntrack_after = after.pop("conntrack")
    conntrack_before = before.pop("conntrack")
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
