"""``dsec cluster``: init, token create/list/revoke, node list/revoke on a state dir."""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path

from click.testing import CliRunner

from dsec.cli.main import cli


def _run(*args: str) -> str:
    r = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.output


def test_init_tokens_and_nodes(tmp_path: Path) -> None:
    sd = str(tmp_path / "state")
    out = _run("cluster", "init", "--state-dir", sd)
    assert out.startswith("created:") and "CA sha256:" in out
    ca_sha = out.split("CA sha256:")[1].strip()
    assert _run("cluster", "init", "--state-dir", sd).startswith("exists:")
    key = os.path.join(sd, "cluster", "ca.key")
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600

    token = _run("cluster", "token", "create", "--ttl", "30m", "--uses", "2",
                 "--description", "rack 4", "--state-dir", sd).strip()
    tid, _, rest = token.partition(".")
    assert rest.endswith(ca_sha)
    listing = _run("cluster", "token", "list", "--state-dir", sd)
    assert tid in listing and "valid" in listing and "0/2" in listing and "rack 4" in listing
    assert token.split(".")[1] not in listing          # the secret is never listed

    # a node joins with it (the authority the REST route uses), then is revoked
    from dsec.cli.cluster import _authority
    from dsec.cluster.ca import new_node_key
    from dsec.cluster.join import join_request
    _, csr = new_node_key("n1")
    auth = _authority(sd)
    auth.join(join_request(token, node_id="n1", csr=csr.decode(),
                           address="tcp:10.251.0.9:7443", nonce=auth.challenge().nonce))
    nodes = json.loads(_run("cluster", "node", "list", "--state-dir", sd))
    assert [(n["node_id"], n["revoked"]) for n in nodes] == [("n1", False)]
    assert _run("cluster", "token", "revoke", tid, "--nodes", "--state-dir", sd) == (
        f"revoked token {tid} and nodes n1\n")
    assert "revoked" in _run("cluster", "token", "list", "--state-dir", sd)
    nodes = json.loads(_run("cluster", "node", "list", "--state-dir", sd))
    assert nodes[0]["revoked"] is True

    r = CliRunner().invoke(cli, ["cluster", "node", "revoke", "nope", "--state-dir", sd])
    assert r.exit_code != 0 and "no joined node 'nope'" in r.output
    r = CliRunner().invoke(cli, ["cluster", "token", "create", "--ttl", "soon",
                                 "--state-dir", sd])
    assert r.exit_code != 0 and "not a duration" in r.output


def test_edge_join_needs_a_state_dir_and_a_token(tmp_path: Path) -> None:
    # `dsec edge` installs SIGINT/SIGTERM handlers first: put pytest's back afterwards
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        _edge_refusals(tmp_path)
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def _edge_refusals(tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["edge", "--listen", "tcp:127.0.0.1:7443", "--join",
                                 "http://127.0.0.1:1"])
    assert r.exit_code != 0 and "--join needs --state-dir" in r.output
    r = CliRunner().invoke(cli, ["edge", "--listen", "tcp:127.0.0.1:7443", "--join",
                                 "http://127.0.0.1:1", "--state-dir", str(tmp_path / "e")])
    assert r.exit_code != 0 and "pass --join URL and --token" in r.output
    r = CliRunner().invoke(cli, ["edge", "--listen", "unix:/tmp/x.sock", "--join",
                                 "http://127.0.0.1:1", "--state-dir", str(tmp_path / "e")])
    assert r.exit_code != 0 and "TCP+TLS" in r.output
    assert not (tmp_path / "e" / "cluster" / "node.key").exists()
