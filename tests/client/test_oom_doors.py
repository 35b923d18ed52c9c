"""An OOM kill inside an exec shows in that exec's result at every door (issue 19): the
SDK over the gateway and over REST (exec's JSON form and the exec_stream NDJSON line),
and the CLI (``dsec sandbox exec`` says it on stderr, ``--json`` has ``oom_killed``, also
with piped stdin), on a real container with a real memory hog; and the sandbox's stats
count it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dsec import LocalCluster
from dsec.wire.spec import ExecResult

pytestmark = pytest.mark.root

HOG = "head -c 400m /dev/zero | tail > /dev/null; echo survived"


def test_oom_killed_through_rest_and_the_gateway() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    with LocalCluster(edges=1, backend="container") as cl:
        for protocol in ("aether", "http"):
            with cl.client(protocol=protocol) as c:
                sb = c.sandboxes.create(memory="64MiB")
                try:
                    r = sb.exec(HOG, timeout=60)
                    assert b"survived" in r.stdout and r.oom_killed, (protocol, r)
                    assert not sb.exec("true").oom_killed
                    last = list(sb.exec_stream(HOG, timeout=60))[-1]
                    assert isinstance(last, ExecResult) and last.oom_killed, protocol
                    st = sb.stats()
                    assert st.oom_kills >= 2 and st.memory_limit_bytes == 64 << 20
                    assert st.net_rx_bytes is not None      # its own network namespace
                finally:
                    sb.kill()


def test_the_cli_says_an_exec_was_oom_killed() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    dsec = [sys.executable, "-c", "from dsec.cli.main import main; main()"]
    with LocalCluster(edges=1, backend="container") as cl, \
            cl.client(protocol="http", session_lease_s=None) as c:
        sb = c.sandboxes.create(memory="64MiB")
        env = {**os.environ, "DSEC_URL": cl.url, "DSEC_API_KEY": cl.api_key}
        try:
            for stdin, extra in ((subprocess.DEVNULL, []), (b"piped\n", []),
                                 (subprocess.DEVNULL, ["--json"])):
                r = subprocess.run([*dsec, "sandbox", "exec", sb.id, *extra, "--shell", HOG],
                                   env=env, capture_output=True, timeout=120,
                                   check=False, **({"input": stdin} if isinstance(
                                       stdin, bytes) else {"stdin": stdin}))
                if extra:
                    assert json.loads(r.stdout)["oom_killed"] is True, r
                else:
                    assert b"survived" in r.stdout and b"OOM killer" in r.stderr, r
                    assert b"--memory" in r.stderr, r
            r = subprocess.run([*dsec, "sandbox", "exec", sb.id, "true"], env=env,
                               capture_output=True, timeout=60, check=False,
                               stdin=subprocess.DEVNULL)
            assert r.returncode == 0 and b"OOM" not in r.stderr, r
        finally:
            sb.kill()


def test_a_background_process_says_it_was_oom_killed() -> None:
    """The process table's result carries ``oom_killed`` for its own OOM kill, not for
    another command's while it ran (both transports' handles read the same result)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    with LocalCluster(edges=1, backend="container") as cl, cl.client() as c:
        sb = c.sandboxes.create(memory="64MiB")
        try:
            bystander = sb.processes.start("sleep 60")
            hog = sb.exec("head -c 400m /dev/zero | tail > /dev/null", background=True)
            r = hog.wait(timeout=60)
            assert r.exit_code == 137 and r.oom_killed, r
            assert sb.exec(HOG, timeout=60).oom_killed      # another OOM kill meanwhile
            bystander.kill()
            assert not bystander.wait(timeout=30).oom_killed
        finally:
            sb.kill()
