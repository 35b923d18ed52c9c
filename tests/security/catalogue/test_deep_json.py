"""Bad input is a 400, never a 500: the generic REST route decodes a row's body *field*
(``PUT /v1/quotas/{path}``'s ``quota``) as untyped JSON first (wire/rest.py
``_json_body(..., Any, ...)``) and catches only ``msgspec.DecodeError``; 1,000 nested
brackets (a 2 KB body) raise ``RecursionError`` inside msgspec, which comes out as
``500 internal_error`` with a stack trace in the apiserver's log, for any key holder (a
reader; the body is decoded before the admin check). The typed decodes of every other
route refuse the same body as a 400.

Branch i13d: wire/rest.py ``decode_request``/``_json_body``. Regression: passes on main
(a30dd26), whose quota route decoded the body as the typed QuotaBody."""

from __future__ import annotations

import pytest

from tests.security.catalogue.conftest import Doors

DEEP = [b"[" * 1000 + b"]" * 1000, b'{"a":' * 1000 + b"1" + b"}" * 1000]


@pytest.mark.parametrize("body", DEEP, ids=["arrays", "objects"])
def test_deeply_nested_json_is_a_400_at_every_json_route(doors: Doors, body: bytes) -> None:
    r = doors.tenant(f"deep{len(body)}", f"default/deep{len(body)}", role="reader")
    routes = [("PUT", f"/v1/quotas/default/deep{len(body)}"), ("POST", "/v1/sandboxes"),
              ("POST", "/v1/batch/create"), ("POST", "/v1/keys"), ("POST", "/v1/images/tag")]
    got = {path: doors.rest(method, path, r, content=body) for method, path in routes}
    bad = {p: f"{a.status} {a.code}: {a.message[:80]}" for p, a in got.items()
           if a.status >= 500}
    assert not bad, f"nested JSON answered with a server error: {bad}"
