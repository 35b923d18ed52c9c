"""The PostgreSQL state store going away under a serving apiserver (its own throwaway
server per test, so killing it disturbs no other test):

- while it is down, requests that need it fail fast with a retryable error at every
  door: REST answers 503 with ``Retry-After``, the Aether gateway the same ``unavailable``
  code (the SDK raises :class:`~dsec.errors.Unavailable` on both transports);
- when it is back the apiserver serves again without a restart (the pool reconnects);
- kill -9 of the server in the middle of keyed creates loses nothing acknowledged and
  makes no duplicate: every acknowledged sandbox is on the edge, listed by the apiserver
  and in the store, exactly once per key.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from dsec.client.sync import Client
from dsec.cluster.local import LocalCluster
from dsec.cluster.pgserver import PgServer
from dsec.control.api.plane import PlaneConfig
from dsec.errors import Unavailable
from dsec.wire.api import CreateSandboxRequest
from tests.control.conftest import replica, served_edge


@pytest.fixture
def pg() -> Iterator[PgServer]:
    d = tempfile.mkdtemp(prefix="dsec-pgf-", dir="/tmp")
    server = PgServer(d, fsync=False, remove=True)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def cluster(pg: PgServer) -> Iterator[LocalCluster]:
    c = LocalCluster(edges=1, store=pg.dsn).start()
    try:
        yield c
    finally:
        c.stop()


def _create(c: LocalCluster, key: str) -> httpx.Response:
    return httpx.post(f"{c.url}/v1/sandboxes", json={"project": "default"}, timeout=30.0,
                      headers={"authorization": f"Bearer {c.api_key}",
                               "idempotency-key": key})


def test_an_outage_fails_fast_and_retryably_at_every_door_then_heals(
        pg: PgServer, cluster: LocalCluster) -> None:
    assert _create(cluster, "before").status_code == 201
    pg.kill9()
    try:
        # REST: 503, Retry-After, the store named, well within the request timeout
        t0 = time.monotonic()
        r = _create(cluster, "during-rest")
        took = time.monotonic() - t0
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        body = r.json()
        assert body["code"] == "unavailable" and "state store" in body["message"]
        assert took < 10.0, f"the 503 took {took:.1f}s: it must not wait out timeouts"
        # the gateway and the SDK's REST transport raise the same retryable class
        for gateway in (cluster.gateway, None):
            with Client(cluster.url, cluster.api_key, gateway=gateway, retries=0,
                        create_retry_s=0, session_lease_s=None) as client:
                t0 = time.monotonic()
                with pytest.raises(Unavailable, match="state store"):
                    client.sandboxes.create(idempotency_key=f"during-{gateway is None}")
                assert time.monotonic() - t0 < 10.0
    finally:
        pg.start()
    # back without restarting the apiserver: the pool reconnects on its own
    deadline = time.monotonic() + 20.0
    while (r := _create(cluster, "after")).status_code != 201:
        assert r.status_code == 503, r.text
        assert time.monotonic() < deadline, f"still failing after the restart: {r.text}"
        time.sleep(0.2)
    again = _create(cluster, "after")
    assert again.status_code == 201 and again.json()["id"] == r.json()["id"]


def test_kill9_of_postgresql_mid_creates_loses_nothing_acknowledged(
        pg: PgServer, cluster: LocalCluster) -> None:
    keys = [f"k-{i}" for i in range(60)]
    acked: dict[str, str] = {}
    refused: list[int] = []
    errors: list[str] = []

    def creates() -> None:
        for key in keys:
            deadline = time.monotonic() + 60.0
            while time.monotonic() < deadline:     # a client retrying with its key
                try:
                    r = _create(cluster, key)
                except httpx.HTTPError as exc:
                    errors.append(repr(exc))
                    time.sleep(0.1)
                    continue
                if r.status_code == 201:
                    acked[key] = r.json()["id"]
                    break
                if r.status_code != 503 or "retry-after" not in r.headers:
                    errors.append(f"{key}: {r.status_code} {r.text}")
                    return
                refused.append(r.status_code)
                time.sleep(0.1)

    worker = threading.Thread(target=creates)
    worker.start()
    while len(acked) < 15:
        time.sleep(0.01)
    pg.kill9()                      # mid-creates: the server and every backend, no warning
    time.sleep(1.0)
    pg.start()
    worker.join(120.0)
    assert not worker.is_alive() and not errors, errors
    assert len(acked) == len(keys)
    assert refused, "no create met the outage (the kill came too late to test anything)"
    ids = set(acked.values())
    assert len(ids) == len(keys)                       # one sandbox per key, no duplicate
    rt: Any = cluster.runtime
    edge_ids = {s.id for s in rt.nodes[0].list()}
    assert ids == edge_ids                            # nothing extra was made
    listed = httpx.get(f"{cluster.url}/v1/sandboxes", params={"limit": 500},
                       headers={"authorization": f"Bearer {cluster.api_key}"}).json()
    assert ids <= {s["id"] for s in listed["items"]}
    # and durable in the store (the registry's batch that met the outage was kept and
    # committed after): read straight from PostgreSQL
    deadline = time.monotonic() + 10.0
    while True:
        with psycopg.connect(pg.dsn) as conn:
            stored = {r[0] for r in conn.execute("SELECT id FROM sandboxes")}
        if ids <= stored or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert ids <= stored


async def test_replicas_keep_hearing_each_other_across_a_server_restart(
        pg: PgServer, tmp_path: Path) -> None:
    """The LISTEN connection dies with the server; it reconnects (and polls meanwhile),
    and replica b lists what replica a creates after the restart, with no heartbeat."""
    cfg = PlaneConfig(heartbeat_interval_s=60.0, store_push_poll_s=60.0, store_poll_s=0.05)
    async with served_edge(tmp_path) as edge:
        a = await replica(pg.dsn, edge.addr, plane=cfg)
        b = await replica(pg.dsn, edge.addr, plane=cfg)
        try:
            await a.plane.start()
            await b.plane.start()
            caller = a.service.authenticate(f"Bearer {a.plane.bootstrap_admin()}")
            await asyncio.to_thread(pg.kill9)
            await asyncio.to_thread(pg.start)
            t0 = time.monotonic()
            while True:                      # a's first calls may meet the dead pool
                try:
                    made = await a.service.create(caller, CreateSandboxRequest())
                    break
                except Unavailable:
                    assert time.monotonic() - t0 < 20.0
                    await asyncio.sleep(0.1)
            while made.id not in b.plane.registry:
                assert time.monotonic() - t0 < 20.0, "b never heard of a's create"
                await asyncio.sleep(0.01)
        finally:
            await a.close()
            await b.close()
