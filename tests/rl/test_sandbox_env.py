"""SandboxEnv / SandboxEnvPool against real EdgeNodes (simulated backend) via EdgeAccess."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from dsec.edge.node import EdgeNode
from dsec.errors import Conflict, InvalidArgument
from dsec.ids import node_of
from dsec.rl.access import EdgeAccess
from dsec.rl.judges import ReferenceJudge, RegexJudge
from dsec.rl.sandbox import (
    CHARSET,
    SandboxEnv,
    SandboxEnvConfig,
    SandboxEnvPool,
    Shell,
    Submit,
    Task,
    WriteFile,
    clean_text,
    parse_action,
)
from dsec.wire.spec import ExecRequest, ExecResult

TASK = Task(prompt="Put the answer in /workspace/answer and submit it.",
            files={"/workspace/README": b"the answer is 42\n"},
            judge=ReferenceJudge("42"), max_turns=4, name="answer42")


def test_parse_action() -> None:
    assert parse_action("ls -la") == Shell(command="ls -la")
    assert parse_action('{"tool": "submit", "answer": "7"}') == Submit(answer="7")
    assert parse_action(json.dumps({"tool": "write_file", "path": "/a", "content": "x"})) == \
        WriteFile(path="/a", content="x")
    with pytest.raises(InvalidArgument, match="invalid tool call"):
        parse_action('{"tool": "rm_rf"}')
    with pytest.raises(InvalidArgument, match="empty action"):
        parse_action("   ")
    assert clean_text("a\x00b\u00e9", 100) == "a\\x00b\u00e9"
    assert len(clean_text("x" * 1000, 50)) == 50


def test_check_env_passes(sim_access: EdgeAccess) -> None:
    env = SandboxEnv(sim_access, [TASK], config=SandboxEnvConfig(max_obs_chars=256,
                                                                  max_action_chars=64))
    try:
        check_env(env, skip_render_check=True)
    finally:
        env.close()


def test_episode_with_tool_calls(sim_access: EdgeAccess, sim_nodes: dict[str, EdgeNode]) -> None:
    env = SandboxEnv(sim_access, [TASK])
    try:
        obs, info = env.reset(seed=3)
        assert obs == TASK.prompt and info["task"] == "answer42"
        sid = info["sandbox_id"]
        obs, r, term, trunc, _ = env.step("cat README")
        assert obs == "the answer is 42\n[exit 0]" and (r, term, trunc) == (0.0, False, False)
        obs, *_ = env.step(json.dumps({"tool": "write_file", "path": "/workspace/answer",
                                       "content": "42"}))
        assert obs == "wrote /workspace/answer"
        obs, *_ = env.step('{"tool": "read_file", "path": "/workspace/answer"}')
        assert obs == "42"
        obs, r, term, trunc, info = env.step('{"tool": "submit", "answer": " 42 "}')
        assert (r, term, trunc) == (1.0, True, False) and info["verdict"].passed
        env.reset()
        assert sim_nodes[node_of(sid)].get(sid).state == "destroyed"
        obs, *_ = env.step('{"tool": "oops"}')
        assert obs.startswith("error: invalid tool call")
        obs, *_ = env.step("nosuchcmd")
        assert obs.endswith("[exit 127]")
        env.step("true")
        obs, r, term, trunc, info = env.step("false")     # 4th turn: time limit
        assert (r, term, trunc) == (0.0, False, True)
        assert "differs" in info["verdict"].detail
    finally:
        env.close()


class _CountingNode:
    """Forwards to a real EdgeNode and counts exec_many round trips."""

    def __init__(self, node: EdgeNode) -> None:
        self.node = node
        self.exec_many_calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.node, name)

    async def exec_many(self, calls: Any) -> Any:
        self.exec_many_calls += 1
        return await self.node.exec_many(calls)


def test_pool_one_exec_round_trip_per_node_per_tick(sim_nodes: dict[str, EdgeNode],
                                                    loop_thread: Any) -> None:
    spies = {k: _CountingNode(v) for k, v in sim_nodes.items()}
    access = EdgeAccess(spies, loop_thread)
    tasks = [Task(prompt="count", judge=RegexJudge(r"\[exit 0\]", field="last_observation"),
                  max_turns=3)]
    pool = SandboxEnvPool(access, tasks, 6)
    try:
        obs, _ = pool.reset(seed=0)
        assert list(obs) == ["count"] * 6
        ids = pool.sandbox_ids()
        assert {node_of(i) for i in ids if i} == {"rl-a", "rl-b"}   # spread over nodes
        before = {k: s.exec_many_calls for k, s in spies.items()}
        for t in range(2):
            obs, rew, term, trunc, _ = pool.step([f"echo env{i} tick{t}" for i in range(6)])
            assert not (term.any() or trunc.any()) and not rew.any()
            assert list(obs) == [f"env{i} tick{t}\n[exit 0]" for i in range(6)]
        assert {k: s.exec_many_calls - before[k] for k, s in spies.items()} == \
            {"rl-a": 2, "rl-b": 2}
        # Third turn: every episode hits max_turns, is judged, and auto-resets.
        obs, rew, _, trunc, info = pool.step(["true"] * 3 + ["false"] * 3)
        assert trunc.all() and rew.tolist() == [1, 1, 1, 0, 0, 0]
        assert list(info["final_obs"]) == ["[exit 0]"] * 3 + ["[exit 1]"] * 3
        assert list(obs) == ["count"] * 6
        new_ids = pool.sandbox_ids()
        assert not set(new_ids) & set(ids)
        for sid in ids:
            assert sim_nodes[node_of(sid)].get(sid).state == "destroyed"  # type: ignore[union-attr]
    finally:
        pool.close()
    for sid in new_ids:
        assert sim_nodes[node_of(sid)].get(sid).state == "destroyed"  # type: ignore[union-attr]


def test_pool_misuse(sim_access: EdgeAccess) -> None:
    with pytest.raises(InvalidArgument, match="at least one task"):
        SandboxEnvPool(sim_access, [], 2)
    pool = SandboxEnvPool(sim_access, [TASK], 2)
    try:
        with pytest.raises(Conflict, match="reset"):
            pool.step(["true", "true"])
        with pytest.raises(InvalidArgument, match="pool state"):
            SandboxEnvPool.restore(b"junk", sim_access, [TASK], 2)
    finally:
        pool.close()


def test_charset_covers_tool_calls() -> None:
    assert set('{"tool": "submit", "answer": "x"}\n\t') <= set(CHARSET)
    assert np.dtype(object) == np.asarray(["a"], dtype=object).dtype


# -- issue 18, section 1: each test below failed on the code before the fix -------------

def test_non_ascii_output_is_kept_and_bad_bytes_are_escaped(sim_access: EdgeAccess) -> None:
    env = SandboxEnv(sim_access, [TASK])
    try:
        env.reset(seed=0)
        obs, *_ = env.step("echo naïve 中文 ✓")
        assert obs == "naïve 中文 ✓\n[exit 0]" and obs in env.observation_space
        # not UTF-8, and a terminal escape: shown as \xNN, nothing dropped or turned to '?'
        sid = env.episodes.states[0].sandbox_id
        assert sid is not None
        sim_access.write_file(sid, "/workspace/bin", b"ok \xff\xfe \x1b[31m\xc3\xa9\n")
        obs, *_ = env.step("cat /workspace/bin")
        assert obs == "ok \\xff\\xfe \\x1b[31mé\n[exit 0]" and obs in env.observation_space
        # actions may hold any printable text too
        assert "echo é" in env.action_space and "a\x00b" not in env.action_space
    finally:
        env.close()


def test_actions_outside_the_action_space_run_nothing(sim_access: EdgeAccess) -> None:
    cfg = SandboxEnvConfig(max_action_chars=40)
    env = SandboxEnv(sim_access, [TASK], config=cfg)
    try:
        env.reset(seed=0)
        sid = env.episodes.states[0].sandbox_id
        long = "echo pwned > /workspace/long; " + "#" * 20          # 50 chars > 40
        assert long not in env.action_space
        obs, r, term, trunc, _ = env.step(long)
        assert obs == ("error: the action is 50 characters long, over the limit of 40 "
                       "(max_action_chars); nothing was run")
        assert (r, term, trunc) == (0.0, False, False)
        obs, *_ = env.step("echo a\x00b > /workspace/nul")        # NUL: not in the space
        assert "control character \\x00" in obs and "nothing was run" in obs
        assert sid is not None
        ls = sim_access.exec_batch([(sid, ExecRequest(shell="ls /workspace"))])[0]
        assert isinstance(ls, ExecResult) and ls.stdout.split() == [b"README"]
    finally:
        env.close()


def test_step_after_the_episode_ended_raises_until_reset(sim_access: EdgeAccess) -> None:
    env = SandboxEnv(sim_access, [TASK])
    try:
        env.reset(seed=0)
        _, r, term, _, _ = env.step('{"tool": "submit", "answer": "42"}')
        assert term and r == 1.0
        for _ in range(2):     # judged once: no second payout, no second judge run
            with pytest.raises(Conflict, match="episode has ended.*reset"):
                env.step('{"tool": "submit", "answer": "42"}')
        env.reset()
        _, r, term, _, _ = env.step('{"tool": "submit", "answer": "42"}')
        assert term and r == 1.0
    finally:
        env.close()


def test_transcript_judge_does_not_match_the_prompt(sim_access: EdgeAccess) -> None:
    task = Task(prompt="print 'SOLVED' when you are done", max_turns=3,
                judge=RegexJudge("SOLVED", field="transcript"))
    env = SandboxEnv(sim_access, [task])
    try:
        env.reset(seed=0)
        *_, info = env.step('{"tool": "submit"}')       # did nothing: the prompt must not pay
        assert info["verdict"].reward == 0.0
        env.reset()
        env.step("echo SOLVED")
        _, r, *_ = env.step('{"tool": "submit"}')
        assert r == 1.0
    finally:
        env.close()


def test_infrastructure_failure_is_flagged_not_blamed_on_the_agent(
        sim_access: EdgeAccess) -> None:
    env = SandboxEnv(sim_access, [TASK])
    try:
        _, info = env.reset(seed=0)
        _, _, _, _, info = env.step("true")
        assert info == {"infra_error": False}
        sim_access.destroy(info_sid := env.episodes.states[0].sandbox_id)  # type: ignore[arg-type]
        obs, r, term, trunc, info = env.step("echo hi")
        assert obs.startswith("error:") and info_sid in obs
        # ended at once (truncated: the agent did not end it), no judge, flagged
        assert (r, term, trunc) == (0.0, False, True)
        assert info["infra_error"] is True and info["verdict"].infra_error
        assert info["verdict"].detail.startswith("infrastructure error")
        # the agent's own mistakes are not infrastructure errors
        env.reset()
        _, _, _, _, info = env.step('{"tool": "read_file", "path": "/nope"}')
        assert info == {"infra_error": False}
        _, _, _, _, info = env.step("nosuchprogram")
        assert info == {"infra_error": False}
    finally:
        env.close()
