"""``dsec up``: a complete single-node cluster in the foreground.

apiserver (REST + Aether gateway) + control plane (SQLite state, placement, watcher,
sweeper) + one edge, with a one-line status. Ctrl-C / SIGTERM stops it cleanly: every
sandbox is destroyed (no process, mount or cgroup left), unless ``--keep`` leaves them
for the next ``dsec up`` to re-adopt. Connection details go to ``<state-dir>/local.json``,
which the SDK and the CLI read when ``DSEC_URL`` is not set.
"""

from __future__ import annotations

import asyncio
import signal

import click


@click.command()
@click.option("--state-dir", type=click.Path(file_okay=False), default=None,
              help="Where state lives (default $DSEC_STATE_DIR or ~/.dsec).")
@click.option("--listen", default="127.0.0.1:8470", show_default=True,
              help="REST address HOST:PORT (port 0 picks a free one).")
@click.option("--gateway", default="tcp:127.0.0.1:0", show_default=True,
              help="Aether gateway address ('off' to disable).")
@click.option("--backend", type=click.Choice(["container", "simulated", "fncall"]),
              default="simulated", show_default=True, help="Default sandbox backend.")
@click.option("--edges", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Edge nodes to run (each on its own Unix socket).")
@click.option("--keep", is_flag=True, help="On exit, leave sandboxes running for re-adoption.")
@click.option("--disk-default", default="10GiB", show_default=True, metavar="SIZE",
              help="Disk cap of a container sandbox created without one.")
@click.option("--disk-pool", default=None, metavar="SIZE",
              help="Size of each edge's sandbox disk pool when first made "
                   "[default: 90% of the state dir's free space].")
@click.option("--node-ttl", type=click.FloatRange(min=0, min_open=True), default=10.0,
              show_default=True, metavar="SECONDS",
              help="An edge silent this long is lost: its sandboxes are evicted (node_lost). "
                   "Restart (upgrade) an edge within it to keep them.")
@click.option("--quiet", is_flag=True, help="No status line.")
def up(state_dir: str | None, listen: str, gateway: str, backend: str, edges: int,
       keep: bool, disk_default: str, disk_pool: str | None, node_ttl: float,
       quiet: bool) -> None:
    """Run a single-machine dsec cluster in the foreground."""
    import uvloop

    from dsec.client.core import parse_memory
    from dsec.control.api.cluster import ClusterConfig, default_state_dir
    from dsec.control.api.plane import PlaneConfig
    from dsec.errors import DsecError

    try:
        disk = parse_memory(disk_default)
        pool = None if disk_pool is None else parse_memory(disk_pool)
    except DsecError as exc:
        raise click.BadParameter(str(exc), param_hint="--disk-default/--disk-pool") from exc
    cfg = ClusterConfig(state_dir=state_dir or default_state_dir(), listen=listen,
                        gateway=None if gateway == "off" else gateway, backend=backend,
                        edges=edges, keep=keep, disk_default_bytes=disk,
                        disk_pool_bytes=pool, plane=PlaneConfig(node_ttl_s=node_ttl))
    uvloop.run(_run(cfg, quiet))


async def _run(cfg: object, quiet: bool) -> None:
    from rich.console import Console

    from dsec.control.api.cluster import ClusterRuntime

    console = Console(stderr=True)
    rt = ClusterRuntime(cfg)  # type: ignore[arg-type]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await rt.start()
    except Exception as exc:
        console.print(f"[red]dsec up failed:[/red] {exc}")
        raise SystemExit(1) from exc
    if not quiet:
        console.print(f"[bold]dsec up[/bold]  REST {rt.url}  gateway {rt.gateway_address}  "
                      f"state {rt.config.state_dir}")
        console.print(f"admin key: {rt.admin_key}  (also in "
                      f"{rt.config.state_dir}/local.json)")
    try:
        if quiet:
            await stop.wait()
        else:
            with console.status("") as status:
                while not stop.is_set():
                    counts = rt.status()
                    line = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "idle"
                    status.update(f"{len(rt.nodes)} edge(s), backend {rt.config.backend}: "
                                  f"{line}  (Ctrl-C to stop)")
                    try:
                        await asyncio.wait_for(stop.wait(), 1.0)
                    except TimeoutError:
                        pass
    finally:
        n = sum(rt.status().values())
        if not quiet:
            what = "keeping" if rt.config.keep else "destroying"
            console.print(f"stopping: {what} {n} sandbox(es)")
        await rt.stop()
