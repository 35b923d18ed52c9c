"""Pushing an image's layers to a blob store, and reading back what a push published.

For each layer of the image's chain (lowest first, so a layer is never visible without
what it stands on) three objects are written, in this order::

    layers/sha256/<hex>            the EROFS file (multipart on S3 above one part)
    layers/sha256/<hex>.chunks     its chunk table (sha256 per 256 KiB chunk)
    layers/sha256/<hex>.manifest   its LayerManifest (JSON): the commit point

Each object is atomic on every backend, and the manifest goes last, so a reader that
finds the manifest finds the other two whole; a push killed anywhere leaves at worst a
layer file or table without a manifest, which no reader uses and the next push
completes. The chunk table is built from the local file in the same pass that checks
the file still hashes to its digest: bytes that are not the layer are never uploaded.

A push is idempotent: a layer whose manifest is there, whose file has the manifest's
size and whose chunk table describes that digest and size is skipped (``verify=True``
also reads the remote file through and checks every chunk).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from dsec.errors import BlobNotFound, CorruptLayer, ImageNotFound
from dsec.image.blob import BlobStore
from dsec.image.blob.keys import layer_chunks_key, layer_key, layer_manifest_key
from dsec.image.chunks import (
    DEFAULT_CHUNK_SIZE,
    ChunkTable,
    build_chunk_table,
    check_table,
    table_ref,
    verify_chunk,
)
from dsec.image.manifest import LayerManifest
from dsec.image.store import LayerStore
from dsec.image.transfer import chain_order

__all__ = [
    "MAX_META_BYTES",
    "PushResult",
    "PushedLayer",
    "layer_chain",
    "push_image",
    "push_layer",
    "read_remote_layer",
    "remote_complete",
]

#: A manifest or chunk table larger than this is not one a push wrote (a chunk table of
#: a 64 GiB layer in 256 KiB chunks is 8.5 MiB).
MAX_META_BYTES = 16 << 20
_manifest_enc = msgspec.json.Encoder()
_manifest_dec = msgspec.json.Decoder(LayerManifest)

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True)
class PushedLayer:
    """One layer of a push: ``uploaded`` False when the store already had it whole."""

    digest: str
    size_bytes: int
    chunk_size: int
    uploaded: bool


@dataclass(frozen=True, slots=True)
class PushResult:
    ref: str
    digest: str                       # the top layer's (the image's) digest
    layers: tuple[PushedLayer, ...]   # lowest first
    bytes_uploaded: int
    seconds: float
    store: str                        # the store's URL, credentials redacted


def _get_small(blob: BlobStore, key: str) -> bytes | None:
    size = blob.head(key)
    if size is None:
        return None
    if size > MAX_META_BYTES:
        raise CorruptLayer(f"blob store {blob.url}: {key} is {size} bytes, over the "
                           f"{MAX_META_BYTES} a manifest or chunk table may be", key=key)
    try:
        return blob.get_range(key, 0, size)
    except BlobNotFound:
        return None                    # deleted between head and read


def read_remote_layer(blob: BlobStore, digest: str) -> tuple[LayerManifest, ChunkTable]:
    """The manifest and chunk table a push published for ``digest``, checked against each
    other and against the layer file's size (``ImageNotFound`` if it was not pushed,
    ``CorruptLayer`` if what is there does not fit together)."""
    raw = _get_small(blob, layer_manifest_key(digest))
    if raw is None:
        raise ImageNotFound(f"layer {digest} is not in the blob store {blob.url}; push it "
                            "(dsec image push)", ref=digest)
    try:
        m = _manifest_dec.decode(raw)
    except msgspec.DecodeError as exc:
        raise CorruptLayer(f"blob store {blob.url}: the manifest of {digest} is malformed: "
                           f"{exc}", digest=digest) from exc
    if m.digest != digest:
        raise CorruptLayer(f"blob store {blob.url}: the manifest under {digest} names "
                           f"{m.digest}", digest=digest)
    traw = _get_small(blob, layer_chunks_key(digest))
    if traw is None:
        raise CorruptLayer(f"blob store {blob.url}: layer {digest} has a manifest but no "
                           "chunk table; push it again", digest=digest)
    if m.chunk_table is not None:
        check_table(traw, m.chunk_table, digest=digest, size=m.size_bytes)
    table = ChunkTable.decode(traw)
    if table.digest != digest or table.size != m.size_bytes:
        raise CorruptLayer(f"blob store {blob.url}: the chunk table of {digest} describes "
                           f"{table.digest} of {table.size} bytes, the manifest "
                           f"{m.size_bytes} bytes", digest=digest)
    size = blob.head(layer_key(digest))
    if size != m.size_bytes:
        raise CorruptLayer(f"blob store {blob.url}: layer file {digest} is "
                           f"{'missing' if size is None else f'{size} bytes'}, its manifest "
                           f"says {m.size_bytes}", digest=digest)
    return m, table


def remote_complete(blob: BlobStore, m: LayerManifest, *, chunk_size: int,
                    verify: bool = False) -> bool:
    """Whether the store holds ``m`` whole, as a push with ``chunk_size`` leaves it, with
    the chunk table ``m`` (the pusher's record) pins."""
    try:
        remote, table = read_remote_layer(blob, m.digest)
    except (ImageNotFound, CorruptLayer):
        return False
    if table.chunk_size != chunk_size or m.chunk_table is None \
            or remote.chunk_table != m.chunk_table:
        return False
    if verify:
        for i in range(table.count):
            off, length = table.chunk_range(i)
            if not verify_chunk(table, i, blob.get_range(layer_key(m.digest), off, length)):
                return False
    return True


def layer_chain(layers: LayerStore, top: LayerManifest) -> list[LayerManifest]:
    """``top`` and every local layer it stands on, lowest first."""
    below: dict[str, LayerManifest] = {}
    todo = [*top.stack, *((top.parent,) if top.parent else ())]
    while todo:
        d = todo.pop()
        if d in below:
            continue
        m = layers.get(d)
        below[d] = m
        todo.extend((*m.stack, *((m.parent,) if m.parent else ())))
    return chain_order(top, below)


def push_layer(blob: BlobStore, layers: LayerStore, m: LayerManifest, *,
               chunk_size: int = DEFAULT_CHUNK_SIZE, verify: bool = False) -> PushedLayer:
    """Publish one layer (file, chunk table, manifest - in that order) and record in
    ``layers`` (the pusher's manifest: the control plane's when the apiserver pushes)
    the sha256 of the chunk table, which lazy nodes check the fetched table against."""
    if remote_complete(blob, m, chunk_size=chunk_size, verify=verify):
        return PushedLayer(m.digest, m.size_bytes, chunk_size, uploaded=False)
    path = layers.layer_path(m)
    try:
        table = build_chunk_table(path, chunk_size, expect_digest=m.digest)
    except OSError as exc:
        raise ImageNotFound(f"layer file of {m.digest} cannot be read ({exc.strerror}): "
                            "removed while it was pushed?", ref=m.digest) from exc
    if table.size != m.size_bytes:
        raise CorruptLayer(f"layer file {path} is {table.size} bytes, its manifest says "
                           f"{m.size_bytes}", digest=m.digest)
    raw, ref = table_ref(table)
    blob.put_file(layer_key(m.digest), path)
    blob.put_bytes(layer_chunks_key(m.digest), raw)
    m = layers.record_chunk_table(m.digest, ref)
    blob.put_bytes(layer_manifest_key(m.digest), _manifest_enc.encode(m))
    return PushedLayer(m.digest, m.size_bytes, chunk_size, uploaded=True)


def push_image(blob: BlobStore, layers: LayerStore, ref: str, *,
               chunk_size: int = DEFAULT_CHUNK_SIZE, verify: bool = False,
               progress: Progress | None = None,
               clock: Callable[[], float] = time.monotonic) -> PushResult:
    """Push the image ``ref`` names in ``layers`` (its layer and every layer below it)."""
    t0 = clock()
    # Pinned, not locked: a prune keeps the layers while they go up, and builds and
    # prunes are not held off for the length of an upload (the store's lock would).
    with layers.pinned() as pin:
        top = layers.get(ref)
        chain = layer_chain(layers, top)
        for m in chain:
            pin.add(m.digest)          # ImageNotFound if a prune took it just now
        total = sum(m.size_bytes for m in chain)
        done = 0
        out: list[PushedLayer] = []
        for m in chain:
            out.append(push_layer(blob, layers, m, chunk_size=chunk_size, verify=verify))
            done += m.size_bytes
            if progress is not None:
                progress("upload", done, total)
    return PushResult(ref=ref, digest=top.digest, layers=tuple(out),
                      bytes_uploaded=sum(p.size_bytes for p in out if p.uploaded),
                      seconds=clock() - t0, store=blob.url)
