"""Red team B (issue 19, every door): the E2B door writes no access log at all.

``--access-log`` records REST requests and Aether gateway calls; the E2B-compatible
listener (``dsec up --e2b``: its control REST and envd's Connect-RPC, the same
sandboxes, keys and admin power) logs nothing there, refused attempts included. An
operator auditing who touched what sees the E2B door's traffic nowhere.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import pytest

from dsec.cluster.local import LocalCluster
from dsec.logs import configure


@pytest.fixture
def e2b_with_access_log(tmp_path) -> Iterator[tuple[LocalCluster, str]]:  # type: ignore[no-untyped-def]
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    path = str(tmp_path / "access.log")
    configure("info", "json", access_log=path)
    try:
        with LocalCluster(edges=1, e2b="127.0.0.1:0") as cl:
            yield cl, path
    finally:
        configure("warning", "text")
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)


def test_b_the_e2b_door_is_in_the_access_log(e2b_with_access_log) -> None:  # type: ignore[no-untyped-def]
    cl, path = e2b_with_access_log
    url = cl.runtime.e2b_url
    ok = httpx.get(f"{url}/sandboxes", headers={"x-api-key": cl.api_key}, timeout=30)
    assert ok.status_code == 200, ok.text
    bad = httpx.get(f"{url}/sandboxes", headers={"x-api-key": "dsec_wrong"}, timeout=30)
    assert bad.status_code == 401, bad.text
    for h in logging.getLogger("dsec.access").handlers:
        h.flush()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert "/sandboxes" in text and "401" in text, (
        f"two E2B requests (200 and 401), access log: {text!r}")
