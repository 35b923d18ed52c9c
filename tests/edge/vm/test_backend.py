"""The vm backend on a real QEMU guest: lifecycle, files, snapshots, pause/resume,
death events and reconcile after the edge is killed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from dsec.edge.backends.vm import agentproto as ap
from dsec.edge.backends.vm.backend import VmBackend
from dsec.errors import Conflict, DsecError, InvalidArgument, NotFound, Timeout
from dsec.ids import SandboxId
from dsec.image.mount import sys_mount, sys_umount
from dsec.wire.spec import ExecChunk, ExecRequest, ExecResult, PtySize, SandboxSpec

pytestmark = pytest.mark.root

SPEC = SandboxSpec(image="base", memory_bytes=192 << 20, disk_bytes=64 << 20, backend="vm",
                   project="default")


def _cmdline(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")


def _qemu_alive(b: VmBackend, sid: str) -> bool:
    return sid in b._qemu_pids()


async def _until(cond: Any, timeout: float) -> bool:
    """Poll ``cond`` every 20 ms until it holds or ``timeout`` seconds pass (a deadline,
    not a count of tries: at host load 10-20 a step can take much longer than 20 ms)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def test_lifecycle_files_snapshot_pause_resume(vm_backend: VmBackend) -> None:
    b = vm_backend
    events: list[tuple[str, str, str]] = []
    b.watch(lambda *a: events.append(a))
    sid = SandboxId("sb-vh-life")
    await b.create(sid, SPEC)
    vm = b._vms[sid]
    st = os.stat(vm.dir)
    assert st.st_mode & 0o777 == 0o700 and st.st_uid == 0
    # QEMU runs as the sandbox's own unprivileged uid, in its cgroup
    pst = os.stat(f"/proc/{vm.rec.pid}")          # the process's effective uid and gid
    assert (pst.st_uid, pst.st_gid) == (vm.rec.uid, vm.rec.uid) and vm.rec.uid >= 300000
    assert vm.rec.pid in b.governor.pids(vm.cg)

    r = await b.exec(sid, ExecRequest(argv=("sh", "-c", "echo hi; echo err >&2; exit 3")))
    assert (r.exit_code, r.stdout, r.stderr) == (3, b"hi\n", b"err\n")
    items = [i async for i in b.exec_stream(sid, ExecRequest(shell="echo a; echo b"))]
    assert b"".join(i.data for i in items if isinstance(i, ExecChunk)) == b"a\nb\n"
    assert isinstance(items[-1], ExecResult) and items[-1].exit_code == 0
    with pytest.raises(InvalidArgument, match="'vm'"):
        await b.exec(sid, ExecRequest(argv=("sh",), pty=PtySize(rows=24, cols=80)))

    await b.write_file(sid, "/root/notes.txt", b"x" * 3_000_000)   # several agent calls
    assert await b.read_file(sid, "/root/notes.txt") == b"x" * 3_000_000
    assert await b.read_file(sid, "/root/notes.txt", offset=2_999_998) == b"xx"
    await b.mkdir(sid, "/work/a")
    names = {e.name for e in await b.list_dir(sid, "/work")}
    assert names == {"a"}
    assert (await b.stat(sid, "/root/notes.txt")).size == 3_000_000
    await b.remove(sid, "/bin/vi")                                   # a whiteout
    with pytest.raises(NotFound):
        await b.stat(sid, "/bin/vi")
    # a channel that closed (a guest that sent garbage gets it closed) is dialled again
    assert vm.link is not None
    await vm.link.close()
    assert (await b.exec(sid, ExecRequest(argv=("true",)))).exit_code == 0
    s = await b.stats(sid)
    assert s.memory_bytes > 0 and s.disk_cap_bytes == 64 << 20 and s.disk_bytes > 0

    snap = await b.snapshot(sid)
    assert snap.parent is None and snap.backend == "vm"

    # pause: guest memory saved to a file, QEMU gone, host memory returned
    ps = await b.pause(sid)
    assert ps.reclaimed_bytes > 0
    assert not _qemu_alive(b, sid)
    assert os.path.getsize(os.path.join(vm.dir, "mem.bin")) > 0
    assert b.governor.memory_usage(vm.cg) < (8 << 20)
    with pytest.raises(Conflict, match="paused"):
        await b.exec(sid, ExecRequest(argv=("true",)))
    # a paused sandbox can be snapshotted (resumed for it, paused again); nothing changed
    again = await b.snapshot(sid)
    assert again.unchanged and again.id == snap.id
    assert vm.rec.paused and not _qemu_alive(b, sid)
    await b.resume(sid)
    assert not os.path.exists(os.path.join(vm.dir, "mem.bin"))
    # the restored guest's clock is the host's again (it ran on the saved virtual clock)
    t0 = time.time()
    r = await b.exec(sid, ExecRequest(argv=("date", "+%s")))
    assert t0 - 2 <= int(r.stdout) <= time.time() + 1, (t0, r)
    r = await b.exec(sid, ExecRequest(shell="head -c 5 /root/notes.txt; ls /bin/vi"))
    assert r.stdout == b"xxxxx" and r.exit_code != 0

    # a new sandbox from the snapshot sees the file and the whiteout
    sid2 = SandboxId("sb-vh-snap")
    await b.create(sid2, SandboxSpec(snapshot=snap.id, memory_bytes=192 << 20,
                                     disk_bytes=64 << 20, backend="vm", project="default"))
    r = await b.exec(sid2, ExecRequest(shell="wc -c < /root/notes.txt; ls /work; "
                                             "test -e /bin/vi || echo novi"))
    assert r.stdout.split() == [b"3000000", b"a", b"novi"], r
    await b.destroy(sid2)

    dirs = (vm.dir, b.governor.paths(sid))
    await b.destroy(sid)
    assert not os.path.exists(dirs[0]) and not b.governor.exists(dirs[1])
    assert not _qemu_alive(b, sid)
    assert events == []                     # nothing died on its own


async def test_density_guest_then_qemu_killed_is_a_backend_crash(
        vm_backend: VmBackend) -> None:
    """With density on (layers on virtio-pmem + DAX, balloon, DAMON): the image is read
    through pmem, pause leaves the regions out of the memory file and resume works; a
    full host filesystem under the guest is I/O errors inside, the VM runs on; then QEMU
    killed from outside is reported as a backend crash."""
    from dsec.edge.backends.vm.density import DensityOptions

    root = vm_backend.root_dir + "-dens"
    os.makedirs(root)
    # a small filesystem of its own, so the host can run out of room under the guest
    sys_mount("vmdens", root, "tmpfs", 0, "size=400m,mode=0700")
    b = VmBackend(root_dir=root, images=vm_backend.images,
                  kernel=vm_backend.kernel, initrd=vm_backend.initrd,
                  append=vm_backend.append, density=DensityOptions())
    events: list[tuple[str, str, str]] = []
    b.watch(lambda *a: events.append(a))
    sid = SandboxId("sb-vh-crash")
    try:
        await b.create(sid, SPEC)
        argv = _cmdline(b._vms[sid].rec.pid)
        assert any(a.startswith(b"virtio-pmem-pci") for a in argv)
        assert not any(a.startswith(b"virtio-blk-pci,drive=d1") for a in argv)  # scratch only
        setup = b._vms[sid].setup
        # the one layer is mounted, and the only virtio-blk disk is the scratch: the layer
        # came from the pmem region
        assert setup is not None and "/layers/0" in setup.mounts, setup
        r = await b.exec(sid, ExecRequest(shell="ls /bin | wc -l"))
        assert r.exit_code == 0 and int(r.stdout) > 50, r
        await b.write_file(sid, "/root/f", b"dens")
        await b.pause(sid)
        await b.resume(sid)
        assert await b.read_file(sid, "/root/f") == b"dens"

        # the host filesystem fills under the guest's disk: the guest gets I/O errors
        # and runs on (QEMU's default would stop the VM for good, silently)
        free = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
        fd = os.open(os.path.join(root, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
        os.posix_fallocate(fd, 0, free - (8 << 20))
        os.close(fd)
        await b.exec(sid, ExecRequest(
            shell="dd if=/dev/zero bs=1M count=16 2>/dev/null | tr '\\0' x > /root/big; "
                  "sync", timeout_s=60))
        vm = b._vms[sid]
        assert vm.qmp is not None
        assert (await vm.qmp.execute("query-status"))["status"] == "running"
        assert (await b.exec(sid, ExecRequest(argv=("echo", "alive")))).stdout == b"alive\n"
        os.unlink(os.path.join(root, "filler"))

        os.kill(b._vms[sid].rec.pid, signal.SIGKILL)
        await _until(lambda: bool(events), 30)
        assert events and events[0][:2] == (sid, "backend_crash")
        await b.destroy(sid)
        assert not os.path.exists(os.path.join(b.root_dir, "sb", sid))
    finally:
        for s in list(b._vms):
            await b.destroy(s)  # type: ignore[arg-type]
        await b.close()
        with contextlib.suppress(OSError):   # its parent cgroups (left empty otherwise)
            b.governor.remove_base()
        sys_umount(root, detach=True)


_EDGE = """
import asyncio, os, signal, sys
from dsec.edge.backends.container.images import StoreImages
from dsec.edge.backends.vm import agentproto as ap
import dsec.edge.backends.vm.backend as vmb
from dsec.edge.backends.vm.backend import VmBackend
# the test's own backend (same root) holds the cgroup name: this edge, killed
# below, must not take it over (a dead claimer's empty cgroups get swept)
vmb.claim_cgroup_name = lambda *a, **k: None
from dsec.image import LayerStore, MountCache
from dsec.wire.spec import SandboxSpec
async def main():
    b = VmBackend(root_dir=sys.argv[1], images=StoreImages(LayerStore(sys.argv[2]), MountCache()),
                  kernel=sys.argv[3], initrd=sys.argv[4])
    await b.create("sb-vh-orphan", SandboxSpec(image="base", memory_bytes=128 << 20,
                                                 disk_bytes=32 << 20, backend="vm"))
    print("created", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
asyncio.run(main())
"""


async def test_reconcile_after_edge_kill9(vm_backend: VmBackend, vm_store: Any,
                                          boot_files: tuple[str, str]) -> None:
    """An edge killed with -9 leaves its QEMU running: the next edge's reconcile finds it
    by its marker and removes the process, cgroup and directory."""
    b = vm_backend
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _EDGE, b.root_dir, vm_store.root, *boot_files, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await p.communicate()
    assert p.returncode == -signal.SIGKILL and b"created" in out, err[-2000:]
    assert _qemu_alive(b, "sb-vh-orphan")
    left = await b.reconcile(set())
    assert [x.sandbox_id for x in left] == ["sb-vh-orphan"]
    assert "QEMU" in left[0].what and "directory" in left[0].what
    assert await _until(lambda: not _qemu_alive(b, "sb-vh-orphan"), 10)
    assert not os.path.exists(os.path.join(b.root_dir, "sb", "sb-vh-orphan"))
    assert not b.governor.exists(b.governor.paths("sb-vh-orphan"))


async def test_warm_pool_clones_a_saved_guest(vm_backend: VmBackend, cpu_load: Any,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """With the warm pool on and the layers on virtio-pmem (the defaults), under CPU load:
    a template saved while the guest still probed its devices (the old behaviour, forced
    here) gives a clone without them - that create boots cold and says why, and the
    template is rebuilt, this time saved only after the agent reports every device;
    creates then restore it (their layer mounts from /dev/pmem0, their clock is the
    host's), each with its own scratch disk. Then an edge restart adopts them (one
    running, one paused)."""
    from dsec.edge.backends.vm.density import DensityOptions

    # a short root: the template builder's agent socket is <root>/pool/<32 hex>.build/a,
    # and a unix socket path has at most 107 bytes
    b = VmBackend(root_dir=os.path.join(os.path.dirname(vm_backend.root_dir), "w"),
                  images=vm_backend.images,
                  kernel=vm_backend.kernel, initrd=vm_backend.initrd,
                  append=vm_backend.append, console=True, density=DensityOptions(),
                  warm_pool=True)
    b2: VmBackend | None = None
    sids = [SandboxId("sb-vh-warm1"), SandboxId("sb-vh-warm2")]
    cold = SandboxId("sb-vh-warm0")
    try:
        with cpu_load(2):
            # the template as it was saved before the fix: right after hello, without
            # waiting for the devices (a sync-only quiesce, so it is surely mid-probe)
            seen: list[ap.QuiesceResult] = []
            save = b._save_memory

            async def unsettled(vm: Any, part: str, *, settle: Any = None) -> None:
                real = vm.link.call

                async def call(method: str, body: Any, rtype: Any, **kw: Any) -> Any:
                    if method == "quiesce":
                        body = ap.QuiesceRequest(drop_caches=False, compact=False)
                    r = await real(method, body, rtype, **kw)
                    if method == "quiesce":
                        seen.append(r)
                    return r
                vm.link.call = call
                await save(vm, part)
            b._save_memory = unsettled  # type: ignore[method-assign]
            await b.warm(SPEC)
            b._save_memory = save       # type: ignore[method-assign]
            assert seen and (seen[0].probing or seen[0].unbound
                             or "pmem0" not in seen[0].devices), seen
            caplog.set_level("WARNING", logger="dsec.edge.vm")
            await b.create(cold, SPEC)                  # the clone lacked pmem0: cold boot
            assert any("not usable" in r.message and "not ready" in r.message
                       for r in caplog.records), caplog.text
            assert (await b.exec(cold, ExecRequest(shell="ls /bin | wc -l"))).exit_code == 0
            for task in list(b._building.values()):   # the template, made again
                assert await task is not None
            for sid in sids:
                await b.create(sid, SPEC)
            boots = {b._vms[s].rec.boot_id for s in sids}
            assert len(boots) == 1 and b._vms[cold].rec.boot_id not in boots  # both warm
            for sid in sids:
                t0 = time.time()
                r = await b.exec(sid, ExecRequest(shell="ls /bin | wc -l; date +%s"))
                n, when = r.stdout.split()
                assert int(n) > 50 and t0 - 2 <= int(when) <= time.time() + 1, (t0, r)
        template = b.pool.path(b._pool_key(b._vms[sids[0]].rec))  # type: ignore[union-attr]
        await b.write_file(sids[0], "/root/mine", b"1")
        r = await b.exec(sids[1], ExecRequest(shell="ls /root; cat /etc/hostname 2>/dev/null; "
                                                    "echo ok"))
        assert r.stdout.split()[-1] == b"ok" and b"mine" not in r.stdout
        assert await b.read_file(sids[0], "/root/mine") == b"1"
        # a template that cannot be restored is removed and the create boots cold (the
        # cold boot is made to give up at once here: a full one would cost ~10 s)
        await b.destroy(cold)
        os.truncate(template, 4096)
        caplog.clear()
        b.boot_timeout_s = 0.5
        with pytest.raises(Timeout, match="did not answer hello"):
            await b.create(SandboxId("sb-vh-warm3"), SPEC)
        b.boot_timeout_s = 120.0
        assert not os.path.exists(template) and "not usable" in caplog.text
        assert not b._building and "sb-vh-warm3" not in b._vms
        # the clones can pause and resume like any guest
        await b.pause(sids[0])
        await b.resume(sids[0])
        assert await b.read_file(sids[0], "/root/mine") == b"1"

        # an edge restart: the next backend object adopts the running VM and the paused one
        await b.pause(sids[1])
        pid = b._vms[sids[0]].rec.pid
        await b.close()
        b2 = VmBackend(root_dir=b.root_dir, images=b.images, kernel=b.kernel,
                       initrd=b.initrd, append=b.append, console=True,
                       density=DensityOptions())
        assert await b2.adopt(sids[0], SPEC) and await b2.adopt(sids[1], SPEC)
        assert b2._vms[sids[0]].rec.pid == pid                  # the same QEMU
        assert await b2.read_file(sids[0], "/root/mine") == b"1"
        await b2.resume(sids[1])
        assert (await b2.exec(sids[1], ExecRequest(argv=("true",)))).exit_code == 0
        assert not await b2.adopt(SandboxId("sb-vh-never"), SPEC)
        assert await b2.reconcile(set(sids)) == []
        # the guest kernel dying (a panic reboots; -no-reboot makes that an exit) is the
        # sandbox exiting, reported on the adopted VM too
        events: list[tuple[str, str, str]] = []
        b2.watch(lambda *a: events.append(a))
        with contextlib.suppress(DsecError):
            await b2.exec(sids[1], ExecRequest(shell="echo c > /proc/sysrq-trigger",
                                               timeout_s=5))
        await _until(lambda: bool(events), 30)
        assert [e[:2] for e in events] == [(sids[1], "exited")]
    finally:
        for x in (b2, b):
            if x is None:
                continue
            for left in list(x._vms):
                with contextlib.suppress(DsecError):
                    await x.destroy(SandboxId(left))
            await x.close()
        await b.reconcile(set())
        with contextlib.suppress(OSError):   # its parent cgroups (left empty otherwise)
            b.governor.remove_base()
