"""Judges: text judges, rubric weights, and the executable judge's tamper resistance
(hidden tests injected only at judge time, reward only from the verifier itself)."""

from __future__ import annotations

import re
from collections.abc import Sequence

import pytest

from dsec.edge.node import EdgeNode
from dsec.errors import InvalidArgument
from dsec.ids import node_of
from dsec.rl.access import DelegatingAccess, EdgeAccess, ExecOutcome
from dsec.rl.judges import (
    Check,
    ExecutableJudge,
    JudgeContext,
    ReferenceJudge,
    RegexJudge,
    RubricJudge,
)
from dsec.rl.sandbox import SandboxEnv, Task
from dsec.wire.spec import ExecRequest, ExecResult, SandboxSpec


def test_regex_and_reference() -> None:
    ctx = JudgeContext(answer="The result is 42.", transcript=("a", "[exit 0]"))
    assert RegexJudge(r"\b42\b").judge(ctx).reward == 1.0
    assert RegexJudge(r"42", fullmatch=True).judge(ctx).reward == 0.0
    assert RegexJudge(r"exit 0", field="last_observation").judge(ctx).passed
    assert not RegexJudge(r"exit 0", field="answer").judge(ctx).passed
    with pytest.raises(InvalidArgument, match="invalid"):
        RegexJudge("(")
    assert ReferenceJudge("Hello  World").judge(JudgeContext(answer="hello world")).passed
    assert not ReferenceJudge("Hello", mode="exact").judge(JudgeContext(answer="hello")).passed
    assert ReferenceJudge("0.3", mode="numeric", tol=1e-9).judge(
        JudgeContext(answer=" 0.30000000000000004\n")).passed
    v = ReferenceJudge("1", mode="numeric").judge(JudgeContext(answer="one"))
    assert v.reward == 0.0 and "not a number" in v.detail


def test_rubric_weights() -> None:
    rubric = RubricJudge([
        Check("mentions 42", 3.0, RegexJudge("42")),
        Check("polite", 1.0, lambda c: "please" in c.answer),
        Check("short", 1.0, lambda c: len(c.answer) < 10),
    ])
    v = rubric.judge(JudgeContext(answer="42 please"))
    assert (v.reward, v.passed, v.detail) == (1.0, True, "all checks passed")
    v = rubric.judge(JudgeContext(answer="it is 42, I think"))
    assert v.reward == pytest.approx(3 / 5) and not v.passed
    assert v.detail == "failed: polite, short"
    with pytest.raises(InvalidArgument, match="positive finite weight"):
        RubricJudge([Check("x", 0.0, RegexJudge("x"))])
    with pytest.raises(InvalidArgument, match="at least one"):
        RubricJudge([])


# The simulated backend's shell has no test runner, so the verifier here prints the
# hidden expectation next to the answer and ``score`` compares them. What is under test
# is the judge's protocol: where tests come from and where the reward comes from.
def _score(res: ExecResult) -> float:
    lines = res.stdout.decode().splitlines()
    return 1.0 if len(lines) == 2 and lines[0] == f"expect {lines[1]}" else 0.0


# stop_agent=False: the simulated backend has no processes to stop (and no `sh`); the
# stop is tested on real containers (test_container.py).
HIDDEN = ExecutableJudge(hidden_files={"expected": b"expect 42\n"},
                         command=["cat", "{tests}/expected", "/workspace/answer"],
                         score=_score, cwd="/workspace", isolate=False, stop_agent=False)


def _episode(access: EdgeAccess, judge: ExecutableJudge,
             actions: Sequence[str]) -> tuple[float, str, str]:
    task = Task(prompt="write the answer to /workspace/answer, then submit", judge=judge,
                files={"/workspace/test_visible.sh": b"test \"$(cat answer)\" = 42\n"},
                max_turns=20)
    env = SandboxEnv(access, [task])
    try:
        _, info = env.reset(seed=0)
        for a in actions:
            obs, r, term, trunc, info2 = env.step(a)
            assert not (term or trunc), obs
        obs, r, term, _, info2 = env.step('{"tool": "submit", "answer": "42"}')
        assert term
        return r, info2["verdict"].detail, info["sandbox_id"]
    finally:
        env.close()


def test_executable_judge_rewards_a_correct_answer(sim_access: EdgeAccess) -> None:
    r, detail, _ = _episode(sim_access, HIDDEN, ["echo 42 > /workspace/answer"])
    assert r == 1.0 and detail == "verifier exit 0"


def test_fake_reward_file_and_edited_tests_earn_nothing(sim_access: EdgeAccess) -> None:
    cheats = [
        "echo 41 > /workspace/answer",
        "echo 1.0 > /workspace/reward; echo 1.0 > /tmp/reward.txt",
        "echo true > /workspace/test_visible.sh",        # edit the visible tests
        "mkdir -p /tmp/.judge-0000000000000000; echo expect 41 > /tmp/.judge-0000000000000000/expected",
        "ls /tmp",                                          # nothing hidden to find yet
    ]
    r, _, _ = _episode(sim_access, HIDDEN, cheats)
    assert r == 0.0


def test_hidden_tests_are_absent_until_judging(sim_access: EdgeAccess) -> None:
    task = Task(prompt="p", judge=HIDDEN, max_turns=20)
    env = SandboxEnv(sim_access, [task])
    try:
        env.reset(seed=0)
        obs, *_ = env.step("ls /tmp")
        assert ".judge-" not in obs
        env.step("echo 42 > /workspace/answer")
        *_, info = env.step('{"tool": "submit"}')
        assert info["verdict"].reward == 1.0
        # Each judging uses a fresh, unpredictable directory.
        sid = env.episodes.states[0].sandbox_id
        assert sid is not None
        ls = sim_access.exec_batch([(sid, ExecRequest(shell="ls /tmp"))])[0]
        assert isinstance(ls, ExecResult)
        dirs = re.findall(r"\.judge-[0-9a-f]{16}", ls.stdout.decode())
        assert len(dirs) == 1
        HIDDEN.judge(JudgeContext(answer="", access=sim_access, sandbox_id=sid))
        ls2 = sim_access.exec_batch([(sid, ExecRequest(shell="ls /tmp"))])[0]
        assert isinstance(ls2, ExecResult)
        assert len(set(re.findall(r"\.judge-[0-9a-f]{16}", ls2.stdout.decode()))) == 2
    finally:
        env.close()


class _TamperDuringRun(DelegatingAccess):
    """A background process of the agent's, rewriting hidden tests while the verifier
    runs (the simulated backend has no background processes, so the access does it)."""

    def exec_batch(self, calls: Sequence[tuple[str, ExecRequest]]) -> list[ExecOutcome]:
        for sid, req in calls:
            for a in req.argv:
                if "/.judge-" in a and a.endswith("expected"):
                    self.inner.write_file(sid, a, b"expect 41\n")
        return self.inner.exec_batch(calls)


def test_tests_modified_during_judging_give_zero(sim_access: EdgeAccess) -> None:
    sid = sim_access.create(SandboxSpec())
    try:
        sim_access.write_file(sid, "/workspace/answer", b"41\n")
        v = HIDDEN.judge(JudgeContext(answer="", access=_TamperDuringRun(sim_access),
                                      sandbox_id=sid))
        assert v.reward == 0.0 and "modified during judging" in v.detail
    finally:
        sim_access.destroy(sid)


def test_isolated_judging_sees_only_carried_files(sim_access: EdgeAccess,
                                                  sim_nodes: dict[str, EdgeNode]) -> None:
    created: list[str] = []

    class Spy(DelegatingAccess):
        def create(self, spec: SandboxSpec) -> str:
            sid = sim_access.create(spec)
            created.append(sid)
            return sid

    judge = ExecutableJudge(hidden_files={"expected": b"expect 42\n"},
                            command=["cat", "{tests}/expected", "/workspace/answer",
                                     "/workspace/notes"],
                            score=_score, cwd="/workspace", isolate=True,
                            carry=["/workspace/answer"])
    sid = sim_access.create(SandboxSpec())
    try:
        sim_access.write_file(sid, "/workspace/answer", b"42\n")
        sim_access.write_file(sid, "/workspace/notes", b"planted by the agent\n")
        v = judge.judge(JudgeContext(answer="", access=Spy(sim_access), sandbox_id=sid))
        # /workspace/notes was not carried: cat fails on it but prints the rest.
        assert v.reward == 1.0, v
        [fresh] = created
        assert fresh != sid and sim_nodes[node_of(fresh)].get(fresh).state == "destroyed"
    finally:
        sim_access.destroy(sid)
    with pytest.raises(InvalidArgument, match="carry"):
        ExecutableJudge(hidden_files={}, command=["true"], isolate=True)
    with pytest.raises(InvalidArgument, match="relative"):
        ExecutableJudge(hidden_files={"../x": b""}, command=["true"], isolate=False)


def test_a_judge_whose_sandbox_is_gone_says_infra_error(sim_access: EdgeAccess) -> None:
    """A lost episode sandbox is the platform's failure, a missing answer file the
    agent's; an env flags the former (infra_error), never blames the agent."""
    judge = ExecutableJudge(hidden_files={"expected": b"expect 42\n"},
                            command=["cat", "{tests}/expected", "/workspace/answer"],
                            score=_score, cwd="/workspace", carry=["/workspace/answer"])
    sid = sim_access.create(SandboxSpec())
    v = judge.judge(JudgeContext(answer="", access=sim_access, sandbox_id=sid))
    assert v.reward == 0.0 and not v.infra_error and "could not be read" in v.detail
    sim_access.destroy(sid)
    v = judge.judge(JudgeContext(answer="", access=sim_access, sandbox_id=sid))
    assert v.reward == 0.0 and v.infra_error, v
