"""The task flywheel: propose tasks, build their environments in sandboxes, solve, judge.

DSec's RL side turns like this, and so does :class:`Flywheel`:

1. **Propose**: a proposer model answers a request for tasks with a ``submit`` whose
   answer is a JSON list of :class:`TaskProposal` (a prompt for the solver, setup steps for
   the environment builder, a readiness check, hidden tests and the verifier command).
2. **Build**: an environment-builder agent runs the setup inside a sandbox (an ordinary
   episode of the rollout engine, judged by the proposal's readiness check in place); the
   sandbox is snapshotted with pack_diff and the snapshot is registered as the task's
   image (``images.promote``). A build that fails its check registers nothing.
3. **Hide the tests**: the hidden tests become a toolkit layer of their own. Solver
   sandboxes start from the snapshot and never mount that layer; only judge sandboxes do.
4. **Solve and judge**: GRPO groups of solver rollouts from the snapshot; an
   :class:`~dsec.rl.judges.ExecutableJudge` copies the declared answer files into a fresh
   sandbox of the task's image *plus* the hidden-tests layer and runs the verifier there,
   so nothing the solver did to its own sandbox (replaced binaries, leftover processes,
   fake reward files) reaches the verdict. Pass rates go to the
   :class:`~dsec.rl.tasks.TaskRegistry`.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec

from dsec.errors import InvalidArgument
from dsec.rl.agent.policy import Policy
from dsec.rl.agent.tools import Submit as SubmitAction
from dsec.rl.agent.tools import ToolCallError, decode_action, parse_reply
from dsec.rl.agent.types import Message, Trajectory
from dsec.rl.engine import RolloutEngine
from dsec.rl.judges import ExecutableJudge
from dsec.rl.tasks import AgentTask, TaskRegistry
from dsec.wire.spec import SandboxSpec

__all__ = ["BuiltTask", "Flywheel", "TaskProposal", "parse_proposals"]

_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
HIDDEN_ROOT = "/opt/dsec-hidden"


class TaskProposal(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A proposed task. ``setup``: shell steps the builder runs; ``ready``: a shell check
    that passes once the environment is built; ``tests``: hidden test files (path relative
    to the hidden-tests layer's root, ``/opt/dsec-hidden``) -> content; ``verify``: the
    verifier argv (``{hidden}`` is replaced by that root); ``answer_files``: what the judge
    copies out of the solver's sandbox."""

    id: str
    prompt: str
    setup: list[str]
    ready: str = "true"
    tests: dict[str, str]
    verify: list[str]
    answer_files: list[str]

    def __post_init__(self) -> None:
        if not _ID.match(self.id):
            raise InvalidArgument(f"proposed task id {self.id[:80]!r} must match {_ID.pattern}")
        if not self.verify or not self.answer_files:
            raise InvalidArgument(f"proposal {self.id}: needs a verify argv and answer_files")
        for p in self.tests:
            if p.startswith("/") or ".." in p.split("/"):
                raise InvalidArgument(f"proposal {self.id}: test path {p!r} must be relative")
        for p in self.answer_files:
            if not p.startswith("/"):
                raise InvalidArgument(f"proposal {self.id}: answer file {p!r} must be absolute")


def parse_proposals(reply: Message) -> list[TaskProposal]:
    """The proposals in a proposer's reply: a ``submit`` call whose answer is a JSON list
    of :class:`TaskProposal` objects (a malformed reply raises InvalidArgument)."""
    for item in parse_reply(reply.content, reply.tool_calls):
        if isinstance(item, ToolCallError):
            raise InvalidArgument(f"proposer reply is not a tool call: {item.message}")
        action = decode_action(item)
        if isinstance(action, SubmitAction):
            try:
                return msgspec.json.decode(action.answer, type=list[TaskProposal])
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise InvalidArgument(f"proposer's answer is not a list of task proposals: "
                                      f"{exc}") from exc
    raise InvalidArgument("proposer reply has no submit call carrying the proposals")


@dataclass(slots=True)
class BuiltTask:
    proposal: TaskProposal
    task: AgentTask | None                    # None: the build failed its readiness check
    build: Trajectory
    snapshot: str | None = None
    image: str | None = None
    hidden_layer: str | None = None


@dataclass(slots=True, kw_only=True)
class Flywheel:
    """One turn of the flywheel (see the module docstring). ``builder`` and ``solver`` are
    rollout engines over the same sandboxes (the builder's keeps its sandboxes so they can
    be snapshotted: ``EngineConfig(keep_sandboxes=True)``); ``base``: the image builders
    start from; ``spec``: the fields of every sandbox (backend, memory...)."""

    proposer: Policy
    builder: RolloutEngine
    solver: RolloutEngine
    registry: TaskRegistry = field(default_factory=TaskRegistry)
    base: str = "base"
    spec: SandboxSpec = field(default_factory=SandboxSpec)
    image_prefix: str = "flywheel"

    def __post_init__(self) -> None:
        if not self.builder.config.keep_sandboxes:
            raise InvalidArgument("the builder engine must keep its sandboxes for the "
                                  "snapshot: EngineConfig(keep_sandboxes=True)")

    async def propose(self, request: str) -> list[TaskProposal]:
        reply = await self.proposer.act([Message(role="user", content=request)])
        return parse_proposals(reply)

    async def build(self, proposal: TaskProposal) -> BuiltTask:
        """Build the environment of ``proposal`` and register the task (see the module
        docstring); the builder's sandbox is destroyed either way."""
        sb = self.builder.sandboxes
        base_spec = msgspec.structs.replace(self.spec, image=self.base, snapshot=None)
        steps = "\n".join(proposal.setup)
        build_task = AgentTask(
            id=f"build-{proposal.id}", spec=base_spec, max_turns=len(proposal.setup) + 4,
            prompt=("Prepare the environment of a task inside this sandbox. Run these "
                    f"setup steps, then submit:\n```bash\n{steps}\n```"),
            judge=ExecutableJudge(hidden_files={}, command=["/bin/sh", "-c", proposal.ready],
                                  isolate=False, timeout_s=60.0))
        traj = await self.builder.episode(build_task)
        sid = traj.sandbox_id
        try:
            if traj.verdict is None or not traj.verdict.passed or sid is None:
                return BuiltTask(proposal, None, traj)
            snap = await sb.snapshot(sid)
        finally:
            if sid is not None:
                await sb.destroy(sid)
        image = await sb.promote(snap, base=self.base,
                                 target=f"{self.image_prefix}-{proposal.id}")
        with tempfile.TemporaryDirectory(prefix="dsec-hidden-") as d:
            _write_tree(os.path.join(d, HIDDEN_ROOT.lstrip("/")), proposal.tests)
            hidden = await sb.build_layer(d, name=f"{self.image_prefix}-hidden-{proposal.id}",
                                          kind="toolkit")
        judge_spec = msgspec.structs.replace(self.spec, image=image, snapshot=None,
                                             toolkits=(hidden,))
        task = AgentTask(
            id=proposal.id, prompt=proposal.prompt,
            spec=msgspec.structs.replace(self.spec, snapshot=snap),
            judge=ExecutableJudge(
                hidden_files={}, carry=list(proposal.answer_files), judge_spec=judge_spec,
                command=[a.replace("{hidden}", HIDDEN_ROOT) for a in proposal.verify]),
            metadata={"image": image, "snapshot": snap, "hidden_layer": hidden})
        self.registry.add(task, replace=True)
        return BuiltTask(proposal, task, traj, snap, image, hidden)

    async def turn(self, request: str, *, group_size: int = 4) -> dict[str, list[Trajectory]]:
        """Propose, build every proposal, and run one GRPO group of solvers per built task;
        returns the groups by task id."""
        out: dict[str, list[Trajectory]] = {}
        for proposal in await self.propose(request):
            built = await self.build(proposal)
            if built.task is not None:
                out[proposal.id] = await self.solver.group(built.task, group_size)
        return out


def _write_tree(root: str, files: Mapping[str, str]) -> None:
    """The hidden tests as files under ``root`` (the layer's directory tree); owner-only
    modes, so even inside a judge sandbox only root reads them."""
    for rel, content in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(content)

