"""A helper in a private mount namespace (the bootstrap's mmdebstrap) must not pin the
host's other mounts: an edge's disk pool unmounted on the host kept its loop device and
its deleted image while a bootstrap beside it ran (CI: test_leaks' kill -9 test)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from dsec.edge.backends.container.disk import loops_of
from dsec.image.bootstrap import BootstrapPlan, contained
from dsec.mountshed import foreign_mounts

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="by design: needs root (mounts)")

MOUNTINFO = """\
22 1 0:21 / / rw - ext4 /dev/vda1 rw
23 22 0:22 / /proc rw - proc proc rw
24 22 0:23 / /sys rw - sysfs sysfs rw
25 24 0:24 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
26 22 0:6 / /dev rw - devtmpfs devtmpfs rw
27 26 0:25 / /dev/shm rw - tmpfs tmpfs rw
28 22 0:26 / /usr ro - ext4 /dev/vda2 ro
29 22 0:27 / /run rw - tmpfs tmpfs rw
30 29 0:28 / /run/dsec/m1 ro - erofs /dev/loop1 ro
31 29 0:4 net:[4026532] /run/netns/a rw - nsfs nsfs rw
32 22 0:29 / /work rw - ext4 /dev/vdb rw
33 32 0:30 / /work/state/container/pool rw - btrfs /dev/loop5 rw
34 32 0:30 / /work/state/container/pool rw - btrfs /dev/loop5 rw
35 32 0:31 / /work/store rw - ext4 /dev/vdc rw
36 22 0:32 / /tmp/with\\040space rw - tmpfs tmpfs rw
37 28 0:33 / /usr/local/fuse rw - fuse.lazy lazy rw
38 22 0:21 /run/resolv.conf /etc/resolv.conf rw - ext4 /dev/vda1 rw
39 22 0:21 /ca.pem /opt/ca.pem rw master:1 - ext4 /dev/vda1 rw
40 22 0:34 / /etc/ssl/private rw - tmpfs tmpfs rw
"""
FILES = {"/run/netns/a", "/etc/resolv.conf", "/opt/ca.pem"}


def test_only_root_system_api_and_kept_mounts_stay() -> None:
    out = foreign_mounts(MOUNTINFO, ["/work/store/tmp/stage/root"],
                         lambda p: p not in FILES)
    assert sorted(out) == sorted(["/run/dsec/m1", "/run/netns/a", "/tmp/with space",
                                  "/work/state/container/pool",
                                  "/work/state/container/pool", "/usr/local/fuse"])
    depths = [p.count("/") for p in out]
    assert depths == sorted(depths, reverse=True)     # deepest first
    # nothing kept: every mount that is not /, a system dir or an API tree goes
    # the host's configuration as container hosts bind it stays (/etc and file binds);
    # a namespace pin on a file (nsfs) goes
    assert not {"/etc/resolv.conf", "/opt/ca.pem", "/etc/ssl/private"} & set(out)
    assert "/work" in foreign_mounts(MOUNTINFO, [])
    assert "/work" not in foreign_mounts(MOUNTINFO, ["/work/x"])


def test_the_file_mirror_and_target_are_kept() -> None:
    plan = BootstrapPlan.parse(suite="bookworm", include="", mirror="file:///srv/repo",
                               trusted=True)
    assert plan.keep_paths("/s/root") == ["/s/root", "/srv/repo"]
    argv = contained(["true"], plan.keep_paths("/s/root"))
    i = argv.index("dsec.mountshed")
    assert argv[i + 1:] == ["--keep", "/s/root", "--keep", "/srv/repo", "--keep",
                            os.path.realpath("/tmp"), "--", "true"]


def _loop_mount(tmp: str) -> tuple[str, str]:
    img, mnt = os.path.join(tmp, "disk.img"), os.path.join(tmp, "m")
    with open(img, "wb") as f:
        f.truncate(8 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", img], check=True, capture_output=True)
    os.mkdir(mnt)
    subprocess.run(["mount", "-o", "loop", img, mnt], check=True)
    return img, mnt


def _hold(argv_prefix: list[str], out: str) -> subprocess.Popen[bytes]:
    """A long helper in a private mount namespace that wrote what it sees to ``out``."""
    p = subprocess.Popen([*argv_prefix, "sh", "-c",
                          (f"cat /proc/self/mountinfo > {out}.tmp && mv {out}.tmp {out}; "
                           "exec sleep 60")])
    deadline = time.monotonic() + 20
    while not os.path.exists(out):
        assert p.poll() is None and time.monotonic() < deadline, "the holder did not start"
        time.sleep(0.02)
    return p


def _gone(img: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while loops_of(img):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_contained_helper_does_not_pin_a_host_mount(tmp_path: object) -> None:
    tmp = str(tmp_path)
    img, mnt = _loop_mount(tmp)
    plain = shed = None
    try:
        # the baseline this guards against: a plain private namespace keeps the loop
        # device (and the filesystem) after the host unmounts it
        plain = _hold(["unshare", "--mount", "--propagation", "private", "--"],
                      os.path.join(tmp, "plain"))
        with open(os.path.join(tmp, "plain")) as f:
            assert f" {mnt} " in f.read()
        subprocess.run(["umount", mnt], check=True)
        assert loops_of(img), "a private copy should hold the loop device"
        plain.kill()
        plain.wait()
        assert _gone(img, 10)

        subprocess.run(["mount", "-o", "loop", img, mnt], check=True)
        shed = _hold(contained([], [os.path.join(tmp, "target")]),
                     os.path.join(tmp, "shed"))
        with open(os.path.join(tmp, "shed")) as f:
            seen = [line.split()[4] for line in f]
        assert mnt not in seen
        assert "/" in seen and "/proc" in seen and "/dev" in seen
        subprocess.run(["umount", mnt], check=True)
        assert _gone(img, 10), "the contained helper still pins the loop device"
        assert shed.poll() is None     # ... while it runs
    finally:
        for p in (plain, shed):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", mnt], check=False)
