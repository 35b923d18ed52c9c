"""What a trainer sends a rollout worker and what the worker is configured with."""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec

from dsec.wire.spec import Isolation

__all__ = ["TASK_ID_PATTERN", "ExecutableJudgeSpec", "JudgeSpec", "PolicySpec",
           "RegexJudgeSpec", "WorkerConfig", "WorkerTask"]

TASK_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
_TASK_ID = re.compile(TASK_ID_PATTERN)


class RegexJudgeSpec(msgspec.Struct, tag="regex", kw_only=True, forbid_unknown_fields=True,
                     frozen=True):
    """:class:`dsec.rl.judges.RegexJudge` as data."""

    pattern: Annotated[str, msgspec.Meta(max_length=4096)]
    field: str = "answer"
    fullmatch: bool = False


class ExecutableJudgeSpec(msgspec.Struct, tag="executable", kw_only=True,
                          forbid_unknown_fields=True, frozen=True):
    """:class:`dsec.rl.judges.ExecutableJudge` as data: hidden test files (text, relative
    paths) and the verifier argv (``{tests}`` names their directory)."""

    hidden_files: dict[str, Annotated[str, msgspec.Meta(max_length=1 << 20)]]
    command: Annotated[list[str], msgspec.Meta(min_length=1, max_length=256)]
    isolate: bool = True
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 60.0


JudgeSpec = RegexJudgeSpec | ExecutableJudgeSpec


class WorkerTask(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """One episode to run. ``task_id`` is the trainer's name for it and makes a submit
    idempotent: the same id is never run twice.

    Two policies: with ``commands`` the policy is scripted (the bash tool calls, one per
    turn, each after ``think_s`` seconds of "model" time; the judge pays 1.0 when the last
    command's stdout contains ``expect``). Without, the worker's model endpoint
    (:class:`WorkerConfig` ``policy``) plays it through the ``agent`` rollout engine
    (:class:`dsec.rl.engine.RolloutEngine`): ``prompt``, ``files`` written before the
    first turn, at most ``max_turns`` turns, judged by ``judge``."""

    task_id: Annotated[str, msgspec.Meta(pattern=TASK_ID_PATTERN)]
    prompt: Annotated[str, msgspec.Meta(max_length=65536)] = ""
    commands: Annotated[list[Annotated[str, msgspec.Meta(max_length=65536)]],
                        msgspec.Meta(max_length=256)] = []
    think_s: Annotated[float, msgspec.Meta(ge=0, le=600)] = 0.0
    command_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 60.0
    expect: str | None = None
    image: str = "base"
    files: dict[str, Annotated[str, msgspec.Meta(max_length=1 << 20)]] = {}
    max_turns: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 16
    judge: JudgeSpec | None = None
    group_id: str | None = None
    epoch: int | None = None
    metadata: dict[str, Any] = {}


class PolicySpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """An OpenAI-compatible endpoint (:class:`dsec.rl.agent.policy.PolicyConfig`)."""

    base_url: str
    model: str
    api_key: str = "EMPTY"
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 120.0
    max_concurrency: Annotated[int, msgspec.Meta(ge=1)] = 64
    tool_format: str = "openai"


class WorkerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A worker's configuration (``config.json`` in its state directory, mode 0600: it
    holds the project key the worker acts with).

    - ``url``/``api_key``/``project``: the apiserver, the key the worker creates its
      sandboxes with, and the project they (and the trainer API's callers) belong to.
    - ``listen``: ``tcp:HOST:PORT`` (port 0: any) or ``unix:PATH`` for the trainer API.
    - ``concurrency``: episodes in flight at once.
    - ``warm``: fresh sandboxes kept ready ahead of tasks (each serves one episode).
    - ``away_after_s``: seconds without a trainer request or open stream after which the
      trainer counts as away and idle (warm) sandboxes are paused; resumed when it is back.
    - ``backend``/``isolation``/``memory_bytes``: of the episodes' sandboxes (backend
      ``None``: the server's default; ``isolation``: the tier, "container", "gvisor" or
      "vm", which picks the backend when ``backend`` is None: docs/sdk.md "Isolation
      tiers").
    - ``policy``: the model endpoint for tasks without scripted ``commands``.
    - ``max_attempts``: an episode that fails on infrastructure (sandbox lost, apiserver
      unreachable) is retried from scratch this many times in all, then reported as an
      ``infra_error`` trajectory (so it is never silently lost).
    """

    url: str
    api_key: str
    project: str
    worker_id: Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")]
    listen: str = "tcp:127.0.0.1:0"
    concurrency: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 16
    warm: Annotated[int, msgspec.Meta(ge=0, le=4096)] = 0
    away_after_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    backend: str | None = None
    isolation: Isolation | None = None
    memory_bytes: Annotated[int, msgspec.Meta(ge=1 << 20)] = 128 << 20
    policy: PolicySpec | None = None
    max_attempts: Annotated[int, msgspec.Meta(ge=1, le=100)] = 3
    auth_cache_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0


def valid_task_id(task_id: str) -> bool:
    return bool(_TASK_ID.match(task_id))
