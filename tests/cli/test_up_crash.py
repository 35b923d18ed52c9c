"""kill -9 of ``dsec up --backend container`` used to leak its EROFS layer mounts (one
fresh mount root per process under /run/dsec, never reclaimed): each start now reclaims
the roots of dead processes, so repeated crashes leave only the live process's mounts,
and its sandboxes come back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.root


def _layer_mounts(state: str) -> set[str]:
    """Mount points of layers from this cluster's layer store (other work mounts too)."""
    out = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[-2].startswith(os.path.join(state, "layers") + "/"):
                out.add(fields[4])
    return out


def _start(state: str, *, backend: str = "container"
           ) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    p = subprocess.Popen([sys.executable, "-c", "from dsec.cli.main import main; main()",
                          "up", "--state-dir", state, "--listen", "127.0.0.1:0", "--quiet",
                          "--backend", backend], stderr=subprocess.PIPE)
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


def test_repeated_kill_9_of_dsec_up_leaks_no_layer_mounts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    from dsec import Client

    state = str(tmp_path / "st")
    made: list[str] = []
    p = None
    try:
        for _ in range(3):
            p, local = _start(state)
            with Client(local["url"], local["api_key"], session_lease_s=None) as c:
                made.append(c.sandboxes.create(detached=True).id)
                roots = {os.path.dirname(m) for m in _layer_mounts(state)}
                assert len(roots) == 1, roots  # only this process's; dead ones reclaimed
                for sid in made:  # and what the previous (killed) process made came back
                    assert c.sandboxes.get(sid).state == "running"
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
        p, local = _start(state)
        with Client(local["url"], local["api_key"], session_lease_s=None) as c:
            assert sorted(s.id for s in c.sandboxes.list()) == sorted(made)
        p.send_signal(signal.SIGTERM)  # a clean stop destroys them and unmounts its layers
        assert p.wait(60) == 0
        assert _layer_mounts(state) == set()
    finally:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()
        if p is not None:  # whatever a failed run left: a start reclaims, a stop destroys
            q, _ = _start(state)
            q.send_signal(signal.SIGTERM)
            q.wait(60)
