from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from dsec.control.quota import Limits, Quota, QuotaIndex, QuotaPolicy
from dsec.control.records import SandboxRecord
from dsec.errors import InvalidArgument, QuotaExceeded, SandboxNotFound
from dsec.ids import project_ancestors


def rec(i: int, project: str = "org/team/exp1", *, node: str = "n1", cpu: int = 1000,
        mem: int = 1 << 30, backend: str = "simulated", paused: bool = False) -> SandboxRecord:
    return SandboxRecord(id=f"sb-{i:012x}-{node}", node=node, project=project,
                         backend=backend, cpu_milli=cpu, memory_bytes=mem, paused=paused)


def test_ancestor_quota_refuses_and_message_names_it() -> None:
    q = QuotaIndex()
    q.set_quota("org", Quota(cpu_milli=2500))
    q.insert(rec(1, "org/a"))
    q.insert(rec(2, "org/b/c"))
    with pytest.raises(QuotaExceeded) as exc:
        q.check("org/b", backend="simulated", cpu_milli=1000, memory_bytes=0)
    msg = str(exc.value)
    assert "'org'" in msg and "ancestor of 'org/b'" in msg and "cpu_milli" in msg
    assert "used 2000" in msg and "requested 1000" in msg and "limit 2500" in msg
    assert exc.value.detail == {"project": "org", "requested_in": "org/b",
                                "resource": "cpu_milli", "backend": None, "used": 2000,
                                "limit": 2500, "requested": 1000}
    q.check("org/b", backend="simulated", cpu_milli=500, memory_bytes=0)


def test_sandbox_count_memory_and_per_backend_limits() -> None:
    q = QuotaIndex()
    q.set_quota("p", Quota(max_sandboxes=2, backends={"container": Limits(memory_bytes=1 << 30)}))
    q.insert(rec(1, "p", backend="container"))
    with pytest.raises(QuotaExceeded, match="memory_bytes for backend 'container'"):
        q.check("p", backend="container", cpu_milli=1, memory_bytes=1)
    q.check("p", backend="simulated", cpu_milli=1, memory_bytes=1 << 40)
    q.insert(rec(2, "p"))
    with pytest.raises(QuotaExceeded, match="sandboxes"):
        q.check("p", backend="simulated", cpu_milli=1, memory_bytes=1)
    q.remove(rec(2, "p").id)
    q.check("p", backend="simulated", cpu_milli=1, memory_bytes=1)


def test_paused_sandboxes_free_cpu_but_keep_memory_by_default() -> None:
    q = QuotaIndex()
    q.set_quota("p", Quota(cpu_milli=1000, memory_bytes=1 << 30))
    r = rec(1, "p")
    q.insert(r)
    q.set_paused(r.id, True)
    assert q.usage("p").cpu_milli == 0 and q.usage("p").memory_bytes == 1 << 30
    q.check("p", backend="simulated", cpu_milli=1000, memory_bytes=0)
    q.insert(rec(2, "p", mem=0, cpu=1000))
    with pytest.raises(QuotaExceeded, match="cpu_milli"):
        q.check_resume(r.id)
    q2 = QuotaIndex(QuotaPolicy(paused_counts_cpu=True, paused_counts_memory=False))
    q2.insert(rec(1, "p", paused=True))
    assert (q2.usage("p").cpu_milli, q2.usage("p").memory_bytes) == (1000, 0)


def test_a_resume_is_checked_and_held_in_one_step() -> None:
    """Red team 19, B3: hold_resume checks the quota chain and charges the resume at
    once (a second resume or a create sees it); release_hold gives it back once."""
    q = QuotaIndex()
    q.set_quota("org", Quota(cpu_milli=2000))
    a, b = rec(1, "org/a"), rec(2, "org/b")
    q.insert(a)
    q.insert(b)
    q.set_paused(a.id, True)
    q.set_paused(b.id, True)
    q.insert(rec(3, "org/c"))                                  # 1000m running
    assert q.hold_resume(rec(9).id) is None                    # unknown: nothing held
    assert q.hold_resume(rec(3, "org/c").id) is None           # running: nothing held
    hold = q.hold_resume(a.id)
    assert hold is not None and q.usage("org").cpu_milli == 2000
    with pytest.raises(QuotaExceeded, match="'org'.*cpu_milli.*used 2000"):
        q.hold_resume(b.id)                                    # the held resume counts
    q.release_hold(hold)                                       # the resume failed
    q.release_hold(hold)                                       # (once only)
    assert q.usage("org").cpu_milli == 1000
    hold = q.hold_resume(b.id)
    assert hold is not None
    q.release_hold(hold)                                       # it succeeded: the hold
    q.set_paused(b.id, False)                                  # becomes its charge
    assert q.usage("org").cpu_milli == q.usage("org/b").cpu_milli + 1000 == 2000
    assert q.usage("org").sandboxes == 3


def test_node_lost_uncounts_its_sandboxes() -> None:
    q = QuotaIndex()
    q.insert(rec(1, "a", node="n1"))
    q.insert(rec(2, "a", node="n2"))
    q.insert(rec(3, "a/b", node="n1"))
    lost = q.node_lost("n1")
    assert sorted(r.id for r in lost) == sorted([rec(1, node="n1").id, rec(3, node="n1").id])
    assert q.usage("a").sandboxes == 1 and q.usage("a/b").sandboxes == 0


def test_bad_input() -> None:
    q = QuotaIndex()
    with pytest.raises(InvalidArgument, match="non-negative"):
        q.set_quota("p", Quota(cpu_milli=-1))
    with pytest.raises(InvalidArgument, match="invalid project path"):
        q.check("Bad Path", backend="x", cpu_milli=0, memory_bytes=0)
    with pytest.raises(SandboxNotFound):
        q.remove("sb-000000000000-n1")
    q.insert(rec(1))
    with pytest.raises(InvalidArgument, match="already counted"):
        q.insert(rec(1))


PROJECTS = ["a", "a/b", "a/b/c", "a/d", "e", "e/f/g/h/i"]
NODES = ["n1", "n2", "n3"]
BACKENDS = ["simulated", "container"]


class QuotaIndexMachine(RuleBasedStateMachine):
    """The incremental index always equals a from-scratch recount of the live set."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = QuotaPolicy(paused_counts_cpu=False, paused_counts_memory=True)
        self.q = QuotaIndex(self.policy)
        self.live: dict[str, SandboxRecord] = {}
        self.next_id = 0

    @rule(project=st.sampled_from(PROJECTS), node=st.sampled_from(NODES),
          backend=st.sampled_from(BACKENDS), cpu=st.integers(0, 8000),
          mem=st.integers(0, 1 << 34), paused=st.booleans())
    def insert(self, project: str, node: str, backend: str, cpu: int, mem: int,
               paused: bool) -> None:
        self.next_id += 1
        r = rec(self.next_id, project, node=node, cpu=cpu, mem=mem, backend=backend,
                paused=paused)
        self.q.insert(r)
        self.live[r.id] = r

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        if self.live:
            sid = data.draw(st.sampled_from(sorted(self.live)))
            self.q.remove(sid)
            del self.live[sid]

    @rule(data=st.data(), paused=st.booleans())
    def toggle_pause(self, data: st.DataObject, paused: bool) -> None:
        if self.live:
            sid = data.draw(st.sampled_from(sorted(self.live)))
            self.q.set_paused(sid, paused)
            r = self.live[sid]
            self.live[sid] = SandboxRecord(**{**r.to_dict(), "paused": paused})

    @rule(node=st.sampled_from(NODES))
    def node_lost(self, node: str) -> None:
        lost = {r.id for r in self.q.node_lost(node)}
        assert lost == {i for i, r in self.live.items() if r.node == node}
        for i in lost:
            del self.live[i]

    @invariant()
    def index_equals_recount(self) -> None:
        want: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        want_b: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
        for r in self.live.values():
            cpu = 0 if r.paused else r.cpu_milli
            for p in project_ancestors(r.project):  # type: ignore[arg-type]
                for acc in (want[p], want_b[(p, r.backend)]):
                    acc[0] += 1
                    acc[1] += cpu
                    acc[2] += r.memory_bytes
        for p in {a for pr in PROJECTS for a in project_ancestors(pr)}:  # type: ignore[arg-type]
            u = self.q.usage(p)
            assert (u.sandboxes, u.cpu_milli, u.memory_bytes) == tuple(want[p])
            for b in BACKENDS:
                assert u.backends.get(b, (0, 0, 0)) == tuple(want_b[(p, b)])
        assert len(self.q) == len(self.live)


QuotaIndexMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                               deadline=None)
TestQuotaIndex = QuotaIndexMachine.TestCase
