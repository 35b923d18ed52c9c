"""mountshed detaches every foreign mount of the bootstrap's namespace, but the helper
keeps the working directory it inherited (``_run`` passes no ``cwd``; mountshed never
chdirs; mmdebstrap's main process keeps it). A cwd is a reference to its mount: the
MNT_DETACH takes the mount out of the namespace, yet the superblock - and its loop
device, its deleted image file - stays until the bootstrap ends. So ``dsec image
bootstrap`` started from a directory on an edge's disk pool, an EROFS layer mount or
any loop-mounted filesystem pins it for the whole run: exactly what dsec.mountshed
exists to prevent.

Repro: a loop-mounted ext4 at tmp/m; ``contained([...sleep])`` started with cwd=tmp/m;
the host unmounts tmp/m; its loop device must be released while the helper runs.

Severity: low (needs the caller's cwd on a foreign mount; effect: the pin of F18's
neighbour, a pool/loop device held for the bootstrap's run).

Fix: mountshed ``os.chdir("/")`` (or into a kept path) before detaching, or ``_run``
passes ``cwd="/"`` to the contained helper (its paths are all absolute).
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from dsec.edge.backends.container.disk import loops_of
from dsec.image.bootstrap import contained

pytestmark = [pytest.mark.root]


def _gone(img: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while loops_of(img):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_the_bootstraps_cwd_does_not_pin_a_host_mount(tmp_path: object) -> None:
    tmp = str(tmp_path)
    img, mnt, seen = os.path.join(tmp, "disk.img"), os.path.join(tmp, "m"), os.path.join(tmp, "seen")
    with open(img, "wb") as f:
        f.truncate(8 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", img], check=True, capture_output=True)
    os.mkdir(mnt)
    subprocess.run(["mount", "-o", "loop", img, mnt], check=True)
    p = None
    try:
        p = subprocess.Popen(contained(["sh", "-c", (f"echo up > {seen}.tmp && mv {seen}.tmp "
                                                     f"{seen}; exec sleep 60")],
                                       [os.path.join(tmp, "target")]),
                             cwd=mnt, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while not os.path.exists(seen):
            assert p.poll() is None and time.monotonic() < deadline, "helper did not start"
            time.sleep(0.02)
        subprocess.run(["umount", mnt], check=True)
        released = _gone(img, 10)
        assert p.poll() is None
        assert released, (f"the contained bootstrap helper, started with its cwd on {mnt}, "
                          f"still holds {loops_of(img)} after the host unmounted it")
    finally:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", mnt], check=False)
        _gone(img, 10)
