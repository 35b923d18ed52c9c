"""The edge's resolver on real sockets in the router netns, upstream in the fake internet.

The asking "sandbox" is a socket opened in a slot's netns (the container cases are in
test_dns_hostile.py). The internet's DNS server logs every name it was asked, so "never
forwarded" is checked on the upstream's side.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import pytest
from dnslib import RCODE, DNSRecord

from dsec.net import netns
from dsec.net.attach import SandboxNetwork
from dsec.net.resolver import Resolver
from dsec.net.router import Router, Slot
from dsec.net.testinternet import ALLOWED, CIDR_IN, DNS_UPSTREAM, SIBLING, Internet
from dsec.wire.netpolicy import NetworkPolicy
from dsec.wire.spec import SandboxSpec

pytestmark = pytest.mark.root

SPEC = SandboxSpec(backend="container")


def spec(*allow: str, deny: tuple[str, ...] = ()) -> SandboxSpec:
    return msgspec.structs.replace(
        SPEC, network=NetworkPolicy(mode="policy", allow=allow, deny=deny).validate())


@dataclass
class Env:
    router: Router
    net: SandboxNetwork
    resolver: Resolver
    internet: Internet

    def attach(self, sid: str, *allow: str, deny: tuple[str, ...] = ()) -> Slot:
        slot = self.net.attach(sid, spec(*allow, deny=deny))
        assert slot is not None
        return slot


@pytest.fixture
async def env(router: Router, internet: Internet) -> AsyncIterator[Env]:
    net = SandboxNetwork(router)
    r = Resolver(net, upstreams=[(DNS_UPSTREAM, 53)], upstream_netns_fd=internet.fd,
                 timeout_s=1.0)
    await r.start()
    try:
        yield Env(router, net, r, internet)
    finally:
        await r.close()


async def ask(slot: Slot, name: str, qtype: str = "A", *, server: str = "10.213.255.254",
              tcp: bool = False, timeout: float = 3.0) -> DNSRecord:
    loop = asyncio.get_running_loop()
    q = DNSRecord.question(name, qtype)
    with netns.entered(slot.fd):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM if tcp else socket.SOCK_DGRAM)
    s.setblocking(False)
    try:
        await asyncio.wait_for(loop.sock_connect(s, (server, 53)), timeout)
        pkt = q.pack()
        if tcp:
            await loop.sock_sendall(s, struct.pack("!H", len(pkt)) + pkt)
            buf = b""
            while len(buf) < 2 or len(buf) < 2 + struct.unpack("!H", buf[:2])[0]:
                buf += await asyncio.wait_for(loop.sock_recv(s, 65537), timeout)
            return DNSRecord.parse(buf[2:])
        await loop.sock_sendall(s, pkt)
        return DNSRecord.parse(await asyncio.wait_for(loop.sock_recv(s, 65535), timeout))
    finally:
        s.close()


def pins(router: Router, slot: Slot) -> str:
    return router.nft(f"list set inet dsec s{slot.index}q4") + router.nft(
        f"list set inet dsec s{slot.index}r4")


def connect(slot: Slot, host: str, port: int, timeout: float = 2.0) -> bytes | OSError:
    with netns.entered(slot.fd):
        c = socket.socket()
    c.settimeout(timeout)
    try:
        c.connect((host, port))
        c.sendall(b"x")
        return c.recv(100)
    except OSError as exc:
        return exc
    finally:
        c.close()


async def test_allowed_name_is_pinned_before_the_answer(env: Env) -> None:
    slot = env.attach("sb-a", "allowed.test:80/tcp")
    assert await asyncio.to_thread(connect, slot, ALLOWED, 80, 0.5) is not None
    r = await ask(slot, "allowed.test")
    assert r.header.rcode == RCODE.NOERROR
    assert [str(rr.rdata) for rr in r.rr] == [ALLOWED]
    # the pin is in the kernel by the time the answer arrived
    assert f"{ALLOWED} . tcp . 80" in pins(env.router, slot)
    got = await asyncio.to_thread(connect, slot, ALLOWED, 80)
    assert got == f"ok {ALLOWED}:80\n".encode()
    assert isinstance(await asyncio.to_thread(connect, slot, ALLOWED, 8080, 0.5), OSError)
    assert env.internet.dns_queries == ["allowed.test."]
    # a cache hit answers without asking upstream and pins nothing new
    pinned = env.resolver.stats.pins
    r2 = await ask(slot, "allowed.test")
    assert [str(rr.rdata) for rr in r2.rr] == [ALLOWED]
    assert env.internet.dns_queries == ["allowed.test."]
    assert env.resolver.stats.pins == pinned and env.resolver.stats.cache_hits == 1


async def test_names_outside_the_policy_are_refused_and_never_forwarded(env: Env) -> None:
    slot = env.attach("sb-b", "allowed.test:80/tcp", "*.wild.test:443/tcp",
                      deny=("deny.wild.test",))
    long = ".".join(["a" * 63] * 3) + ".evil.test"
    for name, qtype in (("sibling.test", "A"), (long, "A"), ("allowed.test", "TXT"),
                        ("allowed.test", "ANY"), ("deny.wild.test", "A")):
        r = await ask(slot, name, qtype)
        assert r.header.rcode == RCODE.REFUSED, (name, qtype)
    # a name over 253 bytes below an allowed wildcard (dnslib will not build one)
    labels = [b"b" * 63] * 4 + [b"wild", b"test"]
    pkt = struct.pack("!HHHHHH", 0x4242, 0x0100, 1, 0, 0, 0) + b"".join(
        bytes([len(x)]) + x for x in labels) + b"\0" + struct.pack("!HH", 1, 1)
    with netns.entered(slot.fd):
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with u:
        u.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(u, ("10.213.255.254", 53))
        await loop.sock_sendall(u, pkt)
        data = await asyncio.wait_for(loop.sock_recv(u, 4096), 3)
    assert data[:2] == b"\x42\x42" and data[3] & 0xF == RCODE.REFUSED
    assert env.internet.dns_queries == []
    assert (await ask(slot, "allowed.test", "AAAA")).rr == []  # NOERROR, no IPv6
    r = await ask(slot, "data.wild.test")
    assert r.header.rcode == RCODE.NOERROR
    assert env.internet.dns_queries == ["data.wild.test."]
    assert env.resolver.stats.refused_by_slot[slot.index] >= 6


async def test_every_dns_path_lands_at_dsec(env: Env) -> None:
    slot = env.attach("sb-c", "allowed.test:80/tcp")
    # a foreign resolver over UDP and TCP: redirected, same policy
    for tcp in (False, True):
        r = await ask(slot, "sibling.test", server=DNS_UPSTREAM, tcp=tcp)
        assert r.header.rcode == RCODE.REFUSED
        r = await ask(slot, "allowed.test", server="198.51.100.7", tcp=tcp)
        assert [str(rr.rdata) for rr in r.rr] == [ALLOWED]
    assert env.internet.dns_queries == ["allowed.test."]
    assert env.internet.arrived(port=53) == []  # nothing reached the internet on 53


async def test_rebinding_answers_are_refused(env: Env) -> None:
    slot = env.attach("sb-d", "rebind.test", "meta.test", "private.test",
                      "cidr.test")
    for name in ("rebind.test", "meta.test", "private.test"):
        r = await ask(slot, name)
        assert r.header.rcode == RCODE.REFUSED, name
    assert [str(rr.rdata) for rr in (await ask(slot, "cidr.test")).rr] == [CIDR_IN]
    # a private address named by a CIDR entry of the policy is kept
    slot2 = env.attach("sb-e", "private.test", "10.1.2.0/24:80/tcp")
    assert [str(rr.rdata) for rr in (await ask(slot2, "private.test")).rr] == ["10.1.2.3"]


async def test_upstream_down_is_servfail_not_a_hang(env: Env) -> None:
    slot = env.attach("sb-f", "allowed.test")
    env.resolver.upstreams = [("198.51.100.200", 53)]  # nothing listens there
    env.resolver.timeout_s = 0.3
    r = await ask(slot, "allowed.test")
    assert r.header.rcode == RCODE.SERVFAIL
    assert env.resolver.stats.servfail == 1


async def test_unknown_askers_and_a_policy_change_drop_pins(env: Env) -> None:
    slot = env.attach("sb-g", "allowed.test:80/tcp", "sibling.test:80/tcp")
    await ask(slot, "allowed.test")
    await ask(slot, "sibling.test")
    assert SIBLING in pins(env.router, slot)
    # the policy drops sibling.test: its pins go with it (re-resolving pins what stays)
    env.net.update("sb-g", spec("allowed.test:80/tcp"))
    assert SIBLING not in pins(env.router, slot) and ALLOWED not in pins(env.router, slot)
    assert isinstance(await asyncio.to_thread(connect, slot, SIBLING, 80, 0.5), OSError)
    assert (await ask(slot, "sibling.test")).header.rcode == RCODE.REFUSED
    await ask(slot, "allowed.test")
    assert ALLOWED in pins(env.router, slot)
    # a free slot (no sandbox) is answered REFUSED
    free = env.router.take()
    assert (await ask(free, "allowed.test")).header.rcode == RCODE.REFUSED


async def test_spoofed_dns_from_another_slot_never_reaches_the_resolver(env: Env) -> None:
    victim = env.attach("sb-v", "allowed.test:80/tcp")
    attacker = env.attach("sb-x", "allowed.test:80/tcp")
    before = env.resolver.stats.queries
    q = DNSRecord.question("allowed.test").pack()
    for src in (str(victim.addr.sandbox_ip), "10.213.255.254", str(attacker.addr.router_ip)):
        udp = struct.pack("!HHHH", 5353, 53, 8 + len(q), 0) + q
        ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0,
                         socket.inet_aton(src), socket.inet_aton("10.213.255.254"))
        with netns.entered(attacker.fd):
            raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
        with raw:
            raw.sendto(ip + udp, ("10.213.255.254", 0))
    # control: the attacker's own address is answered
    assert (await ask(attacker, "allowed.test")).header.rcode == RCODE.NOERROR
    await asyncio.sleep(0.2)
    assert env.resolver.stats.queries == before + 1
    assert "elements" not in pins(env.router, victim)  # nothing pinned for the victim


async def test_a_sandbox_cannot_hold_many_tcp_connections_to_the_resolver(env: Env) -> None:
    slot = env.attach("sb-t", "allowed.test:80/tcp")
    loop = asyncio.get_running_loop()
    held = []
    try:
        for _ in range(env.resolver.tcp_per_sandbox + 4):
            with netns.entered(slot.fd):
                s = socket.socket()
            s.setblocking(False)
            await loop.sock_connect(s, ("10.213.255.254", 53))
            held.append(s)
        await asyncio.sleep(0.2)
        assert sum(env.resolver._tcp_held.values()) == env.resolver.tcp_per_sandbox
        # the ones beyond the cap were closed by the resolver
        closed = 0
        for s in held:
            try:
                if await asyncio.wait_for(loop.sock_recv(s, 10), 0.2) == b"":
                    closed += 1
            except (TimeoutError, OSError):
                pass
        assert closed == 4
    finally:
        for s in held:
            s.close()
    await asyncio.sleep(0.2)
    # all released: queries over TCP work again
    assert (await ask(slot, "allowed.test", tcp=True)).header.rcode == RCODE.NOERROR


async def test_a_query_flood_is_cut_in_the_kernel_and_the_bucket(env: Env) -> None:
    slot = env.attach("sb-f", "allowed.test:80/tcp")
    pkt = DNSRecord.question("allowed.test").pack()
    with netns.entered(slot.fd):
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with u:
        u.connect(("10.213.255.254", 53))
        for _ in range(20_000):
            try:
                u.send(pkt)
            except OSError:  # the socket's buffer: keep flooding
                pass
    await asyncio.sleep(1.0)
    # at most the meter's burst + its rate for the seconds it took reached the resolver
    reached = env.resolver.stats.queries
    assert reached <= 2000 + 1000 * 3, reached
    chain = env.router.nft("list chain inet dsec input")
    [meter] = [ln for ln in chain.splitlines() if "@dnsrate" in ln]
    dropped = int(meter.split("counter packets ")[1].split()[0])
    assert dropped >= 20_000 - 2000 - 1000 * 3 - 2000, meter  # the kernel cut the flood
    # ...and of those, at most the bucket's burst + rate got an answer
    assert env.resolver.stats.answered <= 1000 + 500 * 3
    # the sandbox is served again once it stops
    await asyncio.sleep(2.5)
    assert (await ask(slot, "allowed.test")).header.rcode == RCODE.NOERROR
