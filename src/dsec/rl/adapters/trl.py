"""A TRL reward function (``GRPOTrainer(reward_funcs=[...])``) built on dsec judges.

TRL calls a reward function as ``f(prompts=..., completions=..., completion_ids=...,
**dataset_columns)`` and takes a list with one float per completion (``None`` where the
function has no opinion: TRL ignores it in the sum). :class:`JudgeReward` looks each
completion's task up by a dataset column (``task_id``), and judges the completion text as
the task's answer: sandbox-free judges (regex, reference, rubric) directly; an
:class:`~dsec.rl.judges.ExecutableJudge` in a fresh sandbox from the task's spec holding
the task's files and the answer written to ``answer_path``. A judge that fails on the
platform's side (sandbox creation, a lost node) gives ``None`` for that completion, never
a 0 that would train the policy against an infrastructure fault.
"""

from __future__ import annotations

import concurrent.futures
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

from dsec.errors import DsecError, InvalidArgument, NotFound
from dsec.rl.access import SandboxAccess
from dsec.rl.judges import JudgeContext
from dsec.rl.tasks import AgentTask, TaskRegistry
from dsec.wire.spec import ExecRequest

__all__ = ["JudgeReward", "completion_text"]


def completion_text(completion: Any) -> str:
    """The text of a TRL completion: a string (standard format) or a list of messages
    (conversational format: the assistant messages' content, joined)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence):
        parts = [str(m.get("content") or "") for m in completion
                 if isinstance(m, Mapping) and m.get("role", "assistant") == "assistant"]
        return "\n".join(parts)
    raise InvalidArgument(f"a completion is a string or a list of messages, not "
                          f"{type(completion).__name__}")


class JudgeReward:
    """``reward_funcs=[JudgeReward(registry, access=ClientAccess(client))]``.

    ``tasks``: a :class:`~dsec.rl.tasks.TaskRegistry` or a mapping id -> task;
    ``task_column``: the dataset column holding the task id; ``answer_path``: where an
    executable judge finds the answer (a task's ``metadata["answer_path"]`` wins), relative
    paths under the task's work dir; ``access``: sandboxes for executable judges;
    ``max_workers``: completions judged at once."""

    def __init__(self, tasks: TaskRegistry | Mapping[str, AgentTask], *,
                 access: SandboxAccess | None = None, task_column: str = "task_id",
                 answer_path: str = "answer", name: str = "dsec_judge",
                 max_workers: int = 8) -> None:
        self.tasks = tasks
        self.access = access
        self.task_column = task_column
        self.answer_path = answer_path
        self.__name__ = name                   # TRL logs rewards under the function's name
        self.max_workers = max_workers

    def _task(self, tid: str) -> AgentTask:
        if isinstance(self.tasks, TaskRegistry):
            return self.tasks.get(tid)
        try:
            return self.tasks[tid]
        except KeyError:
            raise NotFound(f"no task {tid!r} for the reward function") from None

    def __call__(self, prompts: Sequence[Any] | None = None,
                 completions: Sequence[Any] = (), completion_ids: Sequence[Any] | None = None,
                 **kwargs: Any) -> list[float | None]:
        ids = kwargs.get(self.task_column)
        if ids is None or len(ids) != len(completions):
            raise InvalidArgument(f"the dataset needs a {self.task_column!r} column (one task "
                                  f"id per completion; got {None if ids is None else len(ids)}"
                                  f" for {len(completions)} completions)")
        jobs = [(self._task(str(tid)), completion_text(c)) for tid, c in zip(ids, completions,
                                                                             strict=True)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.max_workers) as pool:
            return list(pool.map(lambda job: self._score(*job), jobs))

    def _score(self, task: AgentTask, answer: str) -> float | None:
        judge = task.judge
        if judge is None:
            return None
        if type(judge).__name__ != "ExecutableJudge":
            v = judge.judge(JudgeContext(answer=answer, transcript=(), prompt=task.prompt))
            return None if v.infra_error else float(v.reward)
        if self.access is None:
            raise InvalidArgument(f"task {task.id} has an executable judge: JudgeReward needs "
                                  "access= (e.g. ClientAccess(client)) to run it")
        acc = self.access
        path = str(task.metadata.get("answer_path", self.answer_path))
        path = posixpath.join(task.workdir, path)
        try:
            sid = acc.create(task.spec)
        except DsecError:
            return None
        try:
            dirs = sorted({posixpath.dirname(p) for p in [*task.files, path]} | {task.workdir})
            (r,) = acc.exec_batch([(sid, ExecRequest(argv=("mkdir", "-p", *dirs)))])
            if isinstance(r, DsecError) or r.exit_code != 0:
                return None
            for p, data in task.files.items():
                acc.write_file(sid, p, data)
            acc.write_file(sid, path, answer.encode())
            v = judge.judge(JudgeContext(answer=answer, transcript=(), access=acc,
                                         sandbox_id=sid, spec=task.spec, prompt=task.prompt))
            return None if v.infra_error else float(v.reward)
        except DsecError:
            return None
        finally:
            try:
                acc.destroy(sid)
            except DsecError:
                pass
