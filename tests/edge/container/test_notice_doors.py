"""A sandbox hitting its task limit is a notice every door shows: the SDK over the Aether
gateway, the SDK over HTTP, and plain REST (the edge itself: test_node_events.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import httpx
import pytest

from dsec.cluster.local import LocalCluster

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(edges=1, backend="container") as cl:
        yield cl


def test_pids_limit_notice_through_sdk_and_rest(cluster: LocalCluster) -> None:
    with cluster.client(protocol="aether") as gw, cluster.client(protocol="http") as http:
        sb = gw.sandboxes.create(pids_max=24, memory="256MiB")
        try:
            r = sb.exec("i=0; while [ $i -lt 60 ]; do sleep 30 & i=$((i+1)); done",
                        timeout=30)
            assert b"can't fork" in r.stderr, r
            seen = {}
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and len(seen) < 3:
                for door, evs in (
                        ("gateway", [e.reason for e in sb.events()]),
                        ("sdk-http", [e.reason for e in http.sandboxes.get(sb.id).events()]),
                        ("rest", [e["reason"] for e in httpx.get(
                            f"{cluster.url}/v1/sandboxes/{sb.id}/events",
                            headers={"authorization": f"Bearer {cluster.api_key}"}).json()["items"]])):
                    if "pids_limit" in evs:
                        seen[door] = evs.count("pids_limit")
                time.sleep(0.05)
            assert seen == {"gateway": 1, "sdk-http": 1, "rest": 1}, seen
            assert gw.sandboxes.get(sb.id).info.state == "running"
        finally:
            sb.kill()
