"""A verl agent loop running dsec episodes, and trajectories in verl's output format.

verl (``verl.experimental.agent_loop``) runs one ``AgentLoopBase.run(sampling_params,
**kwargs)`` coroutine per sample and takes an ``AgentLoopOutput``: ``prompt_ids``,
``response_ids`` (the model's tokens and the tool results' tokens, interleaved),
``response_mask`` (1 for model tokens, which are trained on; 0 for tool/user tokens),
``response_logprobs``, ``reward_score``, ``num_turns``, ``metrics`` and ``extra_fields``.
:func:`trajectory_to_verl` builds exactly that from a :class:`Trajectory` (the model's
own token ids and logprobs where the endpoint returned them, else the tokenizer's);
:class:`DsecAgentLoop` is the loop class to register: it runs the sample's task through a
:class:`~dsec.rl.engine.RolloutEngine` against verl's OpenAI-compatible rollout servers,
judged by dsec. Without verl installed it is a plain class with the same ``run``, which
returns the output as a dict (what the tests check).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from dsec.errors import InvalidArgument
from dsec.rl.agent.types import Trajectory
from dsec.rl.engine import RolloutEngine
from dsec.rl.tasks import AgentTask, TaskRegistry

__all__ = ["VERL_OUTPUT_FIELDS", "DsecAgentLoop", "trajectory_to_verl"]

# The fields of verl's AgentLoopOutput this adapter fills (verl >= 0.5).
VERL_OUTPUT_FIELDS = ("prompt_ids", "response_ids", "response_mask", "response_logprobs",
                      "reward_score", "num_turns", "metrics", "extra_fields")

Tokenize = Callable[[str], list[int]]


def trajectory_to_verl(traj: Trajectory, tokenize: Tokenize) -> dict[str, Any]:
    """``traj`` as the keyword arguments of verl's ``AgentLoopOutput``. The prompt is the
    messages before the first assistant reply; ``tokenize`` spells text the endpoint gave
    no ids for (the prompt without ``prompt_token_ids``, tool results, a reply without
    ``token_ids``). ``response_logprobs`` is None unless every reply carried logprobs."""
    msgs = traj.messages
    first = next((i for i, m in enumerate(msgs) if m.role == "assistant"), len(msgs))
    if first < len(msgs) and msgs[first].prompt_token_ids:
        prompt_ids = list(msgs[first].prompt_token_ids or [])
    else:
        prompt_ids = tokenize("".join(m.content or "" for m in msgs[:first]))
    ids: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    all_lp = True
    for m in msgs[first:]:
        if m.role == "assistant":
            if m.token_ids is not None:
                toks = list(m.token_ids)
            else:
                toks = tokenize((m.content or "") + "".join(
                    json.dumps(tc.to_openai()) for tc in m.tool_calls))
            if m.logprobs is not None and len(m.logprobs) == len(toks):
                lps += m.logprobs
            else:
                all_lp = False
                lps += [0.0] * len(toks)
            ids += toks
            mask += [1] * len(toks)
        else:
            toks = tokenize(m.content or "")
            ids += toks
            mask += [0] * len(toks)
            lps += [0.0] * len(toks)
    return {
        "prompt_ids": prompt_ids, "response_ids": ids, "response_mask": mask,
        "response_logprobs": lps if all_lp else None,
        "reward_score": traj.reward, "num_turns": len(msgs),
        "metrics": {"generate_sequences": traj.timings.model_s,
                    "tool_calls": traj.timings.tool_s},
        "extra_fields": {"episode_id": traj.episode_id, "task_id": traj.task_id,
                         "infra_error": traj.infra_error, "end": traj.end,
                         "verdict": None if traj.verdict is None else traj.verdict.detail},
    }


try:  # pragma: no cover - verl is optional and heavy (torch, ray)
    from verl.experimental.agent_loop.agent_loop import (
        AgentLoopBase as _Base,
    )
    from verl.experimental.agent_loop.agent_loop import (
        AgentLoopOutput as _Output,
    )
    from verl.experimental.agent_loop.agent_loop import (
        register as _register,
    )
except ImportError:
    _Base, _Output, _register = object, None, None


class DsecAgentLoop(_Base):  # type: ignore[misc]
    """verl agent loop (``agent_name: dsec_agent``): each sample is one dsec episode.

    Set it up once per worker process with :meth:`configure`: the engine factory (called
    in the loop's event loop, so the policy client and the SDK client live there) and the
    task registry. A sample names its task by ``extra_info["task_id"]`` (or a ``task_id``
    column)."""

    engine_factory: ClassVar[Callable[[], RolloutEngine] | None] = None
    tasks: ClassVar[TaskRegistry | Mapping[str, AgentTask] | None] = None
    _engine: ClassVar[RolloutEngine | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if _Base is not object:
            super().__init__(*args, **kwargs)
        self.tokenizer = kwargs.get("tokenizer", getattr(self, "tokenizer", None))

    @classmethod
    def configure(cls, engine_factory: Callable[[], RolloutEngine],
                  tasks: TaskRegistry | Mapping[str, AgentTask]) -> None:
        cls.engine_factory, cls.tasks, cls._engine = engine_factory, tasks, None

    def _tokenize(self, text: str) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            raise InvalidArgument("DsecAgentLoop needs verl's tokenizer (tokenizer=...) to "
                                  "spell text the endpoint returned no token ids for")
        return list(tok.encode(text, add_special_tokens=False))

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        cls = type(self)
        if cls.engine_factory is None or cls.tasks is None:
            raise InvalidArgument("call DsecAgentLoop.configure(engine_factory, tasks) in the "
                                  "worker before verl runs the loop")
        extra = kwargs.get("extra_info") or {}
        tid = extra.get("task_id", kwargs.get("task_id"))
        if tid is None:
            raise InvalidArgument("the sample has no task id (extra_info['task_id'] or a "
                                  "task_id column)")
        tasks = cls.tasks
        task = tasks.get(str(tid)) if isinstance(tasks, TaskRegistry) else tasks[str(tid)]
        if cls._engine is None:
            cls._engine = cls.engine_factory()
        traj = await cls._engine.episode(task)
        out = trajectory_to_verl(traj, self._tokenize)
        if _Output is not None:  # pragma: no cover - with verl installed
            return _Output(**out)
        return out


if _register is not None:  # pragma: no cover - registers the class under verl's name
    _register("dsec_agent")(DsecAgentLoop)
