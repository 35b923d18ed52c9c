"""``dsec node ls|drain|undrain``: edge nodes with their usage, and taking one out of
placement for maintenance."""

from __future__ import annotations

import time

import click

from dsec.cli.sandbox import _table, client, conn_options, emit_json


@click.group()
def node() -> None:
    """Inspect and drain edge nodes."""


@node.command("ls")
@conn_options
def ls(url: str | None, api_key: str | None, as_json: bool) -> None:
    """List edge nodes with capacity and usage."""
    with client(url, api_key) as c:
        nodes = c.nodes()
    if as_json:
        emit_json(nodes)
        return
    now = time.time()
    _table(f"{len(nodes)} node(s)",
           ["node", "healthy", "drained", "backends", "sandboxes", "cpu used/total",
            "memory used/total", "states", "heartbeat"],
           [[n.id, "yes" if n.healthy else "NO", "DRAINED" if n.drained else "",
             ",".join(n.backends),
             f"{n.sandboxes}/{n.max_sandboxes}",
             f"{n.cpu_milli_used / 1000:g}/{n.cpu_milli_total / 1000:g}",
             f"{n.memory_bytes_used / 2**30:.1f}/{n.memory_bytes_total / 2**30:.1f} GiB",
             " ".join(f"{k}={v}" for k, v in sorted(n.by_state.items())),
             f"{now - n.last_heartbeat:.1f}s ago" if n.last_heartbeat else "never"]
            for n in nodes])


@node.command("drain")
@click.argument("node_id")
@click.option("--migrate", is_flag=True,
              help="Also move the node's sandboxes elsewhere: each is snapshotted, started "
                   "from the snapshot on another node and ended (reason migrated, naming "
                   "its new id). Safe to run again after an interruption.")
@conn_options
def drain(node_id: str, migrate: bool, url: str | None, api_key: str | None,
          as_json: bool) -> None:
    """Drain NODE_ID: no new sandboxes are placed on it; the ones it holds keep running
    until they end. Superuser only; stored, so it survives apiserver restarts."""
    with client(url, api_key) as c:
        view = c.drain_node(node_id)
        moved = c.migrate_node(node_id) if migrate else None
    if as_json:
        emit_json(moved if moved is not None else view)
        return
    if moved is not None:
        for m in moved.items:
            click.echo(f"{m.sandbox_id} -> {m.new_id}" if not m.error
                       else f"{m.sandbox_id} stays: {m.error}")
        failed = sum(1 for m in moved.items if m.error)
        click.echo(f"node {view.id} drained; {len(moved.items) - failed} sandbox(es) moved"
                   + (f", {failed} left (run it again)" if failed else ""))
        if failed:
            raise SystemExit(1)
        return
    click.echo(f"node {view.id} drained: no new placements; {view.sandboxes} sandbox(es) "
               "there keep running until they end")


@node.command("undrain")
@click.argument("node_id")
@conn_options
def undrain(node_id: str, url: str | None, api_key: str | None, as_json: bool) -> None:
    """Undrain NODE_ID: placement may use it again. Superuser only."""
    with client(url, api_key) as c:
        view = c.undrain_node(node_id)
    if as_json:
        emit_json(view)
        return
    click.echo(f"node {view.id} undrained: placement may use it again")
