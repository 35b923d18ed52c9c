"""Regression (red team, issue 14, REDTEAM-14): a sandbox's concurrent flows are bounded by nothing of its own.
The wire's ``NetworkPolicy`` says ``max_connections`` None means "the node's default,
4,096" (src/dsec/wire/netpolicy.py) and plan-14 §4.7 puts a per-slot ``ct count`` cap in
the router, but the router's rules have none (nb: src/dsec/net/nftrules.py): one sandbox
fills the router netns's conntrack table (shared by every sandbox of the edge, 262,144
here) and every other tenant's new flows are dropped. Shown with 5,000 UDP flows (one
socket each) to an allowed port: all of them are tracked."""

from __future__ import annotations

import os
import threading

import pytest

from dsec.net import netns
from dsec.net.testinternet import ALLOWED, UDP_ECHO_PORT

from .test_egress_hostile import Env, env, images_dir, policy

__all__ = ["env", "images_dir"]  # fixtures shared with test_egress_hostile

pytestmark = [pytest.mark.root, pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

FLOWS = 5000
NODE_DEFAULT = 4096


def _tracked_from(router_fd: int, src: str) -> int:
    out: list[int] = []

    def run() -> None:  # setns is per thread: a thread of its own
        with netns.entered(router_fd), open("/proc/thread-self/net/nf_conntrack") as f:
            out.append(sum(1 for line in f if f" src={src} " in line))
    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out[0]


async def test_a_sandbox_holds_more_flows_than_the_node_default(env: Env) -> None:
    """HOLE (nb, net/nftrules.py): no per-slot flow cap; over 4,096 flows tracked."""
    sid = await env.create(policy(f"{ALLOWED}:{UDP_ECHO_PORT}/udp"))
    slot = env.net.slot(sid)
    assert slot is not None
    await env.sh(sid, f"i=0; while [ $i -lt {FLOWS} ]; do nettool udp {ALLOWED} "
                 f"{UDP_ECHO_PORT} f >/dev/null; i=$((i+1)); done", timeout_s=240)
    n = _tracked_from(env.router.fd, str(slot.addr.sandbox_ip))
    assert n <= NODE_DEFAULT, (f"sandbox {sid} holds {n} tracked flows in the router "
                               f"(node default cap {NODE_DEFAULT}; none enforced)")
