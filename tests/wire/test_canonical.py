"""The canonical form of a request (dsec.wire.canonical): one request, one set of bytes,
however it was spelled and whichever release (with more defaulted fields) spelled it."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from dsec.control.idempotency import request_fingerprint
from dsec.wire.api import CreateSandboxRequest
from dsec.wire.calls import CreateSandbox
from dsec.wire.canonical import canonical_bytes, meaning
from dsec.wire.spec import NetworkPolicy, SandboxSpec


def test_defaults_are_left_out_by_value_at_every_depth() -> None:
    spelled = CreateSandbox(spec=SandboxSpec(image=str("ba" + "se"), memory_bytes=int("536870912"),
                                             network=None, toolkits=()))
    assert meaning(spelled) == {} == meaning(CreateSandbox())
    # an explicit policy is not the default: network=None leaves it to the server's
    # --net-default, which may be "open"
    assert meaning(CreateSandbox(spec=SandboxSpec(network=NetworkPolicy()))) == {
        "spec": {"network": {}}}
    # msgspec's own encoding tells these apart (identity): the reason this module exists
    assert msgspec.msgpack.encode(spelled) != msgspec.msgpack.encode(CreateSandbox())
    assert canonical_bytes(spelled) == canonical_bytes(CreateSandbox())


def test_what_differs_is_kept_under_wire_names_with_floats_as_floats() -> None:
    m = meaning(CreateSandbox(spec=SandboxSpec(ttl_s=60, labels={"b": "2", "a": "1"}),
                              session="s1"))
    assert m == {"spec": {"ttl_s": 60.0, "labels": {"b": "2", "a": "1"}}, "session": "s1"}
    assert isinstance(m["spec"]["ttl_s"], float)
    a = CreateSandbox(spec=SandboxSpec(labels={"b": "2", "a": "1"}))
    b = CreateSandbox(spec=SandboxSpec(labels={"a": "1", "b": "2"}))
    assert canonical_bytes(a) == canonical_bytes(b)


class _CreateNext(CreateSandboxRequest, kw_only=True):
    """A later release's create body: one more defaulted field."""

    boot_timeout_s: float = 30.0


@given(st.sampled_from(["base", "other"]), st.integers(1, 4096),
       st.dictionaries(st.sampled_from("abc"), st.text(max_size=3), max_size=3))
def test_a_new_defaulted_field_keeps_every_fingerprint(image: str, cpu: int,
                                                       labels: dict[str, str]) -> None:
    old = CreateSandboxRequest(image=image, cpu_milli=cpu, labels=labels)
    new = _CreateNext(image=image, cpu_milli=cpu, labels=labels,
                      boot_timeout_s=float("30"))
    assert request_fingerprint(new) == request_fingerprint(old)
    assert request_fingerprint(_CreateNext(image=image, cpu_milli=cpu, labels=labels,
                                           boot_timeout_s=5.0)) != request_fingerprint(old)


def test_one_create_decoded_from_json_or_msgpack_is_one_fingerprint() -> None:
    body = {"image": "base", "cpu_milli": 1000, "labels": {"run": "1"}, "ttl_s": 60}
    as_json = msgspec.json.decode(msgspec.json.encode(body), type=CreateSandboxRequest)
    as_msgpack = msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=CreateSandboxRequest)
    bare = CreateSandboxRequest(labels={"run": "1"}, ttl_s=60.0)
    assert request_fingerprint(as_json) == request_fingerprint(as_msgpack) == \
        request_fingerprint(bare)
