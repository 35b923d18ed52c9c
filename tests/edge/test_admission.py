from __future__ import annotations

import pytest

from dsec.edge.admission import Capacity, ResourcePool
from dsec.errors import CapacityExceeded, Conflict, InvalidArgument


def test_reserve_release_roundtrip() -> None:
    pool = ResourcePool(Capacity(cpu_milli=2000, memory_bytes=1000, max_sandboxes=3))
    pool.reserve("a", 1000, 400)
    pool.reserve("b", 500, 400)
    assert pool.usage().cpu_milli == 1500 and pool.count == 2
    assert pool.release("a") and not pool.release("a")
    assert pool.usage().cpu_milli == 500 and pool.held == {"b"}


def test_short_resources_are_named_and_rolled_back() -> None:
    pool = ResourcePool(Capacity(cpu_milli=1000, memory_bytes=1000, max_sandboxes=10))
    pool.reserve("a", 800, 900)
    with pytest.raises(CapacityExceeded) as ei:
        pool.reserve("b", 300, 200)
    assert ei.value.detail["short"] == {"cpu_milli": 100, "memory_bytes": 100}
    assert ei.value.detail["free"]["cpu_milli"] == 200
    assert "cpu_milli short by 100" in str(ei.value)
    assert pool.usage().cpu_milli == 800 and pool.held == {"a"}


def test_exactly_max_sandboxes_succeed_under_contention() -> None:
    pool = ResourcePool(Capacity(cpu_milli=10**9, memory_bytes=10**12, max_sandboxes=7))
    ok, short = 0, []
    for i in range(50):
        try:
            pool.reserve(f"s{i}", 1, 1)
            ok += 1
        except CapacityExceeded as exc:
            short.append(exc.detail["short"])
    assert ok == 7 and pool.count == 7
    assert all(s == {"sandboxes": 1} for s in short) and len(short) == 43


def test_double_reserve_and_bad_capacity() -> None:
    pool = ResourcePool(Capacity(cpu_milli=10, memory_bytes=10, max_sandboxes=1))
    pool.reserve("a", 1, 1)
    with pytest.raises(Conflict):
        pool.reserve("a", 1, 1)
    with pytest.raises(InvalidArgument):
        Capacity(cpu_milli=-1, memory_bytes=1, max_sandboxes=1)
