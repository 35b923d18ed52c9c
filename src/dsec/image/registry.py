"""OCI registry references, platform selection and image configs (pure: no I/O).

What a pull needs to decide before and after talking to a registry (the talking itself is
skopeo's, :mod:`dsec.image.pull`):

- :func:`parse_registry_ref` reads ``[docker://]host[:port]/repo[:tag][@sha256:<hex>]``.
  A ref is a *registry* ref only when its first component names a host (it holds a ``.``
  or a ``:`` or is ``localhost``, docker's own rule): ``python:3.11`` stays a dsec layer
  name (:mod:`dsec.image.manifest`), so nothing is fetched from Docker Hub behind a bare
  name. :func:`is_registry_ref` tells the two apart.
- :func:`local_name` is the store name a pulled image gets (``127.0.0.1-5000_team_python``
  + the tag, or ``sha256-<hex>`` for a digest ref), so the same registry ref always lands
  on the same name, and :func:`is_registry_ref` refs never collide with layer names.
- :func:`select_manifest` picks one platform's manifest from an image index (the host's
  by default), :func:`image_layers` pairs a manifest's layer blobs with the config's
  ``rootfs.diff_ids`` (checked one for one).
- :func:`image_defaults` maps an OCI config's ``Env``/``WorkingDir``/``User``/
  ``Entrypoint``/``Cmd``/``Labels`` to the labels stored with the image, and back
  (:func:`defaults_from_labels`): what a sandbox started from it uses by default.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import platform as _platform
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dsec.errors import ImageError, InvalidArgument

__all__ = [
    "ImageDefaults",
    "LayerBlob",
    "Platform",
    "RegistryRef",
    "defaults_from_labels",
    "defaults_labels",
    "host_platform",
    "image_defaults",
    "image_layers",
    "is_registry_ref",
    "local_name",
    "parse_platform",
    "parse_registry_ref",
    "select_manifest",
]

INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")
#: Layers a pulled image may have, checked before anything is fetched (red team F11: a
#: 501-layer image was pulled, charged and named, then never ran, after minutes of mkfs).
#: Docker's own ceiling is 127 layers; the rest of overlayfs' 500 lowers stays for the
#: sandbox's workspace, toolkits (64) and snapshot chain.
MAX_IMAGE_LAYERS = 128
#: Layer media types whose blobs are tar streams we can read (gzip or none).
LAYER_TYPES = ("application/vnd.oci.image.layer.v1.tar",
               "application/vnd.oci.image.layer.v1.tar+gzip",
               "application/vnd.docker.image.rootfs.diff.tar.gzip",
               "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
               "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip")

_HOST_RE = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
                      r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
                      r"|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")
_REPO_RE = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
                      r"(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*")
_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
_MAX_REF = 1024
_NAME_MAX = 128


@dataclass(frozen=True, slots=True)
class RegistryRef:
    """``host[:port]/repo`` with a tag or a digest (the digest wins when both are given)."""

    host: str
    repo: str
    tag: str | None = None
    digest: str | None = None

    @property
    def repository(self) -> str:
        return f"{self.host}/{self.repo}"

    def __str__(self) -> str:
        if self.digest is not None:
            return f"{self.repository}@{self.digest}"
        return f"{self.repository}:{self.tag or 'latest'}"

    def docker(self, digest: str | None = None) -> str:
        """skopeo's ``docker://`` spelling, pinned to ``digest`` when given."""
        if digest is not None:
            return f"docker://{self.repository}@{digest}"
        return f"docker://{self}"


def host_only(host: str) -> str:
    """``host[:port]`` without the port and IPv6 brackets (``[::1]:5000`` -> ``::1``)."""
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_loopback_host(host: str) -> bool:
    """Whether a registry ``host[:port]`` is this machine: ``localhost`` or an IP
    *literal* in 127.0.0.0/8 or ``::1`` (docker's insecure-by-default rule). A name is
    never parsed by its spelling: ``127.attacker.example`` is a public DNS name (red
    team F3: a ``startswith("127.")`` test turned TLS off for it)."""
    h = host_only(host).lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def is_registry_ref(ref: str) -> bool:
    """Whether ``ref`` names an image in a registry (``host[:port]/repo...`` or
    ``docker://...``) rather than a layer of the store (``[project/]name[:tag]``)."""
    if not isinstance(ref, str):
        return False
    if ref.startswith("docker://"):
        return True
    first, slash, _ = ref.partition("/")
    return bool(slash) and ("." in first or ":" in first or first == "localhost")


def parse_registry_ref(ref: str) -> RegistryRef:
    """Parse a registry ref; ``InvalidArgument`` saying what is wrong otherwise."""
    if not isinstance(ref, str) or not ref or len(ref) > _MAX_REF:
        raise InvalidArgument(f"invalid registry ref {str(ref)[:80]!r}: use "
                              "host[:port]/repo[:tag][@sha256:<digest>]", field="ref")
    s = ref.removeprefix("docker://")
    if not is_registry_ref(s):
        raise InvalidArgument(
            f"{ref[:200]!r} is not a registry ref: the first part must be a registry host "
            "(with a '.' or a ':port', or 'localhost'), e.g. registry.example.com/team/app:1 "
            "or 127.0.0.1:5000/app:1 (Docker Hub images: docker.io/library/python:3.12)",
            field="ref")
    digest: str | None = None
    if "@" in s:
        s, _, digest = s.partition("@")
        if not _DIGEST_RE.fullmatch(digest):
            raise InvalidArgument(f"invalid digest in {ref[:200]!r}: expected "
                                  "sha256:<64 lowercase hex>", field="ref")
    host, _, rest = s.partition("/")
    tag: str | None = None
    repo = rest
    last = rest.rsplit("/", 1)[-1]
    if ":" in last:
        repo, _, tag = rest.rpartition(":")
        if not _TAG_RE.fullmatch(tag):
            raise InvalidArgument(f"invalid tag {tag[:130]!r} in {ref[:200]!r}: "
                                  "[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", field="ref")
    if not _HOST_RE.fullmatch(host):
        raise InvalidArgument(f"invalid registry host {host[:100]!r} in {ref[:200]!r}",
                              field="ref")
    if host == "docker.io":
        host = "docker.io"
        if "/" not in repo:
            repo = "library/" + repo
    if not _REPO_RE.fullmatch(repo) or len(repo) > 255:
        raise InvalidArgument(f"invalid repository {repo[:100]!r} in {ref[:200]!r}: "
                              "lowercase path components [a-z0-9] joined by '.', '_', '-'",
                              field="ref")
    if digest is None and tag is None:
        tag = "latest"
    return RegistryRef(host=host, repo=repo, tag=tag, digest=digest)


def local_name(ref: RegistryRef) -> tuple[str, str]:
    """The store's bare name and tag for a pulled image: ``host-port_repo_path`` (a name
    holds no '/', ':' becomes '-') and the tag, or ``sha256-<hex>`` for a digest ref.
    A name longer than a store name may be keeps its tail and a hash of the whole."""
    host = ref.host.lower()
    name = (host.replace(":", "-").replace("[", "").replace("]", "")
            + "_" + ref.repo.replace("/", "_"))
    # Injective (red team F5: quay.io/org/python and quay.io/org_python, host:5000 and a
    # host named host-5000, [::1]:5000 and [::1:5000] shared a name, and a create of one
    # ran the other): the plain spelling reads back uniquely when the host has no '-'
    # (so '-' was ':'), no brackets and the repo no '_' (so '_' was '/'; a host never
    # has one); any other ref gets '__' (which no plain spelling holds) and a hash of
    # the canonical host/repo.
    canon = hashlib.sha256(f"{host}/{ref.repo}".encode()).hexdigest()
    if "-" in host or "[" in host or "_" in ref.repo:
        name = name.lstrip("._-")[:_NAME_MAX - 18] + "__" + canon[:16]
    if len(name) > _NAME_MAX:
        name = canon[:16] + "-" + name[-(_NAME_MAX - 17):].lstrip("._-")
    tag = ("sha256-" + ref.digest.removeprefix("sha256:")) if ref.digest else (ref.tag or "latest")
    return name, tag


# --------------------------------------------------------------------- platforms
@dataclass(frozen=True, slots=True)
class Platform:
    os: str
    architecture: str
    variant: str | None = None

    def __str__(self) -> str:
        return f"{self.os}/{self.architecture}" + (f"/{self.variant}" if self.variant else "")


_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "i686": "386",
         "ppc64le": "ppc64le", "s390x": "s390x", "riscv64": "riscv64"}


def host_platform(machine: str | None = None) -> Platform:
    """This host's platform in OCI words (``linux/amd64``)."""
    m = machine if machine is not None else _platform.machine()
    return Platform("linux", _ARCH.get(m, m))


def parse_platform(text: str) -> Platform:
    """``os/arch[/variant]`` (``linux/arm64``, ``linux/arm/v7``)."""
    parts = text.split("/") if isinstance(text, str) else []
    if not 2 <= len(parts) <= 3 or not all(re.fullmatch(r"[a-z0-9_]{1,32}", p) for p in parts):
        raise InvalidArgument(f"invalid platform {str(text)[:60]!r}: use os/arch[/variant], "
                              "e.g. linux/amd64 or linux/arm/v7", field="platform")
    return Platform(parts[0], parts[1], parts[2] if len(parts) == 3 else None)


def _plat_of(d: Mapping[str, Any]) -> Platform | None:
    p = d.get("platform")
    if not isinstance(p, dict) or not isinstance(p.get("os"), str) \
            or not isinstance(p.get("architecture"), str):
        return None
    v = p.get("variant")
    return Platform(p["os"], p["architecture"], v if isinstance(v, str) else None)


def is_index(doc: Mapping[str, Any]) -> bool:
    return doc.get("mediaType") in INDEX_TYPES or ("manifests" in doc and "layers" not in doc)


def select_manifest(index: Mapping[str, Any], want: Platform) -> dict[str, Any]:
    """The descriptor of ``want``'s manifest in an image index. A variant is matched when
    asked for; without one, a descriptor naming no variant wins over one that does.
    ``ImageNotFound`` listing the platforms there are when none fits."""
    from dsec.errors import ImageNotFound

    manifests = index.get("manifests")
    if not isinstance(manifests, list) or not manifests:
        raise ImageError("the registry's image index lists no manifests")
    fits: list[tuple[int, dict[str, Any]]] = []
    for d in manifests:
        if not isinstance(d, dict) or not isinstance(d.get("digest"), str):
            continue
        p = _plat_of(d)
        if p is None or p.os != want.os or p.architecture != want.architecture:
            continue
        if want.variant is not None and p.variant != want.variant:
            continue
        fits.append((0 if p.variant is None or want.variant is not None else 1, d))
    if not fits:
        have = sorted({str(p) for d in manifests if isinstance(d, dict)
                       and (p := _plat_of(d)) is not None and p.os != "unknown"})
        raise ImageNotFound(f"the image has no {want} variant (it has: "
                            f"{', '.join(have) or 'none named'}); pick one with --platform",
                            ref=str(want))
    fits.sort(key=lambda t: t[0])
    return fits[0][1]


@dataclass(frozen=True, slots=True)
class LayerBlob:
    """One layer of a manifest: its blob (as stored, maybe compressed) and the digest of
    its uncompressed tar (the config's diff_id, what we verify and share layers by)."""

    digest: str
    diff_id: str
    media_type: str
    size: int


def image_layers(manifest: Mapping[str, Any], config: Mapping[str, Any]) -> list[LayerBlob]:
    """The manifest's layers bottom first, each with its diff_id from the config.
    ``ImageError`` when they do not pair up one for one or a layer cannot be read."""
    layers = manifest.get("layers")
    if not isinstance(layers, list):
        raise ImageError("the image manifest has no layers list")
    rootfs = config.get("rootfs")
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(diff_ids, list) or len(diff_ids) != len(layers):
        raise ImageError(
            f"the image config lists {len(diff_ids) if isinstance(diff_ids, list) else 'no'} "
            f"rootfs.diff_ids for {len(layers)} layers; the image is malformed")
    if len(layers) > MAX_IMAGE_LAYERS:
        raise ImageError(
            f"the image has {len(layers)} layers, over the {MAX_IMAGE_LAYERS} a pulled image "
            "may have (a sandbox stacks them with its workspace, toolkits and snapshots "
            "under overlayfs' 500 lowers); nothing was fetched - squash the image "
            "(fewer RUN steps, or `docker build --squash`) and push it again")
    out = []
    for i, (d, diff) in enumerate(zip(layers, diff_ids, strict=True)):
        if not isinstance(d, dict) or not isinstance(d.get("digest"), str) \
                or not _DIGEST_RE.fullmatch(d["digest"]):
            raise ImageError(f"layer {i} of the manifest has no sha256 digest")
        if not isinstance(diff, str) or not _DIGEST_RE.fullmatch(diff):
            raise ImageError(f"rootfs.diff_ids[{i}] of the config is not a sha256 digest")
        mt = str(d.get("mediaType") or LAYER_TYPES[1])
        if mt not in LAYER_TYPES:
            raise ImageError(
                f"layer {i} ({d['digest']}) has media type {mt!r}: only tar and tar+gzip "
                "layers are read (zstd is not); re-push the image with gzip layers")
        if "nondistributable" in mt or "foreign" in mt:
            # skopeo does not copy them (their blob is at the layer's own urls, any host,
            # outside the registry and its allow-list): refused, not half-pulled (F15)
            raise ImageError(
                f"layer {i} ({d['digest']}) is a foreign (non-distributable) layer, fetched "
                "from URLs outside the registry: dsec does not pull those; re-push the "
                "image with its layers in the registry")
        out.append(LayerBlob(d["digest"], diff, mt, int(d.get("size") or 0)))
    return out


def check_platform(config: Mapping[str, Any], want: Platform) -> None:
    """The pulled config is for ``want`` (skopeo picks from an index, this checks it)."""
    os_, arch = config.get("os"), config.get("architecture")
    if (os_, arch) != (want.os, want.architecture):
        raise ImageError(f"the pulled image is for {os_}/{arch}, not {want}; pick its "
                         "platform with --platform")


# ------------------------------------------------------------------ image config
@dataclass(frozen=True, slots=True)
class ImageDefaults:
    """What an image's config sets for the sandboxes started from it."""

    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    user: str | None = None
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)


#: Manifest labels that carry the image config (kept with the top layer of an image).
_ENV, _CWD, _USER, _ENTRY, _CMD, _LABELS = ("oci.env", "oci.workingdir", "oci.user",
                                           "oci.entrypoint", "oci.cmd", "oci.labels")


def _strs(v: Any) -> tuple[str, ...]:
    return tuple(str(x) for x in v) if isinstance(v, list) else ()


def image_defaults(config: Mapping[str, Any]) -> ImageDefaults:
    """The sandbox defaults of an OCI image config (``config.config`` of the blob)."""
    c = config.get("config")
    if not isinstance(c, dict):
        return ImageDefaults()
    env: dict[str, str] = {}
    for item in _strs(c.get("Env")):
        k, sep, v = item.partition("=")
        if sep and k:
            env[k] = v
    cwd = c.get("WorkingDir")
    user = c.get("User")
    labels = c.get("Labels")
    return ImageDefaults(
        env=env, cwd=cwd if isinstance(cwd, str) and cwd else None,
        user=user if isinstance(user, str) and user else None,
        entrypoint=_strs(c.get("Entrypoint")), cmd=_strs(c.get("Cmd")),
        labels={str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {})


def defaults_labels(d: ImageDefaults) -> dict[str, str]:
    """The manifest labels storing ``d`` (the same ``oci.*`` keys the importer wrote:
    JSON values; absent when unset)."""
    out: dict[str, str] = {}
    if d.env:
        out[_ENV] = json.dumps([f"{k}={v}" for k, v in d.env.items()])
    if d.cwd:
        out[_CWD] = json.dumps(d.cwd)
    if d.user:
        out[_USER] = json.dumps(d.user)
    if d.entrypoint:
        out[_ENTRY] = json.dumps(list(d.entrypoint))
    if d.cmd:
        out[_CMD] = json.dumps(list(d.cmd))
    if d.labels:
        out[_LABELS] = json.dumps(d.labels, sort_keys=True)
    return out


def defaults_from_labels(labels: Mapping[str, str]) -> ImageDefaults:
    """Read back :func:`defaults_labels` (bad values are ignored, not fatal: labels of
    old layers were written by hand-rolled importers)."""
    def load(key: str) -> Any:
        raw = labels.get(key)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return None
    cfg: dict[str, Any] = {"Env": load(_ENV), "WorkingDir": load(_CWD), "User": load(_USER),
                           "Entrypoint": load(_ENTRY), "Cmd": load(_CMD),
                           "Labels": load(_LABELS)}
    return image_defaults({"config": cfg})


def merge_env(*layers: Mapping[str, str] | Sequence[tuple[str, str]]) -> dict[str, str]:
    """Later layers win (image defaults, then create, then exec)."""
    out: dict[str, str] = {}
    for layer in layers:
        out.update(dict(layer))
    return out


# ------------------------------------------------------------------ auth challenge
_CHALLENGE_PARAM = re.compile(r'\s*([A-Za-z][A-Za-z0-9_-]*)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,]*))\s*,?')


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """A ``WWW-Authenticate`` value: (scheme in lower case, its parameters), e.g.
    ``Bearer realm="https://auth.example/token",service="reg",scope="repository:a:pull"``
    -> ``("bearer", {"realm": ..., "service": ..., "scope": ...})``. One challenge (the
    registries' way); ``("", {})`` for an empty header."""
    scheme, _, rest = header.strip().partition(" ")
    params: dict[str, str] = {}
    pos = 0
    while pos < len(rest):
        m = _CHALLENGE_PARAM.match(rest, pos)
        if m is None or m.end() == pos:
            break
        quoted, bare = m.group(2), m.group(3)
        params[m.group(1).lower()] = (re.sub(r"\\(.)", r"\1", quoted) if quoted is not None
                                      else bare or "")
        pos = m.end()
    return scheme.lower(), params
