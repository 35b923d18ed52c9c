"""``dsec sandbox shell ID``: an interactive terminal in a sandbox.

The shell is a PTY process of the sandbox (``sb.pty.create``): the local terminal goes
into raw mode (every key, Ctrl-C included, goes to the sandbox's terminal, whose line
discipline turns ^C into SIGINT for *its* foreground process group), output is written
as it comes, a SIGWINCH resizes the sandbox's terminal, and the command exits with the
shell's exit code, the local terminal restored whatever happens.

Registered on the ``sandbox`` group through :data:`dsec.cli.main.EXTENSIONS` (this module
imports :mod:`dsec.cli.sandbox`, so sandbox.py must not import it back). Piped stdin for
``exec`` lives in :mod:`dsec.cli.stdio`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import termios
import tty

import click

from dsec.cli.sandbox import conn_options
from dsec.cli.stdio import CHUNK
from dsec.wire.spec import ExecChunk

__all__ = ["register", "shell"]


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
                while not keys.empty() and len(data) < CHUNK:   # coalesce a paste
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


@click.command("shell")
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


def register(group: click.Group) -> None:
    group.add_command(shell)
