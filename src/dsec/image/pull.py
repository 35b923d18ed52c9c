"""Pull images from OCI registries into the layer store, one EROFS layer per OCI layer.

The registry protocol (token and basic auth, manifests, blobs, retries, TLS) is skopeo's
(Debian's ``skopeo``): writing the distribution API by hand would re-do what a
maintained client does well. What is dsec's own is here:

1. ``skopeo inspect --raw`` the ref: an image index is resolved to one platform's
   manifest by :func:`dsec.image.registry.select_manifest` (the host's unless
   ``platform=``), so the copy is pinned to a manifest digest and auth, unknown
   registries and unknown manifests fail before anything is written; then the config
   (``inspect --config``, checked against its digest) says which layers (diff_ids) the
   image is made of. When the store holds them all, nothing more is fetched.
2. Otherwise ``skopeo copy docker://repo@<digest> oci:<scratch>:img`` into a per-pull
   scratch OCI layout under the store's ``tmp/`` (named by this process: a kill -9
   leaves nothing the next store open does not reclaim). skopeo verifies every blob's
   digest and fetches layers concurrently. The store's blob cache (``oci-cache/``, an
   OCI layout) holds what interrupted pulls fetched: its blobs are hard-linked into the
   scratch layout first (skopeo then does not fetch them), completed blobs are linked
   into it while skopeo runs (every 0.2 s, so a kill -9 keeps them), and a pull that
   succeeds takes its blobs out again (its layers are stored; the cache is no second
   copy of every image), as does a day without use. A retry resumes at blob
   granularity: skopeo 1.9 keeps no partial blobs, so a blob cut mid-transfer is
   fetched again from its first byte.
3. Each layer, bottom first: its blob is streamed through gunzip into the safe tar
   extractor (OCI whiteouts and opaque dirs translated as by the importer), the
   uncompressed stream hashed and checked against the config's ``rootfs.diff_ids``
   (skopeo verifies compressed blobs, not diff_ids), and packed as ONE content-addressed
   EROFS layer labelled ``oci.diffid``. A layer whose diff_id the store already holds in
   a namespace the image may use (its own, an ancestor, cluster-wide) is reused, not
   rebuilt: two images sharing a base share its layers on disk and in the mount cache.
4. The top layer carries the image: ``stack`` (the lower layers, highest first, which
   :func:`dsec.image.compose.compose` stacks below it), the config as ``oci.*`` labels
   (:func:`dsec.image.registry.defaults_labels`) and the name. It is named last; any
   failure before removes the layers this pull made (reused ones stay), and the
   scratch layout goes on the way out: no tag, no orphan layer, no scratch dir.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from dsec.errors import (
    Conflict,
    CorruptLayer,
    DsecError,
    ImageError,
    ImageNotFound,
    InvalidArgument,
    PermissionDenied,
    Timeout,
    Unavailable,
)
from dsec.image.archive import DEFAULT_LIMITS, ExtractLimits, ExtractStats, extract_tar
from dsec.image.erofs import Compression
from dsec.image.gc import LayerNode
from dsec.image.manifest import LayerManifest, ref_key
from dsec.image.registry import (
    LayerBlob,
    Platform,
    RegistryRef,
    check_platform,
    defaults_labels,
    host_platform,
    image_defaults,
    image_layers,
    is_index,
    local_name,
    parse_registry_ref,
    select_manifest,
)
from dsec.image.store import LayerStore, Pin, may_point_at

#: ``LayerStore.tag``'s ``admit``: a quota check run under the store's lock.
Admit = Callable[[Mapping[str, LayerNode], dict[str, str]], None]

__all__ = ["PullOptions", "PullProgress", "PullResult", "pull_image"]

DIFFID_LABEL = "oci.diffid"
BLOB_LABEL = "oci.blob"
REF_LABEL = "oci.ref"
CONFIG_LABEL = "oci.config"
PLATFORM_LABEL = "oci.platform"
_CACHE = "oci-cache"
#: A cached blob no pull used for this long goes (a failed pull nobody retried).
CACHE_MAX_AGE_S = 24 * 3600.0
_MAX_JSON = 16 << 20
_DIR_MODE = 0o700

#: phase ("fetch", "layer 2/3 <digest>"), bytes done, bytes total.
PullProgress = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True)
class PullOptions:
    """How to reach the registry. ``creds`` is ``user:password``; ``authfile`` a
    docker-style ``auth.json`` / ``config.json`` (skopeo reads both)."""

    platform: Platform | None = None
    insecure: bool = False          # plain HTTP (and unverified TLS): local registries
    creds: str | None = None
    authfile: str | None = None
    timeout_s: float = 1800.0
    secret: str | None = None       # creds moved to a private authfile: still redacted

    def auth_args(self, *, src: bool) -> list[str]:
        out: list[str] = []
        if self.insecure:
            out.append("--src-tls-verify=false" if src else "--tls-verify=false")
        if self.creds is not None:
            out += ["--src-creds" if src else "--creds", self.creds]
        if self.authfile is not None:
            out += ["--authfile", self.authfile]
        return out


@dataclass(slots=True)
class PullResult:
    """The image (its top layer, named), every layer highest first, which of them this
    pull built and how many blob bytes skopeo fetched (0: all came from the cache)."""

    image: LayerManifest
    layers: list[LayerManifest]
    made: list[LayerManifest] = field(default_factory=list)
    fetched_bytes: int = 0
    ref: str = ""
    manifest_digest: str = ""
    key: str = ""                   # the store name it got ([project/]name:tag)


# ------------------------------------------------------------------- skopeo
def _redact(text: str, opts: PullOptions) -> str:
    for secret in (opts.creds, opts.secret):
        if secret:
            text = text.replace(secret, "<creds>")
            text = text.replace(secret.partition(":")[2] or "\0", "<password>")
    return text


def _skopeo_error(stderr: str, ref: RegistryRef, opts: PullOptions) -> DsecError:
    """skopeo's failure as the dsec error that says what to change."""
    msg = _redact(stderr.strip(), opts)
    tail = msg.rsplit("msg=", 1)[-1].strip().strip('"')[:600]
    low = msg.lower()
    where = str(ref)
    if "digest" in low and ("mismatch" in low or "did not match" in low):
        return CorruptLayer(f"a blob of {where} did not match its digest: {tail}")
    if "manifest unknown" in low or "name_unknown" in low or "repository name not known" \
            in low or "not found" in low and "manifest" in low:
        return ImageNotFound(f"registry has no image {where}: {tail}", ref=where)
    # status codes as words of their own: a digest in the message holds digit runs too
    if "unauthorized" in low or "authentication required" in low or "denied" in low \
            or re.search(r"\b40[13]\b", low):
        return PermissionDenied(
            f"registry {ref.host} refused {where}: {tail}; give credentials with "
            "--creds user:password or --authfile (docker's auth.json)")
    if "http response to https client" in low:
        return Unavailable(f"registry {ref.host} speaks plain HTTP: {tail}; pass --insecure "
                           "(insecure=True) for a local plain-HTTP registry")
    if "certificate" in low or "x509" in low or "tls" in low:
        return Unavailable(f"TLS to registry {ref.host} failed: {tail}; fix its certificate "
                           "or pass --insecure for a local test registry")
    if "connection refused" in low or "no such host" in low or "dial tcp" in low \
            or "pinging container registry" in low or "i/o timeout" in low:
        return Unavailable(f"cannot reach registry {ref.host}: {tail}; check the host and "
                           "port of the ref")
    return ImageError(f"pulling {where} failed: {tail}")


def _run_skopeo(args: Sequence[str], ref: RegistryRef, opts: PullOptions,
                *, deadline: float) -> bytes:
    left = deadline - time.monotonic()
    if left <= 0:
        raise Timeout(f"pulling {ref} took longer than {opts.timeout_s:.0f} s")
    try:
        p = subprocess.run(["skopeo", *args], capture_output=True, timeout=left,
                           check=False, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise Unavailable("skopeo is not installed (apt-get install skopeo): it is what "
                          "dsec pulls images from registries with") from None
    except subprocess.TimeoutExpired:
        raise Timeout(f"pulling {ref} took longer than {opts.timeout_s:.0f} s") from None
    if p.returncode != 0:
        raise _skopeo_error(p.stderr.decode(errors="replace"), ref, opts)
    return p.stdout


def _json(data: bytes, what: str) -> dict[str, Any]:
    if len(data) > _MAX_JSON:
        raise ImageError(f"{what} is larger than {_MAX_JSON} bytes")
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise ImageError(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ImageError(f"{what} is not a JSON object")
    return doc


def resolve_manifest(ref: RegistryRef, opts: PullOptions, *, deadline: float,
                     ) -> tuple[str, dict[str, Any], Platform]:
    """(manifest digest, manifest, platform) of ``ref``: an index resolved to the
    requested (or the host's) platform."""
    want = opts.platform or host_platform()
    raw = _run_skopeo(["inspect", "--raw", *opts.auth_args(src=False), ref.docker()],
                      ref, opts, deadline=deadline)
    doc = _json(raw, f"the manifest of {ref}")
    if is_index(doc):
        d = select_manifest(doc, want)
        digest = str(d["digest"])
        raw = _run_skopeo(["inspect", "--raw", *opts.auth_args(src=False),
                           ref.docker(digest)], ref, opts, deadline=deadline)
        if "sha256:" + hashlib.sha256(raw).hexdigest() != digest:
            raise CorruptLayer(f"the registry's manifest {digest} of {ref} does not hash "
                               "to its digest")
        doc = _json(raw, f"the {want} manifest of {ref}")
    else:
        digest = ref.digest or "sha256:" + hashlib.sha256(raw).hexdigest()
        if ref.digest is not None and "sha256:" + hashlib.sha256(raw).hexdigest() != digest:
            raise CorruptLayer(f"the registry's manifest of {ref} does not hash to "
                               f"{ref.digest}")
    if "layers" not in doc:
        raise ImageError(f"{ref} is not an image manifest (mediaType "
                         f"{doc.get('mediaType')!r})")
    return digest, doc, want


# ------------------------------------------------------------- blob cache
class BlobCache:
    """An OCI layout of completed blobs per store (``<store>/oci-cache``): hard-linked
    into each pull's scratch layout before skopeo runs and back after, so blobs fetched
    once are never fetched again by this node (and an interrupted pull's completed
    blobs are reused by its retry)."""

    def __init__(self, store: LayerStore) -> None:
        self.root = os.path.join(store.root, _CACHE)
        self.blobs = os.path.join(self.root, "blobs", "sha256")
        os.makedirs(self.blobs, mode=_DIR_MODE, exist_ok=True)
        for d in (self.root, os.path.dirname(self.blobs), self.blobs):
            os.chmod(d, _DIR_MODE)
        layout = os.path.join(self.root, "oci-layout")
        if not os.path.exists(layout):
            with open(layout, "w") as f:
                f.write('{"imageLayoutVersion":"1.0.0"}')
        self.locks = os.path.join(self.root, "locks")
        os.makedirs(self.locks, mode=_DIR_MODE, exist_ok=True)

    def link_into(self, layout: str, digests: Sequence[str]) -> int:
        """Hard-link the cached ``digests`` into ``layout``; returns how many were."""
        dst = os.path.join(layout, "blobs", "sha256")
        os.makedirs(dst, mode=_DIR_MODE, exist_ok=True)
        n = 0
        for d in digests:
            hx = d.removeprefix("sha256:")
            with contextlib.suppress(FileNotFoundError, FileExistsError):
                os.link(os.path.join(self.blobs, hx), os.path.join(dst, hx))
                n += 1
        return n

    def keep(self, layout: str) -> None:
        """Hard-link ``layout``'s completed blobs into the cache (only names that are
        digests: skopeo writes partial blobs under temporary names)."""
        src = os.path.join(layout, "blobs", "sha256")
        with contextlib.suppress(FileNotFoundError):
            for n in os.listdir(src):
                if len(n) == 64 and all(c in "0123456789abcdef" for c in n):
                    with contextlib.suppress(FileExistsError, OSError):
                        os.link(os.path.join(src, n), os.path.join(self.blobs, n))

    def forget(self, layout: str) -> None:
        """Drop from the cache every blob ``layout`` holds (a pull that succeeded)."""
        with contextlib.suppress(FileNotFoundError):
            for n in os.listdir(os.path.join(layout, "blobs", "sha256")):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.blobs, n))

    def expire(self, max_age_s: float, now: float) -> None:
        """Remove blobs cached longer than ``max_age_s`` ago (a failed pull never
        retried); ctime is when the blob was linked in."""
        with contextlib.suppress(FileNotFoundError):
            for e in os.scandir(self.blobs):
                with contextlib.suppress(OSError):
                    if now - e.stat(follow_symlinks=False).st_ctime > max_age_s:
                        os.unlink(e.path)

    @contextlib.contextmanager
    def lock(self, diff_id: str) -> Iterator[None]:
        """One builder per diff_id on this store (two pulls sharing a base build it once)."""
        fd = os.open(os.path.join(self.locks, diff_id.removeprefix("sha256:")),
                     os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def _dir_bytes(path: str) -> int:
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for e in os.scandir(path):
            with contextlib.suppress(FileNotFoundError):
                if e.is_file(follow_symlinks=False):
                    total += e.stat(follow_symlinks=False).st_size
    return total


@contextlib.contextmanager
def _watch(layout: str, total: int, progress: PullProgress | None, cache: BlobCache,
           interval_s: float = 0.2) -> Iterator[None]:
    """While skopeo copies: hard-link each completed blob into the cache as it appears
    (so even a kill -9 of this process keeps what was fetched for the retry) and report
    fetch progress from the blob bytes written (skopeo prints none off a terminal)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(interval_s):
            cache.keep(layout)
            if progress is not None:
                done = _dir_bytes(os.path.join(layout, "blobs", "sha256")) + _dir_bytes(layout)
                progress("fetch", min(done, total), total)
    t = threading.Thread(target=loop, name="dsec-pull-watch", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
        if progress is not None:
            progress("fetch", total, total)


# ------------------------------------------------------------------ layers
class _Hashing:
    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.h = hashlib.sha256()
        self.n = 0

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.h.update(data)
        self.n += len(data)
        return data

    def drain(self) -> None:
        while self.read(1 << 20):
            pass

    @property
    def digest(self) -> str:
        return "sha256:" + self.h.hexdigest()


def _unpack(blob_path: str, layer: LayerBlob, dest: str, limits: ExtractLimits,
            ) -> ExtractStats:
    """Unpack one layer blob into ``dest``, checking blob digest and diff_id; returns
    the extractor's stats (what it left out, counted in the layer's ``skipped``)."""
    with open(blob_path, "rb") as raw_f:
        raw = _Hashing(raw_f)
        gz = layer.media_type.endswith("gzip")
        inner: Any = gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw  # type: ignore[call-overload]
        tar = _Hashing(inner)
        try:
            stats = extract_tar(tar, dest, limits=limits,  # type: ignore[arg-type]
                                oci_whiteouts=True)
            tar.drain()
            raw.drain()
        except (OSError, EOFError) as exc:
            raise CorruptLayer(f"layer blob {layer.digest} is not a readable "
                               f"{'gzip ' if gz else ''}tar: {exc}") from exc
    if raw.digest != layer.digest:
        raise CorruptLayer(f"layer blob hashes to {raw.digest}, not the {layer.digest} its "
                           "manifest names; the image is corrupt")
    if tar.digest != layer.diff_id:
        raise CorruptLayer(f"layer {layer.digest} unpacks to a tar with digest {tar.digest}, "
                           f"not the diff_id {layer.diff_id} the image config names; the "
                           "image is corrupt")
    return stats


def _usable(m: LayerManifest, namespace: str | None) -> bool:
    return m.kind == "base" and may_point_at(namespace, m)


def _bare(m: LayerManifest) -> bool:
    return not m.stack


def _same(stack: tuple[str, ...], labels: dict[str, str]) -> Callable[[LayerManifest], bool]:
    return lambda m: m.stack == stack and m.labels == labels


def _find(store: LayerStore, diff_id: str, namespace: str | None,
          want: Callable[[LayerManifest], bool]) -> LayerManifest | None:
    for m in store.manifests():
        if m.labels.get(DIFFID_LABEL) == diff_id and _usable(m, namespace) and want(m):
            return m
    return None


def pull_image(store: LayerStore, ref: str, *, namespace: str | None = None,
               owner: str | None = None, name: str | None = None, tag: str | None = None,
               options: PullOptions = PullOptions(),
               progress: PullProgress | None = None, compression: Compression | None = None,
               limits: ExtractLimits = DEFAULT_LIMITS, max_bytes: int | None = None,
               name_it: bool = True, pin: Pin | None = None,
               admit: Admit | None = None) -> PullResult:
    """Pull ``ref`` (``host[:port]/repo[:tag|@digest]``) into ``store`` as image
    ``[namespace/]name:tag`` (default :func:`dsec.image.registry.local_name`). Layers
    built belong to ``namespace``; ``max_bytes`` bounds each new layer file.
    ``name_it=False`` leaves the naming to the caller (the API charges the layers to a
    quota first). See the module docstring for the steps and guarantees.

    ``pin``: every layer of the image (built or reused) is pinned on it from the moment
    this pull has it, so a prune (``dsec image prune``, the store budget, another
    replica) never takes one before the name is set; pass one when naming later
    (``name_it=False``), else the pull holds its own until it has named the image.
    ``admit``: :meth:`LayerStore.tag`'s quota check for the name (``image_bytes``)."""
    r = parse_registry_ref(ref)
    dname, dtag = local_name(r)
    name, tag = name or dname, tag or dtag
    if "/" in name:
        raise InvalidArgument(f"image name {name!r} must be bare: the project goes in "
                              "namespace=", field="name")
    deadline = time.monotonic() + options.timeout_s
    with contextlib.ExitStack() as held:
        if pin is None:
            pin = held.enter_context(store.pinned())
        opts = held.enter_context(_private_creds(store, r, options))
        return _pull(store, r, name, tag, opts, deadline, namespace=namespace, owner=owner,
                     progress=progress, compression=compression, limits=limits,
                     max_bytes=max_bytes, name_it=name_it, pin=pin, admit=admit)


@contextlib.contextmanager
def _private_creds(store: LayerStore, r: RegistryRef, opts: PullOptions,
                   ) -> Iterator[PullOptions]:
    """``creds`` moved into a private auth file for skopeo (``--creds`` on its command
    line would show the password to every host user in /proc/<pid>/cmdline)."""
    if opts.creds is None:
        yield opts
        return
    import base64
    import dataclasses
    if ":" not in opts.creds:
        raise InvalidArgument("registry credentials must be user:password", field="creds")
    with store.staging("auth-") as d:
        path = os.path.join(d, "auth.json")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"auths": {r.host: {"auth": base64.b64encode(
                opts.creds.encode()).decode()}}}, f)
        yield dataclasses.replace(opts, creds=None, authfile=path, secret=opts.creds)


def _fetch_config(r: RegistryRef, digest: str, cfg_digest: str, opts: PullOptions, *,
                  deadline: float) -> dict[str, Any]:
    """The image config blob (``skopeo inspect --config --raw``), checked against the
    digest the manifest names: it says which layers (diff_ids) the image is made of, so
    a pull whose layers are all here fetches no layer blob at all."""
    raw = _run_skopeo(["inspect", "--config", "--raw", *opts.auth_args(src=False),
                       r.docker(digest)], r, opts, deadline=deadline)
    if "sha256:" + hashlib.sha256(raw).hexdigest() != cfg_digest:
        raise CorruptLayer(f"the config of {r} does not hash to {cfg_digest}, the digest "
                           "its manifest names; the image is corrupt")
    return _json(raw, f"the config of {r}")


def _have(store: LayerStore, layers: Sequence[LayerBlob], namespace: str | None,
          top_labels: dict[str, str]) -> bool:
    """Whether every layer of the image is already in the store (usable by
    ``namespace``), the top one with the same stack and config."""
    below: list[str] = []
    for i, layer in enumerate(layers):
        is_top = i == len(layers) - 1
        labels = {DIFFID_LABEL: layer.diff_id, BLOB_LABEL: layer.digest,
                  **(top_labels if is_top else {})}
        m = _find(store, layer.diff_id, namespace,
                  _same(tuple(reversed(below)), labels) if is_top else _bare)
        if m is None:
            return False
        below.append(m.digest)
    return True


def _pull(store: LayerStore, r: RegistryRef, name: str, tag: str, options: PullOptions,
          deadline: float, *, namespace: str | None, owner: str | None,
          progress: PullProgress | None, compression: Compression | None,
          limits: ExtractLimits, max_bytes: int | None, name_it: bool, pin: Pin,
          admit: Admit | None) -> PullResult:
    digest, manifest, want = resolve_manifest(r, options, deadline=deadline)
    cfg_desc = manifest.get("config")
    cfg_digest = str(cfg_desc.get("digest")) if isinstance(cfg_desc, dict) else ""
    config = _fetch_config(r, digest, cfg_digest, options, deadline=deadline)
    check_platform(config, want)
    layers = image_layers(manifest, config)
    if not layers:
        raise ImageError(f"{r} has no layers")
    top_labels = {**defaults_labels(image_defaults(config)), REF_LABEL: str(r),
                  PLATFORM_LABEL: str(want), CONFIG_LABEL: cfg_digest}
    cache = BlobCache(store)
    cache.expire(CACHE_MAX_AGE_S, time.time())
    blob_digests = [x.digest for x in layers]
    made: list[LayerManifest] = []
    fetched = 0
    try:
        with store.staging("pull-") as scratch:
            blob_dir = os.path.join(scratch, "blobs", "sha256")
            if not _have(store, layers, namespace, top_labels):
                cache.link_into(scratch, [*blob_digests, cfg_digest])
                had = set(os.listdir(blob_dir))
                total = sum(x.size for x in layers)
                try:
                    with _watch(scratch, total, progress, cache):
                        _run_skopeo(["copy", "--quiet", *options.auth_args(src=True),
                                     r.docker(digest), f"oci:{scratch}:img"], r, options,
                                    deadline=deadline)
                finally:
                    cache.keep(scratch)
                fetched = sum(os.stat(os.path.join(blob_dir, d[7:])).st_size
                              for d in set(blob_digests) if d[7:] not in had)
            below: list[LayerManifest] = []          # bottom first
            for i, layer in enumerate(layers):
                is_top = i == len(layers) - 1
                blob = os.path.join(blob_dir, layer.digest.removeprefix("sha256:"))
                stack = tuple(m.digest for m in reversed(below))
                labels = {DIFFID_LABEL: layer.diff_id, BLOB_LABEL: layer.digest}
                if is_top:
                    labels.update(top_labels)
                if progress is not None:
                    progress(f"layer {i + 1}/{len(layers)}", 0, layer.size)
                with cache.lock(layer.diff_id):
                    found = _find(store, layer.diff_id, namespace,
                                  _same(stack, labels) if is_top else _bare)
                    if found is not None:
                        try:
                            pin.add(found.digest)   # under the store lock: still there
                        except ImageNotFound:
                            found = None            # pruned since: build it again
                    if found is None:
                        if not os.path.exists(blob):
                            raise Conflict(f"layer {layer.diff_id} of {r} was removed from "
                                           "the store while it was being pulled; pull again")
                        with store.staging("pull-layer-") as stage:
                            ex = _unpack(blob, layer, stage, limits)
                            found = store.add_tree(
                                stage, kind="base", labels=labels, compression=compression,
                                stack=stack if is_top else (), namespace=namespace,
                                owner=owner, max_bytes=max_bytes, pin=pin,
                                skipped=ex.skipped, what=f"layer {i + 1} of {r}")
                        made.append(found)
                if progress is not None:
                    progress(f"layer {i + 1}/{len(layers)}", layer.size, layer.size)
                below.append(found)
            top = below[-1]
            if name_it:
                store.tag(top.digest, name, tag, namespace=namespace, admit=admit)
            # The layers are in the store now: this pull's blobs leave the cache (it
            # holds what interrupted pulls fetched, for their retries, not a second copy
            # of every image pulled).
            cache.forget(scratch)
    except BaseException:
        # discard, not remove: a reproducible layer may be one somebody else names or
        # is building right now (their pin), which stays
        for m in reversed(made):
            with contextlib.suppress(DsecError, OSError):
                store.discard(m.digest, pin=pin)
        raise
    return PullResult(image=store.get(top.digest), layers=below[::-1], made=made,
                      fetched_bytes=fetched, ref=str(r), manifest_digest=digest,
                      key=ref_key(namespace, name, tag))
