"""The cluster CA, join tokens in the store, and Aether over mutual TLS on loopback."""

from __future__ import annotations

import os
import stat

import msgspec
import pytest

from dsec.aether import Router
from dsec.aether.transport import connect, serve
from dsec.cluster.ca import (
    APISERVER_NAME,
    NONCE_TTL_S,
    JoinToken,
    NodeCredentials,
    cert_fingerprint,
    check_issued,
    init_ca,
    issue_node_cert,
    new_node_key,
)
from dsec.cluster.join import JoinAuthority, join_request
from dsec.cluster.membership import EdgeTls
from dsec.control.store.sqlite import SqliteStore
from dsec.errors import (
    Conflict,
    ConnectFailed,
    DsecError,
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
)


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_init_ca_private_and_idempotent(tmp_path):
    os.umask(0o022)
    ca, created = init_ca(str(tmp_path / "cluster"))
    assert created
    assert _mode(ca.dir) == 0o700
    for name in ("ca.key", "ca.crt", "apiserver.key", "apiserver.crt"):
        assert _mode(os.path.join(ca.dir, name)) == 0o600, name
    again, created2 = init_ca(ca.dir)
    assert not created2 and again.fingerprint == ca.fingerprint


def test_half_made_ca_refused(tmp_path):
    ca, _ = init_ca(str(tmp_path / "c"))
    os.unlink(ca.ca_path)
    with pytest.raises(InvalidArgument, match="without"):
        init_ca(ca.dir)


def test_issue_names_are_ours_and_apiserver_name_reserved(tmp_path):
    ca, _ = init_ca(str(tmp_path / "c"))
    _key, csr = new_node_key("mallory-wants-this-name")
    cert = issue_node_cert(ca, csr, "edge-a")
    from cryptography.x509.oid import NameOID
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "edge-a"
    with pytest.raises(InvalidArgument, match="reserved"):
        issue_node_cert(ca, csr, APISERVER_NAME)
    with pytest.raises(InvalidArgument):
        issue_node_cert(ca, b"garbage", "edge-a")
    with pytest.raises(InvalidArgument):
        issue_node_cert(ca, csr, "Bad_Name")


def _authority(tmp_path, now=1000.0):
    ca, _ = init_ca(str(tmp_path / "c"))
    store = SqliteStore(str(tmp_path / "s.sqlite"))
    clock = [now]
    return JoinAuthority(store, ca, clock=lambda: clock[0]), store, clock


def _join(auth, token, node="edge-a", address="tcp:127.0.0.1:7443"):
    key, csr = new_node_key(node)
    return key, auth.join(_req(auth, token, node, csr.decode(), address))


def _req(auth, token, node, csr, address):
    """The request an edge sends: a fresh nonce, the token proven, never sent."""
    return join_request(str(token), node_id=node, csr=csr, address=address,
                        nonce=auth.challenge().nonce)


def test_token_single_use_n_use_expiry_revoke_and_garbage(tmp_path):
    auth, store, clock = _authority(tmp_path)
    tok, _ = auth.create_token(ttl_s=60, uses=1)
    key, reply = _join(auth, tok)
    check_issued(reply.certificate.encode(), reply.ca.encode(), key, node_id="edge-a",
                 ca_sha256=tok.ca_sha256)
    # single use: a second join with it creates nothing
    with pytest.raises(Unauthenticated, match="join token refused"):
        _join(auth, tok, node="edge-b")
    assert [n.node_id for n in store.list_nodes()] == ["edge-a"]

    tok3, _ = auth.create_token(ttl_s=60, uses=3)
    for n in ("edge-b", "edge-c", "edge-d"):
        _join(auth, tok3, node=n)
    with pytest.raises(Unauthenticated):
        _join(auth, tok3, node="edge-e")

    expiring, _ = auth.create_token(ttl_s=10, uses=5)
    clock[0] += 11
    with pytest.raises(Unauthenticated):
        _join(auth, expiring, node="edge-f")

    revoked, _ = auth.create_token(ttl_s=60, uses=5)
    auth.revoke_token(revoked.id)
    with pytest.raises(Unauthenticated):
        _join(auth, revoked, node="edge-g")

    wrong = JoinToken(revoked.id, "x" * 43, revoked.ca_sha256)
    with pytest.raises(Unauthenticated):
        _join(auth, wrong, node="edge-h")
    for garbage in ("", "abc", "a.b.c", f"{tok.id}.{tok.secret}"):
        with pytest.raises(Unauthenticated, match="malformed"):
            auth.join(_req(auth, garbage, "edge-i", "x", "tcp:127.0.0.1:1"))
    good = _req(auth, tok3, "edge-i", "x", "tcp:127.0.0.1:1")
    for garbage_id in ("", "abc", "../" + "a" * 9, tok3.id.upper()):
        with pytest.raises(Unauthenticated, match="malformed"):
            auth.join(msgspec.structs.replace(good, token_id=garbage_id))
    other_ca = JoinToken(tok3.id, tok3.secret, "0" * 64)
    with pytest.raises(Unauthenticated, match="another CA"):
        _join(auth, other_ca, node="edge-j")
    assert sorted(n.node_id for n in store.list_nodes()) == [
        "edge-a", "edge-b", "edge-c", "edge-d"]
    assert store.get_join_token(tok3.id).used == 3


def test_taken_node_id_gives_the_use_back(tmp_path):
    auth, store, _ = _authority(tmp_path)
    tok, _ = auth.create_token(ttl_s=60, uses=2)
    _join(auth, tok)
    with pytest.raises(Conflict):
        _join(auth, tok)                      # edge-a again
    assert store.get_join_token(tok.id).used == 1
    _join(auth, tok, node="edge-b")
    assert store.get_join_token(tok.id).used == 2


def test_a_join_whose_answer_was_lost_is_answered_again(tmp_path):
    """kill -9 of the edge (or a cut link) after the apiserver recorded the join: the edge
    kept its key before sending, and the same join (same token, same key) gets a fresh
    certificate without spending another use; the lost one is denied. Another key with
    the same token is still refused."""
    auth, store, _ = _authority(tmp_path)
    tok, _ = auth.create_token(ttl_s=60, uses=1)
    key, csr = new_node_key("edge-a")
    req = _req(auth, tok, "edge-a", csr.decode(), "tcp:127.0.0.1:7443")
    first = auth.join(req)
    # the very request again (a replay, or a resend of the same bytes): its nonce is spent
    with pytest.raises(Unauthenticated, match="used already"):
        auth.join(req)
    _, csr_again = new_node_key("edge-a", key)
    second = auth.join(_req(auth, tok, "edge-a", csr_again.decode(), "tcp:127.0.0.1:7443"))
    assert second.certificate != first.certificate
    assert store.get_join_token(tok.id).used == 1
    from cryptography import x509
    lost = cert_fingerprint(x509.load_pem_x509_certificate(first.certificate.encode()))
    kept = cert_fingerprint(x509.load_pem_x509_certificate(second.certificate.encode()))
    assert lost in store.revoked_fingerprints()
    assert store.get_node("edge-a").cert_fingerprint == kept
    with pytest.raises(Unauthenticated):
        _join(auth, tok)                      # a new key: the token is used up
    assert [n.node_id for n in store.list_nodes()] == ["edge-a"]


def test_joins_racing_for_the_last_uses_get_exactly_that_many(tmp_path):
    from concurrent.futures import ThreadPoolExecutor
    auth, store, _ = _authority(tmp_path)
    tok, _ = auth.create_token(ttl_s=60, uses=3)
    csrs = [new_node_key(f"n-{i}")[1].decode() for i in range(12)]

    def one(i: int) -> bool:
        try:
            auth.join(_req(auth, tok, f"n-{i}", csrs[i], "tcp:127.0.0.1:7443"))
            return True
        except Unauthenticated:
            return False
    with ThreadPoolExecutor(12) as pool:
        won = list(pool.map(one, range(12)))
    assert sum(won) == 3
    assert len(store.list_nodes()) == 3 and store.get_join_token(tok.id).used == 3


def test_static_edge_ids_are_reserved(tmp_path):
    auth, store, _ = _authority(tmp_path)
    auth.reserved = frozenset({"edge-0"})
    tok, _ = auth.create_token(ttl_s=60, uses=1)
    with pytest.raises(Conflict, match="static edge"):
        _join(auth, tok, node="edge-0")
    assert store.list_nodes() == [] and store.get_join_token(tok.id).used == 0


def test_bad_address_creates_nothing(tmp_path):
    auth, store, _ = _authority(tmp_path)
    tok, _ = auth.create_token(ttl_s=60, uses=1)
    for addr in ("unix:/tmp/x.sock", "tcp:127.0.0.1:0", "nonsense"):
        with pytest.raises(InvalidArgument):
            _join(auth, tok, address=addr)
    assert store.list_nodes() == [] and store.get_join_token(tok.id).used == 0


def test_rejoin_and_revocation(tmp_path):
    import base64
    import time as _t

    from dsec.cluster.ca import rejoin_message
    from dsec.cluster.join import RejoinRequest
    auth, store, clock = _authority(tmp_path, now=_t.time())
    tok, _ = auth.create_token(ttl_s=60, uses=1)
    key, reply = _join(auth, tok)
    creds = NodeCredentials(str(tmp_path / "edge-creds"))
    creds.save(key, reply.certificate.encode(), reply.ca.encode())
    assert all(_mode(p) == 0o600 for p in (creds.key_path, creds.cert_path, creds.ca_path))

    def request(addr: str, peer: str | None = None) -> RejoinRequest:
        nonce = auth.challenge(peer).nonce
        sig = creds.sign(rejoin_message("edge-a", addr, nonce))
        return RejoinRequest(node_id="edge-a", address=addr, nonce=nonce,
                             certificate=creds.cert_pem().decode(),
                             signature=base64.b64encode(sig).decode())

    def rejoin(addr: str) -> object:
        return auth.rejoin(request(addr))
    rejoin("tcp:127.0.0.9:7443")
    assert store.get_node("edge-a").address == "tcp:127.0.0.9:7443"
    # a signature over another address does not move it
    nonce = auth.challenge().nonce
    sig = creds.sign(rejoin_message("edge-a", "tcp:1.1.1.1:1", nonce))
    with pytest.raises(Unauthenticated, match="bad signature"):
        auth.rejoin(RejoinRequest(node_id="edge-a", address="tcp:6.6.6.6:1", nonce=nonce,
                                  certificate=creds.cert_pem().decode(),
                                  signature=base64.b64encode(sig).decode()))
    # a rejoin is good once (a replay is refused) ...
    req = request("tcp:127.0.0.8:7443")
    auth.rejoin(req)
    assert store.get_node("edge-a").address == "tcp:127.0.0.8:7443"
    with pytest.raises(Unauthenticated, match="used already"):
        auth.rejoin(req)
    # ... only from the address that asked for its nonce, which is also what an
    # advertised 0.0.0.0 records (the signature covers it) ...
    req = request("tcp:0.0.0.0:7443", peer="10.251.0.7")
    with pytest.raises(Unauthenticated, match="issued to 10.251.0.7"):
        auth.rejoin(req, "10.251.0.66")
    auth.rejoin(req, "10.251.0.7")
    assert store.get_node("edge-a").address == "tcp:10.251.0.7:7443"
    # ... and within its lifetime; a forged nonce is refused
    req = request("tcp:127.0.0.9:7443")
    clock[0] += NONCE_TTL_S + 1
    with pytest.raises(Unauthenticated, match="expired"):
        auth.rejoin(req)
    forged = msgspec.structs.replace(req, nonce=req.nonce[:-4] + "0000")
    with pytest.raises(Unauthenticated, match="not this cluster's"):
        auth.rejoin(forged)
    rejoin("tcp:127.0.0.9:7443")
    auth.revoke_node("edge-a")
    assert cert_fingerprint(_der(creds.cert_path)) in store.revoked_fingerprints()
    with pytest.raises(PermissionDenied, match="revoked"):
        rejoin("tcp:127.0.0.9:7443")
    # the id may join again with a new token and key; the old certificate stays refused
    tok2, _ = auth.create_token(ttl_s=60, uses=1)
    _join(auth, tok2)
    with pytest.raises(PermissionDenied, match="revoked"):
        rejoin("tcp:127.0.0.9:7443")


# ---------------------------------------------------------------------- TLS on loopback
def _free_port() -> int:
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _creds(ca, tmp_path, node: str) -> NodeCredentials:
    key, csr = new_node_key(node)
    cert = issue_node_cert(ca, csr, node)
    from cryptography.hazmat.primitives import serialization
    c = NodeCredentials(str(tmp_path / f"creds-{node}"))
    c.save(key, cert.public_bytes(serialization.Encoding.PEM), ca.pem)
    return c


async def _echo_server(ctx, port):
    r = Router()

    async def echo(body: bytes) -> bytes:
        return body
    r.add("echo", echo)
    return await serve(r, f"tcp:127.0.0.1:{port}", ssl=ctx)


async def test_mutual_tls_roundtrip_and_refusals(tmp_path):
    ca, _ = init_ca(str(tmp_path / "c"))
    edge = _creds(ca, tmp_path, "edge-a")
    port = _free_port()
    server = await _echo_server(edge.server_context(), port)
    try:
        tls = EdgeTls("edge-a", ca.client_context())
        conn = await connect(f"tcp:127.0.0.1:{port}", ssl=tls.context,
                             server_hostname="edge-a", peer_check=tls.check_peer)
        assert await conn.call("echo", b"hi") == b"hi"
        await conn.close()
        # the certificate names another node
        with pytest.raises(ConnectFailed, match="TLS handshake"):
            await connect(f"tcp:127.0.0.1:{port}", ssl=tls.context, server_hostname="edge-b",
                          timeout=5)
        # revoked fingerprint: refused before any call
        denied = EdgeTls("edge-a", ca.client_context(),
                         {cert_fingerprint(_der(edge.cert_path))})
        with pytest.raises(PermissionDenied, match="revoked"):
            await connect(f"tcp:127.0.0.1:{port}", ssl=denied.context,
                          server_hostname="edge-a", peer_check=denied.check_peer, timeout=5)
        # a client of another CA: the edge refuses the handshake
        other, _ = init_ca(str(tmp_path / "other"))
        from dsec.cluster.ca import client_context
        mixed = client_context(other.apiserver_cert_path, other.apiserver_key_path, ca.ca_path)
        with pytest.raises(DsecError):
            c2 = await connect(f"tcp:127.0.0.1:{port}", ssl=mixed, server_hostname="edge-a",
                               timeout=5)
            await c2.call("echo", b"x", timeout=5)
        # another edge's certificate as a client (serverAuth only): refused
        b = _creds(ca, tmp_path, "edge-b")
        as_edge = client_context(b.cert_path, b.key_path, ca.ca_path)
        with pytest.raises(DsecError):
            c3 = await connect(f"tcp:127.0.0.1:{port}", ssl=as_edge, server_hostname="edge-a",
                               timeout=5)
            await c3.call("echo", b"x", timeout=5)
        # plain TCP to a TLS listener gets nowhere
        with pytest.raises(DsecError):
            c4 = await connect(f"tcp:127.0.0.1:{port}", timeout=5)
            await c4.call("echo", b"x", timeout=3)
        assert server.stats.refused.get("tls", 0) >= 2
    finally:
        await server.close()


def _der(path: str) -> bytes:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    with open(path, "rb") as f:
        return x509.load_pem_x509_certificate(f.read()).public_bytes(
            serialization.Encoding.DER)


async def test_tls_listener_drops_a_peer_that_never_handshakes(tmp_path):
    """Slowloris on the TLS edge listener: a connection that sends nothing (or half a
    ClientHello) is closed after the auth deadline, as an unauthenticated one is."""
    import asyncio
    import socket

    from dsec.aether.limits import ServerLimits
    ca, _ = init_ca(str(tmp_path / "c"))
    edge = _creds(ca, tmp_path, "edge-a")
    r = Router()
    port = _free_port()
    server = await serve(r, f"tcp:127.0.0.1:{port}", ssl=edge.server_context(),
                         limits=ServerLimits(auth_timeout_s=0.5))
    try:
        loop = asyncio.get_running_loop()
        socks = []
        for half in (b"", b"\x16\x03\x01\x02\x00\x01"):
            s = socket.create_connection(("127.0.0.1", port))
            s.setblocking(False)
            if half:
                s.send(half)
            socks.append(s)
        for s in socks:
            got = await asyncio.wait_for(loop.sock_recv(s, 100), 10)
            assert got == b""                 # closed by the server
            s.close()
        assert server.stats.refused.get("tls", 0) == 2
        assert server.admission.open == 0
    finally:
        await server.close()


def test_first_join_retries_an_unreachable_apiserver_then_gives_up(tmp_path):
    from dsec.cluster.edge_join import prepare_joined_edge
    now = [0.0]
    slept = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s
    tok = JoinToken("a" * 12, "b" * 43, "c" * 64)
    with pytest.raises(ConnectFailed, match="could not reach the apiserver"):
        prepare_joined_edge(str(tmp_path / "e"), join_url=f"http://127.0.0.1:{_free_port()}",
                            token=str(tok), node_id="edge-a", node_id_given=True,
                            listen="tcp:127.0.0.1:7443", advertise=None, wait_s=3.0,
                            clock=lambda: now[0], sleep=sleep)
    assert slept == [1.0, 1.0, 1.0]
    assert not NodeCredentials(str(tmp_path / "e" / "cluster")).exists()


def test_a_crash_between_the_apiserver_key_and_its_certificate_is_recovered(tmp_path):
    """Red team 22 A4 (same class): a kill -9 after ``apiserver.key`` was linked into
    place and before ``apiserver.crt`` was: the next start must certify the key that is
    on disk (it made a new one, kept the old - a link never replaces - and signed the
    new: TLS refused the pair at every start)."""
    import ssl

    ca, _ = init_ca(str(tmp_path / "c"))
    os.unlink(ca.apiserver_cert_path)           # the crash's state
    again, created = init_ca(ca.dir)
    assert not created
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_cert_chain(again.apiserver_cert_path, again.apiserver_key_path)   # a pair
    again.client_context()
