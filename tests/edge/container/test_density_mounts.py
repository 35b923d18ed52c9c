"""Issue 22, lighter mounts: `/dev`, `/dev/shm` and `/tmp` are directories of one
per-sandbox tmpfs and the masks a bind of a deleted empty directory of it (4 superblocks
per sandbox became 1). Nothing is shared between sandboxes, and every per-mount rule the
separate mounts had still holds: /dev/shm and /tmp are nodev/nosuid (/dev/shm noexec),
the masked directories are empty and nothing can be created in them, the scratch tmpfs's
own root and its dev/tmp split are invisible."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import SPEC, new_sid

pytestmark = pytest.mark.root


async def _sh(b: ContainerBackend, sid: str, cmd: str) -> tuple[int, str]:
    r = await b.exec(sid, ExecRequest(shell=cmd))
    return r.exit_code, (r.stdout + r.stderr).decode()


async def test_scratch_tmpfs_is_per_sandbox_and_keeps_the_mount_rules(
        backend: ContainerBackend) -> None:
    a, b = new_sid(), new_sid()
    await backend.create(a, SPEC)
    await backend.create(b, SPEC)
    code, out = await _sh(backend, a, "echo A > /tmp/t && echo A > /dev/shm/s && "
                          "echo A > /dev/x && cat /tmp/t /dev/shm/s /dev/x")
    assert code == 0 and out == "A\nA\nA\n", out
    # the other sandbox sees none of it (its own dir of the node's scratch tmpfs)
    code, out = await _sh(backend, b, "ls -A /tmp /dev/shm; ls /dev/x")
    assert code != 0 and "t\n" not in out and "s\n" not in out, out
    # /tmp files are not visible under /dev and the other way round; no staging dir
    code, out = await _sh(backend, a, "ls -A /dev; ls -A /tmp")
    assert ".mask" not in out and "tmp" not in out.split(), out
    # per-mount flags: nodev+nosuid on /tmp and /dev/shm, noexec on /dev/shm
    code, out = await _sh(backend, a, "grep -E ' /(tmp|dev/shm) ' /proc/self/mountinfo")
    lines = out.strip().splitlines()
    assert len(lines) == 2, out
    for line in lines:
        opts = line.split()[5].split(",")
        assert "nodev" in opts and "nosuid" in opts, line
        if " /dev/shm " in line:
            assert "noexec" in opts, line
    code, out = await _sh(backend, a, "cp /bin/busybox /dev/shm/bb && /dev/shm/bb true")
    assert code != 0, out   # noexec
    # the masked directories: empty, read-only, nothing can be created in them
    code, out = await _sh(backend, a, "ls -A /proc/acpi /sys/firmware; "
                          "touch /proc/acpi/z || echo refused; mkdir /sys/firmware/d || "
                          "echo refused2")
    assert "refused" in out and "refused2" in out, out
    assert "z" not in out.split(), out
    # one superblock for /dev, /dev/shm and /tmp (the reason for all of this)
    code, out = await _sh(backend, a, "grep -E ' /(tmp|dev|dev/shm) ' /proc/self/mountinfo"
                          " | cut -d' ' -f3 | sort -u | wc -l")
    assert out.strip() == "1", out


async def test_stats_report_host_memory_beyond_the_cgroup(backend: ContainerBackend) -> None:
    """stats().memory_host_bytes adds what the host spends outside the sandbox's memory
    cgroup (its shrinker map grows with the superblocks of every sandbox held)."""
    from dsec.edge.backends.container.density import SUPERBLOCKS_PER_SANDBOX, uncharged_bytes

    sid = new_sid()
    await backend.create(sid, SPEC)
    st = await backend.stats(sid)
    assert st.memory_bytes > 0
    assert backend.shared_sysfs and backend.shared_scratch   # the defaults: 4 of its own
    assert st.memory_host_bytes == st.memory_bytes + uncharged_bytes(1, 4)
    # the quadratic term: each sandbox's map grows by 1 KiB per 64 superblocks held
    assert SUPERBLOCKS_PER_SANDBOX == 6
    assert uncharged_bytes(10_000) - uncharged_bytes(1_000) == (938 - 94) * 1024


async def test_shared_sysfs_is_one_superblock_read_only_and_shows_no_host_interface(
        backend: ContainerBackend, tmp_path: object, images_dir: str) -> None:
    """The node's shared sysfs (issue 22, the next density cut): every loopback-only
    sandbox's /sys is the same superblock, from an empty network namespace (its lo only,
    never the host's interfaces), read-only and nosuid/nodev/noexec; nothing written
    anywhere in it; a backend with shared_sysfs=False gives each sandbox its own."""
    import os

    from dsec.edge.backends.container import DirectoryImages
    from tests.edge.container.conftest import _cleanup

    a, b = new_sid(), new_sid()
    await backend.create(a, SPEC)
    await backend.create(b, SPEC)
    devs = set()
    for sid in (a, b):
        _code, out = await _sh(backend, sid, "awk '$5 == \"/sys\"' /proc/self/mountinfo; "
                              "ls /sys/class/net; touch /sys/x 2>/dev/null || echo refused")
        line = out.splitlines()[0].split()
        devs.add(line[2])
        assert "ro" in line[5].split(",") and {"nosuid", "nodev", "noexec"} <= set(
            line[5].split(",")), line
        assert out.splitlines()[1:] == ["lo", "refused"], out
    assert len(devs) == 1, devs   # one superblock for both
    mountinfo = Path("/proc/self/mountinfo").read_text()
    host_sys = next(ln.split()[2] for ln in mountinfo.splitlines() if ln.split()[4] == "/sys")
    assert host_sys not in devs   # not the host's sysfs (its netns shows the host's eth0)
    own = ContainerBackend(root_dir=os.path.join(str(tmp_path), "own"),
                           images=DirectoryImages(images_dir), shared_sysfs=False)
    try:
        c = new_sid()
        await own.create(c, SPEC)
        _code, out = await _sh(own, c, "awk '$5 == \"/sys\"' /proc/self/mountinfo")
        assert out.split()[2] not in devs | {host_sys}, out
        assert not own.shared_sysfs
    finally:
        await _cleanup(own)


async def test_shared_sysfs_is_unmounted_at_close_even_with_sandboxes_left(
        tmp_path: object, images_dir: str) -> None:
    """close() leaves sandboxes running for a later adopt(); the shared sysfs and its
    namespace holder go anyway (a sandbox keeps its own bind); the next backend on the
    root mounts a new one, and its reconcile removes the sandbox nobody adopted."""
    import os

    from dsec.edge.backends.container import DirectoryImages
    from tests.edge.container.conftest import _cleanup

    root = os.path.join(str(tmp_path), "r")
    b = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir))
    path = b.shared_sysfs
    assert os.path.ismount(path) and os.path.ismount(path + ".netns")
    await b.create(new_sid(), SPEC)
    await b.close()
    assert not os.path.ismount(path) and not os.path.ismount(path + ".netns")
    b2 = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir))
    try:
        assert os.path.ismount(b2.shared_sysfs)
        assert len(await b2.reconcile(set())) == 1
    finally:
        await _cleanup(b2)
    assert not os.path.ismount(path)


async def test_shared_scratch_is_one_superblock_and_leaks_nothing_between_sandboxes(
        backend: ContainerBackend, tmp_path: object, images_dir: str) -> None:
    """The node's shared scratch tmpfs (issue 22: 4 superblocks per sandbox): every
    sandbox's /dev, /dev/shm and /tmp are its own directory of ONE tmpfs. What that must
    not change: no sandbox sees another's files or the dirs above its own (mountinfo
    roots), statfs shows no node-wide size or usage (no side channel on the others' use
    through `df /tmp`), no capability reaches other inodes by handle
    (CAP_DAC_READ_SEARCH: open_by_handle_at), bytes are charged to the writer's memory
    cgroup so its limit binds (one sandbox filling /tmp fails itself, not the others),
    and destroy removes its files (memory back)."""
    import os

    from dsec.edge.backends.container import DirectoryImages
    from dsec.wire.spec import SandboxSpec
    from tests.edge.container.conftest import _cleanup

    scratch = backend.shared_scratch
    assert scratch and os.path.ismount(scratch)
    assert os.stat(scratch).st_mode & 0o777 == 0o700
    small = SandboxSpec(backend="container", memory_bytes=48 << 20, pids_max=64)
    a, b = new_sid(), new_sid()
    await backend.create(a, small)
    await backend.create(b, SPEC)
    assert sorted(os.listdir(scratch)) == sorted([a, b])
    code, out = await _sh(backend, a, "echo secret-a > /tmp/f && echo s > /dev/shm/g")
    assert code == 0, out
    devs = set()
    for sid in (a, b):
        _code, out = await _sh(backend, sid, "grep -E ' /(tmp|dev) ' /proc/self/mountinfo")
        for line in out.strip().splitlines():
            f = line.split()
            devs.add(f[2])
            # the mount's root in the tmpfs is the sandbox's own dir, nothing above it
            assert f[3] in (f"/{sid}/tmp", f"/{sid}/dev"), line
    assert len(devs) == 1, devs
    code, out = await _sh(backend, b, "cat /tmp/f; ls -A /tmp /dev/shm; ls -a /tmp/..")
    assert "secret-a" not in out and "g" not in out.split() and a not in out, out
    # statfs: no size, no usage of the node-wide tmpfs (busybox stat -f: blocks, free)
    code, out = await _sh(backend, b, "stat -f -c '%b %f %c %d' /tmp")
    assert code == 0 and out.split() == ["0", "0", "0", "0"], out
    # no capability that opens inodes by handle across the shared superblock
    _code, out = await _sh(backend, b, "grep -E '^Cap(Eff|Bnd|Prm)' /proc/self/status")
    for line in out.strip().splitlines():
        assert not int(line.split()[1], 16) & (1 << 2), line   # CAP_DAC_READ_SEARCH
    # bytes are charged to the writer: a's memory limit stops its /tmp, b writes on
    assert (await backend.stats(a)).memory_tmpfs_bytes < 1 << 20
    code, out = await _sh(backend, a, "dd if=/dev/zero of=/tmp/z bs=1M count=8 2>&1")
    assert code == 0, out
    st = await backend.stats(a)
    assert st.memory_tmpfs_bytes >= 8 << 20 and st.memory_bytes >= 8 << 20, st
    assert (await backend.stats(b)).memory_tmpfs_bytes < 1 << 20
    code, out = await _sh(backend, a, "dd if=/dev/zero of=/tmp/big bs=1M count=96 2>&1")
    assert code != 0, out     # ENOMEM/ENOSPC or the OOM killer: past its 48 MiB
    code, out = await _sh(backend, b, "dd if=/dev/zero of=/tmp/y bs=1M count=8 2>&1 && "
                          "rm /tmp/y && echo ok")
    assert code == 0 and "ok" in out, out
    await backend.destroy(a)
    assert sorted(os.listdir(scratch)) == [b]
    # shared_scratch=False: a tmpfs of its own, not the node's
    own = ContainerBackend(root_dir=os.path.join(str(tmp_path), "own"),
                           images=DirectoryImages(images_dir), shared_scratch=False)
    try:
        c = new_sid()
        await own.create(c, SPEC)
        _code, out = await _sh(own, c, "grep -E ' /tmp ' /proc/self/mountinfo")
        assert out.split()[2] not in devs and out.split()[3] == "/tmp", out
        assert not own.shared_scratch
    finally:
        await _cleanup(own)


async def test_shared_scratch_outlives_close_with_sandboxes_and_reconcile_empties_it(
        tmp_path: object, images_dir: str) -> None:
    """close() leaving a sandbox for adopt() keeps the scratch tmpfs mounted (its files
    are removed through it); the next backend's reconcile of a sandbox nobody adopted
    removes its dir; with none left, close() unmounts it."""
    import os

    from dsec.edge.backends.container import DirectoryImages
    from tests.edge.container.conftest import _cleanup

    root = os.path.join(str(tmp_path), "r")
    b = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir))
    path = b.shared_scratch
    sid = new_sid()
    await b.create(sid, SPEC)
    code, _ = await _sh(b, sid, "echo x > /tmp/kept")
    assert code == 0
    await b.close()
    assert os.path.ismount(path) and os.listdir(path) == [sid]
    b2 = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir))
    try:
        assert b2.shared_scratch == path
        assert sid in b2.census().scratch
        assert len(await b2.reconcile(set())) == 1
        assert os.listdir(path) == []
    finally:
        await _cleanup(b2)
    assert not os.path.ismount(path)


def test_scratch_dir_is_refused_when_the_scratch_is_not_mounted(tmp_path: object) -> None:
    """A scratch unmounted under a running edge must not put a sandbox's /tmp on the
    host's disk: the create is refused with the reason."""
    import os

    from dsec.edge.backends.container.density import make_scratch_dir
    from dsec.errors import BackendError

    path = os.path.join(str(tmp_path), "scratch")
    os.makedirs(path)
    with pytest.raises(BackendError, match="not mounted"):
        make_scratch_dir(path, "sb-x")
    assert os.listdir(path) == []
