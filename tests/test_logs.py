"""Logs (issue 19): ``--log-level``/``--log-format text|json`` with timestamps and levels,
the access log (REST and gateway), and the audit log of admin actions: who/what/when and
the outcome, at every door, durable (there after kill -9 of ``dsec up`` the instant the
answer came), mode 0600, with no secret in it."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time

import httpx
import pytest

from dsec.logs import AuditLog, configure
from dsec.wire import ops
from dsec.wire.api import CreateKeyRequest, QuotaBody
from dsec.wire.calls import Empty, KeyRef, QuotaSet


@pytest.fixture
def restore_logging():  # type: ignore[no-untyped-def]
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    configure("warning", "text")          # drops our handlers (and the access log's)
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_text_and_json_lines_carry_time_and_level(restore_logging) -> None:  # type: ignore[no-untyped-def]
    out = io.StringIO()
    configure("info", "text", stream=out)
    logging.getLogger("dsec.t").info("hello %s", "there")
    logging.getLogger("dsec.t").debug("not shown")
    line = out.getvalue().strip()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z INFO dsec\.t: hello there",
                        line), line
    out = io.StringIO()
    configure("warning", "json", stream=out)
    logging.getLogger("dsec.t").info("quiet")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("dsec.t").exception("failed %d", 7)
    rec = json.loads(out.getvalue())
    assert rec["level"] == "error" and rec["logger"] == "dsec.t" and rec["msg"] == "failed 7"
    assert rec["ts"].endswith("Z") and "ValueError: boom" in rec["exc"]
    with pytest.raises(ValueError, match="log level"):
        configure("loud", "text")


def test_audit_log_appends_fsyncs_and_is_0600(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "audit.log")
    with open(path, "w"):
        pass
    os.chmod(path, 0o644)                     # a looser file from before is tightened
    synced: list[int] = []
    a = AuditLog(path, clock=lambda: 0.0, fsync=synced.append)
    a.record(actor="root", actor_id="p-1", action="quota_set", target={"path": "t"},
             outcome="ok")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(synced) == 1
    a.close()
    assert AuditLog.read(path) == [{"ts": "1970-01-01T00:00:00.000Z", "actor": "root",
                                    "actor_id": "p-1", "action": "quota_set",
                                    "target": {"path": "t"}, "outcome": "ok"}]


def _start(state: str, *args: str) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    p = subprocess.Popen([sys.executable, "-c", "from dsec.cli.main import main; main()",
                          "up", "--state-dir", state, "--listen", "127.0.0.1:0", "--quiet",
                          "--backend", "simulated", *args],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with open(os.path.join(state, "local.json")) as f:
                local = json.load(f)
            if local["pid"] == p.pid:
                return p, local
        except (OSError, ValueError, KeyError):
            pass
        assert p.poll() is None, p.stderr.read() if p.stderr else b""
        time.sleep(0.05)
    p.kill()
    raise AssertionError("dsec up did not start")


def test_dsec_up_json_logs_access_log_and_durable_audit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from dsec import Client
    from dsec.errors import PermissionDenied

    state = str(tmp_path / "st")
    access = str(tmp_path / "access.log")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        mport = s.getsockname()[1]
    p, local = _start(state, "--log-level", "info", "--log-format", "json",
                      "--access-log", access, "--edge-metrics-port", str(mport))
    try:
        with Client(local["url"], local["api_key"], protocol="aether") as c:
            made = c.call(ops.CREATE_KEY, CreateKeyRequest(name="alice", project="team/a",
                                                           role="member"))
            c.call(ops.QUOTA_SET, QuotaSet(path="team/a", quota=QuotaBody(max_sandboxes=5)))
            c.sandboxes.create().kill()
        with Client(local["url"], made.api_key, protocol="http") as alice:
            with pytest.raises(PermissionDenied):   # a refused attempt is audited too
                alice.call(ops.QUOTA_SET, QuotaSet(path="team", quota=QuotaBody(
                    max_sandboxes=500)))
            assert alice.call(ops.PROJECTS, Empty()).items is not None
        # the edge's own metrics (dsec up --edge-metrics-port): the create above, timed
        # ... for the holder of <state>/metrics.token only (hx: every host user reaches
        # a loopback port)
        murl = f"http://127.0.0.1:{mport}/metrics"
        assert httpx.get(murl, timeout=30).status_code == 401
        with open(os.path.join(state, "metrics.token")) as f:
            bearer = {"Authorization": f"Bearer {f.read().strip()}"}
        text = httpx.get(murl, headers=bearer, timeout=30).text
        assert re.search(r'dsec_edge_operation_seconds_count\{op="create"\} [1-9]', text), text
        with Client(local["url"], local["api_key"], protocol="http") as c:
            kept = c.sandboxes.create(ttl=3600)
            deadline = kept.set_timeout(777).expires_at
            c.call(ops.REVOKE_KEY, KeyRef(id=made.key_id))
            # answered: now kill -9 the whole dsec up, at once
            os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
        audit = os.path.join(state, "audit.log")
        assert stat.S_IMODE(os.stat(audit).st_mode) == 0o600
        lines = AuditLog.read(audit)
        # audited before acting: every outcome line follows an intent line of its op
        intents = {r["op"]: r for r in lines if r.get("phase") == "intent"}
        recs = [r for r in lines if r.get("phase") == "outcome"]
        assert len(intents) == len(recs) == len(lines) // 2, lines
        assert all(lines.index(intents[r["op"]]) < lines.index(r) for r in recs), lines
        assert all(intents[r["op"]]["action"] == r["action"] for r in recs), lines
        got = [(r["actor"], r["action"], r["outcome"]) for r in recs]
        assert got == [("admin", "create_key", "ok"), ("admin", "quota_set", "ok"),
                       ("alice", "quota_set", "permission_denied"),
                       ("admin", "revoke_key", "ok")], got
        assert recs[0]["target"] == {"name": "alice", "project": "team/a", "role": "member",
                                     "made": made.key_id}
        assert recs[1]["target"] == {"path": "team/a", "quota": {"max_sandboxes": 5}}
        assert all(r["ts"].endswith("Z") for r in recs)
        with open(audit) as f:
            assert made.api_key not in f.read()                # never the secret
        with open(access) as f:
            lines = [json.loads(x) for x in f if x.strip()]
        doors = {(x["door"], x.get("op") or x.get("route"), x.get("outcome") or x["status"])
                 for x in lines}
        assert ("gateway", "create_key", "ok") in doors and ("gateway", "create", "ok") in doors
        assert any(d[0] == "rest" and d[2] == 403 for d in doors), doors
        assert all("ts" in x and x["level"] == "info" for x in lines)
        assert stat.S_IMODE(os.stat(access).st_mode) == 0o600
        err = p.stderr.read().decode() if p.stderr else ""
        logged = [json.loads(x) for x in err.splitlines() if x.startswith("{")]
        assert logged and all({"ts", "level", "logger", "msg"} <= set(x) for x in logged)
        with open(os.path.join(state, "edges", "edge-0.log")) as f:   # its edges' too
            edge = [json.loads(x) for x in f if x.startswith("{")]
        assert any(x["logger"].startswith("dsec.edge") and x["level"] == "info"
                   for x in edge), edge
        # the timeout set just before the kill -9 is the restarted cluster's too
        p, local = _start(state)
        with Client(local["url"], local["api_key"], protocol="http") as c:
            got = c.sandboxes.get(kept.id).info
            assert got.state == "running" and got.expires_at == deadline, got
        p.send_signal(signal.SIGTERM)
        p.wait(60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)


def test_text_lines_escape_peer_text_and_quote_fields() -> None:
    """Red team 19 B7: one record is one line; no control character reaches the file;
    a field value cannot add a field (logfmt quoting)."""
    from dsec.logs import TextFormatter

    rec = logging.LogRecord("dsec.access", logging.INFO, __file__, 1,
                            "GET /v1/sandboxes/x\n2026 INFO forged \x1b[2J\\ %d", (404,), None)
    rec.fields = {"path": "/x\r\n\x07", "request_id": "r1 principal=admin status=200",
                  "quote": 'a"b', "empty": "", "n": 3}
    line = TextFormatter().format(rec)
    assert "\n" not in line and "\r" not in line and "\x1b" not in line and "\x07" not in line
    assert line.endswith(r': GET /v1/sandboxes/x\n2026 INFO forged \x1b[2J\\ 404 '
                         r'path=/x\r\n\x07 request_id="r1 principal=admin status=200" '
                         r'quote="a\"b" empty="" n=3'), line


def test_an_audit_intent_precedes_the_action_and_a_failed_one_refuses_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Red team 19 B6: audited before acting (intent, then outcome, one op id); an intent
    that cannot be written refuses the action (the policy never runs); a write that
    fails mid-line leaves no half line."""
    import asyncio
    import errno
    from types import SimpleNamespace

    from dsec.control.audit import audited
    from dsec.errors import Unavailable

    path = str(tmp_path / "audit.log")
    log = AuditLog(path, clock=lambda: 0.0)
    ran: list[str] = []

    async def policy(caller: object, body: object) -> str:
        ran.append("ran")
        assert [r["phase"] for r in AuditLog.read(path)][-1] == "intent"   # already there
        return "reply"
    caller = SimpleNamespace(name="root", id="k1")
    run = audited("quota_set", policy, lambda: log)
    assert asyncio.run(run(caller, None)) == "reply"
    recs = AuditLog.read(path)
    assert [(r["phase"], r["outcome"]) for r in recs] == [("intent", "pending"),
                                                           ("outcome", "ok")]
    assert recs[0]["op"] == recs[1]["op"]

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    log_full = AuditLog(path, clock=lambda: 0.0, fsync=full)
    with pytest.raises(Unavailable, match="cannot be written .ENOSPC"):
        asyncio.run(audited("quota_set", policy, lambda: log_full)(caller, None))
    assert ran == ["ran"]                       # the second action was never done
    assert len(AuditLog.read(path)) == 2        # and no half line was left behind
    log.close()
    log_full.close()


def test_private_log_files_are_0600_from_the_start_and_never_a_symlink(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Red team 19 B8: created 0600 by the open (umask-proof), tightened if looser, not
    through a symlink, not a file another user owns."""
    from dsec.logs import open_private

    old = os.umask(0)
    try:
        f = open_private(str(tmp_path / "a.log"))
        f.close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "a.log").st_mode) == 0o600
    os.chmod(tmp_path / "a.log", 0o644)
    open_private(str(tmp_path / "a.log")).close()
    assert stat.S_IMODE(os.stat(tmp_path / "a.log").st_mode) == 0o600
    os.symlink(tmp_path / "a.log", tmp_path / "link.log")
    with pytest.raises(OSError):
        open_private(str(tmp_path / "link.log"))
    if os.geteuid() == 0:
        os.chown(tmp_path / "a.log", 65534, 65534)
        with pytest.raises(PermissionError, match="owned by uid 65534"):
            open_private(str(tmp_path / "a.log"))


def test_cli_tables_escape_cells_and_labels_are_printable() -> None:
    """Red team 19 B10: a label cannot forge a row in (or write into) a terminal."""
    from dsec.cli.sandbox import plain_table
    from dsec.errors import InvalidArgument
    from dsec.logs import escape_text
    from dsec.wire.spec import SandboxSpec

    assert escape_text("a\nb\x1b]0;t\x07\\") == r"a\nb\x1b]0;t\x07\\"
    assert plain_table(["id"], [[escape_text("x\nsb-fake")]]).splitlines() == [
        "ID", r"x\nsb-fake"]
    for bad in ({"note": "x\ny"}, {"note": "\x1b[2K"}, {"k\t": "v"}):
        with pytest.raises(InvalidArgument, match="printable"):
            SandboxSpec(labels=bad).validate()
    SandboxSpec(labels={"note": "ünïcode ok"}).validate()
