"""``E2B_DOMAIN`` set-ups: the stock SDK with nothing but ``E2B_DOMAIN`` and a key talks
TLS to ``api.{domain}`` and to ``49983-{sandboxID}.{domain}``; dsec's E2B listener
(``--e2b-domain``, ``--e2b-tls-cert``) routes by host name.

The test runs its own E2B listener with a certificate for ``*.e2b.test`` from a CA it
makes, and stands in for DNS with an HTTP CONNECT proxy on loopback that sends every
``host:443`` to that listener (the SDK's ``proxy`` option). The SDK runs in a subprocess
whose ``SSL_CERT_FILE`` is the test CA (its transports are process-wide)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from dsec import LocalCluster

DOMAIN = "e2b.test"


def _cert_pair(tmp: str) -> tuple[str, str, str]:
    """(ca.pem, server cert, server key) for *.DOMAIN and 127.0.0.1."""
    import ipaddress
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dsec e2b test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(hours=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False,
                                       False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, DOMAIN)]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(hours=2))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName(f"*.{DOMAIN}"), x509.DNSName(DOMAIN),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = [os.path.join(tmp, n) for n in ("ca.pem", "cert.pem", "key.pem")]
    with open(paths[0], "wb") as f:
        f.write(ca.public_bytes(serialization.Encoding.PEM))
    with open(paths[1], "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(paths[2], "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return paths[0], paths[1], paths[2]


class _ConnectProxy:
    """CONNECT host:443 -> 127.0.0.1:``port`` (DNS for *.DOMAIN, on loopback only)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.hosts: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.address = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._client, "127.0.0.1", 0))
        self.server = server
        self.address = server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    async def _client(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            head = await r.readuntil(b"\r\n\r\n")
            method, target = head.split(b" ")[:2]
            if method != b"CONNECT":
                w.write(b"HTTP/1.1 405 Method Not Allowed\r\n\r\n")
                return
            self.hosts.append(target.decode())
            ur, uw = await asyncio.open_connection("127.0.0.1", self.port)
            w.write(b"HTTP/1.1 200 Connection established\r\n\r\n")

            async def pipe(a: asyncio.StreamReader, b: asyncio.StreamWriter) -> None:
                try:
                    while data := await a.read(65536):
                        b.write(data)
                        await b.drain()
                finally:
                    b.close()
            await asyncio.gather(pipe(r, uw), pipe(ur, w), return_exceptions=True)
        finally:
            w.close()

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


SCRIPT = r"""
import json, os
from e2b import Sandbox
proxy = os.environ["TEST_PROXY"]
sb = Sandbox.create("e2b-base", timeout=120, proxy=proxy)
out = {"id": sb.sandbox_id, "url": sb.envd_api_url}
out["run"] = sb.commands.run("echo via-domain").stdout
sb.files.write("/tmp/d.txt", "tls")
out["read"] = sb.files.read("/tmp/d.txt")
out["listed"] = sb.sandbox_id in [s.sandbox_id for s in Sandbox.list(proxy=proxy).next_items()]
out["killed"] = sb.kill()
from e2b_code_interpreter import Sandbox as CodeSandbox
cs = CodeSandbox.create("e2b-python", timeout=120, proxy=proxy)
out["code_id"] = cs.sandbox_id
out["code"] = cs.run_code("6 * 7").text
out["contexts"] = [c.cwd for c in [cs.create_code_context(cwd="/tmp")]]
cs.kill()
print(json.dumps(out))
"""


@pytest.fixture
def tls_layer(e2b_cluster: LocalCluster, tmp_path: object) -> Iterator[tuple[str, str]]:
    """An E2B listener with TLS and --e2b-domain beside the cluster's (same service)."""
    from dsec.control.e2b import E2BConfig, start_e2b
    ca, cert, key = _cert_pair(str(tmp_path))
    rt = e2b_cluster.runtime
    srv = e2b_cluster._on_loop(start_e2b(rt.service, "127.0.0.1:0",
                                         config=E2BConfig(domain=DOMAIN),
                                         tls_cert=cert, tls_key=key))
    try:
        yield srv.url, ca
    finally:
        e2b_cluster._on_loop(srv.stop())


def test_sdk_over_tls_by_host_name(e2b_cluster: LocalCluster,
                                   tls_layer: tuple[str, str]) -> None:
    url, ca = tls_layer
    proxy = _ConnectProxy(int(url.rsplit(":", 1)[1]))
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
        env.update(E2B_DOMAIN=DOMAIN, E2B_API_KEY=e2b_cluster.api_key, SSL_CERT_FILE=ca,
                   TEST_PROXY=f"http://127.0.0.1:{proxy.address}")
        out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                             text=True, timeout=120, check=False)
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        proxy.close()
    sid = got["id"]
    assert got["url"] == f"https://49983-{sid}.{DOMAIN}"
    assert (got["run"], got["read"], got["listed"], got["killed"]) == (
        "via-domain\n", "tls", True, True), got
    # every request went by host name over TLS: the API's and the sandbox's
    assert f"api.{DOMAIN}:443" in proxy.hosts and f"49983-{sid}.{DOMAIN}:443" in proxy.hosts
    # the code interpreter's port by host name too
    assert (got["code"], got["contexts"]) == ("42", ["/tmp"]), got
    assert f"49999-{got['code_id']}.{DOMAIN}:443" in proxy.hosts


def test_host_routing_refuses_other_ports_and_unknown_ids(
        e2b_cluster: LocalCluster, tls_layer: tuple[str, str]) -> None:
    url, ca = tls_layer
    with httpx.Client(verify=ssl.create_default_context(cafile=ca)) as http:
        r = http.get(f"{url}/health", headers={"host": f"8080-sb-x-edge-0.{DOMAIN}"})
        assert r.status_code == 502 and "port 8080 is not open" in r.json()["message"]
        r = http.get(f"{url}/health", headers={"host": f"49983-sb-000000000000-edge-0.{DOMAIN}",
                                               "x-access-token": e2b_cluster.api_key})
        assert r.status_code == 502 and "was not found" in r.json()["message"]
