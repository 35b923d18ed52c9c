"""``dsec sandbox`` / ``dsec node`` against a real LocalCluster, and ``dsec up`` lifecycle."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

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


def test_sandbox_commands(cluster: LocalCluster) -> None:
    code, out = _run(cluster, "sandbox", "create", "-n", "2", "--label", "cli=1", "--json")
    assert code == 0, out
    ids = [s["id"] for s in json.loads(out)]
    code, out = _run(cluster, "sandbox", "ls", "--label", "cli=1", "--json")
    assert sorted(s["id"] for s in json.loads(out)) == sorted(ids)
    code, out = _run(cluster, "sandbox", "ls", "--label", "cli=1")
    assert code == 0 and sorted(x.split()[0] for x in out.splitlines()[1:]) == sorted(ids)
    code, out = _run(cluster, "sandbox", "exec", ids[0], "echo", "hi")
    assert code == 0 and out == "hi\n"
    code, _ = _run(cluster, "sandbox", "exec", ids[0], "--shell", "exit 5")
    assert code == 5
    assert _run(cluster, "sandbox", "pause", ids[0])[0] == 0
    code, out = _run(cluster, "sandbox", "get", ids[0], "--json")
    assert json.loads(out)["state"] == "paused"
    assert _run(cluster, "sandbox", "resume", ids[0])[0] == 0
    code, out = _run(cluster, "sandbox", "events", ids[0], "--json")
    assert [e["to_state"] for e in json.loads(out)][-1] == "running"
    assert _run(cluster, "sandbox", "rm", *ids)[0] == 0
    assert _run(cluster, "sandbox", "rm", *ids)[0] == 0
    code, out = _run(cluster, "sandbox", "get", "sb-000000000000-edge-0")
    assert code == 1 and "sandbox_not_found" in out
    code, out = _run(cluster, "node", "ls", "--json")
    assert [n["id"] for n in json.loads(out)] == ["edge-0"]
    assert "edge-0" in _run(cluster, "node", "ls")[1]


def test_sandbox_network_commands(cluster: LocalCluster) -> None:
    """create --allow/--deny, then `dsec sandbox network` shows and replaces the policy;
    a bad entry is refused before anything is sent."""
    code, out = _run(cluster, "sandbox", "create", "--allow", "PyPI.org:443",
                     "--allow", "*.pythonhosted.org:443", "--deny", "203.0.113.0/24", "--json")
    assert code == 0, out
    sid = json.loads(out)[0]["id"]
    code, out = _run(cluster, "sandbox", "network", sid, "--json")
    view = json.loads(out)
    assert view["policy"] == {"mode": "policy", "allow": ["pypi.org:443",
                                                          "*.pythonhosted.org:443"],
                              "deny": ["203.0.113.0/24"]}
    assert view["generation"] == 1
    code, out = _run(cluster, "sandbox", "network", sid, "--mode", "none", "--json")
    assert code == 0 and json.loads(out)["policy"] == {} and json.loads(out)["generation"] == 2
    code, out = _run(cluster, "sandbox", "network", sid)
    assert code == 0 and "generation" in out and "none" in out
    code, out = _run(cluster, "sandbox", "network", sid, "--allow", "203.0.113.5/24")
    assert code == 2 and "did you mean 203.0.113.0/24?" in out
    code, out = _run(cluster, "sandbox", "create", "--network", "none", "--allow", "a.org")
    assert code == 2 and "under mode 'none'" in out
    assert _run(cluster, "sandbox", "rm", sid)[0] == 0


def test_dsec_up_stops_cleanly_on_sigterm(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM destroys every sandbox and removes local.json; --keep leaves them for the
    next start to re-adopt."""
    from dsec import Client

    state = str(tmp_path / "st")

    def start(*extra: str) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
        p = subprocess.Popen([sys.executable, "-c", "from dsec.cli.main import main; main()",
                              "up", "--state-dir", state, "--listen", "127.0.0.1:0",
                              "--quiet", *extra], stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with open(os.path.join(state, "local.json")) as f:
                    local = json.load(f)
                if local["pid"] == p.pid:
                    return p, local
            except (OSError, ValueError):
                pass
            assert p.poll() is None, p.stderr.read() if p.stderr else b""
            time.sleep(0.05)
        raise AssertionError("dsec up did not start")

    p, local = start("--keep")
    try:
        with Client(local["url"], local["api_key"], session_lease_s=None) as c:
            kept = c.sandboxes.create(detached=True).id
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
    assert not os.path.exists(os.path.join(state, "local.json"))
    p, local = start()
    try:
        with Client(local["url"], local["api_key"], session_lease_s=None) as c:
            assert c.sandboxes.get(kept).state == "running"  # re-adopted
    finally:
        p.send_signal(signal.SIGINT)
        assert p.wait(30) == 0
    p, local = start()
    try:
        with Client(local["url"], local["api_key"], session_lease_s=None) as c:
            assert c.sandboxes.list() == []  # the plain stop destroyed it
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
