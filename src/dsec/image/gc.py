"""Which layers are referenced, and which to remove (pure; :meth:`LayerStore.prune` does
the I/O under the store's lock).

A layer is **referenced** - and never removed - when any of these holds it, directly or
through the layers it stands on (a snapshot's ``parent`` and ``stack``, any layer's
``stack``: an image is a stack of layers):

* a name (``refs.json``: tags of every project and cluster-wide);
* it is a snapshot: snapshots are objects users keep and delete themselves (``dsec
  snapshot rm``; the control plane charges them), never garbage;
* it is mounted on this node (a live sandbox's root, the edge's mount cache);
* a live process pinned it (an import or build that made it and has not named it yet,
  :class:`dsec.image.store.Pin`).

Everything else - mostly what a rebuild left behind when its name moved on - is
garbage. With a budget, the least recently used garbage goes first (``last_used``: the
latest mount, else the build) until the store fits; without one, all of it goes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["LayerNode", "PrunePlan", "plan_prune", "project_image_bytes", "referenced"]


@dataclass(frozen=True, slots=True)
class LayerNode:
    """What the plan needs of one stored layer."""

    digest: str
    kind: str
    size_bytes: int
    last_used: float
    below: tuple[str, ...] = ()
    """Digests this layer stands on (parent, stack)."""


@dataclass(frozen=True, slots=True)
class PrunePlan:
    remove: tuple[str, ...]
    """Digests to remove, least recently used first."""
    freed_bytes: int
    kept_bytes: int
    referenced: frozenset[str]


def referenced(layers: Mapping[str, LayerNode], roots: Iterable[str]) -> frozenset[str]:
    """Every layer reachable from ``roots`` (names, mounts, pins) or from a snapshot, down
    through what each stands on. Digests not in ``layers`` are ignored (a name whose
    layer is gone keeps nothing)."""
    todo = [d for d in roots if d in layers]
    todo += [d for d, n in layers.items() if n.kind == "snapshot"]
    seen: set[str] = set()
    while todo:
        d = todo.pop()
        if d in seen:
            continue
        seen.add(d)
        todo.extend(b for b in layers[d].below if b in layers and b not in seen)
    return frozenset(seen)


def _in_subtree(key: str, project: str) -> bool:
    """Whether the refs.json key ``[project/]name:tag`` is a name of ``project`` or of a
    project under it (a bare name is cluster-wide: nobody's)."""
    ns = key.rpartition("/")[0]
    return ns == project or ns.startswith(project + "/")


def project_image_bytes(layers: Mapping[str, LayerNode], refs: Mapping[str, str],
                        project: str) -> int:
    """Bytes of the layers the names of ``project`` (and of its subprojects) reach,
    through what each stands on, each layer once (pure).

    Shared layers are charged **fully to every project that names them** (a cluster-wide
    base tagged ``teama/mybase``, a pulled image's base shared with another project's):
    a project's usage then depends on its own names only, so another tenant naming,
    untagging or deleting something never moves it over (or under) its limit, and what
    it pays is what its images need on a node by themselves. Splitting a shared layer
    between its users would sum to the disk used, but would let one project's action
    change another's usage, and a limit could start failing for a project that did
    nothing. Snapshots are not images: their storage is ``snapshot_bytes``."""
    todo = [d for k, d in refs.items() if _in_subtree(k, project) and d in layers]
    seen: set[str] = set()
    while todo:
        d = todo.pop()
        if d in seen:
            continue
        seen.add(d)
        todo.extend(b for b in layers[d].below if b in layers and b not in seen)
    return sum(layers[d].size_bytes for d in seen)


def plan_prune(layers: Mapping[str, LayerNode], roots: Iterable[str], *,
               budget_bytes: int | None = None, keep: Iterable[str] = (),
               idle_before: float | None = None) -> PrunePlan:
    """The layers to remove: every unreferenced one (``budget_bytes`` None), or the least
    recently used unreferenced ones until the store holds at most ``budget_bytes``
    (fewer when the referenced layers alone exceed it). ``keep``: never remove these
    either (the layer whose arrival triggered a budget prune). ``idle_before``: only
    layers last used before this time (the automatic budget's grace: a multi-step
    build that names its layers only at the end, without a pin, is not cut short)."""
    refd = referenced(layers, [*roots, *keep])
    garbage = sorted((n for d, n in layers.items() if d not in refd
                      and (idle_before is None or n.last_used < idle_before)),
                     key=lambda n: (n.last_used, n.digest))
    total = sum(n.size_bytes for n in layers.values())
    out: list[str] = []
    freed = 0
    for n in garbage:
        if budget_bytes is not None and total - freed <= budget_bytes:
            break
        out.append(n.digest)
        freed += n.size_bytes
    return PrunePlan(remove=tuple(out), freed_bytes=freed, kept_bytes=total - freed,
                     referenced=refd)
