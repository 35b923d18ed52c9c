"""``dsec apiserver`` (not only ``dsec up``) takes ``--log-level``/``--log-format json`` and
``--access-log``, and audits an admin action in its state dir (issue 19, "Logs"); the
library side is tests/test_logs.py."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time

import httpx

DSEC = [sys.executable, "-c", "from dsec.cli.main import main; main()"]


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_apiserver_json_logs_access_log_and_audit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    state = str(tmp_path / "state")
    access = str(tmp_path / "access.log")
    p = subprocess.Popen([*DSEC, "apiserver", "--state-dir", state, "--listen", "127.0.0.1:0",
                          "--gateway", "off", "--log-level", "info", "--log-format", "json",
                          "--access-log", access], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env={**os.environ})
    try:
        assert p.stderr is not None
        url = key = None
        lines: list[str] = []
        deadline = time.monotonic() + 60
        while (url is None or key is None) and time.monotonic() < deadline:
            line = p.stderr.readline().decode()
            assert line, f"dsec apiserver exited: {lines}"
            lines.append(line)
            if m := re.search(r"REST (http://\S+)", line):
                url = m.group(1)
            if m := re.search(r"admin key: (\S+)", line):
                key = m.group(1)
        assert url and key, lines
        h = {"authorization": f"Bearer {key}"}
        r = httpx.put(f"{url}/v1/quotas/logs19", headers=h,
                      json={"max_sandboxes": 3})
        assert r.status_code in (200, 204), r.text
        assert httpx.get(f"{url}/v1/sandboxes", headers=h).status_code == 200
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if os.path.exists(access) and "/v1/sandboxes" in _read(access):
                break
            time.sleep(0.1)
        recs = [json.loads(x) for x in _read(access).splitlines()]
        assert recs and all({"ts", "level"} <= set(r) for r in recs), recs
        assert stat.S_IMODE(os.stat(access).st_mode) == 0o600
        audit = os.path.join(state, "audit.log")
        text = _read(audit)
        assert "quota_set" in text and key not in text, text
        assert stat.S_IMODE(os.stat(audit).st_mode) == 0o600
    finally:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
    err = p.stderr.read().decode() if p.stderr else ""
    # every record on stderr after the banner is one JSON object with a time and a level
    recs = [json.loads(x) for x in [*lines, *err.splitlines()] if x.startswith("{")]
    assert recs, (lines, err)        # --log-level info: the start-up records at least
    for rec in recs:
        assert {"ts", "level", "logger", "msg"} <= set(rec), rec
    assert not [x for x in err.splitlines() if re.match(r"\d{4}-\d\d-\d\dT", x)], err
