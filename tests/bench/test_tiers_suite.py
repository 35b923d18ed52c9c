"""The ``tiers`` suite: registered, its pure parts, and a tier this node lacks is reported
as unavailable (never measured with something else)."""

from __future__ import annotations

import os

import pytest

from dsec.bench import BenchContext, suites
from dsec.bench import tiers as t


def test_registered() -> None:
    assert "tiers" in suites()


def test_plan_gives_vm_less_and_quick_less() -> None:
    full_c, full_v = t.plan("container", quick=False), t.plan("vm", quick=False)
    quick_v = t.plan("vm", quick=True, idle_s=1.5)
    assert full_v.n_create < full_c.n_create and full_v.n_idle < full_c.n_idle
    assert quick_v.n_create <= full_v.n_create and quick_v.idle_s == 1.5
    assert full_c.cpu_bytes == 100 << 20


def test_pct_and_density() -> None:
    assert t.pct([3.0, 1.0, 2.0], 50) == 2.0
    assert t.pct([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        t.pct([], 50)
    assert t.density_in(4 << 30, 512 << 10) == 8192
    with pytest.raises(ValueError, match="noise"):
        t.density_in(4 << 30, -1.0)


def test_unknown_tier_names_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() != 0:
        pytest.skip("the suite returns early without root")
    monkeypatch.setenv("DSEC_BENCH_TIERS", "container,kvm")
    with pytest.raises(ValueError, match="kvm"):
        t.tiers_suite(BenchContext("tiers", quick=True))


def test_missing_backend_is_reported_not_faked(tmp_path: os.PathLike[str]) -> None:
    b, why = t._backend("nosuch", str(tmp_path), str(tmp_path))
    assert b is None and "nosuch" in why
