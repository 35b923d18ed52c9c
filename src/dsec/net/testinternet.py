"""A fake internet in a network namespace (plan-14 §4.9), for tests, the demo and the
``net`` bench.

Everything here lives in one anonymous netns held by an fd: test hosts on documentation
addresses (203.0.113.0/24, 198.51.100.0/24, and 2001:db8::/32 for IPv6) on its ``lo``, TCP/UDP servers, and an
upstream DNS server. No packet ever goes to a real address: the router's uplink is a veth
into this namespace, and closing the fixture's fd makes the kernel remove the namespace
and every link in it.

Every server logs what it received (``hits``), so a test can assert that a packet *never
arrived* rather than only that the sandbox timed out.

TLS: ports 443 (HTTPS, and so DoH) and 853 (DoT) on every host are TLS servers with a
self-signed certificate made once per process by ``openssl req`` (:func:`certificate`:
CN ``allowed.test``, also valid for ``*.wild.test``, ``203.0.113.1`` and ``2001:db8::1``).
They log the TCP accept (``tcp``, no data), the ClientHello's SNI (``sni``, data = the
name) and the decrypted request (``https``), and answer ``ok https <dst>:<port>``.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import selectors
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Self

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

TCP_REPLY_PORTS = (80, 8080)  # answer "ok <dst>:<port>" and close
HTTPS_PORT = 443
DOT_PORT = 853
TLS_PORTS = (HTTPS_PORT, DOT_PORT)  # TLS: log SNI and request, answer "ok https ..."
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

    proto: str  # "tcp" | "udp" | "dns" | "sni" | "https"
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
    _tls_conns: set[socket.socket] = field(default_factory=set)
    _tls: ssl.SSLContext | None = None

    @property
    def ca_file(self) -> str:
        """The TLS servers' certificate (self-signed: it is its own CA)."""
        return certificate()[0]

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
        with self._lock:
            live = list(self._tls_conns)
        for c in live:  # a TLS conversation in a thread: its socket closed ends it
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
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
                elif kind == "listen-tls":
                    c, peer = s.accept()
                    dst, port = c.getsockname()[:2]
                    inet._hit(Hit("tcp", peer[0], dst, port, b""))
                    with inet._lock:
                        inet._tls_conns.add(c)
                    threading.Thread(target=_tls_conversation, args=(inet, c, dst, port),
                                     name="internet-tls", daemon=True).start()
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


_cert_lock = threading.Lock()
_cert: tuple[str, str] | None = None


def certificate() -> tuple[str, str]:
    """(certificate, key) files of the TLS servers: made once per process with
    ``openssl req`` (~50 ms, EC P-256), removed at exit."""
    global _cert
    with _cert_lock:
        if _cert is None:
            d = tempfile.mkdtemp(prefix="dsec-testinternet-tls-")
            atexit.register(shutil.rmtree, d, True)
            cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
            r = subprocess.run(
                ["openssl", "req", "-x509", "-newkey", "ec",
                 "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
                 "-subj", "/CN=allowed.test", "-keyout", key, "-out", cert,
                 "-addext", (f"subjectAltName=DNS:allowed.test,DNS:*.wild.test,"
                             f"IP:{ALLOWED},IP:{ALLOWED6}")],
                capture_output=True, text=True, check=False)
            if r.returncode != 0:
                raise RuntimeError(f"openssl req failed: {r.stderr.strip()[-500:]}")
            _cert = (cert, key)
        return _cert


def _tls_context(inet: Internet) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(*certificate())

    def sni(sock: ssl.SSLObject | ssl.SSLSocket, name: str | None,
            _ctx: ssl.SSLContext) -> None:
        try:
            src = sock.getpeername()[0]  # type: ignore[union-attr]
            dst, port = sock.getsockname()[:2]  # type: ignore[union-attr]
        except OSError:
            return
        inet._hit(Hit("sni", src, dst, port, (name or "").encode()))
    ctx.sni_callback = sni
    return ctx


def _tls_conversation(inet: Internet, c: socket.socket, dst: str, port: int) -> None:
    """One TLS connection: handshake (the SNI logged by the callback), read the request,
    answer. Bounded by a 5 s timeout per step; never raises."""
    assert inet._tls is not None
    try:
        c.settimeout(5)
        src = c.getpeername()[0]
        with inet._tls.wrap_socket(c, server_side=True) as t:
            data = t.recv(65536)
            inet._hit(Hit("https", src, dst, port, data))
            body = f"ok https {dst}:{port}\n".encode()
            t.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\nContent-Length: "
                      + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    except (OSError, ssl.SSLError, ValueError):
        pass
    finally:
        c.close()
        with inet._lock:
            inet._tls_conns.discard(c)


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


class ScriptedDns:
    """A DNS server of the test's own in the internet's netns at ``(addr, port)``: each
    query is answered by ``answer(query)`` after ``delay`` seconds, on a thread of its
    own (an upstream under load, or one the agent runs). ``queries`` lists the names
    asked, in order. Close it (or use it as a context manager)."""

    def __init__(self, inet: Internet, addr: str, port: int,
                 answer: Callable[[DNSRecord], DNSRecord], *, delay: float = 0.0) -> None:
        with netns.entered(inet.fd):
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((addr, port))
        self.sock.settimeout(0.1)
        self.answer, self.delay = answer, delay
        self.queries: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                data, peer = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            q = DNSRecord.parse(data)
            self.queries.append(str(q.q.qname))
            threading.Thread(target=self._reply, args=(q, peer), daemon=True).start()

    def _reply(self, q: DNSRecord, peer: tuple[str, int]) -> None:
        if self.delay:
            time.sleep(self.delay)
        with contextlib.suppress(OSError):
            self.sock.sendto(self.answer(q).pack(), peer)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=2)
        self.sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def answer_a(*addrs: str, ttl: int = 300) -> Callable[[DNSRecord], DNSRecord]:
    """A :class:`ScriptedDns` answer: these A records for whatever name is asked."""
    def answer(q: DNSRecord) -> DNSRecord:
        r = q.reply()
        for a in addrs:
            r.add_answer(RR(q.q.qname, QTYPE.A, rdata=A(a), ttl=ttl))
        return r
    return answer


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
        inet._tls = _tls_context(inet)
        with netns.entered(fd):
            for port, kind in ([(p, "listen-reply") for p in TCP_REPLY_PORTS]
                               + [(p, "listen-tls") for p in TLS_PORTS]
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
