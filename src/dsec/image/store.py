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
    lock                    flock(2) taken by every mutation (CLI and edge may race)

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

Builds are not bit-reproducible (mkfs.erofs 1.5 stamps a random UUID and the build
time into the superblock), so the same tree built twice gives two digests. Digests name
bytes, which is what verification needs; dedup of identical trees is not attempted.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import time
from collections.abc import Iterator, Sequence
from typing import IO

import msgspec

from dsec import ownership
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
    layout_for,
    mkfs_erofs,
)
from dsec.image.manifest import (
    DIGEST_PREFIX,
    LAYER_KINDS,
    PROJECT_LABEL,
    LayerKind,
    LayerManifest,
    layer_namespace,
    parse_ref,
    ref_key,
)
from dsec.image.tree import tree_stats

__all__ = ["LayerStore", "may_point_at", "mounted_sources"]

_DIR_MODE = 0o700
_FILE_MODE = 0o600
_LAYER_MODE = 0o400
_SUBDIRS = ("layers", "manifests", "index", "tmp")

_json_enc = msgspec.json.Encoder()
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
                out.add(_unescape(parts[1]))
    return out


def _unescape(s: str) -> str:
    if "\\" not in s:
        return s
    return s.encode().decode("unicode_escape")


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


def _write_private(path: str, data: bytes) -> None:
    """Write ``path`` atomically (temp file + rename), mode 0600 whatever the umask."""
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


class LayerStore:
    """Layers by digest, names by ``name:tag``; safe for concurrent processes."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
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
    def _locked(self) -> Iterator[None]:
        fd = os.open(os.path.join(self.root, "lock"), os.O_RDWR | os.O_CREAT, _FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _scratch(self, name: str) -> str:
        """A path for scratch entry ``name`` in ``tmp/``, prefixed with this process's
        owner token (:mod:`dsec.ownership`): what a killed process leaves there is
        removed by the next store opened."""
        return os.path.join(self.root, "tmp", f"{ownership.token()}-{name}")

    def _reclaim_scratch(self) -> None:
        """Remove the scratch entries of processes that died mid-build (a kill -9 skips
        the cleanup on the way out: staging trees and half-written layers stayed, ~the
        size of each snapshot, for good). A live owner's, another pid namespace's and
        names without an owner token (made by older versions) are left alone."""
        try:
            entries = list(os.scandir(os.path.join(self.root, "tmp")))
        except OSError:
            return
        for e in entries:
            if ownership.token_alive(e.name.split("-", 1)[0]) is not False:
                continue
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(e.path)

    @contextlib.contextmanager
    def staging(self, prefix: str = "stage-") -> Iterator[str]:
        """A scratch directory inside the store (same filesystem), removed on exit."""
        path = self._scratch(prefix + secrets.token_hex(6))
        os.mkdir(path, _DIR_MODE)
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------------- refs
    def _read_refs(self) -> dict[str, str]:
        try:
            with open(os.path.join(self.root, "refs.json"), "rb") as f:
                return _refs_dec.decode(f.read())
        except FileNotFoundError:
            return {}

    def _write_refs(self, refs: dict[str, str]) -> None:
        _write_private(os.path.join(self.root, "refs.json"),
                       _json_enc.encode(dict(sorted(refs.items()))))

    def refs(self) -> dict[str, str]:
        """``[project/]name:tag`` -> digest."""
        return self._read_refs()

    def tag(self, ref: str, name: str, tag: str = "latest", *,
            namespace: str | None = None) -> LayerManifest:
        """Point ``[namespace/]name:tag`` at the layer ``ref`` names (moves an existing
        tag). ``PermissionDenied`` unless that layer may carry a name of ``namespace``
        (:func:`may_point_at`): a tag never moves to a tree built outside its namespace."""
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
            refs = self._read_refs()
            refs[key] = m.digest
            self._write_refs(refs)
        return m

    def untag(self, key: str) -> str | None:
        """Remove the name ``key`` (``[project/]name:tag``); returns the digest it named
        (None when there was no such name). The layer stays."""
        parse_ref(key)
        with self._locked():
            refs = self._read_refs()
            digest = refs.pop(key, None)
            if digest is not None:
                self._write_refs(refs)
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

    def manifests(self) -> list[LayerManifest]:
        out = []
        for n in sorted(os.listdir(os.path.join(self.root, "manifests"))):
            if n.endswith(".json"):
                out.append(self._load(n[:-5], n))
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
                 owner: str | None = None) -> LayerManifest:
        """Pack the directory ``src_dir`` into a new layer of project ``namespace`` (None:
        cluster-wide; a snapshot's comes from its project label), named
        ``[namespace/]name:tag`` when ``name`` (bare, no '/') is given.

        Bounds (``QuotaExceeded`` naming them, nothing stored): ``max_bytes`` for the
        layer file (checked on the estimate before mkfs and on the result before it
        enters the store), ``max_apparent_bytes`` for the file sizes mkfs must read
        (sparse files are read whole by mkfs.erofs 1.5: that is its time)."""
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
                           max_output_bytes=max_bytes)
            except OutputTooLarge as exc:
                raise self._too_big(what, exc.limit, exc.limit, "more than") from exc
            size = os.stat(tmp).st_blocks * 512
            if max_bytes is not None and size > max_bytes:
                raise self._too_big(what, size, max_bytes, "")
            hx = hash_file(tmp, progress=progress)
            size = os.stat(tmp).st_size
            os.chmod(tmp, _LAYER_MODE)
            # Digests never collide across builds (mkfs.erofs stamps a random UUID), so a
            # manifest, and with it the layer's namespace, is written once per layer. If
            # builds ever become reproducible, two projects' identical trees would share a
            # digest: the manifest must then become per (namespace, digest).
            manifest = LayerManifest(
                digest=DIGEST_PREFIX + hx, kind=kind, size_bytes=size, created=time.time(),
                name=name, tag=tag if name else None, namespace=namespace, owner=owner,
                content_bytes=stats.content_bytes,
                entries=stats.entries, compression=compression, labels=dict(labels or {}),
                parent=parent, stack=tuple(stack))
            with self._locked():
                os.replace(tmp, self.layer_path(manifest.digest))
                _write_private(self._manifest_path(hx), _json_enc.encode(manifest))
                if key is not None:
                    refs = self._read_refs()
                    refs[key] = manifest.digest
                    self._write_refs(refs)
            return manifest
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

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
                owner: str | None = None, max_bytes: int | None = None) -> LayerManifest:
        """Build a layer from a tar stream, unpacked safely into a staging directory."""
        if name is not None:
            _name_key(namespace, name, tag)  # a bad name fails before the upload is unpacked
        with self.staging() as stage:
            extract_tar(fileobj, stage, limits=limits, oci_whiteouts=oci_whiteouts)
            return self.add_tree(stage, kind=kind, name=name, tag=tag, labels=labels,
                                 compression=compression, progress=progress,
                                 namespace=namespace, owner=owner, max_bytes=max_bytes)

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
            refs = {k: v for k, v in self._read_refs().items() if v != m.digest}
            self._write_refs(refs)
            for path in (self._manifest_path(m.hex), self.layer_path(m.digest),
                         self.index_path(m.digest)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        return m

    def write_index(self, digest: str, data: bytes) -> None:
        _write_private(self.index_path(digest), data)

    def read_index(self, digest: str) -> bytes | None:
        try:
            with open(self.index_path(digest), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None


def _name_key(namespace: str | None, name: str | None, tag: str) -> str:
    """refs.json key of a bare ``name`` in ``namespace``, validated."""
    if name is None or "/" in name:
        raise InvalidArgument(f"image name {name!r} must be bare (no '/'): the project goes "
                              "in namespace=, e.g. name='tools', namespace='teama'")
    return parse_ref(ref_key(namespace, name, tag)).key
