"""Name a built image: a build's step layers on its base become one named image.

A build (:mod:`dsec.client.build`) leaves a chain of snapshot layers (one per step, each
the child of the previous) over the image stack it started from. Snapshots are not
images (a name never points at one: :meth:`LayerStore.tag`), so to name the result the
chain is laid into one new ``base`` layer (whiteouts kept: it sits on the base) whose
``stack`` is the base image's own (its top layer and the layers below it), the same
form as a pulled multi-layer image's top layer (:mod:`dsec.image.pull`), with the
build's config as the same ``oci.*`` labels a pull writes, so ``create(image=NAME)``
composes and configures it exactly like a pulled image. The base's layers are shared,
not copied: promoting a 3-step build on a 250 MB Debian base writes only the steps.

``squash=True`` flattens the base in as well: one standalone layer (no ``stack``), every
whiteout applied, what a template is in Modal or E2B. It costs the base's bytes again
(on disk, in the quota and in every node's mount cache) and shares nothing, so it is
not the default; it helps an image of many layers (a pulled one near the layer limit)
or one that must not change when its base's layers are pruned or replaced.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from dsec.errors import InvalidArgument
from dsec.image.compose import RootStack, acquire_stack
from dsec.image.manifest import LayerManifest, layer_namespace
from dsec.image.mount import MountCache
from dsec.image.store import LayerStore, Pin
from dsec.image.tree import apply_tree

__all__ = ["BUILT_FROM_LABEL", "build_chain", "promote_chain"]

BUILT_FROM_LABEL = "dsec.io/built-from"


def build_chain(store: LayerStore, top: str, base: str) -> tuple[list[LayerManifest],
                                                                  list[LayerManifest]]:
    """The snapshot chain of ``top`` (highest first) and the image stack below it, which
    must be exactly ``base``'s (its top layer and that layer's own stack): a build on a
    workspace or toolkits, or on another image, is refused (``InvalidArgument``)."""
    m = store.get(top)
    if m.kind != "snapshot":
        raise InvalidArgument(f"{top} is a {m.kind} layer, not a build's snapshot", field="top")
    lowers = store.lowers(m)
    n = next(i for i, x in enumerate(lowers) if x.kind != "snapshot") \
        if any(x.kind != "snapshot" for x in lowers) else len(lowers)
    chain, image = lowers[:n], lowers[n:]
    b = store.get(base)
    want = [b.digest, *b.stack]
    if [x.digest for x in image] != want:
        raise InvalidArgument(
            f"snapshot {m.digest} stands on {[x.digest for x in image]}, not on the image "
            f"{b.ref} ({want}): a build is named on the base it was built from, without "
            "workspace or toolkits", field="base")
    return chain, image


def promote_chain(store: LayerStore, chain: list[LayerManifest], image: list[LayerManifest],
                  *, labels: Mapping[str, str], namespace: str | None, owner: str | None,
                  max_bytes: int | None = None, pin: Pin | None = None,
                  cache_factory: Callable[[], MountCache] = MountCache,
                  squash: bool = False) -> LayerManifest:
    """Lay ``chain`` (highest first) into one new ``base`` layer standing on ``image``
    (highest first) in project ``namespace``, labelled ``labels``; unnamed (the caller
    names it once charged; ``pin`` holds it from a prune until then). Every chain layer
    must be the namespace's own. ``squash``: ``image`` is laid in too, and the layer
    stands on nothing."""
    for x in chain:
        if layer_namespace(x) != namespace:
            raise InvalidArgument(f"snapshot {x.digest} belongs to project "
                                  f"{layer_namespace(x)!r}, not {namespace!r}: a build is "
                                  "named in the project it ran in", field="target")
    cache = cache_factory()
    try:
        laid = [*chain, *image] if squash else chain
        mounts = acquire_stack(store, cache, RootStack(tuple(laid)))
        try:
            with store.staging("promote-") as stage:
                for path in reversed(mounts):          # lowest first
                    # flattened: nothing below the result for a whiteout to hide
                    apply_tree(path, stage, keep_whiteouts=not squash)
                return store.add_tree(
                    stage, kind="base", labels={**labels, BUILT_FROM_LABEL: chain[0].digest},
                    namespace=namespace, owner=owner,
                    stack=[] if squash else [x.digest for x in image],
                    max_bytes=max_bytes, what="built image", pin=pin)
        finally:
            for x in laid:
                cache.release(x.digest)
    finally:
        cache.close()
