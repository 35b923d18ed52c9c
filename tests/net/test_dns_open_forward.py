"""Regression (red team, issue 14, REDTEAM-14): in mode ``open`` every query type but A is forwarded raw
(nb: src/dsec/net/resolver.py ``Resolver.answer`` -> ``_forward_raw``) without the
per-sandbox *forward* bucket (20 names/s, burst 100) that bounds every other upstream
query: only the 500/s query bucket applies. Each forward holds an edge socket and a task
until the upstream answers or the 2 s timeout, so one open sandbox asking TXT/MX/... for
distinct names keeps hundreds of the edge's fds open and pushes its whole rate onto the
node's upstream resolver (the one the host itself uses)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator

import pytest

from dsec.net.resolver import Resolver
from dsec.net.testinternet import ALLOWED, DNS_UPSTREAM, ScriptedDns, answer_a

from .test_dns_race import SLOW_PORT
from .test_egress_hostile import Env, env, images_dir, policy

__all__ = ["env", "images_dir"]  # fixtures shared with test_egress_hostile

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

FORWARD_BURST = 5


@pytest.fixture
def slow(env: Env) -> Iterator[ScriptedDns]:
    s = ScriptedDns(env.internet, DNS_UPSTREAM, SLOW_PORT, answer_a(ALLOWED), delay=1.0)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
async def dns(env: Env, slow: ScriptedDns) -> AsyncIterator[Resolver]:
    r = Resolver(env.net, upstreams=[(DNS_UPSTREAM, SLOW_PORT)],
                 upstream_netns_fd=env.internet.fd, timeout_s=3.0,
                 forward_rate=1, forward_burst=FORWARD_BURST)
    await r.start()
    try:
        yield r
    finally:
        await r.close()


async def test_open_mode_non_a_queries_skip_the_forward_bucket(
        env: Env, dns: Resolver, slow: ScriptedDns) -> None:
    """HOLE (nb, net/resolver.py): 100 distinct TXT names from an open sandbox all reach
    the upstream at once, past a forward bucket of burst 5."""
    sid = await env.create(policy(mode="open"))
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, len(os.listdir("/proc/self/fd")))
            await asyncio.sleep(0.02)
    before = len(os.listdir("/proc/self/fd"))
    w = asyncio.ensure_future(watch())
    try:
        await env.sh(sid, "for i in $(seq 1 100); do nslookup -type=txt -timeout=3 "
                     "x$i.data.example >/dev/null 2>&1 & done; wait", timeout_s=60)
    finally:
        w.cancel()
    forwarded = len(slow.queries)
    assert forwarded <= FORWARD_BURST + 5, (
        f"{forwarded} distinct names were forwarded upstream (forward bucket burst "
        f"{FORWARD_BURST}); the edge held up to {peak - before} more fds at once")
