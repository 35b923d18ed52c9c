"""The E2B layer's pure parts, without a server: the code interpreter's NDJSON events and
context records (hostile bytes from the sandbox), the list view's order, filters and key
tokens, and the lifecycle fields of a create body."""

from __future__ import annotations

import json

import pytest

from dsec.code import CodeError, CodeResult, Execution
from dsec.control.e2b import code as codeapi
from dsec.control.e2b import mapping
from dsec.errors import InvalidArgument
from dsec.wire.spec import SandboxInfo, SandboxSpec


def test_execute_lines_are_e2bs_events_in_order() -> None:
    ex = Execution(stdout="out\n", stderr="err\n", execution_count=3, results=[
        CodeResult(data={"text/plain": "'side'"}),
        CodeResult(data={"text/plain": "P()", "text/html": "<b/>", "image/png": "iVBO",
                         "application/json": '{"a": 1}', "application/x-custom": "z"},
                   is_main_result=True)],
        error=CodeError(name="ValueError", value="bad", traceback="tb"))
    lines = codeapi.execute_lines(ex, now_ns=5)
    assert all(line.endswith(b"\n") and line.count(b"\n") == 1 for line in lines)
    events = [json.loads(line) for line in lines]
    assert [e["type"] for e in events] == ["stdout", "stderr", "result", "result", "error",
                                           "number_of_executions", "end_of_execution"]
    assert events[0] == {"type": "stdout", "text": "out\n", "timestamp": 5}
    main = events[3]
    assert main == {"type": "result", "is_main_result": True, "text": "P()", "html": "<b/>",
                    "png": "iVBO", "json": {"a": 1}, "extra": {"application/x-custom": "z"}}
    assert events[4] == {"type": "error", "name": "ValueError", "value": "bad",
                         "traceback": "tb"}
    assert events[5] == {"type": "number_of_executions", "execution_count": 3}
    quiet = [json.loads(x)["type"] for x in codeapi.execute_lines(Execution(), 0)]
    assert quiet == ["number_of_executions", "end_of_execution"]


def test_context_records_from_the_sandbox_are_checked() -> None:
    cid = "ctx-0123456789abcdef"
    good = json.dumps(codeapi.context_record(cid, "python", "/tmp")).encode()
    assert codeapi.parse_context(good, cid) == {"id": cid, "language": "python",
                                                "cwd": "/tmp"}
    for bad in (b"{", b"[]", json.dumps({"id": "ctx-other", "language": "python",
                                         "cwd": "/"}).encode(),
                json.dumps({"id": cid, "language": 1, "cwd": "/"}).encode(),
                b" " * (codeapi.MAX_CONTEXT_RECORD + 1)):
        assert codeapi.parse_context(bad, cid) is None
    for bad_id in ("../x", "ctx-0123", "ctx-0123456789ABCDEF", 7, None):
        with pytest.raises(InvalidArgument):
            codeapi.check_context_id(bad_id)
    assert codeapi.check_language(None) == codeapi.check_language("python") == "python"
    with pytest.raises(InvalidArgument, match="language 'js' is not supported"):
        codeapi.check_language("js")


def _info(sid: str, created: float, image: str = "default/e2b-base") -> SandboxInfo:
    return SandboxInfo(id=sid, node="n", state="running", spec=SandboxSpec(image=image),
                       created_at=created, last_active_at=created)


def test_list_view_orders_filters_and_pages_by_key() -> None:
    assert mapping.ListView.of(order=None, started_after=None, template=None) is None
    rows = [_info("sb-b", 2.0), _info("sb-a", 2.0), _info("sb-c", 1.0, "other:1")]
    asc = mapping.ListView.of(order="asc", started_after=None, template=None)
    assert asc is not None
    assert [i.id for i in asc.sorted(rows, None)] == ["sb-c", "sb-a", "sb-b"]
    tok = asc.token(rows[1])                                  # after sb-a
    assert asc.sorted(rows, mapping.ListView.token_key(tok)) == [rows[0]]
    desc = mapping.ListView.of(order="desc", started_after=None, template=None)
    assert desc is not None
    assert [i.id for i in desc.sorted(rows, mapping.ListView.token_key(
        desc.token(rows[0])))] == ["sb-a", "sb-c"]
    for tmpl, keeps in (("e2b-base", [True, True, False]), ("other", [False, False, True]),
                        ("other:1", [False, False, True]),
                        ("default/e2b-base", [True, True, False])):
        v = mapping.ListView.of(order=None, started_after=None, template=tmpl)
        assert v is not None and [v.keeps(i) for i in rows] == keeps, tmpl
    v = mapping.ListView.of(order=None, started_after="1970-01-01T00:00:01.5+00:00",
                            template=None)
    assert v is not None and [v.keeps(i) for i in rows] == [True, True, False]
    for bad in ("", "k", "k:x:y", "k:1.0:", "z:1.0:sb-a", "k:1.0:" + "x" * 200):
        assert mapping.ListView.token_key(bad) is None, bad
    with pytest.raises(InvalidArgument, match="asc or desc"):
        mapping.ListView.of(order="up", started_after=None, template=None)
    with pytest.raises(InvalidArgument, match="ISO 8601"):
        mapping.ListView.of(order=None, started_after="yesterday", template=None)


def test_create_lifecycle_fields() -> None:
    def ttl_action(**body: object) -> str:
        return mapping.create_request({"templateID": "t", **body},
                                      max_ttl_s=100.0).ttl_action
    assert ttl_action() == "destroy"
    assert ttl_action(autoPause=False, autoResume={"enabled": False}) == "destroy"
    assert ttl_action(autoPause=True, autoResume={"enabled": True},
                      autoPauseMemory=False) == "pause"
    for bad in ({"autoPause": "yes"}, {"autoResume": True}, {"autoResume": {}}):
        with pytest.raises(InvalidArgument):
            ttl_action(**bad)
    # autoResume off: the label the layer reads back (and only then); a caller may set
    # that one dsec.io label (it only ever refuses a resume), never another
    from dsec.wire.spec import reserved_label

    def labels(**body: object) -> dict[str, str]:
        return mapping.create_request({"templateID": "t", **body}, max_ttl_s=100.0).labels
    assert labels(autoPause=True, autoResume={"enabled": False}) == {
        mapping.AUTO_RESUME_LABEL: "false"}
    assert labels(autoResume={"enabled": True}) == {} == labels()
    assert not reserved_label(mapping.AUTO_RESUME_LABEL)
    assert reserved_label("e2b.dsec.io/other")
