"""Layer manifests and image references (pure: no I/O).

A layer is one EROFS file named by the sha256 of its bytes. Its manifest says what the
layer is for (``kind``), how people call it (``name:tag``), and for pack_diff snapshots
what it sits on: ``parent`` is the previous snapshot of the same sandbox and ``stack`` the
composed image (layer digests, highest priority first) the snapshot chain applies to.

Names are namespaced (docs/images.md, "Names and tenancy"). A ref is spelled

    [<project>/]<name>[:<tag>]        e.g. ``base``, ``teama/tools:v2``, ``org/team/x:1``
    sha256:<12..64 hex>               a digest or a unique prefix of one

A name never contains ``/``, so everything before the last ``/`` is the project path (which
may itself be nested, ``org/team``): the spelling is unambiguous. A ref without a project
part is *bare*: a write of a bare name is cluster-wide; a read of one (a sandbox's
``image=``) looks in the sandbox's project first and then cluster-wide (the control plane
does that, :mod:`dsec.image.catalog`; the store itself only knows exact names).
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

from dsec.errors import InvalidArgument
from dsec.ids import parse_project_path

__all__ = [
    "DIGEST_PREFIX",
    "LAYER_KINDS",
    "PROJECT_LABEL",
    "ChunkTableRef",
    "LayerKind",
    "LayerManifest",
    "ParsedRef",
    "layer_namespace",
    "parse_ref",
    "ref_key",
    "short_digest",
]

LayerKind = Literal["base", "workspace", "toolkit", "snapshot"]
LAYER_KINDS: tuple[LayerKind, ...] = ("base", "workspace", "toolkit", "snapshot")
DIGEST_PREFIX = "sha256:"
#: Label naming the project a snapshot layer belongs to (written by the edge).
PROJECT_LABEL = "dsec.io/project"
MAX_REF_LEN = 1200                      # 16 project levels of 63 + name 128 + tag 128

_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")
_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_HEX_RE = re.compile(r"[0-9a-f]{12,64}")


class ChunkTableRef(msgspec.Struct, frozen=True, kw_only=True):
    """The chunk table a push published for a layer (``layers/sha256/<hex>.chunks``),
    pinned by its own sha256. Recorded by whoever pushed the layer from a store that
    hashed the whole file (the control plane's manifest), so a node that reads the layer
    lazily checks the table it fetches against this before trusting a single chunk hash:
    the blob store cannot choose the hashes it is checked against (red team 17 F1)."""

    sha256: str                              # "sha256:<64 hex>" of the encoded table
    size: int                                # bytes of the encoded table
    chunk_size: int                          # the table's chunk size

    def __post_init__(self) -> None:
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", self.sha256):
            raise InvalidArgument(f"chunk table sha256 {self.sha256[:80]!r} is not "
                                  "sha256:<64 lowercase hex>")
        if self.size <= 0 or self.chunk_size <= 0:
            raise InvalidArgument(f"chunk table of {self.size} bytes in "
                                  f"{self.chunk_size}-byte chunks: both must be positive")


class LayerManifest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What the store knows about one layer file (``layers/<hex>.erofs``)."""

    digest: str                              # "sha256:<64 hex>" of the EROFS file
    kind: LayerKind
    size_bytes: int                          # size of the EROFS file
    created: float                           # unix seconds
    name: str | None = None                  # bare name (no '/'); see ``namespace``
    tag: str | None = None
    # The project whose layer this is (None: cluster-wide). Set from the name a layer is
    # built under, or for a snapshot from its project label. ``owner``: who built it (an
    # API principal id, or ``host:<user>`` for the CLI on the host).
    namespace: str | None = None
    owner: str | None = None
    content_bytes: int = 0                   # bytes of regular-file data in the tree
    entries: int = 0                         # files, dirs, links, whiteouts in the tree
    compression: str | None = None           # "lz4", "lz4hc" or None
    labels: dict[str, str] = {}
    parent: str | None = None                # snapshots: previous snapshot's digest
    stack: tuple[str, ...] = ()              # snapshots: image digests, highest first
    # Special files left out of the tree, per kind ("devices", "sockets"): the one rule
    # of dsec.image.tree.special_skip, whichever door the tree came through.
    skipped: dict[str, int] = {}
    # The chunk table published with the layer by a push (issue 17): what a lazy node
    # checks the fetched table against. None: never pushed (or pushed by an older dsec).
    chunk_table: ChunkTableRef | None = None

    @property
    def hex(self) -> str:
        return self.digest[len(DIGEST_PREFIX):]

    @property
    def ref(self) -> str:
        """``[project/]name:tag`` (as the layer was built) when named, else the digest."""
        if not self.name:
            return self.digest
        return ref_key(self.namespace, self.name, self.tag or "latest")


class ParsedRef(msgspec.Struct, frozen=True):
    """A parsed image ref: either a (possibly abbreviated) digest or a name and tag, the
    name with its project (``namespace``) or bare (``namespace`` None)."""

    digest_hex: str | None = None            # 12..64 hex chars (a prefix is allowed)
    name: str | None = None
    tag: str = "latest"
    namespace: str | None = None             # the project part; None: a bare name

    @property
    def key(self) -> str:
        """The store's key for this name (``[project/]name:tag``); names only."""
        assert self.name is not None
        return ref_key(self.namespace, self.name, self.tag)


def ref_key(namespace: str | None, name: str, tag: str) -> str:
    """The canonical spelling ``[project/]name:tag`` (also the store's refs.json key)."""
    return f"{namespace}/{name}:{tag}" if namespace else f"{name}:{tag}"


def parse_ref(ref: str) -> ParsedRef:
    """Parse ``[project/]name[:tag]`` or ``sha256:<hex>`` (hex may be a >= 12 char
    prefix). The project part is a project path (``org/team``), validated as one."""
    if not isinstance(ref, str) or not ref:
        raise InvalidArgument(f"invalid image ref {ref!r}: use [project/]name[:tag] or "
                              "sha256:<digest>")
    if len(ref) > MAX_REF_LEN:
        raise InvalidArgument(f"invalid image ref {ref[:60]!r}...: {len(ref)} characters, "
                              f"over the limit of {MAX_REF_LEN}")
    if ref.startswith(DIGEST_PREFIX):
        hx = ref[len(DIGEST_PREFIX):]
        if not _HEX_RE.fullmatch(hx):
            raise InvalidArgument(
                f"invalid image digest {ref!r}: expected sha256: and 12-64 lowercase hex digits")
        return ParsedRef(digest_hex=hx)
    path, sep, tag = ref.rpartition(":")
    if not sep or "/" in tag:
        path, tag = ref, "latest"
    namespace, slash, name = path.rpartition("/")
    if slash:
        try:
            parse_project_path(namespace)
        except InvalidArgument:
            raise InvalidArgument(
                f"invalid image ref {ref!r}: {namespace!r} before the last '/' is not a "
                "project path (lowercase parts like 'org/team'); names themselves contain "
                "no '/'") from None
    if not _NAME_RE.fullmatch(name) or not _TAG_RE.fullmatch(tag):
        raise InvalidArgument(
            f"invalid image ref {ref!r}: use [project/]name[:tag]; names are lowercase "
            "[a-z0-9._-] (up to 128, no '/'), tags [A-Za-z0-9._-]")
    return ParsedRef(name=name, tag=tag, namespace=namespace if slash else None)


def layer_namespace(m: LayerManifest) -> str | None:
    """The project a layer belongs to, None for a cluster-wide one. A snapshot names its
    project in a label (layers written before namespaces existed have only that); one
    without any project belongs to nobody (``""``: no project path matches it)."""
    if m.namespace is not None:
        return m.namespace
    project = m.labels.get(PROJECT_LABEL)
    if project is not None:
        return project
    return "" if m.kind == "snapshot" else None


def short_digest(digest: str, n: int = 12) -> str:
    """First ``n`` hex digits of a digest (for mount points and tables)."""
    return digest.removeprefix(DIGEST_PREFIX)[:n]
