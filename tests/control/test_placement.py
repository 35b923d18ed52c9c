from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from dsec.control.placement import (
    Decision,
    Placement,
    PlacementConfig,
    PlacementNode,
    PlacementRequest,
)
from dsec.errors import InvalidArgument, NoCapacity

GiB = 1 << 30


def view(i: int | str, *, cpu: int = 16000, mem: int = 64 * GiB, used_cpu: int = 0,
         used_mem: int = 0, **kw: object) -> PlacementNode:
    name = i if isinstance(i, str) else f"n{i}"
    return PlacementNode(node=name, cpu_milli_capacity=cpu, memory_bytes_capacity=mem,
                    cpu_milli_used=used_cpu, memory_bytes_used=used_mem, **kw)  # type: ignore[arg-type]


def cluster(n: int, seed: int = 1, **cfg: object) -> Placement:
    p = Placement(rng=random.Random(seed), config=PlacementConfig(**cfg))  # type: ignore[arg-type]
    p.apply_snapshot(view(i) for i in range(n))
    return p


REQ = PlacementRequest(cpu_milli=1000, memory_bytes=4 * GiB)


def test_k_at_least_n_without_jitter_equals_exhaustive_best() -> None:
    rng = random.Random(5)
    p = Placement(rng=random.Random(2), config=PlacementConfig(k=64, jitter=0.0))
    p.apply_snapshot(view(i, used_cpu=rng.randrange(0, 15000), used_mem=rng.randrange(0, 60) * GiB,
                          layers=frozenset({"L1"} if i % 3 else set()), groups={"g": i % 4})
                     for i in range(40))
    for req in (REQ, PlacementRequest(cpu_milli=500, memory_bytes=GiB, layers=("L1", "L2"),
                                      group="g")):
        best = p.best(req)
        d = p.place(req)
        assert d.node == best
        p.forget(d)


def test_only_feasible_nodes_are_chosen_and_no_capacity_is_clear() -> None:
    p = cluster(0)
    p.apply_snapshot([view(0, used_cpu=16000), view(1, used_mem=63 * GiB),
                      view(2, max_sandboxes=1, sandboxes=1), view(3, healthy=False),
                      view(4)])
    for _ in range(20):
        d = p.place(REQ)
        assert d.node == "n4"
        p.forget(d)
    p.update(view(4, used_cpu=15500))
    with pytest.raises(NoCapacity) as exc:
        p.place(REQ)
    assert "cpu_milli=1000" in str(exc.value) and "4 candidate nodes" in str(exc.value)


def test_scan_fallback_finds_the_last_free_node() -> None:
    p = Placement(rng=random.Random(3), config=PlacementConfig(k=4, max_rounds=2))
    p.apply_snapshot(view(i, used_cpu=16000) for i in range(999))
    p.update(view(999))
    assert p.place(REQ).node == "n999"


def test_selector_samples_from_the_label_pool() -> None:
    p = cluster(0, k=2)
    p.apply_snapshot([view(i, labels={"gpu": "a100"} if i == 777 else {"gpu": "none"})
                      for i in range(1000)])
    req = PlacementRequest(cpu_milli=100, memory_bytes=GiB, selector={"gpu": "a100"})
    assert {p.place(req).node for _ in range(10)} == {"n777"}
    p.update(view(777, labels={"gpu": "h100"}))      # label change moves it between pools
    with pytest.raises(NoCapacity, match="selector"):
        p.place(req)


def test_required_layers_and_locality_preference() -> None:
    p = cluster(0, k=8)
    p.apply_snapshot([view(i, layers=frozenset({"base", "ws"}) if i < 2 else frozenset())
                      for i in range(8)])
    req = PlacementRequest(cpu_milli=100, memory_bytes=GiB, layers=("base", "ws"),
                           require_layers=True)
    assert {p.place(req).node for _ in range(20)} <= {"n0", "n1"}
    soft = PlacementRequest(cpu_milli=100, memory_bytes=GiB, layers=("base", "ws"))
    p2 = cluster(0, k=8)
    p2.apply_snapshot([view(i, layers=frozenset({"base", "ws"}) if i == 5 else frozenset())
                       for i in range(8)])
    d = p2.place(soft)
    assert d.node == "n5"


def test_overlay_back_to_back_decisions_see_their_own_load() -> None:
    p = cluster(0, k=4)
    p.apply_snapshot([view(0, max_sandboxes=1), view(1, max_sandboxes=1)])
    a = p.place(REQ)
    b = p.place(REQ)
    assert {a.node, b.node} == {"n0", "n1"}
    with pytest.raises(NoCapacity):
        p.place(REQ)
    p.forget(a)                        # the edge refused: the slot comes back
    c = p.place(REQ)
    assert c.node == a.node
    p.confirm(c)                       # accepted: still charged until the next snapshot
    assert p.usage(c.node) == (1000, 4 * GiB, 1)
    # the next snapshot includes the confirmed sandbox; pending b is still overlaid
    p.update(view(c.node, max_sandboxes=1, used_cpu=1000, used_mem=4 * GiB, sandboxes=1))
    p.update(view(b.node, max_sandboxes=1))
    assert p.usage(c.node) == (1000, 4 * GiB, 1)
    assert p.usage(b.node) == (1000, 4 * GiB, 1) and p.pending(b.node) == 1
    p.forget(c)                        # confirmed decisions are not un-charged twice
    assert p.usage(c.node) == (1000, 4 * GiB, 1)


def test_cloud_bursting_only_when_allowed_and_above_threshold() -> None:
    p = cluster(0, k=8)
    p.apply_snapshot([view(0, used_cpu=12000), view(1, used_cpu=12000),
                      view("c0", cloud=True, cost=1.0)])
    burst = PlacementRequest(cpu_milli=1000, memory_bytes=GiB, allow_burst=True)
    # on-prem at 75% (< 80%): cloud is not a candidate even when allowed
    assert {p.place(burst).node for _ in range(2)} <= {"n0", "n1"}
    # now at 81%: cloud joins but pays its penalty, so on-prem still wins while it fits
    assert p.onprem_utilisation() > 0.8
    d = p.place(burst)
    assert d.node in {"n0", "n1"}
    p.update(view(0, used_cpu=16000))
    p.update(view(1, used_cpu=16000))
    with pytest.raises(NoCapacity, match="cloud bursting not allowed"):
        p.place(REQ)
    assert p.place(burst).node == "c0"


def test_edge_refusal_excludes_and_retries_then_gives_up() -> None:
    p = cluster(5, max_attempts=3)
    attempt = p.begin(REQ)
    seen = []
    for _ in range(3):
        d = attempt.next()
        assert d.node not in seen
        seen.append(d.node)
        attempt.refused(d)
    with pytest.raises(NoCapacity, match="after 3 edge refusals") as exc:
        attempt.next()
    assert exc.value.detail["refused"] == seen
    assert all(p.usage(n) == (0, 0, 0) for n in seen)
    ok = p.begin(REQ)
    d = ok.next()
    ok.accepted(d)
    assert p.pending(d.node) == 0 and p.usage(d.node)[2] == 1


def test_same_seed_same_decisions() -> None:
    a, b = cluster(300, seed=9), cluster(300, seed=9)
    assert [a.place(REQ).node for _ in range(50)] == [b.place(REQ).node for _ in range(50)]


@pytest.mark.parametrize("jitter,herds", [(0.0, True), (1e-3, False)])
def test_simultaneous_burst_herds_without_jitter_and_spreads_with_it(
        jitter: float, herds: bool) -> None:
    """64 apiserver replicas decide at the same moment from the same snapshot (so no one
    sees another's overlay). The nodes are identical, every score ties."""
    snapshot = [view(i) for i in range(16)]
    chosen = Counter()
    for replica in range(64):
        p = Placement(rng=random.Random(replica), config=PlacementConfig(k=16, jitter=jitter))
        p.apply_snapshot(snapshot)
        chosen[p.place(REQ).node] += 1
    if herds:
        assert len(chosen) == 1
    else:
        assert len(chosen) >= 12 and max(chosen.values()) <= 12


def test_removed_node_is_never_chosen_and_snapshot_resync() -> None:
    p = cluster(10)
    p.remove("n3")
    for _ in range(200):
        d = p.place(REQ)
        assert d.node != "n3"
        p.forget(d)
    p.apply_snapshot([view(1), view(2)])
    assert sorted(p.nodes()) == ["n1", "n2"]


def test_bad_config_and_request() -> None:
    with pytest.raises(InvalidArgument, match="k=0"):
        PlacementConfig(k=0)
    with pytest.raises(InvalidArgument, match="burst_threshold"):
        PlacementConfig(burst_threshold=1.5)
    with pytest.raises(InvalidArgument, match="negative"):
        cluster(2).place(PlacementRequest(cpu_milli=-1, memory_bytes=0))


def test_locality_draws_find_a_warm_node_among_many_cold_ones() -> None:
    """With 1 of 2000 nodes holding the image, k=2 finds it every time in O(k)."""
    p = Placement(rng=random.Random(4), config=PlacementConfig(k=2, memory=False, fit_share=0.0,
                                                               affinity_k=1))
    p.apply_snapshot(view(i, layers=frozenset({"base", "ws-7"} if i == 1234 else {"base"}))
                     for i in range(2000))
    req = PlacementRequest(cpu_milli=100, memory_bytes=GiB, layers=("base", "ws-7"))
    for _ in range(20):
        d = p.place(req)
        assert d.node == "n1234"
        p.forget(d)


def test_best_fit_draw_prefers_the_tightest_node_that_fits() -> None:
    p = Placement(rng=random.Random(1), config=PlacementConfig(k=2, memory=False, fit_share=0.5))
    # 999 empty nodes and one with exactly 1000 millicores (and 4 GiB) free
    p.apply_snapshot([view(i) for i in range(999)] + [view(999, used_cpu=15000, used_mem=60 * GiB)])
    d = p.place(PlacementRequest(cpu_milli=1000, memory_bytes=GiB))
    assert d.node == "n999"


class PlacementIndexMachine(RuleBasedStateMachine):
    """Pools, free-CPU bands, totals and the overlay stay consistent under any sequence
    of snapshots, removals and decisions."""

    def __init__(self) -> None:
        super().__init__()
        self.p = Placement(rng=random.Random(0), config=PlacementConfig(k=3))
        self.views: dict[str, PlacementNode] = {}
        self.pending: list[Decision] = []
        self.confirmed: list[Decision] = []

    @rule(i=st.integers(0, 7), used=st.integers(0, 16000), healthy=st.booleans(),
          cloud=st.booleans(), label=st.sampled_from(["a", "b", ""]),
          layer=st.sampled_from(["x", "y", ""]))
    def snapshot(self, i: int, used: int, healthy: bool, cloud: bool, label: str,
                 layer: str) -> None:
        v = view(i, used_cpu=used, healthy=healthy, cloud=cloud,
                 labels={"l": label} if label else {}, layers=frozenset({layer} - {""}))
        self.p.update(v)
        self.views[v.node] = v
        self.confirmed = [d for d in self.confirmed if d.node != v.node]

    @rule(i=st.integers(0, 7))
    def remove(self, i: int) -> None:
        self.p.remove(f"n{i}")
        self.views.pop(f"n{i}", None)
        self.pending = [d for d in self.pending if d.node != f"n{i}"]
        self.confirmed = [d for d in self.confirmed if d.node != f"n{i}"]

    @rule(cpu=st.integers(1, 9000), burst=st.booleans(), label=st.sampled_from(["a", ""]),
          layer=st.sampled_from(["x", ""]))
    def place(self, cpu: int, burst: bool, label: str, layer: str) -> None:
        req = PlacementRequest(cpu_milli=cpu, memory_bytes=GiB, allow_burst=burst,
                               selector={"l": label} if label else {},
                               layers=(layer,) if layer else ())
        feasible = set(self.p.feasible(req))
        try:
            d = self.p.place(req)
        except NoCapacity:
            assert not feasible
            return
        assert d.node in feasible
        self.pending.append(d)

    @rule(data=st.data(), accept=st.booleans())
    def answer(self, data: st.DataObject, accept: bool) -> None:
        if self.pending:
            d = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
            if accept:
                self.p.confirm(d)
                self.confirmed.append(d)
            else:
                self.p.forget(d)

    @invariant()
    def consistent(self) -> None:
        p = self.p
        for name, v in self.views.items():
            extra = [d for d in self.pending + self.confirmed if d.node == name]
            assert p.usage(name) == (v.cpu_milli_used + sum(d.cpu_milli for d in extra),
                                     sum(d.memory_bytes for d in extra),
                                     len(extra))
        for (cloud, tag), pool in p._pools.items():
            want = {n for n, v in self.views.items() if v.healthy and v.cloud == cloud and (
                tag is None or tag in {f"label:{k}={x}" for k, x in v.labels.items()}
                | {f"layer:{x}" for x in v.layers})}
            assert set(pool.pos) == want == {s.node for s in pool.items}
            assert all(pool.items[i].node == n for n, i in pool.pos.items())
        for cloud, bands in p._bands.items():
            for b, pool in enumerate(bands):
                for s in pool.items:
                    free = s.cap_cpu - s.used_cpu
                    assert s.alive and s.cloud == cloud and free > 0 and free.bit_length() == b
        banded = sum(len(pool.items) for bands in p._bands.values() for pool in bands)
        assert banded == sum(1 for n, v in self.views.items()
                             if v.healthy and p.usage(n)[0] < v.cpu_milli_capacity)
        op = [(n, v) for n, v in self.views.items() if v.healthy and not v.cloud]
        assert p._op_used_cpu == sum(p.usage(n)[0] for n, _ in op)
        assert p._op_cap_cpu == sum(v.cpu_milli_capacity for _, v in op)


PlacementIndexMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                                   deadline=None)
TestPlacementIndex = PlacementIndexMachine.TestCase


def test_qos_best_effort_packs_latency_sensitive_spreads() -> None:
    """Issue 22: with one busy and one quiet node, a BE request lands on the busy node,
    an LS request on the quiet one; without a class (older callers) packing decides."""
    from dsec.control.placement import qos_term

    assert qos_term("be", 0.5, 0.5, 1.5) == 0.75 and qos_term("ls", 0.5, 0.5, 1.5) == -0.75
    pl = Placement(rng=random.Random(1), config=PlacementConfig(k=2, jitter=0.0))
    gib = 1 << 30
    pl.update(PlacementNode(node="busy", cpu_milli_capacity=8000,
                            memory_bytes_capacity=32 * gib, cpu_milli_used=6000,
                            memory_bytes_used=24 * gib))
    pl.update(PlacementNode(node="quiet", cpu_milli_capacity=8000,
                            memory_bytes_capacity=32 * gib))

    def best(qos: str | None) -> str | None:
        return pl.best(PlacementRequest(cpu_milli=500, memory_bytes=gib, qos=qos))
    assert best("be") == "busy"
    assert best("ls") == "quiet"
    assert best(None) == "busy"
