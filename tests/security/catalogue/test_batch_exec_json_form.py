"""One exec request, two JSON forms on REST: ``POST /v1/sandboxes/{id}/exec`` takes the
exec JSON form (``stdin`` text, ``stdin_encoding``; output as text with ``encoding``), but
the same request as an item of ``POST /v1/batch/exec`` is msgspec's plain JSON of
``ExecRequest``: ``stdin`` is silently base64-decoded (``"test"`` reaches the command as
the bytes ``b5 eb 2d``; ``"hello world"`` is refused) and stdout comes back base64
(``echo hi`` -> ``"aGkK"``). The plan's one JSON codec (wire/jsonform) is applied only
when a row's body *is* the ExecRequest, not to the ones inside a batch.

Branch i13d: wire/rest.py ``decode_request``/``encode_request`` (jsonform only for
``body="<field>"``), wire/ops.py EXEC_MANY (``body="*"``). Also fails on main (a30dd26): the route came with the
earlier issue-13 streams; i13d owns REST-from-rows now."""

from __future__ import annotations

from typing import Any

import pytest

from tests.security.catalogue.conftest import Doors

REQS: list[dict[str, Any]] = [
    {"argv": ["cat"], "stdin": "hello world"},
    {"argv": ["echo", "hi"]},
]


@pytest.mark.parametrize("req", REQS, ids=["stdin-text", "stdout"])
def test_an_exec_reads_the_same_alone_and_in_a_batch(doors: Doors, req: dict[str, Any]) -> None:
    t = doors.tenant(f"ej{len(str(req))}", f"default/ej{len(str(req))}")
    sid = doors.rest("POST", "/v1/sandboxes", t, json={}).value["id"]
    alone = doors.rest("POST", f"/v1/sandboxes/{sid}/exec", t, json=req)
    assert alone.code == "ok", alone
    batch = doors.rest("POST", "/v1/batch/exec", t, json={"calls": [{"id": sid, "req": req}]})
    assert batch.code == "ok", (f"the exec the single route ran is refused in a batch: "
                                f"{batch.message}")
    item = batch.value["items"][0]
    assert "value" in item, item
    assert item["value"].get("stdout", "") == alone.value["stdout"], (
        f"stdout alone {alone.value['stdout']!r}, in a batch {item['value'].get('stdout')!r}")


def test_stdin_text_that_happens_to_be_base64_reaches_the_command_unchanged(
        doors: Doors) -> None:
    """``cat`` with stdin ``"test"``: alone the command reads ``test``; in a batch it
    reads the base64 decoding of it (echoed back as base64, so its stdout string looks
    the same while the bytes differ)."""
    import base64
    t = doors.tenant("ej-b64", "default/ejb64")
    sid = doors.rest("POST", "/v1/sandboxes", t, json={}).value["id"]
    req = {"argv": ["cat"], "stdin": "test"}
    alone = doors.rest("POST", f"/v1/sandboxes/{sid}/exec", t, json=req).value
    seen_alone = (base64.b64decode(alone["stdout"]) if alone["encoding"] == "base64"
                  else alone["stdout"].encode())
    batch = doors.rest("POST", "/v1/batch/exec", t, json={"calls": [{"id": sid, "req": req}]})
    out = batch.value["items"][0]["value"]
    # the batch's items answer in /exec's form too (text, or base64 with encoding)
    # [amended by i13f: the red team's version read the batch's old base64 form]
    assert out.get("encoding") == alone["encoding"], out
    seen_batch = (base64.b64decode(out["stdout"]) if out.get("encoding") == "base64"
                  else out["stdout"].encode())
    assert seen_alone == b"test"
    assert seen_batch == seen_alone, f"the command read {seen_batch!r} in a batch"
