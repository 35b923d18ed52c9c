"""Red-team checks of "durable before acknowledged" at the journal's own crash points,
in process (the real-process kill -9 tests are in tests/edge/container/).

A kill -9 leaves exactly what the journal file holds at that instant (the page cache
survives it), so "what a restarted edge would read now" is the file read back. Each
test drives the node the way concurrent clients do and checks, at every answer, that
the file already says what was answered."""

from __future__ import annotations

import asyncio
import errno
import os
import random
import threading
from pathlib import Path

import pytest

from dsec.edge.backends.simulated import SimulatedBackend
from dsec.edge.clock import FakeClock
from dsec.edge.journal import JOURNAL, SandboxJournal
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.errors import DsecError
from dsec.wire.spec import ExecRequest, SandboxSpec

from .conftest import BIG, make_node
from .test_durable import on_disk


def _node(state: str, clock: FakeClock, journal: SandboxJournal, **cfg: object) -> EdgeNode:
    config = NodeConfig(node_id="n1", capacity=BIG, state_dir=state,
                        tombstones=journal.keep_ended, **cfg)  # type: ignore[arg-type]
    return EdgeNode(config, SimulatedBackend(clock=clock), clock=clock,
                    rng=random.Random(7), journal=journal)


@pytest.mark.parametrize("sync", ["fsync", "write"])
async def test_compaction_keeps_what_was_answered(tmp_path, sync) -> None:  # type: ignore[no-untyped-def]
    """Compaction rewrites the file from the node's records. A create whose ``running``
    line is written but whose state still says ``creating`` (it switches once the line
    is durable) was rewritten as ``creating`` - and then answered: a kill -9 after that
    answer rolled the acknowledged create back at restart (``create_failed``). Found
    with concurrent creates, pauses and destroys and a journal that compacts often."""
    state = str(tmp_path / "state")
    clock = FakeClock()
    journal = SandboxJournal(state, sync=sync, keep_ended=4, compact_min_lines=8)
    rnd = random.Random(3)
    expected: dict[str, str] = {}   # id -> what the last answer said
    async with _node(state, clock, journal) as node:
        for _ in range(300):
            live = [i for i, s in expected.items() if s in ("running", "paused")]
            rnd.shuffle(live)
            ops: list[tuple[str, str, object]] = []
            for sid in live[:rnd.randint(0, 5)]:
                st = expected[sid]
                kind = rnd.choice(["destroy", "destroy", "pause" if st == "running"
                                   else "resume"])
                ops.append((kind, sid, getattr(node, kind)(sid)))
            for _ in range(rnd.randint(0, 3)):
                ops.append(("create", "", node.create(SandboxSpec())))
            results = await asyncio.gather(*(c for _, _, c in ops))  # type: ignore[arg-type]
            for (kind, sid, _), res in zip(ops, results, strict=True):
                if kind == "create":
                    expected[res.id] = "running"
                else:
                    expected[sid] = {"destroy": "destroyed", "pause": "paused",
                                     "resume": "running"}[kind]
            disk = on_disk(state)
            wrong = {i: (s, disk.get(i, ("absent",))[0]) for i, s in expected.items()
                     if s != "destroyed" and disk.get(i, ("absent",))[0] != s}
            assert not wrong, f"answered vs on disk after a compaction: {wrong}"
        assert journal.compactions > 30
        crashed = Path(state, JOURNAL).read_bytes()  # what a kill -9 now would leave
    Path(state, JOURNAL).write_bytes(crashed)
    async with make_node(clock=clock, state_dir=state, tombstones=4) as again:
        for sid, st in expected.items():
            if st != "destroyed":
                assert again.get(sid).state == st


async def test_no_answer_rides_an_fsync_after_one_that_failed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Linux reports a writeback error to one fsync only (errseq: the "fsyncgate"
    semantics PostgreSQL hit): pages written before a failed fsync may never reach the
    disk, yet the next fsync on the descriptor succeeds. Create A's fsync fails while
    create B's ``running`` line, written meanwhile, waits for the next fsync: B was
    answered on that next fsync although nothing had written its line again. Now
    everything written since the last good fsync is written again before an answer
    rides a later one (or the answer is an error)."""
    state = str(tmp_path / "state")
    clock = FakeClock()
    gate = threading.Event()
    armed = [False]

    def fsync(fd: int) -> None:
        if armed[0]:
            armed[0] = False
            gate.wait(30)
            raise OSError(errno.EIO, "Input/output error")
        os.fsync(fd)

    journal = SandboxJournal(state, fsync=fsync)
    a_id, b_id = "sb-00000000000a-n1", "sb-00000000000b-n1"
    async with _node(state, clock, journal) as node:
        armed[0] = True
        a = asyncio.ensure_future(node.create(SandboxSpec(), sandbox_id=a_id))
        while not (on_disk(state).get(a_id) == ("running", "") and not armed[0]):
            await asyncio.sleep(0.001)        # A's line written, its fsync blocked
        b = asyncio.ensure_future(node.create(SandboxSpec(), sandbox_id=b_id))
        while on_disk(state).get(b_id) != ("running", ""):
            await asyncio.sleep(0.001)        # B's line written, waiting for an fsync
        gate.set()                            # A's fsync fails
        ra, rb = await asyncio.gather(a, b, return_exceptions=True)
        assert isinstance(ra, DsecError) and "journal" in str(ra)
        if isinstance(rb, BaseException):
            assert isinstance(rb, DsecError)
        else:
            lines = [ln for ln in Path(state, JOURNAL).read_bytes().splitlines()
                     if b_id.encode() in ln and b'"running"' in ln]
            assert len(lines) >= 2, ("B answered on an fsync that no write after the "
                                     "failed one covered")
            assert node.get(b_id).state == "running"


async def test_a_restart_does_not_idle_reap_a_sandbox_in_use(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """docs/edge.md: "a restart resets idle clocks" (exec activity is never journaled).
    The adopted record took ``last_active_at`` from its last journal line instead - the
    create - so a sandbox exec'd a moment before a kill -9, with ``idle_timeout_s``
    shorter than its age, was destroyed (``idle_timeout``, the default idle_action) by
    the first reaper pass after the restart."""
    state = str(tmp_path / "state")
    clock = FakeClock()
    node = make_node(clock=clock, state_dir=state)
    await node.start()
    a = await node.create(SandboxSpec(idle_timeout_s=60))
    for _ in range(4):
        clock.advance(50)
        await node.exec(a.id, ExecRequest(shell="true"))
        assert await node.reap() == []
    crashed = Path(state, JOURNAL).read_bytes()      # kill -9 right after that exec
    await node.close()
    Path(state, JOURNAL).write_bytes(crashed)
    clock.advance(1)
    async with make_node(clock=clock, state_dir=state) as again:
        assert await again.reap() == []
        assert again.get(a.id).state == "running"
        clock.advance(61)                             # idle from the restart on: reaped
        assert [x.reason for x in await again.reap()] == ["idle_timeout"]


async def test_two_live_fncall_backends_cannot_share_a_root(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An fncall backend's reconcile removes every work dir it does not hold. Two live
    backends given one ``root`` (``--backend-opt fncall.root=...`` on two edges): the
    second one's start deleted the first one's sandboxes. The root's owner record
    (pid + start time) now refuses a second live owner."""
    from dsec.edge.backends.fncall import FncallBackend
    from dsec.errors import InUse

    root = str(tmp_path / "fncall")
    a = FncallBackend(pool_size=1, root=root)
    sid = "sb-0000000000f1-n1"
    try:
        await a.create(sid, SandboxSpec(backend="fncall"))
        await a.write_file(sid, "kept.txt", b"mine")
        try:
            b = FncallBackend(pool_size=1, root=root)
        except InUse:
            pass
        else:
            await b.reconcile(set())
            await b.close()
        assert await a.read_file(sid, "kept.txt") == b"mine"
    finally:
        await a.destroy(sid)
        await a.close()
    again = FncallBackend(pool_size=1, root=root)  # the owner is gone: free to take
    await again.close()


async def test_two_fncall_roots_cannot_share_a_cgroup_name(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The jailed fncall backend's reconcile takes every cgroup under its name for its
    own (as the container backend's does): a second root given the same explicit
    ``cgroup_name`` would kill the first one's calls and remove its sandbox cgroups."""
    import pytest

    from dsec.edge.backends.fncall import FncallBackend
    from dsec.errors import InUse

    if os.geteuid() != 0:
        pytest.skip("the jailed fncall backend needs root")
    name = f"rtd-f-{os.getpid()}-{random.Random().getrandbits(24):06x}"
    a = FncallBackend(pool_size=1, root=str(tmp_path / "a"), cgroup_name=name)
    try:
        try:
            b = FncallBackend(pool_size=1, root=str(tmp_path / "b"), cgroup_name=name)
        except InUse as exc:
            assert "cgroup name" in str(exc)
        else:
            await b.close()
            pytest.fail("a second root got the cgroup name of a live one")
    finally:
        await a.close()
    assert not os.path.exists(os.path.join("/run/dsec/cgroup-names", name))  # released
