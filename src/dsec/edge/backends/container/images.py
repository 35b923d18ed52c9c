"""Where a sandbox's read-only root layers come from.

The container backend asks an :class:`ImageResolver` for the lowerdirs of a spec's image
(and workspace/toolkit layers) at create and gives them back at destroy. The image store
supplies an EROFS-backed resolver (layers mounted once per node, shared by every sandbox);
:class:`DirectoryImages` is the plain-directory one used until then and by tests.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from dsec.edge.spec import SandboxSpec
from dsec.errors import ImageNotFound, InvalidArgument

__all__ = ["DirectoryImages", "ImageResolver", "RootLayers"]


@dataclass(frozen=True, slots=True)
class RootLayers:
    """Read-only directories that form a sandbox root, highest priority first (overlayfs
    ``lowerdir`` order). ``token`` is opaque to the backend and handed back on release."""

    lowerdirs: tuple[str, ...]
    token: object = None


@runtime_checkable
class ImageResolver(Protocol):
    def acquire(self, spec: SandboxSpec) -> RootLayers:
        """Resolve ``spec.image`` (+ workspace, toolkits) to mounted read-only dirs.

        Raise :class:`~dsec.errors.ImageNotFound` for an unknown ref. Called once per
        sandbox create and once per adopt after an edge restart."""

    def release(self, layers: RootLayers) -> None:
        """The sandbox that used ``layers`` is gone (a resolver may unmount at refcount 0)."""


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")


class DirectoryImages:
    """Maps an image ref to ``<images_dir>/<ref>``: a plain directory holding a root tree.

    Workspace and toolkit refs map the same way and stack above the image (toolkits last
    given win). The directories are never written: overlayfs keeps them as lowerdirs.
    """

    def __init__(self, images_dir: str) -> None:
        self.images_dir = os.path.abspath(images_dir)

    def _dir(self, ref: str, field: str) -> str:
        if not _NAME.fullmatch(ref) or ".." in ref:
            raise InvalidArgument(f"image ref {ref!r} in field {field} is not a plain name; "
                                  "use letters, digits, '_', '.', ':' and '-'", field=field)
        path = os.path.join(self.images_dir, ref)
        if not os.path.isdir(path):
            raise ImageNotFound(f"image {ref!r} not found: no directory {path}; build it "
                                f"there or use one of {sorted(os.listdir(self.images_dir))}",
                                image=ref)
        return path

    def acquire(self, spec: SandboxSpec) -> RootLayers:
        if spec.snapshot is not None:
            raise InvalidArgument(
                f"cannot start from snapshot {spec.snapshot[:80]!r}: this backend resolves "
                "images from plain directories, which hold no snapshots; use the layer "
                "store (StoreImages, as dsec up does)", field="snapshot")
        layers = [self._dir(t, "toolkits") for t in reversed(spec.toolkits)]
        if spec.workspace:
            layers.append(self._dir(spec.workspace, "workspace"))
        layers.append(self._dir(spec.image, "image"))
        return RootLayers(tuple(layers))

    def release(self, layers: RootLayers) -> None:
        return None
