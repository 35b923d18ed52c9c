"""Access traces stored with the image: which chunks of which layers sandboxes of an
image read in their first seconds, so a later cold start on another node prefetches
them in the background (the ``lazy`` stream records and consumes them).

    traces/<image hex>/<node>-<unix ms>    one node's recording (history)
    traces/<image hex>/latest              the newest recording (what readers load)

A trace is msgpack: per layer digest, the chunk indices in first-read order. It is
bounded (:data:`MAX_TRACE_CHUNKS` indices in all, :data:`MAX_TRACE_LAYERS` layers,
:data:`MAX_TRACE_BYTES` encoded) whoever wrote it: a reader refuses a bigger one before
decoding it, so a corrupt or hostile object cannot make a node prefetch a whole store.
Traces are hints: a missing or malformed one means "no prefetch", never a failed start.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

import msgspec

from dsec.errors import BlobNotFound, BlobUnavailable, CorruptLayer, InvalidArgument
from dsec.image.blob import BlobStore
from dsec.image.blob.keys import trace_key, trace_prefix

__all__ = [
    "MAX_TRACE_BYTES",
    "MAX_TRACE_CHUNKS",
    "MAX_TRACE_LAYERS",
    "AccessTrace",
    "load_trace",
    "new_trace",
    "record_trace",
]

log = logging.getLogger(__name__)

MAX_TRACE_CHUNKS = 65536          # 16 GiB of 256 KiB chunks: far past a start's reads
MAX_TRACE_LAYERS = 500            # overlayfs' own limit of lowers
MAX_TRACE_BYTES = 1 << 20
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")


class AccessTrace(msgspec.Struct, frozen=True, kw_only=True):
    """Chunks sandboxes of ``image`` read within ``window_s`` of their start on ``node``."""

    image: str                                  # the image's (top layer's) digest
    node: str
    recorded_at: float                          # unix seconds
    window_s: float
    layers: dict[str, list[int]]                # layer digest -> chunk indices, in order

    def __post_init__(self) -> None:
        if not _DIGEST_RE.fullmatch(self.image):
            raise InvalidArgument(f"trace image {self.image[:80]!r} is not a sha256 digest")
        if len(self.layers) > MAX_TRACE_LAYERS:
            raise InvalidArgument(f"trace of {self.image}: {len(self.layers)} layers, over "
                                  f"the limit of {MAX_TRACE_LAYERS}")
        n = 0
        for digest, chunks in self.layers.items():
            if not _DIGEST_RE.fullmatch(digest):
                raise InvalidArgument(f"trace of {self.image}: layer {digest[:80]!r} is not "
                                      "a sha256 digest")
            n += len(chunks)
            if any(not 0 <= c < 1 << 32 for c in chunks):
                raise InvalidArgument(f"trace of {self.image}: layer {digest} has a chunk "
                                      "index outside 0..2^32")
        if n > MAX_TRACE_CHUNKS:
            raise InvalidArgument(f"trace of {self.image}: {n} chunk indices, over the "
                                  f"limit of {MAX_TRACE_CHUNKS}; record a shorter window")

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> AccessTrace:
        if len(data) > MAX_TRACE_BYTES:
            raise CorruptLayer(f"access trace of {len(data)} bytes, over the limit of "
                               f"{MAX_TRACE_BYTES}")
        try:
            return msgspec.msgpack.decode(data, type=cls)
        except (msgspec.DecodeError, msgspec.ValidationError, InvalidArgument) as exc:
            raise CorruptLayer(f"access trace is malformed ({len(data)} bytes): {exc}") from exc


def record_trace(blob: BlobStore, trace: AccessTrace) -> str:
    """Store ``trace`` under its node's key and as the image's ``latest``; the key."""
    data = trace.encode()
    if len(data) > MAX_TRACE_BYTES:
        raise InvalidArgument(f"access trace of {trace.image} encodes to {len(data)} bytes, "
                              f"over the limit of {MAX_TRACE_BYTES}")
    key = trace_key(trace.image, trace.node, int(trace.recorded_at * 1000))
    blob.put_bytes(key, data)
    blob.put_bytes(trace_prefix(trace.image) + "latest", data)
    return key


def load_trace(blob: BlobStore, image: str) -> AccessTrace | None:
    """The image's newest trace, or None: none recorded, unreadable or malformed (a hint
    lost is logged, never an error: the start goes on without prefetch)."""
    key = trace_prefix(image) + "latest"
    try:
        size = blob.head(key)
        if size is None:
            return None
        if size > MAX_TRACE_BYTES:
            log.warning("access trace %s in %s is %d bytes, over the limit of %d: ignored",
                        key, blob.url, size, MAX_TRACE_BYTES)
            return None
        trace = AccessTrace.decode(blob.get_range(key, 0, size))
    except (BlobNotFound, BlobUnavailable, CorruptLayer) as exc:
        log.warning("access trace %s in %s not used: %s", key, blob.url, exc)
        return None
    if trace.image != image:
        log.warning("access trace %s names image %s: ignored", key, trace.image)
        return None
    return trace


def new_trace(image: str, node: str, layers: dict[str, list[int]], *, window_s: float,
              clock: Callable[[], float] = time.time) -> AccessTrace:
    """A trace recorded now, each layer's indices de-duplicated in first-read order."""
    return AccessTrace(image=image, node=node, recorded_at=clock(), window_s=window_s,
                       layers={d: list(dict.fromkeys(c)) for d, c in layers.items()})
