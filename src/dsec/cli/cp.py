"""``dsec sandbox cp``: copy a file between this machine and a sandbox, like ``docker
cp``: ``dsec sandbox cp ./data.bin SB:/work/data.bin`` or ``dsec sandbox cp
SB:/work/out.log .``. Files of any size stream (sb.files.upload/download: an upload
replaces the remote file atomically, a download lands in a temporary file renamed into
place), with a progress bar on a terminal. ``-`` is stdin or stdout."""

from __future__ import annotations

import os
import posixpath
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from dsec.cli.sandbox import client, conn_options, emit_json

__all__ = ["cp", "parse_target", "register"]


def parse_target(arg: str) -> tuple[str | None, str]:
    """``ID:/path`` -> (ID, /path); anything else is a local path -> (None, arg). A
    local path with a colon is written ``./a:b`` (as with docker cp)."""
    head, sep, tail = arg.partition(":")
    if sep and head and "/" not in head and head not in (".", ".."):
        if not tail:
            raise click.BadParameter(f"{arg!r}: the path in the sandbox is missing "
                                     f"(write {head}:/path)")
        return head, tail if tail.startswith("/") else "/" + tail
    return None, arg


@contextmanager
def _progress(label: str, total: int | None, quiet: bool) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on a terminal (stderr), nothing otherwise."""
    if quiet or not sys.stderr.isatty():
        yield lambda done: None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(),
                  console=__import__("rich.console").console.Console(stderr=True)) as p:
        task = p.add_task(label, total=total)
        yield lambda done: p.update(task, completed=done)


@click.command("cp")
@click.argument("src")
@click.argument("dst")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@conn_options
def cp(src: str, dst: str, quiet: bool, url: str | None, api_key: str | None,
       as_json: bool) -> None:
    """Copy a file between this machine and a sandbox: SRC and DST are a local path
    (``-``: stdin/stdout) and ``SANDBOX_ID:/path``, either way round."""
    s_id, s_path = parse_target(src)
    d_id, d_path = parse_target(dst)
    if (s_id is None) == (d_id is None):
        raise click.UsageError("one of SRC and DST must be SANDBOX_ID:/path and the other "
                               "a local path (copying between two sandboxes: copy through "
                               "this machine)")
    out: dict[str, Any]
    with client(url, api_key) as c:
        if d_id is not None:
            out = _upload(c, s_path, d_id, d_path, quiet or as_json)
        else:
            assert s_id is not None
            out = _download(c, s_id, s_path, d_path, quiet or as_json)
    if as_json:
        emit_json(out)
    elif not quiet and out.get("to") != "-":
        click.echo(f"copied {out['bytes']} bytes to {out['to']}", err=True)


def _upload(c: Any, local: str, sid: str, remote: str, quiet: bool) -> dict[str, Any]:
    sb = c.sandboxes.get(sid)
    if local != "-" and os.path.isdir(local):
        raise click.UsageError(f"{local!r} is a directory: cp copies one file (for a tree: "
                               f"tar it, copy the tar, untar it with dsec sandbox exec)")
    if remote.endswith("/") or _is_dir(sb, remote):
        remote = posixpath.join(remote, os.path.basename(local) if local != "-" else "stdin")
    if local == "-":
        with _progress(f"stdin -> {sid}:{remote}", None, quiet) as tick:
            info = sb.files.write(remote, sys.stdin.buffer, progress=tick)
    else:
        try:
            size = os.path.getsize(local)
        except OSError as exc:
            raise click.ClickException(f"cannot read {local!r}: {exc.strerror}") from exc
        with _progress(f"{os.path.basename(local)} -> {sid}:{remote}", size, quiet) as tick:
            info = sb.files.upload(local, remote, progress=tick)
    return {"from": local, "to": f"{sid}:{info.path}", "bytes": info.size}


def _is_dir(sb: Any, remote: str) -> bool:
    from dsec.errors import NotFound
    try:
        return bool(sb.files.stat(remote).type == "dir")
    except NotFound:
        return False


def _download(c: Any, sid: str, remote: str, local: str, quiet: bool) -> dict[str, Any]:
    sb = c.sandboxes.get(sid)
    info = sb.files.stat(remote)
    # a symlink is copied as what it names (the read follows it, inside the sandbox);
    # its stat is the link's own (size: the target's name), so the total is unknown
    # until the read opens the file (red team 21, B5)
    if info.type not in ("file", "symlink"):
        raise click.UsageError(f"{sid}:{remote} is a {info.type}: cp copies one file")
    if local == "-":
        n = 0
        for chunk in sb.files.read(remote, stream=True):
            sys.stdout.buffer.write(chunk)
            n += len(chunk)
        sys.stdout.buffer.flush()
        return {"from": f"{sid}:{remote}", "to": "-", "bytes": n}
    with _progress(f"{sid}:{remote} -> {local}",
                   info.size if info.type == "file" else None, quiet) as tick:
        got = sb.files.download(remote, local, progress=tick)
    dest = os.path.join(local, posixpath.basename(remote)) if os.path.isdir(local) else local
    return {"from": f"{sid}:{remote}", "to": dest, "bytes": got.size}


def register(group: click.Group) -> None:
    """Add ``cp`` to the ``sandbox`` group (:data:`dsec.cli.main.EXTENSIONS`: this module
    imports :mod:`dsec.cli.sandbox`, which must not import it back)."""
    group.add_command(cp)
