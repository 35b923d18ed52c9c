"""Batches through REST and the gateway: the per-principal rate limit is charged one token
per *request*, so one ``exec_many`` (up to MAX_BATCH_ITEMS = 100,000 commands; no
apiserver cap like create_many's 1,024) or ``create_many`` runs thousands of operations
that the same principal is refused (429) one by one. A tenant held to 2 requests/s runs
5,000 commands in one request.

Branch i13d (REST ``POST /v1/batch/exec`` and ``/v1/batch/create`` are new doors from the
rows wire/ops.py EXEC_MANY/CREATE_MANY); the policy is control/api/service.py
(``authenticate`` charges 1 token; ``exec_many`` has no batch cap; the gateway door had
the same gap on main). Also fails on main (a30dd26), REST and gateway alike."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.security.catalogue.conftest import Doors, LocalCluster

# serial: per-principal token buckets refilled by wall time (rate 2/s, burst 4): beside
# other tests the requests are slower than the refill and none is refused
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def limited() -> Iterator[Doors]:
    with LocalCluster(edges=1, rate_per_s=2.0) as cl:
        yield Doors(cl)


def _spent(d: Doors, sid: str, t: object) -> None:
    """Empty the principal's bucket with single execs until one is refused."""
    for _ in range(50):
        if d.rest("POST", f"/v1/sandboxes/{sid}/exec", t,  # type: ignore[arg-type]
                  json={"argv": ["true"]}).code == "rate_limited":
            return
    raise AssertionError("the rate limit never refused a single exec")


@pytest.mark.parametrize("door", ["rest", "gateway"])
def test_a_batch_does_not_bypass_the_per_principal_rate_limit(limited: Doors,
                                                              door: str) -> None:
    d = limited
    t = d.tenant(f"rl-{door}", f"default/rl{door}")
    time.sleep(2.5)                     # the new key's bucket: full (burst 4)
    sid = d.rest("POST", "/v1/sandboxes", t, json={}).value["id"]
    time.sleep(2.5)
    _spent(d, sid, t)
    time.sleep(1.0)                     # ~2 tokens back: one more request is allowed
    calls = [{"id": sid, "req": {"argv": ["true"]}}] * 5000
    ans = (d.rest("POST", "/v1/batch/exec", t, json={"calls": calls}) if door == "rest"
           else d.gateway("api.exec_many", {"calls": calls}, t))
    ran = 0 if ans.code != "ok" else sum(1 for it in ans.value["items"] if "value" in it)
    assert ran <= 10, (
        f"a principal limited to 2 requests/s, refused single execs a second earlier, ran "
        f"{ran} commands in one {door} exec_many")


@pytest.mark.parametrize("door", ["rest", "gateway"])
def test_exec_many_is_capped_like_create_many(doors: Doors, door: str) -> None:
    """[i13f] exec_many had no apiserver cap (100,000 items vs create_many's 1,024)."""
    t = doors.tenant(f"cap-{door}", f"default/cap{door}")
    sid = doors.rest("POST", "/v1/sandboxes", t, json={}).value["id"]
    calls = [{"id": sid, "req": {"argv": ["true"]}}] * 1025
    ans = (doors.rest("POST", "/v1/batch/exec", t, json={"calls": calls}) if door == "rest"
           else doors.gateway("api.exec_many", {"calls": calls}, t))
    assert (ans.status, ans.code) == (400, "invalid_argument"), ans
    assert "1025 calls" in ans.message and "1024" in ans.message, ans.message


@pytest.mark.parametrize("door", ["rest", "gateway"])
def test_a_batch_within_the_burst_costs_a_token_per_item(limited: Doors, door: str) -> None:
    """[i13f] A batch the bucket cannot pay for item by item is a 429, like that many
    single requests would be; a batch over the burst is refused naming the limit."""
    d = limited
    t = d.tenant(f"rl3-{door}", f"default/rl3{door}")
    time.sleep(2.5)
    sid = d.rest("POST", "/v1/sandboxes", t, json={}).value["id"]
    time.sleep(2.5)
    _spent(d, sid, t)
    time.sleep(0.6)                     # ~1 token back: one request, not three
    calls = [{"id": sid, "req": {"argv": ["true"]}}] * 3
    ans = (d.rest("POST", "/v1/batch/exec", t, json={"calls": calls}) if door == "rest"
           else d.gateway("api.exec_many", {"calls": calls}, t))
    assert ans.code == "rate_limited", ans
    time.sleep(2.5)
    big = [{"id": sid, "req": {"argv": ["true"]}}] * 5     # burst is 4
    ans = (d.rest("POST", "/v1/batch/exec", t, json={"calls": big}) if door == "rest"
           else d.gateway("api.exec_many", {"calls": big}, t))
    assert ans.code == "invalid_argument" and "at most 4" in ans.message, ans
