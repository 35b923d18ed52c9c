"""Idempotency across an apiserver crash, at the ApiService level: a real SQLite store
shared by a "dead" apiserver and a live one, and a real edge over Aether.

A dead apiserver is one whose process lease stopped being renewed (its renew task is
gone, its lease row stays: kill -9 drops nothing), holding a claim, possibly with the
sandbox id it noted and possibly with that sandbox already made on the edge. The live
one gets the retry: it must take the claim over within about the lease (not a fixed
60 s in-flight lease ending in a 409) and answer with the sandbox the dead one made, so
exactly one sandbox exists. tests/client/test_crash_recovery.py does the same with
kill -9 of a real `dsec up`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from dsec.control.api.service import ApiService, Caller
from dsec.control.idempotency import ClaimLost, IdempotencyCache, request_fingerprint
from dsec.control.store import IdempotencyRow
from dsec.control.store.sqlite import SqliteStore
from dsec.edge.backends.simulated import NodeLatencyProfile, SimulatedBackend
from dsec.edge.node import EdgeNode
from dsec.wire.api import CreateSandboxRequest
from dsec.wire.spec import SandboxSpec
from tests.control.conftest import Replica, replica, served_edge

LEASE_S = 0.4     # short leases keep the test fast; the default is 3 s
RENEW_S = 0.1


@dataclass
class World:
    node: EdgeNode
    addr: str
    tmp: Path
    apis: list[Replica]
    url: str = ""

    async def api(self) -> Replica:
        api = await replica(self.url or self.tmp / "control.sqlite", self.addr, idempotency={
            "lease_s": LEASE_S, "lease_renew_s": RENEW_S, "poll_s": 0.01})
        self.apis.append(api)
        return api


@pytest.fixture
async def world(tmp_path: Path, store_url: str) -> AsyncIterator[World]:
    # create takes 0.3 s, so a claim can be caught with its sandbox still `creating`
    backend = SimulatedBackend(profile=NodeLatencyProfile(create_s=0.3))
    async with served_edge(tmp_path, backend) as edge:
        w = World(edge.node, edge.addr, tmp_path, [], store_url)
        try:
            yield w
        finally:
            for a in w.apis:
                await a.close()


async def _die(api: Replica) -> None:
    """kill -9, as far as the store can tell: the lease stops being renewed, nothing is
    released or dropped."""
    renewer = api.cache._renewer
    assert renewer is not None
    renewer.cancel()
    await asyncio.gather(renewer, return_exceptions=True)
    api.cache._closed = True          # close() must not drop the lease either


REQ = CreateSandboxRequest(labels={"crash": "1"})
RAW = msgspec.json.encode(REQ)


def _spec(svc: ApiService, caller: Caller) -> SandboxSpec:
    return svc.build_spec(caller, REQ)


async def _claim(api: Replica, caller: Caller, key: str) -> object:
    begin = api.cache.begin(IdempotencyCache.scoped(caller.id, key), request_fingerprint(REQ))
    assert begin.claim is not None
    return begin.claim


async def test_retry_after_a_crash_returns_the_sandbox_the_dead_apiserver_made(
        world: World) -> None:
    dead, live = await world.api(), await world.api()
    key = dead.plane.bootstrap_admin()
    caller = dead.service.authenticate(f"Bearer {key}")
    claim = await _claim(dead, caller, "k-made")
    sid = "sb-0123456789ab-e0"
    claim.note(sid)                                          # type: ignore[attr-defined]
    made = await dead.link.create(_spec(dead.service, caller), sandbox_id=sid)
    await _die(dead)                                         # ... before it answered
    t0 = time.monotonic()
    info = await live.service.create(live.service.authenticate(f"Bearer {key}"), REQ,
                                     idempotency_key="k-made", raw=RAW)
    took = time.monotonic() - t0
    assert info.id == made.id == sid
    assert [i.id for i in world.node.list()] == [sid]         # exactly one sandbox
    # taken over once the dead one's lease ran out, not after a 60 s in-flight lease
    assert took < 10 * LEASE_S + 5, took
    # and recorded: the live apiserver lists it, and the key now replays it
    page, _ = live.plane.list_sandboxes(caller, project=None, labels={}, state=None,
                                        after="", limit=10)
    assert [i.id for i in page] == [sid]
    again = await live.service.create(caller, REQ, idempotency_key="k-made", raw=RAW)
    assert again.id == sid and world.node.live_count == 1


async def test_a_sandbox_still_creating_is_waited_for_not_duplicated(world: World) -> None:
    dead, live = await world.api(), await world.api()
    key = dead.plane.bootstrap_admin()
    caller = dead.service.authenticate(f"Bearer {key}")
    claim = await _claim(dead, caller, "k-creating")
    sid = "sb-00000000cafe-e0"
    claim.note(sid)                                          # type: ignore[attr-defined]
    first = asyncio.ensure_future(dead.link.create(_spec(dead.service, caller),
                                                   sandbox_id=sid))
    await asyncio.sleep(0.05)
    assert world.node.get(sid).state == "creating"
    await _die(dead)
    info = await live.service.create(caller, REQ, idempotency_key="k-creating", raw=RAW)
    assert info.id == sid and info.state == "running"
    await first
    assert [i.id for i in world.node.list()] == [sid]


async def test_a_noted_sandbox_that_never_reached_the_edge_is_made_under_its_id(
        world: World) -> None:
    dead, live = await world.api(), await world.api()
    key = dead.plane.bootstrap_admin()
    caller = dead.service.authenticate(f"Bearer {key}")
    claim = await _claim(dead, caller, "k-noted")
    sid = "sb-0000000000ff-e0"
    claim.note(sid)                                          # type: ignore[attr-defined]
    await _die(dead)                                         # died before asking the edge
    info = await live.service.create(caller, REQ, idempotency_key="k-noted", raw=RAW)
    # the same id: a first attempt still on its way would be refused by the edge
    assert info.id == sid and [i.id for i in world.node.list()] == [sid]
    late = await asyncio.gather(dead.link.create(_spec(dead.service, caller), sandbox_id=sid),
                                return_exceptions=True)
    assert "already in use" in str(late[0]) and world.node.live_count == 1


async def test_a_claim_without_a_sandbox_is_taken_over_and_created_once(world: World) -> None:
    dead, live = await world.api(), await world.api()
    key = dead.plane.bootstrap_admin()
    caller = dead.service.authenticate(f"Bearer {key}")
    await _claim(dead, caller, "k-bare")
    await _die(dead)
    a, b = await asyncio.gather(   # two retries at once: one creates, the other waits
        live.service.create(caller, REQ, idempotency_key="k-bare", raw=RAW),
        live.service.create(caller, REQ, idempotency_key="k-bare", raw=RAW))
    assert a.id == b.id and [i.id for i in world.node.list()] == [a.id]


async def test_a_waiter_on_a_dead_holder_takes_over_instead_of_a_409(world: World) -> None:
    dead, live = await world.api(), await world.api()
    key = dead.plane.bootstrap_admin()
    caller = dead.service.authenticate(f"Bearer {key}")
    claim = await _claim(dead, caller, "k-wait")
    sid = "sb-00000000beef-e0"
    claim.note(sid)                                          # type: ignore[attr-defined]
    made = await dead.link.create(_spec(dead.service, caller), sandbox_id=sid)
    # the retry arrives while the holder still looks alive: it waits, then takes over
    waiting = asyncio.ensure_future(live.service.create(caller, REQ,
                                                        idempotency_key="k-wait", raw=RAW))
    await asyncio.sleep(2 * RENEW_S)
    assert not waiting.done()
    await _die(dead)
    info = await asyncio.wait_for(waiting, 10 * LEASE_S + 5)
    assert info.id == made.id and world.node.live_count == 1


async def test_an_owner_that_stalled_past_its_lease_learns_it_lost_the_claim(
        world: World) -> None:
    slow, live = await world.api(), await world.api()
    key = slow.plane.bootstrap_admin()
    caller = slow.service.authenticate(f"Bearer {key}")
    noting = await _claim(slow, caller, "k-stall-1")
    finishing = IdempotencyCache.scoped(caller.id, "k-stall-2")
    await _claim(slow, caller, "k-stall-2")
    await _die(slow)                       # a stall as long as a death, as others see it
    one = await live.service.create(caller, REQ, idempotency_key="k-stall-1", raw=RAW)
    two = await live.service.create(caller, REQ, idempotency_key="k-stall-2", raw=RAW)
    # the stalled owner wakes up: it may neither name a sandbox nor answer any more
    with pytest.raises(ClaimLost, match="another apiserver took over"):
        noting.note("sb-000000000001-e0")                    # type: ignore[attr-defined]
    with pytest.raises(ClaimLost):
        slow.cache.finish(finishing, b"stale answer")
    row = live.cache.peek(finishing)
    assert row is not None and row.response is not None and row.response != b"stale answer"
    assert sorted(i.id for i in world.node.list()) == sorted([one.id, two.id])


async def test_a_clean_shutdown_hands_its_claims_over_at_once(world: World) -> None:
    first, live = await world.api(), await world.api()
    key = first.plane.bootstrap_admin()
    caller = first.service.authenticate(f"Bearer {key}")
    await _claim(first, caller, "k-close")
    await first.cache.close()              # drops the lease: its claims are stale now
    row = live.cache.peek(IdempotencyCache.scoped(caller.id, "k-close"))
    assert row is not None and row.stale
    info = await asyncio.wait_for(
        live.service.create(caller, REQ, idempotency_key="k-close", raw=RAW), 5)
    assert world.node.list()[0].id == info.id and world.node.live_count == 1


async def test_an_old_store_gains_the_new_columns(tmp_path: Path) -> None:
    """A control.sqlite written before claims had holders and intents opens and works."""
    import sqlite3
    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE idempotency (key TEXT PRIMARY KEY, fingerprint TEXT NOT "
                 "NULL, owner TEXT NOT NULL, response BLOB, expires_at DOUBLE PRECISION "
                 "NOT NULL)")
    conn.execute("INSERT INTO idempotency VALUES (?, 'fp', 'x:1', X'00', 9e18)", ("p\x00k",))
    conn.commit()
    conn.close()
    store = SqliteStore(path)
    try:
        row = store.idem_get("p\x00k", time.time())
        assert row is not None and row.response == b"\x00" and row.intent is None
        assert store.idem_note("p\x00k", "x:1", "sb-000000000001-e0") is False  # finished
    finally:
        store.close()


def _dead_process_holder() -> str:
    """The holder id a process of this machine had, once that process has exited."""
    import subprocess
    import sys

    from dsec.control.idempotency import _boot_id
    from dsec.ownership import start_time
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ticks = start_time(p.pid)
    finally:
        p.kill()
        p.wait()
    import socket
    return f"{_boot_id()}:{socket.gethostname()}:{p.pid}:{ticks}:deadbeef0000"


def test_holder_gone_judges_only_processes_of_this_machine() -> None:
    from dsec.control.idempotency import holder_gone, local_holder
    me = local_holder("tok")
    assert not holder_gone(me)                               # alive: its lease decides
    dead = _dead_process_holder()
    assert holder_gone(dead)
    boot, host, pid, ticks, tok = me.split(":")
    assert holder_gone(f"{boot}:{host}:{pid}:{int(ticks) + 1}:{tok}")   # pid reused
    assert not holder_gone(f"{boot}:another-host:{pid}:0:{tok}")      # not ours to judge
    assert not holder_gone("a3f09c1e22b4")                           # unknown form


async def test_a_claim_of_a_dead_process_on_this_machine_is_taken_over_at_once(
        world: World) -> None:
    """kill -9 of `dsec up` leaves its lease valid for up to lease_s; the restarted one
    on the same machine sees the process is gone and does not wait for it."""
    live = await world.api()
    key = live.plane.bootstrap_admin()
    caller = live.service.authenticate(f"Bearer {key}")
    dead = _dead_process_holder()
    scoped = IdempotencyCache.scoped(caller.id, "k-pid")
    now = time.time()
    live.store.lease_renew(dead, now + 3600)                 # a lease far from lapsing
    live.store.idem_claim(IdempotencyRow(key=scoped, fingerprint=request_fingerprint(REQ),
                                         owner=f"{dead}:1", holder=dead,
                                         expires_at=now + 300), now)
    sid = "sb-00000000d1ed-e0"
    assert live.store.idem_note(scoped, f"{dead}:1", sid)
    t0 = time.monotonic()
    info = await live.service.create(caller, REQ, idempotency_key="k-pid", raw=RAW)
    assert info.id == sid and world.node.live_count == 1
    assert time.monotonic() - t0 < 30                         # not the hour-long lease
