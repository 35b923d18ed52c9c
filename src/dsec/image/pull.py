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
import errno
import fcntl
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from dsec.errors import (
    CapacityExceeded,
    Conflict,
    CorruptLayer,
    DsecError,
    ImageError,
    ImageNotFound,
    InvalidArgument,
    PermissionDenied,
    QuotaExceeded,
    Timeout,
    Unavailable,
)
from dsec.image.archive import DEFAULT_LIMITS, ExtractLimits, ExtractStats, extract_tar
from dsec.image.erofs import Compression
from dsec.image.gc import LayerNode
from dsec.image.manifest import LayerManifest, layer_namespace, ref_key
from dsec.image.registry import (
    ImageDefaults,
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
    #: a skopeo run that makes no progress this long (no blob byte, or an inspect
    #: without an answer) is killed: a registry that accepts and never answers holds
    #: a pull thread for this long, not for ``timeout_s`` (red team F12)
    stall_s: float = 60.0
    #: use the auth files of the user running the pull (skopeo's defaults:
    #: $REGISTRY_AUTH_FILE, ~/.docker/config.json, ...). Only for the CLI, which is
    #: that user; a pull for an API caller never rides the apiserver host's login
    #: (red team F2): without creds it runs with an empty private auth file.
    ambient_auth: bool = False
    secret: str | None = None       # creds moved to a private authfile: still redacted
    home: str | None = None         # skopeo's $HOME when not ambient (an empty private dir)

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


#: Environment variables through which skopeo finds the auth files of the user it
#: runs as: dropped unless the pull is ``ambient_auth`` (red team F2).
_AMBIENT_AUTH_ENV = ("REGISTRY_AUTH_FILE", "DOCKER_CONFIG", "XDG_RUNTIME_DIR", "HOME",
                     "XDG_CONFIG_HOME")


def _skopeo_env(opts: PullOptions) -> dict[str, str] | None:
    if opts.ambient_auth:
        return None
    env = {k: v for k, v in os.environ.items() if k not in _AMBIENT_AUTH_ENV}
    if opts.home is not None:
        env["HOME"] = opts.home
    return env


#: skopeo gets SIGKILL when the thread that started it dies (a kill -9 of the puller;
#: red team F17: skopeo ran on, holding the registry connection and writing into the
#: store's tmp/ that the next open reclaims). util-linux's setpriv sets it and execs
#: skopeo (the death signal survives the exec): no preexec_fn, which is unsafe in a
#: threaded process. Pull threads live as long as the process (pool threads).
_DIE_WITH_PARENT = ("setpriv", "--pdeathsig", "KILL", "--")


def _run_skopeo(args: Sequence[str], ref: RegistryRef, opts: PullOptions,
                *, deadline: float, progress: Callable[[], int] | None = None) -> bytes:
    """Run skopeo to completion: killed (``Timeout``) at ``deadline`` or after
    ``opts.stall_s`` without progress (``progress()``, bytes so far, not growing; an
    inspect, which has none, within ``stall_s`` of its start)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise Timeout(f"pulling {ref} took longer than {opts.timeout_s:.0f} s")
    try:
        if shutil.which("skopeo") is None:
            raise FileNotFoundError("skopeo")
        p = subprocess.Popen([*_DIE_WITH_PARENT, "skopeo", *args], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=_skopeo_env(opts))
    except FileNotFoundError:
        raise Unavailable("skopeo is not installed (apt-get install skopeo): it is what "
                          "dsec pulls images from registries with") from None
    seen = progress() if progress is not None else 0
    moved = time.monotonic()
    try:
        while True:
            now = time.monotonic()
            try:
                out, err = p.communicate(timeout=max(0.01, min(1.0, deadline - now)))
                break
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if now >= deadline:
                    raise Timeout(f"pulling {ref} took longer than {opts.timeout_s:.0f} s"
                                  ) from None
                cur = progress() if progress is not None else seen
                if cur != seen:
                    seen, moved = cur, now
                elif now - moved > opts.stall_s:
                    raise Timeout(
                        f"registry {ref.host} sent nothing for {opts.stall_s:.0f} s while "
                        f"pulling {ref}; it accepts connections but does not answer - "
                        "check the registry, or retry later") from None
    finally:
        if p.returncode is None:
            p.kill()
            p.communicate()
    if p.returncode != 0:
        raise _skopeo_error(err.decode(errors="replace"), ref, opts)
    return out


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
def cache_scope(namespace: str | None, r: RegistryRef, opts: PullOptions) -> str:
    """The blob cache partition of one pull: the target namespace, the registry and
    repository, and who the credentials say the caller is (a hash of them, or of the
    auth file's content). A cached blob is handed only to a pull of the same scope,
    which proved access to it the same way (red team F1: a store-wide cache keyed by
    digest alone gave another project's private blob to anyone naming its digest,
    without their registry ever serving it)."""
    cred = ""
    secret = opts.secret or opts.creds
    if secret:
        cred = "creds:" + hashlib.sha256(secret.encode()).hexdigest()
    elif opts.authfile is not None:
        try:
            with open(opts.authfile, "rb") as f:
                cred = "authfile:" + hashlib.sha256(f.read(_MAX_JSON)).hexdigest()
        except OSError:
            cred = "authfile:?"
    key = json.dumps([namespace, r.host.lower(), r.repo, cred])
    return hashlib.sha256(key.encode()).hexdigest()[:32]


class BlobCache:
    """Completed blobs of interrupted pulls, per store (``<store>/oci-cache``), in one
    partition per :func:`cache_scope` (``scopes/<scope>/``): hard-linked into a pull's
    scratch layout before skopeo runs and back while it runs, so a retry of the same
    pull (same namespace, repository and credentials) fetches nothing twice. Never
    across scopes: possessing a digest is no right to the content."""

    def __init__(self, store: LayerStore, scope: str) -> None:
        self.root = os.path.join(store.root, _CACHE)
        self.scopes = os.path.join(self.root, "scopes")
        self.blobs = os.path.join(self.scopes, scope, "blobs", "sha256")
        os.makedirs(self.blobs, mode=_DIR_MODE, exist_ok=True)
        for d in (self.root, self.scopes, os.path.join(self.scopes, scope),
                  os.path.dirname(self.blobs), self.blobs):
            os.chmod(d, _DIR_MODE)
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
        retried) in every scope; ctime is when the blob was linked in. The store-wide
        ``blobs/`` of older versions goes whole (no pull may use it: unscoped)."""
        shutil.rmtree(os.path.join(self.root, "blobs"), ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            for sc in os.scandir(self.scopes):
                blobs = os.path.join(sc.path, "blobs", "sha256")
                with contextlib.suppress(FileNotFoundError):
                    for e in os.scandir(blobs):
                        with contextlib.suppress(OSError):
                            if now - e.stat(follow_symlinks=False).st_ctime > max_age_s:
                                os.unlink(e.path)
                if blobs != self.blobs:
                    with contextlib.suppress(OSError):   # empty scopes go
                        os.rmdir(blobs)
                        os.rmdir(os.path.dirname(blobs))
                        os.rmdir(sc.path)

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
#: How many uncompressed layer bytes a pull may unpack per byte of quota room it has
#: (``max_bytes``): the EROFS layer is what is charged, and mkfs.erofs's compression
#: rarely gets a real layer below a quarter; a layer over that is refused as over the
#: quota while it is being unpacked, not after its tree filled the disk (red team F10:
#: a 200 KiB gzip blob wrote 64 MiB of a 64 MiB filesystem with 1 MiB of room).
UNPACK_PER_QUOTA_BYTE = 4
#: Free space a pull leaves on the store's filesystem: the rest of the machine (state
#: dir, other tenants' sandboxes) writes there too.
DISK_RESERVE_BYTES = 64 << 20


@dataclass(slots=True)
class _Room:
    """What one pull may still unpack: ``quota`` (None: no quota) across all its layers,
    ``disk`` for the layer at hand (its tree and its layer file coexist: half of the
    free space, less a reserve)."""

    quota: int | None
    disk: int

    @classmethod
    def of(cls, store: LayerStore, quota: int | None) -> _Room:
        try:
            st = os.statvfs(store.root)
            free = st.f_bavail * st.f_frsize
            reserve = min(DISK_RESERVE_BYTES, st.f_blocks * st.f_frsize // 10)
        except OSError:
            free, reserve = 1 << 62, 0
        return cls(quota=quota, disk=max(0, free // 2 - reserve))

    def error(self, n: int, layer: LayerBlob) -> DsecError:
        if self.quota is not None and self.quota <= self.disk:
            return QuotaExceeded(
                f"layer {layer.digest} unpacks to more than {self.quota} bytes, what this "
                f"pull's quota room allows ({UNPACK_PER_QUOTA_BYTE} bytes unpacked per "
                "byte of room); nothing was stored - raise the project's snapshot_bytes "
                "quota or pull a smaller image", resource="snapshot_bytes", used=n,
                limit=self.quota, requested=n)
        return CapacityExceeded(
            f"layer {layer.digest} unpacks to more than {self.disk} bytes, what the layer "
            "store's filesystem has free for it; nothing was stored - free space in the "
            "store (dsec image prune) or pull a smaller image", used=n, limit=self.disk)


class _Hashing:
    def __init__(self, f: IO[bytes], *, limit: int | None = None,
                 over: Callable[[int], DsecError] | None = None) -> None:
        self._f = f
        self.h = hashlib.sha256()
        self.n = 0
        self._limit = limit
        self._over = over

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.h.update(data)
        self.n += len(data)
        if self._limit is not None and self.n > self._limit:
            assert self._over is not None
            raise self._over(self.n)
        return data

    def drain(self) -> None:
        while self.read(1 << 20):
            pass

    @property
    def digest(self) -> str:
        return "sha256:" + self.h.hexdigest()


def _unpack(blob_path: str, layer: LayerBlob, dest: str, limits: ExtractLimits,
            room: _Room) -> tuple[ExtractStats, int]:
    """Unpack one layer blob into ``dest``, checking blob digest and diff_id; returns
    the extractor's stats (what it left out, counted in the layer's ``skipped``) and
    the uncompressed bytes read. The uncompressed stream is cut at ``room`` (quota and
    free disk) as it is read: a decompression bomb stops there."""
    with open(blob_path, "rb") as raw_f:
        raw = _Hashing(raw_f)
        gz = layer.media_type.endswith("gzip")
        inner: Any = gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw  # type: ignore[call-overload]
        bound = min(room.disk, room.quota if room.quota is not None else room.disk)
        tar = _Hashing(inner, limit=bound, over=lambda n: room.error(n, layer))
        try:
            stats = extract_tar(tar, dest, limits=limits,  # type: ignore[arg-type]
                                oci_whiteouts=True)
            tar.drain()
            raw.drain()
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CapacityExceeded(
                    f"the layer store's filesystem filled up unpacking layer "
                    f"{layer.digest}: {exc}; nothing was stored - free space in the "
                    "store (dsec image prune)") from exc
            raise CorruptLayer(f"layer blob {layer.digest} is not a readable "
                               f"{'gzip ' if gz else ''}tar: {exc}") from exc
        except EOFError as exc:
            raise CorruptLayer(f"layer blob {layer.digest} is not a readable "
                               f"{'gzip ' if gz else ''}tar: {exc}") from exc
    if raw.digest != layer.digest:
        raise CorruptLayer(f"layer blob hashes to {raw.digest}, not the {layer.digest} its "
                           "manifest names; the image is corrupt")
    if tar.digest != layer.diff_id:
        raise CorruptLayer(f"layer {layer.digest} unpacks to a tar with digest {tar.digest}, "
                           f"not the diff_id {layer.diff_id} the image config names; the "
                           "image is corrupt")
    return stats, tar.n


def _usable(m: LayerManifest, namespace: str | None) -> bool:
    """A stored layer this pull may stand on without fetching its blob: one of the
    target namespace itself (whose members read all of it anyway) or cluster-wide
    (every project reads those). Not an ancestor project's: ``may_point_at`` is the
    naming right of the ancestor's writers, not a read right of a descendant's members,
    and a reuse by a diff_id the caller's own config claims is no proof of the content
    (red team F14: a child project's member stacked the parent's private layer)."""
    if m.kind != "base" or not may_point_at(namespace, m):
        return False
    owner = layer_namespace(m)
    return owner is None or owner == namespace


def _bare(m: LayerManifest) -> bool:
    return not m.stack


def _same(stack: tuple[str, ...], labels: dict[str, str]) -> Callable[[LayerManifest], bool]:
    return lambda m: m.stack == stack and m.labels == labels


def _find(store: LayerStore, layer: LayerBlob, namespace: str | None,
          want: Callable[[LayerManifest], bool]) -> LayerManifest | None:
    """A stored layer for ``layer``'s position: the same diff_id AND the same source
    blob digest (the manifest's, which skopeo verifies against the registry), in a
    namespace :func:`_usable` allows."""
    for m in store.manifests():
        if m.labels.get(DIFFID_LABEL) == layer.diff_id \
                and m.labels.get(BLOB_LABEL) == layer.digest \
                and _usable(m, namespace) and want(m):
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
    line would show the password to every host user in /proc/<pid>/cmdline); without
    creds or an auth file, and not ``ambient_auth``, an empty one, and skopeo's $HOME
    an empty private dir: it finds no login of the host user running it."""
    import base64
    import dataclasses
    if opts.creds is None and (opts.authfile is not None or opts.ambient_auth):
        yield opts
        return
    if opts.creds is not None and ":" not in opts.creds:
        raise InvalidArgument("registry credentials must be user:password", field="creds")
    with store.staging("auth-") as d:
        path = os.path.join(d, "auth.json")
        auths = {} if opts.creds is None else {r.host: {"auth": base64.b64encode(
            opts.creds.encode()).decode()}}
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"auths": auths}, f)
        yield dataclasses.replace(opts, creds=None, authfile=path, secret=opts.creds,
                                  home=d)


def check_defaults(d: ImageDefaults, what: str) -> None:
    """Refuse (``ImageError``, naming the config field) an image config whose Env,
    WorkingDir or User the sandbox spec rules refuse: stored, every create from it would
    fail blaming a field the caller never set (red team F13)."""
    from dsec.wire.spec import SandboxSpec

    try:
        SandboxSpec(image="config-check", env=dict(d.env), cwd=d.cwd, user=d.user).validate()
    except InvalidArgument as exc:
        field = {"env": "Env", "cwd": "WorkingDir", "user": "User"}.get(
            str(exc.detail.get("field", "")), "config")
        raise ImageError(f"the image config of {what[:200]} sets a {field} no sandbox may "
                         f"have ({exc.message[:300]}); nothing was stored - fix the image "
                         "(its Dockerfile's ENV/WORKDIR/USER) and push it again") from None


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
        m = _find(store, layer, namespace,
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
    defaults = image_defaults(config)
    check_defaults(defaults, str(r))
    top_labels = {**defaults_labels(defaults), REF_LABEL: str(r),
                  PLATFORM_LABEL: str(want), CONFIG_LABEL: cfg_digest}
    cache = BlobCache(store, cache_scope(namespace, r, options))
    cache.expire(CACHE_MAX_AGE_S, time.time())
    blob_digests = [x.digest for x in layers]
    made: list[LayerManifest] = []
    fetched = 0
    quota_left = None if max_bytes is None else max_bytes * UNPACK_PER_QUOTA_BYTE
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
                                    deadline=deadline,
                                    # skopeo writes each blob as a temp file in the
                                    # layout's root, then renames it into blobs/
                                    progress=lambda: _dir_bytes(blob_dir) + _dir_bytes(
                                        scratch))
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
                    found = _find(store, layer, namespace,
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
                            ex, unpacked = _unpack(blob, layer, stage, limits,
                                                   _Room.of(store, quota_left))
                            if quota_left is not None:
                                quota_left -= unpacked   # a running total: every layer
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
