"""pack_diff snapshots of container sandboxes (the backend's ``snapshot`` capability).

A container sandbox's root is ``overlay(lower = image layers, upper = <dir>/upper)``, so
everything it ever changed is in its upperdir, in overlay's own encoding.
:func:`dsec.image.packdiff.snapshot` turns what changed since the sandbox's previous
snapshot into a new layer of the node's :class:`~dsec.image.store.LayerStore`, whose
``parent`` is that previous snapshot (or, for the first one, the snapshot the sandbox
was started from; none when it sits on the image). A sandbox created with
``spec.snapshot`` mounts the chain above the image (:class:`~dsec.image.resolver.
StoreImages` does that), so it sees exactly the tree the snapshot captured.

Consistency: a running sandbox is frozen (cgroup freezer) for the scan and copy, so no
process in it writes mid-capture; a paused one is already frozen and stays paused. It is
thawed as soon as the copy into the store's staging dir is done: the EROFS build reads
only that copy, and it can take seconds (mkfs.erofs 1.5 reads sparse files whole, ~4.6
s/GiB of apparent size).

Bounds: the layer may hold at most the sandbox's disk cap plus 1/8 (EROFS and btrfs
metadata differ) and, when the control plane passes one, the project's remaining
snapshot storage (``max_bytes``); the build may read at most the backend's
``snapshot_max_apparent_bytes`` of file sizes. Over a bound: ``QuotaExceeded`` and no
layer in the store. Holes and hardlinks are kept (see :mod:`dsec.image.packdiff`), so a
sandbox holding a 1 GiB sparse file stores about what it uses.

Which snapshot a sandbox last took is kept in ``<sandbox dir>/snapshot`` so an edge
restart (adopt) continues the chain incrementally. Snapshot metadata (sandbox, project,
image refs) lives in the layer manifest's labels, so a shared store answers for every
edge that uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

from dsec.edge.spec import SnapshotInfo
from dsec.errors import Conflict, ImageNotFound, InvalidArgument, SandboxNotFound
from dsec.ids import SandboxId
from dsec.image.catalog import StoreIndex
from dsec.image.compose import RootStack
from dsec.image.manifest import DIGEST_PREFIX, LayerManifest, layer_namespace
from dsec.image.packdiff import snapshot as pack_diff
from dsec.image.resolver import StoreImages

if TYPE_CHECKING:
    from dsec.edge.backends.container.backend import ContainerBackend

__all__ = ["ContainerSnapshots", "snapshot_info"]

_L = "dsec.io/"          # manifest label prefix
_LAST = "snapshot"       # file in the sandbox dir: digest of its latest snapshot


def snapshot_info(m: LayerManifest) -> SnapshotInfo:
    """The edge's view of a snapshot layer (from its manifest and labels)."""
    lab = m.labels
    return SnapshotInfo(
        id=m.digest, parent=m.parent, sandbox_id=lab.get(_L + "sandbox", ""),
        # The one tenancy rule (dsec.image.catalog): a snapshot naming no project is
        # nobody's (""), not the "default" project's.
        project=layer_namespace(m) or "", image=lab.get(_L + "image", ""),
        workspace=lab.get(_L + "workspace") or None,
        toolkits=tuple(t for t in lab.get(_L + "toolkits", "").split(",") if t),
        backend=lab.get(_L + "backend", ""), created=m.created, size_bytes=m.size_bytes)


class ContainerSnapshots:
    """Snapshots for one :class:`ContainerBackend` whose resolver is StoreImages."""

    def __init__(self, backend: ContainerBackend) -> None:
        self.backend = backend
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self._index: StoreIndex | None = None
        self._index_lock = threading.Lock()     # listings run in worker threads

    @property
    def images(self) -> StoreImages | None:
        images = self.backend.images
        return images if isinstance(images, StoreImages) else None

    def _store_images(self) -> StoreImages:
        images = self.images
        if images is None:
            raise Conflict(
                "this container backend resolves images from plain directories "
                f"({type(self.backend.images).__name__}), which cannot hold snapshots; "
                "construct it with images=StoreImages(LayerStore(...), MountCache()) "
                "(dsec up does)")
        return images

    # ------------------------------------------------------------------ take
    async def snapshot(self, sid: SandboxId, *, strip: tuple[str, ...] = (),
                       max_bytes: int | None = None) -> SnapshotInfo:
        images = self._store_images()
        box = self.backend._box(sid)
        stack = box.layers.token
        if not isinstance(stack, RootStack):
            raise Conflict(f"sandbox {sid} was not started from the layer store, so it has "
                           "no image stack to snapshot against", sandbox_id=sid)
        # One snapshot of a sandbox at a time (they form a chain); the lock lives only
        # while someone holds or waits for it, so idle sandboxes cost nothing here.
        lock, users = self._locks.get(sid) or (asyncio.Lock(), 0)
        self._locks[sid] = (lock, users + 1)
        try:
            async with lock:
                return await self._take(images, sid, stack, strip, max_bytes)
        finally:
            lock, users = self._locks[sid]
            if users == 1:
                del self._locks[sid]
            else:
                self._locks[sid] = (lock, users - 1)

    async def _take(self, images: StoreImages, sid: SandboxId, stack: RootStack,
                    strip: tuple[str, ...], max_bytes: int | None) -> SnapshotInfo:
        store = images.store
        box = self.backend._box(sid)
        upper = self.backend.upper_dir(sid)
        last_path = os.path.join(box.dir, _LAST)
        previous = await asyncio.to_thread(self._previous, last_path)
        top = stack.layers[0]
        origin = top if top.kind == "snapshot" else None
        labels = self._labels(sid, box.spec, origin)
        gov = self.backend.governor
        bound = self.layer_bound(box.disk_cap)
        if bound is not None and max_bytes is not None:
            bound = min(bound, max_bytes)
        elif max_bytes is not None:
            bound = max_bytes
        frozen_here = False
        if not box.paused:
            try:
                gov.freeze(box.cg)
            except OSError as exc:
                raise SandboxNotFound(f"sandbox {sid} could not be frozen for its snapshot "
                                      f"(is it gone?): {exc}", sandbox_id=sid) from exc
            frozen_here = True
        loop = asyncio.get_running_loop()

        def thaw() -> None:  # a pause that raced us owns the freeze now
            nonlocal frozen_here
            if frozen_here and not box.paused:
                with contextlib.suppress(OSError):
                    gov.thaw(box.cg)
            frozen_here = False

        try:
            if previous is None and origin is not None and not await asyncio.to_thread(
                    _has_entries, upper, strip):
                # Started from a snapshot and changed nothing: that snapshot is the answer.
                return self._unchanged(origin)
            m = await asyncio.to_thread(
                pack_diff, store, upper, previous, base=stack, strip=strip, labels=labels,
                max_bytes=bound,
                max_apparent_bytes=self.backend.snapshot_max_apparent_bytes,
                on_copied=lambda: _discard(loop.call_soon_threadsafe(thaw)))
        finally:
            thaw()
        if previous is not None and m.digest == previous.digest:
            return self._unchanged(m)
        await asyncio.to_thread(_write_last, last_path, m.digest)
        return snapshot_info(m)

    @staticmethod
    def layer_bound(disk_cap: int) -> int | None:
        """The most a sandbox with ``disk_cap`` may put into one snapshot layer: its cap
        plus 1/8 (EROFS lays files out differently from btrfs) plus 1 MiB."""
        return disk_cap + disk_cap // 8 + (1 << 20) if disk_cap else None

    @staticmethod
    def _unchanged(m: LayerManifest) -> SnapshotInfo:
        info = snapshot_info(m)
        info.unchanged = True
        return info

    def _previous(self, last_path: str) -> LayerManifest | None:
        """The sandbox's latest snapshot, if it still exists (deleting it is allowed:
        the next snapshot is then taken in full against the image stack)."""
        try:
            with open(last_path) as f:
                digest = f.read().strip()
        except FileNotFoundError:
            return None
        images = self._store_images()
        try:
            m = images.store.get(digest)
        except (ImageNotFound, InvalidArgument):
            return None
        return m if m.kind == "snapshot" else None

    def _labels(self, sid: str, spec: object, origin: LayerManifest | None) -> dict[str, str]:
        from dsec.edge.spec import SandboxSpec

        assert isinstance(spec, SandboxSpec)
        lab = {_L + "sandbox": sid, _L + "project": spec.project,
               _L + "backend": self.backend.name}
        if origin is not None:  # the image refs come down the chain
            src = origin.labels
            for k in ("image", "workspace", "toolkits"):
                if _L + k in src:
                    lab[_L + k] = src[_L + k]
        else:
            lab[_L + "image"] = spec.image
            if spec.workspace:
                lab[_L + "workspace"] = spec.workspace
            if spec.toolkits:
                lab[_L + "toolkits"] = ",".join(spec.toolkits)
        return lab

    # ------------------------------------------------------------------ query / delete
    async def snapshots(self) -> list[SnapshotInfo]:
        images = self.images
        if images is None:
            return []
        return await asyncio.to_thread(self._listed, images.store.root)

    def _listed(self, root: str) -> list[SnapshotInfo]:
        """Every snapshot in the store, through a cached :class:`StoreIndex` (manifests
        are read once, the directory only when it changed): reading every manifest per
        call took 1.1 s at 20,000 layers (measured here), and any key's ``GET
        /v1/snapshots`` or snapshot prefix asks every edge for this."""
        with self._index_lock:
            if self._index is None or self._index.root != root:
                self._index = StoreIndex(root)
            ms = self._index.sync(listing=True).manifests()
        return [snapshot_info(m) for m in ms if m.kind == "snapshot"]

    def _get(self, ref: str) -> LayerManifest:
        images = self.images
        if images is None:
            raise ImageNotFound(f"no snapshot {ref[:80]!r}: this container backend has no "
                                "layer store", ref=ref[:80])
        m = images.store.get(ref)
        if m.kind != "snapshot":
            raise ImageNotFound(f"{ref[:80]} is a {m.kind} layer, not a snapshot", ref=ref[:80])
        return m

    async def snapshot_info(self, ref: str) -> SnapshotInfo:
        return snapshot_info(await asyncio.to_thread(self._get, ref))

    async def delete_snapshot(self, ref: str) -> SnapshotInfo:
        """Remove the layer; the store refuses (InUse) while it is mounted (a sandbox
        runs from it) or a snapshot builds on it."""
        m = await asyncio.to_thread(self._get, ref)
        images = self._store_images()
        await asyncio.to_thread(images.store.remove, m.digest)
        return snapshot_info(m)

    def images_present(self) -> Iterable[str]:
        """Every layer digest in the store plus its ``name:tag`` refs (one listdir and
        one small file read), so placement can route snapshot creates here."""
        images = self.images
        if images is None:
            return ()
        store = images.store
        try:
            names = os.listdir(os.path.join(store.root, "manifests"))
        except FileNotFoundError:
            return ()
        out = [DIGEST_PREFIX + n[:-5] for n in names if n.endswith(".json")]
        out += store.refs()
        return out


def _discard(_: object) -> None:
    """Drop a value (the thaw's Handle: the thread has nothing to do with it)."""


def _has_entries(upper: str, strip: tuple[str, ...]) -> bool:
    from dsec.image.packdiff import scan_upper

    try:
        entries, _ = scan_upper(upper, strip)
    except FileNotFoundError:
        return False
    return bool(entries)


def _write_last(path: str, digest: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(digest)
    os.replace(tmp, path)
