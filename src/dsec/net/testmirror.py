"""A package mirror on the test internet (plan-14 §4.9 ``mirror.test``), for ``make demo``
and tests: an HTTP server (port 8000) and the DNS server that names it, both inside the internet
namespace of :mod:`dsec.net.testinternet` (documentation addresses only; nothing leaves
the machine).

It serves one package, ``hello-1.0.tar.gz`` (a shell program that says where it came
from), at ``/pool/`` and as a PEP 503 index at ``/simple/hello/``, and logs every request
it answers, so a caller can show that a refused sandbox's request never arrived.
The DNS server answers ``mirror.test`` plus the internet's own zone; point the node's
resolver at it (``--net-dns-upstream 198.51.100.53``).
"""

from __future__ import annotations

import contextlib
import io
import ipaddress
import tarfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final

from dnslib import QTYPE, RCODE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from dsec.net import netns, rtwire
from dsec.net.kernel import Netlink
from dsec.net.testinternet import ZONE, Internet

MIRROR_IP: Final = "198.51.100.80"
MIRROR_DNS: Final = "198.51.100.53"
MIRROR_NAME: Final = "mirror.test"
#: the internet's own servers hold 0.0.0.0:80/443/8080
MIRROR_PORT: Final = 8000
PACKAGE: Final = "hello-1.0.tar.gz"
PACKAGE_PATH: Final = f"/pool/{PACKAGE}"
MIRROR_URL: Final = f"http://{MIRROR_NAME}:{MIRROR_PORT}"
HELLO_OUTPUT: Final = f"hello 1.0, installed from {MIRROR_URL}"

HELLO_SCRIPT = f"""#!/bin/sh
echo "{HELLO_OUTPUT}, running in $(hostname)"
"""


def package_bytes() -> bytes:
    """``hello-1.0.tar.gz``: ``hello/bin/hello`` (mode 0755), made in memory."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = HELLO_SCRIPT.encode()
        info = tarfile.TarInfo("hello/bin/hello")
        info.size, info.mode, info.mtime = len(data), 0o755, 0
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@dataclass
class Mirror:
    files: dict[str, bytes]
    requests: list[tuple[str, str]] = field(default_factory=list)  # (client, path)
    _http: ThreadingHTTPServer | None = None
    _dns: list[DNSServer] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def seen(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self.requests)

    def close(self) -> None:
        for d in self._dns:
            d.stop()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        for t in self._threads:
            t.join(timeout=5)


class _Zone(BaseResolver):  # type: ignore[misc]  # dnslib has no type hints
    def resolve(self, request: DNSRecord, handler: object) -> DNSRecord:
        name = str(request.q.qname).lower()
        reply = request.reply()
        ip = MIRROR_IP if name == f"{MIRROR_NAME}." else ZONE.get(name)
        if ip is None:
            reply.header.rcode = RCODE.NXDOMAIN
        elif request.q.qtype == QTYPE.A:
            reply.add_answer(RR(name, QTYPE.A, rdata=A(ip), ttl=60))
        return reply


def start(inet: Internet) -> Mirror:
    """Add the mirror's addresses to ``inet`` and start its servers (closed with
    :meth:`Mirror.close`; the addresses go with the internet's namespace)."""
    index = f"<html><body><a href=\"../../pool/{PACKAGE}\">{PACKAGE}</a></body></html>\n"
    m = Mirror(files={PACKAGE_PATH: package_bytes(), "/simple/hello/": index.encode(),
                      "/simple/": b'<html><body><a href="hello/">hello</a></body></html>\n'})
    rt = Netlink.route(inet.fd)
    try:
        seq = rt.next_seq(2)
        rt.request(rtwire.messages(
            rtwire.addr_add(seq, 1, ipaddress.IPv4Address(MIRROR_IP), 32),
            rtwire.addr_add(seq + 1, 1, ipaddress.IPv4Address(MIRROR_DNS), 32),
        ), [seq, seq + 1], "mirror addresses")
    finally:
        rt.close()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            with m._lock:
                m.requests.append((self.client_address[0], path))
            body = m.files.get(path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    try:
        with netns.entered(inet.fd):
            m._http = ThreadingHTTPServer((MIRROR_IP, MIRROR_PORT), Handler)
            m._http.daemon_threads = True
            for tcp in (False, True):
                d = DNSServer(_Zone(), address=MIRROR_DNS, port=53, tcp=tcp,
                              logger=DNSLogger(logf=lambda _line: None))
                d.start_thread()
                m._dns.append(d)
        t = threading.Thread(target=m._http.serve_forever, name="mirror", daemon=True)
        t.start()
        m._threads.append(t)
    except BaseException:
        m.close()
        raise
    return m


@contextlib.contextmanager
def mirror(inet: Internet) -> Iterator[Mirror]:
    m = start(inet)
    try:
        yield m
    finally:
        m.close()
