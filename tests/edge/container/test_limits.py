"""Node-protecting limits of the container backend: disk_bytes (a per-sandbox tmpfs under
the overlay upper), the per-sandbox and node-wide task caps, and that an idle backend
leaves no parent cgroup behind when it closes."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.spec import ExecRequest, SandboxSpec
from dsec.errors import DsecError, InvalidArgument
from dsec.ids import SandboxId
from tests.edge.container.conftest import SPEC, _cleanup, new_sid

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

DISK = SandboxSpec(backend="container", memory_bytes=256 << 20, pids_max=64,
                   disk_bytes=8 << 20)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _mount_opts(path: str) -> list[str] | None:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == path:
                return fields[5].split(",") + line.split(" - ")[1].split()[2].split(",")
    return None


async def _sh(b: ContainerBackend, sid: str, cmd: str) -> tuple[int, str]:
    r = await b.exec(SandboxId(sid), ExecRequest(shell=cmd, timeout_s=30))
    return r.exit_code, (r.stdout + r.stderr).decode(errors="replace")


async def test_disk_bytes_is_a_tmpfs_of_that_size_and_full_means_enospc(
        backend: ContainerBackend) -> None:
    sid, bystander = new_sid(), new_sid()
    await backend.create(sid, DISK)
    await backend.create(bystander, SPEC)
    disk = os.path.dirname(backend.upper_dir(sid))
    assert disk == os.path.join(backend.root_dir, "sb", sid, "disk")
    opts = _mount_opts(disk)
    assert opts is not None and {"nosuid", "nodev", "size=8192k", "mode=700"} <= set(opts)
    code, out = await _sh(backend, sid, "dd if=/dev/zero of=/root/big bs=1M count=6 "
                                        "2>/dev/null && echo ok")
    assert (code, out) == (0, "ok\n")
    assert os.path.getsize(os.path.join(backend.upper_dir(sid), "root/big")) == 6 << 20
    st = await backend.stats(SandboxId(sid))
    assert 6 << 20 <= st.disk_bytes <= 8 << 20
    code, out = await _sh(backend, sid, "dd if=/dev/zero of=/root/more bs=1M count=4")
    assert code != 0 and "No space left on device" in out, out
    # the file API hits the same cap
    with pytest.raises(DsecError, match="No space left"):
        await backend.write_file(SandboxId(sid), "/root/api", b"x" * (4 << 20))
    # other sandboxes (plain upper on the host fs) are not limited by it
    code, out = await _sh(backend, bystander, "dd if=/dev/zero of=/root/big bs=1M count=12 "
                                              "2>/dev/null && echo ok")
    assert (code, out) == (0, "ok\n")
    await backend.destroy(SandboxId(sid))
    assert _mount_opts(disk) is None and not os.path.exists(disk)


async def test_disk_capped_sandbox_survives_an_edge_restart(tmp_path: object,
                                                            images_dir: str) -> None:
    """The tmpfs is a host mount, so it outlives the edge process; a new backend adopts
    the sandbox with its upper on it and unmounts it on destroy."""
    root = os.path.join(str(tmp_path), "root")
    sid = new_sid()
    script = f"""
import asyncio, sys
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.spec import ExecRequest, SandboxSpec
async def main():
    b = ContainerBackend(root_dir={root!r}, images=DirectoryImages({images_dir!r}))
    await b.create({sid!r}, SandboxSpec(backend="container", disk_bytes=4 << 20))
    await b.exec({sid!r}, ExecRequest(shell="echo kept > /root/f"))
    await b.close()
asyncio.run(main())
"""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script)
    assert await asyncio.wait_for(proc.wait(), 60) == 0
    b = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir))
    try:
        disk = os.path.join(root, "sb", sid, "disk")
        assert _mount_opts(disk) is not None
        assert await b.adopt(SandboxId(sid), SandboxSpec(backend="container", disk_bytes=4 << 20))
        assert b.upper_dir(sid) == os.path.join(disk, "upper")
        _, out = await _sh(b, sid, "cat /root/f; dd if=/dev/zero of=/root/x bs=1M count=8")
        assert out.startswith("kept\n") and "No space left" in out
        await b.destroy(SandboxId(sid))
        assert _mount_opts(disk) is None
    finally:
        await _cleanup(b)


async def test_pids_max_none_gets_the_node_cap_and_more_is_refused(
        tmp_path: object, images_dir: str) -> None:
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                         images=DirectoryImages(images_dir), max_sandbox_pids=100)
    try:
        sid = new_sid()
        await b.create(sid, SandboxSpec(backend="container", pids_max=None))
        cg = b.governor.paths(sid)
        pids_dir = cg.dirs.get("pids", cg.dirs.get("unified", ""))
        assert _read(os.path.join(pids_dir, "pids.max")) == "100"
        with pytest.raises(InvalidArgument, match="per-sandbox maximum of 100"):
            await b.create(new_sid(), SandboxSpec(backend="container", pids_max=101))
        assert b.sandbox_ids() == [sid]
        assert sorted(os.listdir(os.path.join(b.root_dir, "sb"))) == [sid]
        # all sandboxes together: kernel.pid_max minus the headroom
        pid_max = int(_read("/proc/sys/kernel/pid_max"))
        total = int(_read(os.path.join(os.path.dirname(pids_dir), "pids.max")))
        assert total == b.pids_total == pid_max - 4096
    finally:
        await _cleanup(b)


def test_bad_pid_options_are_refused(tmp_path: object, images_dir: str) -> None:
    for kw in ({"max_sandbox_pids": 0}, {"pids_headroom": 1 << 40}, {"pids_headroom": -1}):
        with pytest.raises(InvalidArgument):
            ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                             images=DirectoryImages(images_dir), **kw)  # type: ignore[arg-type]


def _cgroup_dirs_named(leaf: str) -> list[str]:
    found = []
    for top in os.listdir("/sys/fs/cgroup"):
        for dirpath, dirnames, _ in os.walk(os.path.join("/sys/fs/cgroup", top)):
            if dirpath.count("/") > 8:
                dirnames[:] = []
            elif leaf in dirnames:
                found.append(os.path.join(dirpath, leaf))
                dirnames.remove(leaf)
    return found


@pytest.mark.parametrize("runtime", ["native", "runc"])
async def test_idle_close_removes_the_parent_cgroups_and_busy_close_keeps_them(
        tmp_path: object, images_dir: str, runtime: str) -> None:
    root = os.path.join(str(tmp_path), "root")
    b = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir),
                         runtime=runtime)  # type: ignore[arg-type]
    leaf = f"dsec-{b.cgroup_name}"
    sid = new_sid()
    try:
        await b.create(sid, SPEC)
        await b.close()  # stopping with a sandbox left: it must stay adoptable
        assert _cgroup_dirs_named(leaf)
        b = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir),
                             runtime=runtime)  # type: ignore[arg-type]
        assert await b.adopt(SandboxId(sid), SPEC)
        await b.destroy(SandboxId(sid))
        await b.close()
        assert _cgroup_dirs_named(leaf) == []
    finally:
        await _cleanup(b)
