"""QoS classes, the pure parts (issue 22): the cgroup writes of each class on v1 and v2
(v2 applied to a fake cgroupfs dir: this machine's v2 mount offers no cpu/memory
controller), the memory-pressure policy and its driver (injected clock), the edge door's
class rule, PSI and memory.stat parsing."""

from __future__ import annotations

import asyncio
import os

import msgspec
import pytest

from dsec.edge.governor import Governor, Limits, SandboxCgroup
from dsec.edge.qos import (
    ClassCpus,
    IoLimits,
    MemoryHeld,
    PressureDriver,
    PressurePolicy,
    Psi,
    QosView,
    format_cpulist,
    io_writes,
    memory_held,
    mount_source,
    node_qos,
    parse_class_cpus,
    parse_class_io,
    parse_cpulist,
    parse_psi,
    plan_relief,
    qos_writes,
)
from dsec.errors import InvalidArgument, PermissionDenied
from dsec.wire.spec import SandboxSpec

MiB = 1 << 20


def _files(writes: list[tuple[str, str, str, bool]]) -> dict[str, str]:
    return {f: v for _, f, v, _ in writes}


def test_v1_writes_per_class() -> None:
    be = _files(qos_writes(1, "be", cpu_milli=500, memory_bytes=256 * MiB))
    assert be["cpu.shares"] == "2" and be["cpu.idle"] == "1"
    assert be["memory.soft_limit_in_bytes"] == "0"       # reclaimed first
    ls = _files(qos_writes(1, "ls", cpu_milli=500, memory_bytes=256 * MiB))
    assert "cpu.shares" not in ls and "cpu.idle" not in ls   # the governor's weight stays
    assert ls["memory.soft_limit_in_bytes"] == str(256 * MiB)
    q = _files(qos_writes(1, "ls", cpu_milli=500, memory_bytes=MiB, cpu_quota_milli=2000))
    assert q["cpu.cfs_quota_us"] == "200000"
    assert int(be["blkio.bfq.weight"]) < int(ls["blkio.bfq.weight"])


def test_v2_writes_on_a_fake_cgroupfs(tmp_path: object) -> None:
    """The v2 file names, written by the governor into a directory laid out like a v2
    cgroup (no real v2 cpu/memory controller here). Optional files absent are skipped;
    a required one absent fails."""
    d = os.path.join(str(tmp_path), "sb")
    os.mkdir(d)
    for f in ("cpu.weight", "cpu.idle", "cpu.max", "memory.high"):   # no io.weight
        open(os.path.join(d, f), "w").close()
    cg = SandboxCgroup(2, {"unified": d})
    Governor._apply_qos(cg, Limits(500, 256 * MiB, 64, "be", 1500))

    def read(f: str) -> str:
        with open(os.path.join(d, f)) as fh:
            return fh.read()
    assert read("cpu.weight") == "1" and read("cpu.idle") == "1"
    assert read("cpu.max") == "150000 100000"
    assert read("memory.high") == str(256 * MiB * 15 // 16)   # throttled before OOM
    assert not os.path.exists(os.path.join(d, "io.weight"))
    os.unlink(os.path.join(d, "memory.high"))
    with pytest.raises(OSError):
        Governor._apply_qos(cg, Limits(500, 256 * MiB, 64, "ls"))


def test_class_cpus_parse_and_refuse() -> None:
    node = frozenset({0, 1, 2, 3})
    assert parse_cpulist("0-2,5") == {0, 1, 2, 5} and format_cpulist({0, 1, 2, 5}) == "0-2,5"
    assert parse_class_cpus("be=0", node) == ClassCpus(be="0")
    assert parse_class_cpus("ls=1-3; be=0", node) == ClassCpus(ls="1-3", be="0")
    assert parse_class_cpus("ls=3,1,2 be=0", node).of("ls") == "1-3"
    for bad, says in [("be=4", "not among this node's CPUs 0-3"), ("xx=0", "ls=CPUS"),
                      ("be=", "gets no CPU"), ("be=0 be=1", "twice"), ("be=a", "not a number"),
                      ("be=3-1", "empty or negative")]:
        with pytest.raises(InvalidArgument, match=says):
            parse_class_cpus(bad, node)


def test_cpuset_writes_v1_and_v2(tmp_path: object) -> None:
    """v1 writes mems before cpus (a v1 cpuset cgroup refuses tasks until both are set);
    v2 writes the sandbox's cpuset.cpus; unpinned, nothing is written."""
    w1 = qos_writes(1, "be", cpu_milli=500, memory_bytes=MiB, cpus="0", mems="0")
    files = [f for _, f, _, _ in w1]
    assert files.index("cpuset.mems") < files.index("cpuset.cpus")
    assert _files(w1)["cpuset.cpus"] == "0"
    assert "cpuset.cpus" not in _files(qos_writes(1, "be", cpu_milli=500, memory_bytes=MiB))
    d = os.path.join(str(tmp_path), "sb")
    os.mkdir(d)
    for f in ("cpu.weight", "cpu.idle", "cpu.max", "memory.high", "cpuset.cpus"):
        open(os.path.join(d, f), "w").close()
    Governor._apply_qos(SandboxCgroup(2, {"unified": d}),
                        Limits(500, MiB, 64, "be", cpus="1-3"), cpus="1-3")
    with open(os.path.join(d, "cpuset.cpus")) as f:
        assert f.read() == "1-3"


def test_class_io_parse_writes_and_device() -> None:
    got = parse_class_io("be:wbps=10M,rbps=20m;ls:riops=2000")
    assert got["be"] == IoLimits(rbps=20 << 20, wbps=10 << 20)
    assert got["ls"] == IoLimits(riops=2000)
    for bad in ("xx:wbps=1", "be:wbps=0", "be:wbps=1X", "be:bps=1", "be:wbps=1 be:rbps=1",
                "be"):
        with pytest.raises(InvalidArgument, match="qos_io"):
            parse_class_io(bad)
    assert io_writes(1, "7:0", got["be"]) == [
        ("blkio", "blkio.throttle.read_bps_device", f"7:0 {20 << 20}", False),
        ("blkio", "blkio.throttle.write_bps_device", f"7:0 {10 << 20}", False)]
    assert io_writes(2, "7:0", got["ls"]) == [
        ("unified", "io.max", "7:0 rbps=max wbps=max riops=2000 wiops=max", False)]
    info = ("30 1 0:40 / /var/tmp/a\\040b/pool rw - btrfs /dev/loop0 rw\n"
            "31 1 0:41 / /var/tmp/a\\040b/pool rw - btrfs /dev/loop3 rw\n")
    assert mount_source(info, "/var/tmp/a b/pool") == "/dev/loop3"   # the visible one
    assert mount_source(info, "/var/tmp") is None


def test_psi_and_memory_stat_parsing() -> None:
    psi = parse_psi("some avg10=12.50 avg60=3.00 avg300=1.00 total=5\n"
                    "full avg10=0.40 avg60=0.10 avg300=0.00 total=2\n")
    assert psi == Psi(12.5, 3.0, 0.4, 0.1)
    assert parse_psi("some avg10=1.00 avg60=0.00 avg300=0.00 total=1\n").full_avg10 == 0
    assert memory_held(1, {"total_rss": 5, "total_cache": 7, "total_shmem": 3,
                           "rss": 1}) == MemoryHeld(5, 7, 3)
    assert memory_held(2, {"anon": 5, "file": 7, "shmem": 3}) == MemoryHeld(5, 7, 3)


def _views() -> list[QosView]:
    return [
        QosView("ls-idle", "ls", "running", 0.0, 900 * MiB),      # never paused
        QosView("be-new", "be", "running", 98.0, 100 * MiB),      # active 2 s ago
        QosView("be-old", "be", "running", 10.0, 300 * MiB),
        QosView("be-older", "be", "running", 5.0, 300 * MiB),
        QosView("be-paused", "be", "paused", 1.0, 50 * MiB),
        QosView("be-mid", "be", "running", 50.0, 300 * MiB),
    ]


def test_pressure_policy_pauses_idle_best_effort_longest_idle_first() -> None:
    pol = PressurePolicy(relieve_bytes=500 * MiB, min_idle_s=5.0)
    calm = Psi(1.0, 1.0, 0.0, 0.0)
    assert plan_relief(calm, _views(), now=100.0, policy=pol).pause == ()
    hot = Psi(30.0, 10.0, 0.5, 0.1)
    r = plan_relief(hot, _views(), now=100.0, policy=pol)
    assert r.pause == ("be-older", "be-old")       # 600 MiB >= 500 MiB: stop
    assert "memory pressure" in r.reason and "30.0%" in r.reason
    # full stalls alone count as pressure too; max_per_round caps a round
    full = Psi(0.0, 0.0, 5.0, 1.0)
    one = plan_relief(full, _views(), now=100.0,
                      policy=PressurePolicy(relieve_bytes=10 << 30, max_per_round=1))
    assert one.pause == ("be-older",)
    # everything qualifying when the target is large: never LS, paused or recently active
    every = plan_relief(hot, _views(), now=100.0,
                        policy=PressurePolicy(relieve_bytes=10 << 30))
    assert every.pause == ("be-older", "be-old", "be-mid")


def test_pressure_driver_pauses_then_notifies_and_cools_down() -> None:
    now = [100.0]
    psi = [Psi(40.0, 5.0, 1.0, 0.0)]
    paused: list[str] = []
    notes: list[tuple[str, str]] = []
    views = _views()

    async def pause(sid: str) -> None:
        if sid == "be-old":
            raise RuntimeError("frozen cgroup is gone")
        paused.append(sid)

    drv = PressureDriver(read=lambda: psi[0], views=lambda: views, pause=pause,
                         notify=lambda s, why: notes.append((s, why)), clock=lambda: now[0],
                         policy=PressurePolicy(relieve_bytes=500 * MiB, cooldown_s=10.0))
    r = asyncio.run(drv.tick())
    assert r.pause == ("be-older", "be-old")
    assert paused == ["be-older"] and drv.paused == ["be-older"]
    assert [s for s, _ in notes] == ["be-older", "be-old"]      # pause first, then notify
    assert "pause failed" in notes[1][1]
    now[0] = 105.0                                              # within the cool-down
    assert asyncio.run(drv.tick()).pause == ()
    now[0] = 111.0
    psi[0] = Psi(0.5, 0.5, 0.0, 0.0)                            # relieved
    assert asyncio.run(drv.tick()).pause == ()
    assert paused == ["be-older"]
    drv_none = PressureDriver(read=lambda: None, views=lambda: views, pause=pause,
                              notify=lambda s, w: None, clock=lambda: 0.0)
    assert asyncio.run(drv_none.tick()).reason == "no PSI on this kernel"


def test_edge_door_class_rule() -> None:
    spec = SandboxSpec(project="batch/evals")
    assert node_qos(spec, (), "n1").qos == "ls"
    assert node_qos(spec, ("batch",), "n1").qos == "be"       # a subproject: bound too
    assert node_qos(spec, ("batchx",), "n1").qos == "ls"      # a prefix is not a parent
    with pytest.raises(PermissionDenied, match="qos='ls' is refused on node n1"):
        node_qos(msgspec.structs.replace(spec, qos="ls"), ("batch",), "n1")
    be = msgspec.structs.replace(spec, qos="be")
    assert node_qos(be, ("batch",), "n1") is be


def test_spec_refuses_a_bad_class() -> None:
    from dsec.errors import InvalidArgument
    with pytest.raises(InvalidArgument, match="qos"):
        SandboxSpec(qos="gold").validate()  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="cpu_quota_milli"):
        SandboxSpec(cpu_quota_milli=0).validate()


async def test_node_relieves_memory_pressure_on_best_effort_only() -> None:
    """EdgeNode.relieve_pressure (what the node's pressure loop runs): under PSI pressure
    the idle BE sandbox is paused and gets a ``memory_pressure`` notice; the LS one and the
    recently active BE one keep running; calm PSI pauses nothing."""
    from dsec.edge.clock import FakeClock
    from tests.edge.conftest import make_node

    clock = FakeClock()
    node = make_node(clock=clock, memory_pressure=PressurePolicy(min_idle_s=5.0,
                                                                 cooldown_s=0.0))
    await node.start()
    try:
        psi = [Psi(0.0, 0.0, 0.0, 0.0)]
        node.pressure.read = lambda: psi[0]
        ls = await node.create(SandboxSpec(qos="ls"))
        be_old = await node.create(SandboxSpec(qos="be"))
        clock.advance(60)
        be_new = await node.create(SandboxSpec(qos="be"))
        clock.advance(1)
        assert (await node.relieve_pressure()).pause == ()
        psi[0] = Psi(40.0, 20.0, 3.0, 1.0)
        r = await node.relieve_pressure()
        assert r.pause == (be_old.id,)
        assert node.get(be_old.id).state == "paused"
        assert node.get(be_old.id).paused_reason == "memory_pressure"
        assert node.get(ls.id).state == node.get(be_new.id).state == "running"
        notes = [e for e in node.events(be_old.id) if e.reason == "memory_pressure"]
        # pausing and paused (the transitions' reason), then the notice with the PSI figures
        assert [(e.from_state, e.to_state) for e in notes] == [
            ("running", "pausing"), ("pausing", "paused"), ("paused", "paused")]
        assert "some avg10=40.0%" in notes[-1].detail
    finally:
        await node.close()


def test_v2_governor_delegates_cpuset_and_io_on_a_fake_cgroupfs(tmp_path: object) -> None:
    """cgroup v2 (no real v2 cpu/memory controller here): with CPU pinning and I/O limits
    asked for, the governor delegates +cpuset and +io below the edge's cgroup and reads
    the CPUs its sandboxes may get from the edge's cpuset.cpus.effective."""
    from dsec.edge.governor import CgroupLayout

    own = os.path.join(str(tmp_path), "own")
    base = os.path.join(own, "dsec-t")
    os.makedirs(base)
    for d, f, v in ((own, "cgroup.subtree_control", "cpu memory pids"),
                    (own, "cgroup.procs", ""), (own, "cpuset.cpus.effective", "0-3\n"),
                    (own, "cpuset.mems.effective", "0\n"),
                    (base, "cgroup.subtree_control", "")):
        with open(os.path.join(d, f), "w") as fh:
            fh.write(v)
    gov = Governor(name="t", layout=CgroupLayout(version=2, bases={"unified": base},
                                                 v2_own=own), cpuset=True, blkio=True)
    assert gov.node_cpus == "0-3" and gov.node_mems == "0"
    assert parse_class_cpus("be=0", parse_cpulist(gov.node_cpus)).be == "0"
    with open(os.path.join(base, "cgroup.subtree_control")) as fh:
        # a plain file is not truncated by the writes, so they overlay in order:
        # "+memory +cpu +pids", then "+cpuset", then "+io"
        assert fh.read() == "+iouset +cpu +pids"


# ------------------------------------------------------------------ BE suppression
def test_be_cpu_cap_leaves_ls_their_share_and_never_drops_below_the_floor() -> None:
    from dsec.edge.qos import CpuSuppressPolicy, be_cpu_cap

    pol = CpuSuppressPolicy(threshold=0.65, floor_cores=0.02)
    assert be_cpu_cap(2.0, 0.0, pol) == pytest.approx(1.3)
    assert be_cpu_cap(2.0, 1.0, pol) == pytest.approx(0.3)
    assert be_cpu_cap(2.0, 1.9, pol) == 0.02            # LS take it all: the floor
    with pytest.raises(InvalidArgument):
        CpuSuppressPolicy(threshold=1.5)
    with pytest.raises(InvalidArgument):
        CpuSuppressPolicy(interval_s=0)


def test_busy_time_from_proc_stat() -> None:
    from dsec.edge.qos import read_busy_ns

    text = "cpu  100 5 20 9000 7 1 2 3 50 0\ncpu0 50 2 10 4500 3 0 1 1 25 0\n"
    # user+nice+system+irq+softirq+steal = 100+5+20+1+2+3 ticks of 10 ms
    assert read_busy_ns(text, hz=100) == 131 * 10_000_000
    with pytest.raises(ValueError):
        read_busy_ns("intr 1 2 3\n")


def test_suppressor_follows_ls_use_halves_on_saturation_and_releases() -> None:
    from dsec.edge.qos import CpuSuppressor, CpuSuppressPolicy

    t, busy, be = [0.0], [0], [0]
    caps: list[float | None] = []
    s = CpuSuppressor(cores=2.0, busy_ns=lambda: busy[0], be_ns=lambda: be[0],
                      set_cap=caps.append, clock=lambda: t[0],
                      policy=CpuSuppressPolicy(threshold=0.65, floor_cores=0.02))

    def step(ls_cores: float, be_cores: float, dt: float = 1.0) -> float | None:
        t[0] += dt
        busy[0] += round((ls_cores + be_cores) * dt * 1e9)
        be[0] += round(be_cores * dt * 1e9)
        return s.tick()

    assert s.tick() is None and caps == []               # the first reading: no rate yet
    assert step(0.3, 0.5) == pytest.approx(1.0)          # 1.3 - 0.3
    assert step(0.3, 0.5) == pytest.approx(1.0) and len(caps) == 1   # unmoved: no write
    # LS want more while BE fill the rest: the node is saturated, LS demand is hidden
    # behind BE - the cap halves each interval instead of trusting the LS reading
    assert step(1.0, 1.0) == pytest.approx(0.3)          # min(1.3 - 1.0, 1.0 / 2)
    assert step(1.7, 0.3) == pytest.approx(0.02)         # saturated and LS at 1.7
    # a lull is not believed at once (the estimate halves per interval)...
    assert step(0.0, 0.02) == pytest.approx(1.3 - 0.85)  # LS taken as 1.7 / 2
    assert s.ls_cores == pytest.approx(0.85)
    assert step(0.0, 0.02) == pytest.approx(1.3 - 0.425)
    s.release()
    assert caps[-1] is None and s.cap is None


def test_the_be_cap_is_shared_by_demand_not_by_declared_caps() -> None:
    """Red team 25 A1: by declared caps one idle sandbox declaring 1,024 cores left a
    busy 1-core one 0.001 of the budget; by demand the busy one gets what it can use."""
    from dsec.edge.qos import share_be_cap

    own = {"idle-huge": 1024.0, "busy": 1.0}
    got = share_be_cap(1.3, own, {"idle-huge": 0.0, "busy": 0.4})
    assert got["busy"] == pytest.approx(1.0)             # demand 0.8, grown to its own cap
    assert got["idle-huge"] == pytest.approx(0.3)         # the rest: it may wake up
    assert sum(got.values()) == pytest.approx(1.3)
    # two busy ones over the cap: shared by what they use, nobody above its own cap
    got = share_be_cap(0.5, {"a": 1.0, "b": 1.0}, {"a": 0.3, "b": 0.1})
    assert got["a"] == pytest.approx(0.375) and got["b"] == pytest.approx(0.125)
    # a sandbox that used nothing keeps a floor (min_demand) and nothing is made up
    got = share_be_cap(0.02, {"a": 1.0, "b": 1.0}, {})
    assert got == {"a": pytest.approx(0.01), "b": pytest.approx(0.01)}
    assert share_be_cap(1.0, {}, {}) == {}
