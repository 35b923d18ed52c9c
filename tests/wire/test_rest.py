"""The REST form of every row, both ways: what the SDK encodes (``encode_request``) the
server decodes (``decode_request``) into the very request, for every REST row of the
catalogue; and what the server refuses it refuses by name. Pure: no server.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from dsec.errors import DsecError, InvalidArgument
from dsec.wire import ops
from dsec.wire.calls import CreateSandbox
from dsec.wire.ops import Op
from dsec.wire.rest import decode_request, encode_request
from dsec.wire.spec import ExecRequest, NetworkPolicy, SandboxSpec

from ..test_catalogue import EXAMPLES


class _Names:
    """What the catalogue's examples name, as fixed strings (nothing is called)."""

    sid = "sb-0123456789ab-edge-0"
    snap = "sha256:" + "ab" * 32
    image = "sha256:" + "cd" * 32
    tmp = "/tmp"
    oci = "/tmp/oci.tar"
    built = "sha256:" + "ef" * 32

    def n(self) -> int:
        return 7

    def __getattr__(self, name: str) -> Any:   # sandbox(), session(), key(), dir(), ...
        return lambda *a, **kw: {"session": "ses-0123456789abcdef",
                                 "key": "0123456789abcdef", "dir": "/tmp/d",
                                 "image_name": "cat-x:latest", "pinned": self.image,
                                 "process": 42, "pty_process": 43}.get(name, self.sid)


def _path_params(op: Op[Any, Any], path: str) -> dict[str, str]:
    """The path parameters of a request path, by the row's template (the server's
    router's job)."""
    assert op.rest is not None
    pattern = re.sub(r"\\\{(\w+)(?::path)?\\\}",
                     lambda m: f"(?P<{m.group(1)}>.+)" if ":path" in m.group(0)
                     else f"(?P<{m.group(1)}>[^/]+)", re.escape(op.rest.path))
    m = re.fullmatch(pattern, path)
    assert m is not None, (op.rest.path, path)
    from urllib.parse import unquote
    return {k: unquote(v) for k, v in m.groupdict().items()}


def _round_trip(op: Op[Any, Any], body: Any) -> Any:
    r = encode_request(op, body)
    return decode_request(op, _path_params(op, r.path), r.params, r.headers, r.content)


REST_ROWS = [op for op in ops.REST_OPS if op.name in EXAMPLES]


def test_every_rest_row_has_an_example() -> None:
    assert {op.name for op in ops.REST_OPS} == {op.name for op in REST_ROWS}


@pytest.mark.parametrize("op", REST_ROWS, ids=lambda op: op.name)
def test_the_server_decodes_what_the_sdk_encodes(op: Op[Any, Any]) -> None:
    body = EXAMPLES[op.name](_Names())      # type: ignore[arg-type]
    assert _round_trip(op, body) == body


def test_a_spec_with_every_field_set_crosses_rest_unchanged() -> None:
    spec = SandboxSpec(
        image="python", workspace="ws:1", toolkits=("tk:1",), snapshot="sha256:" + "e" * 64,
        backend="container", cpu_milli=1500, memory_bytes=256 << 20, disk_bytes=1 << 30,
        pids_max=None, priority=7, labels={"a": "b"}, project="team/x", ttl_s=60.0,
        idle_timeout_s=5.0, idle_action="pause", env={"E": "1"},
        network=NetworkPolicy(mode="policy", allow=("pypi.org:443",)), allow_nested=True,
        user_namespace=True)
    body = CreateSandbox(spec=spec, session="ses-1", idempotency_key="k1")
    assert _round_trip(ops.CREATE, body) == body
    # left to the server: null on the wire, None again at the server
    bare = CreateSandbox(spec=SandboxSpec())
    assert _round_trip(ops.CREATE, bare).spec.backend is None


def test_query_parameters_are_typed_by_the_request_and_refused_by_name() -> None:
    sid = _Names.sid
    with pytest.raises(InvalidArgument, match="unknown query parameter 'parnets' for the "
                       r"mkdir request \(it takes: parents, path, user\)") as ei:
        decode_request(ops.MKDIR, {"id": sid}, [("path", "/a"), ("parnets", "0")], {}, None)
    assert ei.value.detail["field"] == "parnets"
    with pytest.raises(InvalidArgument, match="must be true or false"):
        decode_request(ops.MKDIR, {"id": sid}, [("path", "/a"), ("parents", "maybe")], {},
                       None)
    with pytest.raises(InvalidArgument, match="offset='x' must be an integer"):
        decode_request(ops.READ_FILE, {"id": sid}, [("path", "/a"), ("offset", "x")], {},
                       None)
    with pytest.raises(InvalidArgument, match="must be key=value"):
        decode_request(ops.LIST, {}, [("label", "nokey")], {}, None)
    # the request type's own check runs, in its own words (a negative offset)
    with pytest.raises(DsecError, match="must be >= 0"):
        decode_request(ops.READ_FILE, {"id": sid}, [("path", "/a"), ("offset", "-1")], {},
                       None)
    # a required field missing is named
    with pytest.raises(InvalidArgument, match="the stat request does not decode: Object "
                       "missing required field `path`"):
        decode_request(ops.STAT, {"id": sid}, [], {}, None)


def test_a_json_body_is_refused_in_the_words_of_every_door() -> None:
    with pytest.raises(InvalidArgument, match=r"the quota_set request does not decode: "
                       r"Expected `int \| null`, got `str` - at `\$.quota.max_sandboxes`"):
        decode_request(ops.QUOTA_SET, {"path": "team"}, [], {},
                       b'{"max_sandboxes": "many"}')
    with pytest.raises(InvalidArgument, match="empty request body"):
        decode_request(ops.QUOTA_SET, {"path": "team"}, [], {}, b"")
    with pytest.raises(InvalidArgument, match="malformed JSON body"):
        decode_request(ops.EXEC, {"id": _Names.sid}, [], {}, b"{")
    # exec's JSON form (ExecBody) is the body: its limits answer as the type says
    req = decode_request(ops.EXEC, {"id": _Names.sid}, [], {}, b'{"argv": ["true"]}')
    assert req.req == ExecRequest(argv=("true",))
