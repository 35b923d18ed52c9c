"""`make demo` runs `dsec demo`: it must complete and leave nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("backend", ["container", "simulated"])
def test_demo_runs_to_completion(backend: str) -> None:
    if backend == "container" and os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    out = subprocess.run(
        [sys.executable, "-m", "dsec.cli.main", "demo", "-n", "6", "--backend", backend],
        capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "6/6 correct answers" in out.stdout
    assert "5/5 see the snapshot's files" in out.stdout
    assert "nothing was left behind" in out.stdout
    if backend == "container":  # the egress policy case (issue 14): one in, one refused
        text = " ".join(out.stdout.split())  # the table wraps its cells
        assert "1/1 installed and ran:" in text and "1/1 refused:" in text, out.stdout
        assert ("(allow mirror.test:8000): hello 1.0, installed from "
                "http://mirror.test:8000, running in") in text, out.stdout
        assert "bad address 'mirror.test:8000'" in text, out.stdout
        assert "event network_denied:" in text and "e.g. to 198.51.100.80:8000/tcp" in text
        assert "mirror.test's log: 1 request(s)" in text
        assert "0 router uplinks left" in text
