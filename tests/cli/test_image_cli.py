"""``dsec image`` on a layer store directory: namespaced names, owners, the tag rule."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from dsec.cli.main import cli

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")


def _run(root: Path, *args: str) -> str:
    r = CliRunner().invoke(cli, ["image", "--root", str(root), *args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.output


def test_build_tag_ls_rm_with_namespaces(tmp_path: Path) -> None:
    src = tmp_path / "tree"
    (src / "etc").mkdir(parents=True)
    (src / "etc/f").write_text("x")
    root = tmp_path / "store"
    out = _run(root, "build", str(src), "--kind", "toolkit", "--name", "org/team/tools",
               "--tag", "v1", "-q")
    assert out.startswith("org/team/tools:v1 sha256:")
    _run(root, "build", str(src), "--kind", "base", "--name", "base", "-q")
    manifests = [json.loads(line) for line in _run(root, "ls", "--json").splitlines()]
    by_ns = {m.get("namespace"): m for m in manifests}
    assert set(by_ns) == {"org/team", None}
    assert by_ns["org/team"]["owner"] == by_ns[None]["owner"] == "host:root"
    table = CliRunner().invoke(cli, ["image", "--root", str(root), "ls"],
                               env={"COLUMNS": "250"}).output
    assert "NAMESPACE" in table and "OWNER" in table and "org/team" in table
    assert "(cluster-wide)" in table and "host:root" in table
    # a descendant may carry the team's tree; the cluster-wide namespace may not
    assert "org/team/exp/tools:latest ->" in _run(root, "tag", "org/team/tools:v1",
                                                  "org/team/exp/tools")
    r = CliRunner().invoke(cli, ["image", "--root", str(root), "tag", "org/team/tools:v1",
                                 "tools"])
    assert r.exit_code != 0 and "built in project 'org/team'" in " ".join(r.output.split())
    r = CliRunner().invoke(cli, ["image", "--root", str(root), "build", str(src), "--kind",
                                 "base", "--name", "Bad/Name"])
    assert r.exit_code != 0 and "project path" in r.output
    assert "removed" in _run(root, "rm", "org/team/exp/tools")
