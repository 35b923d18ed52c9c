"""Aether frames: a sans-IO codec (no sockets, no asyncio).

Layout (network byte order), 25-byte header then ``length`` payload bytes::

    offset size field
    0      4    magic      b"AETH"
    4      2    version    1
    6      8    stream id  u64; client-initiated streams are odd, server-initiated even
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

_HEAD = struct.Struct("!4sHQBIH")  # the 21 bytes the CRC covers first
_FULL = struct.Struct("!4sHQBIHI")
_CRC = struct.Struct("!I")
_STREAM_MAX = (1 << 64) - 1


class FrameType(enum.IntEnum):
    REQUEST = 1    # payload: u8 method length, method (ascii), msgpack body
    RESPONSE = 2   # payload: msgpack body; ends the call
    ERROR = 3      # payload: msgpack ErrorBody; ends the call
    STREAM = 4     # payload: msgpack body; server-pushed data for a streaming call
    CANCEL = 5     # empty payload; the caller gave up on this stream id
    PING = 6       # opaque payload echoed in PONG
    PONG = 7
    GOAWAY = 8     # payload: msgpack Goaway; no new calls on this connection


class FrameFlags(enum.IntFlag):
    NONE = 0
    STREAMING = 0x1   # on REQUEST: the caller accepts STREAM frames before the final reply


_TYPES = frozenset(int(t) for t in FrameType)


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
    if not 0 <= stream_id <= _STREAM_MAX:
        raise LocalProtocolError(f"stream id {stream_id} is outside 0..2**64-1")
    n = len(payload)
    if n > 0xFFFFFFFF:
        raise LocalProtocolError(f"payload of {n} bytes exceeds the 4 GiB frame length field")
    try:
        head = _HEAD.pack(MAGIC, VERSION, stream_id, ftype, n, flags)
    except struct.error as exc:
        raise LocalProtocolError(f"cannot encode frame type={ftype} flags={flags}: {exc}") from exc
    return head + _CRC.pack(zlib.crc32(payload, zlib.crc32(head)))


def encode(frame: Frame) -> bytes:
    """Header and payload as one bytes object (one copy of the payload)."""
    return encode_parts(frame.type, frame.stream_id, frame.payload, frame.flags) + frame.payload


def _check_header(
    header: bytes | bytearray | memoryview, max_frame: int, offset: int = 0
) -> tuple[int, int, int, int, int]:
    magic, version, stream_id, ftype, length, flags, crc = _FULL.unpack_from(header, offset)
    if magic != MAGIC:
        raise RemoteProtocolError(f"bad frame magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise RemoteProtocolError(f"unsupported Aether version {version}; this side speaks {VERSION}")
    if length > max_frame:
        raise RemoteProtocolError(
            f"frame of {length} bytes exceeds the limit of {max_frame} bytes "
            "(raise max_frame on both ends if this is intended)"
        )
    return stream_id, ftype, length, flags, crc


def decode_parts(
    header: bytes | bytearray | memoryview,
    payload: bytes | bytearray | memoryview,
    *,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> Frame:
    """Verify and decode a frame given its header and payload separately."""
    if len(header) != HEADER_SIZE:
        raise RemoteProtocolError(f"frame header is {len(header)} bytes, expected {HEADER_SIZE}")
    stream_id, ftype, length, flags, crc = _check_header(header, max_frame)
    if len(payload) != length:
        raise RemoteProtocolError(f"frame payload is {len(payload)} bytes, header says {length}")
    if zlib.crc32(payload, zlib.crc32(header[:21])) != crc:
        raise RemoteProtocolError(f"CRC mismatch on frame for stream {stream_id}: data corrupted")
    if ftype not in _TYPES:
        raise RemoteProtocolError(f"unknown frame type {ftype} on stream {stream_id}")
    return Frame(FrameType(ftype), stream_id, bytes(payload), flags)


class FrameDecoder:
    """Incremental decoder: ``feed`` bytes in any fragmentation, take whole frames out.

    After a :class:`RemoteProtocolError` the decoder is poisoned: the stream cannot be
    resynchronised, so the connection must be closed.
    """

    __slots__ = ("_buf", "_pos", "_max", "_error")

    def __init__(self, *, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._max = max_frame
        self._error: RemoteProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as frames."""
        return len(self._buf) - self._pos

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._error is not None:
            raise self._error
        if self._pos and self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        self._buf += data

    def next_frame(self) -> Frame | None:
        """The next complete frame, or None if more bytes are needed."""
        if self._error is not None:
            raise self._error
        buf, pos = self._buf, self._pos
        if len(buf) - pos < HEADER_SIZE:
            self._compact()
            return None
        try:
            stream_id, ftype, length, flags, crc = _check_header(buf, self._max, pos)
        except RemoteProtocolError as exc:
            self._error = exc
            raise
        end = pos + HEADER_SIZE + length
        if len(buf) < end:
            self._compact()
            return None
        view = memoryview(buf)
        try:
            payload = bytes(view[pos + HEADER_SIZE : end])
            c = zlib.crc32(payload, zlib.crc32(view[pos : pos + 21]))
        finally:
            view.release()
        if c != crc:
            self._error = RemoteProtocolError(
                f"CRC mismatch on frame for stream {stream_id}: data corrupted"
            )
            raise self._error
        if ftype not in _TYPES:
            self._error = RemoteProtocolError(f"unknown frame type {ftype} on stream {stream_id}")
            raise self._error
        self._pos = end
        return Frame(FrameType(ftype), stream_id, payload, flags)

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
        """The peer closed: raise if it left half a frame behind."""
        if self.buffered:
            raise RemoteProtocolError(
                f"connection closed in the middle of a frame ({self.buffered} bytes pending)"
            )

    def _compact(self) -> None:
        # Drop consumed bytes only when waiting for more, so a burst of small frames
        # costs one memmove per feed, not one per frame.
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
