"""The sans-IO frame codec: layout, round trips, fragmentation and corruption."""

from __future__ import annotations

import random
import re
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsec.aether.frame import (
    HEADER_SIZE,
    Frame,
    FrameDecoder,
    FrameType,
    decode_parts,
    encode,
    encode_parts,
)
from dsec.errors import LocalProtocolError, RemoteProtocolError

DOCS = Path(__file__).resolve().parents[2] / "docs" / "aether.md"

frames = st.builds(
    Frame,
    type=st.sampled_from(list(FrameType)),
    stream_id=st.integers(0, 2**64 - 1),
    payload=st.binary(max_size=3000),
    flags=st.integers(0, 0xFFFF),
)


def _doc_vector() -> tuple[bytes, bytes]:
    """The worked example in docs/aether.md: (frame bytes, payload bytes)."""
    text = DOCS.read_text()
    block = re.search(r"<!-- test-vector -->\s*```\n(.*?)```", text, re.DOTALL)
    assert block, "docs/aether.md lost its <!-- test-vector --> block"
    lines = {k.strip(): v for k, v in
             (ln.split(":", 1) for ln in block.group(1).strip().splitlines())}
    frame = bytes.fromhex(lines["frame"].replace(" ", ""))
    payload = bytes.fromhex(lines["payload"].replace(" ", ""))
    return frame, payload


def test_docs_test_vector_matches_the_codec_byte_for_byte() -> None:
    wire, payload = _doc_vector()
    assert payload == b"\x04echo\xa2hi"  # method "echo", msgpack body "hi"
    assert encode(Frame(FrameType.REQUEST, 1, payload)) == wire
    assert encode_parts(FrameType.REQUEST, 1, payload) == wire[:HEADER_SIZE]
    assert wire[HEADER_SIZE - 4 : HEADER_SIZE] == (0x0EFAF9B5).to_bytes(4, "big")
    assert zlib.crc32(wire[:21] + payload) == 0x0EFAF9B5
    assert decode_parts(wire[:HEADER_SIZE], wire[HEADER_SIZE:]) == Frame(
        FrameType.REQUEST, 1, payload)


def test_header_layout_is_network_byte_order() -> None:
    h = encode_parts(FrameType.STREAM, 0x0102030405060708, b"xyz", flags=0xA1B2)
    assert h[0:4] == b"AETH"
    assert h[4:6] == b"\x00\x01"
    assert h[6:14] == bytes(range(1, 9))
    assert h[14] == 4
    assert h[15:19] == b"\x00\x00\x00\x03"
    assert h[19:21] == b"\xa1\xb2"
    assert int.from_bytes(h[21:25], "big") == zlib.crc32(b"xyz", zlib.crc32(h[:21]))


@given(frames)
def test_round_trip_through_decode_parts(f: Frame) -> None:
    wire = encode(f)
    assert len(wire) == HEADER_SIZE + len(f.payload)
    assert decode_parts(wire[:HEADER_SIZE], wire[HEADER_SIZE:]) == f


@given(st.lists(frames, min_size=1, max_size=8), st.randoms(use_true_random=False))
def test_round_trip_through_the_decoder_in_random_fragments(
    fs: list[Frame], rnd: random.Random
) -> None:
    wire = b"".join(encode(f) for f in fs)
    dec = FrameDecoder()
    out: list[Frame] = []
    i = 0
    while i < len(wire):
        n = rnd.randint(1, 64)
        dec.feed(wire[i : i + n])
        i += n
        out += dec.frames()
    assert out == fs
    assert dec.buffered == 0
    dec.eof()  # nothing left half-way


def test_delivery_one_byte_at_a_time() -> None:
    fs = [Frame(FrameType.REQUEST, 1, b"\x04echo" + bytes(range(256)) * 40),
          Frame(FrameType.PING, 3), Frame(FrameType.RESPONSE, 1, b"\xc0")]
    wire = b"".join(encode(f) for f in fs)
    dec = FrameDecoder()
    out: list[Frame] = []
    for i in range(len(wire)):
        dec.feed(wire[i : i + 1])
        f = dec.next_frame()
        if f is not None:
            out.append(f)
            # a frame comes out exactly when its last byte arrives
            assert sum(len(encode(g)) for g in out) == i + 1
    assert out == fs


def test_feeding_again_before_taking_frames_keeps_them_all() -> None:
    a, b = encode(Frame(FrameType.PING, 1, b"a")), encode(Frame(FrameType.PING, 3, b"b"))
    dec = FrameDecoder()
    dec.feed(a)
    dec.feed(b)
    assert [f.payload for f in dec.frames()] == [b"a", b"b"]


def test_frames_respects_a_limit() -> None:
    dec = FrameDecoder()
    dec.feed(b"".join(encode(Frame(FrameType.PING, 2 * i + 1)) for i in range(100)))
    assert len(dec.frames(64)) == 64
    assert len(dec.frames(64)) == 36


def _decode_all(wire: bytes) -> list[Frame]:
    dec = FrameDecoder()
    dec.feed(wire)
    out = dec.frames()
    dec.eof()
    return out


def test_a_flipped_bit_at_every_byte_position_is_detected() -> None:
    wire = encode(Frame(FrameType.RESPONSE, 12345, b"\x93\x01\xa3abc\xc4\x03xyz", flags=1))
    for pos in range(len(wire)):
        for bit in range(8):
            bad = bytearray(wire)
            bad[pos] ^= 1 << bit
            with pytest.raises(RemoteProtocolError):
                _decode_all(bytes(bad))
            with pytest.raises(RemoteProtocolError):
                decode_parts(bytes(bad[:HEADER_SIZE]), bytes(bad[HEADER_SIZE:]))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda w: b"XETH" + w[4:], "bad frame magic"),
        (lambda w: w[:4] + b"\x00\x02" + w[6:], "unsupported Aether version 2"),
        (lambda w: w[:-1] + bytes([w[-1] ^ 0xFF]), "CRC mismatch"),
        (lambda w: w[:-3], "closed in the middle of a frame"),
        (lambda w: w[:10], "closed in the middle of a frame"),
    ],
    ids=["magic", "version", "crc", "truncated-payload", "truncated-header"],
)
def test_bad_input_names_the_problem(mutate: object, message: str) -> None:
    wire = encode(Frame(FrameType.RESPONSE, 1, b"\xa5hello"))
    with pytest.raises(RemoteProtocolError, match=message):
        _decode_all(mutate(wire))  # type: ignore[operator]


def _with_type(ftype: int, payload: bytes = b"") -> bytes:
    head = encode_parts(2, 1, payload)[:21]
    head = head[:14] + bytes([ftype]) + head[15:]
    return head + zlib.crc32(payload, zlib.crc32(head)).to_bytes(4, "big") + payload


def test_unknown_frame_type_with_a_valid_crc_is_rejected() -> None:
    with pytest.raises(RemoteProtocolError, match="unknown frame type 99"):
        _decode_all(_with_type(99))
    with pytest.raises(RemoteProtocolError, match="unknown frame type 0"):
        decode_parts(_with_type(0)[:HEADER_SIZE], b"")


def test_oversize_frame_is_rejected_from_its_header_alone() -> None:
    dec = FrameDecoder(max_frame=1024)
    wire = encode(Frame(FrameType.REQUEST, 1, b"x" * 1025))
    dec.feed(wire[:HEADER_SIZE])  # payload never arrives: the header is enough
    with pytest.raises(RemoteProtocolError, match="1025 bytes exceeds the limit of 1024"):
        dec.next_frame()
    with pytest.raises(RemoteProtocolError):
        decode_parts(wire[:HEADER_SIZE], wire[HEADER_SIZE:], max_frame=1024)
    ok = FrameDecoder(max_frame=1024)
    ok.feed(encode(Frame(FrameType.REQUEST, 1, b"x" * 1024)))
    assert ok.next_frame() is not None


def test_a_poisoned_decoder_stays_poisoned() -> None:
    dec = FrameDecoder()
    dec.feed(b"GARBAGE-GARBAGE-GARBAGE-GARBAGE")
    with pytest.raises(RemoteProtocolError) as first:
        dec.next_frame()
    good = encode(Frame(FrameType.PING, 1))
    with pytest.raises(RemoteProtocolError) as again:
        dec.feed(good)
    assert again.value is first.value
    assert dec.error is first.value


def test_decode_parts_checks_part_lengths() -> None:
    wire = encode(Frame(FrameType.PING, 1, b"abc"))
    with pytest.raises(RemoteProtocolError, match="header is 24 bytes"):
        decode_parts(wire[:24], wire[24:])
    with pytest.raises(RemoteProtocolError, match="payload is 2 bytes, header says 3"):
        decode_parts(wire[:HEADER_SIZE], wire[HEADER_SIZE:-1])


def test_encoding_out_of_range_fields_is_our_error() -> None:
    with pytest.raises(LocalProtocolError, match="stream ids are u64"):
        encode_parts(FrameType.PING, 2**64, b"")
    with pytest.raises(LocalProtocolError):
        encode_parts(FrameType.PING, -1, b"")
    with pytest.raises(LocalProtocolError):
        encode_parts(FrameType.PING, 1, b"", flags=0x10000)


@settings(max_examples=200)
@given(st.binary(min_size=1, max_size=200))
def test_random_bytes_never_decode_as_a_frame(junk: bytes) -> None:
    dec = FrameDecoder()
    dec.feed(junk)
    try:
        out = dec.frames()
        dec.eof()
    except RemoteProtocolError:
        return
    assert out == []  # only possible when junk is empty, which min_size excludes
    raise AssertionError("junk was accepted")
