"""The CLI of issue 19 through the real CLI against a real LocalCluster: ids never cut
(to an 80-column terminal and to a pipe), ``ls -q``, ``--json`` on every data command,
``create --env/--disk/--idle-timeout/--network``, ``exec --timeout none``,
``sandbox logs``, ``dsec key|project|quota``, ``dsec up``'s export lines and the
no-cluster error."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import shlex
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator

import click
import pytest
from click.testing import CliRunner

from dsec.cli.main import COMMANDS, cli
from dsec.cluster.local import LocalCluster

DSEC = [sys.executable, "-c", "from dsec.cli.main import main; main()"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(edges=1) as cl:
        yield cl


def _env(cluster: LocalCluster, key: str | None = None) -> dict[str, str]:
    return {"DSEC_URL": cluster.url, "DSEC_API_KEY": key or cluster.api_key}


def _run(cluster: LocalCluster, *args: str, key: str | None = None) -> tuple[int, str]:
    r = CliRunner().invoke(cli, list(args), env=_env(cluster, key), catch_exceptions=False)
    return r.exit_code, r.output


def _on_tty(cluster: LocalCluster, args: list[str], cols: int) -> str:
    """``dsec ARGS`` in a child process whose stdout is a real pseudo-terminal of
    ``cols`` columns (what a user at an 80-column terminal sees)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, cols, 0, 0))
    env = {**os.environ, **_env(cluster)}
    env.pop("COLUMNS", None)
    p = subprocess.Popen([*DSEC, *args], stdout=slave, stderr=slave, stdin=slave, env=env)
    os.close(slave)
    out = b""
    try:
        while True:
            r, _, _ = select.select([master], [], [], 30)
            if not r:
                break
            try:
                got = os.read(master, 65536)
            except OSError:        # EIO: the child closed the terminal
                break
            if not got:
                break
            out += got
    finally:
        p.wait(30)
        os.close(master)
    assert p.returncode == 0, out
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode())


def test_ls_never_cuts_ids_at_80_columns_piped_or_quiet(cluster: LocalCluster) -> None:
    code, out = _run(cluster, "sandbox", "create", "-n", "3", "--label", "ls=1",
                     "--label", "a-rather-long-label-key=and-its-rather-long-value", "--json")
    assert code == 0, out
    ids = sorted(s["id"] for s in json.loads(out))
    try:
        # a real 80-column terminal: the rich table, every id whole on one line
        tty = _on_tty(cluster, ["sandbox", "ls", "--label", "ls=1"], 80)
        assert all(any(i in line for line in tty.splitlines()) for i in ids), tty
        assert "…" not in tty.split("\n", 3)[-1] or all(i in tty for i in ids)
        assert max(len(line) for line in tty.splitlines()) <= 80, tty
        # piped: plain columns, whole ids, one sandbox per line, no width limit
        p = subprocess.run([*DSEC, "sandbox", "ls", "--label", "ls=1"], capture_output=True,
                           text=True, env={**os.environ, **_env(cluster)}, check=True,
                           timeout=60)
        lines = p.stdout.splitlines()
        assert lines[0].split()[:2] == ["ID", "STATE"]
        assert sorted(line.split()[0] for line in lines[1:]) == ids
        assert all("and-its-rather-long-value" in line for line in lines[1:])
        assert "…" not in p.stdout
        # -q: ids only
        code, out = _run(cluster, "sandbox", "ls", "--label", "ls=1", "-q")
        assert code == 0 and sorted(out.split("\n")[:-1]) == ids and out.endswith("\n")
    finally:
        _run(cluster, "sandbox", "rm", *ids)


def _commands(group: click.Group, prefix: str = "") -> Iterator[tuple[str, click.Command]]:
    for name in group.list_commands(click.Context(group)):
        cmd = group.get_command(click.Context(group), name)
        assert cmd is not None
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, f"{prefix}{name} ")
        else:
            yield f"{prefix}{name}", cmd


def test_every_command_that_talks_to_a_cluster_takes_json() -> None:
    """Every command with the connection options (--url/--api-key: it asks the cluster
    for data) has --json; the cluster-less ones are the few listed here."""
    no_json = []
    talking = 0
    for name, cmd in _commands(cli):
        opts = {o for p in cmd.params for o in getattr(p, "opts", [])}
        if "--api-key" in opts:
            talking += 1
            if "--json" not in opts:
                no_json.append(name)
    # image build prints one line (ref digest size); its two paths (a local layer, a
    # Dockerfile build through the cluster) are the image stream's to give --json
    assert talking >= 25 and no_json == ["image build"]
    assert {"key", "project", "quota"} <= set(COMMANDS)


def test_create_env_disk_idle_timeout_network(cluster: LocalCluster) -> None:
    code, out = _run(cluster, "sandbox", "create", "--env", "GREETING=hello world",
                     "--env", "B=2", "--disk", "512MiB", "--idle-timeout", "600",
                     "--idle-action", "pause", "--network", "open", "--ttl", "900",
                     "--ttl-action", "pause", "--json")
    assert code == 0, out
    info = json.loads(out)[0]
    sid = info["id"]
    try:
        spec = info["spec"]
        assert spec["env"] == {"GREETING": "hello world", "B": "2"}
        assert spec["disk_bytes"] == 512 << 20
        assert spec["idle_timeout_s"] == 600 and spec["idle_action"] == "pause"
        assert spec["ttl_s"] == 900 and spec["ttl_action"] == "pause"
        assert spec["network"] == {"mode": "open"}
        code, out = _run(cluster, "sandbox", "create", "--env", "NOEQUALS")
        assert code == 2 and "'NOEQUALS' must be key=value" in out
        code, out = _run(cluster, "sandbox", "create", "--disk", "lots")
        assert code == 1 and "not a size" in out
    finally:
        _run(cluster, "sandbox", "rm", sid)


def test_exec_timeout_none_and_logs(cluster: LocalCluster) -> None:
    code, out = _run(cluster, "sandbox", "create", "--json")
    sid = json.loads(out)[0]["id"]
    try:
        code, out = _run(cluster, "sandbox", "exec", sid, "--timeout", "none", "echo", "hi")
        assert code == 0 and out == "hi\n", out
        code, out = _run(cluster, "sandbox", "exec", sid, "--timeout", "soon", "true")
        assert code == 2 and "'soon' is not a number of seconds or 'none'" in out
        code, out = _run(cluster, "sandbox", "exec", sid, "--timeout", "-1", "true")
        assert code == 2 and "> 0 seconds" in out
        assert _run(cluster, "sandbox", "pause", sid)[0] == 0
        assert _run(cluster, "sandbox", "resume", sid)[0] == 0
        code, out = _run(cluster, "sandbox", "logs", sid)
        assert code == 0, out
        lines = out.splitlines()
        assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z  ", lines[0]), lines
        assert any("running -> pausing" in x or "running -> paused" in x for x in lines)
        assert "-> running" in lines[-1]
        code, out = _run(cluster, "sandbox", "logs", sid, "--json")
        assert [e["to_state"] for e in json.loads(out)][-1] == "running"
    finally:
        _run(cluster, "sandbox", "rm", sid)


def test_admin_key_project_quota(cluster: LocalCluster) -> None:
    code, out = _run(cluster, "key", "create", "alice19", "--project", "t19/a", "--role",
                     "admin", "--json")
    assert code == 0, out
    alice = json.loads(out)
    assert alice["api_key"].startswith(f"dsk_{alice['key_id']}_")
    code, out = _run(cluster, "key", "create", "bob19", "--project", "t19/a", "-q",
                     key=alice["api_key"])
    assert code == 0 and out.startswith("dsk_"), out
    bob = out.strip()
    # the superuser caps t19/a (alice, its admin, may not lift her own quota)
    code, out = _run(cluster, "quota", "set", "t19/a", "--sandboxes", "1", "--memory",
                     "4GiB", "--json")
    assert code == 0, out
    assert json.loads(out)["quota"] == {"max_sandboxes": 1, "memory_bytes": 4 << 30}
    code, out = _run(cluster, "quota", "set", "t19/a", "--cpu", "2", "--json")  # merged
    assert json.loads(out)["quota"] == {"max_sandboxes": 1, "memory_bytes": 4 << 30,
                                        "cpu_milli": 2000}
    code, out = _run(cluster, "quota", "set", "t19/a", "--sandboxes", "5", key=alice["api_key"])
    assert code == 1 and "permission_denied" in out, out
    code, out = _run(cluster, "sandbox", "create", "--project", "t19/a", "--json", key=bob)
    assert code == 0, out
    sid = json.loads(out)[0]["id"]
    code, out = _run(cluster, "sandbox", "create", "--project", "t19/a", key=bob)
    assert code == 1 and "quota_exceeded" in out, out
    code, out = _run(cluster, "project", "get", "t19/a", "--json", key=bob)
    assert code == 0 and json.loads(out)["usage"]["sandboxes"] == 1, out
    code, out = _run(cluster, "project", "ls", "--json", key=alice["api_key"])
    assert "t19/a" in [p["path"] for p in json.loads(out)], out
    code, out = _run(cluster, "project", "ls")
    assert code == 0 and "t19/a" in out and "1/1" in out, out
    code, out = _run(cluster, "quota", "set", "t19/a", "--sandboxes", "lots")
    assert code == 2 and "'lots'" in out
    code, out = _run(cluster, "quota", "set", "t19/a")
    assert code == 2 and "at least one limit" in out
    _run(cluster, "sandbox", "rm", sid)
    # revoke by id or by the whole key; the key stops working at once
    code, out = _run(cluster, "key", "revoke", bob, key=alice["api_key"])
    assert code == 1 and "not_found" in out      # not hers: looks missing
    bob_id = bob.split("_")[1]
    code, out = _run(cluster, "key", "ls", "--json", key=bob)
    assert code == 0 and [k["key_id"] for k in json.loads(out)] == [bob_id], out
    code, out = _run(cluster, "key", "ls", "--principal", "bob19", key=alice["api_key"])
    assert code == 1 and "not_found" in out      # another principal's: not hers to list
    code, out = _run(cluster, "key", "revoke", bob)
    assert code == 0, out
    code, out = _run(cluster, "key", "ls", "--principal", "bob19", "--json")  # superuser
    assert [(k["key_id"], k["revoked"]) for k in json.loads(out)] == [(bob_id, True)]
    code, out = _run(cluster, "key", "ls", "--principal", "bob19", "-q")
    assert code == 0 and out == ""               # no live key left
    code, out = _run(cluster, "key", "ls", "--principal", "Bob 19")
    assert code == 2 and "invalid principal" in out
    code, out = _run(cluster, "sandbox", "ls", key=bob)
    assert code == 1 and "unauthenticated" in out, out
    code, out = _run(cluster, "key", "revoke", "nothex")
    assert code == 1 and "give the key id" in out, out


def test_no_cluster_error_names_dsec_state_dir(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    env["DSEC_STATE_DIR"] = str(tmp_path / "nothing-here")
    p = subprocess.run([*DSEC, "sandbox", "ls"], capture_output=True, text=True, env=env,
                       timeout=60, check=False)
    assert p.returncode == 1
    assert "DSEC_STATE_DIR" in p.stderr and str(tmp_path / "nothing-here") in p.stderr, (
        p.stderr)


def test_dsec_up_prints_eval_able_export_lines(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`dsec up` prints `export DSEC_URL=... DSEC_API_KEY=...` on stdout; a shell that
    evaluates them reaches the cluster with the CLI."""
    state = str(tmp_path / "st")
    p = subprocess.Popen([*DSEC, "up", "--state-dir", state, "--listen", "127.0.0.1:0",
                          "--backend", "simulated"], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL)
    try:
        assert p.stdout is not None
        fd, got = p.stdout.fileno(), b""
        deadline = time.monotonic() + 60      # an up that prints nothing must not hang us
        while got.count(b"\n") < 2 and time.monotonic() < deadline:
            if select.select([fd], [], [], 1)[0]:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                got += chunk
        lines = got.decode().splitlines(keepends=True)
        assert len(lines) == 2, lines
        assert lines[0].startswith("export DSEC_URL=") and lines[1].startswith(
            "export DSEC_API_KEY=dsk_"), lines
        env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
        env["DSEC_STATE_DIR"] = str(tmp_path / "elsewhere")   # only the exports lead there
        script = "".join(lines) + " ".join(shlex.quote(a) for a in DSEC) + " sandbox ls -q"
        r = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env,
                           timeout=60, check=False)
        assert r.returncode == 0 and r.stdout == "", r.stderr
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0


def test_background_processes_ps_attach_signal(cluster: LocalCluster) -> None:
    """``exec -d`` prints a pid; ``ps`` lists it; ``attach`` from another process (a child
    CLI, not this one) prints what it printed before and after it was attached, and exits
    with its code; ``signal`` ends one with the signal's exit code."""
    code, out = _run(cluster, "sandbox", "create", "--json")
    sid = json.loads(out)[0]["id"]
    try:
        code, out = _run(cluster, "sandbox", "exec", "-d", sid, "--shell",
                         "echo before; sleep 1; echo after; exit 7")
        assert code == 0, out
        pid = int(out.strip())
        code, out = _run(cluster, "sandbox", "ps", sid, "--json")
        assert code == 0 and any(p["pid"] == pid and p.get("running", True) for p in json.loads(out)), out
        time.sleep(0.3)       # "before" is in the ring before anyone attached
        r = subprocess.run([*DSEC, "sandbox", "attach", sid, str(pid)], check=False, env={
            **os.environ, **_env(cluster)}, capture_output=True, timeout=60)
        assert (r.returncode, r.stdout, r.stderr) == (7, b"before\nafter\n", b""), r
        code, out = _run(cluster, "sandbox", "ps", sid)
        assert code == 0 and re.search(rf"\b{pid}\b.*exit 7", out), out
        # attached again after it ended: the same output, the same code
        code, out = _run(cluster, "sandbox", "attach", sid, str(pid), "--json")
        got = json.loads(out)
        assert code == 7 and got["stdout"] == "before\nafter\n" and got["exit_code"] == 7, out
        code, out = _run(cluster, "sandbox", "exec", "-d", sid, "sleep", "100")
        sleeper = int(out.strip())
        code, out = _run(cluster, "sandbox", "exec", "-d", "--timeout", "0.5", sid, "sleep",
                         "100")
        timed = int(out.strip())
        code, out = _run(cluster, "sandbox", "attach", sid, str(sleeper), "--timeout", "0.3")
        assert code == 124 and "still running" in out, out
        code, out = _run(cluster, "sandbox", "attach", sid, str(timed), "--json")
        assert json.loads(out)["timed_out"] is True, out      # --timeout given: it applies
        code, out = _run(cluster, "sandbox", "signal", sid, str(sleeper), "-s", "INT")
        assert code == 0 and "SIGINT" in out, out
        code, out = _run(cluster, "sandbox", "attach", sid, str(sleeper), "--json")
        assert code == 128 + signal.SIGINT, out
        code, out = _run(cluster, "sandbox", "signal", sid, str(sleeper), "-s", "NOPE")
        assert code == 2 and "no signal" in out, out
        code, out = _run(cluster, "sandbox", "attach", sid, "99999")
        assert code == 1 and "has no process 99999" in out, out
    finally:
        _run(cluster, "sandbox", "rm", sid)


def test_get_shows_the_lifetime_and_why_it_is_paused(cluster: LocalCluster) -> None:
    """Paused, the TTL clock stops (``ttl left`` stays, no ``expires at``); an idle
    auto-pause says ``idle``, a requested one ``requested`` (SDK: test_lifetimes.py)."""
    code, out = _run(cluster, "sandbox", "create", "--ttl", "600", "--json")
    sid = json.loads(out)[0]["id"]
    code, out = _run(cluster, "sandbox", "create", "--idle-timeout", "1", "--idle-action",
                     "pause", "--json")
    idle = json.loads(out)[0]["id"]
    try:
        code, out = _run(cluster, "sandbox", "get", sid)
        assert code == 0 and "expires at:" in out and "node: edge-0" in out, out
        assert _run(cluster, "sandbox", "pause", sid)[0] == 0
        code, out = _run(cluster, "sandbox", "get", sid)
        assert "expires at:" not in out and re.search(r"ttl left: (5\d\d|600)s", out), out
        assert "paused: requested" in out and "kept paused until:" in out, out
        deadline = time.monotonic() + 20
        while "paused: idle" not in (out := _run(cluster, "sandbox", "get", idle)[1]):
            assert time.monotonic() < deadline, out
            time.sleep(0.2)
        code, out = _run(cluster, "sandbox", "logs", idle)
        assert re.search(r"-> paused\s+idle", out), out
    finally:
        _run(cluster, "sandbox", "rm", sid, idle)


def test_fs_commands_and_the_paused_rule(cluster: LocalCluster) -> None:
    """``dsec sandbox fs``: mkdir/ls/stat/mv/rm and watch (in a child process, while this
    one writes); reads of a paused sandbox leave it paused, a write resumes it."""
    code, out = _run(cluster, "sandbox", "create", "--json")
    sid = json.loads(out)[0]["id"]
    env = {**os.environ, **_env(cluster)}
    try:
        assert _run(cluster, "sandbox", "fs", "mkdir", sid, "/work/a/b")[0] == 0
        watcher = subprocess.Popen([*DSEC, "sandbox", "fs", "watch", sid, "/work/a",
                                    "--timeout", "20", "--json"], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            with cluster.client(protocol="http", session_lease_s=None) as c:
                sb = c.sandboxes.get(sid)
                deadline = time.monotonic() + 20
                seen: list[dict] = []          # type: ignore[type-arg]
                assert watcher.stdout is not None
                os.set_blocking(watcher.stdout.fileno(), False)
                n = 0
                while not any(e["path"] == "/work/a/f.txt" for e in seen):
                    assert time.monotonic() < deadline, seen
                    sb.files.write("/work/a/f.txt", f"x{n}")   # until the watch is up
                    n += 1
                    time.sleep(0.2)
                    for line in (watcher.stdout.read() or b"").splitlines():
                        seen.append(json.loads(line))
        finally:
            watcher.kill()
            watcher.wait(10)
        code, out = _run(cluster, "sandbox", "fs", "ls", sid, "/work/a", "--json")
        assert code == 0 and {f["path"] for f in json.loads(out)} == {
            "/work/a/b", "/work/a/f.txt"}, out
        code, out = _run(cluster, "sandbox", "fs", "mv", sid, "/work/a/f.txt", "/work/a/g")
        assert code == 0, out
        code, out = _run(cluster, "sandbox", "fs", "stat", sid, "/work/a/g", "--json")
        assert code == 0 and json.loads(out)["type"] == "file", out
        code, out = _run(cluster, "sandbox", "fs", "stat", sid, "/work/a/f.txt")
        assert code == 1 and "f.txt" in out, out
        code, out = _run(cluster, "sandbox", "fs", "rm", sid, "/work/a")
        assert code == 1, out              # a directory needs -r
        # the paused rule: ls/stat leave it paused, mkdir (a write) resumes it
        assert _run(cluster, "sandbox", "pause", sid)[0] == 0
        code, out = _run(cluster, "sandbox", "fs", "ls", sid, "/work/a")
        assert code == 0 and "/work/a/g" in out, out
        assert json.loads(_run(cluster, "sandbox", "get", sid, "--json")[1])["state"] == "paused"
        assert _run(cluster, "sandbox", "fs", "mkdir", sid, "/work/c")[0] == 0
        assert json.loads(_run(cluster, "sandbox", "get", sid, "--json")[1])["state"] == "running"
        assert _run(cluster, "sandbox", "fs", "rm", sid, "/work/a", "-r")[0] == 0
        code, out = _run(cluster, "sandbox", "fs", "ls", sid, "/work", "--json")
        assert [f["path"] for f in json.loads(out)] == ["/work/c"], out
    finally:
        _run(cluster, "sandbox", "rm", sid)
