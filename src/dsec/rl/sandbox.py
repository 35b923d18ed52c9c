"""Environments whose state is a real sandbox: actions are tool calls, observations text.

An action is a text tool call. A JSON object picks a tool::

    {"tool": "shell", "command": "ls -la", "timeout_s": 10}
    {"tool": "write_file", "path": "/workspace/a.py", "content": "print(1)"}
    {"tool": "read_file", "path": "/workspace/a.py"}
    {"tool": "submit", "answer": "42"}

and any other text is a shell command. The observation is the tool's output (stdout,
stderr and ``[exit N]`` for commands) as text (:func:`clean_text`: UTF-8 kept as it is,
bytes that are not UTF-8 and control characters shown as ``\\xNN`` escapes), cut to
``max_obs_chars``. An episode ends with ``submit`` (terminated) or after ``max_turns``
(truncated); then the task's judge scores the sandbox and the answer, and that is the
step's reward (0 on every other step). An action outside the action space (longer than
``max_action_chars``, or holding a control character such as NUL) runs nothing and is
answered with an error observation (the turn counts). Stepping an env whose episode
ended raises until it is reset.

Infrastructure failures are not the agent's: when a command cannot be carried out
because the sandbox or the cluster failed (the sandbox was lost, the node is
unreachable, the request timed out), the episode is truncated at once, no judge runs,
and ``info["infra_error"]`` is True with a zero-reward ``info["verdict"]`` whose
``infra_error`` is set, so a trainer can mask the episode instead of learning from it.
A judge that cannot run its verifier says the same through its verdict.

- :class:`SandboxEnv` is a ``gymnasium.Env`` with ``Text`` spaces (passes
  ``gymnasium.utils.env_checker.check_env``), one sandbox per episode.
- :class:`SandboxEnvPool` steps many of them: every shell call of a tick goes out in one
  :meth:`~dsec.rl.access.SandboxAccess.exec_batch` (one round trip per node with
  :class:`~dsec.rl.access.EdgeAccess`), finished episodes get a fresh sandbox in the same
  tick, and :meth:`~dsec.rl.envpool.EnvPool.pause`/``export_state`` make it preemptible
  (see :mod:`dsec.rl.driver`).

Both share :class:`SandboxEpisodes`, which holds the per-env episode state and does the
batched I/O.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import msgspec
import numpy as np
import numpy.typing as npt

from dsec.errors import Conflict, DsecError, InvalidArgument
from dsec.rl.access import (
    SandboxAccess,
    create_sandboxes,
    destroy_sandboxes,
    is_infra_error,
    pause_sandboxes,
    resume_sandboxes,
)
from dsec.rl.commandlog import LoggedAccess
from dsec.rl.envpool import EnvPool
from dsec.rl.judges import Judge, JudgeContext, Verdict
from dsec.wire.spec import ExecRequest, ExecResult, SandboxSpec

__all__ = [
    "CHARSET", "ReadFile", "SandboxBatchEnv", "SandboxEnv", "SandboxEnvConfig",
    "SandboxEnvPool", "SandboxEpisodes", "Shell", "Submit", "Task", "ToolCall", "WriteFile",
    "parse_action",
]

Array = npt.NDArray[Any]
# Printable ASCII plus tab/newline/CR: what the text spaces *sample* from. What they
# *contain* is any printable Unicode text plus tab/newline/CR (:class:`UnicodeText`).
CHARSET = "".join(c for c in string.printable if c not in "\x0b\x0c")


def _allowed(c: str) -> bool:
    return c.isprintable() or c in "\t\n\r"


class UnicodeText(gym.spaces.Text):
    """A Gymnasium ``Text`` space of any printable Unicode text (plus tab, newline, CR).

    ``Text`` needs a finite charset to sample from; model output and command output are
    not limited to one, so :meth:`contains` accepts every printable character while
    sampling keeps to ``charset`` (printable ASCII). Control characters (NUL, ESC, ...)
    are outside the space: observations show them as escapes (:func:`clean_text`).
    """

    def contains(self, x: Any) -> bool:
        if not isinstance(x, str):
            return False
        return self.min_length <= len(x) <= self.max_length and all(map(_allowed, x))

    def __repr__(self) -> str:
        return f"UnicodeText({self.min_length}, {self.max_length})"


class Shell(msgspec.Struct, tag="shell", tag_field="tool", forbid_unknown_fields=True):
    command: str
    timeout_s: float | None = None


class WriteFile(msgspec.Struct, tag="write_file", tag_field="tool", forbid_unknown_fields=True):
    path: str
    content: str


class ReadFile(msgspec.Struct, tag="read_file", tag_field="tool", forbid_unknown_fields=True):
    path: str


class Submit(msgspec.Struct, tag="submit", tag_field="tool", forbid_unknown_fields=True):
    answer: str = ""


ToolCall = Shell | WriteFile | ReadFile | Submit
_tool_decoder = msgspec.json.Decoder(ToolCall)

def parse_action(text: str) -> ToolCall:
    """The tool call in ``text`` (JSON object, or else a shell command).

    Raises :class:`InvalidArgument` with what is wrong for malformed JSON tool calls and
    empty actions; the env turns that into an observation, not a crash.
    """
    s = text.strip()
    if not s:
        raise InvalidArgument("empty action: send a shell command or a JSON tool call")
    if s.startswith("{"):
        try:
            call: ToolCall = _tool_decoder.decode(s)
            return call
        except msgspec.DecodeError as exc:
            raise InvalidArgument(
                f"invalid tool call: {exc}; tools are shell(command), write_file(path, "
                "content), read_file(path), submit(answer)") from exc
    return Shell(command=text)


def _escape(c: str) -> str:
    return c if _allowed(c) else (f"\\x{ord(c):02x}" if ord(c) < 0x100
                                  else c.encode("unicode_escape").decode("ascii"))


def clean_text(text: str, limit: int) -> str:
    """``text`` as an observation, at most ``limit`` characters.

    Printable Unicode, tab, newline and CR stay as they are (a model must see ``naïve``
    and ``中文`` as written, not as ``?``); any other character is shown as its escape
    (``\\x00``, ``\\x1b``, ``\\u200b``), so nothing invisible or terminal-controlling
    reaches the policy and nothing is silently dropped. Command output is decoded as
    UTF-8 with ``backslashreplace`` first (:func:`decode_output`): a byte that is not
    UTF-8 appears as ``\\xNN``, the same rule.
    """
    t = text if all(map(_allowed, text)) else "".join(map(_escape, text))
    if len(t) > limit:
        marker = "\n[... output cut]"
        t = t[: max(0, limit - len(marker))] + marker[: limit]
    return t


def decode_output(data: bytes) -> str:
    """Command output as text: UTF-8, and each byte that is not valid UTF-8 as ``\\xNN``
    (lossless and visible, unlike U+FFFD)."""
    return data.decode("utf-8", "backslashreplace")


def format_result(res: ExecResult) -> str:
    out = decode_output(res.stdout) + decode_output(res.stderr)
    if res.stdout_truncated or res.stderr_truncated:
        out += "\n[output truncated]"
    tail = "timed out" if res.timed_out else f"exit {res.exit_code}"
    return f"{out}{'' if not out or out.endswith(chr(10)) else chr(10)}[{tail}]"


@dataclass(frozen=True, slots=True, kw_only=True)
class Task:
    """One task: a prompt, files to put in the sandbox, and the judge of the result."""

    prompt: str
    judge: Judge | None = None
    files: Mapping[str, bytes] = field(default_factory=dict)   # absolute path -> content
    spec: SandboxSpec = field(default_factory=SandboxSpec)
    max_turns: int = 16
    workdir: str = "/workspace"
    name: str = "task"


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxEnvConfig:
    max_obs_chars: int = 4096            # observation Text space max_length
    max_action_chars: int = 4096         # action Text space max_length
    command_timeout_s: float = 30.0      # per shell call unless the call asks for less
    output_cap_bytes: int = 64 * 1024    # per stream, per call
    # Top-level entries of the sandbox root the agent never reaches, even as root
    # (ExecRequest.hide: Landlock on every agent command, and the read_file/write_file
    # tools run as such commands too). E.g. (".dsec-judge",) with an in-place
    # ExecutableJudge(tests_root="/.dsec-judge"). Needs native container sandboxes.
    hide: tuple[str, ...] = ()


class EpisodeState(msgspec.Struct, kw_only=True):
    """One env slot's episode (what a preempted rollout must carry to resume)."""

    sandbox_id: str | None = None
    task_index: int = 0
    episode: int = -1                    # episodes started in this slot
    turn: int = 0
    transcript: list[str] = []           # the prompt, then one observation per turn
    finished: bool = False               # terminated/truncated: step raises until reset


class _PoolState(msgspec.Struct, kw_only=True):
    seed: int
    episodes: list[EpisodeState]
    cursors: dict[str, int] | None = None    # command-log positions (LoggedAccess)
    run: str = ""                            # names this run's episodes in a command log


@dataclass(slots=True)
class StepOut:
    obs: str
    reward: float
    terminated: bool
    truncated: bool
    verdict: Verdict | None = None
    infra_error: bool = False            # the platform failed, not the agent (mask it)

    def info(self) -> dict[str, Any]:
        """The Gymnasium info of this step: ``verdict`` when the episode ended, and
        ``infra_error`` (always present, so a vector env's mask covers every env)."""
        out: dict[str, Any] = {"infra_error": self.infra_error}
        if self.verdict is not None:
            out["verdict"] = self.verdict
        return out



class SandboxEpisodes:
    """Episode state and batched sandbox I/O for ``num_envs`` env slots."""

    def __init__(self, access: SandboxAccess, tasks: Sequence[Task], num_envs: int,
                 config: SandboxEnvConfig) -> None:
        if not tasks:
            raise InvalidArgument("a sandbox env needs at least one task")
        if num_envs < 1:
            raise InvalidArgument(f"num_envs={num_envs} must be >= 1")
        self.access = access
        self.tasks = list(tasks)
        self.config = config
        self.seed = 0
        # A fresh name per reset: a command log keys episode creates by run/slot/episode.
        self.run = secrets.token_hex(8)
        self.states = [EpisodeState() for _ in range(num_envs)]
        self.action_space = _text_spaces(config)[1]

    # -- episodes ----------------------------------------------------------------------

    def begin(self, i: int, *, task: int | str | None = None) -> str:
        """Start a new episode in slot ``i``: fresh sandbox, task files; returns the prompt."""
        return self.begin_many([i], task=task)[0]

    def task_of(self, task: int | str) -> int:
        """The index of ``task`` (an index, or a task's name) in the task list."""
        if isinstance(task, bool) or not isinstance(task, int | str):
            raise InvalidArgument(f"task {task!r} must be a task index or name", field="task")
        if isinstance(task, int):
            if not 0 <= task < len(self.tasks):
                raise InvalidArgument(f"task {task} is out of range: there are "
                                      f"{len(self.tasks)} tasks", field="task")
            return task
        names = [t.name for t in self.tasks]
        if names.count(task) != 1:
            raise InvalidArgument(f"task {task!r} names {names.count(task)} of the tasks "
                                  f"({', '.join(sorted(set(names))[:20])}); name one, or pass "
                                  "its index", field="task")
        return names.index(task)

    def begin_many(self, idx: Sequence[int], *, task: int | str | None = None) -> list[str]:
        """Start new episodes in slots ``idx``; returns their prompts.

        Batched: the old sandboxes go in one destroy batch, the new ones come from one
        create batch (when the access can batch) and their directories from one exec
        batch. Through the API, 64 episode starts one by one took ~2.5 s on containers.
        """
        idx = list(idx)
        forced = None if task is None else self.task_of(task)   # refuse before any change
        self.end_many(idx)
        tasks: list[Task] = []
        for i in idx:
            st = self.states[i]
            st.episode += 1
            # The task depends only on (seed, slot, episode): a resumed pool picks the
            # same tasks as an uninterrupted one without carrying RNG state.
            if forced is None:
                rng = np.random.default_rng([self.seed, i, st.episode])
                st.task_index = int(rng.integers(len(self.tasks)))
            else:                            # reset(options={"task": ...})
                st.task_index = forced
            st.turn = 0
            st.transcript = []
            st.finished = False
            tasks.append(self.tasks[st.task_index])
        if isinstance(self.access, LoggedAccess):
            # Logged by episode: a replay reuses the sandbox the crashed trainer made.
            sids = self.access.create_episodes(
                [f"{self.run}/{i}/{self.states[i].episode}" for i in idx],
                [t.spec for t in tasks])
        else:
            sids = create_sandboxes(self.access, [t.spec for t in tasks])
        for i, sid in zip(idx, sids):
            self.states[i].sandbox_id = sid
        try:
            mkdirs = []
            for sid, t in zip(sids, tasks):
                dirs = sorted({p.rsplit("/", 1)[0] for p in t.files if p.rsplit("/", 1)[0]}
                              | {t.workdir})
                mkdirs.append((sid, ExecRequest(argv=("mkdir", "-p", *dirs), timeout_s=30.0)))
            for res in self.access.exec_batch(mkdirs):
                if isinstance(res, DsecError):
                    raise res
            for sid, t in zip(sids, tasks):
                for path, data in t.files.items():
                    self.access.write_file(sid, path, data)
        except BaseException:
            self.end_many(idx)
            raise
        out = []
        for i, t in zip(idx, tasks):
            obs = clean_text(t.prompt, self.config.max_obs_chars)
            self.states[i].transcript.append(obs)
            out.append(obs)
        return out

    def end(self, i: int) -> None:
        self.end_many([i])

    def end_many(self, idx: Sequence[int]) -> None:
        """Destroy the sandboxes of slots ``idx`` (already gone is fine)."""
        sids = []
        for i in idx:
            st = self.states[i]
            if st.sandbox_id is not None:
                sids.append(st.sandbox_id)
                st.sandbox_id = None
        destroy_sandboxes(self.access, sids)

    def step(self, idx: Sequence[int], actions: Sequence[str]) -> list[StepOut]:
        """Apply one action per listed slot; all shell calls go out in one batch."""
        cfg = self.config
        calls: list[tuple[str, ExecRequest]] = []
        call_of: dict[int, int] = {}
        text: dict[int, str] = {}
        submitted: dict[int, str] = {}
        for i in idx:        # before any I/O: a refused step changes nothing
            st = self.states[i]
            if st.sandbox_id is None:
                raise Conflict(f"env {i} has no running episode; reset it before stepping")
            if st.finished:
                raise Conflict(f"env {i}'s episode has ended (terminated or truncated, and "
                               "judged); call reset() before stepping it again", env=i)
        for k, (i, action) in enumerate(zip(idx, actions)):
            st = self.states[i]
            sid = st.sandbox_id
            assert sid is not None
            task = self.tasks[st.task_index]
            action = str(action)
            if not self.action_space.contains(action):
                text[k] = self._refused(action)
                continue
            try:
                call = parse_action(action)
            except InvalidArgument as exc:
                text[k] = f"error: {exc.message}"
                continue
            if isinstance(call, Shell):
                t = cfg.command_timeout_s if call.timeout_s is None or call.timeout_s <= 0 \
                    else min(call.timeout_s, cfg.command_timeout_s)
                call_of[k] = len(calls)
                calls.append((sid, ExecRequest(shell=call.command, cwd=task.workdir,
                                               timeout_s=t, hide=cfg.hide,
                                               output_cap_bytes=cfg.output_cap_bytes)))
            elif isinstance(call, WriteFile):
                text[k] = self._write(sid, call, task.workdir)
            elif isinstance(call, ReadFile):
                text[k] = self._read(sid, call, task.workdir)
            else:
                submitted[k] = call.answer
                text[k] = "submitted"
        results = self.access.exec_batch(calls) if calls else []
        outs: list[StepOut] = []
        for k, i in enumerate(idx):
            st = self.states[i]
            task = self.tasks[st.task_index]
            infra: DsecError | None = None
            if k in call_of:
                r = results[call_of[k]]
                if isinstance(r, DsecError):
                    raw = f"error: {r.message}"
                    infra = r if is_infra_error(r) else None
                else:
                    raw = format_result(r)
            else:
                raw = text[k]
            obs = clean_text(raw, cfg.max_obs_chars)
            st.turn += 1
            st.transcript.append(obs)
            terminated = k in submitted
            truncated = not terminated and (st.turn >= task.max_turns or infra is not None)
            out = StepOut(obs, 0.0, terminated, truncated)
            if infra is not None:
                # The sandbox/cluster failed: no judge (it would score a broken sandbox).
                out.infra_error = True
                out.verdict = Verdict(0.0, False, f"infrastructure error: {infra}",
                                      infra_error=True)
            elif terminated or truncated:
                out.verdict = self._judge(i, submitted.get(k, ""))
                out.reward = out.verdict.reward
                out.infra_error = out.verdict.infra_error
            st.finished = terminated or truncated
            outs.append(out)
        return outs

    def _refused(self, action: str) -> str:
        limit = self.config.max_action_chars
        if len(action) > limit:
            return (f"error: the action is {len(action)} characters long, over the limit of "
                    f"{limit} (max_action_chars); nothing was run")
        bad = next(c for c in action if not _allowed(c))
        return (f"error: the action holds the control character {_escape(bad)}, which is "
                "outside the action space; nothing was run")

    def _confined(self, sid: str, req: ExecRequest) -> ExecResult | str:
        """Run a file tool as a command under the agent's Landlock rules (the file API
        is the edge's and would follow the agent's symlinks into a hidden directory)."""
        r = self.access.exec_batch([(sid, req)])[0]
        if isinstance(r, DsecError):
            return f"error: {r.message}"
        if r.exit_code != 0:
            return f"error: {decode_output(r.stderr).strip() or f'exit {r.exit_code}'}"
        return r

    def _write(self, sid: str, call: WriteFile, workdir: str) -> str:
        data = call.content.encode()
        cfg = self.config
        if cfg.hide:
            r = self._confined(sid, ExecRequest(
                argv=("sh", "-c", 'cat > "$1"', "sh", call.path), stdin=data, cwd=workdir,
                hide=cfg.hide, timeout_s=cfg.command_timeout_s))
            return r if isinstance(r, str) else f"wrote {call.path}"
        try:
            self.access.write_file(sid, call.path, data)
        except DsecError as exc:
            return f"error: {exc.message}"
        return f"wrote {call.path}"

    def _read(self, sid: str, call: ReadFile, workdir: str) -> str:
        cfg = self.config
        if cfg.hide:
            r = self._confined(sid, ExecRequest(
                argv=("cat", "--", call.path), cwd=workdir, hide=cfg.hide,
                timeout_s=cfg.command_timeout_s, output_cap_bytes=cfg.output_cap_bytes))
            return r if isinstance(r, str) else decode_output(r.stdout)
        try:
            data = self.access.read_file(sid, call.path)
        except DsecError as exc:
            return f"error: {exc.message}"
        return decode_output(data)

    def _judge(self, i: int, answer: str) -> Verdict:
        st = self.states[i]
        task = self.tasks[st.task_index]
        if task.judge is None:
            return Verdict(0.0, False, "task has no judge")
        access = self.access
        logged = isinstance(access, LoggedAccess) and st.sandbox_id is not None
        if logged:
            assert isinstance(access, LoggedAccess) and st.sandbox_id is not None
            data = access.logged_verdict(st.sandbox_id)
            if data is not None:       # a replay: judged before the crash, never twice
                return msgspec.msgpack.decode(data, type=Verdict)
            # The judge's own commands (random test dirs) are not the agent's: they stay
            # out of the command sequence, and the verdict is logged instead.
            access = access.inner
        # The prompt is not part of the transcript: a pattern over what the agent did
        # must not match what it was told (a prompt naming the answer paid 1.0).
        ctx = JudgeContext(answer=answer, transcript=tuple(st.transcript[1:]),
                           access=access, sandbox_id=st.sandbox_id, spec=task.spec,
                           prompt=st.transcript[0] if st.transcript else "")
        try:
            verdict = task.judge.judge(ctx)
        except DsecError as exc:
            return Verdict(0.0, False, f"judge failed: {exc}", infra_error=True)
        if logged and not verdict.infra_error:
            assert isinstance(self.access, LoggedAccess) and st.sandbox_id is not None
            self.access.record_verdict(st.sandbox_id, msgspec.msgpack.encode(verdict))
        return verdict

    # -- preemption --------------------------------------------------------------------

    def live_sandboxes(self) -> list[str]:
        return [s.sandbox_id for s in self.states if s.sandbox_id is not None]

    def pause(self) -> None:
        pause_sandboxes(self.access, self.live_sandboxes())

    def resume(self) -> None:
        resume_sandboxes(self.access, self.live_sandboxes())

    def export_state(self) -> bytes:
        cursors = None
        if isinstance(self.access, LoggedAccess):
            live = set(self.live_sandboxes())
            cursors = {k: v for k, v in self.access.cursors.items() if k in live}
        return msgspec.msgpack.encode(_PoolState(seed=self.seed, episodes=self.states,
                                                 cursors=cursors, run=self.run))

    def import_state(self, data: bytes) -> None:
        try:
            st = msgspec.msgpack.decode(data, type=_PoolState)
        except msgspec.DecodeError as exc:
            raise InvalidArgument(f"not a sandbox pool state: {exc}") from exc
        if len(st.episodes) != len(self.states):
            raise InvalidArgument(f"pool state holds {len(st.episodes)} envs, this pool "
                                  f"{len(self.states)}; restore with the same num_envs")
        bad = [e.task_index for e in st.episodes if e.task_index >= len(self.tasks)]
        if bad:
            raise InvalidArgument(f"pool state refers to task {bad[0]} but only "
                                  f"{len(self.tasks)} tasks were given; pass the same tasks")
        self.seed = st.seed
        self.states = st.episodes
        self.run = st.run
        if st.cursors is not None:
            if not isinstance(self.access, LoggedAccess):
                raise InvalidArgument("pool state carries command-log positions; restore "
                                      "it with a LoggedAccess over the same command log")
            self.access.seek(st.cursors)


def _task_option(options: dict[str, Any] | None) -> int | str | None:
    """``reset(options={"task": index_or_name})`` picks the episode's task (else it is
    drawn from (seed, slot, episode)); any other option is refused, not ignored."""
    if not options:
        return None
    unknown = sorted(set(options) - {"task"})
    if unknown:
        raise InvalidArgument(f"sandbox envs take the reset option 'task' (an index or a "
                              f"task name), not {unknown}", field="options")
    task = options["task"]
    if not isinstance(task, int | str):
        raise InvalidArgument(f"reset option task={task!r} must be a task index or name",
                              field="options")
    return task


def _text_spaces(cfg: SandboxEnvConfig) -> tuple[UnicodeText, UnicodeText]:
    return (UnicodeText(cfg.max_obs_chars, min_length=0, charset=CHARSET),
            UnicodeText(cfg.max_action_chars, min_length=0, charset=CHARSET))


class SandboxEnv(gym.Env[str, str]):
    """One sandbox-backed environment (see the module docstring)."""

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012  (gymnasium convention)

    def __init__(self, access: SandboxAccess, tasks: Sequence[Task], *,
                 config: SandboxEnvConfig | None = None) -> None:
        self.config = config or SandboxEnvConfig()
        self.episodes = SandboxEpisodes(access, tasks, 1, self.config)
        self.observation_space, self.action_space = _text_spaces(self.config)

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        if seed is not None or self.episodes.states[0].episode < 0:
            self.episodes.seed = int(self.np_random.integers(2**31))
            self.episodes.run = secrets.token_hex(8)
            self.episodes.states[0].episode = -1
        obs = self.episodes.begin(0, task=_task_option(options))
        st = self.episodes.states[0]
        return obs, {"sandbox_id": st.sandbox_id, "task": self.episodes.tasks[st.task_index].name}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        [out] = self.episodes.step([0], [action])
        return out.obs, float(out.reward), out.terminated, out.truncated, out.info()

    def close(self) -> None:
        self.episodes.end(0)


class SandboxBatchEnv:
    """A :class:`~dsec.rl.envpool.BatchEnv` of sandbox envs: one exec batch per tick."""

    def __init__(self, access: SandboxAccess, tasks: Sequence[Task], num_envs: int, *,
                 config: SandboxEnvConfig | None = None) -> None:
        self.config = config or SandboxEnvConfig()
        self.episodes = SandboxEpisodes(access, tasks, num_envs, self.config)
        self.num_envs = num_envs
        self.single_observation_space, self.single_action_space = _text_spaces(self.config)
        self._out: tuple[Array, Array, Array, Array] | None = None
        self.verdicts: list[Verdict | None] = [None] * num_envs   # of the last finished episode
        self._infos: list[dict[str, Any]] = [{} for _ in range(num_envs)]

    def bind(self, obs: Array, rewards: Array, terminated: Array, truncated: Array) -> None:
        self._out = (obs, rewards, terminated, truncated)

    def _bound(self) -> tuple[Array, Array, Array, Array]:
        if self._out is None:
            raise Conflict("SandboxBatchEnv is not bound to a pool; use SandboxEnvPool")
        return self._out


    def reset_all(self, seed: int | Sequence[int | None] | None,
                  options: dict[str, Any] | None = None) -> None:
        task = _task_option(options)
        obs = self._bound()[0]
        entropy: int | list[int] | None = None
        if isinstance(seed, int | np.integer):
            entropy = int(seed)
        elif seed is not None:       # one per env (Gymnasium's list form): all, or none
            seeds = list(seed)
            entropy = None if any(x is None for x in seeds) else [int(x) for x in seeds
                                                                  if x is not None]
        self.episodes.seed = int(np.random.SeedSequence(entropy).generate_state(1)[0])
        self.episodes.run = secrets.token_hex(8)
        for i in range(self.num_envs):
            self.episodes.states[i].episode = -1
        for i, o in enumerate(self.episodes.begin_many(range(self.num_envs), task=task)):
            obs[i] = o
        self._infos = [self._reset_info(i) for i in range(self.num_envs)]

    def _reset_info(self, i: int) -> dict[str, Any]:
        st = self.episodes.states[i]
        return {"sandbox_id": st.sandbox_id, "task": self.episodes.tasks[st.task_index].name}

    def step(self, actions: Array) -> None:
        obs, rew, term, trunc = self._bound()
        outs = self.episodes.step(range(self.num_envs), [str(a) for a in actions])
        for i, o in enumerate(outs):
            obs[i] = o.obs
            rew[i] = o.reward
            term[i] = o.terminated
            trunc[i] = o.truncated
            if o.verdict is not None:
                self.verdicts[i] = o.verdict
        self._infos = [o.info() for o in outs]

    def reset_envs(self, mask: Array, options: dict[str, Any] | None = None) -> None:
        task = _task_option(options)
        obs = self._bound()[0]
        idx = np.flatnonzero(mask).tolist()
        if idx:
            for i, o in zip(idx, self.episodes.begin_many(idx, task=task)):
                obs[i] = o
                self._infos[i] = self._reset_info(i)

    def last_infos(self) -> list[dict[str, Any]]:
        """Per env: ``infra_error`` (and ``verdict`` when the episode ended) after a
        step; ``sandbox_id`` and ``task`` after a reset."""
        return self._infos

    _ATTRS = ("sandbox_id", "task_index", "episode", "turn", "transcript")

    def get_attr(self, name: str) -> list[Any]:
        if name == "task":
            return [self.episodes.tasks[st.task_index] for st in self.episodes.states]
        if name not in self._ATTRS:
            raise InvalidArgument(f"sandbox envs have no per-env attribute {name!r}; they "
                                  f"have {', '.join(('task', *self._ATTRS))}")
        return [getattr(st, name) for st in self.episodes.states]

    def close(self) -> None:
        self.episodes.end_many(range(self.num_envs))

    def pause(self) -> None:
        self.episodes.pause()

    def resume(self) -> None:
        self.episodes.resume()

    def export_state(self) -> bytes:
        return self.episodes.export_state()

    def import_state(self, data: bytes) -> None:
        self.episodes.import_state(data)


class SandboxEnvPool(EnvPool):
    """``num_envs`` sandbox envs stepped as one vector env (see the module docstring).

    Use :meth:`restore` in a new trainer process to rebuild the pool of a preempted
    rollout from ``RolloutHandle.pool_state`` (same tasks, same config, and a
    :class:`~dsec.rl.commandlog.LoggedAccess` over the same log if one was used).
    """

    def __init__(self, access: SandboxAccess, tasks: Sequence[Task], num_envs: int, *,
                 config: SandboxEnvConfig | None = None) -> None:
        self.batch = SandboxBatchEnv(access, tasks, num_envs, config=config)
        super().__init__([self.batch])

    @classmethod
    def restore(cls, pool_state: bytes, access: SandboxAccess, tasks: Sequence[Task],
                num_envs: int, *, config: SandboxEnvConfig | None = None) -> SandboxEnvPool:
        pool = cls(access, tasks, num_envs, config=config)
        pool.import_state(pool_state)
        return pool

    def sandbox_ids(self) -> list[str | None]:
        return [s.sandbox_id for s in self.batch.episodes.states]
