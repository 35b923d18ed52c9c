"""Integer bounds of a create that differ by door, and JSON integers no msgpack door can
carry.

- ``priority`` (higher wins preemption, across projects) is bounded to int32 on
  ``POST /v1/sandboxes`` only (``CreateSandboxRequest.priority: I32``); the same spec through
  ``POST /v1/batch/create``, ``api.create``, ``api.create_many`` (and so the SDK over
  aether, or the SDK's create_many over http) takes any 64-bit value.
  Branch i13d: wire/ops.py CREATE_MANY (body = SandboxSpec items), wire/calls.py
  CreateSandbox/CreateMany, wire/spec.py SandboxSpec.validate (no priority bound).
- A JSON integer beyond 64 bits in a batch item passes REST's decode (the very bug the
  ``I32`` comment in wire/api.py says the schemathesis test found on the single create)
  and fails when re-encoded as msgpack for the edge: the caller's bad input comes back as
  ``edge_unreachable`` (a retryable 503 the SDK retries for create_retry_s) and the
  create-failure metric counts an outage. Branch i13d: wire/rest.py decode_request +
  wire/ops.py CREATE_MANY.
- ``PUT /v1/quotas/{path}`` takes a quota beyond 64 bits (QuotaBody's bounds are
  documentation only, ``_doc``); the project is then unreadable through every Aether door:
  ``api.project_get`` and ``api.projects`` answer ``internal_error``, for every tenant
  whose listing includes it (the superuser's), because the value cannot be msgpack'd. An
  admin of ``default/a`` sets it on their own subproject. Branch i13d: wire/rest.py
  (generic route, JSON ints unbounded), wire/api.py QuotaBody.

On main (a30dd26): the priority test passes (batch items were CreateSandboxRequest, I32):
i13d's passthrough regressed it; the quota test fails on main too.
"""

from __future__ import annotations

import pytest

from tests.security.catalogue.conftest import Doors

HUGE = 10**30          # a JSON number; msgpack carries at most 2**64 - 1


@pytest.mark.parametrize("priority", [2**31, 2**63 - 1, -(2**63)])
def test_priority_bound_is_the_same_at_every_create_door(doors: Doors, priority: int) -> None:
    a = doors.tenant(f"prio{abs(priority) % 997}", "default/prio")
    answers = {
        "rest-create": doors.rest("POST", "/v1/sandboxes", a, json={"priority": priority}),
        "rest-batch": doors.rest("POST", "/v1/batch/create", a,
                                 json={"items": [{"priority": priority}]}),
        "gateway-create": doors.gateway("api.create", {"spec": {"priority": priority}}, a),
        "gateway-batch": doors.gateway("api.create_many",
                                       {"items": [{"priority": priority}]}, a),
    }

    def accepted(ans: object) -> bool:
        from tests.security.catalogue.conftest import Answer
        assert isinstance(ans, Answer)
        if ans.code != "ok":
            return False
        v = ans.value
        if isinstance(v, dict) and "items" in v:      # a batch: its one item
            return "value" in v["items"][0]
        return True
    verdicts = {door: accepted(ans) for door, ans in answers.items()}
    assert verdicts["rest-create"] is False          # int32 on the single REST create
    assert len(set(verdicts.values())) == 1, (
        f"priority={priority} accepted by some create doors and refused by others: "
        f"{verdicts}")


def test_a_json_integer_beyond_64_bits_in_a_batch_item_is_a_400_not_an_outage(
        doors: Doors) -> None:
    a = doors.tenant("bigint", "default/bigint")
    single = doors.rest("POST", "/v1/sandboxes", a,
                        content=b'{"priority": %d}' % HUGE)
    assert single.status == 400 and single.code == "invalid_argument", single
    batch = doors.rest("POST", "/v1/batch/create", a,
                       content=b'{"items": [{"priority": %d}]}' % HUGE)
    if batch.code == "ok":
        item = batch.value["items"][0]
        assert "error" in item, item
        err = item["error"]
        assert err["code"] == "invalid_argument", (
            f"the caller's out-of-range priority is answered as {err['code']}: "
            f"{err['message']}")
    else:
        assert batch.status == 400 and batch.code == "invalid_argument", batch


def test_a_quota_beyond_64_bits_does_not_make_projects_unreadable_over_aether(
        doors: Doors) -> None:
    adm = doors.tenant("qadmin", "default/qa", role="admin")
    put = doors.rest("PUT", "/v1/quotas/default/qa/sub", adm,
                     content=b'{"cpu_milli": %d}' % HUGE)
    # either REST refuses it as the gateway's msgpack could never carry it...
    if put.code != "ok":
        assert put.status == 400, put
        return
    # ... or every door can still read the project back
    mine = doors.gateway("api.project_get", {"path": "default/qa/sub"}, adm)
    everyone = doors.gateway("api.projects", {}, doors.admin)
    assert (mine.code, everyone.code) == ("ok", "ok"), (
        f"after {adm.name} set a {HUGE} quota on its subproject: project_get -> "
        f"{mine.code} ({mine.message[:120]}); the superuser's projects -> {everyone.code}")
