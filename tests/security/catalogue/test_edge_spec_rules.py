"""The edge door takes a spec whose project is no project path (``Default/../x``); the API
doors refuse it in one set of words (``invalid project path ...``). Sandboxes made at the
edge directly (``EdgeClient``, the RL toolkit's ``EdgeAccess``) are adopted by the control
plane's reconcile under whatever project they say, so the one rule every door must hold
is held by three of four.

Branch i13d: wire/spec.py ``resolve``/``SandboxSpec.validate`` (the project is checked by
the apiserver's ``build_spec`` only, control/api/service.py), edge/node.py ``create``.
Low severity: the edge door needs root on the node (0600 socket) or its token. Also
fails on main (a30dd26)."""

from __future__ import annotations

from tests.security.catalogue.conftest import Doors


def test_an_invalid_project_path_is_refused_at_the_edge_too(doors: Doors) -> None:
    t = doors.tenant("edgeproj", "default/edgeproj")
    spec = {"project": "Default/../x"}
    api = doors.gateway("api.create", {"spec": spec}, t)
    assert api.code == "invalid_argument", api
    edge = doors.edge("edge.create", {"spec": spec})
    assert (edge.code, edge.message) == (api.code, api.message), (
        f"the edge answered {edge.code} ({edge.message[:100]}) to a spec the API doors "
        f"refuse: {api.message}")
