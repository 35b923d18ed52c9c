"""Aether frames: a sans-IO codec (no sockets, no asyncio).

Layout (network byte order), 25-byte header then ``length`` payload bytes::

    offset size field
    0      4    magic      b"AETH"
    4      2    version    1
    6      8    stream id  u64; dialer-initiated streams are odd, acceptor-initiated even,
                           0 is the connection itself (GOAWAY)
    14     1    type       FrameType
    15     4    length     u32 payload length
    19     2    flags      FrameFlags bits
    21     4    crc32      zlib.crc32 (IEEE 802.3) over header[0:21] then the payload

The CRC is computed incrementally over the two parts (``crc32(payload, crc32(head21))``)
so neither encoding nor decoding concatenates header and payload. docs/aether.md holds a
worked test vector.
"""

from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass

from dsec.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "DEFAULT_MAX_FRAME",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_FRAME_LIMIT",
    "VERSION",
    "Frame",
    "FrameDecoder",
    "FrameFlags",
    "FrameType",
    "decode_parts",
    "encode",
    "encode_parts",
]

MAGIC = b"AETH"
VERSION = 1
HEADER_SIZE = 25
DEFAULT_MAX_FRAME = 16 * 1024 * 1024
MAX_FRAME_LIMIT = 0xFFFFFFFF  # what the u32 length field can say

_HEAD = struct.Struct("!4sHQBIH")  # the 21 bytes the CRC covers first
_FULL = struct.Struct("!4sHQBIHI")
_CRC = struct.Struct("!I")
_crc32 = zlib.crc32


class FrameType(enum.IntEnum):
    REQUEST = 1    # payload: u8 method length, method (ascii), msgpack body
    RESPONSE = 2   # payload: msgpack body; ends the call
    ERROR = 3      # payload: msgpack ErrorBody; ends the call
    STREAM = 4     # payload: msgpack body; server-pushed data for a streaming call
    CANCEL = 5     # empty payload; the caller gave up on this stream id
    PING = 6       # opaque payload echoed in PONG
    PONG = 7
    GOAWAY = 8     # stream 0, payload: msgpack Goaway; no new calls on this connection
    WINDOW = 9     # payload: u32 credit increment for one duplex stream (see state.DuplexFlow)


class FrameFlags(enum.IntFlag):
    NONE = 0
    STREAMING = 0x1   # on REQUEST: the caller accepts STREAM frames before the final reply
    DUPLEX = 0x2      # on REQUEST: a duplex stream, raw bytes both ways under per-stream credit
    FIN = 0x4         # on STREAM of a duplex stream: the sender's last bytes (half-close)
    CREDIT = 0x8      # on a STREAMING REQUEST: the caller grants per-stream credit (WINDOW)


_TYPES = frozenset(int(t) for t in FrameType)

#: A decoded frame as the hot path sees it: (type, stream id, payload, flags). Plain
#: tuples because a FrameType member plus a frozen slotted dataclass cost ~0.6 us per
#: frame on the dev VM; a no-op call decodes two frames and costs ~4 us when pipelined.
RawFrame = tuple[int, int, bytes, int]


@dataclass(slots=True, frozen=True)
class Frame:
    type: FrameType
    stream_id: int
    payload: bytes = b""
    flags: int = 0


def encode_parts(
    ftype: int, stream_id: int, payload: bytes | bytearray | memoryview, flags: int = 0
) -> bytes:
    """The 25-byte header for ``payload``; write it followed by the payload itself."""
    try:
        head = _HEAD.pack(MAGIC, VERSION, stream_id, ftype, len(payload), flags)
    except struct.error as exc:
        raise LocalProtocolError(
            f"cannot encode frame type={ftype} stream={stream_id} flags={flags} with a "
            f"{len(payload)}-byte payload: {exc} (stream ids are u64, types u8, flags u16, "
            "payloads at most 4 GiB - 1)"
        ) from exc
    return head + _CRC.pack(_crc32(payload, _crc32(head)))


def encode(frame: Frame) -> bytes:
    """Header and payload as one bytes object (one copy of the payload)."""
    return encode_parts(frame.type, frame.stream_id, frame.payload, frame.flags) + frame.payload


_RAISE_MAX = "raise max_frame on both ends if this is intended"


def _bad_header(magic: bytes, version: int, length: int, max_frame: int,
                why: str = _RAISE_MAX) -> RemoteProtocolError:
    if magic != MAGIC:
        return RemoteProtocolError(
            f"bad frame magic {bytes(magic)!r}, expected {MAGIC!r}: the peer does not speak "
            "Aether or the stream lost sync")
    if version != VERSION:
        return RemoteProtocolError(
            f"unsupported Aether version {version}; this side speaks {VERSION}")
    return RemoteProtocolError(
        f"frame of {length} bytes exceeds the limit of {max_frame} bytes ({why})",
        size=length, max_frame=max_frame)


def decode_parts(
    header: bytes | bytearray | memoryview,
    payload: bytes | bytearray | memoryview,
    *,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> Frame:
    """Verify and decode a frame given its header and payload separately."""
    if len(header) != HEADER_SIZE:
        raise RemoteProtocolError(f"frame header is {len(header)} bytes, expected {HEADER_SIZE}")
    magic, version, stream_id, ftype, length, flags, crc = _FULL.unpack(header)
    if magic != MAGIC or version != VERSION or length > max_frame:
        raise _bad_header(magic, version, length, max_frame)
    if len(payload) != length:
        raise RemoteProtocolError(f"frame payload is {len(payload)} bytes, header says {length}")
    if _crc32(payload, _crc32(memoryview(header)[:21])) != crc:
        raise RemoteProtocolError(f"CRC mismatch on frame for stream {stream_id}: data corrupted")
    if ftype not in _TYPES:
        raise RemoteProtocolError(f"unknown frame type {ftype} on stream {stream_id}")
    return Frame(FrameType(ftype), stream_id, bytes(payload), flags)


class FrameDecoder:
    """Incremental decoder: ``feed`` bytes in any fragmentation, take whole frames out.

    Whole frames are sliced straight out of the bytes object that was fed (one copy of
    each payload); only a frame split across reads is gathered in a bytearray, converted
    once it is complete. An oversize length is rejected as soon as the header is in, before
    its payload is buffered.

    After a :class:`RemoteProtocolError` the decoder is poisoned: the byte stream cannot be
    resynchronised, so the connection must be closed.
    """

    __slots__ = ("_acc", "_buf", "_error", "_max", "_need", "_pos", "_why")

    def __init__(self, *, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self._buf = b""             # bytes being parsed
        self._pos = 0               # parse position in _buf
        self._acc = bytearray()     # an incomplete frame, gathered across feeds
        self._need = 0              # bytes _acc must hold before parsing is retried
        self._max = 0
        self._why = _RAISE_MAX      # what the oversize error tells the peer to change
        self._error: RemoteProtocolError | None = None
        self.set_max_frame(max_frame)

    def set_max_frame(self, max_frame: int, why: str = _RAISE_MAX) -> None:
        """Change the payload limit for frames whose header has not arrived yet (a
        listener lifts its small pre-authentication limit this way); ``why`` goes into
        the error for a frame over it."""
        if not 0 <= max_frame <= MAX_FRAME_LIMIT:
            raise ValueError(f"max_frame must be 0..{MAX_FRAME_LIMIT} bytes, got {max_frame}")
        self._max = max_frame
        self._why = why

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as frames."""
        return len(self._buf) - self._pos + len(self._acc)

    @property
    def partial(self) -> bool:
        """Part of a frame is in, the rest is awaited from the peer."""
        return bool(self._acc)

    def release(self) -> None:
        """Drop every buffered byte now (the connection is closed): a partial 16 MiB frame
        must not wait for the cyclic garbage collector to be freed."""
        self._buf, self._pos, self._acc, self._need = b"", 0, bytearray(), 0

    @property
    def error(self) -> RemoteProtocolError | None:
        """The error that poisoned this decoder, if any."""
        return self._error

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._error is not None:
            raise self._error
        acc = self._acc
        if acc:
            acc += data
            if len(acc) >= self._need:
                self._buf, self._pos = bytes(acc), 0
                acc.clear()
        elif self._pos < len(self._buf):  # fed again before the frames were taken out
            self._buf, self._pos = self._buf[self._pos :] + bytes(data), 0
        else:
            self._buf, self._pos = (data if type(data) is bytes else bytes(data)), 0

    def next_type(self) -> int | None:
        """The type byte of the next frame, once its header is in (None before)."""
        if self._acc:
            return self._acc[14] if len(self._acc) > 14 else None
        if len(self._buf) - self._pos > 14:
            return self._buf[self._pos + 14]
        return None

    def next_raw(self) -> RawFrame | None:
        """The next complete frame as ``(type, stream_id, payload, flags)``, or None."""
        if self._error is not None:
            raise self._error
        buf, pos = self._buf, self._pos
        avail = len(buf) - pos
        if avail < HEADER_SIZE:
            if avail:
                self._stash(HEADER_SIZE)
            return None
        magic, version, sid, ftype, length, flags, crc = _FULL.unpack_from(buf, pos)
        if magic != MAGIC or version != VERSION or length > self._max:
            self._error = _bad_header(magic, version, length, self._max, self._why)
            raise self._error
        start = pos + HEADER_SIZE
        end = start + length
        if end > len(buf):
            self._stash(HEADER_SIZE + length)
            return None
        payload = buf[start:end]
        if _crc32(payload, _crc32(buf[pos : pos + 21])) != crc:
            self._error = RemoteProtocolError(
                f"CRC mismatch on frame for stream {sid}: data corrupted")
            raise self._error
        if ftype not in _TYPES:
            self._error = RemoteProtocolError(f"unknown frame type {ftype} on stream {sid}")
            raise self._error
        self._pos = end
        return ftype, sid, payload, flags

    def next_frame(self) -> Frame | None:
        """The next complete frame, or None if more bytes are needed."""
        raw = self.next_raw()
        if raw is None:
            return None
        return Frame(FrameType(raw[0]), raw[1], raw[2], raw[3])

    def frames(self, limit: int | None = None) -> list[Frame]:
        """Up to ``limit`` complete frames (all when None)."""
        out: list[Frame] = []
        while limit is None or len(out) < limit:
            f = self.next_frame()
            if f is None:
                break
            out.append(f)
        return out

    def eof(self) -> None:
        """The peer closed: raise if it left part of a frame behind."""
        if self._error is None and self.buffered:
            self._error = RemoteProtocolError(
                f"connection closed in the middle of a frame ({self.buffered} bytes of an "
                "incomplete frame pending)")
        if self._error is not None:
            raise self._error

    def _stash(self, need: int) -> None:
        # Keep the tail of a frame split across reads; parsing resumes once `need` bytes
        # are in, so a frame fed one byte at a time costs O(size), not O(size**2).
        self._acc += memoryview(self._buf)[self._pos :]
        self._buf, self._pos, self._need = b"", 0, need
