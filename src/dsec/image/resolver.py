"""The container backend's image resolver backed by the layer store and mount cache.

Implements ``dsec.edge.backends.container.images.ImageResolver``: ``acquire(spec)``
resolves ``spec.image`` / ``workspace`` / ``toolkits`` (or ``spec.snapshot``) to mounted
EROFS layers and returns their mount points, highest priority first; ``release`` drops
the references (the mount cache unmounts a layer when its last sandbox goes). The
returned token is the :class:`~dsec.image.compose.RootStack`, which is also the ``base``
a sandbox's first :func:`~dsec.image.packdiff.snapshot` needs.
"""

from __future__ import annotations

from dsec.edge.backends.container.images import RootLayers
from dsec.edge.spec import SandboxSpec
from dsec.errors import InvalidArgument
from dsec.image.compose import RootStack, acquire_stack, compose
from dsec.image.mount import MountCache
from dsec.image.packdiff import restore_stack
from dsec.image.store import LayerStore

__all__ = ["StoreImages"]


class StoreImages:
    """``ImageResolver`` over a :class:`LayerStore` and a node :class:`MountCache`."""

    def __init__(self, store: LayerStore, mount_cache: MountCache) -> None:
        self.store = store
        self.cache = mount_cache

    def stack_for(self, spec: SandboxSpec) -> RootStack:
        """The layer stack ``spec`` asks for (no mounting)."""
        if spec.snapshot is not None:
            if spec.workspace is not None or spec.toolkits:
                raise InvalidArgument(
                    "a sandbox started from a snapshot takes the snapshot's own image; "
                    "leave workspace and toolkits empty", field="snapshot")
            return restore_stack(self.store, spec.snapshot)
        return compose(self.store.get(spec.image),
                       self.store.get(spec.workspace) if spec.workspace else None,
                       [self.store.get(t) for t in spec.toolkits])

    def acquire(self, spec: SandboxSpec) -> RootLayers:
        stack = self.stack_for(spec)
        lowers = acquire_stack(self.store, self.cache, stack)
        return RootLayers(tuple(lowers), token=stack)

    def release(self, layers: RootLayers) -> None:
        stack = layers.token
        if not isinstance(stack, RootStack):
            raise InvalidArgument("release() got layers this resolver did not hand out")
        for d in stack.digests:
            self.cache.release(d)
