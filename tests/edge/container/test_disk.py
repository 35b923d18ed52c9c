"""Disk caps of the container backend: every sandbox's upper layer is a subvolume of the
backend's btrfs disk pool with a qgroup limit (spec.disk_bytes or the node default).

Real filesystems throughout: the pool is a loop-mounted btrfs image under the test's
root_dir, small enough that "the pool is full" is a test, not a threat to the host."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.backends.container.disk import BTRFS_SUPER_MAGIC, DiskPool, near_cap
from dsec.edge.backends.container.linux import fstatfs_type
from dsec.errors import CapacityExceeded, DsecError, QuotaExceeded
from dsec.ids import SandboxId
from dsec.wire.spec import ExecRequest, SandboxSpec
from tests.edge.container.conftest import SPEC, _cleanup, new_sid

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

MiB = 1 << 20


async def _sh(b: ContainerBackend, sid: str, cmd: str) -> tuple[int, str]:
    r = await b.exec(SandboxId(sid), ExecRequest(shell=cmd, timeout_s=60))
    return r.exit_code, (r.stdout + r.stderr).decode(errors="replace")


def _new(tmp_path: object, images_dir: str, name: str = "root",
         **kw: object) -> ContainerBackend:
    return ContainerBackend(root_dir=os.path.join(str(tmp_path), name),
                            images=DirectoryImages(images_dir), **kw)  # type: ignore[arg-type]


def _fs_type(path: str) -> int:
    fd = os.open(path, os.O_PATH)
    try:
        return fstatfs_type(fd)
    finally:
        os.close(fd)


def _mounts_under(root: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [ln.split()[4] for ln in f if ln.split()[4].startswith(root)]


@pytest.fixture
async def capped(tmp_path: object, images_dir: str):  # type: ignore[no-untyped-def]
    b = _new(tmp_path, images_dir, default_disk_bytes=8 * MiB, disk_pool_bytes=512 * MiB)
    events: list[tuple[str, str, str]] = []
    b.watch(lambda sid, reason, detail: events.append((sid, reason, detail)))
    try:
        yield b, events
    finally:
        await _cleanup(b)


async def test_a_sandbox_without_disk_bytes_gets_the_node_default_cap(capped) -> None:  # type: ignore[no-untyped-def]
    b, events = capped
    sid, bystander = new_sid(), new_sid()
    await b.create(sid, SPEC)                       # no disk_bytes: the 8 MiB default
    await b.create(bystander, SandboxSpec(backend="container", disk_bytes=32 * MiB))
    upper = b.upper_dir(sid)
    assert _fs_type(upper) == BTRFS_SUPER_MAGIC     # on the pool, not the host fs
    code, out = await _sh(b, sid, "dd if=/dev/zero of=/root/big bs=1M count=20")
    assert code != 0 and "Disk quota exceeded" in out, out
    assert os.path.getsize(os.path.join(upper, "root/big")) < 8 * MiB
    st = await b.stats(SandboxId(sid))
    assert st.disk_cap_bytes == 8 * MiB and near_cap(st.disk_bytes, 8 * MiB) and st.disk_full
    # the hit is an event, rate-limited: filling again does not add another one
    full = [e for e in events if e[1] == "disk_full"]
    assert len(full) == 1 and full[0][0] == sid and "8388608 bytes" in full[0][2]
    await _sh(b, sid, "dd if=/dev/zero of=/root/more bs=1M count=4")
    assert len([e for e in events if e[1] == "disk_full"]) == 1
    # the file API hits the same cap, with an error that names it
    with pytest.raises(QuotaExceeded, match="disk cap of 8388608 bytes"):
        await b.write_file(SandboxId(sid), "/root/api", b"x" * (4 * MiB))
    # another sandbox has its own cap
    code, out = await _sh(b, bystander, "dd if=/dev/zero of=/root/big bs=1M count=20 "
                                        "2>/dev/null && echo ok")
    assert (code, out) == (0, "ok\n")
    st = await b.stats(SandboxId(bystander))
    assert st.disk_cap_bytes == 32 * MiB and not st.disk_full and st.disk_bytes >= 20 * MiB
    # freeing space inside makes it writable again
    code, out = await _sh(b, sid, "rm -f /root/big /root/more; echo again > /root/f && cat /root/f")
    assert (code, out) == (0, "again\n")


async def test_inodes_are_capped_by_the_same_limit(capped) -> None:  # type: ignore[no-untyped-def]
    """Empty files cost no data but metadata: creating them stops at the cap too (btrfs
    has no inode table, every inode costs metadata bytes that the qgroup counts)."""
    b, _ = capped
    sid = new_sid()
    await b.create(sid, SandboxSpec(backend="container", disk_bytes=1 * MiB))
    _, out = await _sh(b, sid, "mkdir /root/d; i=0; while [ $i -lt 200000 ] && "
                                  "{ true > /root/d/f$i; } 2>/dev/null; do i=$((i+1)); done; echo $i")
    made = int(out.split()[-1])
    assert 100 < made < 200000, out
    st = await b.stats(SandboxId(sid))
    assert st.disk_full and st.disk_bytes <= 1 * MiB


async def test_caps_that_cannot_fit_the_pool_are_refused_and_a_full_pool_is_enospc(
        tmp_path: object, images_dir: str) -> None:
    b = _new(tmp_path, images_dir, default_disk_bytes=8 * MiB, disk_pool_bytes=256 * MiB)
    events: list[tuple[str, str, str]] = []
    b.watch(lambda sid, reason, detail: events.append((sid, reason, detail)))
    try:
        with pytest.raises(CapacityExceeded, match="more than this node's whole sandbox disk"):
            await b.create(new_sid(), SandboxSpec(backend="container", disk_bytes=1 << 30))
        assert os.listdir(os.path.join(b.root_dir, "sb")) == [] and b.disk.sandboxes() == []
        one, two = new_sid(), new_sid()
        big = SandboxSpec(backend="container", disk_bytes=200 * MiB)
        await b.create(one, big)
        await b.create(two, big)       # caps are limits, not reservations: both fit now
        await _sh(b, one, "dd if=/dev/zero of=/root/a bs=1M count=150")
        code, out = await _sh(b, two, "dd if=/dev/zero of=/root/a bs=1M count=150")
        assert code != 0 and "No space left on device" in out, out   # the pool, not the host
        assert any(e[0] == two and e[1] == "disk_full" and "pool is full" in e[2]
                   for e in events), events
        with pytest.raises(CapacityExceeded, match="does not fit"):
            await b.create(new_sid(), big)
        assert sorted(b.disk.sandboxes()) == sorted([one, two])
    finally:
        await _cleanup(b)


async def test_disk_capped_sandbox_survives_an_edge_restart(tmp_path: object,
                                                            images_dir: str) -> None:
    """The pool stays mounted while a sandbox lives, so a new backend adopts the sandbox
    with its upper and its cap (derived from its subvolume) and destroy frees both."""
    root = os.path.join(str(tmp_path), "root")
    sid = new_sid()
    script = f"""
import asyncio
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.wire.spec import ExecRequest, SandboxSpec
async def main():
    b = ContainerBackend(root_dir={root!r}, images=DirectoryImages({images_dir!r}),
                         default_disk_bytes=4 << 20, disk_pool_bytes=512 << 20)
    await b.create({sid!r}, SandboxSpec(backend="container"))
    await b.exec({sid!r}, ExecRequest(shell="echo kept > /root/f"))
    await b.close()
asyncio.run(main())
"""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script)
    assert await asyncio.wait_for(proc.wait(), 60) == 0
    pool = os.path.join(root, "pool")
    assert os.path.ismount(pool)
    b = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir))
    try:
        assert await b.adopt(SandboxId(sid), SandboxSpec(backend="container"))
        assert b.upper_dir(sid) == os.path.join(pool, sid, "upper")
        _, out = await _sh(b, sid, "cat /root/f; dd if=/dev/zero of=/root/x bs=1M count=8")
        assert out.startswith("kept\n") and "Disk quota exceeded" in out
        assert (await b.stats(SandboxId(sid))).disk_cap_bytes == 4 << 20
        await b.destroy(SandboxId(sid))
        assert b.disk.sandboxes() == []
        await b.close()
        assert not os.path.ismount(pool)   # idle: the pool and its loop device are gone
    finally:
        await _cleanup(b)


@pytest.mark.parametrize("runtime", ["native", "runc", "runsc"])
async def test_no_subvolume_qgroup_or_mount_leaks_over_cycles(
        tmp_path: object, images_dir: str, runtime: str) -> None:
    if runtime != "native":
        import shutil
        if shutil.which(runtime) is None:
            pytest.skip(f"needs {runtime}")
    # "proc" is a file: mounting /proc fails (native, runc); so is "dev", which gVisor
    # mounts its own /dev tmpfs on (its /proc is the Sentry's, whatever the image has)
    broken = os.path.join(images_dir, "broken")
    os.makedirs(broken, exist_ok=True)
    Path(broken, "proc").touch()
    Path(broken, "dev").touch()
    b = _new(tmp_path, images_dir, runtime=runtime, default_disk_bytes=4 * MiB,
             disk_pool_bytes=512 * MiB)
    qgroups = f"/sys/fs/btrfs/{b.disk.fsid}/qgroups"

    def sandbox_qgroups() -> set[str]:
        return {n for n in os.listdir(qgroups) if n.startswith("0_") and n != "0_5"}

    try:
        mounts = _mounts_under(b.root_dir)
        for i in range(12):
            sid = new_sid()
            try:
                if i % 3 == 0:   # refused before its subvolume exists (no such image)
                    with pytest.raises(DsecError):
                        await b.create(sid, SandboxSpec(backend="container", image="missing"))
                elif i % 3 == 1:  # fails in the helper after its subvolume exists
                    with pytest.raises(DsecError):
                        await b.create(sid, SandboxSpec(backend="container", image="broken"))
                else:
                    await b.create(sid, SandboxSpec(backend="container"))
                    _, out = await _sh(b, sid, "dd if=/dev/zero of=/root/f bs=1M count=8")
                    assert "Disk quota exceeded" in out, out    # same cap under runc
            finally:
                await b.destroy(sid)
        assert b.disk.sandboxes() == [] and os.listdir(os.path.join(b.root_dir, "sb")) == []
        assert _mounts_under(b.root_dir) == mounts
        b.disk.settle()                       # the cleaner drops deleted subvolumes now
        for _ in range(200):
            if not sandbox_qgroups():
                break
            await asyncio.sleep(0.05)
        assert sandbox_qgroups() == set()     # the kernel removed every qgroup
    finally:
        await _cleanup(b)
    assert _mounts_under(b.root_dir) == []    # idle close unmounted the pool


async def test_orphan_subvolume_is_removed_at_start(tmp_path: object, images_dir: str) -> None:
    """A subvolume whose sandbox directory is gone (a crash between the two removals) is
    garbage: the next backend on the same root_dir deletes it."""
    b = _new(tmp_path, images_dir, disk_pool_bytes=512 * MiB)
    try:
        b.disk.create("sb-orphan", 4 * MiB)   # as if teardown died between the two steps
        await b.close()                        # a subvolume left: the pool stays mounted
        b = _new(tmp_path, images_dir)
        assert b.disk.sandboxes() == []
    finally:
        await _cleanup(b)


def test_near_cap_is_within_a_block_or_a_percent() -> None:
    assert near_cap(8 * MiB - 4096, 8 * MiB) and not near_cap(7 * MiB, 8 * MiB)
    assert near_cap(1000 * MiB - 5 * MiB, 1000 * MiB)    # 1/128 of a large cap
    assert not near_cap(0, 1 * MiB)
    assert DiskPool.usage_at("/nonexistent").used_bytes == 0


async def test_the_pool_image_is_preallocated_and_given_back_when_empty(
        tmp_path: object, images_dir: str) -> None:
    """The pool owns its host space while it exists (a sparse image let a full host make
    the whole pool read-only), and an empty pool is deleted at close so a backend that
    is gone holds no disk."""
    b = _new(tmp_path, images_dir, disk_pool_bytes=300 * MiB)
    image = b.disk.image
    try:
        st = os.stat(image)
        assert st.st_size == 300 * MiB and st.st_blocks * 512 >= st.st_size, st
        opts = next(line.split()[5] for line in Path("/proc/self/mountinfo").read_text().splitlines()
                    if line.split()[4] == b.disk.path)
        assert "nosuid" in opts and "nodev" in opts, opts
        sid = new_sid()
        await b.create(sid, SandboxSpec(backend="container", memory_bytes=64 * MiB))
        # no disk_bytes: the 10 GiB node default, clamped to what this 300 MiB pool has free
        cap = (await b.stats(SandboxId(sid))).disk_cap_bytes
        assert 200 * MiB < cap < 300 * MiB, cap
        await b.destroy(sid)
    finally:
        await _cleanup(b)
    assert not os.path.ismount(b.disk.path)
    assert not os.path.exists(image)
