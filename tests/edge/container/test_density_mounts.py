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
    # the other sandbox sees none of it (its own scratch tmpfs)
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
    assert backend.shared_sysfs   # the default: 5 superblocks of its own
    assert st.memory_host_bytes == st.memory_bytes + uncharged_bytes(1, 5)
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
