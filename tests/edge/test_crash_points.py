"""Red-team checks of "durable before acknowledged" at the journal's own crash points,
in process (the real-process kill -9 tests are in tests/edge/container/).

A kill -9 leaves exactly what the journal file holds at that instant (the page cache
survives it), so "what a restarted edge would read now" is the file read back. Each
test drives the node the way concurrent clients do and checks, at every answer, that
the file already says what was answered."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from dsec.edge.backends.simulated import SimulatedBackend
from dsec.edge.clock import FakeClock
from dsec.edge.journal import JOURNAL, SandboxJournal
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.edge.spec import SandboxSpec

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
