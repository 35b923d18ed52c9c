"""Chunk tables: built in one pass, each chunk verifiable alone, malformed tables refused."""

from __future__ import annotations

import hashlib
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsec.errors import CorruptLayer, InvalidArgument
from dsec.image.chunks import (
    DEFAULT_CHUNK_SIZE,
    ChunkTable,
    build_chunk_table,
    verify_chunk,
)


def _write(tmp_path: os.PathLike[str], data: bytes) -> str:
    p = os.path.join(tmp_path, "layer.erofs")
    with open(p, "wb") as f:
        f.write(data)
    return p


@settings(max_examples=40, deadline=None)
@given(size=st.integers(0, 5 * 4096 + 7), cs=st.sampled_from([4096, 8192]))
def test_table_round_trip_and_every_chunk_verifies(tmp_path_factory: pytest.TempPathFactory,
                                                   size: int, cs: int) -> None:
    data = os.urandom(size)
    path = _write(tmp_path_factory.mktemp("c"), data)
    t = build_chunk_table(path, cs)
    assert t.digest == "sha256:" + hashlib.sha256(data).hexdigest()
    assert t.size == size and t.count == -(-size // cs)
    t2 = ChunkTable.decode(t.encode())
    assert t2 == t
    for i in range(t.count):
        off, length = t.chunk_range(i)
        assert verify_chunk(t2, i, data[off:off + length])
        if length:
            bad = bytearray(data[off:off + length])
            bad[0] ^= 1
            assert not verify_chunk(t2, i, bytes(bad))
            assert not verify_chunk(t2, i, data[off:off + length - 1])  # short: never data


def test_default_chunk_size_is_256k_and_last_chunk_short(tmp_path: os.PathLike[str]) -> None:
    data = os.urandom(DEFAULT_CHUNK_SIZE * 2 + 100)
    t = build_chunk_table(_write(tmp_path, data))
    assert t.chunk_size == 262144
    assert t.count == 3 and t.chunk_range(2) == (2 * 262144, 100)
    assert list(t.chunks_for(262143, 2)) == [0, 1]
    assert list(t.chunks_for(len(data), 10)) == []
    with pytest.raises(InvalidArgument, match="out of range"):
        t.chunk_range(3)


def test_expected_digest_mismatch_is_corrupt(tmp_path: os.PathLike[str]) -> None:
    p = _write(tmp_path, b"abc")
    with pytest.raises(CorruptLayer, match="hashes to sha256:"):
        build_chunk_table(p, expect_digest="sha256:" + "0" * 64)


@pytest.mark.parametrize("blob", [b"", b"\x93\x01", b"not msgpack at all \xff"])
def test_malformed_table_is_corrupt(blob: bytes) -> None:
    with pytest.raises(CorruptLayer):
        ChunkTable.decode(blob)


def test_table_with_wrong_hash_count_is_refused() -> None:
    good = ChunkTable(digest="sha256:" + "a" * 64, size=5000, chunk_size=4096,
                      hashes=[b"\0" * 32, b"\1" * 32])
    raw = good.encode().replace(b"\x92", b"\x91", 1)   # fixarray of 2 -> of 1 (drops one)
    with pytest.raises(CorruptLayer):
        ChunkTable.decode(raw[:-33])
    with pytest.raises(InvalidArgument, match="expected 2"):
        ChunkTable(digest=good.digest, size=5000, chunk_size=4096, hashes=[b"\0" * 32])
    with pytest.raises(InvalidArgument, match="multiple of 4096"):
        ChunkTable(digest=good.digest, size=0, chunk_size=1000, hashes=[])
