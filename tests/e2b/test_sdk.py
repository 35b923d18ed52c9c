"""The stock E2B SDK's public API, unchanged, against dsec's E2B layer (issue 20): one
test per call of :data:`dsec.bench._e2b_calls.CALLS` (a documented gap checks the exact
error docs/e2b.md names), the compatibility fraction computed from the run, and one
agent-harness episode run on both SDKs."""

from __future__ import annotations

import pytest

from dsec import LocalCluster
from dsec.bench._e2b_calls import (
    CALLS,
    Call,
    E2BTarget,
    Gap,
    harness_dsec,
    harness_e2b,
    run_calls,
)


@pytest.mark.parametrize("call", CALLS, ids=[c.name for c in CALLS])
def test_stock_sdk_call(e2b_target: E2BTarget, call: Call) -> None:
    """Behaves as E2B documents, or is a documented gap whose exact error the call
    checked (docs/e2b.md 'Gaps')."""
    try:
        call.fn(e2b_target)
    except Gap:
        pass


def test_compatible_fraction_is_computed_from_a_run(e2b_target: E2BTarget) -> None:
    """The ratio the bench records is counted over outcomes, not written down: a call
    that fails counts against it, a gap never counts for it."""
    quick = [c for c in CALLS if c.name in ("Sandbox.kill", "files.exists",
                                            "unsupported create options and routes")]
    out = run_calls(e2b_target, quick)
    assert all(o.ok for o in out), out
    assert {o.name: o.compatible for o in out} == {
        "Sandbox.kill": True, "files.exists": True,
        "unsupported create options and routes": False}
    broken = run_calls(e2b_target, [type(quick[0])("broken", lambda t: 1 / 0)])
    assert not broken[0].ok and not broken[0].compatible
    assert "ZeroDivisionError" in broken[0].error


def test_agent_harness_runs_on_both_sdks(e2b_cluster: LocalCluster,
                                         e2b_target: E2BTarget) -> None:
    with e2b_cluster.client(session_lease_s=None) as c:
        native = harness_dsec(c, e2b_target.template)
    compat = harness_e2b(e2b_target)
    for rep in (native, compat):
        assert rep.exit_code == 0, rep
        assert rep.stdout == "PASS add\nPASS neg\n", rep
        assert rep.results == "result=0\n", rep


def test_default_code_context_is_dsecs_run_code_kernel(e2b_cluster: LocalCluster,
                                                       e2b_target: E2BTarget) -> None:
    """One kernel, two doors: what e2b-code-interpreter's default context defines, dsec's
    own ``sb.run_code`` with the same API key sees (and the other way round); a created
    context is apart from both."""
    from e2b_code_interpreter import Sandbox as CodeSandbox
    assert e2b_target.python_template
    sb = CodeSandbox.create(e2b_target.python_template, timeout=120, **e2b_target.opts())
    try:
        assert sb.run_code("shared = 7").error is None
        with e2b_cluster.client(session_lease_s=None) as c:
            native = c.sandboxes.get(sb.sandbox_id)
            assert native.run_code("shared * 6").text == "42"
            native.run_code("back = 'from dsec'")
            # the kernel's timeout still interrupts (the run loop streams or not alike)
            slow = native.run_code("import time\nprint('before')\ntime.sleep(30)", timeout=1)
            assert slow.timed_out and slow.error is not None, slow
            assert slow.error.name == "KeyboardInterrupt" and slow.stdout == "before\n"
        assert sb.run_code("back").text == "'from dsec'"
        ctx = sb.create_code_context()
        missing = sb.run_code("shared", context=ctx)
        assert missing.error is not None and missing.error.name == "NameError"
    finally:
        sb.kill()
