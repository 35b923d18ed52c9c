"""Checking a layer received from another node (pure, but for :func:`decode_manifest`'s
decoding): the manifest must describe the digest asked for, the bytes may not exceed
the manifest's size in total nor the agreed chunk size per read, and their sha256 must
be the digest. A peer that lies (more bytes, other bytes, another manifest) is refused
with :class:`~dsec.errors.CorruptLayer` naming what it did; the caller removes its
temp file, so nothing half-received is ever a layer (docs/layers.md).
"""

from __future__ import annotations

import hashlib

import msgspec

from dsec.errors import CorruptLayer
from dsec.image.manifest import DIGEST_PREFIX, LAYER_KINDS, LayerManifest
from dsec.wire.layers import check_digest

__all__ = ["CHUNK_BYTES", "LayerCheck", "chain_order", "decode_manifest"]

CHUNK_BYTES = 1 << 20
"""Bytes per read on both ends of a transfer (1 MiB: Aether's duplex credit moves 64 KiB
pieces under it; larger reads gained nothing measurable here)."""

_dec = msgspec.json.Decoder(LayerManifest)


def decode_manifest(raw: bytes, *, digest: str | None = None) -> LayerManifest:
    """The manifest a holder sent, checked: well-formed, a full digest, a known kind, a
    positive size, and (``digest``) the layer that was asked for."""
    try:
        m = _dec.decode(raw)
    except msgspec.DecodeError as exc:
        raise CorruptLayer(f"layer manifest from the holder is unreadable: {exc}",
                                 digest=digest or "") from exc
    check_digest(m.digest)
    if digest is not None and m.digest != digest:
        raise CorruptLayer(
            f"the holder sent the manifest of {m.digest} when {digest} was asked for; "
            "refused", digest=digest)
    if m.kind not in LAYER_KINDS or m.size_bytes <= 0:
        raise CorruptLayer(
            f"layer manifest of {m.digest} is not one this node can store (kind "
            f"{m.kind!r}, {m.size_bytes} bytes)", digest=m.digest)
    return m


class LayerCheck:
    """The running check of one layer's bytes as they arrive (sans-IO: ``feed`` each
    chunk, then ``finish``)."""

    __slots__ = ("_h", "digest", "max_chunk", "received", "size")

    def __init__(self, manifest: LayerManifest, *, max_chunk: int = CHUNK_BYTES) -> None:
        self.digest = manifest.digest
        self.size = manifest.size_bytes
        self.max_chunk = max_chunk
        self.received = 0
        self._h = hashlib.sha256()

    def feed(self, data: bytes) -> None:
        """Account for ``data``; refuses a chunk over ``max_chunk`` or any byte past the
        manifest's size (before it is written anywhere)."""
        if len(data) > self.max_chunk:
            raise CorruptLayer(
                f"layer {self.digest}: a chunk of {len(data)} bytes, over the limit of "
                f"{self.max_chunk}; refused", digest=self.digest, received=self.received)
        if self.received + len(data) > self.size:
            raise CorruptLayer(
                f"layer {self.digest}: the holder sent more than the {self.size} bytes its "
                f"manifest says ({self.received + len(data)} so far); refused, nothing kept",
                digest=self.digest, received=self.received + len(data), size=self.size)
        self.received += len(data)
        self._h.update(data)

    def finish(self) -> None:
        """The stream ended: all ``size`` bytes, hashing to the digest, or refused."""
        if self.received != self.size:
            raise CorruptLayer(
                f"layer {self.digest}: the stream ended after {self.received} of {self.size} "
                "bytes (truncated); refused, nothing kept", digest=self.digest,
                received=self.received, size=self.size)
        got = DIGEST_PREFIX + self._h.hexdigest()
        if got != self.digest:
            raise CorruptLayer(
                f"layer {self.digest}: the {self.size} bytes received hash to {got} "
                "(corrupted or forged); refused, nothing kept", digest=self.digest,
                actual=got)


def chain_order(top: LayerManifest, below: dict[str, LayerManifest]) -> list[LayerManifest]:
    """``top`` and every layer it stands on (``parent``, ``stack``), lowest first, each
    once: the order to publish them in, so a layer never appears without what is under it.
    ``below``: manifests by digest (a missing one raises)."""
    out: list[LayerManifest] = []
    done: set[str] = set()
    visiting: set[str] = set()

    def visit(m: LayerManifest) -> None:
        if m.digest in done:
            return
        if m.digest in visiting:
            raise CorruptLayer(f"layer chain of {top.digest} loops at {m.digest}",
                                     digest=top.digest)
        visiting.add(m.digest)
        for d in (*m.stack, *((m.parent,) if m.parent else ())):
            sub = below.get(d)
            if sub is None:
                raise CorruptLayer(
                    f"layer {m.digest} stands on {d}, which its holder does not have",
                    digest=m.digest, missing=d)
            visit(sub)
        visiting.discard(m.digest)
        done.add(m.digest)
        out.append(m)

    visit(top)
    return out
