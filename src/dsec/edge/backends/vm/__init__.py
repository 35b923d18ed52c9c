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
    keyword. ``kernel``/``initrd`` default to the guest built by :mod:`.guest` (the
    kernel fetched by ``make setup``, the initramfs holding the agent)."""
    from dsec.edge.backends.container.images import DirectoryImages
    from dsec.edge.backends.vm.backend import VmBackend

    if "images" not in opts:
        opts["images"] = DirectoryImages(opts.pop("images_dir"))
    if "kernel" not in opts or "initrd" not in opts:
        from dsec.edge.backends.vm import guest

        kernel, initrd = guest.boot_files()  # type: ignore[attr-defined]
        opts.setdefault("kernel", kernel)
        opts.setdefault("initrd", initrd)
    return VmBackend(**opts)
