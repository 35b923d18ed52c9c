"""The flywheel example end to end (examples/rl_flywheel.py) on container sandboxes with the
scripted endpoint: proposals -> built, snapshotted, registered task images -> solver groups
from the snapshot -> judged with hidden tests from a layer solvers never mount."""

from __future__ import annotations

import importlib.util
import json
import pathlib
from types import ModuleType

import pytest

from dsec import LocalCluster
from dsec.errors import InvalidArgument
from dsec.rl.agent.scripted import ScriptedEndpoint
from dsec.rl.agent.types import Message, ToolCall
from dsec.rl.export import read_jsonl
from dsec.rl.flywheel import parse_proposals
from dsec.rl.judges import ExecutableJudge
from dsec.rl.tasks import TaskRegistry

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rl_flywheel", ROOT / "examples/rl_flywheel.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


async def test_flywheel_end_to_end(cluster: LocalCluster, tmp_path: pathlib.Path) -> None:
    ex = _example()
    reg = TaskRegistry()
    out = tmp_path / "fw.jsonl"
    with ScriptedEndpoint(policies={"proposer": ex.proposer}) as ep:
        ac = cluster.async_client()
        try:
            summary = await ex.run(ac, ep.base_url, group_size=3, out=str(out), registry=reg)
            assert summary["infra_errors"] == []
            assert summary["rewards"] == {"sum-numbers": [1.0] * 3, "count-words": [0.0] * 3}
            assert summary["cheater_rewards"] == [0.0, 0.0]
            assert summary["tasks"]["sum-numbers"]["pass_rate"] == pytest.approx(3 / 5)
            assert summary["tasks"]["count-words"]["pass_rate"] == 0.0
            assert len(list(read_jsonl(out))) == summary["trajectories"] == 8

            task = reg.get("sum-numbers")
            snap, hidden = task.metadata["snapshot"], task.metadata["hidden_layer"]
            assert task.spec.snapshot == snap and task.spec.toolkits == ()
            judge = task.judge
            assert isinstance(judge, ExecutableJudge) and judge.judge_spec is not None
            assert judge.judge_spec.toolkits == (hidden,) and judge.isolate
            # a solver's sandbox: the builder's environment is there, the hidden tests not
            sb = await ac.sandboxes.create(spec=task.spec)
            try:
                r = await sb.exec("wc -l < /workspace/data.txt; ls /opt/dsec-hidden")
                assert r.stdout.split()[0] == b"100"
                assert r.exit_code != 0 and b"No such file" in r.stderr
            finally:
                await sb.kill()
            # a judge's sandbox: the registered image plus the hidden-tests layer
            jb = await ac.sandboxes.create(spec=judge.judge_spec)
            try:
                r = await jb.exec("ls /opt/dsec-hidden; wc -l < /workspace/data.txt")
                assert r.stdout.split() == [b"test.sh", b"100"]
            finally:
                await jb.kill()
            assert [s.id for s in await ac.sandboxes.list(state="running")] == []
        finally:
            await ac.close()


def test_proposals_are_checked() -> None:
    ex = _example()

    def reply(answer: str) -> Message:
        return Message(role="assistant", tool_calls=(ToolCall(
            id="c", name="submit", arguments=json.dumps({"answer": answer})),))
    assert [p.id for p in parse_proposals(reply(json.dumps(ex.PROPOSALS)))] == [
        "sum-numbers", "count-words"]
    bad = [dict(ex.PROPOSALS[0], id="../etc")]
    with pytest.raises(InvalidArgument, match="id"):
        parse_proposals(reply(json.dumps(bad)))
    bad = [dict(ex.PROPOSALS[0], tests={"/abs": "x"})]
    with pytest.raises(InvalidArgument, match="relative"):
        parse_proposals(reply(json.dumps(bad)))
    with pytest.raises(InvalidArgument, match="not a tool call"):
        parse_proposals(Message(role="assistant", content="here are tasks"))


async def test_llm_agent_example(cluster: LocalCluster, endpoint: ScriptedEndpoint,
                                 tmp_path: pathlib.Path) -> None:
    """examples/rl_llm_agent.py (the docs/rl.md example): judged GRPO group, export."""
    spec = importlib.util.spec_from_file_location("rl_llm_agent",
                                                  ROOT / "examples/rl_llm_agent.py")
    assert spec is not None and spec.loader is not None
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    ac = cluster.async_client()
    try:
        out = tmp_path / "t.jsonl"
        summary = await ex.run(ac, endpoint.base_url, group_size=3, out=str(out))
        assert summary["rewards"] == [1.0, 1.0, 1.0] and summary["infra_errors"] == []
        assert summary["pass_rate"] == {"max-number": 1.0} and summary["logprobs"]
        trajs = list(read_jsonl(out))
        assert len(trajs) == 3 and len({t.group_id for t in trajs}) == 1
        assert trajs[0].messages[0].role == "system"
        assert trajs[0].verdict is not None and trajs[0].verdict.passed
    finally:
        await ac.close()
