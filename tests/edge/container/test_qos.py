"""QoS classes on real container sandboxes (issue 22): a best-effort sandbox's processes
run SCHED_IDLE - its init, its exec helper, a command forked by the zygote (the first
exec, a background exec) and one forked by the helper - in a cgroup with the lowest CPU
weight and ``cpu.idle``; a latency-sensitive one keeps SCHED_OTHER and a weight
proportional to its request; stats show the class and the memory held by kind."""

from __future__ import annotations

import asyncio
import os
import time

import msgspec
import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import SPEC, new_sid

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

SCHED_OTHER, SCHED_IDLE = 0, 5


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


async def _policy_inside(b: ContainerBackend, sid: str) -> int:
    """The scheduling policy of the exec'd command itself (grep reads its own sched)."""
    r = await b.exec(sid, ExecRequest(shell="grep '^policy' /proc/self/sched"))
    assert r.exit_code == 0, r
    return int(r.stdout.decode().split(":")[1])


async def _helper_up(b: ContainerBackend, sid: str) -> None:
    deadline = time.monotonic() + 10
    while not b.box(sid).helper and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert b.box(sid).helper


@pytest.mark.parametrize(("qos", "want"), [("be", SCHED_IDLE), ("ls", SCHED_OTHER)])
async def test_class_reaches_every_process_and_the_cgroup(
        backend: ContainerBackend, qos: str, want: int) -> None:
    sid = new_sid()
    await backend.create(sid, msgspec.structs.replace(SPEC, qos=qos, cpu_milli=500))
    box = backend.box(sid)
    assert os.sched_getscheduler(box.init_pid) == want
    # LS: the first exec takes the zygote's per-exec path (and starts the helper); BE
    # waits for its SCHED_IDLE helper, so not even the command's first instant is OTHER
    assert await _policy_inside(backend, sid) == want
    await _helper_up(backend, sid)
    assert backend.box(sid).helper
    # later ones are forked by the helper: inherited
    assert await _policy_inside(backend, sid) == want
    # a grandchild of a helper-forked shell inherits it too
    r = await backend.exec(sid, ExecRequest(shell="sh -c \"grep '^policy' /proc/self/sched\""))
    assert int(r.stdout.decode().split(":")[1]) == want
    # a background process, read from the host
    bg = await backend.exec(sid, ExecRequest(argv=["sleep", "30"], background=True))
    assert bg.pid is not None
    cg = backend.governor.paths(sid)
    pids = [int(p) for p in _read(os.path.join(
        cg.dirs.get("pids", cg.dirs.get("unified", "")), "cgroup.procs")).split()]
    assert len(pids) >= 2   # init and the sleep (and the helper)
    assert {os.sched_getscheduler(p) for p in pids} == {want}
    cpu = cg.dirs.get("cpu")
    if cpu is not None:   # cgroup v1 (this machine)
        idle = os.path.exists(os.path.join(cpu, "cpu.idle"))
        # with cpu.idle=1 the kernel reports the idle group weight (WEIGHT_IDLEPRIO, 3)
        be_shares = "3" if idle else "2"
        assert _read(os.path.join(cpu, "cpu.shares")) == (be_shares if qos == "be" else "512")
        if idle:
            assert _read(os.path.join(cpu, "cpu.idle")) == ("1" if qos == "be" else "0")
        soft = int(_read(os.path.join(cg.dirs["memory"], "memory.soft_limit_in_bytes")))
        assert soft == (0 if qos == "be" else SPEC.memory_bytes)
    st = await backend.stats(sid)
    assert st.qos == qos
    assert st.memory_rss_bytes + st.memory_cache_bytes > 0


async def test_stats_count_shared_memory_and_page_cache(backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, msgspec.structs.replace(SPEC, qos="be"))
    before = await backend.stats(sid)
    r = await backend.exec(sid, ExecRequest(
        shell="dd if=/dev/zero of=/dev/shm/blob bs=1M count=8 2>/dev/null && "
              "dd if=/dev/zero of=/upper.bin bs=1M count=8 2>/dev/null && sync"))
    assert r.exit_code == 0, r
    after = await backend.stats(sid)
    assert after.memory_shm_bytes - before.memory_shm_bytes >= 8 << 20
    assert after.memory_cache_bytes >= after.memory_shm_bytes   # shmem is file-backed
    assert after.disk_bytes - before.disk_bytes >= 7 << 20   # the upper layer (qgroup-rounded)


async def test_cpu_quota_milli_replaces_the_cap(backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, msgspec.structs.replace(SPEC, cpu_milli=250,
                                                      cpu_quota_milli=1500))
    cg = backend.governor.paths(sid)
    if "cpu" in cg.dirs:
        assert _read(os.path.join(cg.dirs["cpu"], "cpu.cfs_quota_us")) == "150000"
        assert _read(os.path.join(cg.dirs["cpu"], "cpu.shares")) == "256"
    else:
        assert _read(os.path.join(cg.dirs["unified"], "cpu.max")) == "150000 100000"


async def test_class_cpus_pin_best_effort_and_hold_inside(tmp_path: object,
                                                          images_dir: str) -> None:
    """``qos_cpus="be=0"``: a BE sandbox's processes (init, helper- and zygote-forked
    commands) may run on CPU 0 only, and a process inside cannot widen that (the cpuset
    cgroup bounds sched_setaffinity); an LS sandbox keeps every CPU; destroy leaves no
    cpuset cgroup."""
    from dsec.edge.backends.container import DirectoryImages
    from dsec.edge.qos import format_cpulist, parse_cpulist
    from tests.edge.container.conftest import _cleanup

    node = parse_cpulist(_read("/sys/fs/cgroup/cpuset/cpuset.effective_cpus")) \
        if os.path.exists("/sys/fs/cgroup/cpuset/cpuset.effective_cpus") else frozenset()
    if len(node) < 2:
        pytest.skip("needs a v1 cpuset hierarchy and 2 CPUs")
    first = min(node)
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                         images=DirectoryImages(images_dir), qos_cpus=f"be={first}")
    try:
        be, ls = new_sid(), new_sid()
        await b.create(be, msgspec.structs.replace(SPEC, qos="be"))
        await b.create(ls, msgspec.structs.replace(SPEC, qos="ls"))
        allowed = "grep Cpus_allowed_list /proc/self/status | cut -f2"
        for _ in range(3):   # zygote-forked first, then the helper's
            r = await b.exec(be, ExecRequest(shell=allowed))
            assert r.stdout.decode().strip() == str(first), r
            r = await b.exec(ls, ExecRequest(shell=allowed))
            assert r.stdout.decode().strip() == format_cpulist(node), r
        # widening from inside: taskset asks for every CPU; the kernel intersects it
        # with the cgroup's cpuset, so the command still runs on CPU `first` only
        r = await b.exec(be, ExecRequest(shell=f"taskset -p {1 << max(node) | 1} $$ "
                                               f">/dev/null 2>&1; {allowed}"))
        assert r.stdout.decode().strip() == str(first), r
        box = b.box(be)
        assert os.sched_getaffinity(box.init_pid) == {first}
        cg = b.governor.paths(be)
        assert _read(os.path.join(cg.dirs["cpuset"], "cpuset.cpus")) == str(first)
        await b.destroy(be)
        assert not os.path.exists(cg.dirs["cpuset"])
    finally:
        await _cleanup(b)


async def test_io_throttle_on_the_disk_pool(tmp_path: object, images_dir: str) -> None:
    """``qos_io="be:wbps=1M"``: a BE sandbox's cgroup throttles writes on the disk
    pool's block device; a direct write of 3 MiB inside takes >= 1.5 s (unthrottled:
    milliseconds) and is counted on that device in the sandbox's blkio cgroup; an LS
    sandbox has no throttle."""
    from dsec.edge.backends.container import DirectoryImages
    from tests.edge.container.conftest import _cleanup

    if not os.path.isdir("/sys/fs/cgroup/blkio"):
        pytest.skip("needs the v1 blkio hierarchy")
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                         images=DirectoryImages(images_dir), qos_io="be:wbps=1M")
    try:
        be, ls = new_sid(), new_sid()
        await b.create(be, msgspec.structs.replace(SPEC, qos="be"))
        await b.create(ls, msgspec.structs.replace(SPEC, qos="ls"))
        dev = b.io_device
        cg = b.governor.paths(be)
        assert _read(os.path.join(cg.dirs["blkio"], "blkio.throttle.write_bps_device")) \
            == f"{dev} {1 << 20}"
        assert _read(os.path.join(b.governor.paths(ls).dirs["blkio"],
                                  "blkio.throttle.write_bps_device")) == ""
        t0 = time.monotonic()
        r = await b.exec(be, ExecRequest(shell="dd if=/dev/zero of=/big bs=64k count=48 "
                                               "oflag=direct 2>&1"))
        took = time.monotonic() - t0
        assert r.exit_code == 0, r
        assert took >= 1.5, (took, r.stdout)
        served = _read(os.path.join(cg.dirs["blkio"], "blkio.throttle.io_service_bytes"))
        written = next(int(line.split()[2]) for line in served.splitlines()
                       if line.startswith(f"{dev} Write"))
        assert written >= 3 << 20
    finally:
        await _cleanup(b)


async def test_limit_total_memory_caps_the_sandboxes_parent(backend: ContainerBackend) -> None:
    """The cap the qos bench's memory half puts on all sandboxes together, and its
    removal (v1: -1 reads back as the kernel's 'unlimited')."""
    gov = backend.governor
    ctrl = "unified" if gov.version == 2 else "memory"
    f = os.path.join(gov.layout.bases[ctrl],
                     "memory.max" if gov.version == 2 else "memory.limit_in_bytes")
    unlimited = _read(f)
    gov.limit_total_memory(256 << 20)
    assert _read(f) == str(256 << 20)
    gov.limit_total_memory(None)
    assert _read(f) == unlimited


async def test_runc_best_effort_execs_run_sched_idle(runc_backend: ContainerBackend) -> None:
    """runc driver: a BE sandbox's exec'd commands (foreground and background) run
    SCHED_IDLE (runc started under chrt --idle: runc init and the command inherit it);
    an LS sandbox's stay SCHED_OTHER."""
    for qos, want in (("be", SCHED_IDLE), ("ls", SCHED_OTHER)):
        sid = new_sid()
        await runc_backend.create(sid, msgspec.structs.replace(SPEC, qos=qos))
        assert await _policy_inside(runc_backend, sid) == want
        bg = await runc_backend.exec(sid, ExecRequest(argv=["sleep", "30"], background=True))
        assert bg.pid is not None
        r = await runc_backend.exec(sid, ExecRequest(
            shell=f"grep '^policy' /proc/{bg.pid}/sched"))
        assert int(r.stdout.decode().split(":")[1]) == want, r


async def test_pin_or_io_limit_refused_by_a_governor_not_managing_them(
        backend: ContainerBackend) -> None:
    """A Limits asking for CPUs or I/O limits from a governor made without cpuset/blkio
    is refused before anything is made: no cgroup directory is left."""
    from dsec.edge.governor import Limits
    from dsec.edge.qos import IoLimits
    from dsec.errors import BackendError

    gov = backend.governor
    assert not gov.cpuset and not gov.blkio
    sid = new_sid()
    for lim in (Limits(500, 64 << 20, 64, cpus="0"),
                Limits(500, 64 << 20, 64, io=("7:0", IoLimits(wbps=1 << 20)))):
        with pytest.raises(BackendError, match="does not manage"):
            gov.create(sid, lim)
        assert not any(os.path.exists(d) for d in gov.paths(sid).dirs.values())


async def test_best_effort_cpu_cgroups_share_one_idle_parent_beside_the_edge(
        tmp_path: object, images_dir: str) -> None:
    """v1: every BE sandbox's cpu cgroup is under one ``cpu.idle`` parent that is a
    *sibling* of the sandboxes' parent, i.e. at the edge's own level (where the edge's
    exec path meets BE work: dsec.edge.governor.be_cpu_parent); an LS sandbox's stays
    under the base. Every process of the BE sandbox (init, helper, zygote- and
    helper-forked commands) is in it; the census finds it; destroy removes it, and so
    does reconciliation of a sandbox the node forgot (a restarted edge)."""
    from dsec.edge.backends.container import DirectoryImages
    from dsec.edge.backends.container.census import take_census
    from tests.edge.container.conftest import _cleanup

    root = os.path.join(str(tmp_path), "root")
    b = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir))
    b2: ContainerBackend | None = None
    try:
        gov = b.governor
        if gov.version != 1 or "cpu" not in gov.layout.bases:
            pytest.skip("the BE cpu parent is a cgroup v1 layout")
        base, parent = gov.layout.bases["cpu"], gov.layout.be_cpu
        assert os.path.dirname(parent) == os.path.dirname(base)   # the edge's own level
        own = next(line.split(":", 2)[2] for line in _read("/proc/self/cgroup").splitlines()
                   if "cpu" in line.split(":")[1].split(","))
        assert os.path.dirname(base).endswith(own.rstrip("/"))
        be, ls = new_sid(), new_sid()
        await b.create(be, msgspec.structs.replace(SPEC, qos="be"))
        await b.create(ls, msgspec.structs.replace(SPEC, qos="ls"))
        if os.path.exists(os.path.join(parent, "cpu.idle")):
            assert _read(os.path.join(parent, "cpu.idle")) == "1"
        mine = os.path.join(parent, be)
        assert b.box(be).cg.dirs["cpu"] == mine
        assert b.box(ls).cg.dirs["cpu"] == os.path.join(base, ls)
        assert gov.paths(be).dirs["cpu"] == mine   # found without knowing the class
        await b.exec(be, ExecRequest(argv=("sleep", "30"), background=True))   # zygote
        assert (await b.exec(be, ExecRequest(shell="true"))).exit_code == 0
        await _helper_up(b, be)
        await b.exec(be, ExecRequest(argv=("sleep", "30"), background=True))   # helper
        tasks = {int(p) for p in _read(os.path.join(b.box(be).cg.dirs["pids"],
                                                    "cgroup.procs")).split()}
        assert len(tasks) >= 4   # init, helper, two sleeps
        assert {int(p) for p in _read(os.path.join(mine, "cgroup.procs")).split()} == tasks
        assert mine in take_census(root, b.cgroup_name).cgroups[be]
        assert be in gov.list_sandboxes()
        await b.destroy(be)
        assert not os.path.exists(mine)
        # a restarted edge reconciles away a BE sandbox it does not keep: cpu dir too
        gone = new_sid()
        await b.create(gone, msgspec.structs.replace(SPEC, qos="be"))
        await b.close()   # sandboxes keep running for adoption
        b2 = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir))
        await b2.reconcile({ls})
        assert not os.path.exists(os.path.join(parent, gone))
        assert await b2.adopt(ls, msgspec.structs.replace(SPEC, qos="ls"))
    finally:
        await _cleanup(b2 if b2 is not None else b)
        if b2 is not None:
            b.governor.remove_base()
    assert not os.path.exists(parent), "the BE cpu parent outlived the backend"


@pytest.mark.serial   # it loads both CPUs and reads what the node as a whole used
async def test_best_effort_yields_the_cpu_when_other_work_needs_it(
        tmp_path: object, images_dir: str) -> None:
    """BE suppression (dsec.edge.qos.CpuSuppressor): SCHED_IDLE alone let BE work keep a
    whole CPU while LS work queued on the other (perf sched trace in dsec.edge.qos), so
    the node caps BE sandboxes to what other work leaves. Real cgroups, real load: a
    spinning BE sandbox keeps its own cap while the node is quiet; two host spinners
    (everything not BE counts as LS) make its cap and its CPU use fall to the floor;
    once they stop, its cap comes back."""

    from dsec.edge.backends.container import DirectoryImages
    from tests.edge.container.conftest import _cleanup

    backend = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                               images=DirectoryImages(images_dir), be_cpu_threshold="0.65")
    try:
        await _suppressed(backend)
    finally:
        await _cleanup(backend)


async def _suppressed(backend: ContainerBackend) -> None:
    import subprocess
    import sys

    gov = backend.governor
    if gov.version != 1 or not gov.layout.be_cpu:
        pytest.skip("BE suppression caps through the v1 BE parent's sandboxes")
    sid = new_sid()
    await backend.create(sid, msgspec.structs.replace(SPEC, qos="be", cpu_milli=1000))
    await backend.exec(sid, ExecRequest(shell="while :; do :; done", background=True))
    d = backend.box(sid).cg.dirs["cpu"]

    def cap() -> float:      # cores the sandbox may use: quota / period
        return int(_read(os.path.join(d, "cpu.cfs_quota_us"))) / int(
            _read(os.path.join(d, "cpu.cfs_period_us")))

    async def until(ok: object, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ok():  # type: ignore[operator]
                return True
            await asyncio.sleep(0.05)
        return False

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])  # noqa: ASYNC220
            for _ in range(2)]
    try:
        assert await until(lambda: cap() <= 0.1, 5.0), cap()
        await asyncio.sleep(0.3)
        c0 = (await backend.stats(sid)).cpu_seconds
        await asyncio.sleep(1.0)
        used = (await backend.stats(sid)).cpu_seconds - c0
        assert used < 0.15, used          # was ~1 core of the two before the cap
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    # the node is quiet again: the estimate halves each quarter second, the cap follows
    assert await until(lambda: cap() >= 0.5, 5.0), cap()


async def test_be_suppression_is_on_by_default_can_be_off_and_refuses_a_bad_threshold(
        tmp_path: object, images_dir: str) -> None:
    from dsec.edge.backends.container import DirectoryImages
    from dsec.errors import InvalidArgument

    on = ContainerBackend(root_dir=os.path.join(str(tmp_path), "on"),
                          images=DirectoryImages(images_dir))
    try:
        assert (on._suppress is not None) == bool(on.governor.layout.be_cpu)
        if on._suppress is not None:
            assert on._suppress.policy.threshold == 0.65
    finally:
        await on.close()
    for i, off in enumerate(("0", None)):
        b = ContainerBackend(root_dir=os.path.join(str(tmp_path), f"off{i}"),
                             images=DirectoryImages(images_dir), be_cpu_threshold=off)
        try:
            assert b._suppress is None
        finally:
            await b.close()
    for bad, says in (("lots", "is not a number"), ("1.5", r"must be in \(0, 1\]")):
        with pytest.raises(InvalidArgument, match=says):
            ContainerBackend(root_dir=os.path.join(str(tmp_path), "bad"),
                             images=DirectoryImages(images_dir), be_cpu_threshold=bad)
        assert not os.path.exists(os.path.join(str(tmp_path), "bad"))   # nothing made


async def test_a_scaled_cap_takes_the_period_it_can_fill(backend: ContainerBackend) -> None:
    """``Governor.set_cpu_quota``: the suppressor's 10 ms period where the share gives
    at least the kernel's 1 ms quota in it, else 100 ms, else 1 s (down to 0.001 core:
    red team 24 B1); what is written is what the kernel holds."""
    gov = backend.governor
    sid = new_sid()
    await backend.create(sid, msgspec.structs.replace(SPEC, qos="be", cpu_milli=1000))
    cg = backend.box(sid).cg
    d = cg.dirs["unified"] if gov.version == 2 else cg.dirs["cpu"]

    def held() -> tuple[int, int]:
        if gov.version == 2:
            q, p = _read(os.path.join(d, "cpu.max")).split()
            return int(q), int(p)
        return (int(_read(os.path.join(d, "cpu.cfs_quota_us"))),
                int(_read(os.path.join(d, "cpu.cfs_period_us"))))

    for cores, want in ((0.3, (3000, 10_000)), (0.05, (5000, 100_000)),
                        (0.002, (2000, 1_000_000)), (1.0, (100_000, 100_000))):
        period = 100_000 if cores == 1.0 else 10_000
        assert gov.set_cpu_quota(cg, cores, period_us=period) == want
        assert held() == want, cores
