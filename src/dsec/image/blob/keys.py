"""Blob store key layout and the one rule every key passes (pure: no I/O).

    layers/sha256/<hex>               the EROFS layer file
    layers/sha256/<hex>.chunks        its chunk table (dsec.image.chunks, msgpack)
    layers/sha256/<hex>.manifest      its LayerManifest (JSON)
    traces/<image-hex>/<node>-<ts>    one access trace of an image (dsec.image.blob.traces)

A key is a relative path of ``[A-Za-z0-9._-]`` segments: no empty, ``.`` or ``..``
segment, no leading ``/``, at most 1024 bytes, so no key can step outside a
``file://`` directory or an S3 prefix whatever a caller names.
"""

from __future__ import annotations

import re

from dsec.errors import InvalidArgument

__all__ = [
    "MAX_KEY_LEN",
    "check_key",
    "layer_chunks_key",
    "layer_key",
    "layer_manifest_key",
    "trace_key",
    "trace_prefix",
]

MAX_KEY_LEN = 1024
_SEGMENT_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
_HEX_RE = re.compile(r"[0-9a-f]{64}")
_NODE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_key(key: str) -> str:
    """``key`` if it is a safe relative key, else ``InvalidArgument`` saying why."""
    if not isinstance(key, str) or not key or len(key.encode()) > MAX_KEY_LEN:
        raise InvalidArgument(f"blob key {str(key)[:80]!r}: must be 1..{MAX_KEY_LEN} bytes")
    for seg in key.split("/"):
        if not _SEGMENT_RE.fullmatch(seg):
            raise InvalidArgument(
                f"blob key {key[:200]!r}: segment {seg[:80]!r} is not [A-Za-z0-9._-] "
                "starting with a letter, digit or '_' (no empty, '.' or '..' segments)")
    return key


def _hex(digest: str) -> str:
    hx = digest.removeprefix("sha256:")
    if not _HEX_RE.fullmatch(hx):
        raise InvalidArgument(f"digest {digest[:80]!r} is not sha256:<64 lowercase hex>")
    return hx


def layer_key(digest: str) -> str:
    return f"layers/sha256/{_hex(digest)}"


def layer_chunks_key(digest: str) -> str:
    return f"layers/sha256/{_hex(digest)}.chunks"


def layer_manifest_key(digest: str) -> str:
    return f"layers/sha256/{_hex(digest)}.manifest"


def trace_prefix(image_digest: str) -> str:
    return f"traces/{_hex(image_digest)}/"


def trace_key(image_digest: str, node: str, ts: int) -> str:
    """One trace of an image recorded by ``node`` at unix time ``ts`` (milliseconds)."""
    if not _NODE_RE.fullmatch(node):
        raise InvalidArgument(f"node name {node[:80]!r} is not [A-Za-z0-9._-] (1..128)")
    if ts < 0:
        raise InvalidArgument(f"trace timestamp {ts} is negative")
    return f"{trace_prefix(image_digest)}{node}-{ts}"
