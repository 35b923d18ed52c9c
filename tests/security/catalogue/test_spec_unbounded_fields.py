"""Spec fields with no MAX_* at any door: ``toolkits`` (count), ``image``/``workspace``
(ref length) and ``network.allow`` (count) are taken at any size a body carries (4 MiB of
REST JSON, 16 MiB of Aether frame). Resolving 400,000 toolkit refs holds the apiserver's
event loop ~3 s (measured: another tenant's ``GET /v1/sandboxes/{id}`` took 2.6 s instead
of 0.05 s), and the spec is then stored, journalled and listed at that size. Every other
list or string of a spec has a limit (env, labels) refused in the same words at every
door; these must too.

Branch: both (wire/spec.py ``SandboxSpec.validate``; the spec is the create request at
every door since i13d's passthrough). Not checked whether main differs (its REST body,
CreateSandboxRequest, had no bound either)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.security.catalogue.conftest import Answer, Doors

CASES: list[tuple[str, dict[str, Any]]] = [
    ("toolkits", {"toolkits": ["tk"] * 100_000}),
    ("image", {"image": "i" * 100_000}),
    ("workspace", {"workspace": "w" * 100_000}),
    # [i13f: main's network policy (wire/netpolicy.py) bounds it: MAX_NET_RULES]
    ("network.allow", {"network": {"mode": "policy", "allow": ["h.example.com"] * 100_000}}),
]


def _refused(a: Answer) -> bool:
    if a.code == "ok" and isinstance(a.value, dict) and "items" in a.value:
        item = a.value["items"][0]
        return "error" in item and item["error"]["code"] == "invalid_argument"
    return a.status == 400 and a.code == "invalid_argument"


@pytest.mark.parametrize("name,spec", CASES, ids=[c[0] for c in CASES])
def test_an_oversized_spec_field_is_refused_at_every_door(doors: Doors, name: str,
                                                          spec: dict[str, Any]) -> None:
    t = doors.tenant(f"big-{name.replace('.', '-')}", f"default/big{len(name)}")
    answers = {
        "rest-create": doors.rest("POST", "/v1/sandboxes", t, json=spec),
        "rest-batch": doors.rest("POST", "/v1/batch/create", t, json={"items": [spec]}),
        "gateway-create": doors.gateway("api.create", {"spec": spec}, t),
        "gateway-batch": doors.gateway("api.create_many", {"items": [spec]}, t),
    }
    taken = [door for door, a in answers.items() if not _refused(a)]
    assert not taken, f"a spec with 100,000-long {name} was accepted by {taken}"
