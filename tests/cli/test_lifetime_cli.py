"""``dsec sandbox stats ID`` and ``dsec sandbox timeout ID S [--extend]`` (issue 19)
against a real LocalCluster, and the SDK's stats over both transports and REST."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from click.testing import CliRunner

from dsec.cli.main import cli
from dsec.cluster.local import LocalCluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(edges=1) as cl:
        yield cl


def _run(cluster: LocalCluster, *args: str) -> tuple[int, str]:
    env = {"DSEC_URL": cluster.url, "DSEC_API_KEY": cluster.api_key}
    r = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)
    return r.exit_code, r.output


def test_stats_and_timeout_commands(cluster: LocalCluster) -> None:
    code, out = _run(cluster, "sandbox", "create", "--ttl", "600", "--json")
    assert code == 0, out
    sid = json.loads(out)[0]["id"]
    code, out = _run(cluster, "sandbox", "stats", sid, "--json")
    assert code == 0, out
    st = json.loads(out)
    assert st["cpu_interval_s"] >= 0.2 and "cpu_percent" in st
    code, out = _run(cluster, "sandbox", "stats", sid)
    assert code == 0 and "memory" in out and "cpu" in out and "network" in out
    code, out = _run(cluster, "sandbox", "timeout", sid, "120", "--json")
    assert code == 0, out
    first = json.loads(out)["expires_at"]
    code, out = _run(cluster, "sandbox", "timeout", sid, "30", "--extend", "--json")
    assert json.loads(out)["expires_at"] == pytest.approx(first + 30, abs=1)
    code, out = _run(cluster, "sandbox", "timeout", sid, "60")
    assert code == 0 and "expires at" in out
    assert _run(cluster, "sandbox", "pause", sid)[0] == 0
    code, out = _run(cluster, "sandbox", "timeout", sid, "90")
    assert code == 0 and "90s left when it resumes" in out, out
    code, out = _run(cluster, "sandbox", "timeout", sid, "0")
    assert code == 1 and "timeout_s" in out
    # REST, as the SDK and the CLI see it
    h = {"authorization": f"Bearer {cluster.api_key}"}
    r = httpx.get(f"{cluster.url}/v1/sandboxes/{sid}", headers=h)
    assert r.json()["ttl_left_s"] == 90 and r.json()["paused_reason"] == "requested"
    r = httpx.post(f"{cluster.url}/v1/sandboxes/{sid}/timeout", headers=h,
                   json={"timeout_s": 10, "extend": True})
    assert r.status_code == 200 and r.json()["ttl_left_s"] == 100
    assert _run(cluster, "sandbox", "rm", sid)[0] == 0
