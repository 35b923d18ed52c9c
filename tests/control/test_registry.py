from __future__ import annotations

from pathlib import Path

import pytest

from dsec.control.quota import Quota, QuotaIndex
from dsec.control.records import SandboxRecord
from dsec.control.registry import Registry
from dsec.control.store import StateStore, open_store
from dsec.errors import Compacted, InvalidArgument, QuotaExceeded, SandboxNotFound

from .conftest import FakeClock


def rec(i: int, node: str = "n1", project: str = "org/a") -> SandboxRecord:
    return SandboxRecord(id=f"sb-{i:012x}-{node}", node=node, project=project,
                         cpu_milli=1000, memory_bytes=1 << 30, created_at=float(i))


def test_every_mutation_is_a_versioned_event_in_order(store: StateStore,
                                                      clock: FakeClock) -> None:
    reg = Registry(store, clock=clock)
    w = reg.watch(0)
    assert reg.add_sandbox(rec(1)) == 1
    reg.set_paused(rec(1).id, True)
    reg.set_paused(rec(1).id, False, reason="exec")
    reg.remove_sandbox(rec(1).id)
    assert w.poll() == []          # nothing committed yet: batches flush explicitly
    assert reg.flush() == 4
    evs = w.poll()
    assert [(e.version, e.kind) for e in evs] == [
        (1, "sandbox_added"), (2, "sandbox_paused"), (3, "sandbox_resumed"),
        (4, "sandbox_removed")]
    assert evs[0].payload["record"]["project"] == "org/a"
    assert evs[2].payload["reason"] == "exec"
    assert w.poll() == [] and w.position == 4


def test_state_and_version_survive_a_restart(store_url: str, clock: FakeClock) -> None:
    s = open_store(store_url)
    try:
        reg = Registry(s, clock=clock)
        reg.add_sandbox(rec(1))
        reg.add_sandbox(rec(2))
        reg.remove_sandbox(rec(1).id)
        reg.flush()
    finally:
        s.close()
    s = open_store(store_url)
    try:
        q = QuotaIndex()
        reg = Registry(s, clock=clock, quota=q)
        assert reg.version == 3 and [r.id for r in reg.sandboxes()] == [rec(2).id]
        assert q.usage("org").sandboxes == 1
        assert reg.add_sandbox(rec(3)) == 4
        reg.flush()
        # a fresh watcher far behind reads from the database, not the ring
        assert [e.version for e in Registry(s, clock=clock).read(0)] == [1, 2, 3, 4]
    finally:
        s.close()


def test_batch_size_flushes_automatically(store: StateStore, clock: FakeClock) -> None:
    reg = Registry(store, clock=clock, batch_size=10)
    for i in range(25):
        reg.emit("node_up", node_id=f"n{i}")
    assert reg.committed_version == 20 and reg.version == 25
    assert store.event_bounds() == (1, 20)


def test_compacted_history_raises_with_the_way_out(store: StateStore,
                                                   clock: FakeClock) -> None:
    reg = Registry(store, clock=clock, memory_events=4)
    for i in range(20):
        reg.emit("node_up", node_id=f"n{i}")
    reg.flush()
    assert [e.version for e in reg.read(3, limit=2)] == [4, 5]   # from the store
    assert [e.version for e in reg.read(17)] == [18, 19, 20]     # from the ring
    assert reg.compact(keep_last=5) == 15
    with pytest.raises(Compacted) as exc:
        reg.watch(3).poll()
    assert "oldest kept is 16" in str(exc.value) and "watch from version 20" in str(exc.value)
    assert [e.version for e in reg.read(15)] == [16, 17, 18, 19, 20]


def test_evict_node_emits_one_event_per_sandbox_and_updates_quota(
        store: StateStore, clock: FakeClock) -> None:
    q = QuotaIndex()
    q.set_quota("org", Quota(max_sandboxes=3))
    reg = Registry(store, clock=clock, quota=q)
    for i, node in enumerate(["n1", "n1", "n2"]):
        reg.add_sandbox(rec(i, node))
    with pytest.raises(QuotaExceeded):
        q.check("org/a", backend="simulated", cpu_milli=0, memory_bytes=0)
    evicted = reg.evict_node("n1")
    reg.flush()
    assert sorted(r.id for r in evicted) == sorted([rec(0).id, rec(1).id])
    evs = reg.read(3)
    assert [(e.kind, e.sandbox_id, e.payload["reason"]) for e in evs] == [
        ("sandbox_removed", rec(0).id, "node_lost"), ("sandbox_removed", rec(1).id, "node_lost")]
    q.check("org/a", backend="simulated", cpu_milli=0, memory_bytes=0)
    assert [r.id for r in store.list_sandboxes()] == [rec(2, "n2").id]


def test_bad_input(store: StateStore, clock: FakeClock) -> None:
    reg = Registry(store, clock=clock)
    with pytest.raises(SandboxNotFound):
        reg.remove_sandbox("sb-000000000000-n1")
    reg.add_sandbox(rec(1))
    with pytest.raises(InvalidArgument, match="already in the registry"):
        reg.add_sandbox(rec(1))
    with pytest.raises(InvalidArgument):
        reg.read(-1)


def test_pages_walk_projects_in_id_order_with_filters(store: StateStore,
                                                     clock: FakeClock) -> None:
    """List pages come from per-project sorted indexes, merged in id order; the spec
    (labels) survives a restart of the registry from its store."""
    from dsec.wire.spec import SandboxSpec

    reg = Registry(store, clock=clock)
    projects = ["org/a", "org/a/x", "org/b", "other"]
    for i in range(40):
        p = projects[i % 4]
        r = SandboxRecord(id=f"sb-{(i * 7919) % 1000:012x}-n1", node="n1", project=p,
                          created_at=float(i),
                          spec=SandboxSpec(project=p, labels={"even": str(i % 2 == 0)}))
        reg.add_sandbox(r)
    reg.set_paused(f"sb-{0:012x}-n1", True)
    reg.flush()
    reg2 = Registry(store, clock=clock)
    for r_ in (reg, reg2):
        everything: list[str] = []
        after, more = "", True
        while more:
            page, more = r_.page(after=after, limit=7)
            assert len(page) <= 7
            everything += [x.id for x in page]
            after = page[-1].id if page else after
        assert everything == sorted(x.id for x in reg.sandboxes())
        sub = [p for p in r_.projects() if p == "org/a" or p.startswith("org/a/")]
        page, more = r_.page(after="", limit=100, projects=sub,
                             match=lambda x: x.spec is not None and x.spec.labels["even"]
                             == "True")
        assert not more
        assert [x.id for x in page] == sorted(
            x.id for x in reg.sandboxes()
            if x.project in ("org/a", "org/a/x") and x.spec and x.spec.labels["even"] == "True")
        assert r_.sandbox(f"sb-{0:012x}-n1").paused
    reg.remove_sandbox(f"sb-{0:012x}-n1")
    assert f"sb-{0:012x}-n1" not in reg and len(reg) == 39
    assert reg.page(after="", limit=1, projects=["nope"]) == ([], False)


def test_node_digest_follows_every_change_of_the_records(tmp_path: Path) -> None:
    """Registry.node_digest is what a full list is compared with before reconciling it
    (ControlPlane._poll): it must equal the digest recomputed from the records after
    adds, pauses, resumes, removals and another writer's events."""
    from dsec.control.registry import brief_hash
    from dsec.control.store.sqlite import SqliteStore

    def fresh(reg: Registry, node: str) -> tuple[int, int]:
        x = 0
        recs = reg.sandboxes_on(node)
        for r in recs:
            x ^= brief_hash(r.id, r.paused)
        return len(recs), x

    store = SqliteStore(str(tmp_path / "c.sqlite"))
    other = SqliteStore(str(tmp_path / "c.sqlite"))
    try:
        a = Registry(store, clock=lambda: 1.0)
        b = Registry(other, clock=lambda: 1.0)
        ids = [f"sb-{i:012x}-n{i % 2}" for i in range(6)]
        for sid in ids:
            a.add_sandbox(SandboxRecord(id=sid, node=sid[-2:], project="p"))
        a.set_paused(ids[0], True)
        a.set_paused(ids[2], True)
        a.set_paused(ids[2], False)
        a.remove_sandbox(ids[4])
        a.flush()
        b.catch_up()
        a.set_paused(ids[1], True)
        a.remove_sandbox(ids[3])
        a.flush()
        b.catch_up()
        for reg in (a, b):
            for node in ("n0", "n1"):
                assert reg.node_digest(node) == fresh(reg, node)
        assert a.node_digest("n0")[0] == 2 and a.node_digest("nx") == (0, 0)
    finally:
        store.close()
        other.close()
