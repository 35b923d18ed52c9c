"""Fault injection against the idempotency takeover (issue 12 item 3), at the ApiService
level: real SQLite store shared by two apiservers, a real edge over Aether.

Each test puts an apiserver in a state a crash, a stall or a partition leaves behind and
checks the one thing a caller relies on: one create under one Idempotency-Key makes
exactly one sandbox, and every attempt is answered with that sandbox (or a retryable
error), never a second sandbox, never the wrong error.

A *stall* (SIGSTOP, a GC pause, a starved event loop) is modelled as the owner's lease
stopping (its renew task is gone, as under SIGSTOP) while its request is held at the edge
link by :class:`Gate`; "SIGCONT" opens the gate. kill -9 is the same without the
resume (see tests/control/test_idempotency_takeover.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dsec.control.api.plane import PlaneConfig
from dsec.control.api.service import ApiConfig, Caller
from dsec.control.idempotency import IdempotencyCache, request_fingerprint
from dsec.control.retention import RetentionConfig, retain
from dsec.control.store import IdempotencyRow, open_store
from dsec.edge.backends.simulated import NodeLatencyProfile, SimulatedBackend
from dsec.edge.node import EdgeNode
from dsec.errors import Conflict, DsecError, TransportError, Unavailable
from dsec.wire.api import CreateSandboxRequest
from tests.conftest import requires_root
from tests.control.conftest import Replica, ServedEdge, replica, served_edge

LEASE_S = 0.4
RENEW_S = 0.1

REQ = CreateSandboxRequest(labels={"fault": "1", "b": "2"})
RAW = msgspec.json.encode(REQ)


class Gate:
    """An edge link whose ``create`` waits until ``opened`` (the apiserver holding it is
    stalled between noting the sandbox id and asking the edge); everything else passes
    through."""

    def __init__(self, link: Any) -> None:
        self._link = link
        self.reached = asyncio.Event()
        self.opened = asyncio.Event()

    async def create(self, *a: Any, **kw: Any) -> Any:
        self.reached.set()
        await self.opened.wait()
        return await self._link.create(*a, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._link, name)


class GateAfter(Gate):
    """An edge link whose ``create`` is carried out at once, but its answer waits until
    ``opened`` (the apiserver stalled after the edge made the sandbox)."""

    async def create(self, *a: Any, **kw: Any) -> Any:
        info = await self._link.create(*a, **kw)
        self.reached.set()
        await self.opened.wait()
        return info


@dataclass
class World:
    edge: ServedEdge
    tmp: Path
    url: str
    apis: list[Replica] = field(default_factory=list)

    @property
    def node(self) -> EdgeNode:
        return self.edge.node

    @property
    def addr(self) -> str:
        return self.edge.addr

    async def api(self, *, plane: PlaneConfig | None = None,
                  config: ApiConfig | None = None) -> Replica:
        api = await replica(self.url, self.addr, plane=plane,
                            config=config or ApiConfig(), idempotency={
                                "lease_s": LEASE_S, "lease_renew_s": RENEW_S, "poll_s": 0.01})
        self.apis.append(api)
        return api


def _world(create_s: float) -> Callable[[Path, str], AsyncIterator[World]]:
    async def make(tmp_path: Path, store_url: str) -> AsyncIterator[World]:
        backend = SimulatedBackend(profile=NodeLatencyProfile(create_s=create_s))
        async with served_edge(tmp_path, backend) as edge:
            w = World(edge, tmp_path, store_url)
            try:
                yield w
            finally:
                for a in w.apis:
                    a.cache._closed = False   # a stalled one (_stall) closes for real
                    await a.close()
    return make


world = pytest.fixture(_world(0.05), name="world")
slow_world = pytest.fixture(_world(2.0), name="slow_world")


def _stall(api: Replica) -> None:
    """SIGSTOP as the store sees it: the lease is no longer renewed."""
    renewer = api.cache._renewer
    if renewer is not None:
        renewer.cancel()
    api.cache._closed = True


def _resume(api: Replica) -> None:
    """SIGCONT: the process renews its lease again from its next claim on."""
    api.cache._closed = False
    api.cache._renewed_at = float("-inf")


def _admin(api: Replica) -> Caller:
    return api.service.authenticate(f"Bearer {api.plane.bootstrap_admin()}")


async def test_an_owner_stalled_before_asking_the_edge_answers_with_the_sandbox(
        world: World) -> None:
    """The owner noted sb-X and stalled past its lease before asking the edge; a retry
    on another apiserver took the claim over and made sb-X. When the owner wakes up its
    create of sb-X is refused by the edge ("already in use"): its caller must get sb-X
    (the key's answer), not a 409 about an id it never heard of."""
    slow, live = await world.api(), await world.api()
    caller = _admin(slow)
    gate = Gate(slow.link)
    slow.plane.edges["e0"].link = gate
    first = asyncio.ensure_future(slow.service.create(caller, REQ, idempotency_key="k-stall",
                                                      raw=RAW))
    await asyncio.wait_for(gate.reached.wait(), 10)
    _stall(slow)
    retry = await asyncio.wait_for(
        live.service.create(caller, REQ, idempotency_key="k-stall", raw=RAW), 20)
    _resume(slow)
    gate.opened.set()
    answer = await asyncio.wait_for(first, 20)
    assert answer.id == retry.id
    assert [i.id for i in world.node.list()] == [retry.id]


async def test_an_owner_stalled_after_the_edge_made_it_keeps_the_sandbox(
        world: World) -> None:
    """Same stall, after the edge made the sandbox and before the owner stored the
    answer: the retry adopts it. The owner wakes up to a lost claim: it must not destroy
    the sandbox the key now answers with, and its caller gets that sandbox or a
    retryable 503 (whose retry replays it), never another error."""
    slow, live = await world.api(), await world.api()
    caller = _admin(slow)
    gate = GateAfter(slow.link)
    slow.plane.edges["e0"].link = gate
    first = asyncio.ensure_future(slow.service.create(caller, REQ, idempotency_key="k-made",
                                                      raw=RAW))
    await asyncio.wait_for(gate.reached.wait(), 10)
    _stall(slow)
    retry = await asyncio.wait_for(
        live.service.create(caller, REQ, idempotency_key="k-made", raw=RAW), 20)
    _resume(slow)
    gate.opened.set()
    answer = (await asyncio.gather(first, return_exceptions=True))[0]
    if isinstance(answer, Unavailable):
        answer = await slow.service.create(caller, REQ, idempotency_key="k-made", raw=RAW)
    assert not isinstance(answer, BaseException), repr(answer)
    assert answer.id == retry.id
    assert [i.id for i in world.node.list()] == [retry.id]


async def test_a_sandbox_still_creating_after_the_recovery_wait_is_not_made_twice(
        slow_world: World) -> None:
    """A dead apiserver asked the edge for sb-X; the edge is slow (a big image, a VM)
    and sb-X is still `creating` when the retry's recovery wait ends. The retry must
    not give up on sb-X and place a second sandbox: it answers retryably, and a later
    retry gets sb-X."""
    dead = await slow_world.api()
    live = await slow_world.api(config=ApiConfig(recover_wait_s=0.2))
    caller = _admin(dead)
    scoped = IdempotencyCache.scoped(caller.id, "k-slow")
    claim = dead.cache.begin(scoped, request_fingerprint(REQ)).claim
    assert claim is not None
    sid = "sb-00000000510e-e0"
    claim.note(sid)
    made = asyncio.ensure_future(dead.link.create(dead.service.build_spec(caller, REQ),
                                                  sandbox_id=sid))
    await asyncio.sleep(0.1)
    _stall(dead)                                   # kill -9
    answers: list[Any] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            answers.append(await live.service.create(caller, REQ, idempotency_key="k-slow",
                                                     raw=RAW))
            break
        except Unavailable:
            await asyncio.sleep(0.2)                # the SDK retries a 503
    await made
    assert [a.id for a in answers] == [sid]
    assert [i.id for i in slow_world.node.list()] == [sid]


async def test_a_retry_whose_noted_sandbox_is_on_a_lost_node_gets_a_503_not_a_link_error(
        world: World) -> None:
    """The dead apiserver noted sb-X on node e0; e0 is then down past its TTL (lost).
    The retry looks for sb-X there: its own link failing must not reach the caller as
    the caller's ConnectionLost / ConnectFailed (which says *your* connection broke)."""
    dead = await world.api()
    live = await world.api(plane=PlaneConfig(node_ttl_s=0.3))
    caller = _admin(dead)
    scoped = IdempotencyCache.scoped(caller.id, "k-lost")
    claim = dead.cache.begin(scoped, request_fingerprint(REQ)).claim
    assert claim is not None
    claim.note("sb-000000001057-e0")
    _stall(dead)
    await world.edge.server.close()                # the node goes away
    await live.link.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        await live.plane.tick()
        if any(n.status == "lost" for n in live.plane.nodes()):
            break
        await asyncio.sleep(0.1)
    assert [n.status for n in live.plane.nodes()] == ["lost"]
    with pytest.raises(DsecError) as err:
        await live.service.create(caller, REQ, idempotency_key="k-lost", raw=RAW)
    assert isinstance(err.value, Unavailable), repr(err.value)
    assert not isinstance(err.value, TransportError)


async def test_every_door_and_encoding_of_one_request_is_one_key(world: World) -> None:
    """REST fingerprints the raw JSON body, the Aether gateway the decoded request: the
    same create sent over both (SDK clients of two transports sharing an
    ``idempotency_key``, or a retry after the SDK fell back from the gateway to REST),
    or as JSON with another key order, is the same request and gets the same sandbox."""
    api = await world.api()
    caller = _admin(api)
    a = await api.service.create(caller, REQ, idempotency_key="k-doors", raw=RAW)
    b = await api.service.create(caller, REQ, idempotency_key="k-doors")          # gateway
    reordered = b'{ "labels": {"b": "2", "fault": "1"} }'
    c = await api.service.create(caller, msgspec.json.decode(reordered,
                                                             type=CreateSandboxRequest),
                                 idempotency_key="k-doors", raw=reordered)
    assert a.id == b.id == c.id and world.node.live_count == 1
    # a different request under the same key is still refused
    other = CreateSandboxRequest(labels={"fault": "2"})
    with pytest.raises(Conflict):
        await api.service.create(caller, other, idempotency_key="k-doors",
                                 raw=msgspec.json.encode(other))


def test_retention_bounds_claims_that_named_a_sandbox(store_url: str) -> None:
    """A keyed create that failed after it noted its sandbox id (the edge refused it)
    leaves its claim holderless for a retry to look at; once its window is over the
    retention pass must remove it (every SDK create carries a key: a full cluster
    refusing creates grew the table without bound)."""
    store = open_store(store_url)
    try:
        now = time.time()
        for i in range(50):
            row = IdempotencyRow(key=f"p\x00k{i}", fingerprint="fp", owner=f"h:{i}",
                                 holder="h", expires_at=now + 300)
            store.idem_claim(row, now)
            assert store.idem_note(row.key, row.owner, f"sb-{i:012x}-e0")
            assert store.idem_release(row.key, row.owner)      # the create failed
        assert store.table_rows()["idempotency"] == 50
        later = RetentionConfig().plan(now + 3600)             # an hour later
        retain(store, later)
        assert store.table_rows()["idempotency"] == 0
    finally:
        store.close()


async def test_trimming_finished_keys_by_count_keeps_their_answer_within_the_window(
        world: World) -> None:
    """Retention keeps at most ``idempotency_keep`` finished keys. At a high create rate
    the oldest ones are trimmed long before their 5-minute window ends (50,000 keys are
    under a minute at 1,000 creates/s, and the SDK retries a create for 120 s): a retry
    of a trimmed key must still get its sandbox, not a second one."""
    api = await world.api()
    caller = _admin(api)
    first = await api.service.create(caller, REQ, idempotency_key="k-old", raw=RAW)
    now = time.time()
    for i in range(5):                                       # younger creates of others
        row = IdempotencyRow(key=f"other\x00k{i}", fingerprint="fp", owner=f"x:{i}",
                             holder="x", expires_at=now + 300)
        api.store.idem_claim(row, now)
        api.store.idem_finish(row.key, row.owner, b"answer", now + 300 + i)
    retain(api.store, RetentionConfig(idempotency_keep=3).plan(now))
    api.cache._entries.clear()                                # a restarted apiserver
    again = await api.service.create(caller, REQ, idempotency_key="k-old", raw=RAW)
    assert again.id == first.id and world.node.live_count == 1


@requires_root
def test_a_live_holder_in_another_pid_namespace_is_not_judged_gone() -> None:
    """Two apiservers on one machine in containers that share its host name (host
    networking) and its boot, each in a pid namespace of its own: one must not read the
    other's pid in its own /proc, find another process (or none) there, and take a live
    apiserver's claims over at once (two sandboxes for one key)."""
    import os
    import subprocess
    import sys

    from dsec.control.idempotency import holder_gone
    code = ("import time; from dsec.control.idempotency import local_holder; "
            "print(local_holder('tok'), flush=True); time.sleep(60)")
    p = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
                          sys.executable,
                          "-c", code], stdout=subprocess.PIPE, text=True, env=os.environ)
    try:
        assert p.stdout is not None
        holder = p.stdout.readline().strip()
        assert holder, "the namespaced apiserver did not start"
        assert p.poll() is None                  # it is alive ...
        assert not holder_gone(holder), holder   # ... so its lease decides, not its pid
    finally:
        p.kill()
        p.wait()


async def test_a_takeover_interrupted_by_a_second_crash_still_makes_one_sandbox(
        world: World) -> None:
    """kill -9 twice in a row: the first owner noted sb-X and died before asking the
    edge; the apiserver that took over stalled while creating sb-X itself; a third
    takes over from it. One sandbox, and all three answers (where they come) are it."""
    first, second, third = await world.api(), await world.api(), await world.api()
    caller = _admin(first)
    scoped = IdempotencyCache.scoped(caller.id, "k-twice")
    claim = first.cache.begin(scoped, request_fingerprint(REQ)).claim
    assert claim is not None
    claim.note("sb-00000000abcd-e0")
    _stall(first)                                             # first death
    gate = Gate(second.link)
    second.plane.edges["e0"].link = gate
    taking = asyncio.ensure_future(second.service.create(caller, REQ,
                                                         idempotency_key="k-twice", raw=RAW))
    await asyncio.wait_for(gate.reached.wait(), 10)           # recovering sb-X
    _stall(second)                                            # second death, mid-takeover
    answer = await asyncio.wait_for(
        third.service.create(caller, REQ, idempotency_key="k-twice", raw=RAW), 20)
    assert answer.id == "sb-00000000abcd-e0"
    _resume(second)                                           # it was only stalled
    gate.opened.set()
    late = await asyncio.wait_for(taking, 20)
    assert late.id == answer.id
    assert [i.id for i in world.node.list()] == [answer.id]
