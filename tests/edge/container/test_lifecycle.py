"""Pause/resume, stats, edge restart (kill -9 + adopt) and the 200-cycle leak test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.errors import DsecError
from dsec.ids import SandboxId
from dsec.wire.spec import ExecRequest, SandboxSpec
from tests.edge.container.conftest import SPEC, new_sid


async def test_pause_reclaims_and_resume_thaws(backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    # 40 MiB of anonymous memory held by a background process, plus page cache
    await backend.exec(sid, ExecRequest(
        shell="head -c 40m /dev/urandom > /tmp/blob; "
              "cat /tmp/blob > /dev/null", timeout_s=30))
    await backend.exec(sid, ExecRequest(shell="sleep 1000", background=True))
    digest = (await backend.exec(sid, ExecRequest(argv=("md5sum", "/tmp/blob")))).stdout
    stats = await backend.pause(sid)
    assert stats.resident_before_bytes > 30 << 20
    assert stats.reclaimed_bytes >= 0.6 * stats.resident_before_bytes
    assert backend.governor.is_frozen(backend.box(sid).cg)
    await backend.resume(sid)
    assert not backend.governor.is_frozen(backend.box(sid).cg)
    r = await backend.exec(sid, ExecRequest(argv=("md5sum", "/tmp/blob")))
    assert r.stdout == digest and len(digest) == 44  # the data survived the trip via swap
    # an exec on a paused sandbox resumes it
    await backend.pause(sid)
    r = await backend.exec(sid, ExecRequest(shell="echo up; head -c 100000 /dev/zero > /root/d"))
    assert r.stdout == b"up\n"
    s = await backend.stats(sid)
    # /tmp is a tmpfs: /root/d is what the root's upper layer holds (was `disk_bytes >= 0`;
    # the disk pool's accounting adds its own metadata on top)
    assert s.memory_bytes > 0 and s.pids >= 2 and s.cpu_seconds > 0
    assert 100_000 <= s.disk_bytes < 16 << 20, s


_EDGE = textwrap.dedent("""
    import asyncio, sys
    from dsec.edge.backends.container import ContainerBackend, DirectoryImages
    from dsec.wire.spec import ExecRequest, SandboxSpec
    async def main():
        b = ContainerBackend(root_dir=sys.argv[1], images=DirectoryImages(sys.argv[2]))
        for sid in sys.argv[3:]:
            await b.create(sid, SandboxSpec(backend="container"))
            await b.exec(sid, ExecRequest(shell="echo before > /root/state; sleep 1000",
                                          background=True))
        print("ready", flush=True)
        await asyncio.sleep(1000)
    asyncio.run(main())
""")


async def test_sandboxes_survive_edge_kill_9(tmp_path: object, images_dir: str) -> None:
    root = os.path.join(str(tmp_path), "root")
    sids = [new_sid(), new_sid()]
    # the test drives a real edge process and blocks on it on purpose (kill -9, restart)
    edge = subprocess.Popen([sys.executable, "-c", _EDGE, root, images_dir, *sids],  # noqa: ASYNC220
                            stdout=subprocess.PIPE)
    b = None
    try:
        assert edge.stdout is not None and edge.stdout.readline() == b"ready\n"
        edge.send_signal(signal.SIGKILL)
        edge.wait()
        b = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir))
        for sid in sids:
            assert await b.adopt(SandboxId(sid), SandboxSpec(backend="container"))
            r = await b.exec(SandboxId(sid), ExecRequest(shell="cat /root/state; ps -o comm"))
            assert r.stdout.startswith(b"before\n") and b"sleep" in r.stdout
        assert not await b.adopt(new_sid(), SandboxSpec(backend="container"))
    finally:
        if edge.poll() is None:
            edge.kill()
            edge.wait()
        if b is None:
            b = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir))
        for sid in sids:
            await b.destroy(SandboxId(sid))  # adopts leftovers itself if needed
        assert b.governor.list_sandboxes() == []
        await b.close()
        b.governor.remove_base()


def _mounts(root: str) -> int:
    """Mounts at or below ``root`` (other work on the machine mounts and unmounts too)."""
    with open("/proc/self/mountinfo") as f:
        return sum(1 for line in f if line.split()[4].startswith(root))


def _dsec_processes(cgroup_name: str) -> int:
    """Sandbox inits of this backend: /dev/.init processes in its cgroup subtree (other
    tests and benchmarks may run sandboxes of their own meanwhile)."""
    n = 0
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if not f.read().startswith(b"/dev/.init"):
                    continue
            with open(f"/proc/{pid}/cgroup") as f:
                if f"/dsec-{cgroup_name}/" in f.read():
                    n += 1
        except OSError:
            pass
    return n


async def test_no_leaks_over_200_cycles(backend: ContainerBackend, images_dir: str,
                                        tmp_path: object) -> None:
    # an image the helper's child cannot build a root from ("proc" is a file, so mounting
    # procfs on it fails half-way: after namespaces and cgroup membership exist)
    broken = os.path.join(images_dir, "broken")
    os.makedirs(broken, exist_ok=True)
    Path(broken, "proc").write_bytes(b"")
    warm = new_sid()  # start the helper process first: its socket is not a leak
    await backend.create(warm, SPEC)
    await backend.destroy(warm)
    before = (_mounts(backend.root_dir), backend.governor.list_sandboxes(),
              _dsec_processes(backend.cgroup_name),
              os.listdir(os.path.join(backend.root_dir, "sb")), len(os.listdir("/proc/self/fd")),
              backend.disk.sandboxes())
    failures = 0
    for i in range(200):
        sid = new_sid()
        kind = i % 10
        try:
            if kind == 7:
                await backend.create(sid, SandboxSpec(backend="container", image="missing"))
            elif kind == 8:  # fails half-way with its disk subvolume already made
                await backend.create(sid, SandboxSpec(backend="container", image="broken",
                                                      disk_bytes=4 << 20))
            elif kind == 9:
                await backend.create(sid, SandboxSpec(backend="container", cpu_milli=0))
            else:
                await backend.create(sid, SPEC)
                if kind == 1:  # disk-capped: filled past its cap
                    await backend.destroy(sid)
                    await backend.create(sid, SandboxSpec(backend="container",
                                                          disk_bytes=2 << 20))
                    await backend.exec(sid, ExecRequest(
                        shell="dd if=/dev/zero of=/root/f bs=1M count=4"))
                elif kind == 3:
                    await backend.exec(sid, ExecRequest(shell="sleep 5", timeout_s=0.05))
                elif kind == 5:
                    await backend.exec(sid, ExecRequest(shell="sleep 100", background=True))
                    await backend.pause(sid)
                else:
                    await backend.exec(sid, ExecRequest(argv=("true",)))
        except DsecError:
            failures += 1
        finally:
            await backend.destroy(sid)
    assert failures == 60
    after = (_mounts(backend.root_dir), backend.governor.list_sandboxes(),
             _dsec_processes(backend.cgroup_name),
             os.listdir(os.path.join(backend.root_dir, "sb")), len(os.listdir("/proc/self/fd")),
             backend.disk.sandboxes())
    assert after == before
