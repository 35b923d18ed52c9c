"""The content-addressed layer store of one node.

Layout under ``root`` (every directory 0700, every file 0600, layers 0400: a layer
holds one project's files and a manifest names its project, so no other host user may
read them, even when the store lives outside a private state dir)::

    layers/<hex>.erofs      the layer files, named by their sha256, read-only
    manifests/<hex>.json    LayerManifest per layer
    index/<hex>.idx         pack_diff's record of the upperdir a snapshot was taken from
    refs.json               {"[project/]name:tag": "sha256:<hex>"}
    tmp/<owner>-*           staging trees and half-written layers, named by their process
                            (never read as layers; a dead process's go on the next open)
    pins/<owner>-*.json     digests a live process made and has not named yet (gc.py)
    budget                  the store budget in bytes, when one is set (set_budget)
    lock                    flock(2) taken by every mutation (CLI and edge may race);
                            shared while a stack is resolved and mounted (prune waits)

Names are namespaced (:mod:`dsec.image.manifest`): ``teama/tools:v1`` is project
``teama``'s, ``tools:v1`` is cluster-wide. The store answers exact names and digests for
whoever may open it (the host's dsec processes); who may *see* or *write* which name is
the control plane's rule (:mod:`dsec.image.catalog`), except one rule kept here so no door
can skip it: a tag in namespace N only ever points at a layer of N, of an ancestor of N,
or a cluster-wide one (:meth:`LayerStore.tag`), so a tag never moves to a tree built by
someone without the right on N.

A layer appears atomically: the EROFS file is written under ``tmp/``, hashed, renamed
into ``layers/`` and only then gets its manifest. A failed build or import leaves
nothing behind but a ``tmp/`` entry that is removed on the way out - or, when the process
was killed (-9) mid-build, by the next ``LayerStore`` opened on the same root: scratch
entries are named by their process (``tmp/<owner token>-...``, :mod:`dsec.ownership`).

Builds are reproducible (:mod:`dsec.image.erofs`): the same tree built as the same
thing - kind, namespace, parent, stack, labels, compression, layout; not its name, tag,
owner or time - gives the same bytes, so the same digest, and the store keeps one layer
and one manifest for it (the first build's; a later build only moves its name). The
filesystem UUID is derived from that identity (:func:`dsec.image.erofs.layer_uuid`), so
two projects building the same tree still get two layers, each with its own namespace
in its manifest, and a snapshot never shares a digest with an image.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, Protocol

import msgspec

from dsec import ownership, statedir
from dsec.errors import (
    ImageError,
    ImageNotFound,
    InUse,
    InvalidArgument,
    PermissionDenied,
    QuotaExceeded,
)
from dsec.ids import parse_project_path
from dsec.image.archive import DEFAULT_LIMITS, ExtractLimits, extract_tar
from dsec.image.erofs import (
    Compression,
    OutputTooLarge,
    ProgressFn,
    hash_file,
    layer_uuid,
    layout_for,
    mkfs_erofs,
)
from dsec.image.gc import LayerNode, plan_prune, project_image_bytes
from dsec.image.manifest import (
    DIGEST_PREFIX,
    LAYER_KINDS,
    PROJECT_LABEL,
    ChunkTableRef,
    LayerKind,
    LayerManifest,
    layer_namespace,
    parse_ref,
    ref_key,
)
from dsec.image.tree import skip_counts, tree_stats
from dsec.rmtree import remove_tree, unescape_mountinfo

__all__ = ["LayerStore", "Pin", "PruneResult", "may_point_at", "mounted_sources"]

_DIR_MODE = 0o700
_FILE_MODE = 0o600
_LAYER_MODE = 0o400
_SUBDIRS = ("layers", "manifests", "index", "tmp", "pins")

BUDGET_GRACE_S = 600.0
"""The automatic budget prune leaves layers used (built, mounted) in the last 10 minutes:
a build or pull that makes several layers and names them at the end, without a
:class:`Pin`, is not cut short by its own next layer (an explicit prune does not wait)."""
PRUNE_BATCH = 64
"""Layers a prune removes per hold of the store's lock (see :meth:`LayerStore.prune`)."""

_json_enc = msgspec.json.Encoder()
_pins_dec = msgspec.json.Decoder(list[str])


class PruneResult(msgspec.Struct, frozen=True):
    """What a prune removed (or would, ``dry_run``)."""

    removed: tuple[LayerManifest, ...]
    freed_bytes: int
    kept_layers: int
    kept_bytes: int
    orphans: int = 0
    """Files of half-removed layers swept (a prune killed between a manifest and its
    layer file)."""
    dry_run: bool = False


class Pin:
    """Layers a live process holds without a name yet (a build or import between making a
    layer and tagging it): :meth:`LayerStore.prune` keeps them. A file under ``pins/``
    named by the process (:mod:`dsec.ownership`), so a killed holder pins nothing."""

    def __init__(self, store: LayerStore) -> None:
        self._store = store
        self.path = os.path.join(store.root, "pins",
                                 f"{ownership.token()}-{secrets.token_hex(6)}.json")
        self.digests: set[str] = set()

    def _write_locked(self) -> None:
        _write_private(self.path, _json_enc.encode(sorted(self.digests)), durable=False)

    def add(self, digest: str) -> None:
        """Pin a layer that exists (``ImageNotFound`` if a prune removed it first)."""
        with self._store._locked():
            if self._store._load_opt(digest.removeprefix(DIGEST_PREFIX)) is None:
                raise ImageNotFound(f"no layer {digest} in {self._store.root}", ref=digest)
            self.digests.add(digest)
            self._write_locked()

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.digests.clear()
_manifest_dec = msgspec.json.Decoder(LayerManifest)
_refs_dec = msgspec.json.Decoder(dict[str, str])


def mounted_sources() -> set[str]:
    """Sources of every mount in this mount namespace (layer files appear here)."""
    out: set[str] = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            _, _, rest = line.partition(" - ")
            parts = rest.split(" ")
            if len(parts) >= 2:
                out.add(unescape_mountinfo(parts[1]))
    return out


def may_point_at(namespace: str | None, layer: LayerManifest) -> bool:
    """Whether a tag in ``namespace`` (None: cluster-wide) may name ``layer``: only a
    layer built in that namespace, in an ancestor project (whose writers hold the right
    on every descendant), or cluster-wide (built by a superuser); never a snapshot."""
    if layer.kind == "snapshot":
        return False
    owner = layer_namespace(layer)
    if owner is None:
        return True
    if namespace is None:
        return False
    return namespace == owner or namespace.startswith(owner + "/")


def _write_private(path: str, data: bytes, *, durable: bool = True) -> None:
    """Write ``path`` atomically (temp file + rename), mode 0600 whatever the umask.
    ``durable``: the file fsynced before the rename and its directory after it, so what
    a build or pull answered "done" to (its manifest, its name in refs.json, the chunk
    table a push recorded) survives a power loss too, not only kill -9 - before, a crash
    could leave an empty refs.json (every name lost) or a manifest without its layer.
    Measured: ~1-4 ms per write on the dev VM's disk, against a build's seconds. Pins are
    not durable (a pin names a live process; after a crash it is stale anyway)."""
    if durable:
        statedir.write_private_file(path, data)
        return
    tmp = f"{path}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _publish_layer(src: str, dst: str) -> None:
    """Move a finished layer file into ``layers/`` durably: its data fsynced before the
    rename (a renamed-but-empty layer after a power loss would be a corrupt filesystem
    image with a valid name), the directory after it (before its manifest is written)."""
    fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(src, dst)
    statedir.fsync_dir(os.path.dirname(dst))


class RefTable(Protocol):
    """Where a layer store's names live when they are not its own ``refs.json``: the
    state store's tag table (:class:`dsec.control.store.tags.StoreTags`), shared by every
    apiserver replica, so every replica answers a name with the same layer."""

    def read(self) -> dict[str, str]:
        """Every name -> digest, as of now."""
        ...

    def update(self, changes: Mapping[str, LayerManifest | None]) -> None:
        """Set names to layers (None: remove the name), in one change."""
        ...

    def signature(self, *, exact: bool = False) -> object:
        """A value that differs after every change (a cheap check before a re-read).
        ``exact``: as of now, also for a change another replica made a moment ago
        (otherwise it may lag by the time that change takes to be announced)."""
        ...

    def manifest(self, digest: str) -> LayerManifest | None:
        """The manifest of a named layer as the table keeps it (a replica that never
        stored the layer still knows what its name is)."""
        ...


class LayerStore:
    """Layers by digest, names by ``name:tag``; safe for concurrent processes.

    ``refs``: where the names live (None: ``refs.json`` in the store). With a table, the
    table is the truth and keeps ``refs.json`` in step with it, for the processes
    sharing the directory that read and write names in
    the file (the edges of ``dsec up``): :class:`dsec.control.store.tags.HostNames`."""

    def __init__(self, root: str, *, budget_bytes: int | None = None,
                 refs: RefTable | None = None) -> None:
        """``budget_bytes``: after a build stores a new layer and the store holds more
        than this, the least recently used unreferenced layers go (:meth:`prune`). None:
        the budget recorded in the store (:meth:`set_budget`), read at every build, so
        every process sharing the store (edges, apiserver, CLI) keeps the same one."""
        if budget_bytes is not None and budget_bytes < 0:
            raise InvalidArgument(f"image store budget {budget_bytes} must be >= 0 bytes")
        self.root = os.path.abspath(root)
        self._budget = budget_bytes
        self.ref_table = refs
        try:
            for d in (self.root, *(os.path.join(self.root, s) for s in _SUBDIRS)):
                os.makedirs(d, mode=_DIR_MODE, exist_ok=True)
                # Also when it existed (a store made by an older dsec, or a pre-created
                # 0755 dir): the layers are tenants' files.
                if os.stat(d).st_uid == os.geteuid():
                    os.chmod(d, _DIR_MODE)
        except OSError as exc:
            raise ImageError(f"cannot open the layer store at {self.root}: {exc.strerror or exc}"
                             "; run as the user owning it (root for dsec up's store) or "
                             "point --root / $DSEC_IMAGE_ROOT elsewhere") from exc
        self._reclaim_scratch()

    # ----------------------------------------------------------------- paths & locking
    def layer_path(self, layer: LayerManifest | str) -> str:
        digest = layer.digest if isinstance(layer, LayerManifest) else layer
        return os.path.join(self.root, "layers", digest.removeprefix(DIGEST_PREFIX) + ".erofs")

    def _manifest_path(self, hx: str) -> str:
        return os.path.join(self.root, "manifests", hx + ".json")

    def index_path(self, digest: str) -> str:
        return os.path.join(self.root, "index", digest.removeprefix(DIGEST_PREFIX) + ".idx")

    @contextlib.contextmanager
    def _locked(self, mode: int = fcntl.LOCK_EX) -> Iterator[None]:
        fd = os.open(os.path.join(self.root, "lock"), os.O_RDWR | os.O_CREAT, _FILE_MODE)
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def using(self) -> Iterator[None]:
        """Hold off prunes (a shared lock) while layers are resolved and mounted: a
        create about to mount a layer either mounts it before a prune looks (which then
        sees the mount and keeps it) or finds it already gone (``ImageNotFound``)."""
        with self._locked(fcntl.LOCK_SH):
            yield

    @contextlib.contextmanager
    def pinned(self) -> Iterator[Pin]:
        """A :class:`Pin` for the layers made inside (pass it as ``pin=``), dropped on
        exit: name them before that."""
        pin = Pin(self)
        try:
            yield pin
        finally:
            pin.close()

    def touch(self, digest: str) -> None:
        """Record a use of the layer (its manifest's mtime: the LRU order of budget
        prunes)."""
        with contextlib.suppress(FileNotFoundError, PermissionError):
            os.utime(self._manifest_path(digest.removeprefix(DIGEST_PREFIX)))

    def _scratch(self, name: str) -> str:
        """A path for scratch entry ``name`` in ``tmp/``, prefixed with this process's
        owner token (:mod:`dsec.ownership`): what a killed process leaves there is
        removed by the next store opened."""
        return os.path.join(self.root, "tmp", f"{ownership.token()}-{name}")

    def _reclaim_scratch(self) -> None:
        """Remove the scratch entries of processes that died mid-build (a kill -9 skips
        the cleanup on the way out: staging trees and half-written layers stayed, ~the
        size of each snapshot, for good). A live owner's, another pid namespace's and
        names without an owner token (made by older versions) are left alone. Never
        across a mount point: what a killed helper left mounted below a dead entry (a
        killed root-mode mmdebstrap's binds of the host's /dev/shm, /proc, /sys) is
        detached first, and the walk itself stays on the store's mount
        (:func:`dsec.rmtree.remove_tree`)."""
        try:
            entries = list(os.scandir(os.path.join(self.root, "tmp")))
        except OSError:
            return
        for e in entries:
            if ownership.token_alive(e.name.split("-", 1)[0]) is not False:
                continue
            remove_tree(e.path, detach=True)

    @contextlib.contextmanager
    def staging(self, prefix: str = "stage-") -> Iterator[str]:
        """A scratch directory inside the store (same filesystem), removed on exit
        (mounts a helper left below it detached first, never walked into)."""
        path = self._scratch(prefix + secrets.token_hex(6))
        os.mkdir(path, _DIR_MODE)
        try:
            yield path
        finally:
            remove_tree(path, detach=True)

    # ------------------------------------------------------------------------- refs
    def _read_refs(self) -> dict[str, str]:
        if self.ref_table is not None:
            return self.ref_table.read()
        return self._read_refs_file()

    def _read_refs_file(self) -> dict[str, str]:
        try:
            with open(os.path.join(self.root, "refs.json"), "rb") as f:
                return _refs_dec.decode(f.read())
        except FileNotFoundError:
            return {}

    def _write_refs_file(self, refs: dict[str, str]) -> None:
        _write_private(os.path.join(self.root, "refs.json"),
                       _json_enc.encode(dict(sorted(refs.items()))))

    def _change_refs(self, changes: Mapping[str, LayerManifest | None]) -> None:
        """Set (a manifest) or remove (None) names; the lock held. Only these keys are
        written: a table shared with other replicas keeps the names they set meanwhile."""
        if not changes:
            return
        if self.ref_table is not None:
            self.ref_table.update(changes)   # the table keeps refs.json in step itself
            return
        refs = self._read_refs_file()
        for key, m in changes.items():
            if m is None:
                refs.pop(key, None)
            else:
                refs[key] = m.digest
        self._write_refs_file(refs)

    def refs(self) -> dict[str, str]:
        """``[project/]name:tag`` -> digest."""
        return self._read_refs()

    def tag(self, ref: str, name: str, tag: str = "latest", *,
            namespace: str | None = None,
            admit: Callable[[Mapping[str, LayerNode], dict[str, str]], None] | None = None,
            ) -> LayerManifest:
        """Point ``[namespace/]name:tag`` at the layer ``ref`` names (moves an existing
        tag). ``PermissionDenied`` unless that layer may carry a name of ``namespace``
        (:func:`may_point_at`): a tag never moves to a tree built outside its namespace.

        ``admit(layers, refs)``: called under the store's lock with every layer and the
        names as they would be; it may raise (a project's ``image_bytes`` quota,
        :func:`dsec.image.gc.project_image_bytes`) and nothing changes. Under the lock,
        two builds (two apiserver replicas, the CLI) cannot both fit the last room."""
        key = _name_key(namespace, name, tag)
        m = self.get(ref)
        if not may_point_at(namespace, m):
            where = layer_namespace(m)
            raise PermissionDenied(
                f"cannot tag {m.kind} layer {m.digest} as {key}: "
                + ("a snapshot is not an image; start sandboxes from it with snapshot="
                   if m.kind == "snapshot" else
                   f"it was built in project {where!r}, and a "
                   + (f"name in project {namespace!r}" if namespace else "cluster-wide name")
                   + " may only point at layers built there, in an ancestor project or "
                   "cluster-wide; build it under that name instead"))
        with self._locked():
            # Again under the lock: a prune may have removed an unnamed layer since the
            # get() above, and a name must never point at nothing.
            if self._load_opt(m.hex) is None:
                raise ImageNotFound(f"layer {m.digest} was removed (pruned: it had no "
                                    "name) before it could be tagged; build it again",
                                    ref=ref)
            refs = self._read_refs()
            refs[key] = m.digest
            if admit is not None:
                admit(self._nodes(), refs)
            self._change_refs({key: m})
        return m

    def _nodes(self) -> dict[str, LayerNode]:
        """Every layer as the pure gc functions take them (read the lock held)."""
        nodes = {}
        for m in self.manifests():
            try:
                used = os.stat(self._manifest_path(m.hex)).st_mtime
            except FileNotFoundError:
                continue
            below = ((m.parent,) if m.parent else ()) + tuple(m.stack)
            # the manifest's mtime: its creation, then every use (touch)
            nodes[m.digest] = LayerNode(m.digest, m.kind, m.size_bytes, used, below)
        return nodes

    def project_image_bytes(self, project: str) -> int:
        """Bytes of the layers ``project``'s names reach (:func:`dsec.image.gc.
        project_image_bytes`: shared layers fully, snapshots not at all)."""
        with self.using():
            return project_image_bytes(self._nodes(), self._read_refs(), project)

    def untag(self, key: str) -> str | None:
        """Remove the name ``key`` (``[project/]name:tag``); returns the digest it named
        (None when there was no such name). The layer stays."""
        parse_ref(key)
        with self._locked():
            digest = self._read_refs().get(key)
            if digest is not None:
                self._change_refs({key: None})
        return digest

    # ------------------------------------------------------------------------ reads
    def get(self, ref: str) -> LayerManifest:
        """The manifest ``ref`` names (``name[:tag]``, ``sha256:<hex or prefix>``)."""
        p = parse_ref(ref)
        if p.digest_hex is not None:
            hx = p.digest_hex
            if len(hx) < 64:
                matches = [n[:-5] for n in os.listdir(os.path.join(self.root, "manifests"))
                           if n.startswith(hx) and n.endswith(".json")]
                if len(matches) > 1:
                    raise InvalidArgument(f"digest prefix {ref!r} is ambiguous: it matches "
                                          f"{len(matches)} layers; give more digits")
                if not matches:
                    raise ImageNotFound(f"no layer with digest {ref!r} in {self.root}", ref=ref)
                hx = matches[0]
            return self._load(hx, ref)
        digest = self._read_refs().get(p.key)
        if digest is None:
            raise ImageNotFound(f"no image named {p.key} in {self.root}; "
                                "see `dsec image ls`", ref=ref)
        if self.ref_table is not None and not self.has(digest):
            # named by another replica, stored on its host: the table knows what it is
            shared = self.ref_table.manifest(digest)
            if shared is not None:
                return shared
        return self._load(digest.removeprefix(DIGEST_PREFIX), ref)

    def _load(self, hx: str, ref: str) -> LayerManifest:
        try:
            with open(self._manifest_path(hx), "rb") as f:
                return _manifest_dec.decode(f.read())
        except FileNotFoundError:
            raise ImageNotFound(f"no layer {DIGEST_PREFIX}{hx} in {self.root} (ref {ref!r})",
                                ref=ref) from None
        except msgspec.DecodeError as exc:
            raise ImageError(f"manifest of {DIGEST_PREFIX}{hx} is unreadable: {exc}") from exc

    def _load_opt(self, hx: str) -> LayerManifest | None:
        try:
            return self._load(hx, hx)
        except ImageNotFound:
            return None

    def has(self, digest: str) -> bool:
        """Whether the layer ``digest`` (full) is stored."""
        return os.path.exists(self._manifest_path(digest.removeprefix(DIGEST_PREFIX)))

    def manifests(self) -> list[LayerManifest]:
        out = []
        for n in sorted(os.listdir(os.path.join(self.root, "manifests"))):
            if n.endswith(".json"):
                # removed since the listdir (a prune or rm in another process): gone
                m = self._load_opt(n[:-5])
                if m is not None:
                    out.append(m)
        return sorted(out, key=lambda m: m.created)

    def lowers(self, top: LayerManifest) -> list[LayerManifest]:
        """A snapshot's full stack (its chain, then the image), highest first."""
        out = [top]
        seen = {top.digest}
        cur = top
        while cur.parent is not None:
            cur = self.get(cur.parent)
            if cur.digest in seen:
                raise ImageError(f"snapshot chain of {top.digest} loops at {cur.digest}")
            seen.add(cur.digest)
            out.append(cur)
        out.extend(self.get(d) for d in top.stack)
        return out

    # ----------------------------------------------------------------------- writes
    def add_tree(self, src_dir: str, *, kind: LayerKind, name: str | None = None,
                 tag: str = "latest", labels: dict[str, str] | None = None,
                 compression: Compression | None = None, parent: str | None = None,
                 stack: Sequence[str] = (), progress: ProgressFn | None = None,
                 max_bytes: int | None = None, max_apparent_bytes: int | None = None,
                 what: str = "layer", namespace: str | None = None,
                 owner: str | None = None, pin: Pin | None = None,
                 skipped: dict[str, int] | None = None) -> LayerManifest:
        """Pack the directory ``src_dir`` into a new layer of project ``namespace`` (None:
        cluster-wide; a snapshot's comes from its project label), named
        ``[namespace/]name:tag`` when ``name`` (bare, no '/') is given.

        Bounds (``QuotaExceeded`` naming them, nothing stored): ``max_bytes`` for the
        layer file (checked on the estimate before mkfs and on the result before it
        enters the store), ``max_apparent_bytes`` for the file sizes mkfs must read
        (sparse files are read whole by mkfs.erofs 1.5: that is its time).

        Special files are left out by :func:`dsec.image.tree.special_skip` (device nodes
        but whiteouts, sockets) and counted in the manifest's ``skipped``, with
        ``skipped``: what the caller already left out upstream (a tar's device members).

        ``pin``: the new layer is pinned (kept by prunes) from the moment it appears until
        the pin closes; pass one when the layer gets its name only later."""
        if kind not in LAYER_KINDS:
            raise InvalidArgument(f"layer kind {kind!r} is not one of {', '.join(LAYER_KINDS)}")
        if namespace is not None:
            parse_project_path(namespace)
        elif kind == "snapshot" and labels and PROJECT_LABEL in labels:
            with contextlib.suppress(InvalidArgument):
                namespace = parse_project_path(labels[PROJECT_LABEL])
        key = _name_key(namespace, name, tag) if name is not None else None
        if not os.path.isdir(src_dir):
            raise InvalidArgument(f"cannot build a layer from {src_dir!r}: not a directory")
        stats = tree_stats(src_dir)
        if max_apparent_bytes is not None and stats.apparent_bytes > max_apparent_bytes:
            raise QuotaExceeded(
                f"{what} would pack {stats.apparent_bytes} bytes of file contents (sparse "
                f"files count at their full size; {stats.allocated_bytes} bytes allocated), "
                f"over the limit of {max_apparent_bytes}; remove or shrink large (sparse) "
                "files first", resource="apparent_bytes", used=stats.apparent_bytes,
                limit=max_apparent_bytes, requested=stats.apparent_bytes)
        chunk = layout_for(files=stats.files, apparent_bytes=stats.apparent_bytes,
                           allocated_bytes=stats.chunked_bytes, entries=stats.entries)
        if max_bytes is not None and chunk is None and compression is None \
                and stats.apparent_bytes > max_bytes:
            # a flat, uncompressed layer holds every apparent byte: refuse before mkfs
            raise self._too_big(what, stats.apparent_bytes, max_bytes, "at least")
        tmp = self._scratch(f"layer-{secrets.token_hex(6)}.erofs")
        try:
            try:
                mkfs_erofs(src_dir, tmp, compression=compression, chunk_bytes=chunk,
                           expected_bytes=max(stats.content_bytes, 1), progress=progress,
                           max_output_bytes=max_bytes, exclude=stats.skip_paths,
                           uuid=_identity_uuid(kind, namespace, parent, stack, labels,
                                               compression, chunk))
            except OutputTooLarge as exc:
                raise self._too_big(what, exc.limit, exc.limit, "more than") from exc
            size = os.stat(tmp).st_blocks * 512
            if max_bytes is not None and size > max_bytes:
                raise self._too_big(what, size, max_bytes, "")
            hx = hash_file(tmp, progress=progress)
            size = os.stat(tmp).st_size
            os.chmod(tmp, _LAYER_MODE)
            # Reproducible: a digest already stored is the same tree built as the same
            # thing (the UUID carries kind, namespace, parent, stack, labels, layout), so
            # the store keeps that layer and its manifest and only moves the name. Two
            # projects' identical trees differ in UUID, so each has its own manifest.
            manifest = LayerManifest(
                digest=DIGEST_PREFIX + hx, kind=kind, size_bytes=size, created=time.time(),
                name=name, tag=tag if name else None, namespace=namespace, owner=owner,
                content_bytes=stats.content_bytes,
                entries=stats.entries, compression=compression, labels=dict(labels or {}),
                parent=parent, stack=tuple(stack),
                skipped=skip_counts(stats.skipped, skipped or {}))
            with self._locked():
                existing = self._load_opt(hx)
                if existing is None or not os.path.exists(self.layer_path(hx)):
                    _publish_layer(tmp, self.layer_path(manifest.digest))
                if existing is None:
                    _write_private(self._manifest_path(hx), _json_enc.encode(manifest))
                else:
                    manifest = existing
                    self.touch(hx)
                if key is not None:
                    self._change_refs({key: manifest})
                if existing is not None and existing.skipped != skip_counts(
                        stats.skipped, skipped or {}):
                    # the same tree from another source (a tar cannot carry sockets): the
                    # stored manifest keeps the first build's counts, the answer says
                    # what this build left out
                    manifest = msgspec.structs.replace(
                        existing, skipped=skip_counts(stats.skipped, skipped or {}))
                if pin is not None:
                    pin.digests.add(manifest.digest)
                    pin._write_locked()
                if self.budget_bytes is not None:
                    self._prune_locked(budget_bytes=self.budget_bytes,
                                       keep=(manifest.digest,),
                                       idle_before=time.time() - BUDGET_GRACE_S)
            return manifest
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def incoming(self) -> str:
        """A scratch path for a layer file arriving from another node (issue 16): in
        ``tmp/`` under this process's owner token, so one a kill -9 left half-written is
        removed by the next store opened (:meth:`_reclaim_scratch`)."""
        return self._scratch(f"incoming-{secrets.token_hex(6)}.erofs")

    def adopt(self, path: str, manifest: LayerManifest) -> LayerManifest:
        """Publish the layer file at ``path`` (a scratch path, :meth:`incoming`), whose
        sha256 the caller checked to be ``manifest.digest``: renamed into ``layers/``,
        then its manifest written, under the store's lock, then the budget enforced as
        for a build (least recently used unreferenced layers go, never this one). A layer
        already stored is kept and ``path`` removed (idempotent). Refuses a manifest whose
        layers below (``parent``, ``stack``) are not here: publish lowest first."""
        hx = manifest.digest.removeprefix(DIGEST_PREFIX)
        try:
            with self._locked():
                for below in (*manifest.stack, *((manifest.parent,) if manifest.parent else ())):
                    if self._load_opt(below.removeprefix(DIGEST_PREFIX)) is None:
                        raise ImageError(f"cannot store layer {manifest.digest}: the layer "
                                         f"{below} it stands on is not in {self.root}")
                existing = self._load_opt(hx)
                if existing is not None and os.path.exists(self.layer_path(hx)):
                    self.touch(hx)
                    return existing
                os.chmod(path, _LAYER_MODE)
                _publish_layer(path, self.layer_path(manifest.digest))
                _write_private(self._manifest_path(hx), _json_enc.encode(manifest))
                if self.budget_bytes is not None:
                    self._prune_locked(budget_bytes=self.budget_bytes,
                                       keep=(manifest.digest,),
                                       idle_before=time.time() - BUDGET_GRACE_S)
                return manifest
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def stored_digests(self) -> list[str]:
        """Digests of the layers whose file is in this store (two listdirs): what this
        node can hand to another. A layer read lazily from a blob store (issue 17) has a
        manifest here but no file, so it is not one of them."""
        try:
            files = {n[:-6] for n in os.listdir(os.path.join(self.root, "layers"))
                     if n.endswith(".erofs")}
            names = os.listdir(os.path.join(self.root, "manifests"))
        except FileNotFoundError:
            return []
        return [DIGEST_PREFIX + n[:-5] for n in names
                if n.endswith(".json") and n[:-5] in files]

    def record_chunk_table(self, digest: str, ref: ChunkTableRef) -> LayerManifest:
        """Note in a stored layer's manifest the chunk table a push published for it
        (:mod:`dsec.image.blob.push`, after hashing the whole file): the record a lazy
        node checks the blob store's table against. Returns the updated manifest."""
        hx = digest.removeprefix(DIGEST_PREFIX)
        with self._locked():
            m = self._load(hx, digest)
            if m.chunk_table == ref:
                return m
            m = msgspec.structs.replace(m, chunk_table=ref)
            _write_private(self._manifest_path(hx), _json_enc.encode(m))
            return m

    def add_remote(self, manifest: LayerManifest) -> LayerManifest:
        """Record a layer this node reads lazily from a blob store (issue 17): its
        manifest only, no layer file (:meth:`layer_path` does not exist). The layers
        below it must be known here first (lowest first, as :meth:`adopt`). Idempotent."""
        hx = manifest.digest.removeprefix(DIGEST_PREFIX)
        with self._locked():
            existing = self._load_opt(hx)
            if existing is not None:
                return existing
            for below in (*manifest.stack, *((manifest.parent,) if manifest.parent else ())):
                if self._load_opt(below.removeprefix(DIGEST_PREFIX)) is None:
                    raise ImageError(f"cannot record layer {manifest.digest}: the layer "
                                     f"{below} it stands on is not in {self.root}")
            _write_private(self._manifest_path(hx), _json_enc.encode(manifest))
            return manifest

    def replace_remote(self, manifest: LayerManifest) -> LayerManifest:
        """[lazy3] Make the manifest of a layer this node reads lazily (no layer file
        here) exactly ``manifest``: the control plane's grant wins over a record made
        before (an older node resolved it from the blob store's own ``.manifest``). A
        layer stored whole is left alone (its file is the truth). Returns what is
        recorded."""
        hx = manifest.digest.removeprefix(DIGEST_PREFIX)
        with self._locked():
            existing = self._load_opt(hx)
            if existing is None:
                raise ImageNotFound(f"layer {manifest.digest} is not in {self.root}",
                                    ref=manifest.digest)
            if os.path.exists(self.layer_path(hx)) or existing == manifest:
                return existing
            for below in (*manifest.stack, *((manifest.parent,) if manifest.parent else ())):
                if self._load_opt(below.removeprefix(DIGEST_PREFIX)) is None:
                    raise ImageError(f"cannot record layer {manifest.digest}: the layer "
                                     f"{below} it stands on is not in {self.root}")
            _write_private(self._manifest_path(hx), _json_enc.encode(manifest))
            return manifest

    @staticmethod
    def _too_big(what: str, size: int, limit: int, qualifier: str) -> QuotaExceeded:
        return QuotaExceeded(
            f"{what} would take {qualifier + ' ' if qualifier else ''}{size} bytes, over the "
            f"limit of {limit} bytes; nothing was stored - take it with fewer or smaller "
            "files, or raise the quota", resource="snapshot_bytes", used=size, limit=limit,
            requested=size)

    def add_tar(self, fileobj: IO[bytes], *, kind: LayerKind, name: str | None = None,
                tag: str = "latest", labels: dict[str, str] | None = None,
                compression: Compression | None = None,
                limits: ExtractLimits = DEFAULT_LIMITS, oci_whiteouts: bool = False,
                progress: ProgressFn | None = None, namespace: str | None = None,
                owner: str | None = None, max_bytes: int | None = None,
                pin: Pin | None = None) -> LayerManifest:
        """Build a layer from a tar stream, unpacked safely into a staging directory."""
        if name is not None:
            _name_key(namespace, name, tag)  # a bad name fails before the upload is unpacked
        with self.staging() as stage:
            ex = extract_tar(fileobj, stage, limits=limits, oci_whiteouts=oci_whiteouts)
            return self.add_tree(stage, kind=kind, name=name, tag=tag, labels=labels,
                                 compression=compression, progress=progress,
                                 namespace=namespace, owner=owner, max_bytes=max_bytes,
                                 pin=pin, skipped=ex.skipped)

    def users(self, digest: str) -> list[str]:
        """Why ``digest`` cannot be removed: mounts of it and layers that build on it."""
        why = []
        if self.layer_path(digest) in mounted_sources():
            why.append("mounted on this node")
        for m in self.manifests():
            if m.parent == digest or digest in m.stack:
                why.append(f"{'snapshot' if m.kind == 'snapshot' else 'image'} {m.digest} "
                           "builds on it")
        return why

    def remove(self, ref: str) -> LayerManifest:
        """Delete a layer and every ref to it; refuses (InUse) while anything uses it."""
        m = self.get(ref)
        with self._locked():
            why = self.users(m.digest)
            if why:
                raise InUse(f"layer {m.ref} ({m.digest}) is in use: {'; '.join(why)}; "
                            "destroy the sandboxes / snapshots using it first",
                            digest=m.digest)
            self._change_refs({k: None for k, v in self._read_refs().items()
                               if v == m.digest})
            self._unlink_layer(m.digest)
        return m

    def discard(self, digest: str, *, pin: Pin | None = None) -> bool:
        """Remove the layer ``digest`` only if nothing names, uses or pins it (a build
        rolled back: with reproducible builds its digest may be a layer that was already
        there, named by someone else or being built by another request at once, which
        must stay); ``pin``, the caller's own, does not count. True when removed."""
        with self._locked():
            m = self._load_opt(digest.removeprefix(DIGEST_PREFIX))
            if m is None or m.digest in self._read_refs().values() or self.users(m.digest):
                return False
            if m.digest in self._live_pins(but=pin.path if pin is not None else None):
                return False
            self._unlink_layer(m.digest)
        return True

    def _unlink_layer(self, digest: str) -> None:
        """The files of one layer, manifest first (held under the lock): a kill -9
        between them leaves a layer file without a manifest, which no ref or lookup can
        reach and the next prune sweeps."""
        for path in (self._manifest_path(digest.removeprefix(DIGEST_PREFIX)),
                     self.layer_path(digest), self.index_path(digest)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    # ------------------------------------------------------------------------ prune
    @property
    def budget_bytes(self) -> int | None:
        if self._budget is not None:
            return self._budget
        try:
            with open(os.path.join(self.root, "budget"), "rb") as f:
                value = int(f.read().strip())
        except (FileNotFoundError, ValueError):
            return None
        return value if value >= 0 else None

    def set_budget(self, budget_bytes: int | None) -> None:
        """Record the store budget for every process opening this store (None: off)."""
        path = os.path.join(self.root, "budget")
        if budget_bytes is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
        if budget_bytes < 0:
            raise InvalidArgument(f"image store budget {budget_bytes} must be >= 0 bytes")
        with self._locked():
            _write_private(path, str(budget_bytes).encode())

    def _live_pins(self, *, but: str | None = None) -> set[str]:
        """Digests pinned by live processes (but the pin file ``but``); dead holders' pin
        files are removed."""
        out: set[str] = set()
        pins = os.path.join(self.root, "pins")
        for n in os.listdir(pins):
            if but is not None and os.path.join(pins, n) == but:
                continue
            if ownership.token_alive(n.split("-", 1)[0]) is False:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(pins, n))
                continue
            try:
                with open(os.path.join(pins, n), "rb") as f:
                    out.update(_pins_dec.decode(f.read()))
            except (FileNotFoundError, msgspec.DecodeError):
                continue
        return out

    def prune(self, *, dry_run: bool = False, budget_bytes: int | None = None) -> PruneResult:
        """Remove every layer nothing references (:mod:`dsec.image.gc`: names, snapshots
        and what they stand on, mounts on this node, pins of live builds), or with
        ``budget_bytes`` the least recently used of them until the store fits. All under
        the store's lock, so a tag, a build or a mount cannot slip in between the check
        and the removal; a kill -9 midway leaves whole layers or manifest-less files the
        next prune sweeps (``orphans``).

        The lock is taken for at most :data:`PRUNE_BATCH` removals at a time, each round
        planned afresh: unlinks cost ~0.3-3 ms each on a busy disk (1,000 layers took
        2.8 s), and builds and mounts wait for the lock."""
        if dry_run:
            with self._locked():
                return self._prune_locked(dry_run=True, budget_bytes=budget_bytes)
        removed: list[LayerManifest] = []
        freed = orphans = 0
        while True:
            with self._locked():
                res = self._prune_locked(budget_bytes=budget_bytes, limit=PRUNE_BATCH)
            removed += res.removed
            freed += res.freed_bytes
            orphans += res.orphans
            if len(res.removed) < PRUNE_BATCH:
                return PruneResult(removed=tuple(removed), freed_bytes=freed,
                                   kept_layers=res.kept_layers, kept_bytes=res.kept_bytes,
                                   orphans=orphans)

    def _prune_locked(self, *, dry_run: bool = False, budget_bytes: int | None = None,
                      keep: Sequence[str] = (), limit: int | None = None,
                      idle_before: float | None = None) -> PruneResult:
        manifests = {m.digest: m for m in self.manifests()}
        nodes = self._nodes()
        mounted = mounted_sources()
        roots = {*self._read_refs().values(), *self._live_pins(),
                 *(d for d in manifests if self.layer_path(d) in mounted)}
        plan = plan_prune(nodes, roots, budget_bytes=budget_bytes, keep=keep,
                          idle_before=idle_before)
        gone = plan.remove[:limit] if limit is not None else plan.remove
        freed = sum(manifests[d].size_bytes for d in gone)
        orphans = 0
        if not dry_run:
            for d in gone:
                self._unlink_layer(d)
            orphans = self._sweep_orphans(set(manifests) - set(gone))
        return PruneResult(removed=tuple(manifests[d] for d in gone), freed_bytes=freed,
                           kept_layers=len(manifests) - len(gone),
                           kept_bytes=plan.kept_bytes + plan.freed_bytes - freed,
                           orphans=orphans, dry_run=dry_run)

    def _sweep_orphans(self, live: set[str]) -> int:
        """Layer and index files without a manifest (a removal killed midway)."""
        n = 0
        for sub, ext in (("layers", ".erofs"), ("index", ".idx")):
            d = os.path.join(self.root, sub)
            for name in os.listdir(d):
                if name.endswith(ext) and DIGEST_PREFIX + name[:-len(ext)] not in live:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(d, name))
                        n += 1
        return n

    def write_index(self, digest: str, data: bytes) -> None:
        _write_private(self.index_path(digest), data)

    def read_index(self, digest: str) -> bytes | None:
        try:
            with open(self.index_path(digest), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None


def _identity_uuid(kind: str, namespace: str | None, parent: str | None,
                   stack: Sequence[str], labels: dict[str, str] | None,
                   compression: str | None, chunk: int | None) -> str:
    """The filesystem UUID of a layer: what it is besides its tree (pure)."""
    # None (cluster-wide) and "" (a snapshot naming no project) are two identities
    return layer_uuid("dsec-layer-v2", kind, "\0none" if namespace is None else namespace,
                      parent or "", ",".join(stack),
                      _json_enc.encode(dict(sorted((labels or {}).items()))).decode(),
                      compression or "", str(chunk or 0))


def _name_key(namespace: str | None, name: str | None, tag: str) -> str:
    """refs.json key of a bare ``name`` in ``namespace``, validated."""
    if name is None or "/" in name:
        raise InvalidArgument(f"image name {name!r} must be bare (no '/'): the project goes "
                              "in namespace=, e.g. name='tools', namespace='teama'")
    return parse_ref(ref_key(namespace, name, tag)).key
