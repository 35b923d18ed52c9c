"""[i13f] A create binds its sandbox to a client session (the sweeper destroys it when
the session lapses). The session must be a live one of the caller's own principal, at
every door and in either spelling (``session`` or the ``dsec.io/session`` label): before,
any id was taken, so a tenant could bind its sandboxes to another principal's session
(or to an id that does not exist)."""

from __future__ import annotations

import httpx
import pytest

from tests.security.catalogue.conftest import Doors


def _session(d: Doors, key: str) -> str:
    r = httpx.post(f"{d.cl.url}/v1/sessions", headers={"authorization": f"Bearer {key}"},
                   json={"lease_s": 60}, timeout=30)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


@pytest.mark.parametrize("how", ["rest-query", "rest-body", "rest-label", "gateway",
                                 "gateway-batch"])
def test_a_create_cannot_bind_to_another_principals_session(doors: Doors, how: str) -> None:
    victim = doors.tenant(f"sv-{how}", f"default/sv{how.replace('-', '')}")
    mallory = doors.tenant(f"sm-{how}", f"default/sm{how.replace('-', '')}")
    theirs, mine = _session(doors, victim.key), _session(doors, mallory.key)

    def create(sid: str) -> tuple[str, str]:
        if how == "rest-query":
            a = doors.rest("POST", f"/v1/sandboxes?session={sid}", mallory, json={})
        elif how == "rest-body":
            a = doors.rest("POST", "/v1/sandboxes", mallory, json={"session": sid})
        elif how == "rest-label":
            a = doors.rest("POST", "/v1/sandboxes", mallory,
                           json={"labels": {"dsec.io/session": sid}})
        elif how == "gateway":
            a = doors.gateway("api.create", {"spec": {}, "session": sid}, mallory)
        else:
            a = doors.gateway("api.create_many", {"items": [{}], "session": sid}, mallory)
            if a.code == "ok":
                item = a.value["items"][0]
                return ("ok", "") if "value" in item else (item["error"]["code"],
                                                           item["error"]["message"])
        return a.code, a.message
    assert create(mine)[0] == "ok"
    code, msg = create(theirs)
    assert code == "not_found" and "no session" in msg, (code, msg)
    code, _ = create("ses-0000000000000000")
    assert code == "not_found"
