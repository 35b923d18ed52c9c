"""Regression (red team, issue 14, REDTEAM-14 item 8 and "noticed"): a policy's (and a
ceiling's) ``max_connections`` / ``rate_mbit`` were accepted, stored and checked against
the project ceiling, but nothing in the kernel enforced them. ``max_connections`` is now
the slot's flow cap (``ct count`` in its ``sNk`` chain, every accepted new flow passes
it; the node's default 4,096 when unset), and ``rate_mbit`` a tbf on both ends of the
slot's veth."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from dsec.net.nftrules import DEFAULT_MAX_CONNECTIONS
from dsec.net.testinternet import ALLOWED, TCP_ECHO_PORT, TCP_SINK_PORT

from .test_egress_hostile import Env, env, images_dir, policy

__all__ = ["env", "images_dir"]  # fixtures shared with test_egress_hostile

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]


async def test_max_connections_is_enforced(env: Env) -> None:
    """Was a hole (max_connections=4 accepted, 20 concurrent flows passed), then refused
    at create (4af8663: every create under a ceiling with a cap failed); now the slot's
    flow cap (ct count in its sNk chain) holds it."""
    sid = await env.create(_capped(max_connections=4))
    slot = env.net.slot(sid)
    assert slot is not None
    assert "ct count over 4 " in env.router.nft(f"list chain inet dsec s{slot.index}k")
    n = 20
    # n connections held open at once (each sends one line, then sleeps holding it)
    await env.sh(sid, f"for i in $(seq 1 {n}); do (echo conn-$i; sleep 4) | "
                 f"nc {ALLOWED} {TCP_ECHO_PORT} >/dev/null 2>&1 & done; sleep 1.5; echo ok",
                 timeout_s=30)
    await asyncio.sleep(0.5)
    got = {h.data.split(b"\n")[0] for h in env.internet.arrived(data=b"conn-")}
    assert len(got) <= 4, (f"max_connections=4 but {len(got)} concurrent connections "
                           "reached the internet")


async def test_rate_mbit_is_enforced(env: Env) -> None:
    """Was a hole (rate_mbit=1 accepted, 4 MiB left at veth speed), then refused at
    create; now a tbf on both ends of the slot's veth holds it."""
    sid = await env.create(_capped(rate_mbit=1))
    t0 = time.monotonic()
    out = await env.sh(sid, f"dd if=/dev/zero bs=64k count=64 2>/dev/null | "
                       f"nc {ALLOWED} {TCP_SINK_PORT}; echo rc=$?", timeout_s=60)
    took = time.monotonic() - t0
    assert "rc=0" in out, out
    # 4 MiB = 33.5 Mbit: at 1 Mbit/s at least ~30 s (allow a generous burst)
    assert took >= 20, f"4 MiB left a rate_mbit=1 sandbox in {took:.2f} s"


def _capped(**kw: object):  # type: ignore[no-untyped-def]
    import msgspec

    from dsec.wire.netpolicy import NetworkPolicy

    from .test_egress_hostile import SPEC
    net = NetworkPolicy(mode="policy", allow=(f"{ALLOWED}:{TCP_ECHO_PORT}/tcp",
                                              f"{ALLOWED}:{TCP_SINK_PORT}/tcp"),
                        **kw).validate()  # type: ignore[arg-type]
    return msgspec.structs.replace(SPEC, network=net)


async def test_a_recycled_slot_gets_the_node_default_cap_back(env: Env) -> None:
    """A tenant's own max_connections does not outlive it on the slot: the next tenant
    (no cap named) runs under the node's default."""
    a = await env.create(_capped(max_connections=3))
    slot = env.net.slot(a)
    assert slot is not None
    index = slot.index
    await env.backend.destroy(a)
    while env.router.table._free and env.router.table._free[0] != index:
        env.router.take()
    b = await env.create(policy(f"{ALLOWED}:{TCP_ECHO_PORT}/tcp"))
    got = env.net.slot(b)
    assert got is not None and got.index == index
    chain = env.router.nft(f"list chain inet dsec s{index}k")
    assert f"ct count over {DEFAULT_MAX_CONNECTIONS} " in chain, chain
