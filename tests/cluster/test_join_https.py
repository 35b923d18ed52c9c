"""Joining over https:// (an apiserver behind a TLS terminator), and what a refusing or
unknown https endpoint does to the edge.

Real processes and sockets: an in-process apiserver runtime, a TLS terminator on loopback
(asyncio, a server certificate of a test CA made here) relaying to the apiserver's HTTP
port, and a real ``dsec edge --join https://...`` that verifies it with ``$DSEC_JOIN_CA``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.cluster.test_join import EdgeProc, apiserver, eventually, free_port, healthy, rest


def _tls_files(d: Path) -> tuple[Path, Path, Path]:
    """A test CA and a server certificate for 127.0.0.1 / localhost signed by it."""
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "join-https test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .sign(ca_key, hashes.SHA256()))
    d.mkdir(parents=True, exist_ok=True)
    ca_path, cert_path, key_path = d / "ca.pem", d / "cert.pem", d / "key.pem"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return ca_path, cert_path, key_path


class Terminator:
    """TLS in front, plain HTTP to the apiserver (what an ingress / nginx does)."""

    def __init__(self, target: tuple[str, int], ctx: ssl.SSLContext) -> None:
        self.target, self.ctx = target, ctx
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self.seen = bytearray()

    async def start(self) -> Terminator:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0, ssl=self.ctx)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection(*self.target)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                       keep: bool) -> None:
            try:
                while data := await src.read(65536):
                    if keep:
                        self.seen += data
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(r, uw, True), pump(ur, w, False))

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def test_an_edge_joins_and_rejoins_over_https_behind_a_tls_terminator(
        tmp_path: Path) -> None:
    ca_path, cert_path, key_path = _tls_files(tmp_path / "tls")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert_path, key_path)
    async with apiserver(tmp_path / "cp") as rt, rest(rt) as http:
        host, port = rt.url.removeprefix("http://").rsplit(":", 1)
        term = await Terminator((host, int(port)), ctx).start()
        p = free_port()
        edge = EdgeProc(tmp_path / "e", f"tcp:127.0.0.1:{p}")
        try:
            r = await http.post("/v1/cluster/tokens", json={"ttl_s": 600, "uses": 1})
            token = r.json()["token"]
            url = f"https://127.0.0.1:{term.port}"
            env = {"DSEC_JOIN_CA": str(ca_path), "DSEC_JOIN_TOKEN": token}
            edge.start("--join", url, "--node-id", "s1", env=env)
            await edge.serving()
            await eventually(lambda: healthy(rt, "s1"), 30, "s1 healthy")
            assert b"/v1/cluster/challenge" in term.seen and b"/v1/cluster/join" in term.seen
            assert token.split(".")[1].encode() not in term.seen  # not even inside TLS
            await edge.stop()
            edge.start("--join", url, env={"DSEC_JOIN_CA": str(ca_path)})   # a restart
            await edge.serving()
            await eventually(lambda: b"/v1/cluster/rejoin" in term.seen, 10, "the rejoin")
            assert "rejoined the cluster" in edge.output(), edge.output()[-800:]
            await eventually(lambda: healthy(rt, "s1"), 30, "s1 healthy again")
        finally:
            await edge.stop()
            await term.stop()


async def test_an_https_join_url_whose_certificate_is_not_trusted_joins_nothing(
        tmp_path: Path) -> None:
    """Without the terminator's CA (no $DSEC_JOIN_CA, not in the system store) the edge
    refuses to talk to it: it does not join, and says why."""
    _, cert_path, key_path = _tls_files(tmp_path / "tls")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert_path, key_path)
    async with apiserver(tmp_path / "cp") as rt, rest(rt) as http:
        host, port = rt.url.removeprefix("http://").rsplit(":", 1)
        term = await Terminator((host, int(port)), ctx).start()
        edge = EdgeProc(tmp_path / "e", f"tcp:127.0.0.1:{free_port()}")
        try:
            r = await http.post("/v1/cluster/tokens", json={"ttl_s": 600, "uses": 1})
            edge.start("--join", f"https://127.0.0.1:{term.port}", "--node-id", "s2",
                       env={"DSEC_JOIN_TOKEN": r.json()["token"], "DSEC_JOIN_CA": "",
                            "SSL_CERT_FILE": ""})
            await eventually(edge.exited, 90, "the edge to give up")
            assert "CERTIFICATE_VERIFY_FAILED" in edge.output(), edge.output()[-800:]
            assert rt.join_authority.list_nodes() == []
            assert b"/v1/cluster/join" not in term.seen
        finally:
            await edge.stop()
            await term.stop()
