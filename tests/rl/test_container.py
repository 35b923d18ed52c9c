"""Sandbox envs and the executable judge on real container sandboxes (root; runs on CI).

Tamper-proof judging needs real isolation: here the agent's commands really run as root
in a busybox container and try to cheat the verifier.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from dsec.edge.node import EdgeNode
from dsec.errors import InvalidArgument
from dsec.ids import node_of
from dsec.rl.access import EdgeAccess
from dsec.rl.judges import ExecutableJudge, JudgeContext
from dsec.rl.sandbox import SandboxEnv, SandboxEnvConfig, SandboxEnvPool, Task
from dsec.wire.spec import ExecRequest, ExecResult, SandboxSpec
from tests.rl.conftest import container_edge

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)"),
]

SPEC = SandboxSpec(backend="container", image="base", memory_bytes=256 << 20, pids_max=256)
TEST_SH = b'test "$(cat /workspace/answer)" = 42 || { echo "wrong answer"; exit 1; }\necho ok\n'


def _judge(isolate: bool) -> ExecutableJudge:
    return ExecutableJudge(hidden_files={"test.sh": TEST_SH},
                           command=["/bin/sh", "{tests}/test.sh"], cwd="/workspace",
                           isolate=isolate, carry=["/workspace/answer"] if isolate else (),
                           timeout_s=20.0)


@pytest.fixture(scope="module")
def container() -> Iterator[tuple[EdgeAccess, EdgeNode]]:
    with container_edge("rl-ct") as pair:
        yield pair


def _episode(access: EdgeAccess, judge: ExecutableJudge, actions: list[str]) -> float:
    task = Task(prompt="Write the answer to /workspace/answer. Tests: /workspace/tests.sh",
                files={"/workspace/tests.sh": TEST_SH}, judge=judge, spec=SPEC, max_turns=20)
    env = SandboxEnv(access, [task])
    try:
        env.reset(seed=0)
        for a in actions:
            obs, _, term, trunc, _ = env.step(a)
            assert not (term or trunc), obs
        _, reward, term, _, _ = env.step('{"tool": "submit"}')
        assert term
        return float(reward)
    finally:
        env.close()


@pytest.mark.parametrize("isolate", [False, True])
def test_correct_answer_passes(container: tuple[EdgeAccess, EdgeNode], isolate: bool) -> None:
    access, _ = container
    assert _episode(access, _judge(isolate), ["echo 42 > /workspace/answer"]) == 1.0


@pytest.mark.parametrize("isolate", [False, True])
def test_cheating_agent_gets_no_credit(container: tuple[EdgeAccess, EdgeNode],
                                       isolate: bool) -> None:
    access, _ = container
    cheats = [
        "echo 41 > /workspace/answer",
        "echo 1.0 > /workspace/reward.txt; echo 1.0 > /tmp/reward; echo PASS > /tmp/result",
        "printf 'exit 0\\n' > /workspace/tests.sh",          # edit the visible tests
        "for i in 0 1 2 3; do mkdir -p /tmp/.judge-$i; printf 'exit 0' > /tmp/.judge-$i/test.sh; done",
    ]
    assert _episode(access, _judge(isolate), cheats) == 0.0


def test_isolated_judge_ignores_replaced_binaries_and_background_tamperers(
        container: tuple[EdgeAccess, EdgeNode]) -> None:
    access, _ = container
    cheats = [
        "echo 41 > /workspace/answer",
        # Replace the shell the verifier would run with one that always passes ...
        "rm /bin/sh && printf '#!/bin/busybox ash\\nexit 0\\n' > /bin/sh && chmod 755 /bin/sh",
        # ... and leave a process behind that rewrites any test that shows up.
        # (setsid: its own session, so it outlives the exec that started it)
        ("/bin/busybox setsid /bin/busybox ash -c 'while :; do for f in /tmp/.judge-*/test.sh;"
         " do [ -f \"$f\" ] && echo \"exit 0\" > \"$f\"; done; done' </dev/null >/dev/null 2>&1 &"),
    ]
    assert _episode(access, _judge(True), cheats) == 0.0


def _procs(access: EdgeAccess, sid: str) -> list[str]:
    r = access.exec_batch([(sid, ExecRequest(
        shell="for d in /proc/[0-9]*; do p=${d#/proc/}; [ $p = $$ ] || echo $p; done"))])[0]
    assert isinstance(r, ExecResult) and r.exit_code == 0, r
    return r.stdout.decode().split()


def test_in_place_judge_kills_the_agents_processes_first(
        container: tuple[EdgeAccess, EdgeNode]) -> None:
    """A tamperer left running (it rewrites any hidden test that shows up) is killed
    before the hidden files are written: the honest answer is judged on its merits and
    nothing of the agent's is alive afterwards (issue 18)."""
    access, _ = container
    sid = access.create(SPEC)
    try:
        r = access.exec_batch([(sid, ExecRequest(
            shell="mkdir -p /workspace && echo 41 > /workspace/answer"))])
        assert isinstance(r[0], ExecResult) and r[0].exit_code == 0
        for _ in range(2):          # two of them, in their own sessions
            access.exec_batch([(sid, ExecRequest(shell=(
                "/bin/busybox setsid /bin/busybox ash -c 'while :; do "
                "for f in /tmp/.judge-*/test.sh;"
                " do [ -f \"$f\" ] && echo \"exit 0\" > \"$f\"; done; done' "
                "</dev/null >/dev/null 2>&1 &")))])
        assert len(_procs(access, sid)) >= 3          # init + the two tamperers
        v = _judge(False).judge(JudgeContext(answer="", access=access, sandbox_id=sid,
                                             spec=SPEC))
        assert _procs(access, sid) == ["1"]            # only the sandbox's init is left
        assert v.reward == 0.0 and v.detail == "verifier exit 1", v   # tests ran as written
        access.exec_batch([(sid, ExecRequest(shell="echo 42 > /workspace/answer"))])
        v = _judge(False).judge(JudgeContext(answer="", access=access, sandbox_id=sid,
                                             spec=SPEC))
        assert v.reward == 1.0
    finally:
        access.destroy(sid)


def test_in_place_judge_stops_a_forking_agent(container: tuple[EdgeAccess, EdgeNode]) -> None:
    """A respawner forking as fast as it can (bounded by the sandbox's pids_max) is no
    way around the stop: SIGKILL to every process until /proc shows none."""
    access, _ = container
    sid = access.create(SPEC)
    try:
        access.exec_batch([(sid, ExecRequest(shell=(
            "mkdir -p /workspace && echo 42 > /workspace/answer && "
            "/bin/busybox setsid /bin/busybox ash -c 'while :; do (sleep 30 &); done' "
            "</dev/null >/dev/null 2>&1 &")))])
        access.exec_batch([(sid, ExecRequest(shell="sleep 0.2"))])   # let it get going
        assert len(_procs(access, sid)) >= 2                          # init + respawner(s)
        v = _judge(False).judge(JudgeContext(answer="", access=access, sandbox_id=sid,
                                             spec=SPEC))
        assert v.reward == 1.0, v
        assert _procs(access, sid) == ["1"]
    finally:
        access.destroy(sid)


CHEAT_SH = (b"# the 'answer': reads the hidden expectation instead of computing it\n"
            b"cat /tmp/.judge-*/expected 2>/dev/null || echo 'cannot read'\n")
HARNESS_SH = (b'# the harness runs the answer as nobody\n'
              b'out=$(su -s /bin/sh nobody -c "sh /workspace/answer.sh")\n'
              b'test "$out" = "$(cat "$(dirname "$0")/expected")" && echo "DSEC-PASS $1"\n')


@pytest.mark.parametrize("isolate", [False, True])
def test_answer_run_as_nobody_cannot_read_the_hidden_tests(
        container: tuple[EdgeAccess, EdgeNode], isolate: bool) -> None:
    """The harness runs the answer as `nobody`; the answer cats the hidden expectation.
    Before: 0644 files in a 0755 dir, so it printed the expected output and earned 1.0
    (in place and isolated + marker). Now: 0600 in 0700, owned by root."""
    access, _ = container
    judge = ExecutableJudge(
        hidden_files={"test.sh": HARNESS_SH, "expected": b"the secret 1234"},
        command=["/bin/sh", "{tests}/test.sh", "{nonce}"],
        cwd="/workspace", isolate=isolate, require_marker=True,
        carry=["/workspace/answer.sh"] if isolate else (), timeout_s=20.0)
    sid = access.create(SPEC)
    try:
        access.exec_batch([(sid, ExecRequest(shell="mkdir -p /workspace"))])
        access.write_file(sid, "/workspace/answer.sh", CHEAT_SH)
        v = judge.judge(JudgeContext(answer="", access=access, sandbox_id=sid, spec=SPEC))
        assert v.reward == 0.0, v
        # an honest answer passes through the same harness (the protocol works)
        access.write_file(sid, "/workspace/answer.sh", b"echo 'the secret 1234'\n")
        v = judge.judge(JudgeContext(answer="", access=access, sandbox_id=sid, spec=SPEC))
        assert v.reward == 1.0, v
        if not isolate:
            ls = access.exec_batch([(sid, ExecRequest(
                shell="stat -c '%a %U %n' /tmp/.judge-*/ /tmp/.judge-*/*"))])[0]
            assert isinstance(ls, ExecResult)
            modes = {line.split()[0] for line in ls.stdout.decode().splitlines()}
            owners = {line.split()[1] for line in ls.stdout.decode().splitlines()}
            assert modes == {"700", "600"} and owners == {"root"}, ls.stdout
    finally:
        access.destroy(sid)


def test_answer_command_runs_unprivileged_before_the_tests_exist(
        container: tuple[EdgeAccess, EdgeNode]) -> None:
    """answer_command: the judge runs the answer itself, as answer_user, before any
    hidden file exists, and hands its output to the verifier (0600 files)."""
    access, _ = container
    verify = (b'test "$(cat "$(dirname "$0")/answer.stdout")" = "$(cat "$(dirname "$0")/'
              b'expected")" && test "$(cat "$(dirname "$0")/answer.exit")" = 0\n')
    judge = ExecutableJudge(hidden_files={"v.sh": verify, "expected": b"65534 x"},
                            command=["/bin/sh", "{tests}/v.sh"], cwd="/workspace",
                            isolate=True, carry=["/workspace/answer.sh"],
                            answer_command=["/bin/sh", "/workspace/answer.sh"],
                            timeout_s=20.0)
    sid = access.create(SPEC)
    try:
        access.exec_batch([(sid, ExecRequest(shell="mkdir -p /workspace"))])
        # prints its uid (must be nobody's) and what it finds of the tests (nothing)
        access.write_file(sid, "/workspace/answer.sh",
                          b'echo "$(id -u) $(ls -d /tmp/.judge-* 2>/dev/null || echo x)"\n')
        v = judge.judge(JudgeContext(answer="", access=access, sandbox_id=sid, spec=SPEC))
        assert v.reward == 1.0, v
        with pytest.raises(InvalidArgument, match="unprivileged"):
            ExecutableJudge(hidden_files={}, command=["true"], isolate=False,
                            answer_command=["true"], answer_user="root")
        with pytest.raises(InvalidArgument, match="never sees them"):
            ExecutableJudge(hidden_files={}, command=["true"], isolate=False,
                            answer_command=["cat", "{tests}/x"])
    finally:
        access.destroy(sid)


def test_check_env_and_batched_pool_on_containers(container: tuple[EdgeAccess, EdgeNode]) -> None:
    access, node = container
    task = Task(prompt="hello", spec=SPEC, max_turns=3, judge=_judge(False))
    env = SandboxEnv(access, [task], config=SandboxEnvConfig(max_obs_chars=512,
                                                             max_action_chars=48))
    try:
        check_env(env, skip_render_check=True)
    finally:
        env.close()
    pool = SandboxEnvPool(access, [task], 4)
    try:
        pool.reset(seed=1)
        acts = np.empty(4, dtype=object)
        acts[:] = [f"echo {i} > /workspace/answer; hostname; cat /workspace/answer"
                   for i in range(4)]
        obs, *_ = pool.step(acts)
        hostnames = {o.splitlines()[0] for o in obs}
        assert len(hostnames) == 4                     # four separate sandboxes
        assert [o.splitlines()[1] for o in obs] == ["0", "1", "2", "3"]
        ids = pool.sandbox_ids()
        for sid in ids:
            assert sid is not None
            access.pause(sid)
            assert node.get(sid).state == "paused" and node_of(sid) == "rl-ct"
            access.resume(sid)
    finally:
        pool.close()
    for sid in ids:
        assert node.get(sid).state == "destroyed"  # type: ignore[arg-type]
