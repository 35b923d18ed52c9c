"""Judges (verifiers): turn an episode's outcome into a reward.

A judge gets a :class:`JudgeContext` (the submitted answer, the transcript of
observations, and access to the sandbox) and returns a :class:`Verdict`.

- :class:`RegexJudge`: a pattern over the answer or the transcript.
- :class:`ReferenceJudge`: compare the answer with a reference (exact, normalised
  whitespace/case, or numeric within a tolerance).
- :class:`RubricJudge`: weighted checks (each a judge or a predicate); the reward is the
  passed weight over the total weight.
- :class:`ExecutableJudge`: run hidden tests against the sandbox's final state.

Tamper resistance of :class:`ExecutableJudge` (the agent's code is hostile):

- The hidden test files exist nowhere the agent can reach until judging: they are held by
  the trainer and written at judge time into a fresh directory with an unpredictable name
  (``secrets.token_hex``), through the file API, not through a shell the agent could have
  replaced.
- The verifier is a fresh ``argv`` command chosen by the judge (no shell string, fixed
  ``PATH`` and cwd); the reward comes from *its* exit status/stdout, never from a file in
  the sandbox, so a fake ``reward.txt`` or edited visible tests earn nothing.
- The hidden files are read back after the run; if anything changed them during the run
  (a background process the agent left behind), the verdict is zero.
- The hidden files are ``0600`` in a ``0700`` directory made fresh (``mkdir`` without
  ``-p``: a planted directory fails it) and owned by root, the verifier's user. Answer
  code must run as another, unprivileged user: ``answer_command`` is run by the judge as
  ``answer_user`` (``ExecRequest.user``, default ``nobody``) *before* the hidden files
  exist, and its output is handed to the verifier as ``{tests}/answer.stdout``,
  ``answer.stderr`` and ``answer.exit`` (``0600``); a harness that runs the answer
  itself gets the user as ``{answer_user}`` to drop privileges with (before this, the
  files were ``0644`` in a ``0755`` directory, and an answer run as ``nobody`` read the
  expected outputs and earned 1.0).
- In place (``isolate=False``) every other process of the sandbox is killed first
  (``stop_agent=True``: ``kill -9 -1`` as root until none is left, checked through
  ``/proc``), and again after ``answer_command``: nothing the agent left running is alive
  when the hidden files appear. If that fails, nothing is judged (reward 0).
- ``isolate=True`` (the default) goes further: a *new* sandbox is created from the
  judge's spec, only the declared answer files (``carry``) are copied into it as data,
  and the tests run there. Binaries the agent replaced (a fake ``/bin/sh`` that always
  exits 0) and processes it left running cannot affect the verdict. In-place judging
  (``isolate=False``, explicit) trusts the sandbox's own binaries, so use it only when
  the interpreter comes from a read-only toolkit layer. What in-place judging does not
  protect: the sandbox's binaries and libraries (the agent may have replaced ``sh``,
  ``kill``, the test runner), its configuration (``/etc/passwd``: ``nobody`` may have
  been made uid 0), and anything the agent's root could do before the stop (e.g. load
  state into files the verifier reads). Judge in place only with binaries from a
  read-only layer and an answer that is plain data.
- A harness that runs the answer *in its own process* (a shell that sources it, a Python
  harness that imports it) can be ended early by the answer: ``exit 0`` looks like a pass
  to :func:`exit_code_score`. ``require_marker=True`` closes that: the judge passes a
  fresh nonce as ``{nonce}`` and only a last stdout line ``DSEC-PASS <nonce>``, printed by
  the harness after its checks, earns the reward. An answer written to read the
  harness's own arguments could still forge it; for that threat run answer code in a
  child process of the harness (as an unprivileged user), which no judge can do for you.
"""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from dsec.errors import DsecError, InvalidArgument
from dsec.rl.access import SandboxAccess, is_infra_error
from dsec.wire.spec import ExecRequest, ExecResult, SandboxSpec

__all__ = [
    "Check", "ExecutableJudge", "Judge", "JudgeContext", "ReferenceJudge", "RegexJudge",
    "RubricJudge", "Verdict", "exit_code_score",
]


@dataclass(frozen=True, slots=True)
class Verdict:
    reward: float
    passed: bool
    detail: str = ""
    infra_error: bool = False    # the judge could not judge (platform failure): mask it


@dataclass(slots=True)
class JudgeContext:
    answer: str                                  # what the agent submitted ("" if none)
    transcript: Sequence[str] = ()               # observations of the episode, in order
    access: SandboxAccess | None = None          # (the prompt is not one of them)
    sandbox_id: str | None = None
    spec: SandboxSpec | None = None              # the episode sandbox's spec
    prompt: str = ""                             # what the agent was told


class Judge(Protocol):
    def judge(self, ctx: JudgeContext) -> Verdict: ...


Field = Literal["answer", "transcript", "last_observation"]


def _text(ctx: JudgeContext, fld: Field) -> str:
    if fld == "answer":
        return ctx.answer
    if fld == "last_observation":
        return ctx.transcript[-1] if ctx.transcript else ""
    return "\n".join(ctx.transcript)


@dataclass(frozen=True, slots=True)
class RegexJudge:
    """Reward ``reward`` when ``pattern`` matches (``fullmatch`` for the whole text)."""

    pattern: str
    field: Field = "answer"
    fullmatch: bool = False
    flags: int = 0
    reward: float = 1.0

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern, self.flags)
        except re.error as exc:
            raise InvalidArgument(f"RegexJudge pattern {self.pattern!r} is invalid: {exc}") from exc

    def judge(self, ctx: JudgeContext) -> Verdict:
        rx = re.compile(self.pattern, self.flags)
        text = _text(ctx, self.field)
        m = rx.fullmatch(text) if self.fullmatch else rx.search(text)
        if m:
            return Verdict(self.reward, True, f"{self.field} matches {self.pattern!r}")
        return Verdict(0.0, False, f"{self.field} does not match {self.pattern!r}")


@dataclass(frozen=True, slots=True)
class ReferenceJudge:
    """Compare the answer with ``reference``.

    ``exact``: byte-for-byte; ``normalized``: case-folded, whitespace collapsed;
    ``numeric``: both parse as floats and differ by at most ``tol`` (absolute) or
    ``rel_tol`` (relative).
    """

    reference: str
    mode: Literal["exact", "normalized", "numeric"] = "normalized"
    tol: float = 1e-9
    rel_tol: float = 1e-9

    def judge(self, ctx: JudgeContext) -> Verdict:
        a, r = ctx.answer, self.reference
        if self.mode == "exact":
            ok = a == r
        elif self.mode == "normalized":
            ok = " ".join(a.casefold().split()) == " ".join(r.casefold().split())
        else:
            try:
                fa, fr = float(a.strip()), float(r.strip())
            except ValueError:
                return Verdict(0.0, False, f"answer {a[:80]!r} is not a number")
            ok = math.isclose(fa, fr, rel_tol=self.rel_tol, abs_tol=self.tol)
        return Verdict(1.0 if ok else 0.0, ok,
                       f"answer {'equals' if ok else 'differs from'} the reference ({self.mode})")


@dataclass(frozen=True, slots=True)
class Check:
    """One rubric item: a judge (passes when its verdict passes) or a predicate."""

    name: str
    weight: float
    test: Judge | Callable[[JudgeContext], bool]


@dataclass(frozen=True, slots=True)
class RubricJudge:
    """Weighted checks; reward = passed weight / total weight; ``passed`` when all pass."""

    checks: Sequence[Check]
    pass_threshold: float = 1.0

    def __post_init__(self) -> None:
        if not self.checks:
            raise InvalidArgument("RubricJudge needs at least one check")
        bad = [c.name for c in self.checks if not (c.weight > 0 and math.isfinite(c.weight))]
        if bad:
            raise InvalidArgument(f"rubric checks {bad} need a positive finite weight")

    def judge(self, ctx: JudgeContext) -> Verdict:
        total = sum(c.weight for c in self.checks)
        got = 0.0
        failed: list[str] = []
        for c in self.checks:
            judge_fn = getattr(c.test, "judge", None)
            ok = judge_fn(ctx).passed if judge_fn is not None else bool(c.test(ctx))  # type: ignore[operator]
            if ok:
                got += c.weight
            else:
                failed.append(c.name)
        reward = got / total
        detail = "all checks passed" if not failed else f"failed: {', '.join(failed)}"
        return Verdict(reward, reward >= self.pass_threshold, detail)


def exit_code_score(res: ExecResult) -> float:
    """1.0 when the verifier exited 0 (and did not time out), else 0.0."""
    return 1.0 if res.exit_code == 0 and not res.timed_out else 0.0


# Kill everything but init (1) and this shell, until kill finds nothing to signal; then
# check /proc until no process but those two is alive (a zombie is dead: its entry
# lingers until init reaps it; one that forked during a round is killed the next).
_STOP_OTHERS = """\
i=0
while kill -9 -1 2>/dev/null; do i=$((i+1)); [ $i -lt 200 ] || break; done
i=0
while :; do
  left=
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    [ "$p" = 1 ] || [ "$p" = $$ ] || ! read -r st < "$d/stat" 2>/dev/null && continue
    st=${st##*) }; st=${st%% *}
    [ "$st" = Z ] || [ "$st" = X ] || left="$left $p"
  done
  [ -z "$left" ] && exit 0
  i=$((i+1)); [ $i -lt 300 ] || { echo "still running:$left"; exit 1; }
  kill -9 -1 2>/dev/null; sleep 0.01 2>/dev/null
done
"""


@dataclass(frozen=True, slots=True)
class ExecutableJudge:
    """Run hidden tests in the sandbox and map the verifier's result to a reward.

    ``hidden_files`` maps paths relative to the fresh test directory to their contents.
    ``command`` is an argv; ``{tests}`` in any element is replaced by that directory.
    ``score`` maps the verifier's :class:`ExecResult` to a reward in [0, 1] (default:
    exit code 0 -> 1). ``isolate``/``carry``/``judge_spec``: see the module docstring.
    """

    hidden_files: Mapping[str, bytes]
    command: Sequence[str]
    score: Callable[[ExecResult], float] = exit_code_score
    cwd: str = "/"
    env: Mapping[str, str] = field(
        default_factory=lambda: {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp"})
    timeout_s: float = 60.0
    tests_root: str = "/tmp"
    isolate: bool = True
    carry: Sequence[str] = ()
    judge_spec: SandboxSpec | None = None
    require_marker: bool = False
    answer_command: Sequence[str] | None = None    # argv, run as answer_user first
    answer_user: str = "nobody"
    stop_agent: bool = True                        # in place: kill the agent's processes

    def __post_init__(self) -> None:
        if not self.command:
            raise InvalidArgument("ExecutableJudge needs a verifier command (an argv list)")
        for p in self.hidden_files:
            if p.startswith("/") or ".." in p.split("/") or not p:
                raise InvalidArgument(
                    f"hidden file path {p!r} must be relative and stay inside the test dir")
        if self.isolate and not self.carry:
            raise InvalidArgument(
                "ExecutableJudge judges in a fresh sandbox by default and needs "
                "carry=[answer paths] to copy into it; pass isolate=False to judge in the "
                "agent's own sandbox (which trusts the binaries the agent could replace)")
        if self.answer_command is not None and (
                not self.answer_command or any("{tests}" in a for a in self.answer_command)):
            raise InvalidArgument("answer_command must be a non-empty argv that does not "
                                  "name {tests}: the answer runs before the hidden tests "
                                  "exist, and never sees them")
        if self.answer_user in ("", "root", "0") or self.answer_user.startswith("0:"):
            raise InvalidArgument(f"answer_user={self.answer_user!r}: answer code must run "
                                  "as an unprivileged user (e.g. 'nobody')")
        if self.require_marker and not any("{nonce}" in a for a in self.command):
            raise InvalidArgument("require_marker=True needs '{nonce}' in the verifier command "
                                  "(the harness prints 'DSEC-PASS <nonce>' last)")

    def judge(self, ctx: JudgeContext) -> Verdict:
        if ctx.access is None or ctx.sandbox_id is None:
            raise InvalidArgument("ExecutableJudge needs the episode's sandbox access and id")
        # The judge's own operations failing (no capacity for the judging sandbox, a
        # lost node) raise: the caller flags the episode (SandboxEpisodes: an infra_error
        # verdict; the agent engine: end="infra_error"). Only what the verifier's run
        # itself says comes back as a verdict.
        return self._judge(ctx.access, ctx.sandbox_id, ctx.spec)

    def _judge(self, access: SandboxAccess, sandbox_id: str,
               episode_spec: SandboxSpec | None) -> Verdict:
        if not self.isolate:
            return self._run(access, sandbox_id, in_place=True)
        spec = self.judge_spec or episode_spec or SandboxSpec()
        carried: dict[str, bytes] = {}
        for path in self.carry:
            try:
                carried[path] = access.read_file(sandbox_id, path)
            except DsecError as exc:
                return Verdict(0.0, False, f"answer file {path} could not be read: {exc}",
                               infra_error=is_infra_error(exc))
        fresh = access.create(spec)
        try:
            for path, data in carried.items():
                self._mkdirs(access, fresh, path.rsplit("/", 1)[0])
                access.write_file(fresh, path, data)
            return self._run(access, fresh, in_place=False)
        finally:
            access.destroy(fresh)

    def _mkdirs(self, access: SandboxAccess, sid: str, path: str) -> None:
        if path and path != "/":
            r = access.exec_batch([(sid, ExecRequest(argv=("mkdir", "-p", path),
                                                     env=dict(self.env), timeout_s=10.0))])[0]
            if isinstance(r, DsecError):
                raise r

    def _exec(self, access: SandboxAccess, sid: str, req: ExecRequest) -> ExecResult:
        r = access.exec_batch([(sid, req)])[0]
        if isinstance(r, DsecError):
            raise r
        return r

    def _stop_others(self, access: SandboxAccess, sid: str) -> str | None:
        """Kill every process of the sandbox but init and this one; None when none is
        left, else what went wrong. SIGKILL to ``-1`` until nothing answers, then a
        check through /proc (a forking process may have raced one round)."""
        res = self._exec(access, sid, ExecRequest(argv=("sh", "-c", _STOP_OTHERS), user="0",
                                                  env=dict(self.env), timeout_s=20.0))
        if res.exit_code == 0 and not res.timed_out:
            return None
        out = (res.stdout + res.stderr).decode(errors="replace").strip()[-200:]
        return f"exit {res.exit_code}{' (timed out)' if res.timed_out else ''}: {out}"

    def _run(self, access: SandboxAccess, sid: str, *, in_place: bool) -> Verdict:
        stop = self.stop_agent and (in_place or self.answer_command is not None)
        answer: ExecResult | None = None
        try:
            if stop and (why := self._stop_others(access, sid)) is not None:
                return Verdict(0.0, False, "could not stop the agent's processes before "
                                           f"judging in place ({why}); nothing was judged")
            if self.answer_command is not None:
                answer = self._exec(access, sid, ExecRequest(
                    argv=tuple(self.answer_command), user=self.answer_user, cwd=self.cwd,
                    env=dict(self.env), timeout_s=self.timeout_s))
                if stop and (why := self._stop_others(access, sid)) is not None:
                    return Verdict(0.0, False, "could not stop what the answer left running "
                                               f"({why}); nothing was judged")
        except DsecError as exc:
            return Verdict(0.0, False, f"judging could not start: {exc}",
                           infra_error=is_infra_error(exc))
        root = self.tests_root.rstrip("/") or "/"
        if root != "/":
            # e.g. "/.dsec-judge", hidden from the agent's commands (ExecRequest.hide):
            # made by the judge (as root, 0700) if it is not there yet
            made = access.exec_batch([(sid, ExecRequest(
                argv=("mkdir", "-p", "-m700", root), user="0", env=dict(self.env),
                timeout_s=10.0))])[0]
            if isinstance(made, DsecError):
                return Verdict(0.0, False, f"test root {root} could not be made: {made}",
                               infra_error=is_infra_error(made))
        tests = f"{root.rstrip('/')}/.judge-{secrets.token_hex(8)}"
        subdirs = {"/".join(p.split("/")[:k]) for p in self.hidden_files
                   for k in range(1, p.count("/") + 1)}
        dirs = [tests, *(f"{tests}/{d}" for d in sorted(subdirs))]
        for d in dirs:
            # Fresh and private: no -p (a directory that exists was planted: fail), 0700.
            made = access.exec_batch([(sid, ExecRequest(
                argv=("mkdir", "-m700", d), user="0", env=dict(self.env), timeout_s=10.0))])[0]
            if isinstance(made, DsecError):
                return Verdict(0.0, False, f"test directory {d} could not be made: {made}",
                               infra_error=is_infra_error(made))
            if made.exit_code != 0:
                return Verdict(0.0, False, f"test directory {d} could not be made fresh "
                                           f"(exit {made.exit_code}); nothing was judged")
        files = dict(self.hidden_files)
        if answer is not None:
            files.update({"answer.stdout": answer.stdout, "answer.stderr": answer.stderr,
                          "answer.exit": b"%d\n" % answer.exit_code})
        for rel, data in files.items():
            access.write_file(sid, f"{tests}/{rel}", data, mode=0o600)
        nonce = secrets.token_hex(16)
        argv = tuple(a.replace("{tests}", tests).replace("{nonce}", nonce)
                     .replace("{answer_user}", self.answer_user) for a in self.command)
        req = ExecRequest(argv=argv, cwd=self.cwd, env=dict(self.env), timeout_s=self.timeout_s)
        res = access.exec_batch([(sid, req)])[0]
        if isinstance(res, DsecError):
            return Verdict(0.0, False, f"verifier could not run: {res}",
                           infra_error=is_infra_error(res))
        for rel, data in self.hidden_files.items():
            try:
                now = access.read_file(sid, f"{tests}/{rel}")
            except DsecError:
                now = None
            if now != data:
                return Verdict(0.0, False, f"hidden test {rel} was modified during judging")
        if self.require_marker:
            lines = res.stdout.decode(errors="replace").rstrip("\n").rsplit("\n", 1)
            if lines[-1] != f"DSEC-PASS {nonce}":
                return Verdict(0.0, False, f"verifier exit {res.exit_code} without the pass "
                                           "marker (the harness did not finish its checks)")
        reward = min(1.0, max(0.0, float(self.score(res))))
        detail = f"verifier exit {res.exit_code}" + (" (timed out)" if res.timed_out else "")
        return Verdict(reward, reward > 0 and reward >= 1.0, detail)
