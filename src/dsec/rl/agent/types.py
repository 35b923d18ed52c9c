"""The records of an LLM-agent episode: chat messages, tool calls, steps, trajectories.

One vocabulary for every stream that touches an agent episode: the policy client writes
:class:`Message` s (with token ids and logprobs when the endpoint returns them), the rollout
engine appends a :class:`Step` per tool call, the rollout worker streams finished
:class:`Trajectory` s to the trainer, and the export writes them as JSON lines. They are
msgspec structs, so the same type travels as JSON (export, REST) or msgpack (Aether)
without a second schema; :func:`trajectory_to_json` / :func:`trajectory_from_json` round-
trip exactly (tested).

Message and tool-call shapes follow OpenAI's chat-completions format (``role``,
``content``, ``tool_calls[].function.{name, arguments}``, ``tool_call_id``) so a trajectory's
messages can be fed back to any OpenAI-compatible endpoint or trainer (TRL, verl, OpenRLHF,
SkyRL) with :meth:`Message.to_openai`. ``arguments`` stays the model's raw JSON string: a
trainer that re-tokenizes the history must see exactly what the model produced.

Times are seconds (``*_s``); wall-clock stamps are Unix seconds (``*_at``).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = [
    "LOGPROB_FLOOR",
    "EpisodeEnd",
    "Message",
    "ModelInfo",
    "Role",
    "Step",
    "StepTimings",
    "ToolCall",
    "Trajectory",
    "TrajectoryTimings",
    "VerdictRecord",
    "trajectory_from_json",
    "trajectory_to_json",
]

# JSON cannot carry -inf (msgspec writes null, which does not decode back as a float): a
# logprob below this is stored as this (e^-9999 is 0 in float64 anyway).
LOGPROB_FLOOR = -9999.0

Role = Literal["system", "user", "assistant", "tool"]

# Why an episode ended. "submitted": the agent called submit; "max_turns": the turn budget
# ran out; "episode_timeout"/"step_timeout": a deadline of the engine fired; "infra_error":
# the platform (sandbox, endpoint) failed, not the agent, so a trainer masks it; "cancelled":
# the engine was stopped before the episode finished.
EpisodeEnd = Literal["submitted", "max_turns", "episode_timeout", "step_timeout",
                     "infra_error", "cancelled"]


class ToolCall(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One call the model asked for. ``arguments`` is the raw JSON text the model wrote."""

    id: str
    name: str
    arguments: str = "{}"

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class Message(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One chat message. ``token_ids``/``logprobs`` are the sampled completion's tokens and
    their log-probabilities (assistant messages, when the endpoint returned them);
    ``prompt_token_ids`` the prompt's, when the endpoint returned those too. JSON has no
    infinity: the policy client floors a ``-inf`` logprob at ``LOGPROB_FLOOR``."""

    role: Role
    content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None             # role "tool": the call this answers
    name: str | None = None                     # role "tool": the tool's name
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    prompt_token_ids: list[int] | None = None
    finish_reason: str | None = None            # the endpoint's, for assistant messages

    def to_openai(self) -> dict[str, Any]:
        """The message as an OpenAI chat-completions request item (no token fields)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [tc.to_openai() for tc in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return out


class StepTimings(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Where one step's time went. ``model_s``: the policy's request (think time);
    ``queue_s``: from the endpoint's reply to the command's start (parse, admission to the
    concurrency limit, the sandbox call's dispatch); ``tool_s``: the tool call itself."""

    model_s: float = 0.0
    queue_s: float = 0.0
    tool_s: float = 0.0
    started_at: float = 0.0


class Step(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One agent turn: what the model asked for and what came back.

    ``action`` is the parsed tool call, or None when the model's output was not a valid
    tool call; then ``error`` says why and ``observation`` is the error text fed back to
    the model (strict mode: such text is never run as a command). ``infra_error`` is set
    when the platform failed (sandbox gone, endpoint unreachable), which is not the agent's
    fault and ends the episode."""

    index: int
    action: ToolCall | None = None
    observation: str = ""
    reward: float = 0.0
    exit_code: int | None = None
    error: str | None = None
    infra_error: str | None = None
    timings: StepTimings = msgspec.field(default_factory=StepTimings)


class VerdictRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A judge's verdict as exported (:class:`dsec.rl.judges.Verdict` as a record)."""

    reward: float
    passed: bool
    detail: str = ""
    judge: str | None = None                    # the judge's class name


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Which policy produced the trajectory and how it was sampled."""

    model: str
    base_url: str | None = None
    sampling: dict[str, Any] = {}               # temperature, top_p, max_tokens, seed...


class TrajectoryTimings(msgspec.Struct, kw_only=True, omit_defaults=True):
    started_at: float = 0.0
    finished_at: float = 0.0
    setup_s: float = 0.0                        # sandbox start (create or from a snapshot)
    model_s: float = 0.0                        # sum over steps
    tool_s: float = 0.0                         # sum over steps
    judge_s: float = 0.0

    @property
    def total_s(self) -> float:
        return max(0.0, self.finished_at - self.started_at)


class Trajectory(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One finished (or failed) episode: the full chat history and the steps it took.

    ``reward`` is the judge's reward (0.0 without a verdict). ``infra_error`` set means the
    reward says nothing about the policy: mask it out of the loss. ``group_id`` ties the n
    rollouts of one task in a GRPO group; ``epoch`` is the task pass it came from."""

    episode_id: str
    task_id: str
    group_id: str | None = None
    epoch: int | None = None
    messages: list[Message] = []
    steps: list[Step] = []
    reward: float = 0.0
    verdict: VerdictRecord | None = None
    infra_error: str | None = None
    end: EpisodeEnd | None = None
    answer: str | None = None                   # what the agent submitted
    sandbox_id: str | None = None               # the episode's sandbox (gone unless kept)
    timings: TrajectoryTimings = msgspec.field(default_factory=TrajectoryTimings)
    model: ModelInfo | None = None
    metadata: dict[str, Any] = {}

    @property
    def num_steps(self) -> int:
        return len(self.steps)


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Trajectory)


def trajectory_to_json(traj: Trajectory) -> bytes:
    """One trajectory as compact JSON (one line: no newline inside)."""
    return _encoder.encode(traj)


def trajectory_from_json(data: bytes | str) -> Trajectory:
    """The inverse of :func:`trajectory_to_json`; a malformed record raises
    ``msgspec.ValidationError``/``DecodeError`` naming the bad field."""
    return _decoder.decode(data)
