"""Every door a ``dsec up`` opens, tried by another host user (hx, "every local user is
hostile"): the REST API, the E2B API, the edge's metrics and its Aether socket, the
state dir, the processes' command lines. A host user gets 401s, EACCES and aggregate
counts - never a sandbox id, label, env value, key or token, and no operation. (The
tier-specific doors: test_gvisor_control_socket.py; the vm tier's QMP/agent sockets
live in 0700 directories under the state dir.) The verdict of each is in
docs/host-security.md."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from dsec.cluster.runtime import check_key_file
from dsec.errors import InvalidArgument
from tests.security.hx_hardening.probe_user import run_as

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")]

PROBE = r"""
import json, os, socket, sys, urllib.request, urllib.error
cfg = json.loads(sys.argv[1])
out = {}
def get(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError as e:
        return -1, str(e)
out["rest"] = get(cfg["url"] + "/v1/sandboxes")
out["rest_metrics"] = get(cfg["url"] + "/metrics")
out["e2b"] = get(cfg["e2b"] + "/sandboxes")
out["edge_metrics"] = get(cfg["metrics"])
try:
    s = socket.socket(socket.AF_UNIX); s.connect(cfg["edge_sock"]); out["edge_sock"] = "open"
except OSError as e:
    out["edge_sock"] = e.errno
for k, p in (("state", cfg["state"]), ("local", cfg["state"] + "/local.json")):
    try:
        os.listdir(p) if k == "state" else open(p).read(); out[k] = "read"
    except OSError as e:
        out[k] = e.errno
cmdlines = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            cmdlines.append(open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace"))
        except OSError:
            pass
out["cmdlines"] = "\n".join(cmdlines)
environ = []
for pid in cfg["pids"]:
    try:
        environ.append(open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace"))
    except OSError as e:
        environ.append(e.errno)
out["environ"] = environ
print(json.dumps(out))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_host_user_gets_nothing_from_dsec_up(tmp_path: object) -> None:
    from dsec import Client

    state = os.path.join(str(tmp_path), "st")
    mport, eport = _free_port(), _free_port()
    p = subprocess.Popen([sys.executable, "-c", "from dsec.cli.main import main; main()",
                          "up", "--state-dir", state, "--listen", "127.0.0.1:0", "--quiet",
                          "--backend", "simulated", "--e2b", f"127.0.0.1:{eport}",
                          "--edge-metrics-port", str(mport)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    try:
        local: dict[str, str] = {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not local:
            try:
                with open(os.path.join(state, "local.json")) as f:
                    got = json.load(f)
                local = got if got.get("pid") == p.pid else {}
            except (OSError, ValueError):
                time.sleep(0.1)
        assert local, "dsec up did not start"
        with Client(local["url"], local["api_key"], protocol="http") as c:
            sb = c.sandboxes.create(labels={"hx-label": "hx-label-value-31337"},
                                    env={"HX_SECRET": "hx-env-value-27182"})
            # the edge's metrics name it (once it served an operation): to the token's
            # holder only
            assert sb.id
        edge_pids = [int(x) for x in subprocess.run(
            ["pgrep", "-P", str(p.pid)], capture_output=True, text=True,
            check=False).stdout.split()]
        cfg = {"url": local["url"], "e2b": local["e2b"], "state": state,
               "metrics": f"http://127.0.0.1:{mport}/metrics",
               "edge_sock": os.path.join(state, "edges", "edge-0.sock"),
               "pids": [p.pid, *edge_pids]}
        code, out = run_as(65534, PROBE, json.dumps(cfg), timeout_s=60)
        assert code == 0, out
        seen = json.loads(out)
        assert seen["rest"][0] == 401, seen["rest"]
        assert seen["e2b"][0] == 401, seen["e2b"]
        assert seen["edge_metrics"][0] == 401, seen["edge_metrics"]   # hx: was 200
        assert "sandbox_id" not in seen["edge_metrics"][1]
        assert seen["edge_sock"] == 13 and seen["state"] == 13 and seen["local"] == 13, seen
        assert all(e == 13 for e in seen["environ"]), seen["environ"]
        # the apiserver's /metrics is public by design: aggregate counts by route
        # template, op and state - nothing naming a sandbox, project, label or key
        assert seen["rest_metrics"][0] == 200
        secrets_ = [sb.id, "hx-label-value-31337", "hx-env-value-27182", local["api_key"]]
        with open(os.path.join(state, "metrics.token")) as f:
            secrets_.append(f.read().strip())
        for s in secrets_:
            assert s not in seen["rest_metrics"][1], s
            assert s not in seen["cmdlines"], s
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_a_readable_port_token_key_is_refused(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "port-token.key")
    with open(path, "wb") as f:
        f.write(os.urandom(32))
    os.chmod(path, 0o644)
    with pytest.raises(InvalidArgument, match="chmod 600"):
        check_key_file(path, os.stat(path))
    os.chmod(path, 0o600)
    check_key_file(path, os.stat(path))
    os.chown(path, 4242, 4242)
    with pytest.raises(InvalidArgument, match="uid 4242"):
        check_key_file(path, os.stat(path))
