"""Protocol-level Aether bodies and the request payload layout.

Method bodies are msgspec msgpack structs of the shared vocabulary (:mod:`dsec.wire`);
this module holds what the protocol itself needs (the ERROR payload, :class:`ErrorBody`,
lives in :mod:`dsec.wire.outcome` because batch items carry it too). Large
byte payloads travel as msgpack ``bin`` (raw bytes), never base64.
"""

from __future__ import annotations

import msgspec

from dsec.errors import LocalProtocolError, RemoteProtocolError
from dsec.wire.outcome import ErrorBody, error_body

__all__ = [
    "MAX_METHOD_LEN",
    "ErrorBody",
    "Goaway",
    "decode_request",
    "encode_request",
    "error_body",
    "method_prefix",
]

MAX_METHOD_LEN = 255


class Goaway(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Payload of a GOAWAY frame (stream 0): the sender starts no handler for a request
    on a stream id above ``last_stream_id``; the receiver fails those calls at once with a
    retryable ConnectionLost and opens no new calls on this connection.

    ``code`` (optional) names the :mod:`dsec.errors` class those calls fail with instead,
    e.g. ``overloaded`` when a listener refuses a connection at its limits."""

    reason: str = ""
    last_stream_id: int = 0
    code: str = ""


def method_prefix(method: str) -> bytes:
    """The REQUEST payload prefix for ``method``: u8 length, then the ascii name."""
    try:
        m = method.encode("ascii")
    except UnicodeEncodeError:
        m = b""
    if not 0 < len(m) <= MAX_METHOD_LEN or not method.isprintable():
        raise LocalProtocolError(
            f"method name {method!r} must be 1..{MAX_METHOD_LEN} printable ascii characters")
    return bytes((len(m),)) + m


def encode_request(method: str, body: bytes) -> bytes:
    """REQUEST payload: u8 method length, ascii method, then the msgpack body."""
    return method_prefix(method) + body


def decode_request(payload: bytes) -> tuple[str, memoryview]:
    """Split a REQUEST payload into the method name and a view of the msgpack body."""
    if not payload:
        raise RemoteProtocolError("empty REQUEST payload: no method name")
    n = payload[0]
    if n == 0 or len(payload) < 1 + n:
        raise RemoteProtocolError(
            f"REQUEST payload of {len(payload)} bytes is too short for a {n}-byte method name")
    try:
        method = payload[1 : 1 + n].decode("ascii")
    except UnicodeDecodeError as exc:
        raise RemoteProtocolError("REQUEST method name is not ascii") from exc
    return method, memoryview(payload)[1 + n :]
