"""Protocol-level Aether bodies and the request payload layout.

Method bodies are msgspec msgpack structs defined next to the service that owns them
(e.g. ``dsec.edge.protocol``); this module holds what the protocol itself needs. Large
byte payloads travel as msgpack ``bin`` (raw bytes), never base64.
"""

from __future__ import annotations

from typing import Any

import msgspec

from dsec.errors import DsecError, LocalProtocolError, RemoteProtocolError

__all__ = [
    "ErrorBody",
    "Goaway",
    "decode_request",
    "encode_request",
    "error_body",
]

MAX_METHOD_LEN = 255


class ErrorBody(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Payload of an ERROR frame; ``code`` maps back to a :class:`DsecError` subclass."""

    code: str
    message: str
    detail: dict[str, Any] = {}


class Goaway(msgspec.Struct, kw_only=True, omit_defaults=True):
    reason: str = ""


def error_body(exc: BaseException) -> ErrorBody:
    if isinstance(exc, DsecError):
        detail = {k: v for k, v in exc.detail.items() if _wire_safe(v)}
        return ErrorBody(code=exc.code, message=exc.message, detail=detail)
    # Not one of ours: a bug in a handler. Say what, not where (no stack trace on the wire).
    return ErrorBody(code="internal_error", message=f"{type(exc).__name__}: {exc}")


def _wire_safe(v: Any) -> bool:
    return isinstance(v, (str, int, float, bool, type(None), list, dict, tuple))


def encode_request(method: str, body: bytes) -> bytes:
    """REQUEST payload: u8 method length, ascii method, then the msgpack body."""
    m = method.encode("ascii")
    if not 0 < len(m) <= MAX_METHOD_LEN:
        raise LocalProtocolError(f"method name {method!r} must be 1..255 ascii bytes")
    return bytes((len(m),)) + m + body


def decode_request(payload: bytes) -> tuple[str, memoryview]:
    if not payload:
        raise RemoteProtocolError("empty REQUEST payload: no method name")
    n = payload[0]
    if n == 0 or len(payload) < 1 + n:
        raise RemoteProtocolError(f"REQUEST payload too short for a {n}-byte method name")
    try:
        method = payload[1 : 1 + n].decode("ascii")
    except UnicodeDecodeError as exc:
        raise RemoteProtocolError("REQUEST method name is not ascii") from exc
    return method, memoryview(payload)[1 + n :]
