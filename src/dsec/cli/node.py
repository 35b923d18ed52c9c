"""``dsec node ls``: edge nodes with their usage."""

from __future__ import annotations

import time

import click

from dsec.cli.sandbox import _table, client, conn_options, emit_json


@click.group()
def node() -> None:
    """Inspect edge nodes."""


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
           ["node", "healthy", "backends", "sandboxes", "cpu used/total", "memory used/total",
            "states", "heartbeat"],
           [[n.id, "yes" if n.healthy else "NO", ",".join(n.backends),
             f"{n.sandboxes}/{n.max_sandboxes}",
             f"{n.cpu_milli_used / 1000:g}/{n.cpu_milli_total / 1000:g}",
             f"{n.memory_bytes_used / 2**30:.1f}/{n.memory_bytes_total / 2**30:.1f} GiB",
             " ".join(f"{k}={v}" for k, v in sorted(n.by_state.items())),
             f"{now - n.last_heartbeat:.1f}s ago" if n.last_heartbeat else "never"]
            for n in nodes])
