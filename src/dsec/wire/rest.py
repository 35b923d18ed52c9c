"""The REST form of a catalogue row's request and reply, from its :class:`~dsec.wire.ops.Rest`
binding: the SDK's HTTP transport builds every request here (method, path, query,
headers, body) and reads every answer here, so no operation is spelled out a second time
on the client. Pure: no I/O.

A request's fields go where the row says: ``{name}`` in the path, ``query`` parameters
(a list repeats its parameter, a ``dict[str, str]`` repeats it as ``key=value``, booleans
are ``true``/``false``), ``headers``, and the body: ``"*"`` (the other fields as one JSON
object), one named field (raw bytes for a ``bytes`` field, its JSON form for an
:class:`~dsec.wire.spec.ExecRequest`, else its JSON with every field written out, so a
field at its default is not mistaken for one left to the server), or none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import msgspec

from dsec.errors import RemoteProtocolError
from dsec.wire.api import ExecOutput
from dsec.wire.jsonform import exec_body, exec_result
from dsec.wire.ops import Op, path_params
from dsec.wire.spec import ExecRequest, ExecResult

__all__ = ["RestRequest", "decode_reply", "encode_request"]

_json = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class RestRequest:
    """One HTTP request: what ``httpx.request`` takes."""

    method: str
    path: str
    params: list[tuple[str, str]] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    content: bytes | None = None


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _query(name: str, v: Any) -> list[tuple[str, str]]:
    if v is None:
        return []
    if isinstance(v, Mapping):
        return [(name, f"{k}={val}") for k, val in v.items()]
    if isinstance(v, (list, tuple)):
        return [(name, _scalar(x)) for x in v]
    return [(name, _scalar(v))]


def encode_request(op: Op[Any, Any], body: Any) -> RestRequest:
    """The HTTP request of ``op`` with request object ``body``."""
    rest = op.rest
    if rest is None:
        raise RemoteProtocolError(f"operation {op.name!r} has no REST binding")
    fields = {f: getattr(body, f) for f in type(body).__struct_fields__}
    path = rest.path
    for name in path_params(rest.path):
        text = str(fields.pop(name))
        slashes = "{" + name + ":path}" in path
        path = path.replace("{" + name + (":path}" if slashes else "}"),
                            quote(text, safe="/:" if slashes else ":"))
    params: list[tuple[str, str]] = []
    for name, param in rest.query.items():
        params += _query(param, fields.pop(name))
    headers: dict[str, str] = {}
    for name, header in rest.headers.items():
        given = fields.pop(name)
        if given is not None:
            headers[header] = _scalar(given)
    content: bytes | None = None
    if rest.body == "*":
        content = _json.encode(fields)
        headers["content-type"] = "application/json"
    elif rest.body is not None:
        value: Any = fields.pop(rest.body)
        if isinstance(value, bytes):
            content = value
            headers["content-type"] = "application/octet-stream"
        else:
            if isinstance(value, ExecRequest):
                value = exec_body(value)
            elif isinstance(value, msgspec.Struct):
                value = msgspec.structs.asdict(value)     # every field written out
            content = _json.encode(value)
            headers["content-type"] = "application/json"
    return RestRequest(method=rest.method, path=path, params=params, headers=headers,
                       content=content)


def decode_reply(op: Op[Any, Any], content: bytes) -> Any:
    """The reply of ``op`` from its HTTP answer's body (a 2xx)."""
    rest = op.rest
    assert rest is not None
    if rest.reply == "empty":
        return None
    if rest.reply == "raw":
        return content
    try:
        if op.reply is ExecResult:
            return exec_result(msgspec.json.decode(content, type=ExecOutput))
        return msgspec.json.decode(content, type=op.reply)
    except msgspec.DecodeError as exc:     # ValidationError included
        raise RemoteProtocolError(f"{rest.method} {rest.path}: the answer does not decode "
                                  f"as {getattr(op.reply, '__name__', op.reply)}: "
                                  f"{exc}") from exc
