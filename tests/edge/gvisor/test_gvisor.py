"""What is particular to the gvisor tier (runsc.py): the platform probe, the bundle
config, the host file API against the Sentry's view, timeouts killing from inside,
pause by freezer, snapshots of the same upper dir, OOM stopping the sandbox (an event),
background waiters charged to the sandbox, adoption after an edge restart."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec.edge.admission import Capacity
from dsec.edge.backends import make_backend
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.backends.container import runsc as runsc_mod
from dsec.edge.backends.container.images import StoreImages
from dsec.edge.backends.container.oci import oci_config
from dsec.edge.backends.container.runsc import (
    BUSYBOX_IN,
    HELPERS_IN,
    choose_platform,
    listed_platforms,
    probe_platform,
    runsc_config,
)
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.errors import DsecError, InvalidArgument
from dsec.image import LayerStore, MountCache, ensure_busybox_base
from dsec.wire.spec import ExecRequest, SandboxSpec
from tests.edge.container.conftest import SPEC, _cleanup, new_sid
from tests.edge.container.test_snapshot import Env
from tests.edge.container.test_snapshot import test_chain_restores_exact_trees as _chain

from .conftest import _rmdir_everywhere, runsc_missing

# -- pure parts --------------------------------------------------------------------------


def test_platforms_are_parsed_and_chosen_fastest_first() -> None:
    assert listed_platforms("kvm\nptrace\n") == ["kvm", "ptrace"]
    assert listed_platforms("  ptrace \nsome words here\n\nsystrap") == ["ptrace", "systrap"]
    tried: list[str] = []

    def works(p: str) -> bool:
        tried.append(p)
        return p == "ptrace"
    assert choose_platform(["ptrace", "kvm"], works) == "ptrace"
    assert tried == ["kvm", "ptrace"]      # kvm is faster, so tried first
    assert choose_platform(["systrap", "ptrace"], lambda p: True) == "systrap"
    assert choose_platform(["kvm"], lambda p: False) is None
    assert choose_platform(["magic"], lambda p: True) is None  # unknown names never


def test_bundle_config_puts_tmp_on_the_disk_and_busybox_read_only() -> None:
    base = oci_config(spec=SandboxSpec(backend="gvisor"), hostname="h", cgroups_path="x/y",
                      init_path="/usr/bin/catatonit")
    assert any(m["destination"] == "/tmp" and m["type"] == "tmpfs" for m in base["mounts"])
    cfg = runsc_config(base, tmp_dir="/b/root/tmp", helpers="/s/runsc-helpers/x")
    mounts = {m["destination"]: m for m in cfg["mounts"]}  # type: ignore[attr-defined]
    assert mounts["/tmp"]["type"] == "bind" and mounts["/tmp"]["source"] == "/b/root/tmp"
    # one read-only directory mount, the helpers' directory itself (red team 21, A1:
    # files bound into a Sentry directory could have their parent renamed away)
    assert mounts[HELPERS_IN]["options"][:2] == ["bind", "ro"]
    assert mounts[HELPERS_IN]["source"] == "/s/runsc-helpers/x"
    assert not [d for d in mounts if d.startswith(HELPERS_IN + "/")]
    assert os.path.dirname(BUSYBOX_IN) == HELPERS_IN
    assert os.path.basename(BUSYBOX_IN) == "busybox"  # busybox dispatches on its name
    assert base["mounts"] != cfg["mounts"]  # a new dict: the input is not changed
    no_tmp = runsc_config(base, tmp_dir=None)
    assert "/tmp" not in {m["destination"] for m in no_tmp["mounts"]}  # type: ignore[attr-defined]


def test_platform_probe_runs_once_per_node_and_again_on_a_new_version(tmp_path: Path) -> None:
    """A stand-in runsc (a script) that logs each call: kvm hangs, ptrace works."""
    log = tmp_path / "calls"
    fake = tmp_path / "runsc"
    fake.write_text(f"""#!/bin/sh
echo "$*" >> {log}
case "$*" in
  --version) cat {tmp_path}/version;;
  "help platforms") printf 'kvm\\nptrace\\n';;
  *platform=kvm*) sleep 30;;
  *platform=ptrace*) exit 0;;
esac
""")
    fake.chmod(0o755)
    (tmp_path / "version").write_text("runsc version 1\n")
    cache = str(tmp_path / "cache")
    runsc_mod._PROBED.clear()
    assert probe_platform(str(fake), cache, timeout_s=0.5) == "ptrace"
    dos = [ln for ln in log.read_text().splitlines() if ln.endswith("do /bin/true")]
    assert len(dos) in (1, 2)  # kvm only where /dev/kvm is usable
    rec = json.loads((tmp_path / "cache" / "runsc-platform.json").read_text())
    assert rec["platform"] == "ptrace" and "runsc version 1" in rec["key"]
    runsc_mod._PROBED.clear()       # a new process: the file answers, no probe
    assert probe_platform(str(fake), cache, timeout_s=0.5) == "ptrace"
    assert sum(ln.endswith("do /bin/true") for ln in log.read_text().splitlines()) == len(dos)
    (tmp_path / "version").write_text("runsc version 2\n")
    runsc_mod._PROBED.clear()       # an upgraded runsc is probed again
    assert probe_platform(str(fake), cache, timeout_s=0.5) == "ptrace"
    assert sum(ln.endswith("do /bin/true") for ln in log.read_text().splitlines()) > len(dos)
    runsc_mod._PROBED.clear()


def test_a_probe_killed_on_its_timeout_leaves_no_cgroup(tmp_path: Path) -> None:
    """``runsc do`` makes a ``runsc-<n>`` cgroup in every hierarchy and removes it only
    when it exits on its own: a platform probe killed on its timeout left one in each
    (36 on the dev VM after a day of runs, each empty memory cgroup ~300 KiB of kernel
    memory). The probe runs with ``--ignore-cgroups``: the real runsc, killed while it
    still runs, leaves none."""
    why = runsc_missing()
    if why:
        pytest.skip(why)
    import shutil

    def runsc_cgroups() -> set[str]:
        out = set()
        for h in os.listdir("/sys/fs/cgroup"):
            with contextlib.suppress(OSError):
                out |= {f"{h}/{n}" for n in os.listdir(f"/sys/fs/cgroup/{h}")
                        if n.startswith("runsc-")}
        return out

    binary = shutil.which("runsc")
    assert binary is not None
    before = runsc_cgroups()
    # killed at several points of its ~0.25 s run: one of them lands after runsc made
    # its cgroups (the old probe left one in every hierarchy at most of these)
    for i, t in enumerate((0.05, 0.08, 0.1, 0.12, 0.15, 0.18, 0.2, 0.22)):
        state = str(tmp_path / f"state{i}")
        os.mkdir(state)
        runsc_mod._probe_one(binary, state, "ptrace", t)
    assert runsc_cgroups() - before == set()


def test_unknown_platform_and_runtime_are_refused(tmp_path: Path) -> None:
    why = runsc_missing()
    if why:
        pytest.skip(why)
    with pytest.raises(InvalidArgument, match="platform 'warp' is unknown"):
        make_backend("gvisor", root_dir=str(tmp_path / "r"), images_dir=str(tmp_path),
                     platform="warp")
    with pytest.raises(InvalidArgument, match="runs runtime 'runsc'"):
        make_backend("gvisor", root_dir=str(tmp_path / "r"), images_dir=str(tmp_path),
                     runtime="runc")


# -- a running gVisor sandbox ----------------------------------------------------------------

pytestmark = pytest.mark.root


async def sh(b: ContainerBackend, sid: str, cmd: str, timeout_s: float = 20) -> str:
    r = await b.exec(sid, ExecRequest(shell=cmd, timeout_s=timeout_s))
    assert r.exit_code == 0, (cmd, r)
    return r.stdout.decode()


async def test_it_is_gvisor(backend: ContainerBackend) -> None:
    assert backend.name == "gvisor" and backend._runsc is not None
    assert backend._runsc.platform in runsc_mod.PLATFORMS
    sid = new_sid()
    await backend.create(sid, SPEC)
    # the Sentry's kernel, not the host's
    assert (await sh(backend, sid, "uname -r")).strip() != os.uname().release
    # an exec'd process runs under the native seccomp profile (through nsexec's filter
    # mode: runsc gives it none), with no_new_privs
    out = await sh(backend, sid, "grep Seccomp: /proc/self/status; unshare -U true; echo $?")
    assert out.split()[-3:] == ["Seccomp:", "2", "1"], out
    # the host process is runsc's sandbox, in the sandbox's cgroup
    argv0 = Path(f"/proc/{backend.init_pid(sid)}/cmdline").read_bytes().split(b"\0")[0]
    assert argv0 == b"runsc-sandbox", argv0
    cg = backend.box(sid).cg
    assert backend.init_pid(sid) in backend.governor.pids(cg)
    # the limits are the host cgroup's, as for runc (pids: plus the Sentry's own threads)
    assert Path(cg.dirs["memory"], "memory.limit_in_bytes").read_text().strip() == \
        str(SPEC.memory_bytes)
    assert SPEC.pids_max is not None
    assert Path(cg.dirs["pids"], "pids.max").read_text().strip() == \
        str(SPEC.pids_max + runsc_mod.SENTRY_PIDS)


async def test_exec_takes_argv_env_cwd_user_from_a_process_file_it_removes(
        backend: ContainerBackend) -> None:
    """Red team 22, A3: ``runsc exec --process FILE`` (0600, in a 0700 dir of the state
    dir), not ``--env K=V``/argv on the command line of a host process (the detached
    waiter of a background exec lives as long as the command). The exec's env replaces
    the bundle's PATH in place (a process file's env is used as given)."""
    sid = new_sid()
    await backend.create(sid, SPEC)
    await sh(backend, sid, "mkdir -p /tmp/w")
    r = await backend.exec(sid, ExecRequest(
        shell="echo $T; pwd; id -u; id -g; echo $PATH", env={"T": "v 1", "PATH": "/bin"},
        cwd="/tmp/w", user="123:45"))
    assert (r.exit_code, r.stdout) == (0, b"v 1\n/tmp/w\n123\n45\n/bin\n"), r
    bg = await backend.exec(sid, ExecRequest(argv=("sleep", "30"), env={"T": "zq-env"},
                                             background=True))
    assert bg.exit_code == 0
    members = backend.governor.pids(backend.box(sid).cg)
    waiters = [_cmdline(str(p)) for p in members]
    assert any(c.startswith(b"runsc-exec") for c in waiters), waiters
    assert not [c for c in waiters if b"zq-env" in c or b"sleep" in c], waiters
    state = os.path.join(backend.root_dir, "runc-state")
    assert not [n for n in os.listdir(state) if n.startswith(".proc-")]


async def test_host_file_api_and_the_sentry_see_the_same_files(
        backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    await backend.write_file(sid, "/work/a.txt", b"one")
    assert await sh(backend, sid, "cat /work/a.txt") == "one"
    await backend.write_file(sid, "/work/a.txt", b"two, longer")  # cached inside? no
    assert await sh(backend, sid, "cat /work/a.txt") == "two, longer"
    await sh(backend, sid, "echo inside > /tmp/t && mkdir -p /srv/d && echo x > /srv/d/f")
    assert await backend.read_file(sid, "/tmp/t") == b"inside\n"   # /tmp is the disk
    assert [f.name for f in await backend.list_dir(sid, "/srv/d")] == ["f"]
    await backend.remove(sid, "/srv/d", recursive=True)
    assert await sh(backend, sid, "test -e /srv/d || echo gone") == "gone\n"
    await backend.rename_file(sid, "/work/a.txt", "/work/b.txt", True)
    assert await sh(backend, sid, "ls /work") == "b.txt\n"
    assert os.path.exists(os.path.join(backend.upper_dir(sid), "tmp/t"))


async def test_sentry_mounts_are_refused_by_the_file_api(backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    for call in (backend.read_file(sid, "/proc/self/status"),
                 backend.write_file(sid, "/dev/shm/x", b"x"),
                 backend.list_dir(sid, "/sys/kernel"),
                 backend.read_file(sid, "/work/../proc/1/environ"),
                 backend.remove(sid, "/dev", recursive=True)):
        with pytest.raises(InvalidArgument, match="gVisor"):
            await call
    assert await sh(backend, sid, "ls /dev/null /proc/1/status | wc -l") == "2\n"


async def test_file_escapes_stay_inside(backend: ContainerBackend, tmp_path: Path) -> None:
    secret = tmp_path / "host-secret"
    secret.write_text("HOST")
    sid = new_sid()
    await backend.create(sid, SPEC)
    await sh(backend, sid, f"mkdir -p {secret.parent} && echo SANDBOX > {secret} && "
                           "ln -s / /workspace/rootlink && ln -s /etc/passwd /workspace/pw")
    assert await backend.read_file(sid, str(secret)) == b"SANDBOX\n"
    assert (await backend.read_file(sid, "../../../../etc/passwd")).startswith(b"root:x:0:0")
    assert await backend.read_file(sid, f"/workspace/rootlink/workspace/rootlink{secret}") == b"SANDBOX\n"
    assert b"agent" in await backend.read_file(sid, "/workspace/pw")
    with pytest.raises(InvalidArgument):
        await backend.read_file(sid, f"/proc/1/root{secret}")
    await backend.write_file(sid, f"/workspace/rootlink{secret}", b"overwritten")
    assert secret.read_text() == "HOST"


async def test_timeout_kills_descendants_that_left_the_group(
        backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    r = await backend.exec(sid, ExecRequest(
        shell="setsid sleep 101 & (sleep 102 &) ; sleep 103; echo never", timeout_s=0.5))
    assert r.timed_out and r.exit_code == 137 and b"never" not in r.stdout
    left = await sh(backend, sid, "ps -o args | grep 'sleep 10[123]' | grep -v grep | wc -l")
    # setsid'd child of the shell: killed (its parent was the exec's); the subshell's
    # sleep keeps the exec's session: killed
    assert left.strip() == "0"


async def test_pause_freezes_and_resume_thaws(backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    await backend.exec(sid, ExecRequest(
        # renamed into place: a freeze between truncate and write cannot leave it empty
        shell="i=0; while true; do i=$((i+1)); echo $i > /workspace/n.t; "
              "mv /workspace/n.t /workspace/n; sleep 0.05; done",
        background=True))
    for _ in range(200):
        await asyncio.sleep(0.05)
        if backend.box(sid) and os.path.exists(os.path.join(backend.upper_dir(sid),
                                                            "workspace/n")):
            break
    stats = await backend.pause(sid)
    assert stats.resident_before_bytes > 0 and stats.reclaimed_bytes >= 0
    assert backend.governor.is_frozen(backend.box(sid).cg)
    n1 = await backend.read_file(sid, "/workspace/n")   # files work while paused
    await asyncio.sleep(0.4)
    assert await backend.read_file(sid, "/workspace/n") == n1 and int(n1) > 0
    await backend.resume(sid)
    assert not backend.governor.is_frozen(backend.box(sid).cg)
    for _ in range(200):   # it counts on (slowly on a loaded node)
        await asyncio.sleep(0.05)
        if int(await backend.read_file(sid, "/workspace/n")) > int(n1):
            break
    assert int(await backend.read_file(sid, "/workspace/n")) > int(n1)
    await backend.pause(sid)   # an exec on a paused sandbox resumes it
    assert await sh(backend, sid, "echo up") == "up\n"
    assert not backend.box(sid).paused


async def test_background_waiter_is_charged_and_destroy_leaves_nothing(
        backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    r = await backend.exec(sid, ExecRequest(argv=("sleep", "60"), background=True))
    assert r.pid is not None and r.pid > 1
    members = backend.governor.pids(backend.box(sid).cg)
    argv0s = {Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0] for p in members
              if os.path.exists(f"/proc/{p}/cmdline")}
    assert b"runsc-exec" in argv0s, argv0s   # the host waiter is the sandbox's, not the edge's
    await backend.destroy(sid)
    assert sid not in backend.census().sandboxes()
    state = os.listdir(os.path.join(backend.root_dir, "runc-state"))
    assert not [n for n in state if sid in n], state   # runsc's state files went too
    assert not [p for p in os.listdir("/proc") if p.isdigit() and sid.encode() in _cmdline(p)]


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


async def test_sandbox_is_adopted_after_an_edge_restart(tmp_path: Path,
                                                        images_dir: str) -> None:
    why = runsc_missing()
    if why:
        pytest.skip(why)
    root = str(tmp_path / "groot")
    b = make_backend("gvisor", root_dir=root, images=DirectoryImages(images_dir))
    assert isinstance(b, ContainerBackend)
    b2: ContainerBackend | None = None
    sid = new_sid()
    try:
        await b.create(sid, SPEC)
        await sh(b, sid, "echo kept > /workspace/k")
        await b.close()            # the edge goes; the sandbox keeps running
        b2 = make_backend("gvisor", root_dir=root, images=DirectoryImages(images_dir))
        assert isinstance(b2, ContainerBackend)
        assert await b2.adopt(sid, SPEC)
        assert await sh(b2, sid, "cat /workspace/k") == "kept\n"
        assert await b2.reconcile({sid}) == []
    finally:
        await _cleanup(b2 if b2 is not None else b)
        _rmdir_everywhere(f"dsec-{b.cgroup_name}")


async def test_a_killed_sentry_is_a_backend_crash_event(backend: ContainerBackend) -> None:
    """kill -9 of the Sentry from the host (a crash of gVisor itself): the sandbox is
    reported dead (``backend_crash``), its exec fails instead of hanging, destroy
    cleans up."""
    events: list[tuple[str, str]] = []
    backend.watch(lambda sid, reason, detail: events.append((sid, reason)))
    sid = new_sid()
    await backend.create(sid, SPEC)
    running = asyncio.ensure_future(backend.exec(sid, ExecRequest(argv=("sleep", "30"),
                                                                  timeout_s=60)))
    await asyncio.sleep(0.3)
    os.kill(backend.init_pid(sid), 9)
    with pytest.raises(DsecError, match="stopped"):
        await asyncio.wait_for(running, 20)
    for _ in range(100):
        if events:
            break
        await asyncio.sleep(0.05)
    assert events == [(sid, "backend_crash")]
    await backend.destroy(sid)
    assert sid not in backend.census().sandboxes()


async def test_a_fork_bomb_stops_only_its_own_sandbox(backend: ContainerBackend) -> None:
    """Past the host task limit the Sentry cannot start a process and exits: the
    sandbox stops (``backend_crash`` naming the task limit) - the node and the other
    sandboxes go on."""
    events: list[tuple[str, str, str]] = []
    backend.watch(lambda sid, reason, detail: events.append((sid, reason, detail)))
    sid, other = new_sid(), new_sid()
    await backend.create(sid, SandboxSpec(backend="container", memory_bytes=512 << 20,
                                          pids_max=64))
    await backend.create(other, SPEC)
    with pytest.raises(DsecError, match="stopped"):
        await backend.exec(sid, ExecRequest(
            shell="n=0; while [ $n -lt 400 ]; do sleep 100 & n=$((n+1)); done", timeout_s=30))
    for _ in range(100):
        if any(e[0] == sid and e[1] == "backend_crash" for e in events):
            break
        await asyncio.sleep(0.05)
    crash = [e for e in events if e[0] == sid and e[1] == "backend_crash"]
    assert crash and "task limit" in crash[0][2], events
    assert await sh(backend, other, "echo fine") == "fine\n"


async def test_a_sandbox_nobody_keeps_is_removed_at_restart(tmp_path: Path,
                                                       images_dir: str) -> None:
    """After an edge crash, reconcile removes a gvisor sandbox the node does not keep:
    its Sentry and gofer, its state files, its cgroups, its mount."""
    why = runsc_missing()
    if why:
        pytest.skip(why)
    root = str(tmp_path / "groot")
    b = make_backend("gvisor", root_dir=root, images=DirectoryImages(images_dir))
    assert isinstance(b, ContainerBackend)
    b2: ContainerBackend | None = None
    sid = new_sid()
    try:
        await b.create(sid, SPEC)
        await b.exec(sid, ExecRequest(argv=("sleep", "60"), background=True))
        await b.close()
        b2 = make_backend("gvisor", root_dir=root, images=DirectoryImages(images_dir))
        assert isinstance(b2, ContainerBackend)
        left = await b2.reconcile(set())
        assert [x.sandbox_id for x in left] == [sid] and left[0].backend == "gvisor"
        assert sid not in b2.census().sandboxes()
        assert not [n for n in os.listdir(os.path.join(root, "runc-state")) if sid in n]
        assert not [p for p in os.listdir("/proc") if p.isdigit() and sid.encode() in
                    _cmdline(p)]
    finally:
        await _cleanup(b2 if b2 is not None else b)
        _rmdir_everywhere(f"dsec-{b.cgroup_name}")


async def test_privileged_calls_fail_or_stay_in_the_sentry(
        backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    checks = {
        "mount": "mount -t tmpfs none /mnt",
        "mknod": "mknod /work/sda b 8 0 && head -c 1 /work/sda",
        "kcore": "test $(head -c 100 /proc/kcore 2>/dev/null | wc -c) -gt 0",
        "sysrq": "echo h > /proc/sysrq-trigger",
        "sysctl": "echo 1 > /proc/sys/kernel/panic",
        "hostname": "hostname evil",
        "insmod": "insmod /nonexistent.ko",
        "swapoff": "swapoff -a",
        "reboot": "reboot -f",
        "cgroup-escape": "echo $$ > /sys/fs/cgroup/cgroup.procs",
    }
    for name, cmd in checks.items():
        r = await backend.exec(sid, ExecRequest(shell=cmd, timeout_s=20))
        assert r.exit_code != 0, f"{name}: {cmd!r} succeeded inside the sandbox: {r}"
    caps = await sh(backend, sid, "grep CapEff /proc/self/status")
    assert int(caps.split()[1], 16) & (1 << 21) == 0   # no CAP_SYS_ADMIN
    for cmd in ("unshare -U true", "unshare -n true", "strace true"):  # the profile's
        r = await backend.exec(sid, ExecRequest(shell=cmd, timeout_s=20))
        assert r.exit_code != 0, (cmd, r)
    assert os.uname().nodename != "evil"
    assert await sh(backend, sid, "echo alive") == "alive\n"


# -- snapshots through the node (the container suite's chain test, unchanged) ---------------

@pytest.fixture
async def env(tmp_path: object) -> AsyncIterator[Env]:
    """The container suite's snapshot env with the gvisor backend serving the specs'
    backend name, so the test bodies run unchanged on this tier."""
    why = runsc_missing()
    if why:
        pytest.skip(why)
    root = str(tmp_path)
    store = LayerStore(os.path.join(root, "layers"))
    base = ensure_busybox_base(store)
    store.tag(base.digest, "base")
    tools = os.path.join(root, "tools")
    os.makedirs(os.path.join(tools, "opt/tools/lib"))
    Path(tools, "opt/tools/run.sh").write_text("#!/bin/sh\necho tool-ran\n")
    os.chmod(os.path.join(tools, "opt/tools/run.sh"), 0o755 | stat.S_IFREG)
    Path(tools, "opt/tools/lib/data.txt").write_text("toolkit data\n")
    store.add_tree(tools, kind="toolkit", name="mytools")
    cache = MountCache()
    backend = make_backend("gvisor", root_dir=os.path.join(root, "g"),
                           images=StoreImages(store, cache))
    assert isinstance(backend, ContainerBackend)
    node = EdgeNode(NodeConfig(node_id="n1", capacity=Capacity(
        cpu_milli=64_000, memory_bytes=64 << 30, max_sandboxes=64)), {"container": backend},
        rng=random.Random(3))
    await node.start()
    try:
        yield Env(node, backend, store, cache)
    finally:
        ids = [i.id for i in node.list()]
        if ids:
            await node.destroy_many(ids)
        await _cleanup(backend)
        _rmdir_everywhere(f"dsec-{backend.cgroup_name}")
        await node.close()
        try:
            assert cache.mounted() == {}, "layers still mounted after every sandbox went"
        finally:
            cache.close()


async def test_snapshot_chain_restores_exact_trees(env: Env) -> None:
    await _chain(env)


async def test_a_memory_bomb_is_contained_in_its_sandbox(env: Env) -> None:
    """A memory bomb meets one of two ends, both inside its own sandbox: the Sentry
    refuses the memory (its ``--total-memory`` is the limit: ENOMEM inside, the sandbox
    lives on), or the Sentry's own overhead tips the cgroup over and the host OOM-kills
    it - the sandbox stops (``destroyed``, reason ``oom``, the exec interrupted). Which
    one is a race (seen 1 in 4 runs here for the first)."""
    node = env.node
    sb = await node.create(SandboxSpec(image="base", backend="container",
                                       memory_bytes=96 << 20, pids_max=256))
    other = await node.create(SandboxSpec(image="base", backend="container",
                                          memory_bytes=96 << 20, pids_max=256))
    try:
        # tail -c keeps the last 300 MB it read: it grows until the limit
        r = await node.exec(sb.id, ExecRequest(
            shell="head -c 300000000 /dev/zero | tail -c 300000000 | wc -c", timeout_s=60))
    except DsecError as exc:
        assert "oom" in str(exc), exc
        for _ in range(200):
            if node.get(sb.id).state == "destroyed":
                break
            await asyncio.sleep(0.05)
        info = node.get(sb.id)
        assert (info.state, info.reason) == ("destroyed", "oom"), info
        assert "oom" in [e.reason for e in node.events(sb.id)]
    else:
        if not r.stdout.strip():
            # a third end, seen under load: the Sentry's own OOM handling killed the
            # pipeline (wc with it) - the command failed, nothing outside it did
            assert r.exit_code != 0, r
            for _ in range(200):
                if node.get(sb.id).state in ("running", "destroyed"):
                    break
                await asyncio.sleep(0.05)
            info = node.get(sb.id)
            assert info.state == "running" or (info.state, info.reason) == (
                "destroyed", "oom"), info
        else:
            assert int(r.stdout) < 300_000_000, r     # tail got ENOMEM from the Sentry
            assert node.get(sb.id).state == "running"
            assert (await node.exec(sb.id, ExecRequest(shell="echo alive"))).stdout \
                == b"alive\n"
    r = await node.exec(other.id, ExecRequest(shell="echo fine"))
    assert r.stdout == b"fine\n"
