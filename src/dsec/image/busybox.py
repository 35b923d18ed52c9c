"""A tiny busybox-static base layer for tests, the demo and the container backend."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess

from dsec.errors import ImageError, ImageNotFound
from dsec.image.manifest import LayerManifest
from dsec.image.store import LayerStore

__all__ = ["BUSYBOX_NAME", "ensure_busybox_base", "stage_busybox_root"]

BUSYBOX_NAME = "busybox"
_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")

_FILES = {
    "etc/passwd": "root:x:0:0:root:/root:/bin/sh\n"
                  "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
    "etc/group": "root:x:0:\nnogroup:x:65534:\n",
    "etc/hostname": "sandbox\n",
    "etc/hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
    "etc/resolv.conf": "",
    "etc/nsswitch.conf": "passwd: files\ngroup: files\nhosts: files dns\n",
    "etc/profile": "export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n",
}
_DIRS = {"bin": 0o755, "sbin": 0o755, "usr/bin": 0o755, "usr/sbin": 0o755, "etc": 0o755,
         "root": 0o700, "home": 0o755, "tmp": 0o1777, "var/tmp": 0o1777, "proc": 0o555,
         "sys": 0o555, "dev": 0o755, "run": 0o755, "mnt": 0o755, "work": 0o755,
         "workspace": 0o755}


def _busybox() -> str:
    for p in _CANDIDATES:
        if os.path.isfile(p):
            return p
    raise ImageError("busybox not found: install the Debian package busybox-static")


def stage_busybox_root(dest: str) -> None:
    """Fill ``dest`` with a minimal root: /bin/busybox, applet links, /etc basics."""
    bb = _busybox()
    for d, mode in _DIRS.items():
        os.makedirs(os.path.join(dest, d), exist_ok=True)
        os.chmod(os.path.join(dest, d), mode)
    shutil.copy2(bb, os.path.join(dest, "bin/busybox"))
    # `busybox --list-full` is what `busybox --install -s` would link, without touching
    # the host's /bin: one absolute symlink per applet, resolved inside the sandbox root.
    listing = subprocess.run([bb, "--list-full"], capture_output=True, text=True, check=True)
    for rel in listing.stdout.split():
        if rel == "bin/busybox" or rel.startswith("/") or ".." in rel:
            continue
        link = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        if not os.path.lexists(link):
            os.symlink("/bin/busybox", link)
    for rel, text in _FILES.items():
        with open(os.path.join(dest, rel), "w") as f:
            f.write(text)
        os.chmod(os.path.join(dest, rel), 0o644)
    # Every entry dated by the busybox binary, not by when this ran: the same binary gives
    # the same base layer digest on every node and in every store (reproducible layers).
    when = os.stat(bb).st_mtime_ns
    os.chmod(dest, 0o755)
    for dirpath, dirnames, filenames in os.walk(dest, topdown=False):
        for n in dirnames + filenames:
            os.utime(os.path.join(dirpath, n), ns=(when, when), follow_symlinks=False)
    os.utime(dest, ns=(when, when))


def ensure_busybox_base(store: LayerStore) -> LayerManifest:
    """The busybox base layer, built once per store per busybox binary.

    Tagged ``busybox:<12 hex of the binary's sha256>`` (so an upgraded busybox builds a
    new layer) and ``busybox:latest``.
    """
    with open(_busybox(), "rb") as f:
        version = hashlib.sha256(f.read()).hexdigest()[:12]
    try:
        m = store.get(f"{BUSYBOX_NAME}:{version}")
        if os.path.exists(store.layer_path(m)):
            store.tag(m.digest, BUSYBOX_NAME, "latest")
            return m
    except ImageNotFound:
        pass
    with store.staging("busybox-") as stage:
        stage_busybox_root(stage)
        m = store.add_tree(stage, kind="base", name=BUSYBOX_NAME, tag=version,
                           labels={"source": "busybox-static"})
    store.tag(m.digest, BUSYBOX_NAME, "latest")
    return m
