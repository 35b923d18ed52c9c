"""``dsec sandbox fs ls|stat|mkdir|mv|rm|watch ID PATH...`` (issue 19, "Files"): the
SDK's ``sb.files`` calls from the shell (``dsec sandbox cp`` moves the bytes). Each is one
operation of the catalogue, so the rules are the SDK's: reads and watches of a paused
sandbox leave it paused, writes resume it (docs/sdk.md, "Paused sandboxes").

Registered on the ``sandbox`` group through :data:`dsec.cli.main.EXTENSIONS`.
"""

from __future__ import annotations

import stat as _stat
import sys
import time

import click

from dsec.cli.sandbox import _table, client, conn_options, emit_json

__all__ = ["fs", "register"]


def _row(f: object) -> list[str]:
    t = getattr(f, "type", "")
    mode = _stat.filemode(getattr(f, "mode", 0) | {"dir": _stat.S_IFDIR,
                                                    "symlink": _stat.S_IFLNK}.get(t, 0))
    when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(getattr(f, "mtime", 0.0)))
    name = getattr(f, "path", "")
    target = getattr(f, "link_target", None)
    return [mode, str(getattr(f, "size", 0)), when, name + (f" -> {target}" if target else "")]


@click.group("fs")
def fs() -> None:
    """Files inside a sandbox: list, stat, mkdir, move, remove, watch (copy: `cp`)."""


@fs.command("ls")
@click.argument("sandbox_id")
@click.argument("path", default="/")
@conn_options
def ls(sandbox_id: str, path: str, url: str | None, api_key: str | None,
       as_json: bool) -> None:
    """List directory PATH (default /)."""
    with client(url, api_key) as c:
        items = c.sandboxes.get(sandbox_id).files.list(path)
    if as_json:
        emit_json(items)
    else:
        _table(f"{sandbox_id}:{path}", ["mode", "size", "mtime (UTC)", "path"],
               [_row(f) for f in items])


@fs.command("stat")
@click.argument("sandbox_id")
@click.argument("path")
@conn_options
def stat(sandbox_id: str, path: str, url: str | None, api_key: str | None,
         as_json: bool) -> None:
    """One entry's type, size, mode and mtime; exits 1 naming it if it does not exist."""
    with client(url, api_key) as c:
        info = c.sandboxes.get(sandbox_id).files.stat(path)
    if as_json:
        emit_json(info)
    else:
        _table(f"{sandbox_id}:{path}", ["mode", "size", "mtime (UTC)", "path"], [_row(info)])


@fs.command("mkdir")
@click.argument("sandbox_id")
@click.argument("path")
@click.option("--no-parents", is_flag=True, help="Refuse if the parent is missing.")
@conn_options
def mkdir(sandbox_id: str, path: str, no_parents: bool, url: str | None,
          api_key: str | None, as_json: bool) -> None:
    """Create directory PATH (and its missing parents, like mkdir -p)."""
    with client(url, api_key) as c:
        c.sandboxes.get(sandbox_id).files.mkdir(path, parents=not no_parents)
    emit_json({"created": path}) if as_json else None


@fs.command("mv")
@click.argument("sandbox_id")
@click.argument("src")
@click.argument("dst")
@click.option("-f", "--force", is_flag=True, help="Replace an existing DST.")
@conn_options
def mv(sandbox_id: str, src: str, dst: str, force: bool, url: str | None,
       api_key: str | None, as_json: bool) -> None:
    """Rename SRC to DST inside the sandbox (an existing DST is refused without -f)."""
    with client(url, api_key) as c:
        info = c.sandboxes.get(sandbox_id).files.rename(src, dst, overwrite=force)
    emit_json(info) if as_json else None


@fs.command("rm")
@click.argument("sandbox_id")
@click.argument("path")
@click.option("-r", "--recursive", is_flag=True, help="Remove a directory and its contents.")
@conn_options
def rm(sandbox_id: str, path: str, recursive: bool, url: str | None, api_key: str | None,
       as_json: bool) -> None:
    """Remove PATH (a directory needs -r)."""
    with client(url, api_key) as c:
        c.sandboxes.get(sandbox_id).files.remove(path, recursive=recursive)
    emit_json({"removed": path}) if as_json else None


@fs.command("watch")
@click.argument("sandbox_id")
@click.argument("path")
@click.option("-r", "--recursive", is_flag=True, help="Subdirectories too.")
@click.option("--timeout", type=float, default=None,
              help="Stop after this many seconds (default: until Ctrl-C or PATH is gone).")
@conn_options
def watch(sandbox_id: str, path: str, recursive: bool, timeout: float | None,
          url: str | None, api_key: str | None, as_json: bool) -> None:
    """Print changes below directory PATH as they happen (inotify inside the sandbox):
    one line per event, `TYPE PATH` (--json: one JSON object per line)."""
    import json

    import msgspec

    with client(url, api_key) as c:
        for ev in c.sandboxes.get(sandbox_id).files.watch(path, recursive=recursive,
                                                            timeout=timeout):
            if as_json:
                sys.stdout.write(json.dumps(msgspec.to_builtins(ev)) + "\n")
            else:
                from dsec.logs import escape_text
                sys.stdout.write(f"{ev.type} {escape_text(ev.path)}\n")
            sys.stdout.flush()


def register(group: click.Group) -> None:
    group.add_command(fs)
