"""Suite ``cluster``: registered, and it runs the other issue-16 streams' figure modules
that exist (``dsec.bench.cluster_<stream>``) while skipping the ones that have not landed
(plan-16.md "Figures")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dsec.bench import BenchContext, suites
from dsec.bench.cluster import CLUSTER_MODULES, run_stream_modules


def test_cluster_suite_is_registered() -> None:
    assert "cluster" in suites()
    assert CLUSTER_MODULES == ("cluster_pg", "cluster_join", "cluster_hosts", "cluster_move")


def test_stream_modules_run_when_present_and_are_skipped_when_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "fakebench"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "cluster_a.py").write_text(
        "from dsec.bench import Result\n"
        "def run(quick):\n"
        "    return [Result('x', 'cluster_watch_p99_ms', 42.0, 'ms', {'quick': quick})]\n")
    (pkg / "cluster_b.py").write_text("def run(quick):\n    raise RuntimeError('boom')\n")
    (pkg / "cluster_c.py").write_text("import no_such_dependency_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ctx = BenchContext("cluster", quick=True)
    try:
        ran = run_stream_modules(ctx, ("cluster_a", "cluster_missing", "cluster_b"),
                                 package="fakebench")
        assert ran == ["cluster_a", "cluster_b"]
        assert [(r.suite, r.name, r.value, r.params) for r in ctx.results] == [
            ("cluster", "cluster_watch_p99_ms", 42.0, {"quick": True})]
        assert ctx.notes == ["cluster_b failed: RuntimeError: boom"]
        # a module that exists but cannot import its own dependency is an error, not
        # a stream that has not landed
        with pytest.raises(ModuleNotFoundError):
            run_stream_modules(ctx, ("cluster_c",), package="fakebench")
    finally:
        for name in [m for m in sys.modules if m.startswith("fakebench")]:
            del sys.modules[name]


@pytest.mark.serial     # 3,000 creates against heartbeat TTLs: not beside 4 busy workers
@pytest.mark.skipif(not Path("/usr/lib/postgresql/15/bin/initdb").exists(),
                    reason="needs PostgreSQL 15 (make setup installs it)")
def test_the_scale_run_records_its_figures_quick() -> None:
    """The scale part end to end at the quick size (10 simulated edges x 300, 2 replicas,
    PostgreSQL): every figure recorded, nothing failed. (A recording bug once lost a
    whole full-size run after its 100,000 creates.)"""
    from dsec.bench.cluster import scale_cluster

    ctx = BenchContext("cluster", quick=True)
    scale_cluster(ctx)
    got = {r.name: r for r in ctx.results}
    for name in ("cluster_create_e2e", "cluster_live_sandboxes", "cluster_create_e2e_level",
                 "cluster_list_first_page_ms", "cluster_quota_check_ms",
                 "cluster_apiserver_rss_per_10k_mb"):
        assert name in got, name
    assert got["cluster_create_e2e"].params["failed"] == 0
    assert got["cluster_create_e2e"].value > 0
    assert got["cluster_live_sandboxes"].value == got["cluster_live_sandboxes"].params["target"]
