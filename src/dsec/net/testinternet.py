"""A fake internet in a network namespace (plan-14 §4.9), for tests, the demo and the
``net`` bench.

Everything here lives in one anonymous netns held by an fd: test hosts on documentation
addresses (203.0.113.0/24, 198.51.100.0/24, and 2001:db8::/32 for IPv6) on its ``lo``, TCP/UDP servers, and an
upstream DNS server. No packet ever goes to a real address: the router's uplink is a veth
into this namespace, and closing the fixture's fd makes the kernel remove the namespace
and every link in it.

Every server logs what it received (``hits``), so a test can assert that a packet *never
arrived* rather than only that the sandbox timed out.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from dnslib import AAAA, QTYPE, RCODE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from dsec.net import netns, rtwire
from dsec.net.kernel import Netlink

# Test hosts (all on the internet netns's lo).
ALLOWED = "203.0.113.1"
SIBLING = "203.0.113.2"
CIDR_IN = "203.0.113.17"  # inside 203.0.113.16/30
CIDR_OUT = "203.0.113.20"  # just outside it
DNS_UPSTREAM = "203.0.113.53"
OTHER = "198.51.100.7"
HOSTS = (ALLOWED, SIBLING, CIDR_IN, CIDR_OUT, DNS_UPSTREAM, OTHER)
# IPv6 test hosts (a router with IPv6 reaches them through NAT66; one without, never)
ALLOWED6 = "2001:db8::1"
SIBLING6 = "2001:db8::2"
CIDR6_IN = "2001:db8::11"  # inside 2001:db8::10/127
CIDR6_OUT = "2001:db8::12"  # the next address, just outside it
V6ONLY = "2001:db8::66"  # v6only.test: an AAAA record and no A
HOSTS6 = (ALLOWED6, SIBLING6, CIDR6_IN, CIDR6_OUT, V6ONLY)

TCP_REPLY_PORTS = (80, 443, 8080)  # answer "ok <dst>:<port>" and close
TCP_ECHO_PORT = 7
TCP_SINK_PORT = 5001  # read and drop (throughput)
UDP_ECHO_PORT = 9999

ZONE: dict[str, str] = {
    "allowed.test.": ALLOWED,
    "sibling.test.": SIBLING,
    "rebind.test.": "127.0.0.1",
    "meta.test.": "169.254.169.254",
    "private.test.": "10.1.2.3",
    "cidr.test.": CIDR_IN,
}
ZONE6: dict[str, str] = {
    "allowed.test.": ALLOWED6,
    "v6only.test.": V6ONLY,
    "rebind6.test.": "::1",
    "pool6.test.": "fd00:d5ec::3",
}


@dataclass(frozen=True, slots=True)
class Hit:
    """Something that arrived at a server of the internet."""

    proto: str  # "tcp" | "udp" | "dns"
    src: str
    dst: str
    port: int
    data: bytes


@dataclass
class Internet:
    fd: int
    hits: list[Hit] = field(default_factory=list)
    dns_queries: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _socks: list[socket.socket] = field(default_factory=list)
    _dns: list[DNSServer] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- assertions helpers

    def arrived(self, *, dst: str | None = None, port: int | None = None,
                data: bytes | None = None, proto: str | None = None) -> list[Hit]:
        with self._lock:
            hits = list(self.hits)
        return [h for h in hits if (dst is None or h.dst == dst)
                and (port is None or h.port == port)
                and (proto is None or h.proto == proto)
                and (data is None or data in h.data)]

    def wait_for(self, timeout: float = 2.0, **kw: object) -> list[Hit]:
        deadline = time.monotonic() + timeout
        while True:
            got = self.arrived(**kw)  # type: ignore[arg-type]
            if got or time.monotonic() > deadline:
                return got
            time.sleep(0.01)

    def _hit(self, h: Hit) -> None:
        with self._lock:
            self.hits.append(h)

    # -- lifecycle

    def close(self) -> None:
        self._stop.set()
        for d in self._dns:
            d.stop()
        for t in self._threads:
            t.join(timeout=5)
        for s in self._socks:
            s.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _serve(inet: Internet, sel: selectors.DefaultSelector) -> None:
    conns: dict[socket.socket, tuple[str, str, int]] = {}
    while not inet._stop.is_set():
        for key, _ in sel.select(timeout=0.1):
            s: socket.socket = key.fileobj  # type: ignore[assignment]
            kind = key.data
            try:
                if kind == "udp":
                    data, peer = s.recvfrom(65536)
                    # the destination address: which lo address got it (UDP sockets are
                    # per address, see start())
                    dst, port = s.getsockname()[:2]
                    inet._hit(Hit("udp", peer[0], dst, port, data))
                    s.sendto(data, peer)
                elif kind.startswith("listen"):
                    c, peer = s.accept()
                    c.setblocking(False)
                    dst, port = c.getsockname()[:2]
                    conns[c] = (peer[0], dst, port)
                    inet._hit(Hit("tcp", peer[0], dst, port, b""))
                    sel.register(c, selectors.EVENT_READ, kind.replace("listen", "conn"))
                else:
                    src, dst, port = conns[s]
                    try:
                        data = s.recv(1 << 20)
                    except OSError:
                        data = b""
                    if not data:
                        sel.unregister(s)
                        conns.pop(s, None)
                        s.close()
                        continue
                    if kind != "conn-sink":
                        inet._hit(Hit("tcp", src, dst, port, data))
                    if kind == "conn-echo":
                        s.sendall(data)
                    elif kind == "conn-reply":
                        s.sendall(f"ok {dst}:{port}\n".encode())
                        sel.unregister(s)
                        conns.pop(s, None)
                        s.close()
            except (BlockingIOError, InterruptedError):
                continue
    for c in conns:
        c.close()


class _Upstream(BaseResolver):  # type: ignore[misc]  # dnslib has no type hints
    def __init__(self, inet: Internet) -> None:
        self.inet = inet

    def resolve(self, request: DNSRecord, handler: object) -> DNSRecord:
        name = str(request.q.qname).lower()
        with self.inet._lock:
            self.inet.dns_queries.append(name)
        reply = request.reply()
        ip = ZONE.get(name)
        if ip is None and name.endswith(".wild.test."):
            ip = OTHER
        ip6 = ZONE6.get(name)
        if ip is not None and request.q.qtype == QTYPE.A:
            reply.add_answer(RR(name, QTYPE.A, rdata=A(ip), ttl=60))
        elif ip6 is not None and request.q.qtype == QTYPE.AAAA:
            reply.add_answer(RR(name, QTYPE.AAAA, rdata=AAAA(ip6), ttl=60))
        elif ip is None and ip6 is None:
            reply.header.rcode = RCODE.NXDOMAIN
        return reply


def start() -> Internet:
    """Make the namespace, its addresses and servers."""
    fd = netns.new_netns()
    inet = Internet(fd=fd)
    try:
        rt = Netlink.route(fd)
        try:
            hosts = [(ipaddress.ip_address(h), 32) for h in HOSTS] + [
                (ipaddress.ip_address(h), 128) for h in HOSTS6]
            seq = rt.next_seq(1 + len(hosts))
            rt.request(rtwire.messages(
                rtwire.link_up(seq, 1),
                *(rtwire.addr_add(seq + 1 + i, 1, h, plen)
                  for i, (h, plen) in enumerate(hosts)),
            ), list(range(seq, seq + 1 + len(hosts))), "internet addresses")
        finally:
            rt.close()
        sel = selectors.DefaultSelector()
        with netns.entered(fd):
            for port, kind in ([(p, "listen-reply") for p in TCP_REPLY_PORTS]
                               + [(TCP_ECHO_PORT, "listen-echo"), (TCP_SINK_PORT, "listen-sink")]):
                for family, any_addr in ((socket.AF_INET, "0.0.0.0"),
                                         (socket.AF_INET6, "::")):
                    ls = socket.socket(family, socket.SOCK_STREAM)
                    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    if family == socket.AF_INET6:  # v6 only: v4 peers stay unmapped
                        ls.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                    ls.bind((any_addr, port))
                    ls.listen(256)
                    ls.setblocking(False)
                    inet._socks.append(ls)
                    sel.register(ls, selectors.EVENT_READ, kind)
            for h in (*HOSTS, *HOSTS6):  # one UDP socket per address: the reply leaves from it
                us = socket.socket(socket.AF_INET6 if ":" in h else socket.AF_INET,
                                   socket.SOCK_DGRAM)
                us.bind((h, UDP_ECHO_PORT))
                us.setblocking(False)
                inet._socks.append(us)
                sel.register(us, selectors.EVENT_READ, "udp")
            for tcp in (False, True):
                d = DNSServer(_Upstream(inet), address=DNS_UPSTREAM, port=53, tcp=tcp,
                              logger=DNSLogger(logf=lambda _line: None))
                d.start_thread()
                inet._dns.append(d)
        t = threading.Thread(target=_serve, args=(inet, sel), name="internet", daemon=True)
        t.start()
        inet._threads.append(t)
    except BaseException:
        inet.close()
        raise
    return inet


@contextlib.contextmanager
def internet() -> Iterator[Internet]:
    inet = start()
    try:
        yield inet
    finally:
        inet.close()


def links_in(fd: int) -> list[str]:
    """Interface names in netns ``fd`` (for leak checks)."""
    with netns.entered(fd):
        return [name for _i, name in socket.if_nameindex()]
