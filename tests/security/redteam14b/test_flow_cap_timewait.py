"""The per-sandbox flow cap counts only open flows; closed ones keep filling the router's
conntrack table (nb/nd fix of REDTEAM-14 #8, net/nftrules.py conn_cap_rules:
``ct state new ct count over CAP``).

``ct count`` (nf_conncount) forgets a connection once conntrack sees it closed, but
conntrack itself keeps the entry - TIME_WAIT for 120 s (assured, so never early-dropped).
A sandbox that opens and closes short TCP connections to any allowed server (mode open:
any public one, its own) is never capped, and ~2,200 connections/s from one sandbox keep
the router netns's whole table (262,144 here, shared by every sandbox of the edge) full:
every other tenant's new flows are dropped. The cap meant "one sandbox must not fill it
for the others" (nftrules.DEFAULT_MAX_CONNECTIONS comment).

Attack (scaled down): a slot capped at 10 flows makes 60 short connections, one after
another, to an allowed HTTP server.
Expected safe behaviour: the slot never holds more than its cap's worth of the shared
table (count closed-but-tracked flows too, or shorten the router netns's TIME_WAIT /
close timeouts - nf_conntrack_tcp_timeout_time_wait is per netns - and budget the table
per tenant/slot).
Observed: all 60 connect, and conntrack holds 60 entries from the slot.
"""

from __future__ import annotations

import os
import socket
import threading

import pytest

from dsec.net import netns
from dsec.net.nftwire import Dest4, SlotPolicy
from dsec.net.router import Router, Slot
from dsec.net.testinternet import ALLOWED

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]

CAP = 10
CONNS = 60


def tracked_from(router_fd: int, src: str) -> int:
    out: list[int] = []

    def run() -> None:  # setns is per thread
        with netns.entered(router_fd), open("/proc/thread-self/net/nf_conntrack") as f:
            out.append(sum(1 for line in f if f" src={src} " in line))
    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out[0]


def short_conn(slot: Slot) -> bool:
    with netns.entered(slot.fd):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect((ALLOWED, 80))
        s.sendall(b"x\n")
        s.recv(64)
        return True
    except OSError:
        return False
    finally:
        s.close()


def test_closed_flows_count_against_the_slot_share(router: Router) -> None:
    s = router.take()
    router.load(s, SlotPolicy(allow4=(Dest4.of(f"{ALLOWED}/32", "tcp", (80, 80)),)),
                max_connections=CAP)
    ok = sum(short_conn(s) for _ in range(CONNS))
    held = tracked_from(router.fd, str(s.addr.sandbox_ip))
    assert held <= CAP, (
        f"a slot capped at {CAP} flows made {ok} connections and holds {held} entries of "
        "the router's shared conntrack table (closed flows are not counted by ct count)")
