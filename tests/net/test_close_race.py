"""Shared fds and C contexts against the threads that use them (``dsec bench net`` crashed).

- A router closed while its background refill builds: the refill ran
  ``nft_run_cmd_from_buffer`` on the context close() had just freed (heap corruption,
  abort or segfault) and its netlink/netns fd numbers were reused under it (setns into a
  namespace the router never made). Run in a child process: a crash fails the test.
- The net reconcile an edge runs at start deleted the ``dsvN`` link of every slot the
  router had built before it (its pool), leaving their netns without eth0: the bench's
  ~400 "slot N is not reused: cannot inspect its netns: ENODEV".
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import subprocess
import sys

import pytest
from dnslib import DNSRecord

from dsec.errors import BackendError
from dsec.net import netns
from dsec.net.attach import SandboxNetwork
from dsec.net.kernel import Netlink, Nft
from dsec.net.reconcile import (
    Adopted,
    BuildObjects,
    DeleteLink,
    FlushSlot,
    KernelView,
    Lost,
    SlotSeen,
    StartGenerations,
    plan,
)
from dsec.net.router import Router
from dsec.wire.netpolicy import NetworkPolicy
from dsec.wire.spec import SandboxSpec

from .test_resolver import Env, env

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

__all__ = ["env"]

SCRIPT = os.path.join(os.path.dirname(__file__), "closerace.py")


def test_router_closed_under_a_refill_thread_50_times() -> None:
    """50 routers, each closed at a different moment while a thread drains and refills
    its pool: no crash, no setns after close or into a namespace the router did not
    make, the process's fds exactly as before each time (closerace.py)."""
    r = subprocess.run([sys.executable, SCRIPT, "50"], capture_output=True, text=True,
                       timeout=240, check=False)
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert r.stdout.strip().endswith("ok 50")


def test_a_closed_nft_context_or_netlink_socket_refuses_clearly() -> None:
    fd = netns.new_netns()
    try:
        nft = Nft(fd)
        assert "table" not in nft("list tables")
        nft.close()
        nft.close()  # idempotent
        with pytest.raises(BackendError, match="closed"):
            nft("list tables")
        nl = Netlink.route(fd)
        nl.close()
        with pytest.raises(BackendError, match="closed"):
            nl.request(b"\0" * 16, [1], "probe")
    finally:
        os.close(fd)


def test_a_closed_router_refuses_instead_of_using_its_fds(router: Router) -> None:
    router.refill()
    slot = router.take()
    router.close()
    assert router.refill() == 0
    with pytest.raises(BackendError, match="closed"):
        router.take()
    assert router.check(slot) != ""  # never enters a closed (maybe reused) fd number
    with pytest.raises(BackendError, match="closed"):
        router.watch_uplink()  # would put the detached uplink's host objects back


SPEC = SandboxSpec(backend="container", network=NetworkPolicy(
    mode="policy", allow=("203.0.113.1:80/tcp",)).validate())


def test_reconcile_keeps_the_slots_this_router_built(router: Router) -> None:
    """The bench's pattern at n=24: a pool built and policies loaded before the edge's
    start-up reconcile; after it every slot is still as built, the loaded one still holds
    its policy, and every slot is reused when released."""
    net = SandboxNetwork(router)
    router.ensure_free(24)
    for i in range(12):
        net.attach(f"sb-{i}", SPEC)
    loaded = net.slot("sb-0")
    assert loaded is not None
    listed = router.nft(f"list set inet {router.config.table} s{loaded.index}a4")
    assert "203.0.113.1" in listed
    assert net.reconcile() == {}
    assert {i: router.check(s) for i, s in router.slots.items()} == \
        {i: "" for i in router.slots}
    assert "203.0.113.1" in router.nft(
        f"list set inet {router.config.table} s{loaded.index}a4")
    dropped = router.stats.dropped
    for i in range(12):
        net.detach(f"sb-{i}", reusable=True)
    assert router.stats.dropped == dropped  # all recycled, none lost
    assert router.table.count("free") >= 24


def test_plan_never_touches_own_slots() -> None:
    kernel = KernelView(table=True, base_digest="d", uplink=True, slots={
        1: SlotSeen(1, link=True, objects=True, generation=3, elements=5),  # own, loaded
        2: SlotSeen(2, link=True, objects=True),                            # own, free
        7: SlotSeen(7, link=True, objects=True, elements=2),                # leftover
    }, own=frozenset({1, 2}))
    steps = plan([Adopted("sb-x", 2, "dig")], kernel, "d")
    assert steps == [StartGenerations(3), BuildObjects((1, 2, 7), ()), DeleteLink(7),
                     FlushSlot(7), Lost("sb-x", "slot 2 was built anew by this edge (its "
                                                 "dsv2 is not the sandbox's veth)")]


async def test_a_closed_resolver_runs_no_query_after_close(env: Env) -> None:
    """A TCP connection held open across Resolver.close: once close() returns the
    connection is gone and no query reaches the upstream from it (the owner closes the
    upstream netns fd next; a query still running would setns into a reused number)."""
    slot = env.attach("sb-c", "allowed.test:80/tcp")
    loop = asyncio.get_running_loop()
    with netns.entered(slot.fd):
        s = socket.socket()
    s.setblocking(False)
    try:
        await loop.sock_connect(s, ("10.213.255.254", 53))
        await asyncio.sleep(0.1)  # the resolver accepted it: a handler task runs
        asked = env.resolver.stats.forwarded
        await env.resolver.close()
        assert env.resolver._tasks == set()  # nothing of it runs
        pkt = DNSRecord.question("allowed.test").pack()
        try:
            await loop.sock_sendall(s, struct.pack("!H", len(pkt)) + pkt)
            got = await asyncio.wait_for(loop.sock_recv(s, 4096), 2)
        except OSError:
            got = b""
        assert got == b""  # closed by the resolver, never answered
        assert env.resolver.stats.forwarded == asked
    finally:
        s.close()
