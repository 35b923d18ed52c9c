"""Who may see which layer, and what an image ref names for a given caller.

The layer store (:mod:`dsec.image.store`) is shared by every project of a cluster; this
module is the tenancy rule on top of it, used by the control plane before anything
reaches an edge (docs/images.md, "Names and tenancy"):

- A layer belongs to a project (``layer_namespace``) or is cluster-wide. A caller sees a
  layer when it may see that project (``can_see``, i.e. holds a role there) or a name
  pointing at the layer lives in a project it may see (a cluster-wide name is everyone's).
- A ref resolves only among what the caller sees: ``teama/x`` needs teama; a bare ``x``
  is ``<project>/x`` when that exists, else the cluster-wide ``x``; a digest or a prefix
  of one is matched against visible layers only, so a prefix is never expanded across
  projects. Everything the caller may not see answers exactly like what does not exist
  (:func:`image_not_found`): no oracle for other projects' names, digests or kinds.

:func:`resolve` and :func:`visible` are pure over a :class:`LayerIndex`;
:class:`StoreIndex` is the I/O shell that keeps one in step with a store directory
(cached, re-read only when ``refs.json`` or ``manifests/`` change).
"""

from __future__ import annotations

import bisect
import functools
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Literal, Protocol

import msgspec

from dsec.errors import ImageNotFound, InvalidArgument
from dsec.image.manifest import DIGEST_PREFIX, LayerManifest, layer_namespace, parse_ref

if TYPE_CHECKING:
    from dsec.image.store import RefTable

__all__ = [
    "CanSee",
    "LayerIndex",
    "LayerRole",
    "MemoryIndex",
    "Resolved",
    "StoreIndex",
    "image_not_found",
    "resolve",
    "visible",
    "visible_names",
]

#: namespace (None: cluster-wide) -> whether the caller may see it.
CanSee = Callable[[str | None], bool]
#: What a ref is used as in a sandbox: decides which layer kinds fit. (Not an IAM role; the
#: SDK calls the matching layer kinds "base", "workspace", "toolkit": see _KIND_OF.)
LayerRole = Literal["image", "workspace", "toolkit"]
_KIND_OF: dict[LayerRole, str] = {"image": "base", "workspace": "workspace", "toolkit": "toolkit"}


def image_not_found(ref: str) -> ImageNotFound:
    """The one answer for an image ref that names nothing the caller may see: a missing
    name, another project's name or layer, a digest nobody has. Only the ref differs."""
    ref = str(ref)[:200]
    return ImageNotFound(
        f"no image {ref!r} visible to this API key: check the name (GET /v1/images lists "
        "the images you may use; a bare name is looked up in the sandbox's project, then "
        "cluster-wide) or build/import it (POST /v1/images)", ref=ref)


class LayerIndex(Protocol):
    """What resolution reads: manifests by digest hex and the name table."""

    def manifest(self, hx: str) -> LayerManifest | None: ...
    def by_prefix(self, hx: str) -> list[LayerManifest]: ...
    def digest_of(self, key: str) -> str | None: ...
    def names_of(self, digest: str) -> tuple[str, ...]: ...


@functools.lru_cache(maxsize=65536)
def _key_namespace(key: str) -> str | None:
    """The namespace of a store key (keys are few and immutable: cached)."""
    return parse_ref(key).namespace


def visible_names(index: LayerIndex, m: LayerManifest, can_see: CanSee) -> list[str]:
    """The names pointing at ``m`` that live in namespaces the caller may see."""
    return [k for k in index.names_of(m.digest) if can_see(_key_namespace(k))]


def visible(index: LayerIndex, m: LayerManifest, can_see: CanSee) -> bool:
    """Whether the caller may see layer ``m`` (its project, or a name it may see)."""
    return can_see(layer_namespace(m)) or bool(visible_names(index, m, can_see))


class Resolved(msgspec.Struct, frozen=True):
    """What a ref named: the ``layer``, and ``exact``, a spelling of it that a store
    resolves without any caller context to that same layer or to nothing: the full
    digest for a digest or prefix; for a name, the name qualified by the project it was
    found in (``x`` found as ``teamb/x:latest`` -> ``teamb/x``; a cluster-wide ``x``
    stays ``x``, which a store only ever looks up cluster-wide)."""

    layer: LayerManifest
    exact: str


def resolve(index: LayerIndex, ref: str, *, project: str | None, can_see: CanSee,
            role: LayerRole | None = None) -> Resolved | None:
    """What ``ref`` names for a caller in ``project`` (a bare name's first home).

    Returns None only for a bare name that exists neither in ``project`` nor
    cluster-wide (the caller may pass such a name on to a backend that resolves names its
    own way, e.g. plain image directories). Raises :func:`image_not_found` for anything
    else that names nothing visible, ``InvalidArgument`` for a malformed ref, a prefix
    matching several visible layers, or (``role`` given) a visible layer of the wrong
    kind."""
    p = parse_ref(ref)
    m: LayerManifest | None = None
    exact = ref
    if p.digest_hex is not None:
        hx = p.digest_hex
        if len(hx) == 64:
            m = index.manifest(hx)
            if m is not None and not visible(index, m, can_see):
                m = None
        else:
            hits = [c for c in index.by_prefix(hx) if visible(index, c, can_see)]
            if len(hits) > 1:
                raise InvalidArgument(
                    f"digest prefix {ref!r} is ambiguous: it matches {len(hits)} layers "
                    "visible to this API key; give more digits", field=role or "ref")
            m = hits[0] if hits else None
        if m is None:
            raise image_not_found(ref)
        exact = m.digest
    else:
        if p.namespace is not None:
            keys = [(p.key, ref)] if can_see(p.namespace) else []
        else:
            keys = [(k, e) for k, e in (((f"{project}/{p.key}", f"{project}/{ref}")
                                         if project else (None, None)), (p.key, ref))
                    if k is not None and e is not None and can_see(_key_namespace(k))]
        found = False
        for k, e in keys:
            digest = index.digest_of(k)
            if digest is None:
                continue
            found = True
            m = index.manifest(digest.removeprefix(DIGEST_PREFIX))
            exact = e
            break
        if m is None:
            if not found and p.namespace is None:
                return None
            raise image_not_found(ref)
    if role is not None:
        want = _KIND_OF[role]
        if m.kind == "snapshot":
            raise InvalidArgument(
                f"{ref[:200]!r} is a snapshot, not an image: start a sandbox from it with "
                f"snapshot={m.digest!r} (and no {role})", field=role)
        if m.kind != want:
            raise InvalidArgument(
                f"{ref[:200]!r} is a {m.kind} layer and cannot be the sandbox's {role}; "
                f"use a {want} layer (GET /v1/images shows each layer's kind)", field=role)
    return Resolved(m, exact)


# ----------------------------------------------------------------- in-memory index
class MemoryIndex:
    """A :class:`LayerIndex` over given manifests and names (tests, snapshots of state)."""

    def __init__(self, manifests: Iterable[LayerManifest], refs: Mapping[str, str]) -> None:
        self._layers = {m.hex: m for m in manifests}
        self._refs = dict(refs)
        self._names = _names(self._refs)
        self._sorted = sorted(self._layers)

    def manifest(self, hx: str) -> LayerManifest | None:
        return self._layers.get(hx)

    def by_prefix(self, hx: str) -> list[LayerManifest]:
        return _prefixed(self._sorted, hx, self._layers)

    def digest_of(self, key: str) -> str | None:
        return self._refs.get(key)

    def names_of(self, digest: str) -> tuple[str, ...]:
        return self._names.get(digest, ())

    def manifests(self) -> list[LayerManifest]:
        return sorted(self._layers.values(), key=lambda m: m.created)


def _names(refs: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    out: dict[str, list[str]] = {}
    for k, d in sorted(refs.items()):
        out.setdefault(d, []).append(k)
    return {d: tuple(ks) for d, ks in out.items()}


def _prefixed(sorted_hex: list[str], hx: str,
              layers: Mapping[str, LayerManifest]) -> list[LayerManifest]:
    out = []
    i = bisect.bisect_left(sorted_hex, hx)
    while i < len(sorted_hex) and sorted_hex[i].startswith(hx):
        m = layers.get(sorted_hex[i])
        if m is not None:
            out.append(m)
        i += 1
    return out


# ------------------------------------------------------------------ the I/O shell
_manifest_dec = msgspec.json.Decoder(LayerManifest)
_refs_dec = msgspec.json.Decoder(dict[str, str])
# A directory's mtime has the kernel's coarse clock granularity (a few ms): a change in
# the same tick as our last look would not move it. Like git's "racy clean" rule, a
# listing whose mtime is this recent is looked at again next time.
_RACY_S = 0.05


class StoreIndex:
    """A :class:`LayerIndex` over a layer store directory, for the control plane.

    Call :meth:`sync` once per request, then look up as often as needed: lookups touch no
    disk except to read a manifest not seen before (manifests never change once written).
    ``sync`` re-reads the name table only when ``refs.json`` was replaced (it is written
    by rename, so its inode changes on every write), and with ``listing=True`` re-lists
    ``manifests/`` when it changed (for listings and removals). A manifest removed since
    the last listing may still be returned by a lookup; the edge then finds no such
    layer and the create fails with the same "no image" answer.
    Measured here (2 loaded cores): sync + resolve of a name or digest is 6-10 µs."""

    def __init__(self, root: str, *, clock: Callable[[], float] = time.time,
                 refs: RefTable | None = None) -> None:
        self.root = root
        self._clock = clock
        # the names' table when they are not refs.json (LayerStore's ``refs``): re-read
        # when its signature (the state store's tag version) moves
        self._table = refs
        self._refs: dict[str, str] = {}
        self._names: dict[str, tuple[str, ...]] = {}
        self._refs_sig: object = None
        # manifests of layers named in the table but stored on another replica's host
        self._shared: dict[str, LayerManifest] = {}
        self._layers: dict[str, LayerManifest] = {}
        # the same layers by their project (None: cluster-wide), so a listing for one
        # caller skips the projects it may not see wholesale
        self._by_ns: dict[str | None, dict[str, LayerManifest]] = {}
        self._sorted: list[str] | None = None       # sorted(self._layers), kept until it changes
        self._dir_sig: tuple[int, int] | None = None
        self._dir_racy = True

    def sync(self, *, listing: bool = False) -> StoreIndex:
        """Catch up with the store (see the class docstring); returns ``self``."""
        self._fresh_refs(exact=listing)
        if listing:
            self._fresh_listing()
        return self

    # refs.json ----------------------------------------------------------------
    def _fresh_refs(self, *, exact: bool = False) -> None:
        if self._table is not None:
            # a create's lookup may lag another replica's change by its announcement
            # (PostgreSQL NOTIFY, ~1 ms; it costs no round trip meanwhile); the image
            # routes (listing) ask the store's version every time
            tsig = self._table.signature(exact=exact)
            if tsig != self._refs_sig:
                refs = self._table.read()
                self._refs, self._names, self._refs_sig = refs, _names(refs), tsig
            return
        path = os.path.join(self.root, "refs.json")
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self._refs, self._names, self._refs_sig = {}, {}, None
            return
        sig = (st.st_ino, st.st_mtime_ns, st.st_size)
        if sig == self._refs_sig:
            return
        try:
            with open(path, "rb") as f:
                refs = _refs_dec.decode(f.read())
        except (FileNotFoundError, msgspec.DecodeError):
            refs = {}
        self._refs, self._names, self._refs_sig = refs, _names(refs), sig

    def digest_of(self, key: str) -> str | None:
        return self._refs.get(key)

    def names_of(self, digest: str) -> tuple[str, ...]:
        return self._names.get(digest, ())

    def refs(self) -> dict[str, str]:
        return self._refs

    # manifests ----------------------------------------------------------------
    def _load(self, hx: str) -> LayerManifest | None:
        try:
            with open(os.path.join(self.root, "manifests", hx + ".json"), "rb") as f:
                return _manifest_dec.decode(f.read())
        except (FileNotFoundError, msgspec.DecodeError):
            return None

    def manifest(self, hx: str) -> LayerManifest | None:
        m = self._layers.get(hx)
        if m is None:
            m = self._load(hx)
            if m is not None:
                self._put(hx, m)
            elif self._table is not None:
                m = self._shared.get(hx)
                if m is None and DIGEST_PREFIX + hx in self._names:
                    m = self._table.manifest(DIGEST_PREFIX + hx)
                    if m is not None:
                        self._shared[hx] = m
        return m

    def _put(self, hx: str, m: LayerManifest) -> None:
        self._layers[hx] = m
        self._by_ns.setdefault(layer_namespace(m), {})[hx] = m
        self._sorted = None

    def _drop(self, hx: str) -> None:
        m = self._layers.pop(hx)
        ns = layer_namespace(m)
        group = self._by_ns.get(ns)
        if group is not None:
            group.pop(hx, None)
            if not group:
                del self._by_ns[ns]
        self._sorted = None

    def _fresh_listing(self) -> None:
        d = os.path.join(self.root, "manifests")
        try:
            st = os.stat(d)
        except FileNotFoundError:
            self._layers, self._by_ns, self._dir_sig, self._sorted = {}, {}, None, None
            return
        sig = (st.st_ino, st.st_mtime_ns)
        if sig == self._dir_sig and not self._dir_racy:
            return
        names = {n[:-5] for n in os.listdir(d) if n.endswith(".json")}
        for gone in self._layers.keys() - names:
            self._drop(gone)
        for hx in names - self._layers.keys():
            m = self._load(hx)
            if m is not None:
                self._put(hx, m)
        self._dir_sig = sig
        self._dir_racy = self._clock() - st.st_mtime_ns / 1e9 < _RACY_S

    def by_prefix(self, hx: str) -> list[LayerManifest]:
        # Exact like a listing (the directory's signature, with the racy-clean rule), and
        # cheap while the store does not change: this answers any key's prefix lookups,
        # and re-listing plus sorting on each one cost 72 ms at 20,000 layers (measured
        # here), which let one reader stall the apiserver.
        self._fresh_listing()
        if self._sorted is None:
            self._sorted = sorted(self._layers)
        return _prefixed(self._sorted, hx, self._layers)

    def manifests(self) -> list[LayerManifest]:
        """Every layer as of the last ``sync(listing=True)``, oldest first."""
        return sorted(self._layers.values(), key=lambda m: m.created)

    def visible_manifests(self, can_see: CanSee) -> list[LayerManifest]:
        """The layers :func:`visible` to ``can_see``, oldest first, as of the last
        ``sync(listing=True)``: those of the namespaces it sees, plus those a name in such
        a namespace points at. Costs O(namespaces + names + what it returns), not
        O(layers): filtering every layer for every ``GET /v1/images`` took 190 ms at
        20,000 layers here, and any key may call it."""
        see = functools.lru_cache(maxsize=None)(can_see)
        out: dict[str, LayerManifest] = {}
        for ns, group in self._by_ns.items():
            if see(ns):
                out.update(group)
        for key, digest in self._refs.items():
            hx = digest.removeprefix(DIGEST_PREFIX)
            if hx not in out and see(_key_namespace(key)):
                m = self._layers.get(hx)
                if m is None and self._table is not None:
                    m = self.manifest(hx)     # named by another replica, stored there
                if m is not None:
                    out[hx] = m
        return sorted(out.values(), key=lambda m: m.created)
