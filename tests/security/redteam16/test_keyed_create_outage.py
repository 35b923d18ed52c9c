"""Red team 16 (pg): a keyed create whose answer cannot be stored wedges its key.

``ApiService._claimed``: after the edge created the sandbox, ``idempotency.finish``
writes the answer to the store. When that write fails with a store error (PostgreSQL
killed or restarting at that moment - the outage issue 16 asks to survive - or, on any
store, a full disk) the exception leaves ``_claimed`` without ``abort``: the claim's
in-memory entry stays "in flight" with a waiter nobody will ever resolve. Every retry of
that key on this apiserver gets ``Begin(wait=...)`` and waits on it until the caller's
timeout; the sandbox exists on the edge, charged to the project, and the caller never
learns its id (a single-replica deployment can never answer it).

Real PostgreSQL (PgServer, its own server), a real apiserver (LocalCluster, one
simulated edge with the paper's microVM latency: create takes 0.9 s), REST.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from dsec.cluster.local import LocalCluster
from dsec.cluster.pgserver import PgServer


@pytest.fixture
def pg() -> Iterator[PgServer]:
    d = tempfile.mkdtemp(prefix="dsec-rt16pg-", dir="/tmp")
    server = PgServer(d, fsync=False, remove=True)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(d, ignore_errors=True)


def _create(c: LocalCluster, key: str, timeout: float) -> httpx.Response:
    return httpx.post(f"{c.url}/v1/sandboxes", json={"project": "default"},
                      timeout=timeout, headers={"authorization": f"Bearer {c.api_key}",
                                                "idempotency-key": key})


def test_a_keyed_create_whose_answer_could_not_be_stored_is_answered_on_retry(
        pg: PgServer) -> None:
    """Safe: once the store is back, the retry of the key is answered within its timeout
    (with the sandbox the first attempt made, or a fresh one after that is destroyed),
    and the project holds exactly one sandbox for the key."""
    c = LocalCluster(edges=1, store=pg.dsn, simulated_profile="paper-microvm").start()
    try:
        assert _create(c, "warm", 30.0).status_code == 201
        first: dict[str, httpx.Response] = {}
        t = threading.Thread(target=lambda: first.setdefault(
            "r", _create(c, "wedge", 30.0)))
        t.start()
        time.sleep(0.45)            # claimed and noted; the edge is creating (0.9 s)
        pg.kill9()
        t.join(30)
        r1 = first["r"]
        assert r1.status_code >= 500, r1.text      # not acknowledged: fine
        pg.start()
        deadline = time.monotonic() + 30
        # the store is back once a fresh keyed create is answered (201: it made one)
        while _ping(c) not in (200, 201) and time.monotonic() < deadline:
            time.sleep(0.2)
        try:
            r2 = _create(c, "wedge", 15.0)
        except httpx.TimeoutException:
            pytest.fail(f"after {r1.status_code} ({r1.json().get('code')}) the retry of the "
                        "same Idempotency-Key hung for 15 s with the store back: the key is "
                        "wedged on this apiserver")
        assert r2.status_code in (200, 201), r2.text
        items = httpx.get(f"{c.url}/v1/sandboxes", params={"project": "default"},
                          headers={"authorization": f"Bearer {c.api_key}"},
                          timeout=30).json()["items"]
        # "warm", the one ping that got through, and exactly one for "wedge"
        assert len(items) == 3, items
    finally:
        c.stop()


def _ping(c: LocalCluster) -> int:
    try:
        return _create(c, f"ping-{time.monotonic_ns()}", 5.0).status_code
    except httpx.HTTPError:
        return 0
