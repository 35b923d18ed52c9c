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

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import msgspec

from dsec.errors import DsecError, InvalidArgument, RemoteProtocolError
from dsec.wire.api import ExecBody, ExecOutput
from dsec.wire.jsonform import (
    carries_exec,
    exec_body,
    exec_request,
    exec_result,
    from_json,
    json_form,
)
from dsec.wire.ops import Op, path_params
from dsec.wire.outcome import undecodable
from dsec.wire.spec import ExecRequest, ExecResult

__all__ = ["RestRequest", "decode_reply", "decode_request", "encode_request", "query_fields"]

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
        content = _json.encode(json_form(fields))
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
        if carries_exec(op.reply):      # a batch of exec results: each in the exec form
            return from_json(msgspec.json.decode(content), op.reply)
        return msgspec.json.decode(content, type=op.reply)
    except (msgspec.DecodeError, InvalidArgument) as exc:     # ValidationError included
        raise RemoteProtocolError(f"{rest.method} {rest.path}: the answer does not decode "
                                  f"as {getattr(op.reply, '__name__', op.reply)}: "
                                  f"{exc}") from exc


# ------------------------------------------------------------------ the server's side
_TRUE = frozenset({"1", "true", "yes"})
_FALSE = frozenset({"0", "false", "no", ""})
_field_types: dict[type, dict[str, msgspec.inspect.Type]] = {}


def _fields_of(tp: type) -> dict[str, msgspec.inspect.Type]:
    """The request type's fields and their types (computed once per type)."""
    got = _field_types.get(tp)
    if got is None:
        info = msgspec.inspect.type_info(tp)
        assert isinstance(info, msgspec.inspect.StructType)
        got = _field_types[tp] = {f.name: f.type for f in info.fields}
    return got


def query_fields(op: Op[Any, Any]) -> dict[str, msgspec.inspect.Type]:
    """The request fields ``op`` carries as query parameters, by parameter name."""
    assert op.rest is not None
    types = _fields_of(op.request)
    return {param: types[name] for name, param in op.rest.query.items()}


def _scalar_type(t: msgspec.inspect.Type) -> msgspec.inspect.Type:
    """``X | None`` -> ``X`` (a query parameter left out is the field's default)."""
    if isinstance(t, msgspec.inspect.UnionType):
        rest = [u for u in t.types if not isinstance(u, msgspec.inspect.NoneType)]
        if len(rest) == 1:
            return rest[0]
    return t


def _parse(param: str, t: msgspec.inspect.Type, text: str) -> Any:
    """One query parameter's text as its field's type; a refusal names the parameter."""
    t = _scalar_type(t)
    if isinstance(t, msgspec.inspect.BoolType):
        v = text.lower()
        if v in _TRUE or v in _FALSE:
            return v in _TRUE
        raise InvalidArgument(f"query parameter {param}={text[:20]!r} must be true or false",
                              field=param)
    if isinstance(t, msgspec.inspect.IntType):
        try:
            n = int(text)
        except ValueError:
            raise InvalidArgument(f"query parameter {param}={text[:40]!r} must be an integer",
                                  field=param) from None
        if not -(1 << 62) <= n <= 1 << 62:     # a 64-bit int; the range is the type's
            raise InvalidArgument(f"query parameter {param}={n} is out of range",
                                  field=param)
        return n
    if isinstance(t, msgspec.inspect.FloatType):
        try:
            return float(text)
        except ValueError:
            raise InvalidArgument(f"query parameter {param}={text[:20]!r} must be a number",
                                  field=param) from None
    return text                                 # str, a Literal: the type checks it


def decode_request(op: Op[Any, Any], path: Mapping[str, str],
                   query: list[tuple[str, str]], headers: Mapping[str, str],
                   body: bytes | None) -> Any:
    """``op``'s request from an HTTP request, as its row's :class:`Rest` binding lays it
    out (the inverse of :func:`encode_request`): path parameters, query parameters
    (refused by name when the row does not name them), headers and the body. The
    request type's own checks run (``__post_init__``) and answer unchanged; what
    msgspec refuses is worded as at every door (:func:`undecodable`)."""
    rest = op.rest
    assert rest is not None
    # path parameters as their fields' types (``{port}`` is an int: port_close)
    names = path_params(rest.path)
    fields = _fields_of(op.request) if names else {}
    given: dict[str, Any] = {name: _parse(name, fields[name], path[name]) for name in names}
    if query:
        by_param = {param: name for name, param in rest.query.items()}
        types = _fields_of(op.request)
        for param, text in query:
            name = by_param.get(param)
            if name is None:
                takes = ", ".join(sorted(by_param)) or "none"
                raise InvalidArgument(f"unknown query parameter {param[:60]!r} for the "
                                      f"{op.name} request (it takes: {takes})",
                                      field=param[:60])
            t = _scalar_type(types[name])
            if isinstance(t, msgspec.inspect.DictType):
                k, sep, v = text.partition("=")
                if not sep or not k:
                    raise InvalidArgument(f"query parameter {param} {text[:60]!r} must be "
                                          "key=value", field=param)
                given.setdefault(name, {})[k] = v
            elif isinstance(t, (msgspec.inspect.ListType, msgspec.inspect.VarTupleType)):
                given.setdefault(name, []).append(_parse(param, t.item_type, text))
            else:
                given[name] = _parse(param, t, text)
    for name, header in rest.headers.items():
        value = headers.get(header)
        if value is not None:
            given[name] = value
    if rest.body is not None:
        if rest.body == "*":
            exec_inside = carries_exec(op.request)
            if not given and not exec_inside:
                # the whole request is the body: decoded once, as itself
                return _json_body(op, body or b"", op.request, "")
            # an exec request inside (a batch's items) is read in the exec JSON form, as
            # /exec reads it (from_json below)
            given.update(_json_body(op, body or b"", dict[str, Any], ""))
        else:
            t = _fields_of(op.request)[rest.body]
            if isinstance(t, msgspec.inspect.BytesType):
                given[rest.body] = body or b""
            elif getattr(t, "cls", None) is ExecRequest:
                given[rest.body] = exec_request(_json_body(op, body or b"", ExecBody,
                                                           rest.body))
            else:
                given[rest.body] = _json_body(op, body or b"", Any, rest.body)
    try:
        return from_json(given, op.request)
    except msgspec.ValidationError as exc:
        if isinstance(exc.__cause__, DsecError):
            raise exc.__cause__ from None
        raise undecodable(op.name, exc) from None


_body_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}
_any_json = msgspec.json.Decoder()
# Integers every door carries: msgpack (Aether, the edge's journal) holds at most 64 bits.
# msgspec's JSON decoder takes any integer, so one beyond 64 bits used to pass REST's
# decode and fail when re-encoded for the edge (edge_unreachable, a retryable 503).
INT_MIN = -(2**63)
INT_MAX = 2**64 - 1
# A JSON integer outside int64 has at least 19 digits; a body without such a run (the
# usual case: one C-speed scan, ~1 us per KiB) is decoded straight into its type.
_LONG_DIGITS = re.compile(rb"[0-9]{19}")


def check_ints(value: Any, at: str = "") -> None:
    """Refuse (:class:`InvalidArgument`, naming the field) an integer anywhere in
    decoded JSON data ``value`` that msgpack cannot carry (below -2**63 or above
    2**64 - 1); a tighter bound of a field is its type's to check, in its own words, the
    same at every door."""
    stack: list[tuple[Any, str]] = [(value, at)]
    while stack:
        v, where = stack.pop()
        if isinstance(v, bool):
            continue
        if isinstance(v, int):
            if not INT_MIN <= v <= INT_MAX:
                name = where or "body"
                raise InvalidArgument(f"{name}={str(v)[:40]} is out of range: integers are "
                                      f"within {INT_MIN}..{INT_MAX} (64 bits, what every "
                                      "door carries)", field=name, limit=INT_MAX)
        elif isinstance(v, dict):
            stack.extend((x, f"{where}.{k}" if where else str(k)) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((x, f"{where}[{i}]") for i, x in enumerate(v))


def decode_json(raw: bytes, tp: Any = Any, *, what: str = "request body") -> Any:
    """JSON ``raw`` as ``tp``: the one JSON decode of a request at the apiserver (the
    generic route and the by-hand ones). Malformed or too deeply nested JSON
    (``RecursionError`` inside msgspec) and integers beyond 64 bits are refused as
    :class:`InvalidArgument`; msgspec's ``ValidationError`` is left to the caller (it
    words it per operation)."""
    try:
        if _LONG_DIGITS.search(raw) is not None:
            data = _any_json.decode(raw)
            check_ints(data)
            return data if tp is Any else msgspec.convert(data, tp)
        dec = _body_decoders.get(tp)
        if dec is None:
            dec = _body_decoders[tp] = msgspec.json.Decoder(tp)
        return dec.decode(raw)
    except msgspec.ValidationError:
        raise
    except msgspec.DecodeError as exc:
        raise InvalidArgument(f"malformed JSON {what}: {exc}") from None
    except RecursionError:
        raise InvalidArgument(f"the JSON {what} is nested too deeply; nest at most a few "
                              "levels (a request is a flat object of fields)") from None


def _json_body(op: Op[Any, Any], raw: bytes, tp: Any, at: str) -> Any:
    """A JSON body as ``tp`` (Any: plain data, decoded with the request below)."""
    if not raw:
        raise InvalidArgument(f"empty request body: send the {op.name} request's JSON "
                              f"{at or 'object'}")
    try:
        return decode_json(raw, tp, what="body")
    except msgspec.ValidationError as exc:
        if isinstance(exc.__cause__, DsecError):
            raise exc.__cause__ from None
        raise undecodable(op.name, exc, at=at) from None
