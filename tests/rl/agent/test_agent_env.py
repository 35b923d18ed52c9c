"""AgentEnv: a Gymnasium env whose action is the model's reply text, on container
sandboxes through a sync Client; reset(options={"task": ...}) picks the task."""

from __future__ import annotations

import json

import pytest

from dsec import LocalCluster
from dsec.errors import Conflict, InvalidArgument
from dsec.rl.agent_env import AgentEnv
from dsec.rl.judges import ExecutableJudge
from dsec.rl.tasks import AgentTask, TaskRegistry
from dsec.wire.spec import SandboxSpec

SPEC = SandboxSpec(backend="container", memory_bytes=128 << 20, pids_max=128)
JUDGE = ExecutableJudge(hidden_files={"t.sh": b'test "$(cat /workspace/answer)" = 42\n'},
                        command=["/bin/sh", "{tests}/t.sh"], carry=["/workspace/answer"])


def call(name: str, **args: object) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


def test_agent_env_episode(cluster: LocalCluster) -> None:
    reg = TaskRegistry([AgentTask(id="a", prompt="write 42", judge=JUDGE, spec=SPEC,
                                  max_turns=4),
                        AgentTask(id="b", prompt="other", judge=JUDGE, spec=SPEC)])
    with cluster.client() as client:
        env = AgentEnv(client, reg)
        try:
            obs, info = env.reset(seed=1, options={"task": "a"})
            assert obs == "write 42" and info["task_id"] == "a" and info["sandbox_id"]
            # prose is never run (strict), a bare JSON call is accepted
            obs, r, term, trunc, _ = env.step("echo 42 > /workspace/answer")
            assert "no tool call" in obs and (r, term, trunc) == (0.0, False, False)
            obs, r, term, trunc, _ = env.step(json.dumps(
                {"name": "write_file", "arguments": {"path": "answer", "content": "42\n"}}))
            assert "wrote 3 bytes to /workspace/answer" in obs
            obs, r, term, trunc, _ = env.step(call("bash", command="cat answer"))
            assert obs == "42\n[exit 0]"
            obs, r, term, trunc, info = env.step(call("submit", answer="42"))
            assert (r, term, trunc) == (1.0, True, False) and info["verdict"].passed
            assert info["trajectory"].end == "submitted" and len(info["trajectory"].steps) == 4
            with pytest.raises(Conflict, match="reset"):
                env.step(call("bash", command="true"))
            assert reg.stats("a").attempts == 1 and reg.stats("a").passes == 1
            # out of turns: truncated, judged (the answer is wrong)
            env.reset(options={"task": "a"})
            for _ in range(3):
                env.step(call("bash", command="echo 7 > /workspace/answer"))
            obs, r, term, trunc, info = env.step(call("bash", command="true"))
            assert (r, term, trunc) == (0.0, False, True) and not info["verdict"].passed
            # without options: epochs without replacement over the registry
            seen = [env.reset(seed=3)[1]["task_id"], env.reset()[1]["task_id"]]
            assert sorted(seen) == ["a", "b"]
            with pytest.raises(InvalidArgument, match="task"):
                env.reset(options={"level": 3})
        finally:
            env.close()
        assert client.sandboxes.list(state="running") == []
