"""Validation lives in the request types: a request that exists is within its limits,
however it was made (built, replaced, converted, decoded from msgpack or JSON), and the
error names the field, the size and the limit the same way each time."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsec.errors import InvalidArgument
from dsec.wire import spec
from dsec.wire.calls import (
    CreateMany,
    CreateManyOnNode,
    CreateSandbox,
    DestroyMany,
    ExecCall,
    ExecMany,
    FileRef,
    Mkdir,
    ReadFile,
    Remove,
    ResumeOnNode,
    SandboxRef,
    SnapshotCall,
    WriteFile,
)
from dsec.wire.process import ProcessInput
from dsec.wire.spec import (
    MAX_ARG_BYTES,
    MAX_ARGV_BYTES,
    MAX_BATCH_ITEMS,
    MAX_PATH_BYTES,
    MAX_STDIN_BYTES,
    ExecRequest,
    SandboxSpec,
)


def _refused(make: Any, field: str, needle: str) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as ei:
        make()
    assert needle in ei.value.message, ei.value.message
    assert ei.value.detail.get("field") == field, ei.value.detail
    return ei.value


def _decode_refused(tp: Any, raw: dict[str, Any]) -> InvalidArgument:
    """Decoding ``raw`` as ``tp`` fails with the type's own InvalidArgument as the cause
    (the Aether router and the REST decoder answer with that cause unchanged)."""
    for codec in (msgspec.msgpack, msgspec.json):
        wire = codec.encode(raw)
        with pytest.raises(msgspec.ValidationError) as ei:
            codec.decode(wire, type=tp)
        assert isinstance(ei.value.__cause__, InvalidArgument), ei.value
    cause = ei.value.__cause__
    assert isinstance(cause, InvalidArgument)
    return cause


# ------------------------------------------------------------------ ExecRequest
def test_an_exec_request_past_a_limit_cannot_exist() -> None:
    e = _refused(lambda: ExecRequest(argv=("x" * (MAX_ARG_BYTES + 1),)), "argv[0]",
                 f"is {MAX_ARG_BYTES + 1} bytes, over the {MAX_ARG_BYTES}-byte limit")
    assert e.detail == {"field": "argv[0]", "size": MAX_ARG_BYTES + 1, "limit": MAX_ARG_BYTES}
    _refused(lambda: ExecRequest(), "argv", "exactly one of argv")
    _refused(lambda: ExecRequest(argv=("a",), shell="b"), "argv", "exactly one of argv")
    _refused(lambda: ExecRequest(shell="x", stdin=b"\0" * (MAX_STDIN_BYTES + 1)), "stdin",
             f"over the {MAX_STDIN_BYTES}-byte limit")
    _refused(lambda: ExecRequest(shell="x", timeout_s=0), "timeout_s", "must be a positive")
    ok = ExecRequest(shell="true")
    _refused(lambda: msgspec.structs.replace(ok, env={"A=B": "c"}), "env", "env name 'A=B'")
    with pytest.raises(msgspec.ValidationError) as ei:   # convert wraps it as decode does
        msgspec.convert({"shell": "x", "cwd": ""}, ExecRequest)
    assert isinstance(ei.value.__cause__, InvalidArgument)
    assert ei.value.__cause__.detail["field"] == "cwd"
    assert ok.validate() is ok      # kept for callers; nothing left to check


def test_an_exec_request_decoded_from_either_encoding_is_checked() -> None:
    big = {"argv": ["true"] + ["a" * 100_000] * 11}
    e = _decode_refused(ExecRequest, big)
    assert e.message.startswith("exec argv+env is 1100016 bytes, over the "
                                f"{MAX_ARGV_BYTES}-byte limit")
    e = _decode_refused(ExecCall, {"id": "sb-1", "req": {"argv": ["a\0b"]}})
    assert e.detail["field"] == "argv[0]" and "NUL" in e.message


_TRICKY = st.sampled_from(["", "a", "=", "\0", "é", "\ud800", "日本", "x" * 40_000])
_STR = st.lists(_TRICKY, max_size=4).map("".join) | st.text(max_size=30)


@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")  # 40 kB reprs
@settings(max_examples=400, deadline=None)
@given(argv=st.lists(_STR, max_size=4).map(tuple), shell=st.none() | _STR,
       env=st.dictionaries(_STR, _STR, max_size=3), cwd=st.none() | _STR,
       user=st.none() | _STR, stdin=st.sampled_from([b"", b"x", b"x" * (MAX_STDIN_BYTES + 1)]),
       timeout_s=st.none() | st.floats(allow_nan=False),
       output_cap_bytes=st.integers(-2, spec.MAX_OUTPUT_CAP_BYTES + 2),
       background=st.booleans())
def test_the_plain_case_shortcut_never_lets_a_bad_request_through(**fields: Any) -> None:
    """``_plainly_valid`` skips the exact check only when it would pass; and a request
    is made exactly when the exact check passes."""
    ns = types.SimpleNamespace(**fields)
    try:
        ExecRequest._check(ns)  # type: ignore[arg-type]
        exact_ok = True
    except InvalidArgument:
        exact_ok = False
    if ExecRequest._plainly_valid(ns):  # type: ignore[arg-type]
        assert exact_ok, fields
    try:
        ExecRequest(**fields)
        made = True
    except InvalidArgument:
        made = False
    assert made == exact_ok


# ------------------------------------------------------------------ request types
LONG = "/" + "p" * MAX_PATH_BYTES


@pytest.mark.parametrize("make", [
    lambda **k: ReadFile(id="sb-1", **k), lambda **k: WriteFile(id="sb-1", data=b"", **k),
    lambda **k: FileRef(id="sb-1", **k), lambda **k: Mkdir(id="sb-1", **k),
    lambda **k: Remove(id="sb-1", **k)], ids=["read_file", "write_file", "file_ref", "mkdir",
                                               "remove"])
def test_every_file_request_checks_its_path(make: Any) -> None:
    e = _refused(lambda: make(path=LONG), "path",
                 f"path is {MAX_PATH_BYTES + 1} bytes long, over the {MAX_PATH_BYTES}-byte")
    assert e.detail["limit"] == MAX_PATH_BYTES
    _refused(lambda: make(path=""), "path", "must be a non-empty string")
    _refused(lambda: make(path="/a\0b"), "path", "contains a NUL character")
    make(path="/" + "p" * (MAX_PATH_BYTES - 1))     # at the limit: fine


def test_file_request_fields_are_bounded() -> None:
    _refused(lambda: ReadFile(id="s", path="/f", offset=-1), "offset", "must be >= 0")
    _refused(lambda: ReadFile(id="s", path="/f", length=-1), "length", "must be >= 0")
    _refused(lambda: WriteFile(id="s", path="/f", data=b"", mode=0o10000), "mode",
             "mode=10000 must be within 0..0o7777")
    e = _decode_refused(WriteFile, {"id": "s", "path": "/f", "data": b"", "mode": -1})
    assert e.detail["field"] == "mode"


def test_create_requests_check_their_spec_and_keys() -> None:
    _refused(lambda: CreateSandbox(spec=SandboxSpec(cpu_milli=0)), "cpu_milli",
             "sandbox spec field cpu_milli=0 is invalid")
    _decode_refused(CreateSandbox, {"spec": {"memory_bytes": 5}})
    _refused(lambda: CreateSandbox(idempotency_key="k\n"), "idempotency_key",
             "1..255 printable ASCII")
    _refused(lambda: CreateSandbox(idempotency_key="k" * 256), "idempotency_key",
             "1..255 printable ASCII")
    CreateSandbox(idempotency_key="k" * 255)
    _refused(lambda: CreateMany(items=[SandboxSpec()] * 2, idempotency_keys=["a"]),
             "idempotency_keys", "has 1 keys for 2 items")
    # a batch's items succeed or fail alone: an invalid spec is the edge's per-item answer
    CreateManyOnNode(specs=[SandboxSpec(), SandboxSpec(cpu_milli=0)])


@pytest.mark.parametrize("make,field", [
    (lambda n: CreateMany(items=[SandboxSpec()] * n), "items"),
    (lambda n: CreateManyOnNode(specs=[SandboxSpec()] * n), "specs"),
    (lambda n: DestroyMany(ids=["sb-1"] * n), "ids"),
    (lambda n: ExecMany(calls=[ExecCall(id="s", req=ExecRequest(shell="true"))] * n), "calls"),
], ids=["create_many", "create_many_on_node", "destroy_many", "exec_many"])
def test_batches_are_bounded(make: Any, field: str) -> None:
    e = _refused(lambda: make(MAX_BATCH_ITEMS + 1), field,
                 f"a batch of {MAX_BATCH_ITEMS + 1} {field} is over the limit")
    assert e.detail["limit"] == MAX_BATCH_ITEMS
    make(3)


# ------------------------------------------------------------------ every limit
def _read_too_much() -> None:
    async def reader(offset: int, n: int) -> bytes:
        return b""
    asyncio.run(spec.read_in_chunks(reader, 0, spec.MAX_FILE_READ_BYTES + 1))


# One request past each limit of the vocabulary. A MAX_* constant added to wire/spec.py
# without a case here fails the guard below: a limit nobody tried to break is not known
# to hold.
PAST_EACH_LIMIT: dict[str, Any] = {
    "MAX_CPU_MILLI": lambda: SandboxSpec(cpu_milli=spec.MAX_CPU_MILLI + 1).validate(),
    "MAX_MEMORY_BYTES": lambda: SandboxSpec(memory_bytes=spec.MAX_MEMORY_BYTES + 1).validate(),
    "MAX_DISK_BYTES": lambda: SandboxSpec(disk_bytes=spec.MAX_DISK_BYTES + 1).validate(),
    "MAX_PIDS": lambda: SandboxSpec(pids_max=spec.MAX_PIDS + 1).validate(),
    "MAX_TTL_S": lambda: SandboxSpec(ttl_s=spec.MAX_TTL_S + 1).validate(),
    "MAX_ARGV_BYTES": lambda: ExecRequest(argv=("a" * 100_000,) * 11),
    "MAX_ARG_BYTES": lambda: ExecRequest(argv=("a" * (MAX_ARG_BYTES + 1),)),
    "MAX_ARGV_ITEMS": lambda: ExecRequest(argv=("a",) * (spec.MAX_ARGV_ITEMS + 1)),
    "MAX_ENV_ITEMS": lambda: ExecRequest(shell="true", env={
        f"K{i}": "" for i in range(spec.MAX_ENV_ITEMS + 1)}),
    "MAX_STDIN_BYTES": lambda: ExecRequest(shell="true", stdin=b"x" * (MAX_STDIN_BYTES + 1)),
    "MAX_CWD_BYTES": lambda: ExecRequest(shell="true", cwd="/" + "d" * spec.MAX_CWD_BYTES),
    "MAX_USER_BYTES": lambda: ExecRequest(shell="true", user="u" * (spec.MAX_USER_BYTES + 1)),
    "MAX_HIDE_ENTRIES": lambda: ExecRequest(shell="true", hide=tuple(
        f"h{i}" for i in range(spec.MAX_HIDE_ENTRIES + 1))),
    "MAX_EXEC_TIMEOUT_S": lambda: ExecRequest(shell="true",
                                              timeout_s=spec.MAX_EXEC_TIMEOUT_S + 1),
    "MAX_OUTPUT_CAP_BYTES": lambda: ExecRequest(
        shell="true", output_cap_bytes=spec.MAX_OUTPUT_CAP_BYTES + 1),
    "MAX_PATH_BYTES": lambda: FileRef(id="s", path=LONG),
    "MAX_PTY_CELLS": lambda: ExecRequest(shell="sh", pty=spec.PtySize(
        cols=spec.MAX_PTY_CELLS + 1)),
    "MAX_PROCESS_TAG_BYTES": lambda: ExecRequest(shell="sh", tag="t" * (
        spec.MAX_PROCESS_TAG_BYTES + 1)),
    "MAX_PROCESS_INPUT_BYTES": lambda: ProcessInput(id="s", pid=1, data=b"x" * (
        spec.MAX_PROCESS_INPUT_BYTES + 1)),
    "MAX_FILE_READ_BYTES": _read_too_much,
    "MAX_FILE_MODE": lambda: WriteFile(id="s", path="/f", data=b"",
                                       mode=spec.MAX_FILE_MODE + 1),
    "MAX_BATCH_ITEMS": lambda: DestroyMany(ids=["s"] * (MAX_BATCH_ITEMS + 1)),
    "MAX_IDEMPOTENCY_KEY_CHARS": lambda: CreateSandbox(
        idempotency_key="k" * (spec.MAX_IDEMPOTENCY_KEY_CHARS + 1)),
    "MAX_SPEC_ENV_BYTES": lambda: SandboxSpec(env={
        f"K{i}": "v" * 100_000 for i in range(6)}).validate(),
    "MAX_LABELS": lambda: SandboxSpec(labels={
        f"k{i}": "" for i in range(spec.MAX_LABELS + 1)}).validate(),
    "MAX_LABEL_KEY_CHARS": lambda: SandboxSpec(labels={
        "k" * (spec.MAX_LABEL_KEY_CHARS + 1): ""}).validate(),
    "MAX_LABEL_VALUE_CHARS": lambda: SandboxSpec(labels={
        "k": "v" * (spec.MAX_LABEL_VALUE_CHARS + 1)}).validate(),
    "MAX_PRIORITY": lambda: SandboxSpec(priority=spec.MAX_PRIORITY + 1).validate(),
    "MAX_TOOLKITS": lambda: SandboxSpec(toolkits=("tk",) * (spec.MAX_TOOLKITS + 1)).validate(),
    "MAX_REF_CHARS": lambda: SandboxSpec(workspace="w" * (spec.MAX_REF_CHARS + 1)).validate(),
    "MAX_STRIP_PATTERNS": lambda: SnapshotCall(id="s", strip=["/x"] * (
        spec.MAX_STRIP_PATTERNS + 1)),
    "MAX_STRIP_PATTERN_CHARS": lambda: SnapshotCall(id="s", strip=["x" * (
        spec.MAX_STRIP_PATTERN_CHARS + 1)]),
    "MAX_REASON_CHARS": lambda: DestroyMany(ids=["s"], reason="r" * (
        spec.MAX_REASON_CHARS + 1)),
    "MAX_ID_CHARS": lambda: SandboxRef(id="s" * (spec.MAX_ID_CHARS + 1)),
    "MAX_NET_RULES": lambda: _net(allow=tuple(
        f"h{i}.example.com" for i in range(spec.MAX_NET_RULES + 1))),
    "MAX_NET_ENTRY_CHARS": lambda: _net(allow=("x" * (spec.MAX_NET_ENTRY_CHARS + 1),)),
    "MAX_NET_DOMAIN_BYTES": lambda: _net(allow=(".".join(["abcdefgh"] * 29) + ".org",)),
    "MAX_NET_LABEL_BYTES": lambda: _net(allow=("a" * (spec.MAX_NET_LABEL_BYTES + 1) + ".org",)),
    "MAX_NET_DOMAIN_PORTS": lambda: _net(allow=("example.com:1-17",)),
    "MAX_NET_CONNECTIONS": lambda: _net(max_connections=spec.MAX_NET_CONNECTIONS + 1),
    "MAX_NET_RATE_MBIT": lambda: _net(rate_mbit=spec.MAX_NET_RATE_MBIT + 1),
}


def _net(**kw: Any) -> Any:
    return SandboxSpec(network=spec.NetworkPolicy(mode="policy", **kw)).validate()


def test_every_limit_has_a_case() -> None:
    assert set(PAST_EACH_LIMIT) == {n for n in dir(spec) if n.startswith("MAX_")}


@pytest.mark.parametrize("name", sorted(PAST_EACH_LIMIT))
def test_each_limit_refuses_and_says_which(name: str) -> None:
    """Past each limit: InvalidArgument (or its PayloadTooLarge) carrying the limit in
    its detail, so every door can report it the same way."""
    with pytest.raises(InvalidArgument) as ei:
        PAST_EACH_LIMIT[name]()
    assert ei.value.detail.get("limit") == getattr(spec, name), ei.value.detail
    assert len(ei.value.message) < 300, "the message echoes the value"


@pytest.mark.parametrize("tp,raw", [
    (SandboxSpec, {"image": "py", "network_rules": ["deny *"]}),
    (spec.NetworkPolicy, {"mode": "policy", "allow_out": ["10.0.0.0/8"]}),
    (ExecRequest, {"shell": "true", "seccomp": "off"}),
    (CreateSandbox, {"spec": {"imagee": "py"}}),
], ids=["spec", "network", "exec", "nested"])
def test_a_field_this_release_does_not_know_is_refused_by_name(tp: Any, raw: Any) -> None:
    """Dropping it would run the request without it (a newer network rule, say)."""
    for codec in (msgspec.msgpack, msgspec.json):
        with pytest.raises(msgspec.ValidationError, match="unknown field"):
            codec.decode(codec.encode(raw), type=tp)


def test_only_the_control_plane_says_why_a_sandbox_resumed() -> None:
    """The API's resume takes SandboxRef (a caller cannot claim ``auto_resume``); the
    edge's takes ResumeOnNode, whose reason is one of the known ones."""
    sid = "sb-0123456789ab-edge-0"
    for codec in (msgspec.msgpack, msgspec.json):
        with pytest.raises(msgspec.ValidationError, match="unknown field"):
            codec.decode(codec.encode({"id": sid, "reason": "auto_resume"}), type=SandboxRef)
        assert codec.decode(codec.encode({"id": sid}), type=ResumeOnNode).reason == "requested"
        assert codec.decode(codec.encode({"id": sid, "reason": "auto_resume"}),
                            type=ResumeOnNode).reason == "auto_resume"
        with pytest.raises(msgspec.ValidationError, match="reason"):
            codec.decode(codec.encode({"id": sid, "reason": "idle"}), type=ResumeOnNode)


# ------------------------------------------------------------------ snapshot refs
def test_snapshot_ref_is_sha256_and_12_to_64_lowercase_hex() -> None:
    from dsec.wire.spec import check_snapshot_ref

    for good in ("sha256:" + "a" * 12, "sha256:" + "0123456789abcdef" * 4):
        assert check_snapshot_ref(good) == good
    for bad in ("sha256:" + "a" * 11, "sha256:" + "a" * 65, "sha256:" + "A" * 12,
                "md5:" + "a" * 12, "sha256:" + "g" * 12, "", 42, None):
        with pytest.raises(InvalidArgument, match="expected 'sha256:' and 12-64") as e:
            check_snapshot_ref(bad, field="snapshot")
        assert e.value.detail["field"] == "snapshot"
    with pytest.raises(InvalidArgument) as e:
        check_snapshot_ref("x" * 10_000)
    assert len(e.value.message) < 200 and e.value.detail["field"] == "id"


def test_a_quota_is_a_64_bit_count_and_a_stored_one_beyond_reads_back_clamped() -> None:
    """[i13f] A quota beyond 2**63 - 1 made every Aether read of its project fail (msgpack
    cannot carry it): refused when set, and one an older release stored reads back as the
    largest value every door carries instead of failing every reader."""
    from dsec.wire.api import MAX_QUOTA, QuotaBody

    with pytest.raises(InvalidArgument, match="cpu_milli") as ei:
        QuotaBody(cpu_milli=10**30)
    assert ei.value.detail["field"] == "cpu_milli"
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"memory_bytes": -1}', type=QuotaBody)
    q = QuotaBody.clamped(max_sandboxes=None, cpu_milli=10**30, memory_bytes=5,
                          snapshot_bytes=-3)
    assert (q.max_sandboxes, q.cpu_milli, q.memory_bytes, q.snapshot_bytes) == (
        None, MAX_QUOTA, 5, 0)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(q), type=QuotaBody) == q
