"""The pure reference computation and prune plan (dsec.image.gc)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dsec.image.gc import LayerNode, plan_prune, referenced


def _n(d: str, kind: str = "base", size: int = 10, used: float = 0.0,
       below: tuple[str, ...] = ()) -> LayerNode:
    return LayerNode(d, kind, size, used, below)


def test_roots_snapshots_and_what_they_stand_on() -> None:
    layers = {d: n for d, n in [
        ("base", _n("base")), ("tool", _n("tool")), ("old", _n("old")),
        ("s1", _n("s1", "snapshot", below=("img",))), ("img", _n("img")),
        ("s2", _n("s2", "snapshot", below=("s1", "img"))),
        ("multi", _n("multi", below=("l1", "l2"))), ("l1", _n("l1")), ("l2", _n("l2")),
    ]}
    refd = referenced(layers, ["base", "multi", "gone"])
    assert refd == {"base", "s1", "s2", "img", "multi", "l1", "l2"}
    plan = plan_prune(layers, ["base", "multi"])
    assert set(plan.remove) == {"tool", "old"} and plan.freed_bytes == 20


def test_budget_removes_least_recently_used_first() -> None:
    layers = {f"g{i}": _n(f"g{i}", size=100, used=float(i)) for i in range(5)}
    layers["named"] = _n("named", size=100, used=-1.0)
    plan = plan_prune(layers, ["named"], budget_bytes=350)
    assert plan.remove == ("g0", "g1", "g2") and plan.kept_bytes == 300
    # the layer a build just made is kept even when it is the oldest garbage
    plan = plan_prune(layers, ["named"], budget_bytes=350, keep=["g0"])
    assert plan.remove == ("g1", "g2", "g3")
    # referenced layers alone over budget: all garbage goes, nothing referenced
    assert set(plan_prune(layers, list(layers)[:5], budget_bytes=0).remove) == {"named"}


_digests = st.sampled_from([f"d{i}" for i in range(12)])


@st.composite
def _stores(draw: st.DrawFn) -> tuple[dict[str, LayerNode], list[str], int | None]:
    names = draw(st.lists(_digests, unique=True, min_size=1))
    layers = {d: LayerNode(d, draw(st.sampled_from(["base", "toolkit", "snapshot"])),
                           draw(st.integers(0, 1000)), draw(st.floats(0, 100)),
                           tuple(draw(st.lists(_digests, max_size=3))))
              for d in names}
    roots = draw(st.lists(_digests, max_size=5))
    budget = draw(st.one_of(st.none(), st.integers(0, 5000)))
    return layers, roots, budget


@settings(max_examples=300, deadline=None)
@given(_stores())
def test_plan_never_removes_a_referenced_layer(case: tuple[dict[str, LayerNode], list[str],
                                                           int | None]) -> None:
    layers, roots, budget = case
    plan = plan_prune(layers, roots, budget_bytes=budget)
    gone = set(plan.remove)
    kept = set(layers) - gone
    assert not gone & plan.referenced
    assert not gone & set(roots)
    assert all(n.kind != "snapshot" for d, n in layers.items() if d in gone)
    # closure: whatever is kept and referenced keeps what it stands on
    for d in kept & plan.referenced:
        assert all(b in kept for b in layers[d].below if b in layers)
    assert plan.freed_bytes == sum(layers[d].size_bytes for d in gone)
    total = sum(n.size_bytes for n in layers.values())
    if budget is None:
        assert kept == plan.referenced
    else:
        # only as much as needed, least recently used first
        assert plan.kept_bytes <= budget or kept == plan.referenced
        if gone:
            assert total - (plan.freed_bytes - layers[plan.remove[-1]].size_bytes) > budget
        used = [layers[d].last_used for d in plan.remove]
        assert used == sorted(used)
        left = [layers[d].last_used for d in kept - plan.referenced]
        assert not used or not left or max(used) <= min(left)
    # the automatic budget's grace: nothing used since idle_before goes, the rest as before
    idle = plan_prune(layers, roots, budget_bytes=budget, idle_before=50.0)
    assert all(layers[d].last_used < 50.0 for d in idle.remove)
    assert not set(idle.remove) & plan.referenced


def test_project_image_bytes_shared_layers_count_fully() -> None:
    from dsec.image.gc import project_image_bytes

    layers = {d: n for d, n in [
        ("base", _n("base", size=100)), ("top", _n("top", size=10, below=("base",))),
        ("mine", _n("mine", size=5)), ("snap", _n("snap", "snapshot", 7, below=("top",))),
    ]}
    refs = {"teama/py:latest": "top", "teamb/py:latest": "top", "teama/x:1": "mine",
            "teama/x:2": "mine", "base:latest": "base", "teama/sub/y:1": "base",
            "teamab/z:1": "mine"}
    assert project_image_bytes(layers, refs, "teama") == 115      # each layer once
    assert project_image_bytes(layers, refs, "teamb") == 110      # the shared base fully
    assert project_image_bytes(layers, refs, "teama/sub") == 100
    assert project_image_bytes(layers, refs, "teamc") == 0


@settings(max_examples=200, deadline=None)
@given(_stores(), st.lists(st.tuples(st.sampled_from(["p", "p/q", "r", ""]), _digests),
                           max_size=8))
def test_project_image_bytes_depends_on_own_names_only(
        case: tuple[dict[str, LayerNode], list[str], int | None],
        names: list[tuple[str, str]]) -> None:
    from dsec.image.gc import project_image_bytes

    layers = case[0]
    refs = {(f"{ns}/" if ns else "") + f"n{i}:t": d for i, (ns, d) in enumerate(names)}
    mine = {k: v for k, v in refs.items() if k.startswith("p/")}
    got = project_image_bytes(layers, refs, "p")
    assert got == project_image_bytes(layers, mine, "p")          # others' names: no effect
    assert got <= sum(n.size_bytes for n in layers.values())
    sub = project_image_bytes(layers, refs, "p/q")
    assert sub <= got                                              # a subtree is inside
    # what the names reach, as the prune's closure sees it (snapshots as plain layers:
    # they are roots for the prune, not for a project's image storage)
    reach = referenced({d: LayerNode(d, "base", n.size_bytes, n.last_used, n.below)
                        for d, n in layers.items()}, list(mine.values()))
    assert got == sum(layers[d].size_bytes for d in reach)
