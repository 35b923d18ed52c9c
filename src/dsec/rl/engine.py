"""The asyncio rollout engine: LLM-agent episodes that progress independently.

Each episode is its own coroutine: start a sandbox (coalesced with other starts into
batched creates), write the task's files, then turn after turn ask the policy for the
next message, run the tool calls it makes, feed the results back, until the agent
submits or runs out of turns; then the task's judge scores it and the sandbox goes.
No episode waits for another: a ``sleep 3`` in one holds up only that one, where a
lockstep pool (:class:`~dsec.rl.sandbox.SandboxEnvPool`, which stays for Gymnasium users)
waits for the slowest env on every tick.

- **Bounded**: at most ``max_concurrent_episodes`` episodes hold a sandbox at once; the
  policy client bounds its own requests (:class:`~dsec.rl.agent.policy.PolicyConfig`).
- **Deadlines**: ``step_timeout_s`` covers one turn (the model's reply and its tool
  calls); ``episode_timeout_s`` the whole episode. A step deadline means the platform
  hung (a command has its own, shorter timeout whose expiry is an observation), so it
  ends the episode as an infrastructure error; an episode deadline ends it unjudged
  (``end="episode_timeout"``, reward 0).
- **Judging**: judges (synchronous, :mod:`dsec.rl.judges`) run concurrently in a pool of
  ``judge_concurrency`` threads; the sandboxes an isolating judge creates are coalesced
  into batched creates with everyone else's.
- **Infrastructure errors** (a sandbox operation failed, the endpoint is down, a judge
  crashed) end the episode with ``infra_error`` set and reward 0; trainers mask them
  (they say nothing about the policy). An agent's own mistakes (a failing command, a
  malformed tool call) are observations.
- **Groups**: :meth:`RolloutEngine.group` runs n rollouts of one task (GRPO), every one
  from the same start: the task's snapshot, or with ``snapshot_files=True`` a snapshot
  the engine makes once of a sandbox holding the task's files.

``run`` / ``stream`` take tasks from a :class:`~dsec.rl.tasks.TaskSampler` (epochs without
replacement) and record results in a :class:`~dsec.rl.tasks.TaskRegistry`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from dsec.errors import DsecError, InvalidArgument
from dsec.rl.agent.executor import ToolConfig, run_action
from dsec.rl.agent.policy import Policy
from dsec.rl.agent.sandboxes import ClientSandboxes
from dsec.rl.agent.tools import ToolCallError, decode_action, parse_reply
from dsec.rl.agent.types import (
    Message,
    Step,
    StepTimings,
    ToolCall,
    Trajectory,
    TrajectoryTimings,
    VerdictRecord,
)
from dsec.rl.judges import JudgeContext
from dsec.rl.tasks import AgentTask, TaskRegistry, TaskSampler
from dsec.wire.spec import ExecRequest, SandboxSpec

__all__ = ["EngineConfig", "InfraFailure", "RolloutEngine"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """How episodes run. Times in seconds; None means no deadline."""

    max_concurrent_episodes: int = 256
    step_timeout_s: float | None = 600.0     # one turn: model reply + its tool calls
    episode_timeout_s: float | None = 3600.0
    judge_concurrency: int = 16              # judge threads
    strict: bool = True                      # prose is an observation error, never a command
    tools: ToolConfig = field(default_factory=ToolConfig)
    keep_sandboxes: bool = False             # leave episode sandboxes running (debugging)

    def __post_init__(self) -> None:
        if self.max_concurrent_episodes < 1:
            raise InvalidArgument(f"max_concurrent_episodes={self.max_concurrent_episodes} "
                                  "must be >= 1")
        if self.judge_concurrency < 1:
            raise InvalidArgument(f"judge_concurrency={self.judge_concurrency} must be >= 1")
        for name in ("step_timeout_s", "episode_timeout_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise InvalidArgument(f"{name}={v} must be > 0, or None for no deadline")


class InfraFailure(Exception):
    """Raised inside an episode to end it as an infrastructure failure (recorded in the
    trajectory's ``infra_error``; never escapes :meth:`RolloutEngine.episode`)."""


class RolloutEngine:
    """Runs agent episodes of :class:`~dsec.rl.tasks.AgentTask` s with ``policy`` in
    sandboxes reached through ``sandboxes``. Use it inside one event loop (the one the
    policy and an :class:`~dsec.client.core.AsyncClient` live on); ``await engine.close()``
    at the end. ``clock`` (monotonic seconds) and ``wall`` (Unix seconds) are injectable."""

    def __init__(self, sandboxes: ClientSandboxes, policy: Policy,
                 config: EngineConfig | None = None, *, registry: TaskRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.sandboxes = sandboxes
        self.policy = policy
        self.config = config or EngineConfig()
        self.registry = registry
        self.clock = clock
        self.wall = wall
        self._slots = asyncio.Semaphore(self.config.max_concurrent_episodes)
        self._judges = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.config.judge_concurrency, thread_name_prefix="dsec-judge")
        self.live_episodes = 0

    async def close(self) -> None:
        self._judges.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------------- episodes
    async def episode(self, task: AgentTask, *, group_id: str | None = None,
                      epoch: int | None = None, spec: SandboxSpec | None = None) -> Trajectory:
        """One episode of ``task`` (``spec`` overrides where it starts)."""
        async with self._slots:
            self.live_episodes += 1
            try:
                traj = await self._episode(task, group_id, epoch, spec or task.spec)
            finally:
                self.live_episodes -= 1
        if self.registry is not None and task.id in self.registry:
            self.registry.record(traj)
        return traj

    async def _episode(self, task: AgentTask, group_id: str | None, epoch: int | None,
                       spec: SandboxSpec) -> Trajectory:
        cfg = self.config
        tools = dataclasses.replace(cfg.tools, workdir=task.workdir)
        traj = Trajectory(episode_id="ep-" + uuid.uuid4().hex[:16], task_id=task.id,
                          group_id=group_id, epoch=epoch, model=self.policy.info(),
                          timings=TrajectoryTimings(started_at=self.wall()))
        system = task.system_prompt or self.policy.system_prompt
        if task.system_prompt and self.policy.system_prompt and \
                self.policy.system_prompt != task.system_prompt:
            system = task.system_prompt + "\n\n" + self.policy.system_prompt
        if system:
            traj.messages.append(Message(role="system", content=system))
        traj.messages.append(Message(role="user", content=task.prompt))
        sid: str | None = None
        t0 = self.clock()
        try:
            async with asyncio.timeout(cfg.episode_timeout_s):
                try:
                    sid = traj.sandbox_id = await self.start_sandbox(task, spec)
                except DsecError as exc:
                    raise InfraFailure(f"sandbox start failed: {exc}") from exc
                finally:
                    traj.timings.setup_s = self.clock() - t0
                await self._turns(task, sid, tools, traj)
                await self.judge_episode(task, sid, traj)
        except InfraFailure as exc:
            traj.infra_error = str(exc)
            traj.end = "step_timeout" if traj.end == "step_timeout" else "infra_error"
            traj.reward, traj.verdict = 0.0, None
        except TimeoutError:
            traj.end, traj.reward, traj.verdict = "episode_timeout", 0.0, None
        except asyncio.CancelledError:
            traj.end = "cancelled"
            raise
        finally:
            if sid is not None and not cfg.keep_sandboxes:
                await asyncio.shield(self.destroy_sandbox(sid))
            traj.timings.finished_at = self.wall()
        return traj

    async def destroy_sandbox(self, sid: str) -> None:
        try:
            await self.sandboxes.destroy(sid)
        except DsecError:
            pass          # the sandbox's TTL and the session lease sweep it

    async def start_sandbox(self, task: AgentTask, spec: SandboxSpec) -> str:
        sid = await self.sandboxes.create(spec)
        try:
            dirs = sorted({task.workdir} | {p.rsplit("/", 1)[0] or "/" for p in task.files})
            res = await self.sandboxes.exec(sid, ExecRequest(argv=("mkdir", "-p", *dirs),
                                                             timeout_s=30.0))
            if res.exit_code != 0:
                raise InfraFailure(f"could not make {dirs} in sandbox {sid}: "
                                  f"{res.stderr.decode(errors='replace')[:200]}")
            await asyncio.gather(*(self.sandboxes.write_file(sid, p, data)
                                   for p, data in task.files.items()))
        except BaseException:
            await asyncio.shield(self.destroy_sandbox(sid))
            raise
        return sid

    async def _turns(self, task: AgentTask, sid: str, tools: ToolConfig,
                     traj: Trajectory) -> None:
        cfg = self.config
        for _turn in range(task.max_turns):
            try:
                async with asyncio.timeout(cfg.step_timeout_s):
                    if await self._turn(sid, tools, traj):
                        return
            except TimeoutError as exc:  # this turn's deadline; the episode's passes through
                traj.end = "step_timeout"
                raise InfraFailure(f"step {len(traj.steps)} took longer than "
                                  f"step_timeout_s={cfg.step_timeout_s}s") from exc
        traj.end = "max_turns"

    async def _turn(self, sid: str, tools: ToolConfig, traj: Trajectory) -> bool:
        """One model reply and its tool calls; True when the agent submitted."""
        t_ask = self.clock()
        try:
            reply = await self.policy.act(traj.messages)
        except DsecError as exc:
            raise InfraFailure(f"policy request failed: {exc}") from exc
        return await self.apply_reply(sid, tools, traj, reply, model_s=self.clock() - t_ask)

    async def apply_reply(self, sid: str, tools: ToolConfig, traj: Trajectory, reply: Message,
                          *, model_s: float = 0.0) -> bool:
        """Append the assistant ``reply`` to ``traj`` and carry out its tool calls in
        sandbox ``sid`` (observation errors for what is not a valid call); True when the
        agent submitted. Raises ``InfraFailure`` when a sandbox operation fails."""
        t_reply = self.clock()
        traj.timings.model_s += model_s
        traj.messages.append(reply)
        calls = parse_reply(reply.content, reply.tool_calls, strict=self.config.strict)
        for i, item in enumerate(calls):
            timings = StepTimings(model_s=model_s if i == 0 else 0.0, started_at=self.wall())
            step = Step(index=len(traj.steps), timings=timings)
            traj.steps.append(step)
            call: ToolCall | None = item if isinstance(item, ToolCall) else item.call
            step.action = call
            try:
                if isinstance(item, ToolCallError):
                    raise item
                action = decode_action(item)
            except ToolCallError as err:
                step.error, step.observation = err.kind, f"error: {err.message}"
                self._feed_back(traj, call if reply.tool_calls else None, step.observation)
                continue
            t_tool = self.clock()
            try:
                out = await run_action(self.sandboxes, sid, action, tools)
            except DsecError as exc:
                step.infra_error = f"{type(exc).__name__}: {exc}"
                raise InfraFailure(f"tool {item.name} failed: {exc}") from exc
            done = self.clock()
            started = out.started_at if out.started_at is not None else t_tool
            timings.queue_s = max(0.0, started - t_reply)
            timings.tool_s = done - started
            traj.timings.tool_s += timings.tool_s
            step.observation, step.exit_code, step.error = out.observation, out.exit_code, \
                out.error
            if out.submitted:
                traj.answer, traj.end = out.answer or "", "submitted"
                self._feed_back(traj, item if reply.tool_calls else None, "submitted")
                return True
            self._feed_back(traj, item if reply.tool_calls else None, out.observation)
        return False

    @staticmethod
    def _feed_back(traj: Trajectory, call: ToolCall | None, text: str) -> None:
        """The observation as the model sees it next turn: a ``tool`` message answering a
        native call, else (Hermes text, prose) a ``user`` message."""
        if call is not None:
            traj.messages.append(Message(role="tool", content=text, tool_call_id=call.id,
                                         name=call.name))
        else:
            traj.messages.append(Message(role="user", content=text))

    async def judge_episode(self, task: AgentTask, sid: str, traj: Trajectory) -> None:
        if task.judge is None:
            return
        loop = asyncio.get_running_loop()
        ctx = JudgeContext(answer=traj.answer or "",
                           transcript=[s.observation for s in traj.steps],
                           access=self.sandboxes.sync_access(loop), sandbox_id=sid,
                           spec=task.spec, prompt=task.prompt)
        judge = task.judge
        t0 = self.clock()
        try:
            verdict = await loop.run_in_executor(self._judges, judge.judge, ctx)
        except DsecError as exc:
            raise InfraFailure(f"judge {type(judge).__name__} failed: {exc}") from exc
        except Exception as exc:  # a judge's bug must not end the run
            raise InfraFailure(f"judge {type(judge).__name__} raised "
                              f"{type(exc).__name__}: {exc}") from exc
        finally:
            traj.timings.judge_s = self.clock() - t0
        if verdict.infra_error:
            raise InfraFailure(f"judge {type(judge).__name__} could not judge: "
                              f"{verdict.detail}")
        traj.verdict = VerdictRecord(reward=float(verdict.reward), passed=bool(verdict.passed),
                                     detail=verdict.detail, judge=type(judge).__name__)
        traj.reward = float(verdict.reward)
        if traj.steps:
            traj.steps[-1].reward = traj.reward

    # ------------------------------------------------------------------------ groups
    async def group(self, task: AgentTask, n: int, *, epoch: int | None = None,
                    snapshot_files: bool = False) -> list[Trajectory]:
        """``n`` rollouts of ``task`` (a GRPO group), concurrently, each from the same
        start. ``snapshot_files``: first put the task's files into one sandbox and
        snapshot it (pack_diff); every rollout then starts from that snapshot (needs a
        backend with snapshots) instead of writing the files n times."""
        if n < 1:
            raise InvalidArgument(f"group size n={n} must be >= 1")
        gid = "grp-" + uuid.uuid4().hex[:12]
        spec, run_task = task.spec, task
        snap_sid: str | None = None
        if snapshot_files and task.files and task.spec.snapshot is None:
            snap_sid = await self.start_sandbox(task, task.spec)
            try:
                snap = await self.sandboxes.snapshot(snap_sid)
            finally:
                await self.destroy_sandbox(snap_sid)
            spec = msgspec.structs.replace(task.spec, snapshot=snap, workspace=None,
                                           toolkits=())
            run_task = _without_files(task)
        return list(await asyncio.gather(*(self.episode(run_task, group_id=gid, epoch=epoch,
                                                        spec=spec) for _ in range(n))))

    async def stream(self, sampler: TaskSampler, *, groups: int, group_size: int = 1
                     ) -> AsyncIterator[list[Trajectory]]:
        """Take ``groups`` tasks from ``sampler`` and yield each finished group as soon as
        it finishes (groups overlap; episode slots bound the sandboxes)."""
        pending = {asyncio.ensure_future(self.group(task, group_size, epoch=ep))
                   for task, ep in sampler.take(groups)}
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for d in done:
                    yield d.result()
        finally:
            for p in pending:
                p.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    async def run(self, tasks: Sequence[AgentTask], *, epochs: int = 1, group_size: int = 1,
                  seed: int = 0) -> list[Trajectory]:
        """Every task ``epochs`` times (without replacement inside an epoch), ``group_size``
        rollouts each; all trajectories, in completion order."""
        sampler = TaskSampler(tasks, seed=seed)
        out: list[Trajectory] = []
        async for grp in self.stream(sampler, groups=epochs * len(tasks),
                                     group_size=group_size):
            out.extend(grp)
        return out


def _without_files(task: AgentTask) -> AgentTask:
    return dataclasses.replace(task, files={})

