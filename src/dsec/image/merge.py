"""Offline merging of consecutive small layers into one.

Long snapshot chains cost a lowerdir each (overlay allows 500, and every lookup walks the
stack), so consecutive layers below a size threshold are merged into a single layer.
Deletions survive the merge as whiteouts and opaque marks, so the merged layer hides
exactly what the originals hid in the layers below it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from dsec.errors import InvalidArgument
from dsec.image.compose import RootStack, acquire_stack
from dsec.image.erofs import Compression
from dsec.image.manifest import PROJECT_LABEL, LayerKind, LayerManifest, layer_namespace
from dsec.image.mount import MountCache
from dsec.image.store import LayerStore
from dsec.image.tree import apply_tree

__all__ = ["merge_layers", "plan_merges"]


def plan_merges(sizes: Sequence[int], threshold_bytes: int) -> list[tuple[int, int]]:
    """Runs ``[start, end)`` of >= 2 consecutive layers each under the threshold (pure)."""
    runs: list[tuple[int, int]] = []
    start: int | None = None
    for i, size in enumerate([*sizes, threshold_bytes]):
        small = size < threshold_bytes and i < len(sizes)
        if small and start is None:
            start = i
        elif not small and start is not None:
            if i - start >= 2:
                runs.append((start, i))
            start = None
    return runs


def merge_layers(store: LayerStore, cache: MountCache, layers: Sequence[LayerManifest], *,
                 kind: LayerKind | None = None, bottom: bool = False,
                 name: str | None = None, tag: str = "latest",
                 compression: Compression | None = None) -> LayerManifest:
    """Merge ``layers`` (highest first, consecutive in some stack) into one new layer.

    ``bottom=True`` says nothing lies below them, so whiteouts can be dropped. A merged
    run of snapshots keeps the chain linkage: its parent is the parent of the lowest one.
    """
    if len(layers) < 2:
        raise InvalidArgument(f"merging needs at least two layers, got {len(layers)}")
    lowest = layers[-1]
    kinds = {m.kind for m in layers}
    out_kind: LayerKind = kind or (lowest.kind if len(kinds) == 1 else "base")
    if out_kind == "snapshot":
        for upper_m, lower_m in itertools.pairwise(layers):
            if upper_m.parent != lower_m.digest:
                raise InvalidArgument(f"snapshot {upper_m.digest} is not the child of "
                                      f"{lower_m.digest}; only consecutive chains merge")
    # The merged tree holds every input's files, so it belongs where the most private of
    # them does: cluster-wide only when all are; never to two projects at once.
    projects = {layer_namespace(m) for m in layers} - {None}
    if len(projects) > 1:
        raise InvalidArgument(f"cannot merge layers of different projects "
                              f"({', '.join(sorted(str(p) for p in projects))}): the merged "
                              "layer would belong to all of them")
    namespace = projects.pop() if projects else None
    if namespace == "" and out_kind != "snapshot":
        raise InvalidArgument("cannot merge a snapshot that names no project into a "
                              f"{out_kind} layer: it would become cluster-wide")
    labels = {"merged_from": ",".join(m.digest for m in layers)}
    if namespace is not None and PROJECT_LABEL in lowest.labels:
        labels[PROJECT_LABEL] = lowest.labels[PROJECT_LABEL]
    stack = RootStack(tuple(layers))
    mounts = acquire_stack(store, cache, stack)
    try:
        with store.staging("merge-") as stage:
            for path in reversed(mounts):
                apply_tree(path, stage, keep_whiteouts=not bottom)
            merged = store.add_tree(
                stage, kind=out_kind, name=name, tag=tag, compression=compression,
                labels=labels, namespace=namespace or None,
                parent=lowest.parent if out_kind == "snapshot" else None,
                stack=lowest.stack if out_kind == "snapshot" else ())
        if out_kind == "snapshot":
            # The merged layer stands for the top one's upperdir state: later snapshots
            # of the same sandbox diff against it.
            idx = store.read_index(layers[0].digest)
            if idx is not None:
                store.write_index(merged.digest, idx)
        return merged
    finally:
        for m in layers:
            cache.release(m.digest)
