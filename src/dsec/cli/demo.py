"""``dsec demo``: what ``make demo`` runs. Grows with the platform."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time

import click
from rich.console import Console
from rich.table import Table


async def _aether_demo(console: Console) -> None:
    from dsec.aether import Router, connect, serve

    router = Router()
    router.add("echo", lambda body: body)
    with tempfile.TemporaryDirectory(prefix="dsec-demo-") as d:
        server = await serve(router, f"unix:{os.path.join(d, 'edge.sock')}")
        conn = await connect(server.address)
        table = Table(title="Aether over a Unix socket (client and server in one process)")
        for col in ("pattern", "calls", "seconds", "calls/s"):
            table.add_column(col, justify="right")
        n = 20_000
        t0 = time.perf_counter()
        for i in range(n // 4):
            await conn.call("echo", i)
        dt = time.perf_counter() - t0
        table.add_row("one at a time", f"{n // 4:,}", f"{dt:.3f}", f"{n / 4 / dt:,.0f}")
        t0 = time.perf_counter()
        for _ in range(n // 64):
            await conn.call_batch([("echo", b"x" * 64)] * 64)
        dt = time.perf_counter() - t0
        table.add_row("call_batch(64)", f"{n // 64 * 64:,}", f"{dt:.3f}", f"{n / dt:,.0f}")
        console.print(table)
        await conn.close()
        await server.close()


@click.command()
def demo() -> None:
    """Run dsec's main job on an embedded single-node default."""
    import uvloop

    console = Console()
    uvloop.run(_aether_demo(console))
