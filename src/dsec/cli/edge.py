"""``dsec edge``: run one edge node and serve it over Aether until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import socket
from typing import Any

import click


def _default_node_id() -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", socket.gethostname().lower()).strip("-")
    return name[:63].strip("-") or "edge"


def _mem_total() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def _labels(values: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for v in values:
        k, sep, val = v.partition("=")
        if not sep or not k:
            raise click.BadParameter(f"label {v!r} must look like key=value", param_hint="--label")
        out[k] = val
    return out


def _extra_opts(values: tuple[str, ...], backends: tuple[str, ...]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for v in values:
        target, sep, val = v.partition("=")
        name, dot, key = target.partition(".")
        if not sep or not dot or not key or name not in backends:
            raise click.BadParameter(
                f"{v!r} must look like BACKEND.KEY=VALUE for a backend given with --backend",
                param_hint="--backend-opt")
        out.setdefault(name, {})[key] = val
    return out


def _backend_opts(name: str, profile: str, pool_size: int,
                  state_dir: str | None) -> dict[str, Any]:
    if name == "simulated":
        from dsec.edge.backends.simulated import NodeLatencyProfile

        if profile == "zero":
            prof = NodeLatencyProfile.zero()
        else:
            kind = profile.removeprefix("paper").lstrip("-") or "container"
            prof = NodeLatencyProfile.paper(kind)  # type: ignore[arg-type]
        return {"profile": prof}
    if name == "fncall":
        # Work dirs next to the journal: a restarted edge adopts its fncall sandboxes
        # and reconciles the rest (a temp dir per process could do neither).
        root = {"root": os.path.join(state_dir, "fncall")} if state_dir else {}
        return {"pool_size": pool_size, **root}
    return {}


@click.command()
@click.option("--listen", required=True, metavar="ADDR",
              help="Where to serve Aether: unix:PATH or tcp:HOST:PORT.")
@click.option("--state-dir", type=click.Path(file_okay=False), default=None,
              help="Directory for the sandbox journal (a restarted edge adopts what it "
                   "owned). Without it, records live in memory only.")
@click.option("--journal-sync", type=click.Choice(["fsync", "write", "tick"]), default="fsync",
              show_default=True,
              help="When an answered create/destroy/pause/resume is on disk: fsync before "
                   "the answer (survives kill -9 and power loss), write before it (kill -9 "
                   "only), or tick (up to 50 ms later: a crash loses that tick).")
@click.option("--backend", "backends", multiple=True, default=("simulated",), show_default=True,
              help="Backend to offer (repeatable): simulated, fncall, container, ...")
@click.option("--node-id", default=_default_node_id, show_default="hostname",
              help="This node's id; it is part of every sandbox id it creates.")
@click.option("--cpu-milli", type=int, default=None,
              help="Admitted millicores (default: cores x 1000).")
@click.option("--memory-bytes", type=int, default=None, help="Admitted memory (default: RAM).")
@click.option("--max-sandboxes", type=int, default=1000, show_default=True)
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE",
              help="Node label for placement (repeatable).")
@click.option("--profile", type=click.Choice(["zero", "paper", "paper-container", "paper-fncall",
                                              "paper-microvm"]),
              default="zero", show_default=True, help="Latency profile of the simulated backend.")
@click.option("--fncall-pool-size", type=int, default=8, show_default=True,
              help="Warm Python workers kept by the fncall backend.")
@click.option("--backend-opt", "backend_opts", multiple=True, metavar="BACKEND.KEY=VALUE",
              help="Option for one backend's make_backend (repeatable), e.g. "
                   "container.images_dir=/var/lib/dsec/images. Values are strings.")
@click.option("--token-file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="File holding the secret every Aether connection must present first "
                   "(required with a tcp: listener; the apiserver gets the same file).")
@click.option("--insecure", is_flag=True,
              help="Serve tcp: without a token (anyone who connects can run commands in "
                   "sandboxes): only on a private test network.")
@click.option("--disk-default", default="10GiB", show_default=True, metavar="SIZE",
              help="Disk cap of a container sandbox created without one.")
@click.option("--disk-pool", default=None, metavar="SIZE",
              help="Size of the container backend's sandbox disk pool when first made "
                   "[default: 90% of its root dir's free space].")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def edge(listen: str, state_dir: str | None, journal_sync: str, backends: tuple[str, ...],
         node_id: str,
         cpu_milli: int | None, memory_bytes: int | None, max_sandboxes: int,
         labels: tuple[str, ...], profile: str, fncall_pool_size: int,
         backend_opts: tuple[str, ...], token_file: str | None, insecure: bool,
         disk_default: str, disk_pool: str | None, log_level: str) -> None:
    """Run an edge node: sandboxes on this machine, served over Aether."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from dsec.edge.admission import Capacity
    from dsec.edge.backends import make_backend
    from dsec.edge.node import NodeConfig
    from dsec.errors import DsecError

    try:
        if state_dir is not None:
            from dsec.statedir import ensure_private_dir
            # 0700 even when it existed: journals, sandbox records (with their env).
            state_dir = ensure_private_dir(state_dir)
        cfg = NodeConfig(
            node_id=node_id,
            capacity=Capacity(cpu_milli=cpu_milli if cpu_milli is not None else (os.cpu_count() or 1) * 1000,
                              memory_bytes=memory_bytes if memory_bytes is not None else _mem_total(),
                              max_sandboxes=max_sandboxes),
            labels=_labels(labels), state_dir=state_dir,
            journal_sync=journal_sync)  # type: ignore[arg-type]
        extra = _extra_opts(backend_opts, backends)
        from dsec.client.core import parse_memory
        disk: dict[str, Any] = {"default_disk_bytes": parse_memory(disk_default),
                                "disk_pool_bytes": None if disk_pool is None
                                else parse_memory(disk_pool)}
        for name in backends:
            if name == "container":
                extra[name] = {**disk, **extra.get(name, {})}
        built = {name: make_backend(name, **{**_backend_opts(name, profile, fncall_pool_size,
                                                             state_dir),
                                              **extra.get(name, {})})
                 for name in dict.fromkeys(backends)}
    except DsecError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        import uvloop

        token = None
        if token_file is not None:
            with open(token_file, "rb") as f:
                token = f.read().strip()
            if len(token) < 16:
                raise click.BadParameter(f"{token_file} holds {len(token)} bytes; use a random "
                                         "secret of at least 16", param_hint="--token-file")
        uvloop.run(_serve(cfg, built, listen, token, insecure))
    except DsecError as exc:
        raise click.ClickException(str(exc)) from exc


async def _serve(cfg: Any, backends: dict[str, Any], listen: str, token: bytes | None,
                 insecure: bool) -> None:
    from dsec.edge.node import EdgeNode
    from dsec.edge.service import serve_edge

    log = logging.getLogger("dsec.edge")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with EdgeNode(cfg, backends) as node:
        server = await serve_edge(node, listen, token=token, insecure=insecure)
        log.info("edge %s serving %s on %s (%d sandboxes adopted)", cfg.node_id,
                 ",".join(sorted(backends)), server.address, node.live_count)
        click.echo(f"edge {cfg.node_id} listening on {server.address}", err=True)
        try:
            await stop.wait()
        finally:
            await server.close()
    log.info("edge %s stopped", cfg.node_id)
