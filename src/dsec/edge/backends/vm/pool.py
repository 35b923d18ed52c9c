"""The vm backend's warm pool: one saved guest per VM shape, cloned by every create.

A cold create boots a kernel and the agent (seconds under TCG). A warm one starts QEMU
with ``-incoming`` from a memory file of a guest that already booted to ``hello`` (no
``setup`` yet: no sandbox state in it) and gives it a fresh scratch disk; the agent then
mounts the sandbox (``setup``). One file serves any number of creates: it is only read.

A restored guest must see the same devices as the one that was saved, so the template
is keyed by everything that shapes them: the layer files, the guest RAM and vCPUs, the
scratch disk size (virtio-blk's capacity is read once by the guest driver at boot), the
kernel, initramfs and command line, and the extra QEMU arguments (density options).

Clones share the template's kernel state. Its random-number generator state is not
replayed: every QEMU start gets a new ``vmgenid`` generation id (qemu.py), on which the
guest kernel reseeds (docs/vm-host.md).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PoolKey", "WarmPool"]


@dataclass(frozen=True, slots=True)
class PoolKey:
    layer_files: tuple[str, ...]
    memory_mib: int
    vcpus: int
    disk_bytes: int
    kernel: str
    initrd: str
    append: str
    extra: tuple[str, ...]
    console: bool

    def digest(self) -> str:
        """A stable name for this shape (pure). Files are named by path, size and mtime:
        a layer or kernel rewritten in place gets a new template."""
        def ident(p: str) -> list[object]:
            try:
                st = os.stat(p)
                return [p, st.st_size, st.st_mtime_ns]
            except OSError:
                return [p]
        doc = [[ident(p) for p in self.layer_files], self.memory_mib, self.vcpus,
               self.disk_bytes, ident(self.kernel), ident(self.initrd), self.append,
               list(self.extra), self.console]
        return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:32]


class WarmPool:
    """Template memory files under ``root`` (``<digest>.mem``), at most ``max_templates``
    of them (the least recently used one goes first)."""

    def __init__(self, root: str, *, max_templates: int = 8) -> None:
        self.root = root
        self.max_templates = max_templates
        os.makedirs(root, mode=0o700, exist_ok=True)

    def path(self, key: PoolKey) -> str:
        return os.path.join(self.root, key.digest() + ".mem")

    def get(self, key: PoolKey) -> str | None:
        """The template for ``key`` if one is saved (its use time is touched)."""
        p = self.path(key)
        try:
            os.utime(p)
        except FileNotFoundError:
            return None
        return p

    def build_dir(self, key: PoolKey) -> str:
        """Where a template VM for ``key`` runs while it is made."""
        return os.path.join(self.root, key.digest() + ".build")

    def commit(self, key: PoolKey, mem_file: str) -> str:
        """Install ``mem_file`` (in :meth:`build_dir`) as the template of ``key``, and
        evict beyond ``max_templates``."""
        p = self.path(key)
        os.replace(mem_file, p)
        self._evict(keep=p)
        return p

    def _evict(self, keep: str) -> None:
        mems = [os.path.join(self.root, n) for n in os.listdir(self.root) if n.endswith(".mem")]
        for p in evictable(mems, self.max_templates, keep=keep):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


def evictable(paths: Sequence[str], limit: int, *, keep: str) -> list[str]:
    """The templates to remove so at most ``limit`` stay: least recently used first,
    never ``keep``."""
    def used(p: str) -> float:
        try:
            return os.stat(p).st_mtime
        except OSError:
            return 0.0
    others = sorted((p for p in paths if p != keep), key=used)
    excess = len(paths) - limit
    return others[:max(0, excess)]
