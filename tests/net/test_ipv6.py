"""IPv6 with the same policy (plan-14 §4.6): a router with ``ipv6=True`` gives each slot a
/127 of ``fd00:d5ec::/48``, NAT66 out of its uplink, and enforces the policies' v6
entries with the v4 rules' twins; one without drops every v6 packet. The fake internet's
hosts have 2001:db8:: addresses; "refused" means nothing arrived there.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.net import netns
from dsec.net.attach import SandboxNetwork, compile_spec
from dsec.net.compile import compile as compile_policy
from dsec.net.nftwire import Dest, Pin4, SlotPolicy
from dsec.net.resolver import Resolver
from dsec.net.router import Router, RouterConfig, Slot
from dsec.net.testinternet import (
    ALLOWED6,
    CIDR6_IN,
    CIDR6_OUT,
    DNS_UPSTREAM,
    SIBLING6,
    UDP_ECHO_PORT,
    V6ONLY,
    Internet,
)
from dsec.net.uplink import NetnsUplink, netns_has_ipv6
from dsec.wire.netpolicy import NetworkPolicy
from dsec.wire.spec import SandboxSpec

from ..edge.container.conftest import _cleanup
from .test_egress_hostile import Env, env, images_dir, policy

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

__all__ = ["env", "images_dir"]  # fixtures shared with test_egress_hostile

_uplinks = itertools.count()


@pytest.fixture
def router6(internet: Internet) -> Iterator[Router]:
    r = Router.create(RouterConfig(pool_min=2, build_batch=2, ipv6=True),
                      NetnsUplink(internet.fd, f"nf6up{next(_uplinks)}"))
    try:
        yield r
    finally:
        r.close()


def tcp6(slot: Slot, host: str, port: int, data: bytes = b"hello6\n",
         timeout: float = 3.0) -> bytes | OSError:
    with netns.entered(slot.fd):
        c = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    c.settimeout(timeout)
    try:
        c.connect((host, port))
        c.sendall(data)
        return c.recv(200)
    except OSError as exc:
        return exc
    finally:
        c.close()


def udp6(slot: Slot, host: str, port: int, data: bytes) -> None:
    with netns.entered(slot.fd):
        u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    with u:
        try:
            u.sendto(data, (host, port))
        except OSError:
            pass  # unreachable: the kernel may say so at once


def test_uplink_with_ipv6_is_detected(internet: Internet) -> None:
    # the fake internet has 2001:db8:: hosts: "auto" turns IPv6 on; a bare netns has only
    # loopback (and no global address): off
    assert netns_has_ipv6(internet.fd)
    fd = netns.new_netns()
    try:
        assert not netns_has_ipv6(fd)
    finally:
        os.close(fd)


def test_v6_cidr_edges_ports_and_nat66(router6: Router, internet: Internet) -> None:
    s = router6.take()
    assert isinstance(tcp6(s, ALLOWED6, 80, timeout=0.5), OSError)  # nothing loaded yet
    router6.load(s, SlotPolicy(allow6=(
        Dest.of(f"{ALLOWED6}/128", "tcp", (80, 80)),
        Dest.of("2001:db8::10/127", "tcp", (80, 80)),
        Dest.of(f"{ALLOWED6}/128", "udp", (UDP_ECHO_PORT, UDP_ECHO_PORT)))))
    assert tcp6(s, ALLOWED6, 80) == f"ok {ALLOWED6}:80\n".encode()
    # NAT66: the internet saw the router's uplink address, not the slot's ULA
    [hit] = internet.arrived(dst=ALLOWED6, port=80, data=b"hello6")
    assert hit.src == str(router6.uplink.router_ip6)
    assert tcp6(s, CIDR6_IN, 80) == f"ok {CIDR6_IN}:80\n".encode()
    for host, port in ((CIDR6_OUT, 80), (SIBLING6, 80), (ALLOWED6, 8080)):
        got = tcp6(s, host, port, data=b"denied6\n", timeout=0.5)
        assert isinstance(got, OSError), (host, port, got)
    udp6(s, ALLOWED6, UDP_ECHO_PORT, b"udp6-allowed")
    udp6(s, SIBLING6, UDP_ECHO_PORT, b"udp6-denied")
    assert internet.wait_for(data=b"udp6-allowed")
    time.sleep(0.2)
    assert internet.arrived(data=b"denied6") == []
    assert internet.arrived(dst=CIDR6_OUT) == [] and internet.arrived(dst=SIBLING6) == []
    assert internet.arrived(data=b"udp6-denied") == []
    # the v4 twin of the policy is empty: v4 stays closed
    assert router6.counters()[s.index] >= 3


def test_v6_deny_wins_and_open_mode_skips_private(router6: Router, internet: Internet
                                                  ) -> None:
    s = router6.take()
    router6.load(s, SlotPolicy(open=True, deny6=(Dest.of(f"{SIBLING6}/128", "tcp"),)))
    assert tcp6(s, ALLOWED6, 80) == f"ok {ALLOWED6}:80\n".encode()  # open: public v6
    assert isinstance(tcp6(s, SIBLING6, 80, data=b"deny6\n", timeout=0.5), OSError)
    # never / private: the router's uplink and the pool (ULA), loopback, link-local,
    # another ULA, NAT64. (A v4-mapped destination is an IPv4 flow: the kernel sends it
    # as IPv4, judged by the v4 rules.)
    a = s.addr
    for host in (str(router6.uplink.peer_ip6), str(router6.uplink.router_ip6),
                 str(a.router_ip6), "fd00:d5ec::3", "::1", "fe80::1", "fd12:3456::1",
                 "64:ff9b::cb00:7101"):
        got = tcp6(s, host, 80, data=b"never6\n", timeout=0.5)
        assert isinstance(got, OSError) or got == b"", (host, got)
    time.sleep(0.1)
    assert internet.arrived(data=b"deny6") == [] and internet.arrived(data=b"never6") == []


def test_v6_pins_and_spoofed_source(router6: Router, internet: Internet) -> None:
    s = router6.take()
    gen = router6.load(s, SlotPolicy())
    router6.pin(s, [Pin4(__import__("ipaddress").IPv6Address(V6ONLY), "tcp", 80, 60_000)],
                generation=gen)
    assert tcp6(s, V6ONLY, 80) == f"ok {V6ONLY}:80\n".encode()
    assert isinstance(tcp6(s, V6ONLY, 8080, timeout=0.5), OSError)
    # a slot's own v6 address is the only source that leaves: bind another (the test
    # holds CAP_NET_ADMIN in the slot netns, which a sandbox does not) and send
    other = router6.take()
    router6.load(other, SlotPolicy(allow6=(Dest.of("2001:db8::/32", "udp"),)))
    with netns.entered(other.fd):
        u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        u.setsockopt(socket.IPPROTO_IPV6, 78, 1)  # IPV6_FREEBIND: any source
    with u:
        u.bind((str(s.addr.sandbox_ip6), 0))
        try:
            u.sendto(b"spoof6", (ALLOWED6, UDP_ECHO_PORT))
        except OSError:
            pass
    udp6(other, ALLOWED6, UDP_ECHO_PORT, b"own6")
    assert internet.wait_for(data=b"own6")
    time.sleep(0.2)
    assert internet.arrived(data=b"spoof6") == []


def test_router_without_ipv6_drops_v6_and_says_so(router: Router, internet: Internet) -> None:
    assert router.config.ipv6 is False
    s = router.take()
    router.load(s, SlotPolicy(open=True, allow6=(Dest.of("2001:db8::/32", "tcp"),)))
    got = tcp6(s, ALLOWED6, 80, data=b"off6\n", timeout=0.5)
    assert isinstance(got, OSError), got
    time.sleep(0.1)
    assert internet.arrived(data=b"off6") == []
    assert [h for h in internet.arrived() if ":" in h.dst] == []
    # the compiled policy still carries its v6 entries (policies are node-independent)
    net = SandboxNetwork(router)
    spec = SandboxSpec(backend="container", network=NetworkPolicy(
        mode="policy", allow=("[2001:db8::1]:80/tcp",)).validate())
    plan = net.prepare(spec)
    assert plan is not None and plan.slot.allow6 and not plan.slot.allow4
    assert compile_spec(spec) == plan
    assert compile_policy(spec.net).sets["a6"]


# ----------------------------------------------------------------- real sandboxes


@pytest.fixture
async def env6(tmp_path: object, images_dir: str, router6: Router,
               internet: Internet) -> AsyncIterator[Env]:
    net = SandboxNetwork(router6)
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                         images=DirectoryImages(images_dir), network=net, limits_poll_s=0.2)
    e = Env(b, router6, net, internet)
    try:
        yield e
    finally:
        await _cleanup(b)


@pytest.fixture
async def dns6(env6: Env) -> AsyncIterator[Resolver]:
    r = Resolver(env6.net, upstreams=[(DNS_UPSTREAM, 53)], upstream_netns_fd=env6.internet.fd,
                 timeout_s=1.0)
    await r.start()
    try:
        yield r
    finally:
        await r.close()


async def test_sandbox_v6_cidr_edge_and_unnamed_literal(env6: Env) -> None:
    assert env6.backend.network_ipv6 is True
    sid = await env6.create(policy("[2001:db8::10/127]:80/tcp", f"[{ALLOWED6}]:80/tcp"))
    assert (await env6.tool(sid, "tcp6", CIDR6_IN, "80", "in6")) == f"OK ok {CIDR6_IN}:80"
    assert (await env6.tool(sid, "tcp6", ALLOWED6, "80", "a6")) == f"OK ok {ALLOWED6}:80"
    for host, port in ((CIDR6_OUT, "80"), (SIBLING6, "80"), (V6ONLY, "80"),
                       (ALLOWED6, "8080")):
        out = await env6.tool(sid, "tcp6", host, port, f"denied6-{host}")
        assert out.startswith("ERR"), (host, port, out)
    await asyncio.sleep(0.2)
    assert env6.internet.arrived(data=b"denied6-") == []
    assert env6.internet.arrived(dst=CIDR6_OUT) == [] and env6.internet.arrived(dst=SIBLING6) == []
    # the sandbox has its /127 and nothing it could autoconfigure
    addrs = await env6.sh(sid, "cat /proc/net/if_inet6")
    slot = env6.net.slot(sid)
    assert slot is not None
    assert slot.addr.sandbox_ip6.exploded.replace(":", "") in addrs
    assert sum(1 for line in addrs.splitlines() if line.split()[3:4] == ["00"]) == 1, addrs


async def test_sandbox_v6_never_reachable(env6: Env) -> None:
    other = await env6.create(policy(f"[{SIBLING6}]:80/tcp"))
    sid = await env6.create(policy(mode="open"))
    them = env6.net.slot(other)
    assert them is not None
    assert (await env6.tool(sid, "tcp6", ALLOWED6, "80", "open6")) == f"OK ok {ALLOWED6}:80"
    up = env6.router.uplink
    for host in (str(up.peer_ip6), str(up.router_ip6), str(them.addr.sandbox_ip6),
                 str(them.addr.router_ip6), "fe80::1%eth0", "::1", "fd00:ec2::254",
                 "fd12::1"):
        out = await env6.tool(sid, "tcp6", host.split("%")[0], "80", "never6")
        assert out.startswith("ERR"), (host, out)
    await asyncio.sleep(0.1)
    assert env6.internet.arrived(data=b"never6") == []


async def test_sandbox_name_with_only_aaaa_is_answered_pinned_and_reachable(
        env6: Env, dns6: Resolver) -> None:
    sid = await env6.create(policy("v6only.test:80/tcp", "rebind6.test:80/tcp"))
    out = await env6.sh(sid, "nslookup -type=AAAA -timeout=2 v6only.test; echo rc=$?")
    print(out)
    assert f"Address: {V6ONLY}" in out and "rc=0" in out, out
    assert (await env6.tool(sid, "tcp6", V6ONLY, "80", "pinned6")) == f"OK ok {V6ONLY}:80"
    # the pin is for the name's port only
    assert (await env6.tool(sid, "tcp6", V6ONLY, "8080", "x")).startswith("ERR")
    # an AAAA pointing at ::1 is refused (rebinding), as an A at 127.0.0.1 is
    out = await env6.sh(sid, "nslookup -type=AAAA -timeout=2 rebind6.test; echo rc=$?")
    print(out)
    assert "Address: ::1" not in out and "rc=1" in out, out
    assert dns6.stats.pins >= 1


async def test_v6_off_node_nothing_v6_leaves_and_aaaa_is_empty(env: Env) -> None:
    r = Resolver(env.net, upstreams=[(DNS_UPSTREAM, 53)], upstream_netns_fd=env.internet.fd,
                 timeout_s=1.0)
    await r.start()
    try:
        sid = await env.create(policy("v6only.test:80/tcp", f"[{ALLOWED6}]:80/tcp",
                                      mode="policy"))
        out = await env.sh(sid, "nslookup -type=AAAA -timeout=2 v6only.test; echo rc=$?")
        assert V6ONLY not in out, out
        out = await env.tool(sid, "tcp6", ALLOWED6, "80", "off6")
        assert out.startswith("ERR"), out
        await asyncio.sleep(0.1)
        assert [h for h in env.internet.arrived() if ":" in h.dst] == []
        # AAAA is answered empty without asking the upstream
        assert r.stats.forwarded == 0 and env.internet.dns_queries == []
    finally:
        await r.close()


def test_reopened_router_keeps_a_slots_v6_policy_and_pins(tmp_path: object,
                                                          internet: Internet) -> None:
    """A restarted edge (Router.open on the pin) sees the slot's v6 elements and v6 pins
    (reconcile counts and re-reads them), keeps its policy (Keep: same generation), and
    the slot's v6 traffic flows as before; a FlushSlot empties the v6 sets too."""
    import ipaddress

    from dsec.net.reconcile import Adopted, FlushSlot, Keep, KernelView, plan

    pin = os.path.join(str(tmp_path), "router6")
    cfg = RouterConfig(pool_min=2, build_batch=2, ipv6=True)
    name = f"nf6up{next(_uplinks)}"
    r1 = Router.open(cfg, NetnsUplink(internet.fd, name), pin)
    slot_fd = -1
    try:
        v1 = r1.reconcile_view()
        for ins in plan([], KernelView(table=v1.table, base_digest=v1.base_digest,
                                       uplink=r1.has_uplink(), reopened=False),
                        r1.base_digest()):
            r1.apply(ins)  # type: ignore[arg-type]
        r1.refill()
        s = r1.take()
        gen = r1.load(s, SlotPolicy(allow6=(Dest.of(f"{ALLOWED6}/128", "tcp", (80, 80)),)),
                      digest="d-v6")
        r1.pin(s, [Pin4(ipaddress.IPv6Address(V6ONLY), "tcp", 80, 60_000)], generation=gen)
        assert tcp6(s, ALLOWED6, 80) == f"ok {ALLOWED6}:80\n".encode()
        slot_fd = os.dup(s.fd)
        r1.close(unpin=False)   # as a crash leaves it
        r2 = Router.open(cfg, NetnsUplink(internet.fd, name), pin)
        try:
            view = r2.reconcile_view()
            seen = view.slots[s.index]
            assert (seen.generation, seen.digest) == (gen, "d-v6")
            assert seen.elements >= 3  # g, l, a6 (and the q6 pin)
            assert [(p.slot, str(p.address), p.proto, p.port) for p in view.pins] == [
                (s.index, V6ONLY, "tcp", 80)]
            steps = plan([Adopted("sb", s.index, "d-v6")],
                         KernelView(table=True, base_digest=view.base_digest,
                                    uplink=r2.has_uplink(), slots=view.slots,
                                    max_mark=view.max_mark),
                         r2.base_digest())
            assert Keep("sb", s.index, gen) in steps, steps
            for ins in steps:
                if not isinstance(ins, Keep):  # attach.py adopts a kept slot
                    r2.apply(ins)  # type: ignore[arg-type]
            slot = r2.adopt(s.index, slot_fd, generation=gen, conn_cap=-1, rate_mbit=None)
            slot_fd = -1  # the router's now
            assert tcp6(slot, ALLOWED6, 80) == f"ok {ALLOWED6}:80\n".encode()
            assert tcp6(slot, V6ONLY, 80) == f"ok {V6ONLY}:80\n".encode()
            r2.apply(FlushSlot(s.index))
            assert r2.reconcile_view().slots[s.index].elements == 0
            assert r2.reconcile_view().pins == ()
        finally:
            r2.close(unpin=True)
    finally:
        r1.close(unpin=True)
        if slot_fd >= 0:
            os.close(slot_fd)
    assert not os.path.exists(pin)


def test_slot_v6_sources_other_than_its_own_are_dropped_before_routing(
        router6: Router) -> None:
    """Link-local forged sources too (fe80::/64 is 2^64 neighbour entries): NS with them
    make no neighbour entry on the slot's router device, and a slot's own NS flood is
    rate-limited per slot (REDTEAM-14b #10; the 2001:db8 case is the red team's repro)."""
    import ipaddress

    from tests.security.redteam14b.test_v6_nd_neigh_flood import neigh_count, ns_frame

    s = router6.take()
    router6.load(s, SlotPolicy())
    with netns.entered(s.fd):
        p = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
        with open("/sys/class/net/eth0/address") as f:
            mac = bytes.fromhex(f.read().strip().replace(":", ""))
    with p:
        p.bind(("eth0", 0))
        for i in range(30):
            p.send(ns_frame(mac, ipaddress.IPv6Address(f"fe80::dead:{i + 1:x}"),
                            s.addr.router_ip6))
    time.sleep(0.3)
    entries = neigh_count(router6.fd, s.addr.ifname)
    assert [e for e in entries if e.startswith("fe80::dead")] == [], entries
    raw6 = router6.nft("list chain inet dsec raw6")
    assert "packets 0 " not in raw6, raw6  # dropped by the anti-spoof, before routing
    # its own source: answered, but at most ND_BURST + ND_RATE/s of them (the router
    # joins the solicited-node group of a fresh slot's address a moment after the build:
    # until then multicast NS are not for it; send until the meter has something to say)
    nd: list[str] = []
    with netns.entered(s.fd):
        p = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    with p:
        p.bind(("eth0", 0))
        for _ in range(40):
            for _ in range(100):
                p.send(ns_frame(mac, s.addr.sandbox_ip6, s.addr.router_ip6))
            nd = [line for line in router6.nft("list chain inet dsec input").splitlines()
                  if "ndrate" in line]
            if nd and "packets 0 " not in nd[0]:
                break
            time.sleep(0.05)
    assert nd and "packets 0 " not in nd[0], nd  # the per-slot ND meter dropped the rest
