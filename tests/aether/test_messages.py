"""Protocol bodies: the REQUEST payload layout and error bodies."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsec.aether.messages import (
    ErrorBody,
    Goaway,
    decode_request,
    encode_request,
    error_body,
    method_prefix,
)
from dsec.errors import (
    DsecError,
    LocalProtocolError,
    RemoteProtocolError,
    SandboxNotFound,
    error_from_wire,
)

methods = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1,
                  max_size=255)


@given(methods, st.binary(max_size=500))
def test_request_payload_round_trip(method: str, body: bytes) -> None:
    payload = encode_request(method, body)
    assert payload[0] == len(method)
    m, rest = decode_request(payload)
    assert (m, bytes(rest)) == (method, body)


@pytest.mark.parametrize("bad", ["", "x" * 256, "método", "a\nb"])
def test_bad_method_names_are_our_error(bad: str) -> None:
    with pytest.raises(LocalProtocolError, match="must be 1..255 printable ascii"):
        method_prefix(bad)


@pytest.mark.parametrize(
    ("payload", "message"),
    [(b"", "empty REQUEST"), (b"\x00\xc0", "too short"), (b"\x05ab", "too short"),
     (b"\x02\xff\xfe\xc0", "not ascii")],
)
def test_malformed_request_payloads_are_the_peers_error(payload: bytes, message: str) -> None:
    with pytest.raises(RemoteProtocolError, match=message):
        decode_request(payload)


@given(st.text(), st.text(), st.dictionaries(st.text(max_size=5), st.integers(-2**63, 2**64 - 1) | st.text()))
def test_error_body_round_trip(code: str, message: str, detail: dict[str, object]) -> None:
    eb = ErrorBody(code=code, message=message, detail=detail)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(eb), type=ErrorBody) == eb


def test_error_body_keeps_class_message_and_wire_safe_detail() -> None:
    exc = SandboxNotFound("sandbox sb-1 not found", sandbox_id="sb-1", obj=object())
    eb = error_body(exc)
    assert (eb.code, eb.message, eb.detail) == ("sandbox_not_found", "sandbox sb-1 not found",
                                                {"sandbox_id": "sb-1"})
    back = error_from_wire(eb.code, eb.message, eb.detail)
    assert type(back) is SandboxNotFound and back.detail == {"sandbox_id": "sb-1"}


def test_foreign_exceptions_become_internal_errors_without_a_traceback() -> None:
    eb = error_body(KeyError("k"))
    assert eb.code == "internal_error"
    assert eb.message == "KeyError: 'k'"
    assert type(error_from_wire("no_such_code", "m")) is DsecError


def test_goaway_defaults_are_omitted_on_the_wire() -> None:
    assert msgspec.msgpack.encode(Goaway()) == b"\x80"
    g = msgspec.msgpack.decode(msgspec.msgpack.encode(Goaway(reason="bye", last_stream_id=7)),
                               type=Goaway)
    assert (g.reason, g.last_stream_id) == ("bye", 7)
