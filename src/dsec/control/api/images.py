"""Image administration: the layer store as the API's callers see it.

Image names are namespaced per project (docs/images.md, "Names and tenancy"): the rules
live in :mod:`dsec.image.catalog` (who sees what, what a ref names) and
:meth:`LayerStore.tag <dsec.image.store.LayerStore.tag>` (what a tag may point at); here
they meet the caller's roles. :meth:`ImageAdmin.resolve_layers` is also what every create
goes through (the :class:`~dsec.control.api.service.ImageResolver` of the apiserver).
It used to live in :class:`~dsec.control.api.plane.ControlPlane` (issue 13 moved it out);
the project's layer-storage quota (``snapshot_bytes``, shared with snapshots) stays with
the plane's quota gate, reached through :class:`SnapshotCharges`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import functools
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any, Protocol

import msgspec

from dsec.control.api.service import ApiService, Caller
from dsec.control.store import SnapshotChargeRow
from dsec.control.store.tags import HostNames, StoreTags
from dsec.errors import (
    CapacityExceeded,
    Conflict,
    DsecError,
    ImageError,
    InUse,
    InvalidArgument,
    PermissionDenied,
    QuotaExceeded,
)
from dsec.ids import parse_project_path
from dsec.image.blob import BlobStore
from dsec.image.catalog import (
    CanSee,
    LayerRole,
    StoreIndex,
    image_not_found,
    resolve,
    visible_names,
)
from dsec.image.egress import EgressPolicy
from dsec.image.gc import LayerNode, project_image_bytes
from dsec.image.manifest import DIGEST_PREFIX, LayerManifest, ParsedRef, layer_namespace, parse_ref
from dsec.image.registry import RegistryRef
from dsec.image.store import LayerStore, Pin
from dsec.wire.api import (
    ImageList,
    ImagePromoteRequest,
    ImagePruned,
    ImagePullRequest,
    ImagePushed,
    ImagePushRequest,
    ImageTagRequest,
    ImageView,
    PushedLayerView,
)
from dsec.wire.spec import SandboxSpec

__all__ = ["ImageAdmin", "SnapshotCharges"]

#: Threads running registry pulls (fetch + unpack + mkfs) for one apiserver.
PULL_WORKERS = 8
#: Threads pushing images to the blob store (each uploads one layer at a time; an S3
#: multipart upload moves several parts at once on its own).
PUSH_WORKERS = 2
#: Pulls of one project at once; the rest wait their turn (a project cannot take
#: every pull thread).
PULLS_PER_PROJECT = 2

log = logging.getLogger("dsec.control")


class SnapshotCharges(Protocol):
    """The layer-storage quota (``snapshot_bytes``) a project's built layers share with
    its snapshots (the control plane's quota gate implements it)."""

    def snapshot_room(self, project: str) -> int | None: ...
    def registry_pull(self, project: str) -> tuple[bool, str | None]: ...
    def check_snapshot(self, project: str, size_bytes: int) -> None: ...
    def charge_snapshot(self, snapshot_id: str, project: str, node: str,
                        size_bytes: int, *, kind: str | None = None,
                        parent: str | None = None, stack: tuple[str, ...] = ()) -> None: ...
    def release_snapshot(self, snapshot_id: str) -> None: ...
    def image_limits(self, project: str) -> list[tuple[str, int]]: ...


class ImageAdmin:
    """The image routes over the shared layer store at ``layer_dir`` (None: this apiserver
    has none; the image routes answer Conflict and creates pass bare names on)."""

    def __init__(self, charges: SnapshotCharges, *, layer_dir: str | None = None,
                 state: Any = None) -> None:
        self.charges = charges
        self.layer_dir = layer_dir
        # The state store: image names live in its tag table (shared by every replica,
        # dsec.control.store.tags), the layer files in the layer store at layer_dir.
        self.state = state
        self._tags: StoreTags | None = None
        self._store_cache: LayerStore | None = None
        self._index_cache: StoreIndex | None = None
        self._pulls: dict[tuple[str, str], asyncio.Lock] = {}
        # Registry pulls run in a pool of their own, at most PULLS_PER_PROJECT of one
        # project at once: pulls stalled on a silent registry hold these threads, never
        # the event loop's default executor every other route (builds, prune, the
        # plane's jobs) shares, nor another project's turn (red team F12).
        self._pull_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pull_slots: dict[str, asyncio.Semaphore] = {}
        self._pull_waiting: dict[str, int] = {}
        # host[:port] patterns (fnmatch) callers may pull from; None: any registry but
        # loopback / link-local / private addresses (dsec.image.egress.EgressPolicy,
        # held on every hop: redirects, token realms, resolved addresses)
        self.registries: tuple[str, ...] | None = None
        # patterns only redirects and token realms of those registries may reach
        self.registry_blob_hosts: tuple[str, ...] = ()
        # [blob] The operator's blob store URL (`--blob-store`; dsec.image.blob): images
        # are pushed there. Never a caller's: a request names an image, not a store.
        self.blob_store: str | None = None
        self._blob_cache: tuple[str, BlobStore] | None = None
        # pushes run in a pool of their own: a slow blob store holds these threads, never
        # the event loop's default executor other routes share
        self._push_pool: concurrent.futures.ThreadPoolExecutor | None = None

    # Image names are namespaced per project (docs/images.md, "Names and tenancy"): the
    # rules live in dsec.image.catalog (who sees what, what a ref names) and
    # LayerStore.tag (what a tag may point at); here they meet the caller's roles.
    def _layers(self) -> LayerStore:
        if self.layer_dir is None:
            raise Conflict("this apiserver has no layer store configured")
        if self._store_cache is None or self._store_cache.root != os.path.abspath(
                self.layer_dir):
            tags = self._tag_table()
            names = None
            if tags is not None:
                root = os.path.abspath(self.layer_dir)
                probe = LayerStore(root)
                names = HostNames(tags, root, lambda d: probe._load_opt(
                    d.removeprefix(DIGEST_PREFIX)))
            store = LayerStore(self.layer_dir, refs=names)
            self._store_cache = store
            self._index_cache = StoreIndex(store.root, refs=names)
        return self._store_cache

    def layers(self) -> LayerStore:
        """The layer store, its names in the state store's tag table (Conflict when this
        apiserver has no layer store)."""
        return self._layers()

    def _tag_table(self) -> StoreTags | None:
        if self.state is None:
            return None
        if self._tags is None:
            self._tags = StoreTags(self.state)
        return self._tags

    def _index(self, *, listing: bool = False) -> StoreIndex | None:
        """The layer index, caught up with the store (``listing``: also with removals,
        for the image routes; creates only need names and the manifests they hit)."""
        if self.layer_dir is None:
            return None
        self._layers()
        assert self._index_cache is not None
        return self._index_cache.sync(listing=listing)

    def resolve_layers(self, caller: Caller, spec: SandboxSpec) -> SandboxSpec:
        """``spec`` with ``image``/``workspace``/``toolkits`` resolved *for this caller*
        (``ImageResolver``, called on every create through every door) and replaced by
        spellings the edge's store resolves exactly, with no caller context: a full
        digest for a digest or prefix, a name qualified by the project it was found in
        (``tools`` -> ``teamb/tools``; a cluster-wide ``tools`` stays ``tools``, which a
        store looks up cluster-wide only). The edge never looks up a name in a project or
        expands a prefix on the caller's behalf. A name can still move between this check
        and the edge's lookup, but only by someone with the right on its namespace (a
        namespace this caller sees), and only to a layer built there (LayerStore.tag).

        A bare name found neither in the sandbox's project nor cluster-wide is passed on
        unchanged: an edge store only holds cluster-wide names under bare keys, and other
        backends (plain image directories, the simulated one) resolve names their own
        way. A digest or a project name that resolves to nothing visible is refused here
        with the same error as one that does not exist."""
        if spec.snapshot is not None:
            return spec   # the snapshot brings its own stack (checked by ApiService)
        index = self._index()
        can_see = _can_see(caller)

        def one(ref: str, role: LayerRole) -> str:
            try:
                parsed = parse_ref(ref)
            except InvalidArgument:
                if "/" in ref or ref.startswith(DIGEST_PREFIX):
                    raise
                return ref      # not a store name: a backend with its own names decides
            if index is None:
                if parsed.digest_hex is not None or parsed.namespace is not None:
                    raise image_not_found(ref)
                return ref
            found = resolve(index, ref, project=spec.project, can_see=can_see, role=role)
            return ref if found is None else found.exact

        image = one(spec.image, "image")
        workspace = one(spec.workspace, "workspace") if spec.workspace else spec.workspace
        toolkits = tuple(one(t, "toolkit") for t in spec.toolkits)
        out = spec
        if (image, workspace, toolkits) != (spec.image, spec.workspace, spec.toolkits):
            out = msgspec.structs.replace(spec, image=image, workspace=workspace,
                                          toolkits=toolkits)
        if index is not None:
            base = _named(index, image)
            if base is not None:
                out = with_image_defaults(out, base)
        return out

    async def pull_on_create(self, caller: Caller, spec: SandboxSpec) -> SandboxSpec:
        """A create naming a registry image (``image="127.0.0.1:5000/team/app:1"``,
        :func:`dsec.image.registry.is_registry_ref`): the image already pulled as
        ``<project>/<its local name>`` (or cluster-wide under that name) is used as is;
        otherwise it is pulled into the sandbox's project, when the project's
        ``registry_pull`` setting (nearest ancestor's; default yes) allows it, as the
        caller (a member of the project: the create needs that) and charged like
        ``images.pull``. Loopback registries are reached over plain HTTP (docker's rule
        for 127.0.0.0/8), others over verified TLS, anonymously (never the apiserver host's
        registry logins: red team F2), under the apiserver's egress policy. The spec then names the store name,
        which :meth:`resolve_layers` resolves like any other."""
        from dsec.image.pull import REF_LABEL
        from dsec.image.registry import is_registry_ref, local_name, parse_registry_ref

        if spec.snapshot is not None or not is_registry_ref(spec.image):
            return spec
        if self.layer_dir is None:
            raise image_not_found(spec.image)
        r = parse_registry_ref(spec.image)
        name, tag = local_name(r)
        project = spec.project
        local = f"{name}:{tag}"

        def pulled() -> SandboxSpec | None:
            # A stored name counts only when its image was pulled from exactly this ref
            # (its oci.ref label, which a digest ref's digest is part of): a member may
            # point any name at any project layer (images.tag, build, pull --name), and
            # a digest-pinned create must run the image with that manifest digest
            # (red team F4), a tag ref that repository's image (F5).
            index = self._index()
            assert index is not None
            for key in ((f"{project}/{local}",) if project else ()) + (local,):
                digest = index.digest_of(key)
                if digest is None:
                    continue
                with contextlib.suppress(DsecError):
                    if self._layers().get(digest).labels.get(REF_LABEL) == str(r):
                        return msgspec.structs.replace(spec, image=key)
            return None
        found = pulled()
        if found is not None:
            return found
        if project is None:
            raise image_not_found(spec.image)
        # one pull per (project, ref) at a time: a batch of creates naming one image
        # waits for the first one's pull instead of pulling it N times
        lock = self._pulls.setdefault((project, local), asyncio.Lock())
        try:
            async with lock:
                found = pulled()
                if found is not None:
                    return found
                return await self._pull_for_create(caller, spec, r, project, local, pulled)
        finally:
            if not lock.locked():
                self._pulls.pop((project, local), None)   # bounded by pulls in flight

    async def _pull_for_create(self, caller: Caller, spec: SandboxSpec, r: RegistryRef,
                               project: str, local: str,
                               pulled: Callable[[], SandboxSpec | None]) -> SandboxSpec:
        from dsec.image.registry import is_loopback_host

        check_registry(r.host, self.registries)
        allowed, said_by = self.charges.registry_pull(project)
        if not allowed:
            raise PermissionDenied(
                f"image {spec.image[:200]!r} is not in the layer store and project "
                f"{project!r} does not pull registry images on create (setting "
                f"registry_pull=false on project {said_by!r}): pull it first with "
                "images.pull / `dsec image pull`, or ask an admin to set registry_pull "
                "to true", field="image")
        insecure = is_loopback_host(r.host)     # IP literals only, never a name's spelling
        res = await self.pull_image(caller, ImagePullRequest(
            ref=spec.image, project=project, insecure=insecure))
        found = pulled()
        if found is None and res.items:
            # the name moved since the pull set it: the image this pull stored, by digest
            found = msgspec.structs.replace(spec, image=res.items[0].digest)
        return found or msgspec.structs.replace(spec, image=f"{project}/{local}")

    def list_images(self, caller: Caller) -> ImageList:
        """Layers in the shared layer store that the caller may see: cluster-wide ones,
        and those of (or named in) projects it holds a role on. Snapshot layers are one
        project's data too (``GET /v1/snapshots`` is their route)."""
        ApiService.require(caller, caller.default_project, "reader")
        index = self._index(listing=True)
        if index is None:
            raise Conflict("this apiserver has no layer store configured")
        can_see = functools.lru_cache(maxsize=None)(_can_see(caller))
        return ImageList(items=[_image_view(index, m, can_see)
                                for m in index.visible_manifests(can_see)])

    def _find_image(self, caller: Caller, ref: str) -> tuple[StoreIndex, LayerManifest]:
        index = self._index(listing=True)
        if index is None:
            raise Conflict("this apiserver has no layer store configured")
        found = resolve(index, ref, project=caller.default_project, can_see=_can_see(caller))
        if found is None:
            raise image_not_found(ref)
        return index, found.layer

    def get_image(self, caller: Caller, ref: str) -> ImageView:
        """One image by ``[project/]name[:tag]`` (a bare name: the caller's default
        project first, then cluster-wide) or digest / prefix, if the caller may see it."""
        index, m = self._find_image(caller, ref)
        return _image_view(index, m, _can_see(caller))

    def delete_image(self, caller: Caller, ref: str) -> None:
        """Delete an image. A name (``[project/]name[:tag]``, a bare one resolved like
        ``get_image``) is removed, needing the write right on its namespace; its layer
        goes too when no other name points at it, the caller may write the layer's
        namespace and nothing uses it (otherwise the layer stays, by digest). A digest
        removes the layer and every name pointing at it, needing the write right on all
        of those namespaces; ``InUse`` while a sandbox runs from it or a snapshot builds
        on it."""
        parsed = parse_ref(ref)
        index = self._index(listing=True)
        if index is None:
            raise Conflict("this apiserver has no layer store configured")
        can_see = _can_see(caller)
        found = resolve(index, ref, project=caller.default_project, can_see=can_see)
        if found is None:
            raise image_not_found(ref)
        m = found.layer
        if m.kind == "snapshot":
            raise InvalidArgument(f"{ref[:200]!r} is a snapshot: delete it with DELETE "
                                  f"/v1/snapshots/{m.digest}", field="ref")
        store = self._layers()
        if parsed.name is not None:
            key = parse_ref(found.exact).key
            _require_write(caller, parse_ref(key).namespace, what=f"delete {key}")
            store.untag(key)
            try:
                # a layer stored on another replica's host stays there, unnamed (its
                # store's gc removes it: names are the table's everywhere)
                if not index.sync().names_of(m.digest) and store.has(m.digest):
                    _require_write(caller, layer_namespace(m), what="")
                    store.remove(m.digest)
                    self.charges.release_snapshot(m.digest)
            except (PermissionDenied, InUse):
                pass   # the name is gone; the layer stays (another's, or in use)
            return
        for ns in {layer_namespace(m), *(parse_ref(k).namespace
                                         for k in index.names_of(m.digest))}:
            _require_write(caller, ns, what=f"delete {m.digest}")
        try:
            store.remove(m.digest)
            self.charges.release_snapshot(m.digest)
        except InUse:
            # The store names the users (mounts, other projects' snapshots): say only
            # that there are some.
            raise InUse(f"layer {m.digest} is in use by sandboxes running from it or by "
                        "snapshots that build on it; destroy those sandboxes and delete "
                        "those snapshots first", digest=m.digest) from None

    def tag_image(self, caller: Caller, req: ImageTagRequest) -> ImageView:
        """Point the name ``req.target`` at the layer ``req.source`` names. The caller
        needs the write right on the target's namespace and must see the source; and the
        store refuses a layer built outside that namespace (LayerStore.tag)."""
        target = parse_ref(req.target)
        if target.name is None:
            raise InvalidArgument(f"target {req.target[:200]!r} must be a name "
                                  "([project/]name[:tag]), not a digest", field="target")
        _require_write(caller, target.namespace, what=f"tag {target.key}")
        index, m = self._find_image(caller, req.source)
        self._layers().tag(m.digest, target.name, target.tag, namespace=target.namespace,
                           admit=self.admit_names(target.namespace))
        return _image_view(index.sync(), m, _can_see(caller))

    async def build_image(self, caller: Caller, tar_path: str, *, name: str, kind: str,
                          tag: str, oci: bool) -> ImageList:
        """Build (or import) layers with dsec.image in a worker thread (mkfs.erofs).

        ``name`` is ``[project/]name``: a project name needs the write right there
        (``member``), a bare name is cluster-wide and needs a superuser, because every
        project starts from those (a project admin could otherwise move ``base`` under
        everyone). Every layer made, named or not, belongs to that namespace."""
        try:
            parsed = parse_ref(f"{name}:{tag}")
        except InvalidArgument as exc:
            raise InvalidArgument(exc.message, field="name") from None
        if parsed.name is None:
            raise InvalidArgument(f"name {name[:200]!r} must be [project/]name, not a digest",
                                  field="name")
        if kind not in ("base", "workspace", "toolkit"):
            # A "snapshot" built from an upload would pass for a sandbox's snapshot (and
            # list under whatever project its labels claim): only edges make those.
            raise InvalidArgument(f"kind={kind[:40]!r}: build a 'base', 'workspace' or "
                                  "'toolkit' layer (snapshots are taken of sandboxes)",
                                  field="kind")
        ns = parsed.namespace
        _require_write(caller, ns, what=f"build {parsed.key}")
        store = self._layers()
        # A project's layers share its layer-storage quota with its snapshots
        # (``snapshot_bytes``, every ancestor's too): members build now, and the layer
        # store is one disk. Cluster-wide layers (a superuser's) are not charged.
        room = self.charges.snapshot_room(ns) if ns else None
        if room == 0 and ns:
            self.charges.check_snapshot(ns, 1)   # raises, naming the full quota

        # Pinned from the moment they appear until named: a prune (CLI, another
        # replica, the store budget) never takes a layer between the build and its tag.
        pin = Pin(store)

        def work() -> list[LayerManifest]:
            # Built without a name, named only once charged: a refused build moves no tag.
            if oci:
                from dsec.image import import_oci
                return list(import_oci(store, tar_path, kind=kind,  # type: ignore[arg-type]
                                       namespace=ns, owner=caller.id, max_bytes=room,
                                       pin=pin))
            with open(tar_path, "rb") as f:
                return [store.add_tar(f, kind=kind,  # type: ignore[arg-type]
                                      namespace=ns, owner=caller.id, max_bytes=room,
                                      pin=pin)]
        try:
            return await self._build_pinned(caller, parsed, ns, store, pin, work)
        finally:
            pin.close()

    def gone_build_charges(self, charges: Iterable[SnapshotChargeRow]) -> set[str]:
        """The charges of built, imported or pulled layers (node ``""``) whose layer is no
        longer in the store: a prune (``dsec image prune`` on the host, the store budget)
        removed it without the control plane; their bytes leave the usage."""
        if self.layer_dir is None:
            return set()
        store = self._layers()
        return {c.id for c in charges
                if c.node == "" and c.id.startswith(DIGEST_PREFIX) and not store.has(c.id)}

    def image_bytes(self, project: str) -> int | None:
        """The project's image storage (usage ``image_bytes``): the layers its names (and
        its subprojects') reach, shared ones fully (:func:`dsec.image.gc.
        project_image_bytes`); None without a layer store."""
        if self.layer_dir is None:
            return None
        return self._layers().project_image_bytes(project)

    def admit_names(self, project: str | None
                    ) -> Callable[[Mapping[str, LayerNode], dict[str, str]], None] | None:
        """The check a new name in ``project`` must pass, run by :meth:`LayerStore.tag`
        under the store's lock (so racing builds, replicas and pulls see each other):
        the ``image_bytes`` quota of the project and of every ancestor limiting it. Every
        path that names a layer in a project through the API goes through it (build,
        import, tag; pulls naming through the store's tag too)."""
        if project is None:
            return None
        limits = self.charges.image_limits(project)
        if not limits:
            return None

        def admit(layers: Mapping[str, LayerNode], refs: dict[str, str]) -> None:
            for where, limit in limits:
                used = project_image_bytes(layers, refs, where)
                if used > limit:
                    raise QuotaExceeded(
                        f"project {where!r} would hold {used} bytes of image layers "
                        f"(every layer its names reach, shared ones counted in full), over "
                        f"its image_bytes quota of {limit}; nothing was named - delete "
                        "images, prune, or ask an admin of the parent project for more",
                        resource="image_bytes", project=where, used=used, limit=limit,
                        requested=used)
        return admit

    async def prune_images(self, caller: Caller, *, dry_run: bool) -> ImagePruned:
        """Remove every layer nothing references (:meth:`LayerStore.prune`). A
        superuser's: the store is every project's, and whether a layer is garbage is
        decided across all of them. Removed project layers give their bytes back to
        the project's layer-storage quota (``snapshot_bytes``), as a delete does."""
        if not caller.superuser:
            raise PermissionDenied(
                f"cannot prune the layer store: it holds every project's layers, so only "
                f"a superuser may (principal {caller.name!r} is not one); delete your "
                "project's images by name instead")
        store = self._layers()
        res = await asyncio.to_thread(store.prune, dry_run=dry_run)
        if not dry_run:
            for m in res.removed:
                self.charges.release_snapshot(m.digest)
        views = [ImageView(ref=m.digest, digest=m.digest, kind=m.kind,
                           size_bytes=m.size_bytes, created_at=m.created,
                           labels=dict(m.labels), namespace=layer_namespace(m),
                           owner=m.owner) for m in res.removed]
        return ImagePruned(removed=views, freed_bytes=res.freed_bytes,
                           kept_layers=res.kept_layers, kept_bytes=res.kept_bytes,
                           dry_run=dry_run)

    async def _build_pinned(self, caller: Caller, parsed: ParsedRef, ns: str | None,
                            store: LayerStore, pin: Pin,
                            work: Callable[[], list[LayerManifest]]) -> ImageList:
        assert parsed.name is not None
        try:
            made = await asyncio.to_thread(work)
        except DsecError:
            raise
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                log.warning("image build %s failed", parsed.key, exc_info=exc)
                raise ImageError(f"could not build image {parsed.key} from the upload: "
                                 f"{type(exc).__name__}: {exc}") from exc
            # the store's filesystem filled (red team 16 F9's class): a capacity
            # refusal without the host path, not a bad upload; nothing is named
            raise CapacityExceeded(
                f"could not build image {parsed.key}: the layer store's filesystem is "
                f"full ({exc.strerror}); nothing was named - free space in the store "
                "(dsec image prune) or build a smaller image", resource="disk_bytes") from exc
        except Exception as exc:
            log.warning("image build %s failed", parsed.key, exc_info=exc)
            raise ImageError(f"could not build image {parsed.key} from the upload: "
                             f"{type(exc).__name__}: {exc}") from exc
        charged: list[str] = []
        try:
            if ns:
                for m in made:
                    self.charges.charge_snapshot(m.digest, ns, "", m.size_bytes,
                                                 kind=m.kind, parent=m.parent,
                                                 stack=m.stack)
                    charged.append(m.digest)
            store.tag(made[0].digest, parsed.name, parsed.tag, namespace=ns,
                      admit=self.admit_names(ns))
        except BaseException:
            # Only what nothing else names: a reproducible build of a tree already stored
            # returns that layer (and its charge), which stays.
            for m in made:
                with contextlib.suppress(DsecError, OSError):
                    if store.discard(m.digest, pin=pin) and m.digest in charged:
                        self.charges.release_snapshot(m.digest)
            raise
        index = self._index()
        assert index is not None
        can_see = _can_see(caller)
        return ImageList(items=[_image_view(index, m, can_see) for m in made])

    async def promote_image(self, caller: Caller, req: ImagePromoteRequest) -> ImageView:
        """Name a built image (:mod:`dsec.image.promote`): the chain of ``req.top`` laid
        into one base layer on ``req.base``'s stack, in the target's project (the write
        right there; the chain must be that project's own snapshots, and the base one
        the caller sees), carrying the config as a pulled image's ``oci.*`` labels;
        charged to the project's layer storage like a build. ``req.squash``: the base's
        layers laid in too, one standalone layer."""
        from dsec.image.promote import build_chain, promote_chain
        from dsec.image.registry import ImageDefaults, defaults_labels

        target = parse_ref(req.target)
        if target.name is None:
            raise InvalidArgument(f"target {req.target[:200]!r} must be a name "
                                  "([project/]name[:tag]), not a digest", field="target")
        ns = target.namespace if target.namespace is not None else caller.default_project
        _require_write(caller, ns, what=f"name the built image {ns}/{target.name}")
        _, top = self._find_image(caller, req.top)
        _, base = self._find_image(caller, req.base)
        if top.kind != "snapshot" or layer_namespace(top) != ns:
            raise image_not_found(req.top)     # a snapshot of another project: not seen
        store = self._layers()
        room = self.charges.snapshot_room(ns)
        if room == 0:
            self.charges.check_snapshot(ns, 1)
        labels = defaults_labels(ImageDefaults(
            env=dict(req.env), cwd=req.workdir, user=req.user,
            entrypoint=tuple(req.entrypoint), cmd=tuple(req.cmd), labels=dict(req.labels)))
        pin = Pin(store)     # a prune never takes the layer between its build and its tag

        def work() -> list[LayerManifest]:
            chain, image = build_chain(store, top.digest, base.digest)
            return [promote_chain(store, chain, image, labels=labels, namespace=ns,
                                  owner=caller.id, max_bytes=room, pin=pin,
                                  squash=req.squash)]
        try:
            made = await self._build_pinned(caller, target, ns, store, pin, work)
        finally:
            pin.close()
        return made.items[0]

    @contextlib.asynccontextmanager
    async def _pull_slot(self, project: str) -> AsyncIterator[None]:
        """One of the project's PULLS_PER_PROJECT pull slots (the table holds only
        projects with pulls running or waiting)."""
        sem = self._pull_slots.setdefault(project, asyncio.Semaphore(PULLS_PER_PROJECT))
        self._pull_waiting[project] = self._pull_waiting.get(project, 0) + 1
        try:
            async with sem:
                yield
        finally:
            self._pull_waiting[project] -= 1
            if not self._pull_waiting[project]:
                del self._pull_waiting[project], self._pull_slots[project]

    def egress(self) -> EgressPolicy:
        """Where this apiserver's pulls may connect (every hop, every address)."""
        return EgressPolicy(registries=self.registries,
                            blob_hosts=self.registry_blob_hosts)

    def pull_target(self, caller: Caller, req: ImagePullRequest) -> tuple[str | None, str,
                                                                          str]:
        """(namespace, bare name, tag) a pull writes, with the caller's write right on
        that namespace checked (the same rule as a build: member of the project, a
        superuser for a cluster-wide name). Without ``name``: the registry ref's own
        name (:func:`dsec.image.registry.local_name`) in ``project``."""
        from dsec.image.registry import local_name, parse_registry_ref

        r = parse_registry_ref(req.ref)
        check_registry(r.host, self.registries)
        if req.name is not None:
            try:
                p = parse_ref(req.name if ":" in req.name.rsplit("/", 1)[-1]
                              else f"{req.name}:{local_name(r)[1]}")
            except InvalidArgument as exc:
                raise InvalidArgument(exc.message, field="name") from None
            if p.name is None:
                raise InvalidArgument(f"name {req.name[:200]!r} must be [project/]name[:tag], "
                                      "not a digest", field="name")
            ns, name, tag = p.namespace, p.name, p.tag
        else:
            ns = parse_project_path(req.project) if req.project is not None else None
            name, tag = local_name(r)
        _require_write(caller, ns, what=f"pull {req.ref[:200]} into "
                       + (f"project {ns!r}" if ns else "a cluster-wide name"))
        return ns, name, tag

    def blob(self) -> BlobStore:
        """The operator's blob store (``Conflict`` when none is configured)."""
        from dsec.image.blob import open_blobstore

        if self.blob_store is None:
            raise Conflict("this apiserver has no blob store configured: its operator "
                           "starts it with --blob-store URL (dsec up / dsec apiserver)")
        if self._blob_cache is None or self._blob_cache[0] != self.blob_store:
            self._blob_cache = (self.blob_store, open_blobstore(self.blob_store))
        return self._blob_cache[1]

    async def push_image(self, caller: Caller, req: ImagePushRequest) -> ImagePushed:
        """Push an image the caller may see to the blob store: its layer and every layer
        below it (:func:`dsec.image.blob.push.push_image`). The caller needs the write
        right on the image's namespace (a project's member; a superuser for a
        cluster-wide layer), as for a tag: a push copies the layer where every node reads
        it. Idempotent: layers already there whole are skipped."""
        from dsec.image.blob.push import push_image

        _, m = self._find_image(caller, req.ref)
        _require_write(caller, layer_namespace(m), what=f"push {req.ref[:200]}")
        blob = self.blob()
        store = self._layers()
        res = await asyncio.get_running_loop().run_in_executor(
            self._pool(), functools.partial(push_image, blob, store, m.digest,
                                               verify=req.verify))
        return ImagePushed(ref=req.ref, digest=res.digest, store=res.store,
                           layers=[PushedLayerView(digest=p.digest, size_bytes=p.size_bytes,
                                                   chunk_size=p.chunk_size,
                                                   uploaded=p.uploaded)
                                   for p in res.layers],
                           bytes_uploaded=res.bytes_uploaded, seconds=res.seconds)

    async def pushed_chain(self, caller: Caller, ref: str) -> tuple[str, list[str]]:
        """The image ``ref`` (as the caller sees it) and every layer of it, lowest first,
        each checked to be in the blob store whole (``InvalidArgument`` naming the first
        that is not: push the image first)."""
        from dsec.errors import ImageNotFound
        from dsec.image.blob.push import layer_chain, read_remote_layer

        _, m = self._find_image(caller, ref)
        blob = self.blob()
        chain = [x.digest for x in layer_chain(self._layers(), m)]

        def check() -> None:
            for d in chain:
                try:
                    read_remote_layer(blob, d)
                except ImageNotFound as exc:
                    raise InvalidArgument(
                        f"image {ref[:200]!r}: its layer {d} is not in the blob store "
                        f"{blob.url}; push the image first (dsec image push / "
                        "images.push)", field="ref", layer=d) from exc
        await asyncio.get_running_loop().run_in_executor(self._pool(), check)
        return m.digest, chain

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._push_pool is None:
            self._push_pool = concurrent.futures.ThreadPoolExecutor(
                PUSH_WORKERS, thread_name_prefix="dsec-push")
        return self._push_pool

    async def pull_image(self, caller: Caller, req: ImagePullRequest) -> ImageList:
        """Pull a registry image into the layer store (``dsec.image.pull``) as the
        caller: layers built belong to the target namespace and are charged to its
        layer-storage quota (``snapshot_bytes``) like a build; layers it reuses (shared
        base layers already here) are not charged again. Returns the layers, the image
        (its top layer, named) first."""
        from dsec.image.pull import PullOptions, pull_image
        from dsec.image.registry import parse_platform

        ns, name, tag = self.pull_target(caller, req)
        opts = PullOptions(platform=parse_platform(req.platform) if req.platform else None,
                           insecure=req.insecure, creds=req.creds, egress=self.egress())
        store = self._layers()
        room = self.charges.snapshot_room(ns) if ns else None
        if room == 0 and ns:
            self.charges.check_snapshot(ns, 1)   # raises, naming the full quota
        # Every layer of the image pinned from the moment the pull has it until it is
        # named: a prune (CLI, another replica, the store budget) never takes one between.
        with store.pinned() as pin:
            async with self._pull_slot(ns or ""):
                if self._pull_pool is None:
                    self._pull_pool = concurrent.futures.ThreadPoolExecutor(
                        PULL_WORKERS, thread_name_prefix="dsec-pull")
                res = await asyncio.get_running_loop().run_in_executor(
                    self._pull_pool, functools.partial(
                        pull_image, store, req.ref, namespace=ns, owner=caller.id,
                        name=name, tag=tag, options=opts, max_bytes=room, name_it=False,
                        pin=pin))
            charged: list[str] = []
            try:
                if ns:
                    for m in res.made:
                        self.charges.charge_snapshot(m.digest, ns, "", m.size_bytes,
                                                 kind=m.kind, parent=m.parent,
                                                 stack=m.stack)
                        charged.append(m.digest)
                # named only once charged, through the image_bytes check under the
                # store's lock: a refused pull moves no tag
                store.tag(res.image.digest, name, tag, namespace=ns,
                          admit=self.admit_names(ns))
            except BaseException:
                # discard, never remove: a reproducible layer somebody else names or
                # builds at once stays (and keeps its charge)
                for m in reversed(res.made):
                    with contextlib.suppress(DsecError, OSError):
                        if store.discard(m.digest, pin=pin) and m.digest in charged:
                            self.charges.release_snapshot(m.digest)
                raise
        index = self._index()
        assert index is not None
        can_see = _can_see(caller)
        return ImageList(items=[_image_view(index, m, can_see) for m in res.layers])


def check_registry(host: str, allowed: tuple[str, ...] | None) -> None:
    """``PermissionDenied`` unless ``host`` (``name[:port]``) matches one of the
    apiserver's allowed registry patterns. A pattern without a port matches the host on
    any port. None (the default): any registry but the apiserver's own neighbourhood -
    ``localhost`` and IP literals that are loopback, link-local (cloud metadata),
    private, unspecified, multicast or reserved, which only an operator's list opens
    (red team F6). The pull itself holds the same policy on every hop: each redirect,
    token realm and resolved address (:class:`dsec.image.egress.EgressPolicy`, F16)."""
    EgressPolicy(registries=allowed).check_registry(host)


def _named(index: StoreIndex, exact: str) -> LayerManifest | None:
    """The layer an exact store spelling (as :func:`resolve` gives it: a full digest or a
    qualified name) names; None for a name the store does not hold."""
    try:
        p = parse_ref(exact)
    except InvalidArgument:
        return None
    if p.digest_hex is not None:
        return index.manifest(p.digest_hex)
    digest = index.digest_of(p.key)
    return None if digest is None else index.manifest(digest.removeprefix(DIGEST_PREFIX))


def with_image_defaults(spec: SandboxSpec, image: LayerManifest) -> SandboxSpec:
    """``spec`` over its image's config (issue 15 §2): the image's ``Env`` under the
    create's env, its ``WorkingDir``/``User`` where the create gave none. Stored in the
    spec, so the sandbox shows what its execs get and every backend applies the same
    (an exec's own env/cwd/user still win)."""
    from dsec.image.registry import defaults_from_labels

    d = defaults_from_labels(image.labels)
    env = {**d.env, **spec.env} if d.env else spec.env
    cwd = spec.cwd if spec.cwd is not None else d.cwd
    user = spec.user if spec.user is not None else d.user
    if (env, cwd, user) == (spec.env, spec.cwd, spec.user):
        return spec
    return msgspec.structs.replace(spec, env=env, cwd=cwd, user=user).validate()


def _can_see(caller: Caller) -> CanSee:
    """The caller's view of image namespaces: cluster-wide (None) is everyone's, a project
    needs a role on it (or an ancestor); ``""`` (a snapshot naming no project) and
    anything that is not a project path are the superuser's alone."""
    def see(ns: str | None) -> bool:
        if ns is None or caller.superuser:
            return True
        try:
            parse_project_path(ns)
        except InvalidArgument:
            return False
        return caller.role_on(ns) is not None
    return see


def _require_write(caller: Caller, ns: str | None, *, what: str) -> None:
    """The write right on image namespace ``ns``: ``member`` of the project (members
    already write project layers: snapshots); cluster-wide names: a superuser only."""
    if ns is None:
        if not caller.superuser:
            raise PermissionDenied(
                f"cannot {what}: cluster-wide image names are writable only by a "
                f"superuser (principal {caller.name!r} is not one); use a name in your "
                f"project instead, e.g. '{caller.default_project}/<name>'")
        return
    if not ns:
        raise PermissionDenied(f"cannot {what}: it belongs to no project")
    ApiService.require(caller, ns, "member")


def _image_view(index: StoreIndex, m: LayerManifest, can_see: CanSee) -> ImageView:
    names = visible_names(index, m, can_see)
    return ImageView(ref=names[0] if names else m.digest, refs=names, digest=m.digest,
                     kind=m.kind, size_bytes=m.size_bytes, created_at=m.created,
                     labels=dict(m.labels), namespace=layer_namespace(m), owner=m.owner,
                     skipped=dict(m.skipped))
