"""Shared bits of the hx hardening tests: run a probe as an unprivileged host user."""

from __future__ import annotations

import os
import subprocess
import sys

#: a host uid that is nobody's: the sandbox runtimes map other uids to 65534 (nobody),
#: so the tests run their probes both as that and as an ordinary unmapped user
UNPRIVILEGED_UIDS = (65534, 4242)


def run_as(uid: int, code: str, *args: str, timeout_s: float = 20.0) -> tuple[int, str]:
    """Run ``code`` with the system Python as host ``uid`` (gid the same, no groups):
    (exit code, stdout+stderr). The venv's interpreter sits in a 0700 home."""
    py = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    r = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                        "--inh-caps=-all", py, "-I", "-c", code, *args],
                       capture_output=True, text=True, timeout=timeout_s, cwd="/", check=False)
    return r.returncode, r.stdout + r.stderr
