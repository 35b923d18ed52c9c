"""The container backend: real Linux isolation (see backend.py and docs/container.md).

Exports are lazy (PEP 562) so the helper process, which imports a few modules of this
package, does not pull in asyncio and the backend itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsec.edge.backends.container.backend import ContainerBackend
    from dsec.edge.backends.container.images import DirectoryImages, ImageResolver, RootLayers

__all__ = ["ContainerBackend", "DirectoryImages", "ImageResolver", "RootLayers", "make_backend"]


def __getattr__(name: str) -> Any:
    if name == "ContainerBackend":
        from dsec.edge.backends.container.backend import ContainerBackend

        return ContainerBackend
    if name in ("DirectoryImages", "ImageResolver", "RootLayers"):
        from dsec.edge.backends.container import images

        return getattr(images, name)
    raise AttributeError(name)


def make_backend(**opts: Any) -> ContainerBackend:
    """Registry hook (``dsec.edge.backends.make_backend("container", ...)``).

    Takes ``root_dir`` and either ``images`` (an ImageResolver) or ``images_dir`` (a
    directory of plain root trees for :class:`DirectoryImages`), plus any other
    :class:`ContainerBackend` keyword such as ``runtime="runc"``.
    """
    from dsec.edge.backends.container.backend import ContainerBackend
    from dsec.edge.backends.container.images import DirectoryImages

    if "images" not in opts:
        opts["images"] = DirectoryImages(opts.pop("images_dir"))
    return ContainerBackend(**opts)
