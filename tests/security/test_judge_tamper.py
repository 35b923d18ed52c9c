"""An RL agent with root in its sandbox tries to earn a reward it did not deserve from
:class:`dsec.rl.judges.ExecutableJudge` on real container sandboxes.

The verifier checks ``/workspace/answer``'s sum function: ``add 2 3`` must print 5. The
agent does not solve the task; it attacks the judge instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from dsec.errors import InvalidArgument
from dsec.rl.access import EdgeAccess
from dsec.rl.judges import ExecutableJudge, JudgeContext
from dsec.wire.spec import ExecRequest, ExecResult, SandboxSpec
from tests.rl.conftest import container_edge

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

SPEC = SandboxSpec(backend="container", image="base", memory_bytes=256 << 20, pids_max=256)
# Hidden test: source the agent's solution and check it.
TEST_SH = b'. /workspace/solution.sh\n[ "$(add 2 3)" = 5 ] || { echo wrong; exit 1; }\n'


@pytest.fixture(scope="module")
def access() -> Iterator[EdgeAccess]:
    with container_edge("sec-judge") as (acc, _):
        yield acc


def _agent(access: EdgeAccess, *shell: str) -> str:
    sid = access.create(SPEC)
    for cmd in shell:
        r = access.exec_batch([(sid, ExecRequest(shell=cmd, timeout_s=20))])[0]
        assert isinstance(r, ExecResult) and r.exit_code == 0, r
    return str(sid)


def _verdict(access: EdgeAccess, sid: str, judge: ExecutableJudge) -> float:
    try:
        return float(judge.judge(JudgeContext(answer="", access=access, sandbox_id=sid,
                                              spec=SPEC)).reward)
    finally:
        access.destroy(sid)


WRONG = "mkdir -p /workspace && printf 'add() { echo 4; }\\n' > /workspace/solution.sh"


def test_judge_fails_an_honest_wrong_answer(access: EdgeAccess) -> None:
    for isolate in (False, True):
        judge = ExecutableJudge(hidden_files={"t.sh": TEST_SH},
                                command=["/bin/sh", "{tests}/t.sh"], isolate=isolate,
                                carry=["/workspace/solution.sh"] if isolate else ())
        assert _verdict(access, _agent(access, WRONG), judge) == 0.0


def test_default_judge_is_not_fooled_by_a_replaced_shell(access: EdgeAccess) -> None:
    with pytest.raises(InvalidArgument, match="carry"):  # no silent in-place default
        ExecutableJudge(hidden_files={"t.sh": TEST_SH}, command=["/bin/sh", "{tests}/t.sh"])
    judge = ExecutableJudge(hidden_files={"t.sh": TEST_SH}, command=["/bin/sh", "{tests}/t.sh"],
                            carry=["/workspace/solution.sh"])
    sid = _agent(access, WRONG, "rm /bin/sh && printf '#!/bin/busybox ash\\nexit 0\\n' > /bin/sh"
                                " && chmod 755 /bin/sh")
    assert _verdict(access, sid, judge) == 0.0


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="KNOWN LIMITATION (reward hacking, documented in judges.py): "
                   "with the default exit_code_score and a harness that sources the answer, "
                   "exit_code_score "
                   "(judges.py) trusts the verifier's exit status, but the carried answer is "
                   "code the verifier runs: a solution that calls 'exit 0' (sys.exit(0), "
                   "os._exit(0) in Python) ends the verifier 'successfully' even with "
                   "isolate=True. Score from a result the answer code cannot forge (e.g. a "
                   "per-judgement nonce written by the test harness after the tests finished, "
                   "or run the answer in a separate, unprivileged process)")
def test_isolated_judge_is_not_fooled_by_answer_code_that_exits_zero(
        access: EdgeAccess) -> None:
    judge = ExecutableJudge(hidden_files={"t.sh": TEST_SH}, command=["/bin/sh", "{tests}/t.sh"],
                            isolate=True, carry=["/workspace/solution.sh"])
    sid = _agent(access, "mkdir -p /workspace && printf 'exit 0\\n' > /workspace/solution.sh")
    assert _verdict(access, sid, judge) == 0.0


def test_marker_judge_is_not_fooled_by_answer_code_that_exits_zero(access: EdgeAccess) -> None:
    harness = (b'. /workspace/solution.sh\n[ "$(add 2 3)" = 5 ] || { echo wrong; exit 1; }\n'
               b'echo "DSEC-PASS $1"\n')
    judge = ExecutableJudge(hidden_files={"t.sh": harness},
                            command=["/bin/sh", "{tests}/t.sh", "{nonce}"],
                            carry=["/workspace/solution.sh"], require_marker=True)
    cheat = _agent(access, "mkdir -p /workspace && printf 'exit 0\\n' > /workspace/solution.sh")
    assert _verdict(access, cheat, judge) == 0.0
    forged = _agent(access, "mkdir -p /workspace && printf 'echo DSEC-PASS guess; exit 0\\n'"
                            " > /workspace/solution.sh")
    assert _verdict(access, forged, judge) == 0.0
    honest = _agent(access, "mkdir -p /workspace && printf 'add() { echo $(($1 + $2)); }\\n'"
                            " > /workspace/solution.sh")
    assert _verdict(access, honest, judge) == 1.0
