"""IPv6 neighbour solicitations from a sandbox with any source address make neighbour
entries in the router - and the neighbour table is global to the host (nf,
net/nftrules.py base_ruleset input: ``icmpv6 type { nd-neighbor-solicit,
nd-neighbor-advert } ip6 hoplimit 255 accept`` with no source check).
Run against nf: PYTHONPATH=/work/wt/rt14b-nf/src:/work/wt/rt14b.

A sandbox holds CAP_NET_RAW (linux.py DEFAULT_CAPS; seccomp refuses only AF_VSOCK), so it
can put any frame on its eth0. For IPv4 the router's strict rp_filter (router.py
_setup_netns) stops ARP from an off-link sender making an entry; IPv6 has no rp_filter,
and the ND accept rule takes a solicitation from any source: ndisc_recv_ns makes a
neighbour entry (STALE) for each source on dsvN. ``nd_tbl`` is one table for every
network namespace of the host (net.ipv6.neigh.default.gc_thresh3 = 1024 exists only in
the init netns): ~1,024 solicitations per 5 s from one sandbox overflow it, and the host
and every other namespace can no longer resolve a new IPv6 neighbour ("neighbour table
overflow") - a host-wide IPv6 outage from inside a sandbox.

Attack (scaled down, 40 packets: no global effect): NS to the router's end of the slot,
hop limit 255, with 40 different source addresses and a source link-layer option.
Expected safe behaviour: no entry for any source but the slot's own address (drop ND
whose source is not the slot's address/link-local, e.g. ``ip6 saddr != { me6,
fe80::/64 } drop`` before the accept, or a per-slot rate limit on ND).
Observed: one neighbour entry per forged source on the slot's router device.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import socket
import struct
import subprocess
import threading
from collections.abc import Iterator

import pytest

from dsec.net import netns
from dsec.net.router import Router, RouterConfig
from dsec.net.testinternet import Internet
from dsec.net.uplink import NetnsUplink

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]

_n = itertools.count()
N = 40


@pytest.fixture
def router6(internet: Internet) -> Iterator[Router]:
    r = Router.create(RouterConfig(pool_min=2, build_batch=2, ipv6=True),
                      NetnsUplink(internet.fd, f"rt14bnd{next(_n)}"))
    try:
        yield r
    finally:
        r.close()


def _csum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return int(~s & 0xFFFF)


def ns_frame(src_mac: bytes, src: ipaddress.IPv6Address,
             target: ipaddress.IPv6Address) -> bytes:
    snm = ipaddress.IPv6Address("ff02::1:ff00:0").packed[:13] + target.packed[13:]
    dst_mac = b"\x33\x33" + snm[12:]
    icmp = struct.pack("!BBHI", 135, 0, 0, 0) + target.packed + \
        struct.pack("!BB", 1, 1) + src_mac  # SLLAO
    pseudo = src.packed + snm + struct.pack("!I", len(icmp)) + b"\0\0\0\x3a"
    c = _csum(pseudo + icmp)
    icmp = icmp[:2] + struct.pack("!H", c) + icmp[4:]
    ip6 = struct.pack("!IHBB", 0x60000000, len(icmp), 58, 255) + src.packed + snm
    return dst_mac + src_mac + b"\x86\xdd" + ip6 + icmp


def neigh_count(fd: int, dev: str) -> list[str]:
    out: list[str] = []

    def run() -> None:
        with netns.entered(fd):
            r = subprocess.run(["ip", "-6", "neigh", "show", "dev", dev],
                               capture_output=True, text=True, check=False)
        out.extend(line for line in r.stdout.splitlines() if line.strip())
    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out


def test_forged_nd_sources_make_no_neighbour_entries(router6: Router) -> None:
    s = router6.take()
    from dsec.net.nftwire import SlotPolicy
    router6.load(s, SlotPolicy())
    target = s.addr.router_ip6
    me6 = s.addr.sandbox_ip6
    err: list[BaseException] = []

    def send() -> None:
        try:
            with netns.entered(s.fd):
                p = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
                with open("/sys/class/net/eth0/address") as f:
                    mac = bytes.fromhex(f.read().strip().replace(":", ""))
            with p:
                p.bind(("eth0", 0))
                for i in range(N):
                    src = ipaddress.IPv6Address(f"2001:db8:dead::{i + 1:x}")
                    p.send(ns_frame(mac, src, target))
        except BaseException as exc:  # noqa: BLE001
            err.append(exc)
    t = threading.Thread(target=send)
    t.start()
    t.join()
    assert not err, err
    import time
    time.sleep(0.3)
    entries = neigh_count(router6.fd, s.addr.ifname)
    forged = [e for e in entries if e.startswith("2001:db8:dead::") and str(me6) not in e]
    assert forged == [], (
        f"{len(forged)} neighbour entries made on {s.addr.ifname} for forged sources "
        f"(global nd_tbl, gc_thresh3 1024): {forged[:3]}")
