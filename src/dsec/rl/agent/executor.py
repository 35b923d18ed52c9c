"""Run the agent's typed tool actions in a sandbox and turn the results into observations.

``bash`` is one exec (shell string, the task's work dir, a timeout of at most
``ToolConfig.command_timeout_s``, output capped); ``read_file``/``write_file`` go through the
file API (no shell the agent could have replaced); ``str_replace`` reads the file, checks
that ``old_str`` occurs exactly once, and writes it back. Failures the agent caused (a
missing file, a non-unique ``old_str``) are observations; a failed *operation* (the
sandbox is gone, the node unreachable) raises its :class:`~dsec.errors.DsecError`, which the
engine records as an infrastructure error.
"""

from __future__ import annotations

import posixpath
import time
from dataclasses import dataclass
from typing import Protocol

from dsec.errors import DsecError, InvalidArgument, PayloadTooLarge
from dsec.rl.access import is_infra_error
from dsec.rl.agent.tools import Action, Bash, ReadFile, StrReplace, Submit, WriteFile
from dsec.wire.spec import ExecRequest, ExecResult

__all__ = ["ToolConfig", "ToolOutcome", "ToolSandbox", "format_exec", "run_action"]


class ToolSandbox(Protocol):
    """The sandbox operations a tool needs (:class:`~dsec.rl.agent.sandboxes.ClientSandboxes`
    has them)."""

    async def exec(self, sid: str, req: ExecRequest) -> ExecResult: ...

    async def write_file(self, sid: str, path: str, data: bytes, *, mode: int = 0o644
                         ) -> None: ...

    async def mkdir(self, sid: str, path: str) -> None: ...

    async def read_file(self, sid: str, path: str, *, length: int | None = None) -> bytes: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolConfig:
    """How tools run. Sizes in characters/bytes, times in seconds."""

    workdir: str = "/workspace"           # cwd of bash, base of relative paths
    command_timeout_s: float = 30.0       # a bash call's cap (the model may ask for less)
    output_cap_bytes: int = 64 * 1024     # per stream, per command
    max_observation_chars: int = 8192     # what the model sees of one tool result
    max_file_bytes: int = 1 << 20         # read_file / str_replace limit
    user: str | None = None               # run bash as this user (None: the sandbox's)
    env: tuple[tuple[str, str], ...] = ()
    # Top-level entries of the sandbox root the agent never reaches, even as root
    # (ExecRequest.hide: Landlock on the command's whole tree). With it set, the file tools
    # run as such confined commands too, not through the file API. E.g. (".dsec-judge",)
    # for a harness or an in-place judge living in the agent's sandbox. Needs native
    # container sandboxes.
    hide: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.workdir.startswith("/"):
            raise InvalidArgument(f"ToolConfig.workdir={self.workdir!r} must be absolute")
        if not self.command_timeout_s > 0:
            raise InvalidArgument(f"command_timeout_s={self.command_timeout_s} must be > 0")
        if self.max_observation_chars < 64:
            raise InvalidArgument(f"max_observation_chars={self.max_observation_chars} is "
                                  "too small to carry an error message (>= 64)")


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    observation: str
    exit_code: int | None = None
    submitted: bool = False
    answer: str | None = None
    error: str | None = None              # the agent's mistake (e.g. "file_not_found")
    started_at: float | None = None       # monotonic, just before the command was sent


def cut(text: str, limit: int) -> str:
    """At most ``limit`` characters, saying when something was cut."""
    if len(text) <= limit:
        return text
    marker = f"\n[... {len(text) - limit} more characters cut]"
    return text[: max(0, limit - len(marker))] + marker


def format_exec(res: ExecResult, limit: int) -> str:
    """stdout + stderr (UTF-8, undecodable bytes as U+FFFD) and ``[exit N]``/``[timed out]``."""
    out = res.stdout.decode("utf-8", "replace") + res.stderr.decode("utf-8", "replace")
    if res.stdout_truncated or res.stderr_truncated:
        out += "\n[output truncated]"
    tail = "[timed out]" if res.timed_out else f"[exit {res.exit_code}]"
    if out and not out.endswith("\n"):
        out += "\n"
    return cut(out, limit - len(tail)) + tail


def _path(cfg: ToolConfig, path: str) -> str:
    if not path or "\0" in path:
        raise InvalidArgument(f"invalid path {path!r}")
    return posixpath.normpath(posixpath.join(cfg.workdir, path))


async def run_action(sb: ToolSandbox, sid: str, action: Action, cfg: ToolConfig
                     ) -> ToolOutcome:
    """Carry out ``action`` in sandbox ``sid``. Raises DsecError only for failed operations
    (infrastructure); everything the agent got wrong is in the outcome."""
    lim = cfg.max_observation_chars
    if isinstance(action, Submit):
        return ToolOutcome("submitted", submitted=True, answer=action.answer)
    if isinstance(action, Bash):
        t = cfg.command_timeout_s if action.timeout_s is None \
            else max(0.001, min(action.timeout_s, cfg.command_timeout_s))
        try:
            req = ExecRequest(shell=action.command, cwd=cfg.workdir, timeout_s=t,
                              output_cap_bytes=cfg.output_cap_bytes, user=cfg.user,
                              env=dict(cfg.env), hide=cfg.hide)
        except InvalidArgument as exc:
            return ToolOutcome(f"command refused: {exc}", error="bad_command")
        started = time.monotonic()
        res = await sb.exec(sid, req)
        return ToolOutcome(format_exec(res, lim), exit_code=res.exit_code, started_at=started)
    try:
        path = _path(cfg, action.path)
    except InvalidArgument as exc:
        return ToolOutcome(str(exc), error="bad_path")
    if isinstance(action, ReadFile):
        data = await _read(sb, sid, path, cfg)
        if isinstance(data, ToolOutcome):
            return data
        return ToolOutcome(cut(data.decode("utf-8", "replace"), lim))
    if isinstance(action, WriteFile):
        failed = await _write(sb, sid, path, action.content.encode(), cfg)
        return failed or ToolOutcome(f"wrote {len(action.content.encode())} bytes to {path}")
    assert isinstance(action, StrReplace)
    if not action.old_str:
        return ToolOutcome("str_replace needs a non-empty old_str", error="bad_arguments")
    data = await _read(sb, sid, path, cfg)
    if isinstance(data, ToolOutcome):
        return data
    text = data.decode("utf-8", "replace")
    n = text.count(action.old_str)
    if n != 1:
        return ToolOutcome(f"old_str occurs {n} times in {path}; it must occur exactly once "
                           "(add surrounding lines to make it unique)", error="not_unique"
                           if n else "not_found")
    failed = await _write(sb, sid, path, text.replace(action.old_str, action.new_str,
                                                      1).encode(), cfg)
    return failed or ToolOutcome(f"replaced 1 occurrence in {path}")


async def _confined(sb: ToolSandbox, sid: str, cfg: ToolConfig, argv: tuple[str, ...],
                    stdin: bytes = b"", cap: int = 1 << 20) -> ExecResult | ToolOutcome:
    """A file operation as a command under ``cfg.hide`` (what the agent may reach)."""
    res = await sb.exec(sid, ExecRequest(argv=argv, stdin=stdin, cwd=cfg.workdir,
                                         user=cfg.user, hide=cfg.hide, output_cap_bytes=cap,
                                         timeout_s=cfg.command_timeout_s))
    if res.exit_code != 0 or res.timed_out:
        why = res.stderr.decode("utf-8", "replace").strip() or f"exit {res.exit_code}"
        return ToolOutcome(f"{argv[-1]}: {why[:300]}", error="file_error")
    return res


async def _read(sb: ToolSandbox, sid: str, path: str, cfg: ToolConfig) -> bytes | ToolOutcome:
    if cfg.hide:
        r = await _confined(sb, sid, cfg, ("cat", "--", path), cap=cfg.max_file_bytes + 1)
        if isinstance(r, ToolOutcome):
            return r
        if r.stdout_truncated or len(r.stdout) > cfg.max_file_bytes:
            return ToolOutcome(f"{path} is larger than {cfg.max_file_bytes} bytes",
                               error="file_too_large")
        return r.stdout
    try:
        data = await sb.read_file(sid, path, length=cfg.max_file_bytes + 1)
    except DsecError as exc:
        if is_infra_error(exc):
            raise
        if isinstance(exc, PayloadTooLarge):
            return ToolOutcome(f"{path} is larger than {cfg.max_file_bytes} bytes",
                               error="file_too_large")
        return ToolOutcome(f"cannot read {path}: {exc.message}", error="file_error")
    if len(data) > cfg.max_file_bytes:
        return ToolOutcome(f"{path} is larger than {cfg.max_file_bytes} bytes; read it in "
                           "parts with bash (head, sed -n)", error="file_too_large")
    return data


async def _write(sb: ToolSandbox, sid: str, path: str, data: bytes,
                 cfg: ToolConfig) -> ToolOutcome | None:
    """Write ``data`` (making missing parents); an outcome saying what failed, or None."""
    if cfg.hide:
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
        r = await _confined(sb, sid, cfg, ("sh", "-c", script, "sh", path), stdin=data)
        return r if isinstance(r, ToolOutcome) else None
    try:
        await sb.write_file(sid, path, data)
        return None
    except DsecError as exc:
        if is_infra_error(exc):
            raise
    try:
        await sb.mkdir(sid, posixpath.dirname(path))
        await sb.write_file(sid, path, data)
    except DsecError as exc:
        if is_infra_error(exc):
            raise
        return ToolOutcome(f"cannot write {path}: {exc.message}", error="file_error")
    return None
