"""Issue 22, lighter mounts: `/dev`, `/dev/shm` and `/tmp` are directories of one
per-sandbox tmpfs and the masks a bind of a deleted empty directory of it (4 superblocks
per sandbox became 1). Nothing is shared between sandboxes, and every per-mount rule the
separate mounts had still holds: /dev/shm and /tmp are nodev/nosuid (/dev/shm noexec),
the masked directories are empty and nothing can be created in them, the scratch tmpfs's
own root and its dev/tmp split are invisible."""

from __future__ import annotations

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
    assert st.memory_host_bytes == st.memory_bytes + uncharged_bytes(1)
    # the quadratic term: each sandbox's map grows by 1 KiB per 64 superblocks held
    assert SUPERBLOCKS_PER_SANDBOX == 6
    assert uncharged_bytes(10_000) - uncharged_bytes(1_000) == (938 - 94) * 1024
