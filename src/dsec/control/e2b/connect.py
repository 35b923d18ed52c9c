"""Connect-RPC with the JSON codec, as E2B's envd speaks it (pure: no I/O).

The stock ``e2b`` SDK calls envd's ``process.Process`` and ``filesystem.Filesystem``
services through ``connectrpc`` with a JSON codec (``e2b.envd.client_shared``):

- a **unary** call is ``POST /<service>/<Method>`` with ``Content-Type:
  application/json`` and the request message as the whole body; the answer is ``200``
  with the reply message, or an error status with ``{"code": "<connect code>",
  "message": ...}`` (the code names the status, :data:`HTTP_STATUS`);
- a **server-streaming** call sends ``Content-Type: application/connect+json`` and the
  request in one *envelope*: a 5-byte header (1 flag byte, a 4-byte big-endian length)
  then the JSON message. The answer is ``200`` with envelopes of reply messages (flag 0)
  and exactly one *end-of-stream* envelope last (flag ``0x02``): ``{}`` or ``{"error":
  {"code", "message"}}``; an error inside a stream never changes the HTTP status.

Protobuf's JSON mapping gives the field names (lowerCamelCase), ``bytes`` as base64,
enums by name (``"SIGNAL_SIGKILL"``) and 64-bit integers as strings.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import msgspec

from dsec.errors import DsecError, InvalidArgument

__all__ = ["END_OK", "END_STREAM", "HTTP_STATUS", "code_of", "data_event",
           "decode_envelope", "end_stream", "envelope", "error_body", "frame"]

END_STREAM = 0x02
_COMPRESSED = 0x01
_HEADER = struct.Struct(">BI")

#: Connect error code -> HTTP status of a unary error answer (the Connect protocol's
#: table; ``e2b.envd.client_shared.PLAIN_HTTP_ERROR_CODES`` is its inverse).
HTTP_STATUS: dict[str, int] = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504,
    "not_found": 404, "already_exists": 409, "permission_denied": 403,
    "resource_exhausted": 429, "failed_precondition": 400, "aborted": 409,
    "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
    "data_loss": 500, "unauthenticated": 401,
}

# dsec HTTP status -> Connect code (the SDK maps codes to its exception classes:
# NOT_FOUND -> NotFoundException, INVALID_ARGUMENT -> InvalidArgumentException, ...).
_BY_STATUS: dict[int, str] = {
    400: "invalid_argument", 401: "unauthenticated", 403: "permission_denied",
    404: "not_found", 405: "unimplemented", 408: "deadline_exceeded",
    409: "failed_precondition", 413: "resource_exhausted", 429: "resource_exhausted",
    501: "unimplemented", 503: "unavailable", 504: "deadline_exceeded",
}


def code_of(exc: DsecError) -> str:
    """The Connect code of a dsec error (by its HTTP status; ``internal`` otherwise)."""
    return _BY_STATUS.get(exc.http_status, "internal")


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"code": code, "message": message}


_encode = msgspec.json.Encoder().encode


def frame(data: bytes, flags: int = 0) -> bytes:
    """One envelope of an already encoded JSON message ``data``."""
    return _HEADER.pack(flags, len(data)) + data


def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    """One envelope: the 5-byte header and ``message`` as compact JSON (msgspec: UTF-8,
    no ``\\u`` escapes; any JSON parser reads it as ``json.dumps``' output). A string
    msgspec cannot write as UTF-8 (a lone surrogate: a file name that is not UTF-8,
    decoded with ``surrogateescape``) goes through ``json.dumps``, which escapes it."""
    try:
        data = _encode(message)
    except UnicodeEncodeError:
        data = json.dumps(message, separators=(",", ":")).encode()
    return frame(data, flags)


def data_event(stream: str, b64: bytes) -> bytes:
    """A process ``DataEvent`` envelope: ``{"event":{"data":{stream: b64}}}``, built by
    concatenation (``stream`` is ``stdout``, ``stderr`` or ``pty``; ``b64`` base64,
    which JSON needs no escaping of)."""
    return frame(b'{"event":{"data":{"' + stream.encode() + b'":"' + b64 + b'"}}}')


#: The end-of-stream envelope of a stream that ended well (``{}``).
END_OK = frame(b"{}", END_STREAM)


def end_stream(error: tuple[str, str] | None = None) -> bytes:
    """The end-of-stream envelope: ``{}``, or the error ``(code, message)``."""
    if error is None:
        return END_OK
    return envelope({"error": error_body(*error)}, END_STREAM)


def decode_envelope(body: bytes, *, limit: int) -> dict[str, Any]:
    """The one request message of a server-streaming call's body (one envelope)."""
    if len(body) < _HEADER.size:
        raise InvalidArgument(f"a Connect streaming request is one enveloped message: "
                              f"got {len(body)} bytes, less than the 5-byte header")
    flags, n = _HEADER.unpack_from(body)
    if flags & _COMPRESSED:
        raise InvalidArgument("compressed Connect messages are not accepted: send "
                              "identity-encoded envelopes")
    if n > limit or len(body) != _HEADER.size + n:
        raise InvalidArgument(f"the request envelope says {n} bytes, the body holds "
                              f"{len(body) - _HEADER.size} (limit {limit})")
    return parse_message(body[_HEADER.size:])


_decode = msgspec.json.Decoder().decode


def parse_message(raw: bytes) -> dict[str, Any]:
    try:
        msg = _decode(raw) if raw else {}
    except msgspec.DecodeError:
        # what msgspec does not take (UTF-16/32 JSON, ...) is json's to accept or
        # refuse, with its message
        try:
            msg = json.loads(raw)
        except ValueError as exc:
            raise InvalidArgument(f"the request message is not JSON: {exc}") from None
    if not isinstance(msg, dict):
        raise InvalidArgument("the request message must be a JSON object")
    return msg
