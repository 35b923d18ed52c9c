"""``dsec sandbox shell ID``: an interactive terminal in a sandbox, and stdin for ``exec``.

The shell is a PTY process of the sandbox (``sb.pty.create``): the local terminal goes
into raw mode (every key, Ctrl-C included, goes to the sandbox's terminal, whose line
discipline turns ^C into SIGINT for *its* foreground process group), output is written
as it comes, a SIGWINCH resizes the sandbox's terminal, and the command exits with the
shell's exit code, the local terminal restored whatever happens.

``echo data | dsec sandbox exec ID cat``: when stdin is a pipe or a file, ``exec`` runs
the command as a process with stdin open and streams stdin to it (:func:`exec_with_stdin`),
so input of any size flows with bounded memory and a command that never reads it still
ends the call when it exits. A terminal or ``/dev/null`` on stdin sends nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import stat
import sys
import termios
import tty
from collections.abc import Callable
from typing import Any

import click

from dsec.cli.sandbox import conn_options, sandbox
from dsec.wire.spec import ExecChunk

__all__ = ["exec_piped", "exec_with_stdin", "shell", "stdin_to_forward"]

_CHUNK = 64 << 10


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


async def exec_with_stdin(url: str | None, api_key: str | None, sandbox_id: str,
                          cmd: str | list[str], fd: int, *, timeout: float | None,
                          cwd: str | None, env: dict[str, str],
                          on_stdout: Callable[[bytes], Any],
                          on_stderr: Callable[[bytes], Any]) -> tuple[int, bool]:
    """Run ``cmd`` with stdin streamed from ``fd``; (exit code, timed out)."""
    from dsec.client.core import AsyncClient

    loop = asyncio.get_running_loop()
    async with AsyncClient(url, api_key, session_lease_s=None) as c:
        sb = await c.sandboxes.get(sandbox_id)
        h = await sb.processes.start(cmd, stdin=True, timeout=timeout, cwd=cwd, env=env)

        async def feed() -> None:
            while True:
                data = await loop.run_in_executor(None, os.read, fd, _CHUNK)
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
            async for item in h.stream():
                if isinstance(item, ExecChunk):
                    (on_stdout if item.stream == "stdout" else on_stderr)(item.data)
                else:
                    return item.exit_code, bool(item.timed_out)
        finally:
            feeder.cancel()
    return 1, False


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
        code, timed_out = asyncio.run(exec_with_stdin(
            url, api_key, sandbox_id, cmd, fd, timeout=timeout, cwd=cwd, env=env,
            on_stdout=emit(out, sys.stdout), on_stderr=emit(err, sys.stderr)))
    except DsecError as exc:
        raise click.ClickException(f"{exc.code}: {exc}") from exc
    if as_json:
        sys.stdout.write(json.dumps({"exit_code": code, "stdout": out.decode(errors="replace"),
                                    "stderr": err.decode(errors="replace"),
                                    "timed_out": timed_out}, indent=1) + "\n")
    elif timed_out:
        click.echo(f"command timed out after {timeout:g}s (command timeout)", err=True)
    sys.exit(code)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:
            import select
            select.select([], [fd], [])
            continue
        view = view[n:]


async def _shell(url: str | None, api_key: str | None, sandbox_id: str, cmd: list[str],
                 cwd: str | None, user: str | None, env: dict[str, str]) -> int:
    from dsec.client.core import AsyncClient

    loop = asyncio.get_running_loop()
    fd_in, fd_out = sys.stdin.fileno(), sys.stdout.fileno()
    interactive = os.isatty(fd_in)
    try:
        cols, rows = os.get_terminal_size(fd_out if os.isatty(fd_out) else fd_in)
    except OSError:
        cols, rows = 80, 24
    term = {"TERM": os.environ.get("TERM", "xterm-256color"), **env}
    async with AsyncClient(url, api_key, session_lease_s=None) as c:
        sb = await c.sandboxes.get(sandbox_id)
        h = await sb.pty.create(cols=max(1, min(cols, 1000)), rows=max(1, min(rows, 1000)),
                                cmd=cmd, env=term, cwd=cwd, user=user)
        saved = termios.tcgetattr(fd_in) if interactive else None
        keys: asyncio.Queue[bytes] = asyncio.Queue()
        ended = asyncio.Event()

        def readable() -> None:
            try:
                data = os.read(fd_in, 4096)
            except OSError:
                data = b""
            if not data:
                loop.remove_reader(fd_in)
                keys.put_nowait(b"")
                return
            keys.put_nowait(data)

        async def typing() -> None:
            while True:
                data = await keys.get()
                while not keys.empty() and len(data) < _CHUNK:   # coalesce a paste
                    more = keys.get_nowait()
                    if not more:
                        keys.put_nowait(more)
                        break
                    data += more
                try:
                    if not data:
                        if not interactive:
                            await h.close_stdin()
                        return
                    await h.send_stdin(data)
                except Exception:  # noqa: BLE001 - the shell is gone; output says why
                    return

        def winch() -> None:
            with contextlib.suppress(OSError):
                c2, r2 = os.get_terminal_size(fd_out if os.isatty(fd_out) else fd_in)
                asyncio.ensure_future(h.resize(max(1, min(c2, 1000)), max(1, min(r2, 1000))))

        try:
            if saved is not None:
                tty.setraw(fd_in, termios.TCSANOW)
            loop.add_reader(fd_in, readable)
            if interactive:
                loop.add_signal_handler(signal.SIGWINCH, winch)
            typer = asyncio.ensure_future(typing())
            code = 1
            async for item in h.stream():
                if isinstance(item, ExecChunk):
                    _write_all(fd_out, item.data)
                else:
                    code = item.exit_code
                    break
            ended.set()
            typer.cancel()
            return code
        finally:
            with contextlib.suppress(Exception):
                loop.remove_reader(fd_in)
            if interactive:
                with contextlib.suppress(Exception):
                    loop.remove_signal_handler(signal.SIGWINCH)
            if saved is not None:
                termios.tcsetattr(fd_in, termios.TCSADRAIN, saved)


@sandbox.command("shell")
@click.argument("sandbox_id")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.option("--cwd", default=None, help="Working directory inside the sandbox.")
@click.option("--user", default=None, help="User inside the sandbox.")
@click.option("--env", "env", multiple=True, help="KEY=VALUE, repeatable.")
@conn_options
def shell(sandbox_id: str, command: tuple[str, ...], cwd: str | None, user: str | None,
          env: tuple[str, ...], url: str | None, api_key: str | None, as_json: bool) -> None:
    """An interactive terminal in a sandbox (COMMAND, default /bin/sh); exits with its
    exit code. Ctrl-C goes to the sandbox's foreground process."""
    from dsec.errors import DsecError

    kv = dict(e.partition("=")[::2] for e in env)
    try:
        code = asyncio.run(_shell(url, api_key, sandbox_id, list(command) or ["/bin/sh"],
                                  cwd, user, kv))
    except DsecError as exc:
        raise click.ClickException(f"{exc.code}: {exc}") from exc
    sys.exit(code)
