"""Where a sandbox's read-only root layers come from.

The container backend asks an :class:`ImageResolver` for the lowerdirs of a spec's image
(and workspace/toolkit layers) at create and gives them back at destroy.
:class:`StoreImages` is the EROFS-backed resolver over the layer store (layers mounted once
per node, shared by every sandbox; what ``dsec up`` uses); :class:`DirectoryImages` is the
plain-directory one used by tests and small setups.

The resolvers live here, with the backend that uses them, not in :mod:`dsec.image`: the
image package knows layers, stacks and mounts but nothing of sandboxes, so the edge sits
above it and the arrow runs one way (issue 13; it used to be ``dsec.image.resolver``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from dsec.errors import DsecError, ImageNotFound, InvalidArgument
from dsec.image.compose import RootStack, acquire_stack, compose
from dsec.image.manifest import LayerManifest
from dsec.image.mount import MountCache
from dsec.image.packdiff import restore_stack
from dsec.image.store import LayerStore
from dsec.wire.layers import MAX_CHAIN
from dsec.wire.spec import SandboxSpec

if TYPE_CHECKING:
    from dsec.edge.lazy.layers import LazyLayers

__all__ = ["DirectoryImages", "ImageResolver", "PinChange", "RootLayers", "StoreImages"]


@dataclass(frozen=True, slots=True)
class RootLayers:
    """Read-only directories that form a sandbox root, highest priority first (overlayfs
    ``lowerdir`` order). ``token`` is opaque to the backend and handed back on release."""

    lowerdirs: tuple[str, ...]
    token: object = None


@dataclass(frozen=True, slots=True)
class PinChange:
    """What :meth:`StoreImages.apply_pins` did: layer digests pinned and unpinned, and
    the images it could not resolve (tried again with the next set)."""

    pinned: tuple[str, ...] = ()
    unpinned: tuple[str, ...] = ()
    unresolved: tuple[str, ...] = ()


@runtime_checkable
class ImageResolver(Protocol):
    def acquire(self, spec: SandboxSpec) -> RootLayers:
        """Resolve ``spec.image`` (+ workspace, toolkits) to mounted read-only dirs.

        Raise :class:`~dsec.errors.ImageNotFound` for an unknown ref. Called once per
        sandbox create and once per adopt after an edge restart."""

    def release(self, layers: RootLayers) -> None:
        """The sandbox that used ``layers`` is gone (a resolver may unmount at refcount 0)."""


_FULL_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def _meaning(m: LayerManifest) -> tuple[object, ...]:
    """What a lazily read layer's manifest says that the node acts on (names, owners
    and timestamps are the store's own business: a store shared with the control plane
    keeps its richer record when it says the same)."""
    return (m.kind, m.parent, m.stack, m.size_bytes, m.chunk_table, m.namespace)
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


class StoreImages:
    """``ImageResolver`` over a :class:`LayerStore` and a node :class:`MountCache`.

    ``acquire(spec)`` resolves ``spec.image`` / ``workspace`` / ``toolkits`` (or
    ``spec.snapshot``) to mounted EROFS layers and returns their mount points, highest
    priority first; ``release`` drops the references (the mount cache unmounts a layer when
    its last sandbox goes). The returned token is the :class:`~dsec.image.compose.RootStack`,
    which is also the ``base`` a sandbox's first :func:`~dsec.image.packdiff.snapshot` needs.
    """

    def __init__(self, store: LayerStore, mount_cache: MountCache,
                 lazy: LazyLayers | None = None) -> None:
        self.store = store
        self.cache = mount_cache
        self.lazy = lazy

    def _get(self, ref: str) -> LayerManifest:
        """The manifest of ``ref`` in the node's store. A layer the node reads lazily is
        there only once the control plane granted it (:meth:`grant`): a digest the store
        does not know is ``ImageNotFound`` - never looked up in the blob store, whose
        ``.manifest`` any writer of the store could forge (red team 17 F1)."""
        try:
            m = self.store.get(ref)
        except ImageNotFound:
            if self.lazy is None or not _FULL_DIGEST.fullmatch(ref):
                raise
            raise ImageNotFound(
                f"layer {ref} is not on this node and the control plane granted no "
                "manifest for it: a node reads a layer from the blob store only with the "
                "control plane's record of it (sent with the create or the pins); create "
                "through the control plane, or push the image and retry", ref=ref) from None
        self._lazy_here(m)
        return m

    def _lazy_here(self, m: LayerManifest) -> None:
        """A layer recorded remote by another process sharing the store (``dsec up``'s
        edges share one): this node's daemon needs its chunk table too."""
        if self.lazy is not None and not os.path.exists(self.store.layer_path(m)):
            self.lazy.register(m)

    def grant(self, manifests: Sequence[LayerManifest]) -> list[str]:
        """Record layers the control plane says this node may read lazily (``layer_grant``,
        sent before a create, a snapshot relay or the pins that need them): each is the
        control plane's own manifest of a pushed layer, lowest first, with the sha256 of
        the chunk table its push published. The node fetches that table from the blob
        store, checks it against the record (:meth:`LazyLayers.register`) and only then
        records the layer remote in its store (no file). The blob store's ``.manifest``
        is never read: what a layer stands on, its kind and its chunk hashes all come
        from the control plane. Returns the digests now readable here (whole or lazily).
        """
        if self.lazy is None:
            raise InvalidArgument(
                "this node has no blob store (dsec edge --blob-store URL), so it cannot "
                "read layers lazily; the control plane relays them whole instead",
                field="manifests")
        if len(manifests) > MAX_CHAIN:
            raise InvalidArgument(f"{len(manifests)} layers granted at once is over the "
                                  f"limit of {MAX_CHAIN}", field="manifests")
        out = []
        for m in manifests:
            if m.kind == "snapshot":
                raise InvalidArgument(
                    f"layer {m.digest} is a snapshot: snapshots are relayed whole from the "
                    "node that took them, never read from the blob store", field="manifests")
            if self.store.has(m.digest):
                have = self.store.get(m.digest)
                if os.path.exists(self.store.layer_path(have)):
                    out.append(m.digest)        # whole here: nothing to read lazily
                    continue
                # recorded remote before: by a grant, or (an older node) from the blob
                # store's own .manifest - the control plane's record wins either way
                self.lazy.register(m)
                if _meaning(have) != _meaning(m):
                    self.store.replace_remote(m)
                out.append(m.digest)
                continue
            self.lazy.register(m)           # CorruptLayer/ImageNotFound: nothing recorded
            self.store.add_remote(m)        # ImageError if what it stands on is unknown
            out.append(m.digest)
        return out

    def stack_for(self, spec: SandboxSpec) -> RootStack:
        """The layer stack ``spec`` asks for (no mounting)."""
        if spec.snapshot is not None:
            if spec.workspace is not None or spec.toolkits:
                raise InvalidArgument(
                    "a sandbox started from a snapshot takes the snapshot's own image; "
                    "leave workspace and toolkits empty", field="snapshot")
            return restore_stack(self.store, spec.snapshot)
        base = self._get(spec.image)
        return compose(base,
                       self._get(spec.workspace) if spec.workspace else None,
                       [self._get(t) for t in spec.toolkits],
                       [self._get(d) for d in base.stack] if base.kind == "base" else ())

    def pin(self, ref: str) -> list[str]:
        """Keep the image ``ref`` fully cached on this node (``image_pin``, issue 17):
        every layer of it this node reads lazily is fetched whole in the background and
        never evicted. Resolves from the blob store what the node lacks. Returns the
        digests pinned (layers stored whole here need nothing)."""
        if self.lazy is None:
            return []
        m = self._get(ref)
        out = []
        for d in (m.digest, *m.stack):
            if self.lazy.knows(d):
                self.lazy.pin(d)
                out.append(d)
        return out

    def apply_pins(self, images: Sequence[str]) -> PinChange:
        """Make the node's pins exactly the layers of ``images`` (the control plane's
        pins for this node, ``ControlPlane.pins_for``, delivered by ``node_pins``): pin
        what is new, unpin what is no longer named. Idempotent. An image the blob store
        cannot resolve now is skipped and named in ``unresolved`` (the edge then does not
        report the set applied, so the control plane sends it again); while any is, no
        layer is unpinned (its layers are not known)."""
        if self.lazy is None:
            return PinChange()
        want: set[str] = set()
        unresolved: list[str] = []
        for ref in images:
            try:
                m = self._get(ref)
            except DsecError:
                unresolved.append(ref)
                continue
            want |= {d for d in (m.digest, *m.stack) if self.lazy.knows(d)}
        have = set(self.lazy.pinned)
        keep = have if unresolved else set()
        new, gone = sorted(want - have), sorted(have - want - keep)
        for d in new:
            self.lazy.pin(d)
        for d in gone:
            self.lazy.unpin(d)
        return PinChange(tuple(new), tuple(gone), tuple(unresolved))

    def unpin(self, ref: str) -> list[str]:
        """Undo :meth:`pin`: the image's chunks may be evicted again."""
        if self.lazy is None:
            return []
        m = self._get(ref)
        out = [d for d in (m.digest, *m.stack) if d in self.lazy.pinned]
        for d in out:
            self.lazy.unpin(d)
        return out

    def acquire(self, spec: SandboxSpec) -> RootLayers:
        stack = self.stack_for(spec)
        if self.lazy is not None:
            # prefetch the image's access trace (in the background, racing the mounts
            # below), or record one; keyed by the image layer (a task's workspace and
            # toolkits vary around it). A hint: never fails the create.
            image = stack.layers[0] if spec.snapshot is not None else self._get(spec.image)
            self.lazy.image_started(image.digest, stack.digests)
        lowers = acquire_stack(self.store, self.cache, stack)
        return RootLayers(tuple(lowers), token=stack)

    def release(self, layers: RootLayers) -> None:
        stack = layers.token
        if not isinstance(stack, RootStack):
            raise InvalidArgument("release() got layers this resolver did not hand out")
        for d in stack.digests:
            self.cache.release(d)
