"""The vm backend (isolation tier "vm"): each sandbox is a microVM with its own guest
kernel under QEMU, driven through a guest agent (backend.py; docs/vm.md).

Exports are lazy (PEP 562): the guest builder and the agent protocol are imported by
tools that need neither asyncio nor the backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsec.edge.backends.vm.backend import VmBackend

__all__ = ["VmBackend", "make_backend"]


def __getattr__(name: str) -> Any:
    if name == "VmBackend":
        from dsec.edge.backends.vm.backend import VmBackend

        return VmBackend
    raise AttributeError(name)


def make_backend(**opts: Any) -> VmBackend:
    """Registry hook (``dsec.edge.backends.make_backend("vm", ...)``).

    Takes ``root_dir`` and either ``images`` (an ImageResolver) or ``images_dir`` (plain
    root trees, packed into EROFS files on first use), plus any :class:`VmBackend`
    keyword (density and the warm pool default to on here). ``kernel``/``initrd``
    default to the guest built by :mod:`.guest` (the kernel fetched by ``make setup``,
    the initramfs holding the agent)."""
    from dsec.edge.backends.container.images import DirectoryImages
    from dsec.edge.backends.vm.backend import VmBackend
    from dsec.edge.backends.vm.density import DensityOptions

    if "images" not in opts:
        opts["images"] = DirectoryImages(opts.pop("images_dir"))
    # A node's vm tier runs dense by default (vd measured each mechanism: layers shared
    # through pmem+DAX, freed memory reported back, idle pages reclaimed) and keeps a
    # warm pool (create ~1-2 s restoring a saved guest instead of ~7-11 s booting under
    # TCG on a loaded 2-core host). ``density=None`` / ``warm_pool=False`` turn them off.
    opts.setdefault("density", DensityOptions())
    opts.setdefault("warm_pool", True)
    if "kernel" not in opts or "initrd" not in opts:
        from dsec.edge.backends.vm import guest

        k = guest.find_kernel()
        opts.setdefault("kernel", k.vmlinuz)
        opts.setdefault("initrd", guest.ensure_initramfs(k))
        opts.setdefault("append", guest.kernel_cmdline())
    return VmBackend(**opts)
