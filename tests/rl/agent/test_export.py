"""Trajectory export (JSONL, Parquet) and the trainer adapters' formats: verl's
AgentLoopOutput fields and agent-loop signature, TRL's reward-function call convention."""

from __future__ import annotations

import inspect
import io
import json

import pyarrow.parquet as pq
import pytest

from dsec import LocalCluster
from dsec.errors import InvalidArgument
from dsec.rl.access import ClientAccess
from dsec.rl.adapters import VERL_OUTPUT_FIELDS, DsecAgentLoop, JudgeReward, trajectory_to_verl
from dsec.rl.agent.policy import OpenAIPolicy, PolicyConfig
from dsec.rl.agent.sandboxes import ClientSandboxes
from dsec.rl.agent.scripted import ScriptedEndpoint
from dsec.rl.agent.types import (
    Message,
    Step,
    ToolCall,
    Trajectory,
    VerdictRecord,
)
from dsec.rl.engine import RolloutEngine
from dsec.rl.export import JsonlWriter, read_jsonl, write_jsonl, write_parquet
from dsec.rl.judges import ExecutableJudge, ReferenceJudge
from dsec.rl.tasks import AgentTask, TaskRegistry
from dsec.wire.spec import SandboxSpec


def _traj(i: int, *, infra: bool = False) -> Trajectory:
    call = ToolCall(id=f"c{i}", name="bash", arguments='{"command": "echo hi"}')
    return Trajectory(
        episode_id=f"ep{i}", task_id=f"t{i % 2}", group_id="g", epoch=0,
        messages=[Message(role="user", content="do"),
                  Message(role="assistant", tool_calls=(call,), token_ids=[5, 6, 7],
                          logprobs=[-0.1, -0.2, -0.3], prompt_token_ids=[1, 2]),
                  Message(role="tool", content="hi\n[exit 0]", tool_call_id=f"c{i}")],
        steps=[Step(index=0, action=call, observation="hi\n[exit 0]", exit_code=0)],
        reward=0.0 if infra else 1.0, infra_error="node lost" if infra else None,
        verdict=None if infra else VerdictRecord(reward=1.0, passed=True, detail="ok"),
        end="infra_error" if infra else "submitted")


def test_jsonl_round_trip_and_append(tmp_path) -> None:  # type: ignore[no-untyped-def]
    trajs = [_traj(i, infra=i == 2) for i in range(4)]
    path = tmp_path / "t.jsonl"
    assert write_jsonl(trajs, path) == 4
    assert list(read_jsonl(path)) == trajs
    with JsonlWriter(path) as w:                          # appends, one flushed line each
        w.write(_traj(9))
        assert len(path.read_bytes().splitlines()) == 5
    lines = path.read_bytes().splitlines()
    doc = json.loads(lines[2])
    assert doc["infra_error"] == "node lost" and "verdict" not in doc
    assert doc["messages"][1]["logprobs"] == [-0.1, -0.2, -0.3]
    path.write_bytes(path.read_bytes() + b'{"episode_id": "torn"')
    with pytest.raises(InvalidArgument, match="line 6"):
        list(read_jsonl(path))


def test_parquet_rows() -> None:
    buf = io.BytesIO()
    assert write_parquet([_traj(0), _traj(1, infra=True)], buf) == 2
    buf.seek(0)
    table = pq.read_table(buf)
    rows = table.to_pylist()
    assert [r["reward"] for r in rows] == [1.0, 0.0]
    assert [r["passed"] for r in rows] == [True, None]
    assert rows[1]["infra_error"] == "node lost"
    assert json.loads(rows[0]["messages"])[1]["token_ids"] == [5, 6, 7]
    assert {"task_id", "group_id", "epoch", "end", "num_steps", "total_s",
            "steps"} <= set(table.column_names)


def _tok(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_verl_output_format() -> None:
    out = trajectory_to_verl(_traj(0), _tok)
    assert tuple(out) == VERL_OUTPUT_FIELDS
    assert out["prompt_ids"] == [1, 2]                            # the endpoint's own ids
    tool_len = len("hi\n[exit 0]")
    assert out["response_ids"][:3] == [5, 6, 7]
    assert out["response_mask"] == [1, 1, 1] + [0] * tool_len     # train on model tokens only
    assert out["response_logprobs"] == [-0.1, -0.2, -0.3] + [0.0] * tool_len
    assert len(out["response_ids"]) == len(out["response_mask"]) == len(out["response_logprobs"])
    assert out["reward_score"] == 1.0 and out["num_turns"] == 3
    assert set(out["metrics"]) == {"generate_sequences", "tool_calls"}
    assert out["extra_fields"]["infra_error"] is None
    # no ids/logprobs from the endpoint: the tokenizer spells the reply, logprobs are None
    t = _traj(1)
    t.messages[1].token_ids = t.messages[1].logprobs = t.messages[1].prompt_token_ids = None
    out = trajectory_to_verl(t, _tok)
    assert out["response_logprobs"] is None and out["prompt_ids"] == _tok("do")


def test_verl_agent_loop_signature() -> None:
    sig = inspect.signature(DsecAgentLoop.run)
    assert inspect.iscoroutinefunction(DsecAgentLoop.run)
    assert list(sig.parameters)[:2] == ["self", "sampling_params"]
    assert any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())


SPEC = SandboxSpec(backend="container", memory_bytes=128 << 20, pids_max=128)
EXE = ExecutableJudge(hidden_files={"t.sh": b'test "$(cat /workspace/answer)" = 42\n'},
                      command=["/bin/sh", "{tests}/t.sh"], carry=["/workspace/answer"])


async def test_verl_agent_loop_runs_a_dsec_episode(cluster: LocalCluster,
                                                   endpoint: ScriptedEndpoint) -> None:
    reg = TaskRegistry([AgentTask(id="v1", prompt="```bash\necho 42 > /workspace/answer\n```",
                                  judge=EXE, spec=SPEC)])
    ac = cluster.async_client()
    pol = OpenAIPolicy(PolicyConfig(base_url=endpoint.base_url, model="honest"))
    DsecAgentLoop.configure(lambda: RolloutEngine(ClientSandboxes(ac), pol), reg)

    class Tok:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return _tok(text)
    try:
        out = await DsecAgentLoop(tokenizer=Tok()).run({"temperature": 1.0},
                                                       extra_info={"task_id": "v1"})
        assert out["reward_score"] == 1.0 and out["extra_fields"]["task_id"] == "v1"
        assert 1 in out["response_mask"] and 0 in out["response_mask"]
        assert out["response_logprobs"] is not None
    finally:
        DsecAgentLoop.configure(lambda: None, {})  # type: ignore[arg-type, return-value]
        await pol.close()
        await ac.close()


def test_trl_reward_function(cluster: LocalCluster) -> None:
    tasks = {"ref": AgentTask(id="ref", prompt="2+2?", judge=ReferenceJudge("4")),
             "exe": AgentTask(id="exe", prompt="the answer", judge=EXE, spec=SPEC)}
    with cluster.client() as client:
        reward = JudgeReward(tasks, access=ClientAccess(client))
        assert reward.__name__ == "dsec_judge"
        sig = inspect.signature(reward.__call__)
        assert {"prompts", "completions", "completion_ids"} <= set(sig.parameters)
        got = reward(prompts=["2+2?"] * 2 + ["a"] * 2,
                     completions=["4", [{"role": "assistant", "content": "5"}], "42", "41"],
                     completion_ids=[[1]] * 4, task_id=["ref", "ref", "exe", "exe"])
        assert got == [1.0, 0.0, 1.0, 0.0]
        assert client.sandboxes.list(state="running") == []
        with pytest.raises(InvalidArgument, match="task_id"):
            reward(completions=["4"])
