"""The fncall backend with real worker processes, jailed (the default, needs root) and
unjailed (``isolate=False``, the benchmark's baseline). The red-team tests of the jail
are in tests/security/test_fncall_jail.py."""

from __future__ import annotations

import asyncio
import operator
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from typing import Any

import pytest

from dsec.edge.backends.fncall import FncallBackend, WorkerPool
from dsec.edge.backends.fncall_jail import (
    JailConfig,
    python_runtime,
    root_plan,
    split_profile,
    worker_mounts,
)
from dsec.errors import InvalidArgument
from dsec.net.seccomp import profile_rules
from dsec.wire.spec import ExecRequest, NetworkPolicy, SandboxSpec

from .conftest import make_node

SID = "sb-00000000000a-n1"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the jail needs root (CI runs as root)")


@pytest.fixture(params=[pytest.param(True, id="jailed", marks=needs_root),
                        pytest.param(False, id="unjailed")])
async def fn(request: pytest.FixtureRequest) -> AsyncIterator[FncallBackend]:
    b = FncallBackend(pool_size=2, isolate=request.param)
    await b.create(SID, SandboxSpec(backend="fncall", env={"GREETING": "hi"}))  # type: ignore[arg-type]
    await b.pool.wait_ready()
    try:
        yield b
    finally:
        await b.close()
        assert not os.path.exists(b.root)


async def test_calls_run_code_and_functions_without_leaking_state(fn: FncallBackend) -> None:
    r = await fn.exec(SID, ExecRequest(shell="import os\nX = 41\nprint(os.environ['GREETING'])\n"
                                               "open('f.txt', 'w').write('kept')\nX + 1"))
    assert (r.exit_code, r.stdout) == (0, b"hi\n42\n")
    r = await fn.exec(SID, ExecRequest(shell="print(globals().get('X'))\nprint(open('f.txt').read())"))
    assert r.stdout == b"None\nkept\n"  # process state gone, files kept
    await fn.pool.wait_ready()  # two calls used both warm workers; let the refill catch up
    res = await fn.call(SID, operator.mul, 6, 7)  # type: ignore[arg-type]
    assert res.value == 42 and res.exit_code == 0 and not res.cold
    assert fn.pool.hits >= 3 and fn.pool.misses == 0
    r = await fn.exec(SID, ExecRequest(argv=("python3", "-c", "import sys; sys.exit(4)")))
    assert r.exit_code == 4
    r = await fn.exec(SID, ExecRequest(shell="raise KeyError('k')"))
    assert r.exit_code == 1 and r.stderr.endswith(b"KeyError: 'k'\n") and b"fncall_worker" not in r.stderr
    r = await fn.exec(SID, ExecRequest(shell="print('x' * 100)", output_cap_bytes=10))
    assert r.stdout == b"x" * 10 and r.stdout_truncated


def _host_pids_running(marker: str) -> list[int]:
    """Host pids whose command line contains ``marker`` (zombies excluded)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmd and state != "Z":
            out.append(int(name))
    return out


async def test_timeout_kills_the_whole_process_group(fn: FncallBackend) -> None:
    """A timed-out call returns once every process it started is gone, including a
    child in its own session (setsid) that the old process-group kill missed."""
    marker = f"60.{os.getpid()}{id(fn) % 10**6}"
    code = ("import subprocess, time, os\n"
            f"p = subprocess.Popen(['sleep', '{marker}'])\n"
            + (f"q = subprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n"
               if fn.isolate else "")  # unjailed: a new session escapes the group kill
            + "open('started', 'w').write('yes')\n"
            "time.sleep(60)")
    r = await fn.exec(SID, ExecRequest(shell=code, timeout_s=1.0))
    assert r.timed_out and r.exit_code == 137
    assert await fn.read_file(SID, "started") == b"yes"  # the children did start
    for _ in range(0 if fn.isolate else 100):  # unjailed: the group kill is asynchronous
        if not _host_pids_running(marker):
            break
        await asyncio.sleep(0.02)
    assert _host_pids_running(marker) == []
    cg = fn._boxes[SID].cg
    if cg is not None:
        assert fn.governor.pids(cg) == []


@pytest.mark.parametrize("zygote", [True, False])
async def test_empty_pool_cold_starts_and_counts_it(zygote: bool) -> None:
    pool = WorkerPool(pool_size=0, zygote=zygote)
    try:
        res = await pool.run({"code": "1"}, 30)
        assert res.cold and res.value == 1 and pool.misses == 1 and pool.hit_rate == 0.0
    finally:
        await pool.close()


async def test_pool_survives_its_zygote_dying() -> None:
    pool = WorkerPool(pool_size=1)
    try:
        await pool.wait_ready()
        z = pool._zygote
        assert z is not None
        z.proc.kill()
        await z.proc.wait()
        for _ in range(3):  # the warm worker, then workers from a restarted zygote
            assert (await pool.run({"code": "2 * 21"}, 30)).value == 42
        assert pool._zygote is not None and pool._zygote.proc.returncode is None
    finally:
        await pool.close()


@needs_root
async def test_a_jailed_pool_survives_its_zygote_dying() -> None:
    """The warm workers die with their zygote (PR_SET_PDEATHSIG); the pool notices, starts
    a new zygote and serves on."""
    b = FncallBackend(pool_size=2)
    try:
        await b.create(SID, SandboxSpec(backend="fncall"))  # type: ignore[arg-type]
        await b.pool.wait_ready()
        z = b.pool._zygote
        assert z is not None
        z.proc.kill()
        await z.proc.wait()
        for _ in range(3):
            r = await b.exec(SID, ExecRequest(shell="import sys; sys.path"))  # type: ignore[arg-type]
            assert r.exit_code == 0, r
            assert b"/src" not in r.stdout, r.stdout  # no host source dir on the jail's path
        assert b.pool._zygote is not None and b.pool._zygote.proc.returncode is None
    finally:
        await b.close()


async def test_paths_cannot_escape_and_argv_must_be_python(fn: FncallBackend) -> None:
    with pytest.raises(InvalidArgument, match="leaves"):
        os.symlink("/etc", os.path.join(fn.work_dir(SID), "etc"))
        await fn.read_file(SID, "/etc/passwd")
    with pytest.raises(InvalidArgument, match="runs Python code"):
        await fn.exec(SID, ExecRequest(argv=("ls", "-l")))
    await fn.write_file(SID, "/../../a.txt", b"x")  # clamps to the work dir root
    assert await fn.read_file(SID, "a.txt") == b"x"


async def test_edge_node_over_fncall_cleans_up() -> None:
    backend = FncallBackend(pool_size=1)
    async with make_node(backend) as node:
        info = await node.create(SandboxSpec(backend="fncall"))
        r = await node.exec(info.id, ExecRequest(shell="sum(range(10))"))
        assert r.stdout == b"45\n"
        await node.pause(info.id)
        r = await node.exec(info.id, ExecRequest(shell="'resumed'"))
        assert r.stdout == b"'resumed'\n"
        await node.destroy(info.id)
        assert not os.path.exists(backend.work_dir(info.id))


# ------------------------------------------------------------------ the jail's plans (pure)
def test_python_runtime_is_minimal_and_never_a_host_tree() -> None:
    assert python_runtime("/opt/venv", "/usr", ["/opt/venv/lib/python3.11/site-packages",
                                                 "/usr/lib/python3/dist-packages"]) == \
        ("/usr", "/opt/venv")
    assert python_runtime("/work/x/.venv", "/root/.pyenv/versions/3.11.7") == \
        ("/usr", "/work/x/.venv", "/root/.pyenv/versions/3.11.7")
    for bad in ("/root", "/", "/home", "/var", "/tmp"):
        with pytest.raises(ValueError, match="expose the host"):
            python_runtime(bad, "/usr")


def test_the_root_plan_holds_only_the_runtime_and_synthetic_files() -> None:
    cfg = JailConfig(uid=65534, runtime=("/usr", "/opt/py"), mountpoint="/x")
    steps = root_plan(cfg, {"bin": "usr/bin", "lib": "usr/lib"}, ["/etc/ld.so.cache"])
    binds = sorted(s.source for s in steps if s.kind == "bind")
    assert binds == ["/etc/ld.so.cache", "/opt/py", "/usr"]
    written = {s.path: s.data for s in steps if s.kind == "write"}
    assert sorted(written) == ["/etc/group", "/etc/hosts", "/etc/nsswitch.conf", "/etc/passwd"]
    assert b"nobody:x:65534:65534" in written["/etc/passwd"]
    dirs = [s.path for s in steps if s.kind == "dir"]
    assert dirs.index("/opt") < dirs.index("/opt/py")  # parents first
    assert {"/proc", "/tmp", "/dev/shm", "/workspace"} <= set(dirs)
    devs = {s.path for s in steps if s.kind == "dev"}
    assert devs == {"/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom",
                    "/dev/tty"}


def test_the_seccomp_profile_is_split_without_losing_a_rule() -> None:
    rules = profile_rules(allow_nested=False)
    pre, admit = split_profile(rules)
    assert sorted(map(repr, pre + admit)) == sorted(map(repr, rules))
    assert {r.syscall for r in admit} == {"unshare", "move_mount"}


def test_worker_mounts_mask_proc_like_a_container() -> None:
    ms = worker_mounts(JailConfig())
    assert (ms[0].target, ms[0].fstype) == ("/proc", "proc")
    masked = {m.target for m in ms if m.source == "/dev/null"}
    assert {"/proc/kcore", "/proc/keys", "/proc/timer_list"} <= masked
    ro = {m.target for m in ms if m.source is None}
    assert {"/proc/sys", "/proc/sysrq-trigger"} <= ro
    # private /tmp, /dev/shm and /etc (admission names the sandbox's own uid in it; a
    # root jail keeps the root's read-only /etc)
    assert [m.target for m in ms if m.fstype == "tmpfs"] == ["/tmp", "/dev/shm", "/etc"]
    assert [m.target for m in worker_mounts(JailConfig(uid=0))
            if m.fstype == "tmpfs"] == ["/tmp", "/dev/shm"]


# ------------------------------------------------------------- lifecycle, leaks, restarts
def _mounts(under: str) -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {p for p in (line.split()[4] for line in f) if p.startswith(under)}


async def _destroy_all(b: FncallBackend) -> None:
    """A given root keeps sandboxes for adoption at close(); a failed test must not."""
    for sid in list(b._boxes):
        await b.destroy(sid)  # type: ignore[arg-type]


def _cgroups(b: FncallBackend) -> list[str]:
    return b.governor.list_sandboxes() if b.governor is not None else []


@needs_root
async def test_failures_and_destroys_leave_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Bad specs, timeouts, OOM kills, a destroy while a call runs: afterwards no mount,
    cgroup, process, fd or directory of any sandbox is left."""
    b = FncallBackend(pool_size=2, root=str(tmp_path / "root"))
    try:
        b.pool.start()
        await b.pool.wait_ready()
        fds = len(os.listdir("/proc/self/fd"))  # with a full pool
        for i in range(6):
            sid = f"sb-{i:012x}-n1"
            with pytest.raises(InvalidArgument, match="loopback"):
                await b.create(sid, SandboxSpec(backend="fncall",  # type: ignore[arg-type]
                                                network=NetworkPolicy(mode="allowlist")))
            await b.create(sid, SandboxSpec(backend="fncall", memory_bytes=48 << 20))  # type: ignore[arg-type]
            r = await b.exec(sid, ExecRequest(shell="import time; time.sleep(30)", timeout_s=0.3))  # type: ignore[arg-type]
            assert r.timed_out
            r = await b.exec(sid, ExecRequest(shell="x = bytearray(200 << 20)", timeout_s=30))  # type: ignore[arg-type]
            assert r.exit_code == 137 and b"OOM" in r.stderr, r
            running = asyncio.ensure_future(b.exec(sid, ExecRequest(  # type: ignore[arg-type]
                shell="import subprocess, time; subprocess.Popen(['sleep', '30']); time.sleep(30)")))
            await asyncio.sleep(0.3)
            await b.destroy(sid)  # type: ignore[arg-type]
            r = await asyncio.wait_for(running, 10)
            assert r.exit_code != 0
        assert _mounts(str(tmp_path)) == {b.disk.path}  # the disk pool, nothing per sandbox
        assert _cgroups(b) == []
        assert b.disk.sandboxes() == []
        await b.pool.wait_ready()
        assert len(os.listdir("/proc/self/fd")) == fds
    finally:
        await _destroy_all(b)
        await b.close()
    assert b.governor is not None and not any(os.path.exists(d)
                                              for d in b.governor.layout.bases.values())


@needs_root
async def test_a_restarted_edge_adopts_work_dirs_and_limits(tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = str(tmp_path / "root")
    b = FncallBackend(pool_size=1, root=root)
    try:
        await b.create(SID, SandboxSpec(backend="fncall", memory_bytes=48 << 20))  # type: ignore[arg-type]
        await b.write_file(SID, "/kept.txt", b"still here")  # type: ignore[arg-type]
    except BaseException:
        await _destroy_all(b)
        raise
    finally:
        await b.close()  # a given root: the sandbox stays for the next edge
    b = FncallBackend(pool_size=1, root=root)
    try:
        assert await b.adopt(SID, SandboxSpec(backend="fncall", memory_bytes=48 << 20))  # type: ignore[arg-type]
        assert not await b.adopt("sb-00000000000b-n1", SandboxSpec(backend="fncall"))  # type: ignore[arg-type]
        r = await b.exec(SID, ExecRequest(shell="print(open('kept.txt').read())\n"  # type: ignore[arg-type]
                                                "bytearray(100 << 20)"))
        assert r.exit_code == 137, r  # the memory limit came back with the sandbox
        assert (await b.exec(SID, ExecRequest(shell="open('kept.txt').read()"))).stdout == \
            b"'still here'\n"  # type: ignore[arg-type]
        await b.destroy(SID)  # type: ignore[arg-type]
        assert not os.path.exists(b.work_dir(SID)) and _cgroups(b) == []
    finally:
        await _destroy_all(b)
        await b.close()


KILLED_EDGE = """
import asyncio, sys
from dsec.edge.backends.fncall import FncallBackend
from dsec.wire.spec import ExecRequest, NetworkPolicy, SandboxSpec
async def main():
    b = FncallBackend(pool_size=2, root=sys.argv[1])
    await b.create("sb-00000000000c-n1", SandboxSpec(backend="fncall"))
    print("ready", flush=True)
    code = open(sys.argv[2]).read()  # not in our argv: the test looks for the marker
    await b.exec("sb-00000000000c-n1", ExecRequest(shell=code, timeout_s=600))
asyncio.run(main())
"""


@needs_root
async def test_an_edge_killed_mid_call_leaves_no_call_running(tmp_path) -> None:  # type: ignore[no-untyped-def]
    marker = f"91.{os.getpid()}"
    code = textwrap.dedent(f"""
    import subprocess, time
    subprocess.Popen(['sleep', '{marker}'], start_new_session=True)
    while True:
        time.sleep(1)
    """)
    root = str(tmp_path / "root")
    (tmp_path / "code.py").write_text(code)
    edge = subprocess.Popen([sys.executable, "-c", KILLED_EDGE, root, str(tmp_path / "code.py")],  # noqa: ASYNC220 - a child we kill -9
                            stdout=subprocess.PIPE, env={**os.environ,
                                                         "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert edge.stdout is not None
        assert edge.stdout.readline().strip() == b"ready"
        for _ in range(200):
            if _host_pids_running(marker):
                break
            await asyncio.sleep(0.05)
        assert _host_pids_running(marker), "the call never started"
        edge.send_signal(signal.SIGKILL)
        edge.wait()
        for _ in range(200):
            if not _host_pids_running(marker):
                break
            await asyncio.sleep(0.05)
        assert _host_pids_running(marker) == [], "a call outlived its edge"
    finally:
        edge.kill()
        edge.wait()
        b = FncallBackend(pool_size=0, root=root)  # the next edge cleans up what is left
        await b.adopt("sb-00000000000c-n1", SandboxSpec(backend="fncall"))  # type: ignore[arg-type]
        await b.destroy("sb-00000000000c-n1")  # type: ignore[arg-type]
        await b.close()


@needs_root
async def test_reconcile_removes_unknown_sandboxes_with_their_processes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """What a dead edge left (a work dir subvolume, a cgroup with a process in it) is
    found through the disk pool and the cgroups, killed, removed and reported."""
    root = str(tmp_path / "root")
    a = FncallBackend(pool_size=0, root=root)
    keep, gone = "sb-00000000000d-n1", "sb-00000000000e-n1"
    stray = None
    try:
        for sid in (keep, gone):
            await a.create(sid, SandboxSpec(backend="fncall"))  # type: ignore[arg-type]
        assert a.governor is not None
        stray = subprocess.Popen(["sleep", "300"])  # noqa: ASYNC220 - stands in for a runaway call
        for procs in a.governor.paths(gone).procs_files:
            with open(procs, "w") as f:  # noqa: ASYNC230
                f.write(str(stray.pid))
        await a.close()  # a given root: both stay, as after a crash
        b = FncallBackend(pool_size=0, root=root)
        try:
            assert await b.adopt(keep, SandboxSpec(backend="fncall"))  # type: ignore[arg-type]
            left = await b.reconcile({keep})
            assert [(x.sandbox_id, x.backend) for x in left] == [(gone, "fncall")]
            assert "work directory" in left[0].what and "1 runaway process(es)" in left[0].what
            assert stray.wait(10) == -signal.SIGKILL
            assert not os.path.exists(b.work_dir(gone)) and _cgroups(b) == [keep]
            assert await b.discard(gone) is None  # nothing left of it
        finally:
            await _destroy_all(b)
            await b.close()
    finally:
        if stray is not None and stray.poll() is None:
            stray.kill()
            stray.wait()


@needs_root
async def test_a_best_effort_sandbox_gets_the_idle_cgroup() -> None:
    """Issue 22: the fncall backend applies a class's cgroup side like the container one
    (BE: lowest weight + cpu.idle, soft limit 0; LS keeps the request's weight)."""
    fn = FncallBackend(pool_size=1, isolate=True)
    be, ls = "sb-00000000000b-n1", "sb-00000000000c-n1"
    try:
        await fn.create(be, SandboxSpec(backend="fncall", qos="be"))  # type: ignore[arg-type]
        await fn.create(ls, SandboxSpec(backend="fncall"))  # type: ignore[arg-type]
        cg, ls_cg = fn._boxes[be].cg, fn._boxes[ls].cg
        assert cg is not None and ls_cg is not None

        def read(c: object, ctrl: str, f: str) -> str:
            with open(os.path.join(c.dirs[ctrl], f)) as fh:  # type: ignore[attr-defined]
                return fh.read().strip()
        if cg.version == 1:
            assert read(cg, "cpu", "cpu.shares") in ("2", "3")   # 3: the kernel's idle weight
            assert read(ls_cg, "cpu", "cpu.shares") == "1024"
            assert read(cg, "memory", "memory.soft_limit_in_bytes") == "0"
            if os.path.exists(os.path.join(cg.dirs["cpu"], "cpu.idle")):
                assert read(cg, "cpu", "cpu.idle") == "1"
                assert read(ls_cg, "cpu", "cpu.idle") == "0"
        else:
            assert read(cg, "unified", "cpu.weight") == "1"
    finally:
        await fn.close()


@needs_root
async def test_a_jailed_call_does_not_inherit_the_edges_raised_nofile() -> None:
    """Red team 19, B5: user code in a jailed call gets RLIMIT_NOFILE = SANDBOX_NOFILE
    (soft = hard), not the edge's raised limit, and cannot raise it."""
    import resource

    from dsec.edge.backends.container.linux import SANDBOX_NOFILE
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    big = max(before[1], 8 * SANDBOX_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (big, big))
    b = FncallBackend(pool_size=1)
    try:
        await b.create(SID, SandboxSpec(backend="fncall"))  # type: ignore[arg-type]
        r = await b.exec(SID, ExecRequest(  # type: ignore[arg-type]
            shell="import resource; resource.getrlimit(resource.RLIMIT_NOFILE)"))
        assert r.stdout == f"({SANDBOX_NOFILE}, {SANDBOX_NOFILE})\n".encode(), r
        r = await b.exec(SID, ExecRequest(  # type: ignore[arg-type]
            shell=f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, "
                  f"({SANDBOX_NOFILE}, {4 * SANDBOX_NOFILE}))"))
        assert r.exit_code != 0 and b"ValueError" in r.stderr + r.stdout, r
    finally:
        await b.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


async def test_destroying_a_full_work_dir_does_not_stall_the_loop(
        fn: FncallBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The work dir is the tenant's to fill; its removal ran on the event loop, so a
    sandbox with many files held every other sandbox's requests for the whole rmtree
    (on this VM's ext4 a million files take minutes). It runs in a thread now. The
    removal is made slow here (the real one, then 0.5 s: a tenant's million files
    without the minutes of making them); the loop must keep ticking meanwhile."""
    import time

    from dsec.edge.backends import fncall as mod

    def slow(real: Any) -> Any:
        def wrapped(*a: Any, **kw: Any) -> Any:
            out = real(*a, **kw)
            time.sleep(0.5)
            return out
        return wrapped

    monkeypatch.setattr(mod, "remove_tree", slow(mod.remove_tree))
    if fn.disk is not None:          # jailed: the work dir is a subvolume of the pool
        monkeypatch.setattr(fn.disk, "remove", slow(fn.disk.remove))
    d = fn.work_dir(SID)
    loop = asyncio.get_running_loop()
    gaps: list[float] = []
    done = False

    async def tick() -> None:
        last = loop.time()
        while not done:
            await asyncio.sleep(0.01)
            now = loop.time()
            gaps.append(now - last)
            last = now

    ticker = asyncio.ensure_future(tick())
    await asyncio.sleep(0.05)
    t0 = loop.time()
    await fn.destroy(SID)
    took = loop.time() - t0
    done = True
    await ticker
    assert not os.path.exists(d)
    assert took >= 0.5, took                      # the slow removal did run
    assert max(gaps) < 0.25, (max(gaps), took)    # and the loop ticked through it


async def test_a_cancelled_destroy_or_pause_still_reaches_its_final_state(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Red team 23b B3: a destroy whose caller was cancelled (client hung up) during
    the threaded teardown left the sandbox ``destroying`` for good - every later
    destroy refused by the state table, its reservation held. The node now runs a
    begun destroy/pause/resume to its end whatever happens to the caller."""
    import time

    from dsec.edge.backends import fncall as mod

    real_remove = mod.remove_tree

    def slow_remove(*a: Any, **kw: Any) -> Any:
        time.sleep(0.4)
        return real_remove(*a, **kw)

    backend = FncallBackend(pool_size=1, isolate=False)
    monkeypatch.setattr(mod, "remove_tree", slow_remove)
    async with make_node(backend) as node:
        info = await node.create(SandboxSpec(backend="fncall"))
        real_pause = backend.pause

        async def slow_pause(sid: Any) -> Any:
            await asyncio.sleep(0.3)
            return await real_pause(sid)

        monkeypatch.setattr(backend, "pause", slow_pause)
        t = asyncio.ensure_future(node.pause(info.id))
        await asyncio.sleep(0.1)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        for _ in range(100):
            if node.get(info.id).state == "paused":
                break
            await asyncio.sleep(0.02)
        assert node.get(info.id).state == "paused"
        await node.resume(info.id)                    # not refused as "pausing"

        d = backend.work_dir(info.id)
        t = asyncio.ensure_future(node.destroy(info.id))
        await asyncio.sleep(0.1)                       # inside the slow teardown
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        for _ in range(100):
            if node.get(info.id).state == "destroyed":
                break
            await asyncio.sleep(0.02)
        final = node.get(info.id)
        assert final.state == "destroyed", final
        assert not os.path.exists(d)
        assert info.id not in node.pool.held


@pytest.mark.parametrize("isolate", [pytest.param(True, id="jailed", marks=needs_root),
                                     pytest.param(False, id="unjailed")])
async def test_a_call_inherits_no_blocked_signal_from_the_edge(isolate: bool) -> None:
    """A blocked signal mask survives fork and execve (``subprocess`` leaves it as it
    is): an edge started by a supervisor with SIGTERM and SIGINT blocked handed that
    mask to the zygote and so to every call - a call that cannot be stopped politely.
    The zygote clears it (the container path's nsexec already did)."""
    blocked = {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        b = FncallBackend(pool_size=1, isolate=isolate)
        await b.create(SID, SandboxSpec(backend="fncall"))  # type: ignore[arg-type]
        await b.pool.wait_ready()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    try:
        r = await b.exec(SID, ExecRequest(shell=(
            "[ln.split()[1] for ln in open('/proc/self/status') "
            "if ln.startswith('SigBlk')][0]")))
        assert r.exit_code == 0, r
        assert r.stdout.strip() == b"'" + b"0" * 16 + b"'", r.stdout
    finally:
        await b.close()


@needs_root
async def test_reconcile_claims_the_cgroup_name_back_from_a_dead_claimer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """As the container and vm tiers' tests of the same name: the backend reconciling
    its root re-claims its cgroup name from a dead claimer, so another edge's start
    does not sweep this one's empty cgroups (census.idle_names)."""
    from dsec.edge.backends.container.census import NAMES_DIR, _binding, process_identity

    b = FncallBackend(pool_size=1, root=str(tmp_path / "root"))
    try:
        assert b.governor is not None
        name = b.governor.name
        with open(os.path.join(NAMES_DIR, name), "w") as f:  # noqa: ASYNC230
            f.write(f"{b.root}\n999999 1\n")
        assert _binding(NAMES_DIR, name) == (b.root, "999999 1")
        await b.reconcile(set())
        assert _binding(NAMES_DIR, name) == (b.root, process_identity(os.getpid()))
    finally:
        await b.close()


@needs_root
async def test_discard_removes_a_partial_cgroup_set(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A create or teardown cut off between hierarchies leaves some of a sandbox's
    cgroup dirs: discard acted only when all were there (``exists``), so the rest stayed
    for good. Any one present is now removed (``present``)."""
    b = FncallBackend(pool_size=1, root=str(tmp_path / "root"))
    try:
        assert b.governor is not None
        cg = b.governor.paths("sb-partial")
        one = next(iter(cg.dirs.values()))
        os.mkdir(one)
        left = await b.discard("sb-partial")  # type: ignore[arg-type]
        assert left is not None and "cgroup" in left.what
        assert not os.path.exists(one)
    finally:
        await b.close()
