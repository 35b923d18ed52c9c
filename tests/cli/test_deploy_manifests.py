"""Every manifest and unit file in ``deploy/`` parses, and every ``dsec ...`` command line
in them uses only commands and flags the CLI really has (introspected from the click
commands), so a renamed flag cannot leave a deployment that fails at start.

Flags that other issue-16 streams add on their branches (``--store``, ``--join``,
``--token``) are allowed through :data:`EXPECTED_UPCOMING` until they land; the lead
removes each entry at merge, after which the check holds for them too.
"""

from __future__ import annotations

import configparser
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from dsec.cli.main import cli

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"

# ---- EXPECTED-UPCOMING FLAGS (remove each when its stream is merged) -------------------
# (command path, flag) -> the stream that adds it (plan-16.md "Interfaces agreed up front")
EXPECTED_UPCOMING: dict[tuple[str, str], str] = {
    ("edge", "--join"): "join",          # dsec edge --join URL --token JOIN_TOKEN
    ("edge", "--token"): "join",
}
# -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CommandLine:
    where: str
    argv: tuple[str, ...]


def _resolve(argv: tuple[str, ...]) -> tuple[click.Command, list[str], list[str]]:
    """The click command a ``dsec`` argv names, its path, and the rest of the argv."""
    ctx = click.Context(cli)
    cmd: click.Command = cli
    path: list[str] = []
    rest = list(argv[1:])
    while isinstance(cmd, click.Group) and rest and not rest[0].startswith("-"):
        sub = cmd.get_command(ctx, rest[0])
        if sub is None:
            raise AssertionError(f"`dsec {' '.join(path + [rest[0]])}` is no command")
        cmd = sub
        path.append(rest.pop(0))
    return cmd, path, rest


def problems(line: CommandLine) -> list[str]:
    """What is wrong with one ``dsec`` command line (empty: nothing)."""
    try:
        cmd, path, rest = _resolve(line.argv)
    except AssertionError as exc:
        return [f"{line.where}: {exc}"]
    opts: dict[str, click.Parameter] = {}
    for p in cmd.params:
        if isinstance(p, click.Option):
            for o in (*p.opts, *p.secondary_opts):
                opts[o] = p
    out = []
    key = " ".join(path)
    i = 0
    while i < len(rest):
        tok = rest[i]
        i += 1
        if not tok.startswith("--"):
            continue
        flag, eq, value = tok.partition("=")
        p = opts.get(flag)
        if p is None:
            if (key, flag) not in EXPECTED_UPCOMING:
                out.append(f"{line.where}: `dsec {key}` has no flag {flag}")
            elif i < len(rest) and not rest[i].startswith("--"):
                i += 1             # an upcoming flag: assume it takes a value
            continue
        assert isinstance(p, click.Option)
        if p.is_flag or p.count:
            continue
        if not eq:
            if i >= len(rest):
                out.append(f"{line.where}: {flag} needs a value")
                continue
            value = rest[i]
            i += 1
        if (isinstance(p.type, click.Choice) and "$" not in value and "%" not in value
                and value not in p.type.choices):
            out.append(f"{line.where}: {flag} {value!r} is not one of "
                           f"{list(p.type.choices)}")
    return out


# ------------------------------------------------------------------------ the files
def _manifests() -> list[Path]:
    return sorted(DEPLOY.glob("k8s/*.yaml"))


def _units() -> list[Path]:
    return sorted(DEPLOY.glob("systemd/*.service"))


def _containers(doc: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    spec = (doc.get("spec") or {})
    pod = (spec.get("template") or {}).get("spec") or {}
    for c in (*pod.get("initContainers", ()), *pod.get("containers", ())):
        yield c.get("name", "?"), c


def _k8s_lines(path: Path) -> Iterator[CommandLine]:
    for doc in yaml.safe_load_all(path.read_text()):
        if not doc:
            continue
        for name, c in _containers(doc):
            argv = tuple(str(a) for a in (*(c.get("command") or ()), *(c.get("args") or ())))
            if argv and Path(argv[0]).name == "dsec":
                yield CommandLine(f"{path.name}:{doc['kind']}/{name}", argv)


def _unit(path: Path) -> configparser.RawConfigParser:
    cp = configparser.RawConfigParser(strict=False, delimiters=("=",))
    cp.optionxform = str  # type: ignore[assignment,method-assign]
    # systemd continues a line ending in a backslash; configparser does not
    cp.read_string(path.read_text().replace("\\\n", " "))
    return cp


def _unit_lines(path: Path) -> Iterator[CommandLine]:
    cp = _unit(path)
    for key in ("ExecStart", "ExecStartPre", "ExecStartPost", "ExecReload", "ExecStop"):
        if cp.has_option("Service", key):
            cmd = cp.get("Service", key).lstrip("-@:+!")
            argv = tuple(shlex.split(cmd))
            if argv and Path(argv[0]).name == "dsec":
                yield CommandLine(f"{path.name}:{key}", argv)


# ------------------------------------------------------------------------ the tests
def test_there_is_something_to_check() -> None:
    kinds = {doc["kind"] for p in _manifests() for doc in yaml.safe_load_all(p.read_text())
             if doc}
    assert {"Deployment", "DaemonSet", "Service", "Secret"} <= kinds, kinds
    names = {p.name for p in _units()}
    assert {"dsec-apiserver.service", "dsec-edge.service"} <= names
    lines = [line for p in _manifests() for line in _k8s_lines(p)]
    lines += [line for p in _units() for line in _unit_lines(p)]
    assert {_resolve(line.argv)[1][0] for line in lines} == {"apiserver", "edge"}


@pytest.mark.parametrize("path", _manifests(), ids=lambda p: p.name)
def test_manifest_parses_and_uses_real_flags(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs, path
    for d in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(d), (path, d)
        assert d["metadata"].get("name"), (path, d)
    bad = [msg for line in _k8s_lines(path) for msg in problems(line)]
    assert bad == []


@pytest.mark.parametrize("path", _units(), ids=lambda p: p.name)
def test_unit_parses_and_uses_real_flags(path: Path) -> None:
    cp = _unit(path)
    assert {"Unit", "Service", "Install"} <= set(cp.sections()), path
    assert cp.get("Service", "ExecStart")
    bad = [msg for line in _unit_lines(path) for msg in problems(line)]
    assert bad == []


def test_edge_unit_keeps_sandboxes_across_restarts() -> None:
    """Hardening must not break the edge: no private mount namespace (its mounts must be
    the host's, for re-adoption), no device allow-list, and only the edge process is
    signalled on stop (the default KillMode would kill every sandbox)."""
    svc = dict(_unit(DEPLOY / "systemd" / "dsec-edge.service").items("Service"))
    assert svc["KillMode"] == "process" and svc["Delegate"] == "yes"
    for unsafe in ("ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices",
                   "ReadOnlyPaths", "DevicePolicy", "ProtectKernelTunables",
                   "ProtectControlGroups", "RestrictNamespaces", "NoNewPrivileges",
                   "PrivateNetwork", "ProtectClock", "MemoryDenyWriteExecute",
                   "RestrictSUIDSGID", "CapabilityBoundingSet", "User"):
        assert unsafe not in svc, unsafe


def test_the_checker_catches_what_it_should() -> None:
    """The check above can fail: a made-up flag, a misspelt command, a bad choice and an
    upcoming flag on the wrong command are all reported; real ones are not."""
    def bad(*argv: str) -> list[str]:
        return problems(CommandLine("t", ("dsec", *argv)))

    assert bad("edge", "--listen", "unix:/x", "--journal-sync", "write") == []
    assert bad("node", "drain", "edge-1") == []
    assert bad("apiserver", "--store", "postgresql://x/y", "--edge", "a=unix:/s") == []
    assert bad("edge", "--no-such-flag", "1") == ["t: `dsec edge` has no flag --no-such-flag"]
    assert bad("edgy", "--listen", "x") == ["t: `dsec edgy` is no command"]
    assert bad("edge", "--journal-sync", "often") == [
        "t: --journal-sync 'often' is not one of ['fsync', 'write', 'tick']"]
    assert bad("apiserver", "--join", "http://x") == ["t: `dsec apiserver` has no flag --join"]
