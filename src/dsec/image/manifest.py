"""Layer manifests and image references (pure: no I/O).

A layer is one EROFS file named by the sha256 of its bytes. Its manifest says what the
layer is for (``kind``), how people call it (``name:tag``), and for pack_diff snapshots
what it sits on: ``parent`` is the previous snapshot of the same sandbox and ``stack`` the
composed image (layer digests, highest priority first) the snapshot chain applies to.
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

from dsec.errors import InvalidArgument

__all__ = [
    "DIGEST_PREFIX",
    "LAYER_KINDS",
    "LayerKind",
    "LayerManifest",
    "ParsedRef",
    "parse_ref",
    "short_digest",
]

LayerKind = Literal["base", "workspace", "toolkit", "snapshot"]
LAYER_KINDS: tuple[LayerKind, ...] = ("base", "workspace", "toolkit", "snapshot")
DIGEST_PREFIX = "sha256:"

_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._/-]{0,127}")
_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_HEX_RE = re.compile(r"[0-9a-f]{12,64}")


class LayerManifest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What the store knows about one layer file (``layers/<hex>.erofs``)."""

    digest: str                              # "sha256:<64 hex>" of the EROFS file
    kind: LayerKind
    size_bytes: int                          # size of the EROFS file
    created: float                           # unix seconds
    name: str | None = None
    tag: str | None = None
    content_bytes: int = 0                   # bytes of regular-file data in the tree
    entries: int = 0                         # files, dirs, links, whiteouts in the tree
    compression: str | None = None           # "lz4", "lz4hc" or None
    labels: dict[str, str] = {}
    parent: str | None = None                # snapshots: previous snapshot's digest
    stack: tuple[str, ...] = ()              # snapshots: image digests, highest first

    @property
    def hex(self) -> str:
        return self.digest[len(DIGEST_PREFIX):]

    @property
    def ref(self) -> str:
        """``name:tag`` when named, else the digest."""
        return f"{self.name}:{self.tag}" if self.name else self.digest


class ParsedRef(msgspec.Struct, frozen=True):
    """A parsed image ref: either a (possibly abbreviated) digest or a name and tag."""

    digest_hex: str | None = None            # 12..64 hex chars (a prefix is allowed)
    name: str | None = None
    tag: str = "latest"


def parse_ref(ref: str) -> ParsedRef:
    """Parse ``name[:tag]`` or ``sha256:<hex>`` (hex may be a >= 12 char prefix)."""
    if not isinstance(ref, str) or not ref:
        raise InvalidArgument(f"invalid image ref {ref!r}: use name[:tag] or sha256:<digest>")
    if ref.startswith(DIGEST_PREFIX):
        hx = ref[len(DIGEST_PREFIX):]
        if not _HEX_RE.fullmatch(hx):
            raise InvalidArgument(
                f"invalid image digest {ref!r}: expected sha256: and 12-64 lowercase hex digits")
        return ParsedRef(digest_hex=hx)
    name, sep, tag = ref.rpartition(":")
    if not sep:
        name, tag = ref, "latest"
    if not _NAME_RE.fullmatch(name) or ".." in name or not _TAG_RE.fullmatch(tag):
        raise InvalidArgument(
            f"invalid image ref {ref!r}: names are lowercase [a-z0-9._/-] (up to 128), "
            "tags [A-Za-z0-9._-]")
    return ParsedRef(name=name, tag=tag)


def short_digest(digest: str, n: int = 12) -> str:
    """First ``n`` hex digits of a digest (for mount points and tables)."""
    return digest.removeprefix(DIGEST_PREFIX)[:n]
