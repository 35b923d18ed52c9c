"""An OOM kill inside an exec shows in that exec's result at every door (issue 19): the
SDK over the gateway and over REST (exec's JSON form and the exec_stream NDJSON line),
on a real container with a real memory hog; and the sandbox's stats count it."""

from __future__ import annotations

import os

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
