"""The operation catalogue (:mod:`dsec.wire.ops`): each row is well formed, the rows
agree with each other and with their annotations, and every type a row names crosses
both encodings (msgpack for Aether, JSON for REST) unchanged."""

from __future__ import annotations

import typing
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsec.errors import NotFound
from dsec.wire import ops
from dsec.wire.calls import ExecCall, ExecMany, SandboxRef
from dsec.wire.ops import (
    ALL_OPS,
    BY_NAME,
    EDGE_OPS,
    GATEWAY_OPS,
    REST_OPS,
    Op,
    StreamOp,
    TunnelOp,
    UploadOp,
    path_params,
)
from dsec.wire.outcome import Batch, Outcome
from dsec.wire.spec import ExecRequest, SandboxInfo, SandboxSpec
from tests.wire.strategies import of


def _fields(tp: Any) -> tuple[str, ...]:
    return tuple(getattr(tp, "__struct_fields__", ()))


def _ids(op: Op[Any, Any]) -> str:
    return op.name


def test_catalogue_has_the_82_operations_each_once() -> None:
    names = [op.name for op in ALL_OPS]
    assert len(names) == len(set(names)) == 83
    assert set(BY_NAME) == set(names)
    # every row constant of the module is in ALL_OPS, and nothing else is
    constants = {v for k, v in vars(ops).items() if k.isupper() and isinstance(v, Op)}
    assert constants == set(ALL_OPS)
    assert {op.name for op in EDGE_OPS} == {op.name for op in ALL_OPS if "edge" in op.doors}
    assert len(EDGE_OPS) == 50 and len(GATEWAY_OPS) == 71 and len(REST_OPS) == 73


def test_rest_routes_and_operation_ids_are_unique() -> None:
    routes = [(op.rest.method, op.rest.path) for op in REST_OPS if op.rest]
    assert len(routes) == len(set(routes))
    oids = [op.rest.operation_id for op in REST_OPS if op.rest]
    assert len(oids) == len(set(oids))
    for op in ALL_OPS:
        assert (op.rest is not None) == ("rest" in op.doors), op.name


@pytest.mark.parametrize("op", REST_OPS, ids=_ids)
def test_every_request_field_has_a_place_in_the_rest_request(op: Op[Any, Any]) -> None:
    """Path, query, headers and body together carry each field of the request exactly
    once, so nothing a caller sets over the gateway is unreachable over REST."""
    rest = op.rest
    assert rest is not None
    fields = _fields(op.request)
    placed = [*path_params(rest.path), *rest.query, *rest.headers]
    assert len(placed) == len(set(placed)), f"{op.name}: a field placed twice: {placed}"
    unknown = set(placed) - set(fields)
    assert not unknown, f"{op.name}: {sorted(unknown)} are not fields of {op.request}"
    rest_of = [f for f in fields if f not in placed]
    if rest.body == "*":
        assert rest_of, f"{op.name}: body='*' but no field is left for it"
    elif rest.body is None:
        assert not rest_of, f"{op.name}: fields {rest_of} have no place (no body)"
    else:
        assert rest_of == [rest.body], f"{op.name}: body={rest.body!r}, left: {rest_of}"


@pytest.mark.parametrize("op", REST_OPS, ids=_ids)
def test_rest_reply_form_follows_the_reply_type(op: Op[Any, Any]) -> None:
    rest = op.rest
    assert rest is not None
    if rest.method == "GET":
        assert op.idempotent and rest.body is None, op.name
    assert (rest.reply == "empty") == (rest.status == 204), op.name
    if op.reply is None:
        assert rest.reply == "empty", op.name
    if op.reply is bytes:
        assert rest.reply == "raw", op.name
    assert (rest.reply == "ndjson") == isinstance(op, StreamOp), op.name
    if isinstance(op, UploadOp):
        assert rest.body is None and rest.body_limit == "image" and op.doors == {"rest"}
    if rest.body_limit == "file":
        assert rest.body is not None and typing.get_type_hints(op.request)[rest.body] is bytes


@pytest.mark.parametrize("op", ALL_OPS, ids=_ids)
def test_targets_name_what_the_apiserver_routes_by(op: Op[Any, Any]) -> None:
    if op.target in ("sandbox", "snapshot") and op.batch_of is None:
        assert "id" in _fields(op.request), op.name
        assert "id" in _fields(op.edge_type), op.name
    if op.target == "node":
        assert op.doors == {"edge"} and op.role is None, op.name
    if op.doors == {"edge"} and not isinstance(op, TunnelOp):
        # a duplex row's API door is a hand-written route (port_connect: the proxy)
        assert op.target == "node", op.name
    if op.edge_request is not None or op.edge_reply is not None:
        assert "edge" in op.doors, op.name


def test_annotations_match_rows() -> None:
    """``EXEC: Op[ExecCall, ExecResult]`` is what mypy trusts for ``call(EXEC, ...)``:
    it must say what the row says."""
    checked = 0
    for name, value in vars(ops).items():
        if not isinstance(value, Op):
            continue
        ann = eval(ops.__annotations__[name], vars(ops))  # the module's own names
        origin, args = typing.get_origin(ann), typing.get_args(ann)
        assert origin is type(value), f"{name}: annotated {origin}, built {type(value)}"
        want: tuple[Any, ...]
        if isinstance(value, StreamOp):
            want = (value.request, value.item, value.reply)
        else:
            want = (value.request, value.reply)
        got = tuple(None if a is type(None) else a for a in args)
        assert got == want, f"{name}: annotation {ann} but the row has {want}"
        checked += 1
    assert checked == 83


def _types_of(op: Op[Any, Any]) -> list[Any]:
    out = [op.request, op.edge_type, op.reply, op.edge_reply_type]
    if isinstance(op, StreamOp):
        out.append(op.item)
    return [t for t in dict.fromkeys(out) if t is not None]


_TYPES = list(dict.fromkeys(t for op in ALL_OPS for t in _types_of(op)))


@pytest.mark.parametrize("tp", _TYPES, ids=lambda t: getattr(t, "__name__", repr(t)))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.filter_too_much])
@given(data=st.data())
def test_every_type_in_the_catalogue_round_trips(tp: Any, data: st.DataObject) -> None:
    value = data.draw(of(tp))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(value), type=tp) == value
    assert msgspec.json.decode(msgspec.json.encode(value), type=tp) == value


@pytest.mark.parametrize("tp", sorted({op.request for op in ALL_OPS} |
                                      {op.edge_type for op in ALL_OPS}, key=str),
                         ids=lambda t: t.__name__)
def test_request_types_refuse_unknown_fields(tp: Any) -> None:
    """A field this release does not know is refused by name, never dropped: an edge that
    ignored a new field (a network rule, say) would run the request without it."""
    with pytest.raises(msgspec.ValidationError, match="unknown field `surprise`"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"surprise": 1}), type=tp)


def test_batch_carries_values_and_errors_in_order() -> None:
    spec = SandboxSpec(image="python")
    info = SandboxInfo(id="sb-1", node="e1", state="running", spec=spec, created_at=1.0,
                       last_active_at=2.0)
    err = NotFound("sandbox sb-2 not found", sandbox_id="sb-2")
    batch = Batch[SandboxInfo].of([info, err])
    for codec in (msgspec.msgpack, msgspec.json):
        back = codec.decode(codec.encode(batch), type=Batch[SandboxInfo])
        got = back.results()
        assert got[0] == info
        assert isinstance(got[1], NotFound)
        assert got[1].message == "sandbox sb-2 not found"
        assert got[1].detail == {"sandbox_id": "sb-2"}
    assert Outcome[SandboxInfo].of(info).result() == info


def test_a_batch_of_one_type_refuses_items_of_another() -> None:
    wire = msgspec.msgpack.encode(Batch.of([SandboxRef(id="x")]))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(wire, type=Batch[SandboxInfo])


def test_exec_deadlines_follow_the_command_timeout() -> None:
    margin = ops.EXEC_DEADLINE_MARGIN_S
    call = ExecCall(id="sb-1", req=ExecRequest(argv=("true",), timeout_s=5.0))
    assert ops.EXEC.deadline is not None and ops.EXEC.deadline(call) == 5.0 + margin
    assert ops.EXEC_STREAM.deadline is not None
    forever = ExecCall(id="sb-1", req=ExecRequest(argv=("true",), timeout_s=None))
    assert ops.EXEC.deadline(forever) is None
    background = ExecCall(id="sb-1", req=ExecRequest(argv=("sleep", "1d"), timeout_s=None,
                                                     background=True))
    assert ops.EXEC.deadline(background) == margin
    many = ops.EXEC_MANY.deadline
    assert many is not None
    assert many(ExecMany(calls=[call, background])) == 5.0 + margin
    assert many(ExecMany(calls=[call, forever])) is None
    assert ops.EXEC_MANY.batch_of is ops.EXEC


def test_effect_and_method_names() -> None:
    assert ops.EXEC.effect and not ops.GET.effect
    assert ops.EXEC.api_method == "api.exec" and ops.EXEC.edge_method == "edge.exec"
    assert ops.CREATE.edge_type is not ops.CREATE.request
    assert ops.GET.edge_type is ops.GET.request
    assert path_params("/v1/images/{ref:path}") == ("ref",)
    assert path_params("/v1/sandboxes/{id}/files") == ("id",)


def test_rows_are_singletons() -> None:
    assert ops.GET == ops.GET and ops.GET != ops.STATS
    assert len({*ALL_OPS}) == 83


def test_a_request_type_names_invalid_input_in_its_error() -> None:
    with pytest.raises(msgspec.ValidationError, match=r"\$\.id"):
        msgspec.json.decode(b'{"id": 5}', type=SandboxRef)


def test_the_vocabulary_and_the_edge_door_are_typed_without_ignores() -> None:
    """The catalogue's point is typing every door from the rows: no escape hatches in the
    vocabulary, the edge's router or its client (the ratchet only goes down)."""
    import pathlib

    import dsec.edge.client
    import dsec.edge.service
    import dsec.wire
    wire = pathlib.Path(dsec.wire.__file__).parent
    # the modules as of the edge door's move (A3/A4); add each new one once it is clean
    files = [*(wire / f"{m}.py" for m in ("__init__", "api", "calls", "jsonform", "node",
                                          "ops", "outcome", "rest", "spec")),
             pathlib.Path(dsec.edge.client.__file__), pathlib.Path(dsec.edge.service.__file__)]
    found = [f"{f.name}:{i}" for f in files
             for i, line in enumerate(f.read_text().splitlines(), 1) if "type: ignore" in line]
    assert not found, found
