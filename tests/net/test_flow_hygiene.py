"""A slot's flows do not outlive its tenant (REDTEAM-14b #2, #8): released, dropped or
rebuilt slots' conntrack entries are deleted (ctnetlink flush by original source, in the
router netns), and closed TCP flows leave the router's conntrack at once (the flow cap's
``ct count`` does not count TIME_WAIT/CLOSE)."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from dsec.net import netns
from dsec.net.nftwire import Dest4, SlotPolicy
from dsec.net.router import CONNTRACK_TIMEOUTS, Router, Slot
from dsec.net.testinternet import ALLOWED, UDP_ECHO_PORT, Internet

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]


def tracked_from(router_fd: int, src: str) -> int:
    out: list[int] = []

    def run() -> None:  # setns is per thread
        with netns.entered(router_fd), open("/proc/thread-self/net/nf_conntrack") as f:
            out.append(sum(1 for line in f if f" src={src} " in line))
    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out[0]


def udp(slot: Slot, data: bytes, sport: int) -> None:
    with netns.entered(slot.fd):
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with u:
        u.bind(("0.0.0.0", sport))
        u.sendto(data, (ALLOWED, UDP_ECHO_PORT))


def test_release_forgets_the_slots_flows(router: Router, internet: Internet) -> None:
    s = router.take()
    other = router.take()
    pol = SlotPolicy(allow4=(Dest4.of(f"{ALLOWED}/32", "udp", (UDP_ECHO_PORT, UDP_ECHO_PORT)),))
    router.load(s, pol)
    router.load(other, pol)
    for i in range(5):
        udp(s, b"hyg-%d" % i, 41000 + i)
    udp(other, b"hyg-other", 41100)
    assert internet.wait_for(data=b"hyg-other")
    assert tracked_from(router.fd, str(s.addr.sandbox_ip)) == 5
    router.release(s, reusable=True)
    assert tracked_from(router.fd, str(s.addr.sandbox_ip)) == 0
    # another slot's flows are untouched
    assert tracked_from(router.fd, str(other.addr.sandbox_ip)) == 1
    router.release(other, reusable=False)  # dropped: its flows go as well
    assert tracked_from(router.fd, str(other.addr.sandbox_ip)) == 0


def test_closed_tcp_flows_leave_the_router_conntrack(router: Router) -> None:
    def sysctl(key: str) -> str:
        out: list[str] = []

        def run() -> None:
            with netns.entered(router.fd), \
                    open(f"/proc/sys/net/netfilter/nf_conntrack_{key}") as f:
                out.append(f.read().strip())
        t = threading.Thread(target=run)
        t.start()
        t.join()
        return out[0]
    assert {k: sysctl(k) for k in CONNTRACK_TIMEOUTS} == CONNTRACK_TIMEOUTS
    s = router.take()
    router.load(s, SlotPolicy(allow4=(Dest4.of(f"{ALLOWED}/32", "tcp", (80, 80)),)),
                max_connections=5)
    for _ in range(20):
        with netns.entered(s.fd):
            c = socket.create_connection((ALLOWED, 80), timeout=2)
        with c:
            c.sendall(b"x\n")
            c.recv(64)
    time.sleep(0.2)
    assert tracked_from(router.fd, str(s.addr.sandbox_ip)) <= 5
