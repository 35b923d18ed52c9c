"""The edge's side of joining: ``dsec edge --join URL --token TOKEN``.

First start: make an EC P-256 key and a CSR, ask the apiserver for a nonce (``POST
/v1/cluster/challenge``), send the CSR with the token's id and a proof of the token
(``HMAC(sha256(secret), nonce | node | address | sha256(CSR))``: the secret itself never
leaves this host) to ``POST /v1/cluster/join``, check the answer (the CA is the one the token pins, the
certificate is the CA's, for this node and this key), and keep key, certificate and CA
in ``<state-dir>/cluster/`` (0600 each, 0700 dir) with the join URL in ``join.json``.
Later starts need no token: the edge announces its address with ``POST
/v1/cluster/rejoin``, signed by its key over a fresh nonce (good once, and only from the
address that asked for it). A revoked node is told so and does not start.
An apiserver that cannot be reached at a restart is not fatal: the replicas still have
the node's row and dial it.

The join goes over HTTPS when the URL says so (verified by the system's CAs,
``SSL_CERT_FILE``, or ``$DSEC_JOIN_CA`` when set: a PEM file of the CA that signed the
apiserver's HTTPS certificate), else over plain HTTP: an observer of the path then learns
no secret (the proof is good for one nonce and this CSR only), and the token's CA hash
keeps the edge from trusting another CA.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from dsec.aether.transport import parse_address
from dsec.cluster.ca import (
    JoinToken,
    NodeCredentials,
    check_issued,
    new_node_key,
    rejoin_message,
)
from dsec.cluster.join import join_request
from dsec.errors import (
    ConnectFailed,
    DsecError,
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
    error_from_wire,
)
from dsec.statedir import write_private_file

__all__ = ["JoinedEdge", "prepare_joined_edge"]

log = logging.getLogger("dsec.edge.join")

JOIN_FILE = "join.json"


@dataclass(frozen=True, slots=True)
class JoinedEdge:
    node_id: str
    address: str               # as the apiserver recorded it
    credentials: NodeCredentials


def _post(url: str, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    import httpx

    if not url.startswith(("http://", "https://")):
        raise InvalidArgument(f"--join {url!r}: use http://HOST:PORT or https://HOST:PORT")
    verify: Any = True
    ca_file = os.environ.get("DSEC_JOIN_CA")
    if ca_file and url.startswith("https://"):
        import ssl
        verify = ssl.create_default_context(cafile=ca_file)
    try:
        r = httpx.post(url.rstrip("/") + path, json=body, timeout=timeout, verify=verify)
    except httpx.HTTPError as exc:
        if _untrusted(exc):
            # not a blip to wait out: the endpoint is not the one we were told to trust
            # (InvalidArgument, not PermissionDenied: a refused *node* is told apart,
            # and makes an edge given a token discard its credentials)
            raise InvalidArgument(
                f"the https join URL {url} presented a certificate this edge does not "
                f"trust ({exc}); give the CA that signed it in $DSEC_JOIN_CA (a PEM file) "
                "or the system's store / $SSL_CERT_FILE") from exc
        raise ConnectFailed(f"could not reach the apiserver at {url}: {exc}") from exc
    try:
        data = r.json()
    except ValueError:
        data = {}
    if r.status_code >= 400:
        raise error_from_wire(str(data.get("code", "internal")),
                              str(data.get("message", f"HTTP {r.status_code} from {url}")))
    if not isinstance(data, dict):
        raise InvalidArgument(f"unexpected answer from {url}{path}")
    return data


def _untrusted(exc: BaseException) -> bool:
    import ssl
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLCertVerificationError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def prepare_joined_edge(state_dir: str | None, *, join_url: str | None, token: str | None,
                        node_id: str, node_id_given: bool, listen: str,
                        advertise: str | None, timeout: float = 30.0,
                        wait_s: float = 60.0,
                        clock: Any = time.monotonic, sleep: Any = time.sleep) -> JoinedEdge:
    """Join (or rejoin) and return what to serve with (see the module docstring).

    A first join whose apiserver cannot be reached yet (started at the same time, by
    systemd or a test harness) is retried every second for up to ``wait_s``."""
    if state_dir is None:
        raise InvalidArgument("--join needs --state-dir: the node's key and certificate are "
                              "kept there, so a restart rejoins without a token")
    addr = parse_address(listen)
    if addr.kind != "tcp":
        raise InvalidArgument(f"a joined edge serves Aether over TCP+TLS: --listen must be "
                              f"tcp:HOST:PORT, not {listen!r}")
    advertised = f"tcp:{advertise}" if advertise and not advertise.startswith("tcp:") \
        else (advertise or listen)
    adv = parse_address(advertised)
    if adv.kind != "tcp" or adv.port == 0:
        raise InvalidArgument(f"--advertise {advertise or listen!r} must be HOST:PORT with a "
                              "fixed port (the replicas dial it)")
    creds = NodeCredentials(os.path.join(state_dir, "cluster"))
    meta_path = os.path.join(creds.dir, JOIN_FILE)
    if creds.exists():
        known = creds.node_id()
        if node_id_given and node_id != known:
            raise InvalidArgument(f"this state dir holds the credentials of node {known!r}, "
                                  f"not {node_id!r}: drop --node-id, or use another "
                                  "--state-dir to join as a new node")
        url = join_url
        if url is None:
            try:
                with open(meta_path) as f:
                    url = json.load(f).get("url")
            except (OSError, ValueError):
                url = None
        try:
            if url is not None:
                _rejoin(url, creds, known, str(adv), timeout)
            return JoinedEdge(node_id=known, address=str(adv), credentials=creds)
        except (PermissionDenied, Unauthenticated) as exc:
            if token is None or join_url is None:
                raise
            # Revoked (or replaced): a token given with it means "join again".
            log.warning("the cluster refused this node's certificate (%s); joining again "
                        "with the token given", exc)
            for p in (creds.cert_path, creds.key_path, creds.ca_path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
            if not node_id_given:
                node_id = known
    if join_url is None or token is None:
        raise InvalidArgument("this edge has not joined yet: pass --join URL and --token "
                              "TOKEN (from `dsec cluster token create`)")
    tok = JoinToken.parse(token)
    # A join sent before but never answered (killed, cut off) is sent again with the same
    # key: the apiserver recognises it (same token, same key) instead of refusing the id.
    pending = creds.pending_key()
    key_pem, csr_pem = new_node_key(node_id, pending)
    if pending is None:
        creds.save_key(key_pem)
    deadline = clock() + wait_s
    while True:
        try:
            # a fresh nonce per attempt (a lost answer's retry is a new request: the
            # apiserver recognises the same token and key)
            nonce = _challenge(join_url, timeout)
            body = msgspec.to_builtins(join_request(
                tok, node_id=node_id, csr=csr_pem.decode(), address=str(adv), nonce=nonce))
            reply = _post(join_url, "/v1/cluster/join", body, timeout)
            break
        except ConnectFailed as exc:
            if clock() >= deadline:
                raise
            log.warning("%s; retrying for up to %.0fs more", exc, deadline - clock())
            sleep(1.0)
    cert_pem = str(reply.get("certificate", "")).encode()
    ca_pem = str(reply.get("ca", "")).encode()
    try:
        check_issued(cert_pem, ca_pem, key_pem, node_id=node_id, ca_sha256=tok.ca_sha256)
    except ValueError as exc:
        raise InvalidArgument(f"the apiserver's join answer is unreadable: {exc}") from exc
    creds.save_issued(cert_pem, ca_pem)
    _write_meta(meta_path, join_url)
    log.info("joined the cluster at %s as node %s (advertised %s)", join_url, node_id,
             reply.get("address"))
    return JoinedEdge(node_id=node_id, address=str(reply.get("address", adv)),
                      credentials=creds)


def _write_meta(path: str, url: str) -> None:
    write_private_file(path, json.dumps({"url": url}).encode())


def _challenge(url: str, timeout: float) -> str:
    nonce = _post(url, "/v1/cluster/challenge", {}, timeout).get("nonce")
    if not isinstance(nonce, str) or not nonce:
        raise InvalidArgument(f"the apiserver at {url} sent no challenge nonce")
    return nonce


def _rejoin(url: str, creds: NodeCredentials, node_id: str, address: str,
            timeout: float) -> None:
    try:
        nonce = _challenge(url, timeout)
        sig = creds.sign(rejoin_message(node_id, address, nonce))
        _post(url, "/v1/cluster/rejoin", {
            "node_id": node_id, "address": address, "nonce": nonce,
            "certificate": creds.cert_pem().decode(),
            "signature": base64.b64encode(sig).decode()}, timeout)
    except DsecError as exc:
        if isinstance(exc, ConnectFailed):
            log.warning("could not announce node %s at %s to %s (%s); serving anyway: the "
                        "replicas dial the address they recorded", node_id, address, url, exc)
            return
        raise
    log.info("rejoined the cluster at %s as node %s (%s)", url, node_id, address)
