"""Piped stdin for ``dsec sandbox exec``: ``echo data | dsec sandbox exec ID cat``.

When stdin is a pipe or a file, ``exec`` runs the command as a process with stdin open
and streams stdin to it (:func:`exec_with_stdin`), so input of any size flows with
bounded memory and a command that never reads it still ends the call when it exits. A
terminal or ``/dev/null`` on stdin sends nothing.

Its own module, below :mod:`dsec.cli.sandbox` (which imports it) and beside
:mod:`dsec.cli.shell` (which imports :mod:`dsec.cli.sandbox`): no sibling cycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import sys
from collections.abc import Callable
from typing import Any

import click

from dsec.wire.spec import ExecChunk

__all__ = ["CHUNK", "exec_piped", "exec_with_stdin", "oom_note", "stdin_to_forward"]

CHUNK = 64 << 10


def oom_note(sandbox_id: str) -> str:
    """What ``exec`` says on stderr when its result has ``oom_killed``."""
    return (f"the OOM killer killed a process in sandbox {sandbox_id} while this command ran "
            "(its memory limit was reached; create it with a larger --memory, or see "
            f"`dsec sandbox stats {sandbox_id}`)")


def stdin_to_forward() -> int | bytes | None:
    """What ``exec`` should forward: a descriptor to stream (a pipe, file or socket), the
    bytes of a stdin without one (click's test runner), or None (a terminal, a device
    such as /dev/null, nothing)."""
    try:
        fd = sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else b""
        return data or None
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    if os.isatty(fd) or stat.S_ISCHR(st.st_mode):
        return None
    return fd


async def _oom_kills(sb: Any) -> int | None:
    """The sandbox's OOM kill count now (None: its stats cannot be read)."""
    try:
        return int((await sb.stats()).oom_kills)
    except Exception:  # noqa: BLE001 - stats are a hint here, never a reason to fail
        return None


async def exec_with_stdin(url: str | None, api_key: str | None, sandbox_id: str,
                          cmd: str | list[str], fd: int, *, timeout: float | None,
                          cwd: str | None, env: dict[str, str],
                          on_stdout: Callable[[bytes], Any],
                          on_stderr: Callable[[bytes], Any]) -> tuple[int, bool, bool]:
    """Run ``cmd`` with stdin streamed from ``fd``; (exit code, timed out, OOM killed)."""
    from dsec.client.core import AsyncClient

    loop = asyncio.get_running_loop()
    async with AsyncClient(url, api_key, session_lease_s=None) as c:
        sb = await c.sandboxes.get(sandbox_id)
        # the process table's results carry no oom_killed (exec's do): the sandbox's OOM
        # counter moving while it ran says it, as exec's own check does on the edge
        ooms = await _oom_kills(sb)
        h = await sb.processes.start(cmd, stdin=True, timeout=timeout, cwd=cwd, env=env)

        async def feed() -> None:
            while True:
                data = await loop.run_in_executor(None, os.read, fd, CHUNK)
                if not data:
                    break
                try:
                    await h.send_stdin(data)
                except Exception:  # noqa: BLE001 - it exited: the rest of stdin goes nowhere
                    return
            with contextlib.suppress(Exception):
                await h.close_stdin()

        feeder = asyncio.ensure_future(feed())
        try:
            async with contextlib.aclosing(h.stream()) as items:
                async for item in items:
                    if isinstance(item, ExecChunk):
                        (on_stdout if item.stream == "stdout" else on_stderr)(item.data)
                    else:
                        oom = bool(item.oom_killed) or (
                            ooms is not None and ((await _oom_kills(sb)) or 0) > ooms)
                        return item.exit_code, bool(item.timed_out), oom
        finally:
            feeder.cancel()
    return 1, False, False


def exec_piped(url: str | None, api_key: str | None, sandbox_id: str, cmd: str | list[str],
               fd: int, *, timeout: float | None, cwd: str | None, env: dict[str, str],
               as_json: bool) -> None:
    """``dsec sandbox exec`` with stdin from a pipe or file: stream it, print output as
    it comes (or one JSON object at the end), exit with the command's code."""
    import json

    from dsec.errors import DsecError

    out, err = bytearray(), bytearray()

    def emit(buf: bytearray, stream: Any) -> Callable[[bytes], None]:
        def write(data: bytes) -> None:
            if as_json:
                buf.extend(data)
            else:
                stream.buffer.write(data)
                stream.buffer.flush()
        return write

    try:
        code, timed_out, oom = asyncio.run(exec_with_stdin(
            url, api_key, sandbox_id, cmd, fd, timeout=timeout, cwd=cwd, env=env,
            on_stdout=emit(out, sys.stdout), on_stderr=emit(err, sys.stderr)))
    except DsecError as exc:
        raise click.ClickException(f"{exc.code}: {exc}") from exc
    if as_json:
        sys.stdout.write(json.dumps({"exit_code": code, "stdout": out.decode(errors="replace"),
                                    "stderr": err.decode(errors="replace"),
                                    "timed_out": timed_out, "oom_killed": oom},
                                   indent=1) + "\n")
    else:
        if timed_out:
            click.echo(f"command timed out after {timeout:g}s (command timeout)", err=True)
        if oom:
            click.echo(oom_note(sandbox_id), err=True)
    sys.exit(code)
