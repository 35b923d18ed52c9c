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


# ------------------------------------------------------------------ real capacity
def test_a_request_larger_than_the_whole_node_is_unsatisfiable_not_full() -> None:
    from dsec.edge.admission import Resources
    from dsec.errors import Unsatisfiable

    physical = Resources(cpu_milli=2000, memory_bytes=24 << 30, disk_bytes=100 << 30)
    pool = ResourcePool(Capacity(cpu_milli=128_000, memory_bytes=96 << 30, max_sandboxes=10,
                                 disk_bytes=100 << 30, physical=physical), node="node n1")
    with pytest.raises(Unsatisfiable) as ei:
        pool.reserve("a", 1000, 1 << 40)
    assert str(ei.value) == (
        "memory=1 TiB is more than node n1 could ever hold (it has 24 GiB x overcommit 4 "
        "= 96 GiB for all its sandboxes); ask for at most 96 GiB or raise its overcommit")
    assert ei.value.detail["field"] == "memory_bytes" and ei.value.http_status == 400
    with pytest.raises(Unsatisfiable, match=r"cpu=200 cores .* 2 cores x overcommit 64"):
        pool.reserve("a", 200_000, 1 << 20)
    with pytest.raises(Unsatisfiable, match=r"disk=1 TiB .* a 100 GiB filesystem\)"):
        pool.reserve("a", 1000, 1 << 20, disk_bytes=1 << 40)
    assert pool.count == 0 and pool.usage().memory_bytes == 0     # nothing held
    # the whole node is fine; more than what is left of it is "full now"
    pool.reserve("a", 1000, 96 << 30)
    with pytest.raises(CapacityExceeded):
        pool.reserve("b", 1000, 1 << 30)


def test_plan_capacity_splits_the_machine_and_overcommits() -> None:
    from dsec.edge.admission import HostResources, Overcommit, plan_capacity

    host = HostResources(cpu_milli=2000, memory_bytes=24 << 30, disk_bytes=1 << 40,
                         sources={})
    one = plan_capacity(host, overcommit=Overcommit(cpu=64, memory=4), max_sandboxes=100)
    assert (one.cpu_milli, one.memory_bytes, one.disk_bytes) == (128_000, 96 << 30, 1 << 40)
    two = plan_capacity(host, overcommit=Overcommit(cpu=1, memory=1.5), max_sandboxes=100,
                        share=2)
    assert two.physical is not None and two.physical.memory_bytes == 12 << 30
    assert (two.cpu_milli, two.memory_bytes) == (1000, 18 << 30)
    assert two.disk_bytes == 1 << 40            # per-sandbox ceiling, not split
    with pytest.raises(InvalidArgument, match="overcommit"):
        Overcommit(memory=0)


def _fake_tree(root: str, *, cgroup: str, files: dict[str, str]) -> tuple[str, str]:
    import os

    proc, cg = os.path.join(root, "proc"), os.path.join(root, "cg")
    os.makedirs(os.path.join(proc, "self"))
    with open(os.path.join(proc, "meminfo"), "w") as f:
        f.write("MemTotal:       24684084 kB\nMemFree: 1 kB\n")
    with open(os.path.join(proc, "self", "cgroup"), "w") as f:
        f.write(cgroup)
    for rel, text in files.items():
        path = os.path.join(cg, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return proc, cg


def test_measure_host_takes_the_lower_of_machine_and_cgroup_v1(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from dsec.edge.admission import measure_host

    proc, cg = _fake_tree(str(tmp_path), cgroup="4:memory:/job/a\n1:cpu,cpuacct:/job/a\n0::/\n",
                          files={
                              # the parent's limit binds, not the child's looser one
                              "memory/job/memory.limit_in_bytes": str(8 << 30),
                              "memory/job/a/memory.limit_in_bytes": "9223372036854771712",
                              "memory/memory.limit_in_bytes": "9223372036854771712",
                              "cpu/job/a/cpu.cfs_quota_us": "150000",
                              "cpu/job/a/cpu.cfs_period_us": "100000",
                              "cpu/job/cpu.cfs_quota_us": "-1",
                              "cpu/job/cpu.cfs_period_us": "100000"})
    h = measure_host(str(tmp_path), proc_root=proc, cgroup_root=cg, cpus_allowed=4)
    assert (h.cpu_milli, h.memory_bytes) == (1500, 8 << 30)
    assert h.sources["memory"].endswith("job/memory.limit_in_bytes")
    assert h.sources["cpu"].endswith("job/a/cpu.cfs_quota_us")
    assert h.disk_bytes is not None and h.disk_bytes > 0


def test_measure_host_reads_cgroup_v2_and_falls_back_to_the_machine(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from dsec.edge.admission import measure_host

    proc, cg = _fake_tree(str(tmp_path / "a"), cgroup="0::/svc/edge\n", files={
        "cgroup.controllers": "cpu memory pids\n",
        "svc/edge/memory.max": "max\n", "svc/memory.max": str(2 << 30) + "\n",
        "svc/edge/cpu.max": "max 100000\n", "svc/cpu.max": "50000 100000\n"})
    h = measure_host(None, proc_root=proc, cgroup_root=cg, cpus_allowed=8)
    assert (h.cpu_milli, h.memory_bytes, h.disk_bytes) == (500, 2 << 30, None)
    proc, cg = _fake_tree(str(tmp_path / "b"), cgroup="0::/\n", files={
        "cgroup.controllers": "cpu memory\n"})
    h = measure_host(None, proc_root=proc, cgroup_root=cg, cpus_allowed=8)
    assert (h.cpu_milli, h.memory_bytes) == (8000, 24684084 * 1024)
    assert h.sources["memory"].endswith("meminfo MemTotal")


def test_measure_host_on_this_machine(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import os

    from dsec.edge.admission import measure_host

    h = measure_host(str(tmp_path / "not-yet"))
    assert 1000 <= h.cpu_milli <= len(os.sched_getaffinity(0)) * 1000
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    assert 0 < h.memory_bytes <= total
    st = os.statvfs(str(tmp_path))
    assert h.disk_bytes == st.f_blocks * st.f_frsize


def test_the_disk_ceiling_is_the_smaller_of_filesystem_and_disk_pool() -> None:
    from types import SimpleNamespace

    from dsec.edge.admission import Resources, bound_disk

    phys = Resources(cpu_milli=1000, memory_bytes=1 << 30, disk_bytes=1 << 40)
    cap = Capacity(cpu_milli=1000, memory_bytes=1 << 30, max_sandboxes=1,
                   disk_bytes=1 << 40, physical=phys)
    pooled = SimpleNamespace(disk=SimpleNamespace(total_bytes=lambda: 100 << 30))
    assert bound_disk(cap, [object(), pooled]).disk_bytes == 100 << 30
    assert bound_disk(cap, [pooled]).physical.disk_bytes == 100 << 30  # type: ignore[union-attr]
    assert bound_disk(cap, [object()]) is cap                       # no pool: unchanged
    small = Capacity(cpu_milli=1000, memory_bytes=1 << 30, max_sandboxes=1, disk_bytes=1 << 30)
    assert bound_disk(small, [pooled]) is small                     # the fs is smaller
