"""Episode records: exact JSON round trip, OpenAI message shape, clear errors on bad input."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsec.rl.agent.types import (
    Message,
    ModelInfo,
    Step,
    StepTimings,
    ToolCall,
    Trajectory,
    TrajectoryTimings,
    VerdictRecord,
    trajectory_from_json,
    trajectory_to_json,
)


def _sample() -> Trajectory:
    call = ToolCall(id="call_1", name="bash", arguments='{"command": "echo héllo"}')
    return Trajectory(
        episode_id="ep-1", task_id="t-42", group_id="g-7", epoch=3,
        messages=[
            Message(role="system", content="you are an agent"),
            Message(role="user", content="write 42 to /workspace/out"),
            Message(role="assistant", content=None, tool_calls=(call,), token_ids=[1, 2, 3],
                    logprobs=[-0.1, -0.25, -3.5], prompt_token_ids=[9, 8],
                    finish_reason="tool_calls"),
            Message(role="tool", content="héllo\n[exit 0]", tool_call_id="call_1",
                    name="bash"),
        ],
        steps=[Step(index=0, action=call, observation="héllo\n[exit 0]", exit_code=0,
                    timings=StepTimings(model_s=0.05, queue_s=0.0004, tool_s=0.002,
                                        started_at=1.7e9)),
               Step(index=1, observation="not a tool call", error="not_a_tool_call"),
               Step(index=2, infra_error="sandbox sb-1 is gone")],
        reward=1.0, verdict=VerdictRecord(reward=1.0, passed=True, detail="verifier exit 0",
                                          judge="ExecutableJudge"),
        end="submitted", answer="42",
        timings=TrajectoryTimings(started_at=1.7e9, finished_at=1.7e9 + 2.5, setup_s=0.1,
                                  model_s=0.05, tool_s=0.002, judge_s=0.3),
        model=ModelInfo(model="scripted-honest", base_url="http://127.0.0.1:1/v1",
                        sampling={"temperature": 0.7, "max_tokens": 256}),
        metadata={"difficulty": "easy"},
    )


def test_trajectory_json_round_trip_is_exact() -> None:
    traj = _sample()
    data = trajectory_to_json(traj)
    assert b"\n" not in data                      # one JSON line per trajectory
    back = trajectory_from_json(data)
    assert back == traj
    assert back.timings.total_s == pytest.approx(2.5)
    assert trajectory_from_json(data.decode()) == traj


def test_defaults_are_omitted_and_restored() -> None:
    traj = Trajectory(episode_id="e", task_id="t")
    doc = json.loads(trajectory_to_json(traj))
    assert "verdict" not in doc and "infra_error" not in doc
    assert trajectory_from_json(trajectory_to_json(traj)) == traj


def test_message_to_openai_shape() -> None:
    traj = _sample()
    assistant, tool = traj.messages[2].to_openai(), traj.messages[3].to_openai()
    assert assistant == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "bash", "arguments": '{"command": "echo héllo"}'}}]}
    assert "token_ids" not in assistant and "logprobs" not in assistant
    assert tool == {"role": "tool", "content": "héllo\n[exit 0]", "tool_call_id": "call_1",
                    "name": "bash"}


def test_malformed_record_names_the_field() -> None:
    with pytest.raises(msgspec.ValidationError, match="role"):
        trajectory_from_json(b'{"episode_id":"e","task_id":"t",'
                             b'"messages":[{"role":"robot","content":"x"}]}')
    with pytest.raises(msgspec.ValidationError, match="task_id"):
        trajectory_from_json(b'{"episode_id":"e"}')


_text = st.text(max_size=40)


@given(st.lists(st.tuples(_text, _text, st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=5)),
                max_size=6), st.floats(allow_nan=False, allow_infinity=False))
def test_round_trip_property(turns: list[tuple[str, str, list[float]]], reward: float) -> None:
    msgs: list[Message] = []
    steps: list[Step] = []
    for i, (args, obs, lps) in enumerate(turns):
        call = ToolCall(id=f"c{i}", name="bash", arguments=args)
        msgs.append(Message(role="assistant", tool_calls=(call,), logprobs=lps or None,
                            token_ids=list(range(len(lps))) or None))
        msgs.append(Message(role="tool", content=obs, tool_call_id=f"c{i}"))
        steps.append(Step(index=i, action=call, observation=obs))
    traj = Trajectory(episode_id="e", task_id="t", messages=msgs, steps=steps, reward=reward)
    assert trajectory_from_json(trajectory_to_json(traj)) == traj
