"""``dsec sandbox ps|attach|signal`` (issue 19, "Processes"): the CLI side of process
handles. ``dsec sandbox exec -d ID CMD`` starts a background process and prints its pid;
``ps`` lists the sandbox's process table (running and ended); ``attach`` connects to a pid
from any shell, at any time, prints what it printed (the edge keeps a bounded ring of it)
and what it prints next, and exits with its exit code; ``signal`` signals it.

Registered on the ``sandbox`` group through :data:`dsec.cli.main.EXTENSIONS`, so it may
import the group's helpers without a sibling cycle.
"""

from __future__ import annotations

import signal as _signal
import sys
import time

import click

from dsec.cli.sandbox import _table, client, conn_options, emit_json

__all__ = ["register", "signal_number"]


def signal_number(name: str) -> int:
    """``TERM``, ``SIGTERM``, ``sigterm`` or ``15`` -> 15; anything else is refused."""
    text = name.strip().upper()
    if text.isdigit():
        n = int(text)
        if 1 <= n <= 64:
            return n
    else:
        try:
            return int(_signal.Signals[text if text.startswith("SIG") else "SIG" + text])
        except KeyError:
            pass
    raise click.BadParameter(f"{name!r} is no signal: give a name (TERM, INT, KILL) or a "
                             "number 1..64", param_hint="--signal")


@click.command("ps")
@click.argument("sandbox_id")
@conn_options
def ps(sandbox_id: str, url: str | None, api_key: str | None, as_json: bool) -> None:
    """The sandbox's background processes and terminals (started with `exec -d`, the SDK's
    processes.start/pty.create, or `dsec sandbox shell`), running and ended, oldest first."""
    with client(url, api_key) as c:
        items = c.sandboxes.get(sandbox_id).processes.list()
    if as_json:
        emit_json(items)
        return
    rows = []
    for p in items:
        cmd = p.cmd if isinstance(p.cmd, str) else " ".join(p.cmd)
        state = "running" if p.running else f"exit {p.exit_code}"
        rows.append([str(p.pid), state, p.tag or "-", "pty" if p.pty else "-",
                     f"{max(time.time() - p.started_at, 0):.0f}s", cmd])
    _table(f"{len(items)} process(es) in {sandbox_id}",
           ["pid", "state", "tag", "tty", "age", "command"], rows)


@click.command("attach")
@click.argument("sandbox_id")
@click.argument("pid", type=int)
@click.option("--timeout", type=float, default=None,
              help="Stop waiting after this many seconds (exit 124; the process runs on).")
@conn_options
def attach(sandbox_id: str, pid: int, timeout: float | None, url: str | None,
           api_key: str | None, as_json: bool) -> None:
    """Print what process PID printed (kept by the edge, up to its ring's size) and what it
    prints until it ends; exit with its exit code. Works from any shell, also after the
    process ended."""
    from dsec.errors import RequestTimeout

    def out(data: bytes) -> None:
        if not as_json:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()

    def err(data: bytes) -> None:
        if not as_json:
            sys.stderr.buffer.write(data)
            sys.stderr.buffer.flush()

    with client(url, api_key) as c:
        h = c.sandboxes.get(sandbox_id).processes.connect(pid, on_stdout=out, on_stderr=err)
        try:
            res = h.wait(timeout=timeout)
        except RequestTimeout:
            click.echo(f"process {pid} still running after {timeout:g}s", err=True)
            sys.exit(124)
    if as_json:
        emit_json({"pid": pid, "exit_code": res.exit_code,
                   "stdout": res.stdout.decode(errors="replace"),
                   "stderr": res.stderr.decode(errors="replace"),
                   "timed_out": res.timed_out, "oom_killed": res.oom_killed})
    sys.exit(res.exit_code)


@click.command("signal")
@click.argument("sandbox_id")
@click.argument("pid", type=int)
@click.option("-s", "--signal", "sig", default="TERM", show_default=True,
              help="Signal name or number.")
@conn_options
def signal_(sandbox_id: str, pid: int, sig: str, url: str | None, api_key: str | None,
            as_json: bool) -> None:
    """Send a signal to process PID's process group (see `dsec sandbox ps`)."""
    num = signal_number(sig)
    with client(url, api_key) as c:
        c.sandboxes.get(sandbox_id).processes.connect(pid).kill(num)
    if as_json:
        emit_json({"pid": pid, "signal": num})
    else:
        try:
            name = _signal.Signals(num).name
        except ValueError:
            name = str(num)
        click.echo(f"{sandbox_id}: sent {name} to process {pid}")


def register(group: click.Group) -> None:
    group.add_command(ps)
    group.add_command(attach)
    group.add_command(signal_)
