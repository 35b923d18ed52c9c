"""Red team 16 (scale, deploy/): the shipped manifests put secrets on command lines.

Kubernetes expands ``$(VAR)`` in ``command``/``args`` and systemd expands ``${VAR}`` in
``ExecStart`` into the process's argv: the PostgreSQL DSN (with its password) and the
join token are then in ``/proc/<pid>/cmdline``, readable by every user of the host
(``ps aux``), for the life of the process, and in every crash report that records
argv. ``dsec apiserver`` already reads ``$DSEC_STORE`` and ``dsec edge`` reads
``$DSEC_JOIN_TOKEN`` from the environment (0600-readable by the owner only, in
``/proc/<pid>/environ``): the manifests need not expand them.

(tests/security/redteam16/test_store_argv.py on rt16-pg reads a real apiserver's
password from its argv as user ``nobody``.)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).parents[3]
DEPLOY = ROOT / "deploy"


def _containers(doc: Any) -> list[dict[str, Any]]:
    spec = (doc or {}).get("spec", {})
    pod = spec.get("template", {}).get("spec", {})
    return list(pod.get("containers", [])) + list(pod.get("initContainers", []))


def test_k8s_manifests_never_expand_a_secret_into_argv() -> None:
    bad = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            for c in _containers(doc):
                secret_vars = {e["name"] for e in c.get("env", [])
                               if "secretKeyRef" in (e.get("valueFrom") or {})}
                argv = [*c.get("command", []), *c.get("args", [])]
                for a in argv:
                    for var in re.findall(r"\$\((\w+)\)", str(a)):
                        if var in secret_vars:
                            bad.append(f"{path.name}: {c['name']} argv has $({var}) "
                                       "(a Secret)")
    assert bad == [], bad


def test_systemd_units_never_expand_a_secret_into_argv() -> None:
    bad = []
    for path in sorted((DEPLOY / "systemd").glob("*.service")):
        text = path.read_text()
        m = re.search(r"^ExecStart=(.*?)(?<!\\)$", text, re.MULTILINE | re.DOTALL)
        assert m is not None, path
        for var in re.findall(r"\$\{?(\w+)\}?", m.group(1)):
            if re.search(r"TOKEN|DSN|PASSWORD|SECRET|KEY", var):
                bad.append(f"{path.name}: ExecStart expands ${{{var}}} into argv")
    assert bad == [], bad


def test_shipped_edge_joins_never_send_the_token_over_plain_http() -> None:
    """(with test_join_wire.py on rt16: the token crosses the wire in the clear)"""
    bad = []
    for path in [*(DEPLOY / "k8s").glob("*.yaml"), *(DEPLOY / "systemd").glob("*")]:
        for m in re.finditer(r"--join\s*\n?\s*-?\s*(\S+)", path.read_text()):
            if m.group(1).startswith("http://"):
                bad.append(f"{path.name}: --join {m.group(1)}")
    assert bad == [], bad


def test_a_store_password_on_the_command_line_draws_a_warning() -> None:
    """Every door of the secret: an operator who types ``--store postgresql://u:pw@...``
    is told it is readable by every host user; the env var and a password-less URL are
    quiet. Both commands that take --store use the check."""
    import click
    from click.testing import CliRunner

    from dsec.cli.apiserver import apiserver
    from dsec.cli.edge import secret_in_argv
    from dsec.cli.up import up

    for cmd in (apiserver, up):
        [store] = [p for p in cmd.params if p.name == "store"]
        assert store.callback is secret_in_argv, cmd.name

    @click.command()
    @click.option("--store", envvar="DSEC_STORE", callback=secret_in_argv)
    def probe(store: str | None) -> None:
        pass

    def run(*args: str, env: dict[str, str] | None = None) -> str:
        r = CliRunner().invoke(probe, list(args), env=env)
        assert r.exit_code == 0, r.output
        return r.stderr
    loud = run("--store", "postgresql://dsec:hunter2@db.example/dsec")
    assert "carries a secret on the command line" in loud and "DSEC_STORE" in loud
    assert "hunter2" not in loud
    assert "carries a secret" not in run("--store", "postgresql://dsec@db.example/dsec")
    assert "carries a secret" not in run(
        env={"DSEC_STORE": "postgresql://dsec:hunter2@db.example/dsec"})
