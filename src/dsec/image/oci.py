"""Import OCI images (an OCI layout directory or tarball, or a ``docker save`` tarball).

Each image layer is a tar whose deletions use the OCI encoding (``.wh.<name>`` files and
``.wh..wh..opq`` for "directory replaced"). Layers are unpacked safely
(:mod:`dsec.image.archive`) with those translated into overlayfs whiteouts, then either
squashed bottom-up into one ``base`` layer (the default: a sandbox needs one base) or
kept one EROFS layer per OCI layer (``squash=False``), stackable as overlay lowers as is.
Blob digests of an OCI layout are verified while reading (gzip-compressed blobs are
fine; zstd blobs are not supported by Python's tarfile).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from dsec.errors import CorruptLayer, ImageError, InvalidArgument
from dsec.image.archive import DEFAULT_LIMITS, ExtractLimits, extract_tar, open_tar
from dsec.image.erofs import Compression, ProgressFn
from dsec.image.manifest import LayerKind, LayerManifest
from dsec.image.store import LayerStore, Pin
from dsec.image.tree import apply_tree, skip_counts

__all__ = ["OciImage", "import_oci", "read_oci"]

_INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
                "application/vnd.docker.distribution.manifest.list.v2+json")
_MAX_JSON = 16 << 20


@dataclass(frozen=True, slots=True)
class OciImage:
    """The parts of an image we use: layer blob paths (bottom first) and its config."""

    layers: tuple[tuple[str, str | None], ...]   # (path inside the layout, sha256 hex | None)
    config: dict[str, Any]


class _Source:
    """Reads files of a layout that is a directory or a tarball, by relative path."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._tar: tarfile.TarFile | None = None
        if os.path.isfile(path):
            try:
                # Kept open for the object's lifetime; closed by close().
                self._tar = open_tar(name=path, mode="r:*")
            except tarfile.TarError as exc:
                raise InvalidArgument(f"{path} is not an OCI/docker-save tarball: {exc}") from exc
        elif not os.path.isdir(path):
            raise InvalidArgument(f"OCI image {path!r} is neither a directory nor a tarball")

    def exists(self, rel: str) -> bool:
        if self._tar is None:
            return os.path.isfile(os.path.join(self.path, rel))
        try:
            self._tar.getmember(rel)
            return True
        except KeyError:
            return False

    @contextlib.contextmanager
    def open(self, rel: str) -> Iterator[IO[bytes]]:
        if rel.startswith("/") or ".." in rel.split("/"):
            raise ImageError(f"OCI image references the path {rel!r} outside its layout")
        if self._tar is None:
            try:
                # Opened apart from `with f:` so only a missing file becomes ImageError.
                f: IO[bytes] = open(os.path.join(self.path, rel), "rb")  # noqa: SIM115
            except FileNotFoundError:
                raise ImageError(f"OCI image {self.path} lacks {rel}") from None
            with f:
                yield f
            return
        try:
            member = self._tar.extractfile(rel)
        except KeyError:
            raise ImageError(f"OCI tarball {self.path} lacks {rel}") from None
        if member is None:
            raise ImageError(f"{rel} in {self.path} is not a regular file")
        with member:
            yield member

    def json(self, rel: str) -> Any:
        with self.open(rel) as f:
            data = f.read(_MAX_JSON + 1)
        if len(data) > _MAX_JSON:
            raise ImageError(f"{rel} in {self.path} is larger than {_MAX_JSON} bytes")
        try:
            return json.loads(data)
        except ValueError as exc:
            raise ImageError(f"{rel} in {self.path} is not valid JSON: {exc}") from exc

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()


def _blob(digest: str) -> tuple[str, str]:
    algo, _, hx = digest.partition(":")
    if algo != "sha256" or len(hx) != 64 or not all(c in "0123456789abcdef" for c in hx):
        raise ImageError(f"unsupported or malformed blob digest {digest!r} (sha256 only)")
    return f"blobs/sha256/{hx}", hx


def _arch() -> str:
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())


def read_oci(src: _Source, ref: str | None = None) -> OciImage:
    """Find the image in a layout: docker-save ``manifest.json`` or OCI ``index.json``."""
    if src.exists("manifest.json"):
        entries = src.json("manifest.json")
        if not isinstance(entries, list) or not entries:
            raise ImageError("docker-save manifest.json lists no images")
        entry = entries[0]
        if ref is not None:
            matches = [e for e in entries if ref in (e.get("RepoTags") or [])]
            if not matches:
                raise ImageError(f"docker-save tarball has no image tagged {ref!r}")
            entry = matches[0]
        cfg: dict[str, Any] = src.json(entry["Config"]) if entry.get("Config") else {}
        saved: tuple[tuple[str, str | None], ...] = tuple(
            (str(p), None) for p in entry.get("Layers", []))
        return OciImage(saved, cfg)
    if not src.exists("index.json"):
        raise ImageError(f"{src.path} has neither index.json (OCI layout) nor manifest.json "
                         "(docker save)")
    doc = src.json("index.json")
    for _ in range(4):                       # index -> (nested index ->) manifest
        manifests = doc.get("manifests") or []
        if not manifests:
            raise ImageError("OCI index lists no manifests")
        pick = manifests[0]
        if ref is not None:
            named = [m for m in manifests
                     if (m.get("annotations") or {}).get("org.opencontainers.image.ref.name") == ref]
            if named:
                pick = named[0]
        plat = [m for m in manifests if (m.get("platform") or {}).get("architecture") == _arch()]
        if plat and ref is None:
            pick = plat[0]
        doc = src.json(_blob(pick["digest"])[0])
        if doc.get("mediaType") in _INDEX_TYPES or ("manifests" in doc and "layers" not in doc):
            continue
        break
    if "layers" not in doc:
        raise ImageError("OCI manifest has no layers")
    config: dict[str, Any] = {}
    if doc.get("config", {}).get("digest"):
        config = src.json(_blob(doc["config"]["digest"])[0])
    blobs: tuple[tuple[str, str | None], ...] = tuple(
        _blob(layer["digest"]) for layer in doc["layers"])
    return OciImage(blobs, config)


class _Hashing:
    """File wrapper that hashes what is read through it."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.h = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.h.update(data)
        return data

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


def _labels(config: dict[str, Any], ref: str | None) -> dict[str, str]:
    """The image config as the ``oci.*`` labels every image carries (pulled ones too:
    :func:`dsec.image.registry.defaults_labels`), which become its sandboxes' defaults."""
    from dsec.image.registry import defaults_labels, image_defaults

    out = defaults_labels(image_defaults(config))
    if ref:
        out["oci.ref"] = ref
    return out


def import_oci(store: LayerStore, path: str, *, name: str | None = None, tag: str = "latest",
               ref: str | None = None, squash: bool = True, kind: LayerKind = "base",
               compression: Compression | None = None,
               limits: ExtractLimits = DEFAULT_LIMITS,
               progress: ProgressFn | None = None, namespace: str | None = None,
               owner: str | None = None, max_bytes: int | None = None,
               pin: Pin | None = None) -> list[LayerManifest]:
    """Import an OCI image into the store; returns its layers, highest first.

    With ``squash`` (default) that is one layer of ``kind`` (named ``name:tag``);
    otherwise one layer per OCI layer, the top one named. Every layer, named or not,
    belongs to project ``namespace`` (None: cluster-wide). ``max_bytes`` bounds each
    layer file (``QuotaExceeded``, as ``LayerStore.add_tree``). Unsquashed, the top
    layer's ``stack`` names the ones below (highest first), so they are referenced as
    long as it is (a prune keeps them; a pulled image is recorded the same way).
    ``pin``: every layer made is pinned from the moment it appears (name them later).
    """
    src = _Source(path)
    try:
        img = read_oci(src, ref)
        labels = _labels(img.config, ref)
        with contextlib.ExitStack() as stack:
            stages: list[str] = []
            skips: list[dict[str, int]] = []    # device members left out (special_skip)
            for blob_path, hx in img.layers:
                stage = stack.enter_context(store.staging("oci-"))
                with src.open(blob_path) as raw:
                    f = _Hashing(raw)
                    skips.append(extract_tar(f, stage, limits=limits,  # type: ignore[arg-type]
                                             oci_whiteouts=True).skipped)
                    f.drain()
                if hx is not None and f.h.hexdigest() != hx:
                    raise CorruptLayer(f"OCI blob {blob_path} hashes to sha256:"
                                       f"{f.h.hexdigest()}, not the sha256:{hx} its manifest "
                                       "names; the image is corrupt")
                stages.append(stage)
            if squash:
                final = stack.enter_context(store.staging("oci-squash-"))
                for stage in stages:
                    apply_tree(stage, final, keep_whiteouts=False)
                return [store.add_tree(final, kind=kind, name=name, tag=tag, labels=labels,
                                       compression=compression, progress=progress,
                                       namespace=namespace, owner=owner,
                                       max_bytes=max_bytes, skipped=skip_counts(*skips),
                                       pin=pin)]
            out: list[LayerManifest] = []
            for i, stage in enumerate(stages):
                top = i == len(stages) - 1
                out.append(store.add_tree(stage, kind=kind, name=name if top else None,
                                          tag=tag, labels=labels if top else {},
                                          stack=tuple(m.digest for m in reversed(out))
                                          if top else (),
                                          compression=compression, namespace=namespace,
                                          owner=owner, max_bytes=max_bytes,
                                          skipped=skips[i], pin=pin))
            return out[::-1]
    finally:
        src.close()
