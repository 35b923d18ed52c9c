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
