"""The cluster CA: who may be an edge, who may be the apiserver, over TCP+TLS.

Edges on other hosts serve Aether over mutual TLS (docs/cluster.md "Joining hosts"):

- ``dsec cluster init`` (or the first ``dsec up``/``dsec apiserver``) makes the CA in
  ``<state-dir>/cluster/``: ``ca.key``/``ca.crt`` (EC P-256, ten years) and the
  apiserver's own ``apiserver.key``/``apiserver.crt`` (CN ``dsec-apiserver``, extended key
  usage *clientAuth*). Keys are 0600 in a 0700 directory; replicas share the directory.
- An edge joins with a token and a CSR; the apiserver signs a certificate for its node id
  (CN and DNS SAN = the node id, extended key usage *serverAuth only*).
- The apiserver dials an edge with ``server_hostname=<node id>``: OpenSSL's hostname check
  is the "certificate names the node I meant" check, and the edge's ``node_info`` answer
  (its hello) must name the same node. The edge requires a client certificate of the CA
  with *clientAuth*: an edge's certificate (serverAuth only) is refused by OpenSSL's
  purpose check, so a joined edge can never speak to another edge as the apiserver.
- Revocation is a denylist of certificate fingerprints (the ``nodes`` table's revoked
  rows) that every replica checks right after each handshake, before the first call.

Join tokens look like ``<id>.<secret>.<ca-sha256>`` (kubeadm's discovery hash): the id
finds the row, the secret is stored as a sha256 only, and the CA hash lets the joining
edge pin the CA it is handed even when it joins over plain HTTP.

Pure functions over bytes and ``cryptography`` objects; the only I/O is reading and
writing the files of one directory (:func:`init_ca`, :func:`load_ca`).
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import hashlib
import hmac
import json
import os
import re
import secrets
import ssl
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dsec.errors import InvalidArgument, PermissionDenied, Unauthenticated
from dsec.ids import parse_node_id
from dsec.statedir import create_private_file, ensure_private_dir

__all__ = [
    "APISERVER_NAME",
    "ClusterCA",
    "JoinToken",
    "NodeCredentials",
    "cert_fingerprint",
    "check_nonce",
    "client_context",
    "init_ca",
    "issue_node_cert",
    "join_proof",
    "load_ca",
    "make_nonce",
    "new_node_key",
    "server_context",
]

APISERVER_NAME = "dsec-apiserver"   # CN/SAN of the apiserver's certificate; no node may take it
CA_DAYS = 3650
NODE_DAYS = 825                    # an edge's certificate (re-join with a token to renew)
_ORG = "dsec cluster"
_TOKEN_RE = re.compile(r"^([0-9a-f]{12})\.([A-Za-z0-9_-]{32,64})\.([0-9a-f]{64})$")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def key_fingerprint(public_key: ec.EllipticCurvePublicKey) -> str:
    """sha256 of the public key's SubjectPublicKeyInfo DER, hex."""
    return hashlib.sha256(public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)).hexdigest()


def cert_fingerprint(cert: x509.Certificate | bytes) -> str:
    """sha256 of the certificate's DER, hex: what the denylist and token pins hold."""
    der = cert if isinstance(cert, bytes) else cert.public_bytes(serialization.Encoding.DER)
    return hashlib.sha256(der).hexdigest()


def _write_private(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` 0600, whole or not at all (temp file, fsync, link):
    never a half-written key, never a window where it is readable by others. A file
    already there is kept (a link refuses to replace: two processes creating at once
    agree): callers use what is on disk, not what they passed."""
    create_private_file(path, lambda: data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True, slots=True)
class ClusterCA:
    """The CA of one cluster and the apiserver's credentials, as files in ``dir``."""

    dir: str
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @property
    def ca_path(self) -> str:
        return os.path.join(self.dir, "ca.crt")

    @property
    def apiserver_cert_path(self) -> str:
        return os.path.join(self.dir, "apiserver.crt")

    @property
    def apiserver_key_path(self) -> str:
        return os.path.join(self.dir, "apiserver.key")

    @property
    def fingerprint(self) -> str:
        return cert_fingerprint(self.cert)

    @property
    def pem(self) -> bytes:
        return _pem(self.cert)

    def client_context(self) -> ssl.SSLContext:
        """What the apiserver dials edges with (its certificate, the CA pinned)."""
        return client_context(self.apiserver_cert_path, self.apiserver_key_path, self.ca_path)


def init_ca(directory: str, *, now: dt.datetime | None = None) -> tuple[ClusterCA, bool]:
    """The CA in ``directory``, created if absent; returns it and whether it was created.
    An existing CA is never replaced (every joined edge pins it)."""
    d = ensure_private_dir(directory, what="cluster CA dir")
    key_path, crt_path = os.path.join(d, "ca.key"), os.path.join(d, "ca.crt")
    created = False
    if not os.path.exists(crt_path):
        if os.path.exists(key_path):
            raise InvalidArgument(f"{key_path} exists without {crt_path}: a CA half made or "
                                  "half removed; remove the key to start a new CA (every "
                                  "joined edge must then join again)")
        t = now or _now()
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, _ORG),
                          x509.NameAttribute(NameOID.COMMON_NAME, f"dsec cluster CA "
                                             f"{secrets.token_hex(4)}")])
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(t - dt.timedelta(minutes=5))
                .not_valid_after(t + dt.timedelta(days=CA_DAYS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(
                    digital_signature=True, key_cert_sign=True, crl_sign=True,
                    content_commitment=False, key_encipherment=False, data_encipherment=False,
                    key_agreement=False, encipher_only=False, decipher_only=False),
                    critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                               critical=False)
                .sign(key, hashes.SHA256()))
        _write_private(key_path, _key_pem(key))
        _write_private(crt_path, _pem(cert))
        created = True
    ca = load_ca(d)
    if not os.path.exists(ca.apiserver_cert_path):
        # The key on disk is the one certified: a crash after the key was linked and
        # before its certificate left the key alone, and the next start made a new key,
        # kept the old one (a link never replaces) and certified the new: a pair TLS
        # refused at every start (red team 22 A4). Nothing pinned that key yet.
        _write_private(ca.apiserver_key_path,
                       _key_pem(ec.generate_private_key(ec.SECP256R1())))
        akey = _load_ec_key(ca.apiserver_key_path)
        acert = _sign(ca, akey.public_key(), APISERVER_NAME, client=True, now=now)
        _write_private(ca.apiserver_cert_path, _pem(acert))
    return ca, created


def _load_ec_key(path: str) -> ec.EllipticCurvePrivateKey:
    try:
        with open(path, "rb") as f:
            key = serialization.load_pem_private_key(f.read(), None)
    except ValueError as exc:
        raise InvalidArgument(f"{path} is not a readable PEM key ({exc}); remove it (and "
                              "its certificate) to have a new one made") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise InvalidArgument(f"{path} is not an EC key; remove it (and its certificate) "
                              "to have a new one made")
    return key


def load_ca(directory: str) -> ClusterCA:
    """The CA made by :func:`init_ca` in ``directory`` (InvalidArgument if there is none)."""
    try:
        with open(os.path.join(directory, "ca.key"), "rb") as f:
            key = serialization.load_pem_private_key(f.read(), None)
        with open(os.path.join(directory, "ca.crt"), "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
    except FileNotFoundError as exc:
        raise InvalidArgument(f"no cluster CA in {directory}: run `dsec cluster init "
                              "--state-dir DIR` (or `dsec up`, which makes one)") from exc
    except ValueError as exc:
        raise InvalidArgument(f"the cluster CA in {directory} is unreadable: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise InvalidArgument(f"{directory}/ca.key is not an EC key")
    return ClusterCA(dir=directory, key=key, cert=cert)


def _sign(ca: ClusterCA, public_key: ec.EllipticCurvePublicKey, name: str, *,
          client: bool, now: dt.datetime | None = None,
          days: int = NODE_DAYS) -> x509.Certificate:
    t = now or _now()
    usage = [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [ExtendedKeyUsageOID.SERVER_AUTH]
    return (x509.CertificateBuilder()
            .subject_name(x509.Name([
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, _ORG),
                x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME,
                                   "apiserver" if client else "edge"),
                x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca.cert.subject).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(t - dt.timedelta(minutes=5))
            .not_valid_after(t + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca.key.public_key()), critical=False)
            .sign(ca.key, hashes.SHA256()))


def issue_node_cert(ca: ClusterCA, csr_pem: bytes, node_id: str, *,
                    now: dt.datetime | None = None) -> x509.Certificate:
    """Sign ``csr_pem`` (an EC P-256 key's CSR, self-signed) as edge ``node_id``. The
    certificate's names are ours (CN and DNS SAN = node id), never the CSR's."""
    node = parse_node_id(node_id)
    if node == APISERVER_NAME:
        raise InvalidArgument(f"node id {node!r} is reserved for the apiserver's certificate")
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as exc:
        raise InvalidArgument(f"the join request's CSR is not a PEM CSR: {exc}") from exc
    if not csr.is_signature_valid:
        raise InvalidArgument("the join request's CSR signature is invalid")
    pub = csr.public_key()
    if not isinstance(pub, ec.EllipticCurvePublicKey) or pub.curve.name != "secp256r1":
        raise InvalidArgument("the join request's CSR must carry an EC P-256 key")
    return _sign(ca, pub, node, client=False, now=now)


# ------------------------------------------------------------------ the edge's side
@dataclass(frozen=True, slots=True)
class NodeCredentials:
    """What a joined edge keeps in ``<state-dir>/cluster/`` to serve and rejoin."""

    dir: str

    @property
    def key_path(self) -> str:
        return os.path.join(self.dir, "node.key")

    @property
    def cert_path(self) -> str:
        return os.path.join(self.dir, "node.crt")

    @property
    def ca_path(self) -> str:
        return os.path.join(self.dir, "ca.crt")

    def exists(self) -> bool:
        return all(os.path.exists(p) for p in (self.key_path, self.cert_path, self.ca_path))

    def node_id(self) -> str:
        with open(self.cert_path, "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
        return str(cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)

    def save(self, key_pem: bytes, cert_pem: bytes, ca_pem: bytes) -> None:
        """Persist what the join answered (0600 each; the cert last: it marks done)."""
        self.save_key(key_pem)
        self.save_issued(cert_pem, ca_pem)

    def save_key(self, key_pem: bytes) -> None:
        """Keep the key *before* the join is sent: a join the apiserver recorded but whose
        answer was lost (a kill -9, a cut link) is retried with the same key, which the
        apiserver recognises (JoinAuthority.join) instead of refusing the taken id."""
        ensure_private_dir(self.dir, what="edge credentials dir")
        for p in (self.key_path, self.ca_path, self.cert_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        _write_private(self.key_path, key_pem)

    def save_issued(self, cert_pem: bytes, ca_pem: bytes) -> None:
        _write_private(self.ca_path, ca_pem)
        _write_private(self.cert_path, cert_pem)

    def pending_key(self) -> bytes | None:
        """The key of a join that was sent but not answered (no certificate yet)."""
        if os.path.exists(self.cert_path) or not os.path.exists(self.key_path):
            return None
        with open(self.key_path, "rb") as f:
            return f.read()

    def server_context(self) -> ssl.SSLContext:
        return server_context(self.cert_path, self.key_path, self.ca_path)

    def sign(self, message: bytes) -> bytes:
        with open(self.key_path, "rb") as f:
            key = serialization.load_pem_private_key(f.read(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        return key.sign(message, ec.ECDSA(hashes.SHA256()))

    def cert_pem(self) -> bytes:
        with open(self.cert_path, "rb") as f:
            return f.read()


def new_node_key(node_id: str, key_pem: bytes | None = None) -> tuple[bytes, bytes]:
    """A fresh EC P-256 key (or ``key_pem``'s) and its CSR for ``node_id``, both PEM."""
    if key_pem is None:
        key = ec.generate_private_key(ec.SECP256R1())
    else:
        loaded = serialization.load_pem_private_key(key_pem, None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise InvalidArgument("the kept node key is not an EC key")
        key = loaded
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
           .sign(key, hashes.SHA256()))
    return _key_pem(key), csr.public_bytes(serialization.Encoding.PEM)


def check_issued(cert_pem: bytes, ca_pem: bytes, key_pem: bytes, *, node_id: str,
                 ca_sha256: str) -> None:
    """What a joining edge checks of the answer before it keeps it: the CA is the one its
    token pins, the certificate is the CA's, for ``node_id``, and for the key it made."""
    ca = x509.load_pem_x509_certificate(ca_pem)
    if not hmac.compare_digest(cert_fingerprint(ca), ca_sha256):
        raise PermissionDenied(f"the apiserver's CA (sha256 {cert_fingerprint(ca)}) is not the "
                               f"one the join token pins ({ca_sha256}): refusing to join")
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise PermissionDenied(f"the certificate the apiserver sent is not its CA's: {exc}"
                               ) from exc
    key = serialization.load_pem_private_key(key_pem, None)
    if cert.public_key() != key.public_key():
        raise PermissionDenied("the certificate the apiserver sent is for another key")
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    if cn != node_id:
        raise PermissionDenied(f"the certificate is for node {cn!r}, not {node_id!r}")


# ------------------------------------------------------------------ challenges
# A join or rejoin starts with a server nonce (POST /v1/cluster/challenge). It names the
# address the challenge was asked from and expires soon; it is MAC'd with a key derived
# from the CA's key, so every replica sharing the CA can check one another's nonces with
# no shared state. The join's proof and the rejoin's signature cover it: a captured join
# or rejoin is bound to one nonce (used once), one peer address and one CSR/key.
NONCE_TTL_S = 60.0


def _nonce_key(ca: ClusterCA) -> bytes:
    der = ca.key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())
    return hmac.new(der, b"dsec-join-nonce-v1", hashlib.sha256).digest()


def make_nonce(ca: ClusterCA, peer: str, *, now_s: float) -> str:
    """A fresh challenge for a client at ``peer`` (``""``: unknown, in-process)."""
    body = base64.urlsafe_b64encode(json.dumps(
        {"e": int(now_s + NONCE_TTL_S), "r": secrets.token_hex(16), "p": peer},
        separators=(",", ":")).encode()).decode().rstrip("=")
    mac = hmac.new(_nonce_key(ca), body.encode(), hashlib.sha256).hexdigest()
    return f"{body}.{mac}"


def check_nonce(ca: ClusterCA, nonce: str, peer: str, *, now_s: float) -> tuple[str, float]:
    """The peer address a nonce of this CA was issued to, and when it expires; refused if
    forged, expired or asked from another address than ``peer`` (the request's)."""
    body, _, mac = nonce.partition(".")
    want = hmac.new(_nonce_key(ca), body.encode(), hashlib.sha256).hexdigest()
    if not mac or not hmac.compare_digest(mac, want):
        raise Unauthenticated("the challenge nonce is not this cluster's: ask "
                              "POST /v1/cluster/challenge for a fresh one")
    try:
        data = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        expires, issued_to = float(data["e"]), str(data["p"])
    except (ValueError, KeyError, TypeError) as exc:
        raise Unauthenticated("unreadable challenge nonce") from exc
    if expires <= now_s:
        raise Unauthenticated(f"the challenge nonce expired {now_s - expires:.0f}s ago "
                              f"(nonces live {NONCE_TTL_S:g}s): ask for a fresh one")
    if issued_to != peer:
        raise Unauthenticated(f"the challenge nonce was issued to {issued_to or 'another'} "
                              f"client, not {peer or 'this one'}: a join or rejoin is "
                              "answered only to the address that asked for its nonce")
    return issued_to, expires


def join_proof(secret_hash: bytes, nonce: str, node_id: str, address: str,
               csr_pem: bytes) -> str:
    """What proves a join token without sending it: an HMAC keyed by sha256(secret) (the
    apiserver stores only that) over the nonce, node id, address and the CSR. Whoever
    sees it on the wire can neither learn the secret nor use it for another key, node,
    address or nonce."""
    msg = "\n".join(("dsec-join-v2", nonce, node_id, address,
                     hashlib.sha256(csr_pem).hexdigest())).encode()
    return hmac.new(secret_hash, msg, hashlib.sha256).hexdigest()


# ------------------------------------------------------------------ rejoin proof
def rejoin_message(node_id: str, address: str, nonce: str) -> bytes:
    """What a restarted edge signs with its key to announce its address without a token:
    the server's nonce (one use, bound to the address it was asked from) included."""
    return f"dsec-rejoin-v2\n{node_id}\n{address}\n{nonce}".encode()


def verify_rejoin(ca: ClusterCA, cert_pem: bytes, signature: bytes, node_id: str,
                  address: str, nonce: str, *, now_s: float) -> str:
    """Check a rejoin: ``cert_pem`` is the CA's, for ``node_id``, unexpired, and signed
    the message; returns the certificate's fingerprint (the caller checks it is the
    node's recorded, unrevoked one)."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        cert.verify_directly_issued_by(ca.cert)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise Unauthenticated(f"rejoin of {node_id}: the certificate is not this cluster's "
                              f"CA's ({exc})") from exc
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    if cn != node_id:
        raise Unauthenticated(f"rejoin of {node_id}: the certificate is for {cn!r}")
    if not cert.not_valid_before_utc.timestamp() <= now_s <= cert.not_valid_after_utc.timestamp():
        raise Unauthenticated(f"rejoin of {node_id}: the certificate expired; join again "
                              "with a token")
    pub = cert.public_key()
    assert isinstance(pub, ec.EllipticCurvePublicKey)
    try:
        pub.verify(signature, rejoin_message(node_id, address, nonce),
                   ec.ECDSA(hashes.SHA256()))
    except InvalidSignature as exc:
        raise Unauthenticated(f"rejoin of {node_id}: bad signature") from exc
    return cert_fingerprint(cert)


# ------------------------------------------------------------------ TLS contexts
def server_context(cert_path: str, key_path: str, ca_path: str) -> ssl.SSLContext:
    """An edge's listener: its certificate; clients must show a CA certificate with
    clientAuth (the apiserver's). TLS 1.3 only: both ends are dsec."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(cert_path, key_path)
    ctx.load_verify_locations(ca_path)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(cert_path: str, key_path: str, ca_path: str) -> ssl.SSLContext:
    """The apiserver dialling edges: its certificate, the CA pinned (no system roots),
    the edge's node id checked as the hostname."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(cert_path, key_path)
    ctx.load_verify_locations(ca_path)
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


# ------------------------------------------------------------------ join tokens
@dataclass(frozen=True, slots=True)
class JoinToken:
    """``<id>.<secret>.<ca-sha256>``; only ``sha256(secret)`` is stored."""

    id: str
    secret: str
    ca_sha256: str

    def __str__(self) -> str:
        return f"{self.id}.{self.secret}.{self.ca_sha256}"

    @property
    def secret_hash(self) -> bytes:
        return hashlib.sha256(self.secret.encode()).digest()

    @classmethod
    def new(cls, ca_sha256: str) -> JoinToken:
        return cls(secrets.token_hex(6), secrets.token_urlsafe(32), ca_sha256)

    @classmethod
    def parse(cls, text: str) -> JoinToken:
        m = _TOKEN_RE.fullmatch(text.strip())
        if m is None:
            raise Unauthenticated("malformed join token: expected <12 hex id>.<secret>."
                                  "<64 hex CA sha256> as printed by `dsec cluster token "
                                  "create`")
        return cls(m[1], m[2], m[3])
