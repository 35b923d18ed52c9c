"""Tasks for LLM agents: what to solve, where, and how it is judged; epochs and pass rates.

- :class:`AgentTask`: a prompt, the sandbox it starts in (an image, or a snapshot an
  environment builder made: :attr:`AgentTask.spec`), files to put there, the judge.
- :class:`TaskSampler`: epochs **without replacement**: every task once per epoch, in a
  seeded order, before any task comes again.
- :class:`TaskRegistry`: the tasks by id, with what happened to them: attempts, passes,
  infrastructure errors (not counted as attempts: the policy was not judged) and mean
  reward, for difficulty filtering (``registry.select(min_pass_rate=0.1,
  max_pass_rate=0.9)`` keeps what is neither solved nor hopeless). Pure: no I/O; save it
  with ``to_json``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from dsec.errors import Conflict, InvalidArgument, NotFound
from dsec.rl.agent.types import Trajectory
from dsec.rl.judges import Judge
from dsec.wire.spec import SandboxSpec

__all__ = ["AgentTask", "TaskRegistry", "TaskSampler", "TaskStats"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentTask:
    """One task. ``spec`` says where an episode starts (``spec.snapshot`` for a snapshot an
    environment builder registered); ``files`` (absolute path -> bytes) are written into
    each episode's sandbox before the first turn; ``judge`` scores the result (None: every
    episode earns 0, e.g. for data collection)."""

    id: str
    prompt: str
    judge: Judge | None = None
    spec: SandboxSpec = field(default_factory=SandboxSpec)
    files: Mapping[str, bytes] = field(default_factory=dict)
    max_turns: int = 16
    workdir: str = "/workspace"
    system_prompt: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.id or len(self.id) > 256:
            raise InvalidArgument(f"task id {self.id[:80]!r} must be 1..256 characters")
        if self.max_turns < 1:
            raise InvalidArgument(f"task {self.id}: max_turns={self.max_turns} must be >= 1")
        bad = [p for p in self.files if not p.startswith("/")]
        if bad:
            raise InvalidArgument(f"task {self.id}: file paths {bad} must be absolute")
        if not self.workdir.startswith("/"):
            raise InvalidArgument(f"task {self.id}: workdir {self.workdir!r} must be absolute")


class TaskSampler:
    """Epochs without replacement over ``tasks``: :meth:`take` hands out tasks in a seeded
    permutation; a new epoch (a new permutation) starts only when the current one is
    used up. ``rng``: a seeded ``random.Random`` (default: seeded with ``seed``)."""

    def __init__(self, tasks: Sequence[AgentTask], *, seed: int = 0,
                 rng: random.Random | None = None) -> None:
        if not tasks:
            raise InvalidArgument("TaskSampler needs at least one task")
        ids = [t.id for t in tasks]
        if len(set(ids)) != len(ids):
            raise InvalidArgument(f"task ids must be unique; repeated: "
                                  f"{sorted({i for i in ids if ids.count(i) > 1})}")
        self.tasks = list(tasks)
        self.rng = rng if rng is not None else random.Random(seed)
        self.epoch = -1
        self._order: list[int] = []

    def __iter__(self) -> Iterator[tuple[AgentTask, int]]:
        while True:
            yield self.next()

    def next(self) -> tuple[AgentTask, int]:
        """The next ``(task, epoch)``."""
        if not self._order:
            self.epoch += 1
            self._order = list(range(len(self.tasks)))
            self.rng.shuffle(self._order)
            self._order.reverse()                   # pop() from the end: permutation order
        return self.tasks[self._order.pop()], self.epoch

    def take(self, k: int) -> list[tuple[AgentTask, int]]:
        if k < 0:
            raise InvalidArgument(f"take(k={k}): k must be >= 0")
        return [self.next() for _ in range(k)]

    def epoch_tasks(self) -> list[tuple[AgentTask, int]]:
        """The rest of the current epoch (a whole new one if the current is used up)."""
        if not self._order:
            first = self.next()
            return [first, *self.take(len(self._order))]
        return self.take(len(self._order))


class TaskStats(msgspec.Struct, kw_only=True):
    attempts: int = 0              # judged episodes (infrastructure failures excluded)
    passes: int = 0
    infra_errors: int = 0
    reward_sum: float = 0.0

    @property
    def pass_rate(self) -> float | None:
        """Passes over attempts; None before the first attempt."""
        return self.passes / self.attempts if self.attempts else None

    @property
    def mean_reward(self) -> float | None:
        return self.reward_sum / self.attempts if self.attempts else None


class _Saved(msgspec.Struct):
    stats: dict[str, TaskStats]


class TaskRegistry:
    """Tasks by id and their record (see the module docstring)."""

    def __init__(self, tasks: Iterable[AgentTask] = ()) -> None:
        self._tasks: dict[str, AgentTask] = {}
        self._stats: dict[str, TaskStats] = {}
        for t in tasks:
            self.add(t)

    def add(self, task: AgentTask, *, replace: bool = False) -> AgentTask:
        """Register ``task``; an id already taken is refused unless ``replace`` (e.g. the
        flywheel re-registering a task with the image its builder made). Its record
        stays."""
        if task.id in self._tasks and not replace:
            raise Conflict(f"task {task.id!r} is already registered; pass replace=True to "
                           "replace it")
        self._tasks[task.id] = task
        self._stats.setdefault(task.id, TaskStats())
        return task

    def get(self, task_id: str) -> AgentTask:
        try:
            return self._tasks[task_id]
        except KeyError:
            raise NotFound(f"no task {task_id!r} in the registry ({len(self._tasks)} "
                           "tasks)") from None

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._tasks

    def __len__(self) -> int:
        return len(self._tasks)

    def tasks(self) -> list[AgentTask]:
        return list(self._tasks.values())

    def record(self, traj: Trajectory) -> None:
        """Count a finished episode of a registered task."""
        st = self._stats.get(traj.task_id)
        if st is None:
            raise NotFound(f"trajectory {traj.episode_id} is of task {traj.task_id!r}, "
                           "which is not registered")
        if traj.infra_error is not None:
            st.infra_errors += 1
            return
        st.attempts += 1
        st.reward_sum += traj.reward
        if traj.verdict is not None and traj.verdict.passed:
            st.passes += 1

    def stats(self, task_id: str) -> TaskStats:
        self.get(task_id)
        return self._stats[task_id]

    def select(self, *, min_pass_rate: float = 0.0, max_pass_rate: float = 1.0,
               min_attempts: int = 1, keep_unattempted: bool = True) -> list[AgentTask]:
        """Tasks whose pass rate is within ``[min, max]`` once they have ``min_attempts``
        (those with fewer are kept when ``keep_unattempted``: not enough is known)."""
        if not 0.0 <= min_pass_rate <= max_pass_rate <= 1.0:
            raise InvalidArgument(f"need 0 <= min_pass_rate ({min_pass_rate}) <= "
                                  f"max_pass_rate ({max_pass_rate}) <= 1")
        out = []
        for tid, task in self._tasks.items():
            st = self._stats[tid]
            if st.attempts < min_attempts:
                if keep_unattempted:
                    out.append(task)
                continue
            rate = st.passes / st.attempts
            if min_pass_rate <= rate <= max_pass_rate:
                out.append(task)
        return out

    def to_json(self) -> bytes:
        return msgspec.json.encode(_Saved(stats=self._stats))

    def load_stats(self, data: bytes) -> None:
        """Restore records saved with :meth:`to_json` (for tasks registered here)."""
        saved = msgspec.json.decode(data, type=_Saved)
        for tid, st in saved.stats.items():
            if tid in self._tasks:
                self._stats[tid] = st
