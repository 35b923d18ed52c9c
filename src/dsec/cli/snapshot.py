"""``dsec snapshot ls|get|rm``: the snapshots of a cluster, through the API.

Snapshots are taken with ``dsec sandbox snapshot ID`` and used with
``dsec sandbox create --snapshot ID``. They live in the layer store of the node that took
them (``dsec image ls`` on that machine shows them as ``snapshot`` layers)."""

from __future__ import annotations

import datetime

import click

from dsec.cli.sandbox import _table, client, conn_options, emit_json

__all__ = ["snapshot"]

_COLS = ["id", "parent", "sandbox", "project", "image", "size", "created", "nodes"]


def _row(s: object) -> list[str]:
    v = s.view  # type: ignore[attr-defined]
    image = v.image + "".join(f"+{t}" for t in v.toolkits)
    return [v.id[:19], (v.parent or "-")[:19], v.sandbox_id, v.project, image,
            f"{v.size_bytes / 1024:.1f} KiB",
            datetime.datetime.fromtimestamp(v.created_at).strftime("%Y-%m-%d %H:%M:%S"),
            ",".join(v.nodes)]


@click.group()
def snapshot() -> None:
    """List, inspect and delete sandbox snapshots."""


@snapshot.command("ls")
@click.option("--project", default=None, help="Only this project (and its subprojects).")
@click.option("--sandbox", "sandbox_id", default=None, help="Only snapshots of this sandbox.")
@conn_options
def ls(project: str | None, sandbox_id: str | None, url: str | None, api_key: str | None,
       as_json: bool) -> None:
    """List snapshots visible to the API key, oldest first."""
    with client(url, api_key) as c:
        snaps = c.snapshots.list(project=project, sandbox_id=sandbox_id)
    if as_json:
        emit_json([s.view for s in snaps])
    else:
        _table("snapshots", _COLS, [_row(s) for s in snaps])


@snapshot.command("get")
@click.argument("snapshot_id")
@conn_options
def get(snapshot_id: str, url: str | None, api_key: str | None, as_json: bool) -> None:
    """Show one snapshot (a unique id prefix of >= 12 hex digits works)."""
    with client(url, api_key) as c:
        s = c.snapshots.get(snapshot_id)
    if as_json:
        emit_json(s.view)
    else:
        _table(s.id, _COLS, [_row(s)])


@snapshot.command("rm")
@click.argument("snapshot_ids", nargs=-1, required=True)
@conn_options
def rm(snapshot_ids: tuple[str, ...], url: str | None, api_key: str | None,
       as_json: bool) -> None:
    """Delete snapshots (refused while a sandbox runs from one or a snapshot builds on it:
    delete children first)."""
    with client(url, api_key) as c:
        for sid in snapshot_ids:
            c.snapshots.delete(sid)
    emit_json({"removed": list(snapshot_ids)}) if as_json else click.echo(
        f"removed {len(snapshot_ids)} snapshot(s)")
