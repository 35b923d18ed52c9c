"""A network namespace that plays the *host* between dsec's router and the test internet
(plan-14 §4.9 "fakehost"), so the ``host`` uplink's code (net/uplink.py ``HostUplink``)
runs for real - its nft table, its veth, its sysctls - without touching the real host.

Topology: ``fakehost`` holds ``eth0`` 192.0.2.1/24 (its egress device, default route via
the internet's 192.0.2.2), a second address of its own on ``lo`` (198.51.100.200, one no
router never-set knows about) and TCP decoy listeners on 0.0.0.0 ("apiserver", "edge",
"sshd" ports) that log every connection they accept. Closing it removes the namespace and
its links (the internet's end of the veth goes with it).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import selectors
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

from dsec.net import netns, rtwire
from dsec.net.kernel import Netlink
from dsec.net.testinternet import Internet
from dsec.net.uplink import local_addresses

EGRESS: Final = "eth0"
EGRESS_IP: Final = "192.0.2.1"
INTERNET_SIDE_IP: Final = "192.0.2.2"
EXTRA_IP: Final = "198.51.100.200"
DECOY_PORTS: Final = (22, 6443, 7070)


@dataclass
class FakeHost:
    fd: int
    accepted: list[tuple[str, str, int]] = field(default_factory=list)  # (src, dst, port)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _socks: list[socket.socket] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def addresses(self) -> list[str]:
        """Every IPv4 address of the fake host (read from the kernel, not assumed)."""
        with netns.entered(self.fd), open("/proc/thread-self/net/fib_trie") as f:
            return sorted(local_addresses(f.read()))

    def decoy_hits(self) -> list[tuple[str, str, int]]:
        with self._lock:
            return list(self.accepted)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for s in self._socks:
            s.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _serve(h: FakeHost, sel: selectors.DefaultSelector) -> None:
    while not h._stop.is_set():
        for key, _ in sel.select(timeout=0.1):
            s: socket.socket = key.fileobj  # type: ignore[assignment]
            try:
                c, peer = s.accept()
            except OSError:
                continue
            dst, port = c.getsockname()
            with h._lock:
                h.accepted.append((peer[0], dst, port))
            c.close()


def start(inet: Internet) -> FakeHost:
    """The fake host, wired to ``inet``."""
    h = FakeHost(fd=netns.new_netns())
    try:
        rt = Netlink.route(h.fd)
        try:
            seq = rt.next_seq(1)
            rt.request(rtwire.veth_pair(seq, name=EGRESS, index=0, peer="fhup0",
                                        peer_index=0, peer_netns_fd=inet.fd),
                       [seq], "fakehost egress veth")
            with netns.entered(h.fd):
                eth0 = socket.if_nametoindex(EGRESS)
            s = rt.next_seq(5)
            rt.request(rtwire.messages(
                rtwire.link_up(s, 1),
                rtwire.addr_add(s + 1, 1, ipaddress.IPv4Address(EXTRA_IP), 32),
                rtwire.addr_add(s + 2, eth0, ipaddress.IPv4Address(EGRESS_IP), 24),
                rtwire.link_up(s + 3, eth0),
                rtwire.default_route(s + 4, ipaddress.IPv4Address(INTERNET_SIDE_IP), eth0),
            ), list(range(s, s + 5)), "fakehost addresses")
        finally:
            rt.close()
        irt = Netlink.route(inet.fd)
        try:
            with netns.entered(inet.fd):
                up = socket.if_nametoindex("fhup0")
            s = irt.next_seq(2)
            irt.request(rtwire.messages(
                rtwire.addr_add(s, up, ipaddress.IPv4Address(INTERNET_SIDE_IP), 24),
                rtwire.link_up(s + 1, up),
            ), [s, s + 1], "internet side of the fakehost veth")
        finally:
            irt.close()
        sel = selectors.DefaultSelector()
        with netns.entered(h.fd):
            for port in DECOY_PORTS:
                ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                ls.bind(("0.0.0.0", port))
                ls.listen(64)
                ls.setblocking(False)
                h._socks.append(ls)
                sel.register(ls, selectors.EVENT_READ)
        h._thread = threading.Thread(target=_serve, args=(h, sel), name="fakehost",
                                     daemon=True)
        h._thread.start()
    except BaseException:
        h.close()
        raise
    return h


@contextlib.contextmanager
def fakehost(inet: Internet) -> Iterator[FakeHost]:
    h = start(inet)
    try:
        yield h
    finally:
        h.close()
