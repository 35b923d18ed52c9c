"""A ``{id}`` path parameter holding ``/``: the SDK's HTTP transport escapes it
(``%2F``), the server routes on the percent-decoded path, so the request lands on another
row. ``client.call(GET, SandboxRef(id=f"{sid}/events"))`` answers ``events`` of ``sid``
(and fails to decode it as a SandboxInfo: ``remote_protocol_error``); ``DESTROY`` of the
same id is a 405 naming the events route; over aether each is ``sandbox_not_found``. One
request, two different operations by protocol. (No destructive mapping found: a row's
path suffix always follows the id.)

Branch i13d: wire/rest.py ``encode_request`` (``quote(..., safe=":")`` of a plain
``{id}``) and the REST server's routing of decoded paths (control/apiserver.py). Low.
The same encoder is on main (a30dd26); there the test cannot run (no ``protocol=``).

[Amended by i13f: the red team's version built ``SandboxRef(id="sid/events")`` and
expected ``sandbox_not_found`` at both doors; the fix makes an id with '/' no id at all
(wire.spec.check_id: the request type refuses it, so the SDK cannot even build one), and
the REST server refuses a %2F in a segment parameter before routing. Both doors now
answer ``invalid_argument``; the raw requests below are what a non-SDK client sends.]"""

from __future__ import annotations

import httpx
import pytest

from dsec.errors import InvalidArgument
from dsec.wire import ops
from dsec.wire.calls import SandboxRef
from tests.security.catalogue.conftest import Doors, LocalCluster


@pytest.mark.parametrize("op", [ops.GET, ops.DESTROY, ops.STATS], ids=lambda o: o.name)
def test_an_id_with_a_slash_is_the_same_answer_over_http_and_aether(
        cluster: LocalCluster, doors: Doors, op: ops.Op[SandboxRef, object]) -> None:
    t = doors.tenant(f"slash-{op.name}", f"default/slash{op.name}")
    sid = doors.rest("POST", "/v1/sandboxes", t, json={}).value["id"]
    with pytest.raises(InvalidArgument, match="without '/'"):
        SandboxRef(id=f"{sid}/events")
    assert op.rest is not None
    path = op.rest.path.replace("{id}", f"{sid}%2Fevents")
    r = httpx.request(op.rest.method, f"{cluster.url}{path}", headers=t.h, timeout=60)
    gw = doors.gateway(f"api.{op.name}", {"id": f"{sid}/events"}, t)
    assert (r.status_code, r.json()["code"]) == (400, "invalid_argument"), r.text
    assert (gw.status, gw.code) == (400, "invalid_argument"), gw
    # and the sandbox is still there (a DESTROY landed nowhere)
    assert doors.rest("GET", f"/v1/sandboxes/{sid}", t).code == "ok"
