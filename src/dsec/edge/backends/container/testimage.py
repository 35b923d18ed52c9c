"""A tiny busybox root tree for tests, benchmarks and demos (no network needed).

``build_busybox_root(dir)`` copies Debian's static busybox into ``dir/bin`` and installs
its applets as symlinks, plus the handful of files a shell session expects (/etc/passwd
with root and an unprivileged ``agent`` user, mountpoints). ~1 MB, built in ~20 ms.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from dsec.rmtree import remove_tree

__all__ = ["BUSYBOX", "build_busybox_root"]

BUSYBOX = "/bin/busybox"


def build_busybox_root(path: str, *, busybox: str = BUSYBOX) -> str:
    """Create (or reuse, if complete) a busybox root at ``path``; returns ``path``."""
    marker = os.path.join(path, ".dsec-image-ok")
    if os.path.exists(marker):
        return path
    if not os.path.exists(busybox):
        raise FileNotFoundError(f"{busybox} not found: install busybox-static (make setup)")
    tmp = f"{path}.tmp{os.getpid()}"
    remove_tree(tmp)
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "etc", "root", "home/agent", "tmp",
              "proc", "dev", "sys", "var/tmp", "workspace"):
        os.makedirs(os.path.join(tmp, d), exist_ok=True)
    shutil.copy2(busybox, os.path.join(tmp, "bin/busybox"))
    subprocess.run(["/bin/busybox", "chroot", tmp, "/bin/busybox", "--install", "-s"],
                   check=True, capture_output=True)
    with open(os.path.join(tmp, "etc/passwd"), "w") as f:
        f.write("root:x:0:0:root:/root:/bin/sh\nagent:x:1000:1000:agent:/home/agent:/bin/sh\n"
                "nobody:x:65534:65534:nobody:/:/bin/false\n")
    with open(os.path.join(tmp, "etc/group"), "w") as f:
        f.write("root:x:0:\nagent:x:1000:\nnogroup:x:65534:\n")
    with open(os.path.join(tmp, "etc/hosts"), "w") as f:
        f.write("127.0.0.1 localhost\n")
    os.chown(os.path.join(tmp, "home/agent"), 1000, 1000)
    os.chmod(os.path.join(tmp, "tmp"), 0o1777)
    open(os.path.join(tmp, ".dsec-image-ok"), "w").close()
    try:
        os.rename(tmp, path)
    except OSError:  # built concurrently by someone else
        remove_tree(tmp)
    return path
