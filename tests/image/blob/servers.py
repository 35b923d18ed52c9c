"""Real blob store servers on loopback, started by the tests: moto's standalone S3
server, Debian's nginx serving a directory (GET with Range, WebDAV PUT/DELETE), and a
TCP proxy that injects faults between a client and either of them.

Each server runs in its own temp dir and process and is torn down by its fixture
(tests/image/blob/conftest.py); nothing is left listening or on disk.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import httpx

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, proc: subprocess.Popen[bytes], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before answering")
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not answer on {url} in {timeout} s") from None
            time.sleep(0.05)


class MotoServer:
    """``python -m moto.server`` on 127.0.0.1 (S3 protocol, in-memory)."""

    ACCESS_KEY = "dsec-test-access"
    SECRET_KEY = "dsec-test-secret-never-logged"

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, MOTO_ALLOW_NONEXISTENT_REGION="true")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
            start_new_session=True)
        try:
            _wait_http(self.endpoint + "/moto-api/", self.proc, "moto server")
        except BaseException:
            self.stop()
            raise

    def client(self):  # type: ignore[no-untyped-def]
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=self.ACCESS_KEY,
                            aws_secret_access_key=self.SECRET_KEY)

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


class Nginx:
    """Debian's nginx serving ``root`` on 127.0.0.1: GET/HEAD with Range, and WebDAV
    PUT/DELETE (it writes a PUT body to a temp file and renames it into place, so an
    object appears whole). The master runs as root only to drop its worker to
    ``nobody``; every path is under ``prefix``."""

    def __init__(self, prefix: str, *, dav: bool = True) -> None:
        self.prefix = prefix
        self.root = os.path.join(prefix, "www")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        tmp = os.path.join(prefix, "tmp")
        for d in (self.root, tmp, os.path.join(prefix, "logs")):
            os.makedirs(d, exist_ok=True)
        nobody = pwd.getpwnam("nobody")
        if os.geteuid() == 0:
            for d in (self.root, tmp):
                os.chown(d, nobody.pw_uid, nobody.pw_gid)
            os.chmod(prefix, 0o755)
        user = "user nobody nogroup;" if os.geteuid() == 0 else ""
        dav_conf = ("dav_methods PUT DELETE; create_full_put_path on; "
                    "dav_access user:rw group:r all:r;") if dav else ""
        conf = os.path.join(prefix, "nginx.conf")
        with open(conf, "w") as f:
            f.write(f"""
{user}
worker_processes 1;
daemon off;
pid {prefix}/nginx.pid;
error_log {prefix}/logs/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    client_max_body_size 0;
    keepalive_requests 100000;
    server {{
        listen 127.0.0.1:{self.port};
        root {self.root};
        location / {{ {dav_conf} }}
    }}
}}
""")
        self.proc = subprocess.Popen([NGINX, "-p", prefix, "-c", conf, "-e",
                                      f"{prefix}/logs/error.log"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True)
        try:
            _wait_http(self.url + "/", self.proc, "nginx", timeout=15)
        except BaseException:
            self.stop()
            raise

    def kill(self) -> None:
        """SIGKILL the master and its worker (a server dying mid-request)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        self.kill()
        if self.proc.stderr is not None:
            self.proc.stderr.close()


@dataclass
class Fault:
    """What the proxy does to one client connection.

    ``status``: answer the first request with this HTTP status and close (5xx).
    ``cut_after``: forward this many response bytes (headers included), then close.
    ``flip_at``: flip one response byte at this offset (headers included), then pass.
    ``stall``: accept, read the request, never answer (a hung server).
    ``pause_after``: forward this many response bytes, set ``paused``, then wait for
    ``resume`` before forwarding the rest (to kill the server mid-response)."""

    status: int | None = None
    cut_after: int | None = None
    flip_at: int | None = None
    stall: bool = False
    pause_after: int | None = None
    paused: threading.Event = field(default_factory=threading.Event)
    resume: threading.Event = field(default_factory=threading.Event)


class FaultProxy:
    """A TCP proxy on 127.0.0.1 to ``upstream`` port. Each new client connection takes
    the next :class:`Fault` from :attr:`faults` (none left: pass through). ``conns``
    counts connections, so a test can see how many tries a client made."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.faults: deque[Fault] = deque()
        self.conns = 0
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = int(self.sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._accept, daemon=True)
        self._t.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self.conns += 1
                fault = self.faults.popleft() if self.faults else Fault()
                self._open.add(c)
            threading.Thread(target=self._serve, args=(c, fault), daemon=True).start()

    def _close(self, *socks: socket.socket) -> None:
        for s in socks:
            with self._lock:
                self._open.discard(s)
            try:
                s.close()
            except OSError:
                pass

    def _serve(self, c: socket.socket, fault: Fault) -> None:
        if fault.status is not None or fault.stall:
            try:
                c.recv(65536)
                if fault.stall:
                    self._stop.wait()
                else:
                    body = b"injected fault"
                    c.sendall(f"HTTP/1.1 {fault.status} Injected\r\nContent-Length: "
                              f"{len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            except OSError:
                pass
            self._close(c)
            return
        try:
            u = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=10)
        except OSError:
            self._close(c)
            return
        with self._lock:
            self._open.add(u)

        def up() -> None:
            try:
                while data := c.recv(65536):
                    u.sendall(data)
                u.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        threading.Thread(target=up, daemon=True).start()
        sent = 0
        try:
            while data := u.recv(65536):
                if fault.flip_at is not None and sent <= fault.flip_at < sent + len(data):
                    i = fault.flip_at - sent
                    data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]
                if fault.cut_after is not None and sent + len(data) >= fault.cut_after:
                    c.sendall(data[:fault.cut_after - sent])
                    break
                if fault.pause_after is not None and not fault.paused.is_set() \
                        and sent + len(data) >= fault.pause_after:
                    k = fault.pause_after - sent
                    c.sendall(data[:k])
                    sent += k
                    data = data[k:]
                    fault.paused.set()
                    fault.resume.wait(30)      # the upstream may be killed meanwhile
                c.sendall(data)
                sent += len(data)
        except OSError:
            pass
        self._close(c, u)

    def close(self) -> None:
        self._stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)      # wakes the blocked accept()
        except OSError:
            pass
        self.sock.close()
        with self._lock:
            socks = list(self._open)
        self._close(*socks)
        self._t.join(5)
