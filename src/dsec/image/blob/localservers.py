"""Blob store servers on loopback, for tests and benchmarks: moto's standalone S3 server
and Debian's nginx serving a directory (GET with Range, WebDAV PUT/DELETE).

Each runs in its own process (and, for nginx, its own temp prefix) on 127.0.0.1 with a
port picked at start; :meth:`stop` kills it. Nothing here is used by the product: the
product talks to whatever store an operator configures (``--blob-store``).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

__all__ = ["NGINX", "MotoServer", "Nginx", "free_port", "wait_http"]

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[bytes], what: str, timeout: float = 30) -> None:
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
            wait_http(self.endpoint + "/moto-api/", self.proc, "moto server")
        except BaseException:
            self.stop()
            raise

    def client(self) -> Any:
        """A boto3 S3 client of this server (to look at buckets from the side)."""
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
                    "dav_access user:rw;") if dav else ""
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
            wait_http(self.url + "/", self.proc, "nginx", timeout=15)
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
