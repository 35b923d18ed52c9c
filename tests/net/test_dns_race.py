"""Regression (red team, issue 14, REDTEAM-14): the resolver decides on a query with the sandbox's policy as it
was when the query arrived, awaits the upstream, then pins the answer into the slot
with that *old* decision (nb: src/dsec/net/resolver.py ``Resolver.answer`` holds
``slot, plan`` across ``await self._resolve(d)``). A ``network_update`` that removes the
name in between flushes the pins, and the late answer pins them back: the name the
update removed stays reachable for the pin's lifetime (max(TTL, 60 s) + 30 s, up to 1 h).
The agent controls the timing (it asks just before the update it expects, or keeps a
slow-resolving wildcard name in flight)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator

import pytest

from dsec.net.resolver import Resolver
from dsec.net.testinternet import ALLOWED, CIDR_IN, DNS_UPSTREAM, ScriptedDns, answer_a

from .test_egress_hostile import Env, env, images_dir, policy

__all__ = ["env", "images_dir"]  # fixtures shared with test_egress_hostile

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

SLOW_PORT = 5353


@pytest.fixture
def slow(env: Env) -> Iterator[ScriptedDns]:
    s = ScriptedDns(env.internet, DNS_UPSTREAM, SLOW_PORT, answer_a(ALLOWED), delay=1.5)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
async def dns(env: Env, slow: ScriptedDns) -> AsyncIterator[Resolver]:
    r = Resolver(env.net, upstreams=[(DNS_UPSTREAM, SLOW_PORT)],
                 upstream_netns_fd=env.internet.fd, timeout_s=5.0)
    await r.start()
    try:
        yield r
    finally:
        await r.close()


async def test_answer_in_flight_across_an_update_pins_a_removed_name(
        env: Env, dns: Resolver, slow: ScriptedDns) -> None:
    """HOLE (nb, net/resolver.py): a lookup in flight when network_update removes its
    name pins the answer after the update; the removed name's address stays reachable."""
    sid = await env.create(policy("allowed.test:80/tcp", f"{CIDR_IN}:80/tcp"))
    look = asyncio.ensure_future(env.sh(sid, "nslookup -timeout=5 allowed.test; echo rc=$?"))
    for _ in range(300):
        if slow.queries:
            break
        await asyncio.sleep(0.01)
    assert slow.queries == ["allowed.test."]
    # the operator closes the name (e.g. end of the environment-building phase)
    gen = env.net.update(sid, policy(f"{CIDR_IN}:80/tcp"))
    assert gen is not None
    await look
    out = await env.tool(sid, "tcp", ALLOWED, "80", "after-update")
    slot = env.net.slot(sid)
    assert slot is not None
    pins = env.router.nft(f"list set inet dsec s{slot.index}q4")
    assert out.startswith("ERR connect"), (
        f"allowed.test was removed by the update (generation {gen}) but {ALLOWED}:80 is "
        f"still reachable: {out!r}; pins now: {pins}")
    assert env.internet.arrived(data=b"after-update") == []


async def test_answer_in_flight_across_destroy_pins_into_the_next_tenant(
        env: Env, dns: Resolver, slow: ScriptedDns) -> None:
    """HOLE (nb, net/resolver.py): the same late pin lands in the slot's *next* tenant
    (another project's sandbox) when the asker was destroyed and its slot recycled while
    the upstream answered: the new tenant reaches an address its policy never named."""
    a = await env.create(policy("allowed.test:80/tcp"))
    slot = env.net.slot(a)
    assert slot is not None
    index = slot.index
    look = asyncio.ensure_future(env.sh(a, "nslookup -timeout=5 allowed.test"))
    for _ in range(300):
        if slow.queries:
            break
        await asyncio.sleep(0.01)
    assert slow.queries == ["allowed.test."]
    look.cancel()
    await env.backend.destroy(a)
    while env.router.table._free and env.router.table._free[0] != index:
        env.router.take()
    b = await env.create(policy(f"{CIDR_IN}:80/tcp"))
    assert env.net.slot(b).index == index  # type: ignore[union-attr]
    await asyncio.sleep(2.0)  # the upstream answers A's question now
    out = await env.tool(b, "tcp", ALLOWED, "80", "next-tenant")
    assert out.startswith("ERR connect"), (
        f"sandbox {b} (policy {CIDR_IN}:80 only) reaches {ALLOWED}:80 through a pin made "
        f"for the slot's previous tenant {a}: {out!r}")
