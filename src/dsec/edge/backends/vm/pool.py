"""The vm backend's warm pool: one saved guest per VM shape, cloned by every create.

A cold create boots a kernel and the agent (seconds under TCG). A warm one starts QEMU
with ``-incoming`` from a memory file of a guest that already booted to ``hello`` (no
``setup`` yet: no sandbox state in it) and gives it a fresh scratch disk; the agent then
mounts the sandbox (``setup``). One file serves any number of creates: it is only read.

A restored guest must see the same devices as the one that was saved, so the template
is keyed by everything that shapes them: the layer files, the guest RAM and vCPUs, the
scratch disk size (virtio-blk's capacity is read once by the guest driver at boot), the
kernel, initramfs and command line, and the extra QEMU arguments (density options).

A template is saved only once its guest has probed every device (the agent's ``quiesce``
waits for that and says so): QEMU 7.2 restores a virtio device no driver had touched yet
so that its probe after the restore fails (docs/vm.md, "Devices"). A clone whose
``hello`` still lacks a device is not used: the create boots cold and logs why
(:func:`device_gaps`).

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

__all__ = ["PoolKey", "WarmPool", "device_gaps", "guest_block_devices"]


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


def guest_block_devices(n_layers: int, *, pmem: bool) -> list[str]:
    """The guest block devices a VM of ``n_layers`` layers gets (pure): the layers as
    ``pmem0..`` with the scratch disk ``vda``, or the layers as ``vda..`` and the scratch
    disk after them (the order of backend.py's ``_launch``)."""
    if pmem:
        return [f"pmem{i}" for i in range(n_layers)] + ["vda"]
    if n_layers + 1 > 26:
        raise ValueError(f"{n_layers} layers and a scratch disk do not fit in vda..vdz")
    return [f"vd{chr(ord('a') + i)}" for i in range(n_layers + 1)]


def device_gaps(want: Sequence[str], devices: Sequence[str], unbound: Sequence[str],
                probing: bool) -> str | None:
    """Why a guest reporting ``devices``/``unbound``/``probing`` (agent ``hello`` or
    ``quiesce``) is not ready to be saved or used as a clone, or None if it is (pure).
    The lists come from the guest: only a few of their items, cut short, are quoted."""
    def quote(items: Sequence[str]) -> str:
        shown = ", ".join(str(i)[:40] for i in items[:8])
        return shown + (f" (+{len(items) - 8} more)" if len(items) > 8 else "")

    have = set(devices)
    missing = [d for d in want if d not in have]
    why = []
    if missing:
        why.append(f"missing block device(s) {quote(missing)}")
    if unbound:
        why.append(f"virtio device(s) without a driver {quote(list(unbound))}")
    if probing:
        why.append("boot's module loader still running")
    return "; ".join(why) or None
