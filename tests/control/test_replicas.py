"""Two apiserver replicas (ControlPlane + ApiService each) over one SQLite state store and
one real edge served over Aether on a Unix socket: they must behave like one apiserver
for Idempotency-Key creates and session leases, and their registries must not collide
on event versions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec.control.api.plane import PlaneConfig
from dsec.control.api.service import Caller
from dsec.control.idempotency import IdempotencyCache, Retry, fingerprint
from dsec.control.store import open_store
from dsec.edge.node import EdgeNode
from dsec.errors import Conflict
from dsec.wire.api import CreateSandboxRequest
from tests.control.conftest import Replica, replica, served_edge


@pytest.fixture
async def replicas(tmp_path: Path, store_url: str
                   ) -> AsyncIterator[tuple[Replica, Replica, EdgeNode, str]]:
    async with served_edge(tmp_path) as edge:
        node, addr = edge.node, edge.addr
        reps: list[Replica] = []
        try:
            for _ in range(2):   # one store file, two connections
                reps.append(await replica(store_url, addr))
            key = reps[0].plane.bootstrap_admin()
            yield reps[0], reps[1], node, key
        finally:
            for r in reps:
                await r.close()


async def test_create_retried_on_the_other_replica_returns_the_same_sandbox(
        replicas: tuple[Replica, Replica, EdgeNode, str]) -> None:
    a, b, node, key = replicas
    caller_a = a.service.authenticate(f"Bearer {key}")
    caller_b = b.service.authenticate(f"Bearer {key}")  # the key is in the shared store
    req = CreateSandboxRequest(labels={"run": "1"})
    raw = b'{"labels": {"run": "1"}}'
    first = await a.service.create(caller_a, req, idempotency_key="retry-1", raw=raw)
    again = await b.service.create(caller_b, req, idempotency_key="retry-1", raw=raw)
    assert again.id == first.id
    assert [i.id for i in node.list()] == [first.id]          # nothing else was created
    with pytest.raises(Conflict, match="different request body"):
        await b.service.create(caller_b, CreateSandboxRequest(), idempotency_key="retry-1",
                               raw=b"{}")
    assert node.live_count == 1
    # Both registries write the one store: versions are allocated there, no collision.
    other = await b.service.create(caller_b, CreateSandboxRequest())
    a.plane.registry.flush()
    b.plane.registry.flush()
    versions = [e.version for e in a.store.read_events(0, 100)]
    assert versions == list(range(1, len(versions) + 1)) and len(versions) == 2
    # Each replica learns the other's sandboxes from the store (Registry.catch_up: the
    # store watch runs it), not from the edge's lists.
    a.plane.registry.catch_up()
    page, _ = a.service.directory.list_sandboxes(caller_a, project=None, labels={},
                                                 state=None, after="", limit=10)
    assert {i.id for i in page} == {first.id, other.id}


async def test_concurrent_create_on_two_replicas_creates_one(
        replicas: tuple[Replica, Replica, EdgeNode, str]) -> None:
    a, b, node, key = replicas
    ca, cb = (r.service.authenticate(f"Bearer {key}") for r in (a, b))
    req = CreateSandboxRequest(labels={"race": "1"})
    x, y = await asyncio.gather(
        a.service.create(ca, req, idempotency_key="race-1", raw=b"same"),
        b.service.create(cb, req, idempotency_key="race-1", raw=b"same"))
    assert x.id == y.id and node.live_count == 1


async def test_a_waiter_on_another_replica_takes_the_key_when_the_first_create_fails(
        store_url: str) -> None:
    store = open_store(store_url)
    try:
        one = IdempotencyCache(clock=time.time, store=store, poll_s=0.005)
        two = IdempotencyCache(clock=time.time, store=store, poll_s=0.005)
        key, fp = IdempotencyCache.scoped("p", "k"), fingerprint(b"body")
        assert one.begin(key, fp).proceed
        wait = two.begin(key, fp).wait
        assert wait is not None
        one.abort(key, RuntimeError("edge refused"))
        with pytest.raises(Retry):                 # claim it yourself: no 409 on the way
            await asyncio.wait_for(wait, 5)
        assert two.begin(key, fp).proceed          # the key is free again
        two.finish(key, b"answer")
        assert one.begin(key, fp).replay == b"answer"
        await one.close()
        await two.close()
    finally:
        store.close()


async def test_idempotency_rows_expire_and_stay_bounded(store_url: str) -> None:
    store = open_store(store_url)
    try:
        clock = [1000.0]
        cache = IdempotencyCache(clock=lambda: clock[0], store=store, ttl_s=300,
                                 max_entries=20, purge_every=10)
        for i in range(100):
            clock[0] += 0.001      # distinct expiry times: "oldest" is the same on both stores
            k = IdempotencyCache.scoped("p", f"k{i}")
            assert cache.begin(k, "fp").proceed
            cache.finish(k, b"r")
        assert len(cache) == 20
        # The purge at the 100th claim kept the 20 newest finished rows (k79..k98) and
        # the claim in flight (k99); now that k99 finished, the oldest of 21 goes.
        assert store.idem_purge(clock[0], 20) == 1
        # (PostgreSQL text cannot hold the NUL of a scoped key: it stores U+001F)
        assert sorted(r[0].replace("\x1f", "\x00")
                      for r in store._all("SELECT key FROM idempotency")) == sorted(
            IdempotencyCache.scoped("p", f"k{i}") for i in range(80, 100))
        clock[0] += 301                                        # the 5-minute window ends
        assert store.idem_get(IdempotencyCache.scoped("p", "k99"), clock[0]) is None
        assert cache.begin(IdempotencyCache.scoped("p", "k99"), "other-body").proceed
    finally:
        store.close()


async def test_session_opened_on_one_replica_is_renewable_and_closable_on_the_other(
        replicas: tuple[Replica, Replica, EdgeNode, str]) -> None:
    a, b, node, key = replicas
    ca: Caller = a.service.authenticate(f"Bearer {key}")
    cb: Caller = b.service.authenticate(f"Bearer {key}")
    ses = a.plane.open_session(ca, 30.0)
    renewed = b.plane.renew_session(cb, ses.id)
    assert renewed.id == ses.id and renewed.expires_at >= ses.expires_at
    sb = await a.service.create(ca, CreateSandboxRequest(session=ses.id))
    assert await a.plane.sweep() == [] and await b.plane.sweep() == []
    b.plane.close_session(cb, ses.id)
    # replica A sweeps what B closed
    assert await a.plane.sweep() == [(sb.id, "session_closed")]
    assert node.get(sb.id).state == "destroyed"


async def test_a_quota_or_ceiling_set_on_one_replica_binds_the_other(
        replicas: tuple[Replica, Replica, EdgeNode, str]) -> None:
    """Each replica holds a copy of the quotas; the other's changes reach it within
    PlaneConfig.quota_refresh_s (here 0: every check re-reads the store). Before, a
    network ceiling (or quota) set through one apiserver bound the others only after
    their restart."""
    import dataclasses

    from dsec.errors import PermissionDenied, QuotaExceeded
    from dsec.wire.api import QuotaBody
    from dsec.wire.netpolicy import NetworkPolicy

    a, b, node, key = replicas
    b.plane.config = dataclasses.replace(b.plane.config, quota_refresh_s=0.0)
    ca, cb = (r.service.authenticate(f"Bearer {key}") for r in (a, b))
    assert b.service.network_ceilings("lab/x") == []
    ceiling = NetworkPolicy(mode="policy", allow=("pypi.org:443/tcp",))
    a.plane.admin.set_quota(ca, "lab", QuotaBody(network=ceiling))
    with pytest.raises(PermissionDenied, match="outside the network ceiling of project 'lab'"):
        await b.service.create(cb, CreateSandboxRequest(project="lab/x",
                                                        network=NetworkPolicy(mode="open")))
    assert node.live_count == 0
    ok = await b.service.create(cb, CreateSandboxRequest(project="lab/x", network=ceiling))
    assert ok.spec.network == ceiling
    a.plane.admin.set_quota(ca, "lab", QuotaBody(max_sandboxes=1, network=ceiling))
    with pytest.raises(QuotaExceeded):
        await b.service.create(cb, CreateSandboxRequest(project="lab/x"))
    assert node.live_count == 1


async def test_a_sandbox_is_recorded_once_by_the_replica_that_created_it(
        tmp_path: Path, store_url: str) -> None:
    """Replica B meets A's sandbox in the edge's listing before reading A's commit: it
    holds A's stored record (listed, charged) and writes nothing of its own, so the
    store gets one row write and one ``sandbox_added`` per create, not one per replica."""
    async with served_edge(tmp_path) as edge:
        every = PlaneConfig(sandbox_list_interval_s=0.0)     # a full list at each poll
        a = await replica(store_url, edge.addr, plane=every)
        b = await replica(store_url, edge.addr, plane=every)
        try:
            await _recorded_once(a, b, edge.node, a.plane.bootstrap_admin())
        finally:
            await a.close()
            await b.close()


async def _recorded_once(a: Replica, b: Replica, node: EdgeNode, key: str) -> None:
    ca, cb = (r.service.authenticate(f"Bearer {key}") for r in (a, b))
    made = await a.service.create(ca, CreateSandboxRequest(labels={"once": "1"}))
    a.plane.registry.flush()
    before = b.plane.registry.version
    await b.plane.poll_edges()                     # a full list: B discovers it
    assert made.id in b.plane.registry
    page, _ = b.service.directory.list_sandboxes(cb, project=None, labels={"once": "1"},
                                                 state=None, after="", limit=10)
    assert [i.id for i in page] == [made.id]
    assert b.plane.registry.version == before      # no event of B's own
    b.plane.registry.flush()
    b.plane.registry.catch_up()                    # A's event: skipped, known already
    added = [e for e in a.store.read_events(0, 100)
             if e.kind == "sandbox_added" and e.sandbox_id == made.id]
    assert len(added) == 1
    # a pause B hears of from the edge is a change of B's: written once
    await node.pause(made.id)
    await b.plane.poll_edges()
    assert b.plane.registry.sandbox(made.id).paused
