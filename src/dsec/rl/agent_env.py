"""A Gymnasium environment for LLM agents: the action is the model's reply text, the
observation what its tool calls returned.

:class:`AgentEnv` is the synchronous door to the same episode logic as the rollout
engine (tool parsing in strict mode, tools in a dsec sandbox, the task's judge), for
Gymnasium-style trainers that drive one env step by step with their own model. The
action is the assistant message as text: Hermes ``<tool_call>{...}</tool_call>`` blocks
(or a bare JSON tool call, ``{"name": "bash", "arguments": {...}}``); prose is an
observation error in strict mode, never a command. The task comes from
``reset(options={"task": task_or_id})``, or else from a :class:`~dsec.rl.tasks.TaskSampler`
over the given tasks (epochs without replacement, seeded by ``reset(seed=...)``). On the
last step ``info`` carries the ``verdict``, ``infra_error`` and the whole ``trajectory``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import gymnasium as gym

from dsec.errors import Conflict, InvalidArgument
from dsec.rl.access import LoopThread
from dsec.rl.agent.executor import ToolConfig
from dsec.rl.agent.sandboxes import ClientSandboxes
from dsec.rl.agent.types import Message, ModelInfo, Trajectory
from dsec.rl.engine import EngineConfig, InfraFailure, RolloutEngine
from dsec.rl.sandbox import CHARSET, UnicodeText
from dsec.rl.tasks import AgentTask, TaskRegistry, TaskSampler

__all__ = ["AgentEnv"]


class _NoPolicy:
    """The env's actions come from the caller, not from a policy client."""

    system_prompt: str | None = None

    async def act(self, messages: Sequence[Message]) -> Message:
        raise Conflict("AgentEnv takes the model's reply as the step's action")

    def info(self) -> ModelInfo:
        return ModelInfo(model="external")


class AgentEnv(gym.Env[str, str]):
    """See the module docstring. ``client``: a sync :class:`~dsec.client.sync.Client`
    (its loop thread runs the sandbox calls); ``tasks``: a registry or a list of tasks
    (episodes are recorded in the registry)."""

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 - gymnasium convention

    def __init__(self, client: Any, tasks: TaskRegistry | Sequence[AgentTask], *,
                 config: EngineConfig | None = None, max_chars: int = 65536) -> None:
        self._registry = tasks if isinstance(tasks, TaskRegistry) else TaskRegistry(tasks)
        if not len(self._registry):
            raise InvalidArgument("AgentEnv needs at least one task")
        self._loop = LoopThread(name="dsec-agent-env")
        self._sandboxes = ClientSandboxes(client)
        self._engine = RolloutEngine(self._sandboxes, _NoPolicy(), config,
                                     registry=self._registry)
        self._sampler = TaskSampler(self._registry.tasks())
        # the sandbox envs' spaces: UTF-8 text within a finite charset (Gymnasium's rule)
        self.observation_space = UnicodeText(max_chars, min_length=0, charset=CHARSET)
        self.action_space = UnicodeText(max_chars, min_length=0, charset=CHARSET)
        self._task: AgentTask | None = None
        self._traj: Trajectory | None = None
        self._tools: ToolConfig | None = None
        self._turns = 0
        self._done = True

    # --------------------------------------------------------------------- episodes
    def _run(self, coro: Any) -> Any:
        return self._loop.run(coro)

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        if seed is not None:
            self._sampler = TaskSampler(self._registry.tasks(), seed=seed)
        unknown = sorted(set(options or {}) - {"task"})
        if unknown:
            raise InvalidArgument(f"AgentEnv.reset takes options={{'task': ...}}, not "
                                  f"{unknown}")
        chosen = (options or {}).get("task")
        if chosen is None:
            task, epoch = self._sampler.next()
        elif isinstance(chosen, AgentTask):
            task, epoch = chosen, None
        elif isinstance(chosen, str):
            task, epoch = self._registry.get(chosen), None
        else:
            raise InvalidArgument(f"options['task'] is an AgentTask or a task id, not "
                                  f"{type(chosen).__name__}")
        self._finish()
        self._task, self._turns, self._done = task, 0, False
        eng = self._engine
        traj = Trajectory(episode_id=f"env-{id(self):x}-{self.np_random.integers(1 << 30)}",
                          task_id=task.id, epoch=epoch, model=_NoPolicy().info())
        traj.timings.started_at = eng.wall()
        if task.system_prompt:
            traj.messages.append(Message(role="system", content=task.system_prompt))
        traj.messages.append(Message(role="user", content=task.prompt))
        self._traj = traj
        self._tools = dataclasses.replace(eng.config.tools, workdir=task.workdir)
        traj.sandbox_id = self._run(eng.start_sandbox(task, task.spec))
        return task.prompt, {"task_id": task.id, "sandbox_id": traj.sandbox_id,
                             "epoch": epoch}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._done or self._traj is None or self._task is None or self._tools is None:
            raise Conflict("AgentEnv.step after the episode ended: call reset() first")
        traj, task = self._traj, self._task
        assert traj.sandbox_id is not None
        reply = _reply_of(action)
        first = len(traj.steps)
        self._turns += 1
        info: dict[str, Any] = {}
        try:
            submitted = self._run(self._engine.apply_reply(traj.sandbox_id, self._tools,
                                                           traj, reply))
        except InfraFailure as exc:
            traj.infra_error, traj.end = str(exc), "infra_error"
            return self._end(self._obs(first), 0.0, terminated=True, info=info)
        obs = self._obs(first)
        if submitted or self._turns >= task.max_turns:
            if not submitted:
                traj.end = "max_turns"
            try:
                self._run(self._engine.judge_episode(task, traj.sandbox_id, traj))
            except InfraFailure as exc:
                traj.infra_error, traj.end, traj.verdict = str(exc), "infra_error", None
            return self._end(obs, traj.reward, terminated=submitted, info=info)
        return obs, 0.0, False, False, {"steps": [s.index for s in traj.steps[first:]]}

    def _obs(self, first: int) -> str:
        assert self._traj is not None
        return "\n".join(s.observation for s in self._traj.steps[first:])

    def _end(self, obs: str, reward: float, *, terminated: bool,
             info: dict[str, Any]) -> tuple[str, float, bool, bool, dict[str, Any]]:
        traj = self._traj
        assert traj is not None
        self._finish()
        info.update(verdict=traj.verdict, infra_error=traj.infra_error, trajectory=traj)
        return obs, float(reward), terminated, not terminated, info

    def _finish(self) -> None:
        """Destroy the episode's sandbox and record the trajectory (once)."""
        traj = self._traj
        if traj is not None and not self._done:
            self._done = True
            traj.timings.finished_at = self._engine.wall()
            if traj.sandbox_id is not None:
                self._run(self._engine.destroy_sandbox(traj.sandbox_id))
            if traj.task_id in self._registry and traj.end is not None:
                self._registry.record(traj)

    def close(self) -> None:
        try:
            self._finish()
            self._run(self._engine.close())
        finally:
            self._loop.close()


def _reply_of(action: str) -> Message:
    """The action as an assistant message: text (Hermes blocks); a bare JSON tool call
    ``{"name": ..., "arguments": ...}`` is wrapped into one block."""
    text = action.strip()
    if text.startswith("{") and "<tool_call>" not in text:
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            return Message(role="assistant", content=f"<tool_call>{text}</tool_call>")
    return Message(role="assistant", content=action)
