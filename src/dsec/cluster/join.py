"""Joining edges to a cluster: join tokens, the join/rejoin endpoints, revocation.

:class:`JoinAuthority` is the logic (the store, the CA, a clock); :func:`join_routes` its
REST doors:

- ``POST /v1/cluster/challenge`` (no API key): a nonce, bound to the address that asked
  and valid :data:`~dsec.cluster.ca.NONCE_TTL_S`; every join and rejoin starts with one.
- ``POST /v1/cluster/join`` (no API key: a proof of the join token is the credential): a
  CSR, the node id, the advertised address, the token's id and
  ``HMAC(sha256(secret), nonce | node | address | sha256(CSR))`` in (the secret never
  crosses the network: a captured join is good for that one nonce, address and key
  only); the signed certificate and the CA out. The token use and the ``nodes`` row are
  one transaction, written only after the CSR was signed: an expired, revoked, used-up
  or garbage token creates nothing.
- ``POST /v1/cluster/rejoin`` (no API key: a signature by the node's key over its id,
  address and a nonce, with its certificate): a restarted edge announces its address
  without a token. A revoked node's certificate is refused; a nonce is good once, and
  only from the address it was issued to (which is also the address recorded for an
  advertised ``0.0.0.0``): a replayed rejoin moves nothing.
- Tokens and joined nodes (``GET/POST /v1/cluster/tokens``, ``DELETE
  /v1/cluster/tokens/{id}[?nodes=true]``, ``GET /v1/cluster/nodes``, ``POST
  /v1/cluster/nodes/{id}/revoke``) are the catalogue's ``cluster_*`` rows
  (:mod:`dsec.wire.ops`), served at every door by :class:`~dsec.control.api.service.
  ApiService` over this authority: superusers only.

Failed joins and rejoins are charged to the client address's budget for unauthenticated
requests (the one the REST door keeps for bad API keys): a token guesser is answered 429
after the burst, for the price of nothing. Request bodies are capped at
:data:`MAX_BODY`, and the HTTP listener's own limits (header/body deadlines, connections
per address) bound slow clients exactly as on every other route.
"""

from __future__ import annotations

import base64
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import msgspec
from cryptography.hazmat.primitives.asymmetric import ec

from dsec.aether.transport import Address, parse_address
from dsec.cluster.ca import (
    NONCE_TTL_S,
    ClusterCA,
    JoinToken,
    cert_fingerprint,
    check_nonce,
    issue_node_cert,
    join_proof,
    key_fingerprint,
    make_nonce,
    verify_rejoin,
)
from dsec.control.store.membership import JoinTokenRow, NodeRow
from dsec.errors import (
    Conflict,
    DsecError,
    InternalError,
    InvalidArgument,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    Unauthenticated,
)
from dsec.ids import parse_node_id
from dsec.wire.cluster import JoinedNode, JoinTokenCreate, JoinTokenView

__all__ = ["ChallengeReply", "JoinAuthority", "JoinReply", "JoinRequest", "RejoinRequest",
           "edge_join_args", "join_request", "join_routes"]

log = logging.getLogger("dsec.cluster.join")

MAX_BODY = 16 << 10          # a CSR is ~500 bytes; a certificate ~700
MAX_TTL_S = 365 * 86400.0
MAX_USES = 10_000
_TOKEN_ID = re.compile(r"[0-9a-f]{12}")


class ChallengeReply(msgspec.Struct, frozen=True, kw_only=True):
    nonce: str
    peer: str                # the address the apiserver sees this client at
    expires_in_s: float


class JoinRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    token_id: str            # the token's <id> (never its secret)
    ca_sha256: str           # the CA the token pins (a token of another cluster: a clear error)
    node_id: str
    csr: str                 # PEM
    address: str             # tcp:HOST:PORT the replicas dial (HOST 0.0.0.0: the peer's IP)
    nonce: str               # from POST /v1/cluster/challenge
    proof: str               # ca.join_proof(sha256(secret), nonce, node_id, address, csr)


def join_request(token: str | JoinToken, *, node_id: str, csr: str, address: str,
                 nonce: str) -> JoinRequest:
    """The join request an edge sends for ``token`` (the secret stays here)."""
    tok = token if isinstance(token, JoinToken) else JoinToken.parse(token)
    return JoinRequest(token_id=tok.id, ca_sha256=tok.ca_sha256, node_id=node_id, csr=csr,
                       address=address, nonce=nonce,
                       proof=join_proof(tok.secret_hash, nonce, node_id, address,
                                        csr.encode()))


class JoinReply(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    certificate: str         # PEM
    ca: str                  # PEM
    ca_sha256: str
    address: str             # as recorded


class RejoinRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    node_id: str
    address: str
    nonce: str               # from POST /v1/cluster/challenge (once, from that address)
    certificate: str         # PEM
    signature: str           # base64 ECDSA-SHA256 over ca.rejoin_message(...)


# The catalogue's types (dsec.wire.cluster): the cluster_* rows serve tokens and nodes
# at every door; these names stay for the edges' side and older callers.
TokenCreate = JoinTokenCreate
TokenView = JoinTokenView
NodeView = JoinedNode


def token_view(row: JoinTokenRow, token: str | None = None) -> TokenView:
    return TokenView(id=row.id, uses=row.uses, used=row.used, created_at=row.created_at,
                     expires_at=row.expires_at, revoked=row.revoked,
                     description=row.description, token=token)


def node_view(row: NodeRow) -> NodeView:
    return NodeView(node_id=row.node_id, address=row.address,
                    cert_fingerprint=row.cert_fingerprint, token_id=row.token_id,
                    joined_at=row.joined_at, revoked=row.revoked)


def _advertised(text: str, peer: str | None) -> Address:
    addr = parse_address(text)
    if addr.kind != "tcp":
        raise InvalidArgument(f"advertised address {text!r} must be tcp:HOST:PORT (a joined "
                              "edge serves Aether over TCP+TLS)", field="address")
    if addr.port == 0:
        raise InvalidArgument(f"advertised address {text!r} has port 0", field="address")
    if addr.host in ("0.0.0.0", "::", "") and peer:
        addr = Address("tcp", host=peer, port=addr.port)
    return addr


class JoinAuthority:
    """Tokens, joins, rejoins and revocations over one store and the cluster CA."""

    def __init__(self, store: Any, ca: ClusterCA, *,
                 clock: Callable[[], float] = time.time,
                 reserved: frozenset[str] = frozenset()) -> None:
        self.store = store
        self.ca = ca
        self.clock = clock
        # node ids this apiserver has as static edges (`dsec up`'s edge-N, --edge flags):
        # a joined node may not take one
        self.reserved = reserved

    # ------------------------------------------------------------------ nonces
    def challenge(self, peer: str | None = None) -> ChallengeReply:
        return ChallengeReply(nonce=make_nonce(self.ca, peer or "", now_s=self.clock()),
                              peer=peer or "", expires_in_s=NONCE_TTL_S)

    def _check_nonce(self, nonce: str, peer: str | None) -> str:
        """Check the nonce (this CA's, unexpired, issued to ``peer``, unspent); returns
        the peer address it was issued to. Spending it is :meth:`_spend`'s."""
        now = self.clock()
        issued_to, _ = check_nonce(self.ca, nonce, peer or "", now_s=now)
        if self.store.nonce_spent(nonce, now):
            raise _nonce_used()
        return issued_to

    def _spend(self, nonce: str) -> None:
        """Spend the nonce in the state store, once for every replica: two requests
        carrying it (a replay to another replica, or two at once) get one spend."""
        now = self.clock()
        if not self.store.spend_nonce(nonce, now + NONCE_TTL_S + 1.0, now):
            raise _nonce_used()

    # ------------------------------------------------------------------ tokens
    def create_token(self, *, ttl_s: float = 86400.0, uses: int = 1,
                     description: str = "") -> tuple[JoinToken, JoinTokenRow]:
        if not 0 < ttl_s <= MAX_TTL_S:
            raise InvalidArgument(f"ttl {ttl_s:g}s must be within (0, {MAX_TTL_S:g}]s",
                                  field="ttl_s")
        if not 1 <= uses <= MAX_USES:
            raise InvalidArgument(f"uses {uses} must be within 1..{MAX_USES}", field="uses")
        if len(description) > 200:
            raise InvalidArgument("description is longer than 200 characters",
                                  field="description")
        tok = JoinToken.new(self.ca.fingerprint)
        now = self.clock()
        row = JoinTokenRow(id=tok.id, secret_hash=tok.secret_hash, uses=uses, used=0,
                           created_at=now, expires_at=now + ttl_s, description=description)
        self.store.put_join_token(row)
        return tok, row

    def list_tokens(self) -> list[JoinTokenRow]:
        return list(self.store.list_join_tokens())

    def revoke_token(self, token_id: str, *, nodes: bool = False) -> list[str]:
        """Revoke a token (no more joins with it); with ``nodes`` also every node that
        joined with it. Returns the node ids revoked."""
        if not self.store.revoke_join_token(token_id):
            raise NotFound(f"no join token {token_id!r}; see `dsec cluster token list`")
        out = []
        if nodes:
            for n in self.store.list_nodes():
                if n.token_id == token_id and not n.revoked:
                    self.store.revoke_node(n.node_id, self.clock())
                    out.append(n.node_id)
        return out

    # ------------------------------------------------------------------ nodes
    def list_nodes(self) -> list[NodeRow]:
        return list(self.store.list_nodes())

    def revoke_node(self, node_id: str) -> None:
        if not self.store.revoke_node(node_id, self.clock()):
            raise NotFound(f"no joined node {node_id!r}; see `dsec cluster node list`")
        log.warning("node %s revoked: every replica refuses its certificate from now on",
                    node_id)

    # ------------------------------------------------------------------ join
    def join(self, req: JoinRequest, peer: str | None = None) -> JoinReply:
        if not _TOKEN_ID.fullmatch(req.token_id):
            raise Unauthenticated("malformed join token id: expected 12 hex digits (the "
                                  "first part of the token `dsec cluster token create` "
                                  "printed)")
        if req.ca_sha256 != self.ca.fingerprint:
            raise Unauthenticated("the join token pins another CA than this cluster's "
                                  f"(sha256 {self.ca.fingerprint}); it was made by another "
                                  "cluster, or this one's CA was remade")
        node = parse_node_id(req.node_id)
        if node in self.reserved:
            raise Conflict(f"node id {node!r} is a static edge of this cluster (`dsec up`'s "
                           "own, or an --edge flag): pick another --node-id")
        if len(req.csr) > MAX_BODY:
            raise PayloadTooLarge("CSR too large", limit=MAX_BODY)
        # The nonce binds the request to the address that asked for it (and the address
        # recorded for an advertised 0.0.0.0 is that one: the proof covers it).
        addr = _advertised(req.address, self._check_nonce(req.nonce, peer))
        # The cheap token check first (a guesser costs no signature; a used-up token may
        # still be the retry of a join whose answer was lost: join_node decides) ...
        row = self.store.get_join_token(req.token_id)
        now = self.clock()
        if (row is None or row.revoked or row.expires_at <= now
                or not _same(join_proof(row.secret_hash, req.nonce, req.node_id, req.address,
                                        req.csr.encode()).encode(), req.proof.encode())):
            raise Unauthenticated(_token_refusal(row, now))
        self._spend(req.nonce)
        tok_id, secret_hash = row.id, row.secret_hash
        cert = issue_node_cert(self.ca, req.csr.encode(), node)
        fp = cert_fingerprint(cert)
        # ... then the use and the row, together (two joins racing for the last use:
        # one wins, the other's certificate is thrown away unrecorded and never valid).
        pub = cert.public_key()
        assert isinstance(pub, ec.EllipticCurvePublicKey)
        why = self.store.join_node(tok_id, secret_hash, now, NodeRow(
            node_id=node, address=str(addr), cert_fingerprint=fp, token_id=tok_id,
            joined_at=now, key_fingerprint=key_fingerprint(pub)))
        if why == "taken":
            raise Conflict(f"node {node!r} is already joined; pick another --node-id, or "
                           f"revoke it first (`dsec cluster node revoke {node}`)")
        if why:
            raise Unauthenticated(_token_refusal(self.store.get_join_token(tok_id), now))
        from cryptography.hazmat.primitives import serialization
        log.info("node %s joined at %s with token %s", node, addr, tok_id)
        return JoinReply(node_id=node, certificate=cert.public_bytes(
            serialization.Encoding.PEM).decode(), ca=self.ca.pem.decode(),
            ca_sha256=self.ca.fingerprint, address=str(addr))

    def rejoin(self, req: RejoinRequest, peer: str | None = None) -> NodeView:
        node = parse_node_id(req.node_id)
        addr = _advertised(req.address, self._check_nonce(req.nonce, peer))
        try:
            sig = base64.b64decode(req.signature, validate=True)
        except ValueError as exc:
            raise Unauthenticated("rejoin signature is not base64") from exc
        fp = verify_rejoin(self.ca, req.certificate.encode(), sig, node, req.address,
                           req.nonce, now_s=self.clock())
        self._spend(req.nonce)
        if fp in self.store.revoked_fingerprints():
            raise PermissionDenied(f"node {node}'s certificate was revoked: it cannot rejoin "
                                   "with it; join again with a new token (as a new node id "
                                   "or after `dsec cluster node revoke`)")
        if not self.store.set_node_address(node, fp, str(addr)):
            raise Unauthenticated(f"node {node} with this certificate is not a joined node "
                                  "(revoked, replaced, or never joined): join with a token")
        row = self.store.get_node(node)
        assert row is not None
        return node_view(row)


def _nonce_used() -> Unauthenticated:
    return Unauthenticated("this challenge nonce was used already: ask "
                           "POST /v1/cluster/challenge for a fresh one per request")


def edge_join_args(authority: JoinAuthority, url: str, *, node_id: str, listen: str,
                   ttl_s: float = 600.0) -> tuple[list[str], dict[str, str]]:
    """What to add to a ``dsec edge --state-dir DIR ...`` command line so that it joins the
    cluster at ``url`` (REST) as ``node_id``, serving TLS on ``listen`` (``tcp:HOST:PORT``;
    ``tcp:0.0.0.0:PORT`` lets the apiserver record the address the join came from):
    argv and environment (the single-use token travels in $DSEC_JOIN_TOKEN, not argv).
    Instead of a static ``--edge NODE=tcp:ADDR`` on the apiserver plus ``--token-file``
    on the edge (docs/cluster.md)."""
    tok, _ = authority.create_token(ttl_s=ttl_s, uses=1, description=f"join {node_id}")
    return (["--join", url, "--node-id", node_id, "--listen", listen],
            {"DSEC_JOIN_TOKEN": str(tok)})


class _Empty(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The (empty) body of a challenge request."""


def _same(a: bytes, b: bytes) -> bool:
    import hmac
    return hmac.compare_digest(a, b)


def _token_refusal(row: JoinTokenRow | None, now: float) -> str:
    """One message for every bad token (which part was wrong is the guesser's to find
    out); the token's owner reads the real state with `dsec cluster token list`."""
    del row, now
    return ("join token refused: unknown, wrong secret, expired, revoked or used up "
            "(see `dsec cluster token list`; create a new one with `dsec cluster token "
            "create`)")


# ---------------------------------------------------------------------- REST
def join_routes(authority: JoinAuthority, service: Any) -> list[tuple[Any, Any]]:
    """The Starlette routes of :class:`JoinAuthority` (see the module docstring)."""
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from dsec.control.apiserver import (
        _client_host,
        _error_response,
        _json_response,
        _read_body,
        _request_id,
    )

    async def body(request: Request) -> bytes:
        return await _read_body(request, MAX_BODY)

    def _internal(rid: str, exc: Exception) -> Response:
        return _error_response(InternalError(
            f"internal error ({type(exc).__name__}); quote request id {rid} when "
            "reporting it"), rid)

    def decode(t: type[Any], raw: bytes) -> Any:
        if t is _Empty:          # a challenge: whatever the body, nothing is read from it
            return _Empty()
        try:
            return msgspec.json.decode(raw, type=t)
        except msgspec.DecodeError as exc:
            raise InvalidArgument(f"bad {t.__name__} body: {exc}") from exc

    def anonymous(fn: Callable[[Any, str | None], Any], t: type[Any]) -> Any:
        async def endpoint(request: Request) -> Response:
            rid = _request_id(request)
            client = _client_host(request.scope)
            try:
                if client is not None:
                    service.check_anonymous(client, charge=False)
                try:
                    reply = fn(decode(t, await body(request)), client)
                except (Unauthenticated, PermissionDenied, InvalidArgument):
                    if client is not None:
                        service.check_anonymous(client, charge=True)
                    raise
            except DsecError as exc:
                return _error_response(exc, rid)
            except Exception as exc:  # a bug: say so, log it, never leak the trace
                log.exception("request %s %s failed (request id %s)", request.method,
                              request.url.path, rid)
                return _internal(rid, exc)
            return _json_response(reply, rid, 200)
        return endpoint

    from dsec.control.api.openapi import Op

    def challenge(raw: Any, client: str | None) -> ChallengeReply:
        del raw
        return authority.challenge(client)

    tag = "cluster"
    return [
        (Route("/v1/cluster/challenge", anonymous(challenge, _Empty), methods=["POST"]),
         Op("POST", "/v1/cluster/challenge", "clusterChallenge",
            "A nonce for one join or rejoin (bound to the caller's address)", None,
            ChallengeReply, tag=tag, auth=False)),
        (Route("/v1/cluster/join", anonymous(authority.join, JoinRequest), methods=["POST"]),
         Op("POST", "/v1/cluster/join", "clusterJoin", "Join an edge with a join token",
            JoinRequest, JoinReply, tag=tag, auth=False, body_credential=True)),
        (Route("/v1/cluster/rejoin", anonymous(authority.rejoin, RejoinRequest),
               methods=["POST"]),
         Op("POST", "/v1/cluster/rejoin", "clusterRejoin",
            "A joined edge announces its address, signed by its key", RejoinRequest,
            NodeView, tag=tag, auth=False, body_credential=True)),
    ]
