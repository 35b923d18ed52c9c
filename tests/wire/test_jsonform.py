"""The JSON forms of exec requests, results and stream lines: whatever the bytes, the
SDK's encoding and the server's decoding (and back) give the same record."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsec.errors import InvalidArgument, SandboxNotFound
from dsec.wire.api import ApiError, ExecBody, ExecOutput, ExecStreamLine
from dsec.wire.jsonform import (
    exec_body,
    exec_output,
    exec_request,
    exec_result,
    from_text,
    stream_item,
    stream_line,
    text_or_base64,
)
from dsec.wire.spec import MAX_STDIN_BYTES, ExecChunk, ExecRequest, ExecResult

_json = msgspec.json.Encoder()
safe_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"),
                    min_size=1, max_size=40)


@given(st.binary(max_size=300))
def test_bytes_survive_json(data: bytes) -> None:
    text, enc = text_or_base64(data)
    assert from_text(text, enc, field="stdin") == data
    assert enc == "utf-8" or not _is_utf8(data)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
        return True
    except UnicodeDecodeError:
        return False


@given(st.one_of(st.lists(safe_text, min_size=1, max_size=5).map(tuple), safe_text),
       st.binary(max_size=200), st.one_of(st.none(), st.floats(0.5, 1e5)),
       st.booleans(), st.dictionaries(st.from_regex(r"[A-Z]{1,8}", fullmatch=True),
                                      safe_text, max_size=3))
def test_an_exec_request_crosses_rest_unchanged(cmd: tuple[str, ...] | str, stdin: bytes,
                                                timeout: float | None, background: bool,
                                                env: dict[str, str]) -> None:
    req = ExecRequest(argv=cmd if isinstance(cmd, tuple) else (),
                      shell=cmd if isinstance(cmd, str) else None, stdin=stdin,
                      timeout_s=timeout, background=background, env=env, cwd="/w")
    wire = _json.encode(exec_body(req))                     # what the SDK sends
    got = exec_request(msgspec.json.decode(wire, type=ExecBody))   # what the server runs
    assert got == req


def test_every_exec_request_field_crosses_rest() -> None:
    """A field ExecRequest grows must reach the server over REST too: ``hide`` (Landlock)
    was dropped silently by the REST form once, so a judge's files were hidden over the
    gateway and readable over REST."""
    assert set(ExecRequest.__struct_fields__) - {"stdin"} <= set(ExecBody.__struct_fields__)
    req = ExecRequest(shell="true", hide=(".dsec-judge", "secret"), user="nobody")
    got = exec_request(msgspec.json.decode(_json.encode(exec_body(req)), type=ExecBody))
    assert got == req


@given(st.integers(-255, 255), st.binary(max_size=200), st.binary(max_size=200),
       st.booleans(), st.one_of(st.none(), st.integers(1, 1 << 22)))
def test_an_exec_result_crosses_rest_unchanged(code: int, out: bytes, err: bytes,
                                               timed_out: bool, pid: int | None) -> None:
    res = ExecResult(exit_code=code, stdout=out, stderr=err, timed_out=timed_out,
                     duration_s=0.25, pid=pid)
    wire = _json.encode(exec_output(res))
    assert exec_result(msgspec.json.decode(wire, type=ExecOutput)) == res


@given(st.sampled_from(["stdout", "stderr"]), st.binary(max_size=200))
def test_stream_lines_cross_rest_unchanged(stream: str, data: bytes) -> None:
    chunk = ExecChunk(stream=stream, data=data)  # type: ignore[arg-type]
    line = msgspec.json.decode(_json.encode(stream_line(chunk)), type=ExecStreamLine)
    assert stream_item(line) == chunk
    final = ExecResult(exit_code=3, timed_out=True, duration_s=1.5)
    line = msgspec.json.decode(_json.encode(stream_line(final)), type=ExecStreamLine)
    assert stream_item(line) == final


def test_an_error_line_raises_the_servers_error() -> None:
    line = ExecStreamLine(error=ApiError(code="sandbox_not_found", message="gone",
                                         request_id="r", detail={"sandbox_id": "sb-x"}))
    with pytest.raises(SandboxNotFound, match="gone"):
        stream_item(line)


def test_bad_stdin_is_refused_with_the_field_named() -> None:
    with pytest.raises(InvalidArgument, match="stdin is not valid base64"):
        exec_request(ExecBody(argv=["cat"], stdin="!!", stdin_encoding="base64"))
    with pytest.raises(InvalidArgument, match=f"over the {MAX_STDIN_BYTES}-byte limit"):
        exec_request(ExecBody(argv=["cat"], stdin="A" * (MAX_STDIN_BYTES * 2),
                              stdin_encoding="base64"))
    with pytest.raises(InvalidArgument, match="not valid Unicode"):
        exec_request(ExecBody(argv=["cat"], stdin="\udc80"))


def test_every_rest_body_holding_an_exec_record_is_read_and_documented_in_its_json_form() -> None:
    """An ExecRequest/ExecResult nested in a REST body or reply (a batch's) travels in the
    exec JSON form; the OpenAPI document names that form for each such row."""
    from dsec.control.api.openapi import _JSON_FORMS
    from dsec.wire import ops
    from dsec.wire.jsonform import carries_exec
    from dsec.wire.spec import ExecRequest, ExecResult

    for op in ops.BY_NAME.values():
        if op.rest is None:
            continue
        if op.rest.body == "*" and carries_exec(op.request):
            assert op.request in _JSON_FORMS, op.name
        if op.rest.reply == "json" and op.reply is not ExecResult and carries_exec(op.reply):
            assert op.reply in _JSON_FORMS, op.name
    assert carries_exec(ExecRequest) and not carries_exec(ops.GET.reply)


def test_a_batch_of_exec_records_round_trips_through_its_json_form() -> None:
    from dsec.wire.calls import ExecCall, ExecMany
    from dsec.wire.jsonform import from_json, json_form
    from dsec.wire.outcome import Batch, Outcome
    from dsec.wire.spec import ExecRequest, ExecResult

    req = ExecMany(calls=[ExecCall(id="s", req=ExecRequest(argv=("cat",), stdin=b"test")),
                          ExecCall(id="t", req=ExecRequest(shell="x", stdin=b"\xff\x00"))])
    data = msgspec.json.decode(msgspec.json.encode(json_form(req)))
    assert data["calls"][0]["req"]["stdin"] == "test"
    assert data["calls"][1]["req"]["stdin_encoding"] == "base64"
    assert from_json(data, ExecMany) == req
    rep = Batch(items=[Outcome(value=ExecResult(exit_code=0, stdout=b"hi\n")),
                       Outcome(value=ExecResult(exit_code=1, stderr=b"\xfe"))])
    data = msgspec.json.decode(msgspec.json.encode(json_form(rep)))
    assert data["items"][0]["value"]["stdout"] == "hi\n"
    assert from_json(data, Batch[ExecResult]) == rep
