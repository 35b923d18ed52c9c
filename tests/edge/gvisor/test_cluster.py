"""The gvisor tier end to end: a LocalCluster whose edge (a `dsec edge` process) offers
the real gvisor backend beside the native container one; the SDK picks the tier with
``isolation="gvisor"`` and gets a sandbox on gVisor's kernel."""

from __future__ import annotations

import pytest

from dsec import LocalCluster

from .conftest import runsc_missing

pytestmark = pytest.mark.root


def test_sdk_isolation_gvisor_runs_on_gvisor_next_to_native() -> None:
    why = runsc_missing()
    if why:
        pytest.skip(why)
    with LocalCluster(edges=1, backend="container", tiers=("gvisor",)) as cl, \
            cl.client() as c:
        sb = c.sandboxes.create(isolation="gvisor")
        native = c.sandboxes.create()
        try:
            assert sb.isolation == "gvisor" and native.isolation == "container"
            kernel = sb.exec("uname -r").stdout.strip()
            assert kernel != native.exec("uname -r").stdout.strip()   # the Sentry's
            sb.files.write("/workspace/in.txt", b"from the sdk")
            r = sb.exec("cat /workspace/in.txt && echo out > /tmp/out.txt")
            assert r.exit_code == 0 and r.stdout == b"from the sdk"
            assert sb.files.read("/tmp/out.txt") == b"out\n"
            sb.pause()
            r = sb.exec("echo resumed")           # an exec resumes it
            assert r.stdout == b"resumed\n"
            r = sb.exec("sleep 5", timeout=0.5)
            assert r.timed_out
        finally:
            sb.kill()
            native.kill()
