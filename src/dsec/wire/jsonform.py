"""The JSON forms of records that carry bytes: one codec for the server and the SDK.

msgpack (the Aether doors) carries bytes as bytes. JSON (REST) cannot, so an exec's stdin
and output travel as text: UTF-8 when the bytes decode, else base64 with
``encoding: "base64"``. These functions are that conversion, both ways; the apiserver
and :class:`~dsec.client.transport.HttpTransport` use the same ones, so the two ends
cannot disagree (``tests/wire/test_jsonform.py`` round-trips arbitrary bytes through
them). Pure: no I/O.
"""

from __future__ import annotations

import base64
from typing import Any

import msgspec

from dsec.errors import InvalidArgument, error_from_wire
from dsec.wire.api import Encoding, ExecBody, ExecOutput, ExecStreamLine
from dsec.wire.process import ProcessRunItem, ProcessRunLine
from dsec.wire.spec import MAX_STDIN_BYTES, ExecChunk, ExecRequest, ExecResult

__all__ = [
    "carries_exec",
    "exec_body",
    "exec_output",
    "exec_request",
    "exec_result",
    "from_json",
    "from_text",
    "json_form",
    "run_item",
    "run_line",
    "stream_item",
    "stream_line",
    "text_or_base64",
]


def text_or_base64(data: bytes) -> tuple[str, Encoding]:
    """``data`` as JSON text: itself when it is UTF-8, else its base64."""
    try:
        return data.decode(), "utf-8"
    except UnicodeDecodeError:
        return base64.b64encode(data).decode(), "base64"


def from_text(text: str, encoding: Encoding, *, field: str) -> bytes:
    """The bytes a JSON text stands for (the inverse of :func:`text_or_base64`)."""
    if encoding == "base64":
        try:
            return base64.b64decode(text, validate=True)
        except ValueError:
            raise InvalidArgument(f"{field} is not valid base64 ({field}_encoding="
                                  "'base64')", field=field) from None
    try:
        return text.encode()
    except UnicodeEncodeError:
        raise InvalidArgument(f"exec {field} is not valid Unicode text (send bytes with "
                              f"{field}_encoding='base64')", field=field) from None


# ----------------------------------------------------------------------- exec
def exec_body(req: ExecRequest) -> ExecBody:
    """An :class:`ExecRequest` as the JSON body of ``POST .../exec`` (the SDK's side)."""
    stdin, enc = text_or_base64(req.stdin) if req.stdin else ("", "utf-8")
    return ExecBody(argv=None if req.shell is not None else list(req.argv), shell=req.shell,
                    env=dict(req.env), cwd=req.cwd, user=req.user, stdin=stdin,
                    stdin_encoding=enc, timeout_s=req.timeout_s,
                    output_cap_bytes=req.output_cap_bytes, background=req.background,
                    hide=list(req.hide), pty=req.pty, stdin_open=req.stdin_open,
                    tag=req.tag)


def exec_request(body: ExecBody) -> ExecRequest:
    """The :class:`ExecRequest` a REST exec body stands for (the server's side), checked
    by :meth:`ExecRequest.validate` (the same limits and words as every other door).
    Base64 stdin is bounded before it is decoded."""
    if body.stdin_encoding == "base64" and len(body.stdin) > MAX_STDIN_BYTES * 4 // 3 + 4:
        raise InvalidArgument(f"exec stdin is over the {MAX_STDIN_BYTES}-byte limit; "
                              "write large inputs to a file first", field="stdin",
                              limit=MAX_STDIN_BYTES)
    stdin = from_text(body.stdin, body.stdin_encoding, field="stdin")
    req = ExecRequest(argv=tuple(body.argv or ()), shell=body.shell, env=dict(body.env),
                      cwd=body.cwd, user=body.user, stdin=stdin, timeout_s=body.timeout_s,
                      output_cap_bytes=body.output_cap_bytes, background=body.background,
                      hide=tuple(body.hide), pty=body.pty, stdin_open=body.stdin_open,
                      tag=body.tag)
    return req.validate()


def exec_output(res: ExecResult) -> ExecOutput:
    """An :class:`ExecResult` as JSON: text when both streams are UTF-8, else base64."""
    enc: Encoding
    try:
        out, err, enc = res.stdout.decode(), res.stderr.decode(), "utf-8"
    except UnicodeDecodeError:
        out = base64.b64encode(res.stdout).decode()
        err = base64.b64encode(res.stderr).decode()
        enc = "base64"
    return ExecOutput(exit_code=res.exit_code, stdout=out, stderr=err, encoding=enc,
                      stdout_truncated=res.stdout_truncated,
                      stderr_truncated=res.stderr_truncated, timed_out=res.timed_out,
                      duration_s=res.duration_s, pid=res.pid, oom_killed=res.oom_killed)


def exec_result(o: ExecOutput) -> ExecResult:
    """The :class:`ExecResult` a JSON exec answer stands for (the inverse of
    :func:`exec_output`)."""
    return ExecResult(exit_code=o.exit_code, stdout=from_text(o.stdout, o.encoding,
                                                              field="stdout"),
                      stderr=from_text(o.stderr, o.encoding, field="stderr"),
                      stdout_truncated=o.stdout_truncated,
                      stderr_truncated=o.stderr_truncated, timed_out=o.timed_out,
                      duration_s=o.duration_s, pid=o.pid, oom_killed=o.oom_killed)


def stream_line(item: ExecChunk | ExecResult) -> ExecStreamLine:
    """One NDJSON line of a streamed exec: an output chunk, or the final result."""
    if isinstance(item, ExecResult):
        return ExecStreamLine(exit_code=item.exit_code, timed_out=item.timed_out,
                              duration_s=item.duration_s, oom_killed=item.oom_killed)
    data, enc = text_or_base64(item.data)
    return ExecStreamLine(stream=item.stream, data=data, encoding=enc)


def stream_item(line: ExecStreamLine) -> ExecChunk | ExecResult:
    """What one NDJSON line stands for (the inverse of :func:`stream_line`); a line with
    ``error`` raises that error (the class the server raised, with its detail)."""
    if line.error is not None:
        raise error_from_wire(line.error.code, line.error.message, dict(line.error.detail))
    if line.exit_code is not None:
        return ExecResult(exit_code=line.exit_code, timed_out=line.timed_out,
                          duration_s=line.duration_s or 0.0, oom_killed=line.oom_killed)
    return ExecChunk(stream=line.stream or "stdout",
                     data=from_text(line.data or "", line.encoding, field="data"))


def run_line(item: ProcessRunItem | ExecResult) -> ExecStreamLine:
    """One NDJSON line of ``process_run``: its entry (``started``), an output chunk (as
    :func:`stream_line` writes one), or its end."""
    if isinstance(item, ExecResult):
        return stream_line(item)
    if item.started is not None:
        return ProcessRunLine(started=item.started)
    data, enc = text_or_base64(item.data)
    return ExecStreamLine(stream=item.stream, data=data, encoding=enc)


def run_item(line: ProcessRunLine) -> ProcessRunItem | ExecResult:
    """What one ``process_run`` NDJSON line stands for (the inverse of :func:`run_line`;
    an ``error`` line raises it)."""
    if line.started is not None and line.error is None:
        return ProcessRunItem(started=line.started)
    item = stream_item(line)
    if isinstance(item, ExecResult):
        return item
    return ProcessRunItem(stream=item.stream, data=item.data)


# ------------------------------------------------- exec records inside other records
# An ExecRequest or ExecResult is written in its JSON form (above) wherever it appears in
# a REST body or answer, not only when it is the whole body: ``POST /v1/batch/exec``'s
# items read and answer as ``POST .../exec`` does (before, a batch item's stdin was
# base64-decoded msgspec bytes: "test" reached the command as b"\xb5\xeb\x2d").
_EXEC_TYPES = (ExecRequest, ExecResult)
_carries: dict[Any, bool] = {}


def _carries_type(t: msgspec.inspect.Type, seen: set[Any]) -> bool:
    if isinstance(t, msgspec.inspect.StructType):
        if t.cls in _EXEC_TYPES:
            return True
        if t.cls in seen:
            return False
        seen.add(t.cls)
        return any(_carries_type(f.type, seen) for f in t.fields)
    if isinstance(t, (msgspec.inspect.ListType, msgspec.inspect.VarTupleType,
                      msgspec.inspect.SetType, msgspec.inspect.FrozenSetType)):
        return _carries_type(t.item_type, seen)
    if isinstance(t, msgspec.inspect.DictType):
        return _carries_type(t.value_type, seen)
    if isinstance(t, msgspec.inspect.TupleType):
        return any(_carries_type(x, seen) for x in t.item_types)
    if isinstance(t, msgspec.inspect.UnionType):
        return any(_carries_type(x, seen) for x in t.types)
    return False


def carries_exec(tp: Any) -> bool:
    """Whether values of type ``tp`` can hold an ExecRequest or ExecResult (computed
    once per type, so records without one are encoded and decoded as they are)."""
    got = _carries.get(tp)
    if got is None:
        got = _carries[tp] = _carries_type(msgspec.inspect.type_info(tp), set())
    return got


def json_form(value: Any) -> Any:
    """``value`` with every ExecRequest inside it as its :func:`exec_body` and every
    ExecResult as its :func:`exec_output` (records are copied only where one sits)."""
    if isinstance(value, ExecRequest):
        return exec_body(value)
    if isinstance(value, ExecResult):
        return exec_output(value)
    if isinstance(value, msgspec.Struct):
        changed = {}
        for name in value.__struct_fields__:
            v = getattr(value, name)
            n = json_form(v)
            if n is not v:
                changed[name] = n
        # replace() does not check field types: the copy is for the JSON encoder only
        return msgspec.structs.replace(value, **changed) if changed else value
    if isinstance(value, (list, tuple)):
        out = [json_form(x) for x in value]
        return out if any(a is not b for a, b in zip(out, value, strict=True)) else value
    if isinstance(value, dict):
        d = {k: json_form(v) for k, v in value.items()}
        return d if any(d[k] is not v for k, v in value.items()) else value
    return value


def _from(data: Any, t: msgspec.inspect.Type) -> Any:
    if isinstance(t, msgspec.inspect.StructType):
        if t.cls is ExecRequest and isinstance(data, dict):
            return exec_request(msgspec.convert(data, ExecBody))
        if t.cls is ExecResult and isinstance(data, dict):
            return exec_result(msgspec.convert(data, ExecOutput))
        if isinstance(data, dict):
            types = {f.encode_name: f.type for f in t.fields}
            return {k: _from(v, types[k]) if k in types else v for k, v in data.items()}
        return data
    if isinstance(t, (msgspec.inspect.ListType, msgspec.inspect.VarTupleType)):
        return [_from(x, t.item_type) for x in data] if isinstance(data, list) else data
    if isinstance(t, msgspec.inspect.DictType):
        return ({k: _from(v, t.value_type) for k, v in data.items()}
                if isinstance(data, dict) else data)
    if isinstance(t, msgspec.inspect.UnionType):
        if data is None:
            return data
        inner = [x for x in t.types if _carries_type(x, set())]
        return _from(data, inner[0]) if len(inner) == 1 else data
    return data


def from_json(data: Any, tp: Any) -> Any:
    """Plain decoded JSON ``data`` as a value of ``tp``, every ExecRequest/ExecResult
    inside read from its JSON form (the inverse of :func:`json_form`). Raises what
    :func:`msgspec.convert` raises, or the exec form's own :class:`InvalidArgument`."""
    if carries_exec(tp):
        data = _from(data, msgspec.inspect.type_info(tp))
    return msgspec.convert(data, tp)
