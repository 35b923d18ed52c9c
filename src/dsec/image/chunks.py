"""Chunk tables: the per-chunk sha256 of a layer file, so a node that reads a layer
lazily (256 KiB at a time from a blob store) can verify each chunk on its own.

A layer's whole-file digest proves nothing until the last byte has arrived; a chunk
table stored beside the layer (``layers/sha256/<hex>.chunks``) lets a reader check every
chunk as it lands and never serve bytes that do not match. The table is msgpack
(msgspec), ~34 bytes per chunk: 4,096 chunks (140 KiB) for a 1 GiB layer.

256 KiB is DSec's chunk size: small enough that a task touching 5% of an image fetches
little more than it reads, large enough that one ranged GET amortises its round trip.
"""

from __future__ import annotations

import hashlib
import re

import msgspec

from dsec.errors import CorruptLayer, InvalidArgument
from dsec.image.manifest import ChunkTableRef

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "MAX_CHUNK_SIZE",
    "MIN_CHUNK_SIZE",
    "ChunkTable",
    "build_chunk_table",
    "check_table",
    "table_bytes_bound",
    "table_ref",
    "verify_chunk",
]

DEFAULT_CHUNK_SIZE = 256 * 1024
#: Chunks are whole pages (FUSE reads and the page cache work in pages) ...
MIN_CHUNK_SIZE = 4096
#: ... and no bigger than one ranged GET we are willing to hold in memory.
MAX_CHUNK_SIZE = 64 * 1024 * 1024
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
_READ = 1 << 20


class ChunkTable(msgspec.Struct, frozen=True, kw_only=True):
    """sha256 of each ``chunk_size`` piece of a ``size``-byte file whose whole sha256 is
    ``digest`` ("sha256:<hex>"); the last chunk is short unless ``size`` is a multiple."""

    digest: str
    size: int
    chunk_size: int = DEFAULT_CHUNK_SIZE
    hashes: list[bytes] = []

    def __post_init__(self) -> None:
        if not _DIGEST_RE.fullmatch(self.digest):
            raise InvalidArgument(f"chunk table digest {self.digest[:80]!r} is not "
                                  "sha256:<64 lowercase hex>")
        if self.size < 0:
            raise InvalidArgument(f"chunk table size {self.size} is negative")
        check_chunk_size(self.chunk_size)
        want = chunk_count(self.size, self.chunk_size)
        if len(self.hashes) != want:
            raise InvalidArgument(
                f"chunk table of {self.digest}: {len(self.hashes)} hashes for {self.size} "
                f"bytes in {self.chunk_size}-byte chunks, expected {want}")
        for i, h in enumerate(self.hashes):
            if len(h) != 32:
                raise InvalidArgument(f"chunk table of {self.digest}: hash {i} is "
                                      f"{len(h)} bytes, not a sha256 (32)")

    @property
    def count(self) -> int:
        return len(self.hashes)

    def chunk_range(self, index: int) -> tuple[int, int]:
        """``(offset, length)`` of chunk ``index`` in the file."""
        if not 0 <= index < len(self.hashes):
            raise InvalidArgument(f"chunk {index} out of range: {self.digest} has "
                                  f"{len(self.hashes)} chunks")
        off = index * self.chunk_size
        return off, min(self.chunk_size, self.size - off)

    def chunks_for(self, offset: int, length: int) -> range:
        """The chunk indices a read of ``length`` bytes at ``offset`` touches (clipped to
        the file; empty past its end)."""
        if offset < 0 or length < 0:
            raise InvalidArgument(f"read at offset {offset} of {length} bytes: negative")
        end = min(offset + length, self.size)
        if end <= offset:
            return range(0)
        return range(offset // self.chunk_size, (end - 1) // self.chunk_size + 1)

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> ChunkTable:
        """Parse an encoded table; a malformed one is :class:`CorruptLayer`."""
        try:
            return msgspec.msgpack.decode(data, type=cls)
        except (msgspec.DecodeError, msgspec.ValidationError, InvalidArgument) as exc:
            raise CorruptLayer(f"chunk table is malformed ({len(data)} bytes): {exc}") from exc


def check_chunk_size(chunk_size: int) -> None:
    if not (MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE) or chunk_size % MIN_CHUNK_SIZE:
        raise InvalidArgument(
            f"chunk size {chunk_size} must be a multiple of {MIN_CHUNK_SIZE} between "
            f"{MIN_CHUNK_SIZE} and {MAX_CHUNK_SIZE} (default {DEFAULT_CHUNK_SIZE})")


def chunk_count(size: int, chunk_size: int) -> int:
    return -(-size // chunk_size)


def build_chunk_table(path: str, chunk_size: int = DEFAULT_CHUNK_SIZE, *,
                      expect_digest: str | None = None) -> ChunkTable:
    """Hash ``path`` chunk by chunk (and whole) in one pass. ``expect_digest``: the
    digest the file is stored under; a file that no longer matches it is
    :class:`CorruptLayer` (a table is never built for bytes that are not the layer)."""
    check_chunk_size(chunk_size)
    whole = hashlib.sha256()
    hashes: list[bytes] = []
    size = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(chunk_size)
            if not chunk:
                break
            whole.update(chunk)
            hashes.append(hashlib.sha256(chunk).digest())
            size += len(chunk)
            if len(chunk) < chunk_size:
                break
    digest = "sha256:" + whole.hexdigest()
    if expect_digest is not None and digest != expect_digest:
        raise CorruptLayer(f"layer file {path} hashes to {digest}, not {expect_digest}: "
                           "it changed on disk; remove it and pull/build it again")
    return ChunkTable(digest=digest, size=size, chunk_size=chunk_size, hashes=hashes)


def verify_chunk(table: ChunkTable, index: int, data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` is exactly chunk ``index`` of the table's file (length and hash)."""
    _, length = table.chunk_range(index)
    if len(data) != length:
        return False
    return hashlib.sha256(data).digest() == table.hashes[index]


def table_bytes_bound(size: int, chunk_size: int) -> int:
    """The most bytes an encoded table of a ``size``-byte file in ``chunk_size`` chunks
    takes (msgpack: 34 bytes a hash, a few dozen for the rest): what a reader may ask a
    blob store for, whatever the store announces."""
    return 256 + 34 * chunk_count(size, chunk_size)


def table_ref(table: ChunkTable) -> tuple[bytes, ChunkTableRef]:
    """The encoded table and the record that pins it (:class:`ChunkTableRef`)."""
    raw = table.encode()
    return raw, ChunkTableRef(sha256="sha256:" + hashlib.sha256(raw).hexdigest(),
                              size=len(raw), chunk_size=table.chunk_size)


def check_table(raw: bytes, ref: ChunkTableRef, *, digest: str, size: int) -> ChunkTable:
    """The table ``raw`` (as fetched from a blob store) if it is exactly the one ``ref``
    records for the layer ``digest`` of ``size`` bytes, else :class:`CorruptLayer`: the
    hashes every chunk is verified against are never the store's own choice."""
    got = "sha256:" + hashlib.sha256(raw).hexdigest()
    if len(raw) != ref.size or got != ref.sha256:
        raise CorruptLayer(
            f"the chunk table fetched for {digest} ({len(raw)} bytes, {got[:23]}..) is not "
            f"the one its push recorded ({ref.size} bytes, {ref.sha256[:23]}..): the blob "
            "store holds other bytes than were pushed; push the layer again",
            digest=digest)
    table = ChunkTable.decode(raw)
    if table.digest != digest or table.size != size or table.chunk_size != ref.chunk_size:
        raise CorruptLayer(f"the chunk table recorded for {digest} describes "
                           f"{table.digest} of {table.size} bytes in {table.chunk_size}-byte "
                           f"chunks, not {size} bytes in {ref.chunk_size}", digest=digest)
    return table
