"""A join challenge nonce is good once across every apiserver replica (issue 16): spent
nonces live in the state store, so a join or rejoin replayed to another replica within
the nonce's lifetime is refused there, on both stores. Two replicas here are two
:class:`~dsec.cluster.join.JoinAuthority` objects over their own connections to one real
store, with the cluster's one CA (as every replica has it)."""

from __future__ import annotations

import base64
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dsec.cluster.ca import NodeCredentials, init_ca, new_node_key, rejoin_message
from dsec.cluster.join import NONCE_TTL_S, JoinAuthority, RejoinRequest, join_request
from dsec.control.store import open_store
from dsec.errors import Unauthenticated


def test_a_join_or_rejoin_replayed_to_another_replica_is_refused(
        tmp_path: Path, store_url: str) -> None:
    ca, _ = init_ca(str(tmp_path / "ca"))
    s1, s2 = open_store(store_url), open_store(store_url)
    clock = [time.time()]
    try:
        r1 = JoinAuthority(s1, ca, clock=lambda: clock[0])
        r2 = JoinAuthority(s2, ca, clock=lambda: clock[0])
        tok, _ = r1.create_token(ttl_s=600, uses=1)
        key, csr = new_node_key("edge-a")
        join = join_request(str(tok), node_id="edge-a", csr=csr.decode(),
                            address="tcp:127.0.0.1:7443", nonce=r1.challenge("10.0.0.5").nonce)
        reply = r1.join(join, "10.0.0.5")
        # the very join, replayed to the other replica from the same address
        with pytest.raises(Unauthenticated, match="used already"):
            r2.join(join, "10.0.0.5")
        assert s2.get_node("edge-a") is not None
        assert [n.node_id for n in s2.list_nodes()] == ["edge-a"]
        creds = NodeCredentials(str(tmp_path / "creds"))
        creds.save(key, reply.certificate.encode(), reply.ca.encode())

        def rejoin_req(addr: str, nonce: str) -> RejoinRequest:
            sig = creds.sign(rejoin_message("edge-a", addr, nonce))
            return RejoinRequest(node_id="edge-a", address=addr, nonce=nonce,
                                 certificate=creds.cert_pem().decode(),
                                 signature=base64.b64encode(sig).decode())
        # a rejoin through replica 2, replayed to replica 1 after the node moved on
        first = rejoin_req("tcp:127.0.0.9:7443", r2.challenge("10.0.0.5").nonce)
        r2.rejoin(first, "10.0.0.5")
        r1.rejoin(rejoin_req("tcp:127.0.0.8:7443", r1.challenge("10.0.0.5").nonce),
                  "10.0.0.5")
        with pytest.raises(Unauthenticated, match="used already"):
            r1.rejoin(first, "10.0.0.5")
        assert s1.get_node("edge-a").address == "tcp:127.0.0.8:7443"  # not moved back
        # one nonce sent to both replicas at once: one spend
        both = rejoin_req("tcp:127.0.0.7:7443", r1.challenge("10.0.0.5").nonce)
        with ThreadPoolExecutor(2) as pool:
            outcomes = list(pool.map(lambda r: _try(r, both), (r1, r2)))
        assert sorted(outcomes) == [False, True]
        # spent nonces are kept only while they could be used
        clock[0] += NONCE_TTL_S + 2
        r1.rejoin(rejoin_req("tcp:127.0.0.6:7443", r1.challenge("10.0.0.5").nonce),
                  "10.0.0.5")
        assert not s1.nonce_spent(both.nonce, 0.0)      # pruned by the later spend
    finally:
        s1.close()
        s2.close()


def _try(auth: JoinAuthority, req: RejoinRequest) -> bool:
    try:
        auth.rejoin(req, "10.0.0.5")
        return True
    except Unauthenticated:
        return False
