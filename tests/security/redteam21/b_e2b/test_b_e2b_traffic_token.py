"""B8: the E2B create answer's ``trafficAccessToken`` is the caller's API key itself
(mapping.sandbox_created). In E2B it is a per-sandbox token that only opens that
sandbox's traffic (its ports behind ``allow_public_traffic=False``), the one users hand to
browsers and previews (``sandbox.traffic_access_token``, ``get_host()`` URLs); dsec's
port 49999 accepts it as a full credential. Anyone given "the traffic token" of one
sandbox holds the key: every sandbox of every project the key reaches, create, destroy,
keys of its role.

Secure behaviour: a token scoped to the sandbox (and to traffic/code-interpreter calls),
e.g. an HMAC of (sandbox id, key id) verified by the layer, never the key."""

from __future__ import annotations

import httpx
import pytest

from dsec.bench._e2b_calls import E2BTarget

pytestmark = pytest.mark.root


def test_traffic_access_token_is_not_the_api_key(e2b_target: E2BTarget) -> None:
    with httpx.Client(base_url=e2b_target.url, timeout=30,
                      headers={"x-api-key": e2b_target.api_key}) as api:
        r = api.post("/v2/sandboxes", json={"templateID": e2b_target.template,
                                            "timeout": 60})
        assert r.status_code == 201, r.text
        got = r.json()
        try:
            token = got["trafficAccessToken"]
            # what the token can do: list every sandbox of the key's projects
            listed = httpx.get(f"{e2b_target.url}/sandboxes", timeout=30,
                               headers={"x-api-key": token})
            assert token != e2b_target.api_key and listed.status_code == 401, (
                "the trafficAccessToken of one sandbox is the caller's API key: it "
                f"lists {len(listed.json()) if listed.status_code == 200 else '?'} "
                "sandboxes on the control API")
        finally:
            api.delete(f"/sandboxes/{got['sandboxID']}")
