"""A destroy racing a snapshot of the same container sandbox. The snapshot's final write
(``last-snapshot.tmp`` renamed inside the sandbox's directory) used to run while the
destroy removed that directory, so the removal failed and the sandbox ended ``failed``
instead of ``destroyed``. The node now serialises them: a destroy waits for the snapshot
in flight, and a snapshot asked for once the destroy began is refused clearly."""

from __future__ import annotations

import asyncio
import random

import pytest

from dsec.errors import InvalidTransition
from dsec.wire.spec import ExecRequest, SandboxSpec

from .test_snapshot import SPEC, Env, env  # noqa: F401 - env is the fixture used below

pytestmark = pytest.mark.root

ROUNDS = 40


async def test_destroy_racing_a_snapshot_always_ends_destroyed(env: Env) -> None:  # noqa: F811
    node = env.node
    rng = random.Random(7)
    outcomes: dict[str, int] = {}
    for i in range(ROUNDS):
        info = await node.create(SandboxSpec(**SPEC))
        sid = info.id
        # something to pack, so the snapshot does real work before its final write
        await node.exec(sid, ExecRequest(shell=f"mkdir -p /work && seq 1 {2000 + i} > "
                                               "/work/f && echo x > /work/g"))
        snap = asyncio.ensure_future(node.snapshot(sid))
        await asyncio.sleep(rng.random() * 0.08)  # land the destroy anywhere in it
        final = await node.destroy(sid)
        assert final.state == "destroyed" and final.reason == "requested", final
        try:
            got = await snap
            outcomes["snapshot"] = outcomes.get("snapshot", 0) + 1
            assert got.id.startswith("sha256:")
        except InvalidTransition as exc:   # asked for after the destroy began
            assert "cannot snapshot while it is destroying" in exc.message, exc
            outcomes["refused"] = outcomes.get("refused", 0) + 1
        events = node.events(sid)
        assert [e.to_state for e in events][-2:] == ["destroying", "destroyed"], events
        assert all(e.to_state != "failed" for e in events), events
    # the race was really run: the destroy landed both before and during snapshots
    assert outcomes.get("snapshot", 0) >= 1, outcomes
    assert env.backend.sandbox_ids() == []
