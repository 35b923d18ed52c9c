"""``dsec up``: a complete single-machine cluster in the foreground.

apiserver (REST + Aether gateway) + control plane (SQLite state, placement, watcher,
sweeper) in this process, and each edge in a supervised ``dsec edge`` process of its own
(restarted on a crash; it re-adopts its sandboxes), with a one-line status. Ctrl-C /
SIGTERM stops it cleanly: every sandbox is destroyed (no process, mount or cgroup left),
unless ``--keep`` leaves them for the next ``dsec up`` to re-adopt. Connection details go
to ``<state-dir>/local.json``, which the SDK and the CLI read when ``DSEC_URL`` is not
set.
"""

from __future__ import annotations

import asyncio
from typing import Any

import click

from dsec.cli.e2b_options import e2b_banner, e2b_config, e2b_options
from dsec.cli.edge import (
    blob_store_option,
    capacity_options,
    image_budget_option,
    net_default_option,
    net_node_options,
    reply_budget_option,
    secret_in_argv,
)
from dsec.cli.logopts import access_log_option, log_format_option, log_level_option


def _check_tiers(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    """--tiers as the backends of its tiers (dsec.wire.spec.TIER_BACKENDS), refused at
    parse time when it names something else."""
    from dsec.wire.spec import TIER_BACKENDS

    out: list[str] = []
    for t in (x.strip() for x in value.split(",")):
        if not t:
            continue
        if t not in TIER_BACKENDS:
            raise click.BadParameter(f"{t!r} is no isolation tier; use "
                                     f"{', '.join(TIER_BACKENDS)} (comma-separated)")
        out.append(TIER_BACKENDS[t])
    return tuple(dict.fromkeys(out))


@click.command()
@click.option("--state-dir", type=click.Path(file_okay=False), default=None,
              help="Where state lives (default $DSEC_STATE_DIR or ~/.dsec).")
@click.option("--store", "store", default=None, metavar="URL", envvar="DSEC_STORE",
              callback=secret_in_argv,
              help="The state store: sqlite:///path (default: control.sqlite in the state "
                   "dir) or postgresql://user[:password]@host[:port]/db (shared by "
                   "apiserver replicas; env DSEC_STORE).")
@click.option("--listen", default="127.0.0.1:8470", show_default=True,
              help="REST address HOST:PORT (port 0 picks a free one).")
@click.option("--gateway", default="tcp:127.0.0.1:0", show_default=True,
              help="Aether gateway address ('off' to disable).")
@click.option("--backend", type=click.Choice(["container", "simulated", "fncall", "gvisor",
                                              "vm"]),
              default="simulated", show_default=True, help="Default sandbox backend.")
@click.option("--tiers", default="", metavar="TIER[,TIER]", callback=_check_tiers,
              help="Isolation tiers every edge offers besides --backend's: container, "
                   "gvisor, vm (comma-separated; each runs its backend, sharing the "
                   "edge's layer store). A create with isolation=TIER goes to an edge "
                   "offering it (docs/isolation.md).")
@click.option("--edges", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Edge nodes to run (each its own process on its own Unix socket; they "
                   "share the machine's capacity evenly).")
@capacity_options("this machine")
@click.option("--max-sandboxes", type=click.IntRange(1), default=100_000, show_default=True,
              help="Live sandboxes per edge.")
@click.option("--in-process-edges", is_flag=True, hidden=True,
              help="Run the edges inside this process (debugging, profiling).")
@click.option("--keep", is_flag=True, help="On exit, leave sandboxes running for re-adoption.")
@click.option("--profile", type=click.Choice(["zero", "paper", "paper-container", "paper-fncall",
                                              "paper-microvm"]),
              default="zero", show_default=True,
              help="Latency profile of the simulated backend (as `dsec edge --profile`).")
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
@click.option("--registry", "registries", multiple=True, metavar="HOST[:PORT]",
              help="Only pull images from these registries (fnmatch patterns, repeatable; "
                   "default: any but loopback, link-local and private addresses, which "
                   "must be listed, e.g. --registry 127.0.0.1 for a local registry).")
@click.option("--registry-blob-host", "registry_blob_hosts", multiple=True,
              metavar="HOST[:PORT]",
              help="Hosts the listed registries' redirects and token realms may reach (their "
                   "blob CDN, auth service; fnmatch, repeatable). Any other hop is refused.")
@image_budget_option
@net_default_option
@net_node_options
# --- hosts stream (issue 16): a multi-host cluster of test hosts on this machine ---
@click.option("--hosts", type=click.IntRange(1, 64), default=None, metavar="N",
              help="Run N test hosts instead of local edges: network namespaces on a "
                   "private bridge, each with a dsec edge on TCP (own state, layers, "
                   "containers), the apiserver in a namespace of its own (needs root; "
                   "docs/sdk.md 'A multi-host cluster on one machine').")
@click.option("--replicas", type=click.IntRange(1, 8), default=1, show_default=True,
              help="With --hosts: apiserver replicas over one store, behind --listen.")
@blob_store_option
@reply_budget_option
@log_level_option()
@log_format_option
@access_log_option
@click.option("--edge-metrics-port", type=click.IntRange(1, 65535), default=None,
              metavar="PORT", help="Edge i serves its Prometheus metrics at "
              "http://127.0.0.1:<PORT+i>/metrics (dsec edge --metrics-listen) [default: off].")
@e2b_options
def up(state_dir: str | None, store: str | None, listen: str, gateway: str, backend: str,
       tiers: tuple[str, ...], edges: int,
       cpus: float | None, memory: int | None, disk: int | None, cpu_overcommit: float,
       memory_overcommit: float, cpu_milli: int | None, memory_bytes: int | None,
       disk_bytes: int | None, max_sandboxes: int, in_process_edges: bool, keep: bool,
       profile: str, disk_default: str, disk_pool: str | None, node_ttl: float,
       quiet: bool, registries: tuple[str, ...], registry_blob_hosts: tuple[str, ...],
       image_store_budget: Any, net_default: Any, net_max: Any, net_uplink: str | None, net_link: str,
       net_egress: str | None, net_pool: str, net_dns_upstream: tuple[str, ...],
       net_ipv6: str, hosts: int | None, replicas: int, blob_store: str | None,
       reply_budget: Any = None, log_level: str = "warning", log_format: str = "text",
       access_log: str | None = None, edge_metrics_port: int | None = None,
       e2b: str | None = None, e2b_domain: str | None = None,
       e2b_tls_cert: str | None = None, e2b_tls_key: str | None = None) -> None:
    """Run a single-machine dsec cluster in the foreground."""
    from dsec.nofile import raise_nofile  # dens: soft RLIMIT_NOFILE to hard (issue 22)
    raise_nofile()
    logs = (log_level, log_format, access_log)     # issue 19: dsec.logs
    if hosts is not None and blob_store is not None:
        # the test hosts live in their own network namespaces: a loopback blob store
        # of this host is not theirs (and nothing passes the flag to their edges yet)
        raise click.BadParameter("not with --hosts yet", param_hint="--blob-store")
    if hosts is not None:
        from dsec.logs import configure
        configure(log_level, log_format, access_log=access_log)
        _up_hosts(hosts=hosts, replicas=replicas, state_dir=state_dir, store=store,
                  listen=listen,
                  backend=backend, edges=edges, node_ttl=node_ttl, quiet=quiet,
                  profile=profile, max_sandboxes=max_sandboxes, tiers=tiers,
                  net_uplink=net_uplink, in_process_edges=in_process_edges)
        return
    if replicas != 1:
        raise click.BadParameter("only with --hosts", param_hint="--replicas")
    import uvloop

    from dsec.client.core import parse_memory
    from dsec.cluster.runtime import ClusterConfig
    from dsec.control.api.plane import PlaneConfig
    from dsec.edge.admission import Overcommit
    from dsec.errors import DsecError
    from dsec.statedir import default_state_dir

    try:
        default_disk = parse_memory(disk_default)
        pool = None if disk_pool is None else parse_memory(disk_pool)
    except DsecError as exc:
        raise click.BadParameter(str(exc), param_hint="--disk-default/--disk-pool") from exc
    if net_uplink is not None and backend != "container":
        raise click.BadParameter("needs --backend container (the network router serves "
                                 "container sandboxes)", param_hint="--net-uplink")
    if net_egress is not None and net_uplink != "host":
        raise click.BadParameter("only with --net-uplink host", param_hint="--net-egress")
    cfg = ClusterConfig(
        state_dir=state_dir or default_state_dir(), store=store, listen=listen,
        gateway=None if gateway == "off" else gateway, backend=backend, tiers=tiers,
        edges=edges, edge_processes=not in_process_edges, keep=keep,
        cpu_milli=cpu_milli or (round(cpus * 1000) if cpus is not None else None),
        memory_bytes=memory_bytes or memory, disk_bytes=disk_bytes or disk,
        overcommit=Overcommit(cpu=cpu_overcommit, memory=memory_overcommit),
        edge_max_sandboxes=max_sandboxes, disk_default_bytes=default_disk,
        disk_pool_bytes=pool, plane=PlaneConfig(node_ttl_s=node_ttl),
        simulated_profile=profile, net_default=net_default, net_max=net_max,
        net_uplink=net_uplink, net_link=net_link, net_egress=net_egress, net_pool=net_pool,
        net_dns_upstream=net_dns_upstream, net_ipv6=net_ipv6,
        image_store_budget=image_store_budget, registries=tuple(registries) or None,
        registry_blob_hosts=tuple(registry_blob_hosts), blob_store=blob_store,
        reply_budget=reply_budget, edge_log_level=log_level, edge_log_format=log_format,
        edge_metrics_port=edge_metrics_port,
        **e2b_config(e2b, e2b_domain, e2b_tls_cert, e2b_tls_key))
    uvloop.run(_run(cfg, quiet, logs))


def _sizes(rt: Any) -> str:
    from dsec.wire.node import format_bytes, format_cpu

    cap, host = rt.capacity, rt.host
    if cap is None or host is None:
        return ""
    oc = rt.config.overcommit
    per = f" each ({len(rt.node_ids)} edges share it)" if len(rt.node_ids) > 1 else ""
    return (f"machine {format_cpu(host.cpu_milli)}, {format_bytes(host.memory_bytes)}; "
            f"admits {format_cpu(cap.cpu_milli)} (cpu x{oc.cpu:g}) and "
            f"{format_bytes(cap.memory_bytes)} (memory x{oc.memory:g}){per}")


def export_lines(url: str, api_key: str) -> None:
    """The cluster's address and admin key as shell ``export`` lines on stdout (the
    banner is on stderr), for another shell: paste them, or
    ``eval "$(grep ^export up.out)"``."""
    import shlex
    import sys

    sys.stdout.write(f"export DSEC_URL={shlex.quote(url)}\n"
                     f"export DSEC_API_KEY={shlex.quote(api_key)}\n")
    sys.stdout.flush()


def _log_to(console: Any, level: str = "warning", fmt: str = "text",
            access_log: str | None = None) -> None:
    """Warnings (and the supervisor's restart notes) print above the status line, with
    their time and level (``--log-format json``: JSON lines on stderr instead)."""
    import logging

    from rich.logging import RichHandler

    from dsec.logs import configure

    if fmt == "json":
        configure(level, "json", access_log=access_log)
    else:
        handler = RichHandler(console=console, show_path=False, markup=False,
                              rich_tracebacks=False, log_time_format="%Y-%m-%dT%H:%M:%S")
        configure(level, "text", access_log=access_log, handler=handler)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))  # rich: time, level
    if logging.getLogger().level > logging.INFO:
        logging.getLogger("dsec.supervisor").setLevel(logging.INFO)


async def _run(cfg: Any, quiet: bool,
               logs: tuple[str, str, str | None] = ("warning", "text", None)) -> None:
    from rich.console import Console
    from rich.markup import escape

    from dsec.cluster.run import run_until_signalled

    console = Console(stderr=True)
    _log_to(console, *logs)

    def failed(exc: Exception) -> None:
        console.print(f"[red]dsec up failed:[/red] {escape(str(exc))}")

    def started(rt: Any) -> None:
        if quiet:
            return
        console.print(f"[bold]dsec up[/bold]  REST {rt.url}  gateway {rt.gateway_address}  "
                      f"state {rt.config.state_dir}")
        console.print(f"admin key: {rt.admin_key}  (also in "
                      f"{rt.config.state_dir}/local.json)")
        console.print(_sizes(rt))
        export_lines(rt.url, rt.admin_key)
        if (banner := e2b_banner(rt)) is not None:
            console.print(banner, markup=False, highlight=False)

    async def serve(rt: Any, stop: asyncio.Event) -> None:
        if quiet:
            await stop.wait()
            return
        with console.status("") as status:
            while not stop.is_set():
                counts = rt.status()
                line = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "idle"
                states = rt.edge_states()
                odd = ", ".join(f"{n} {s}" for n, s in states.items() if s != "running")
                status.update(f"{len(rt.node_ids)} edge(s){f' ({odd})' if odd else ''}, "
                              f"backend {rt.config.backend}"
                              + "".join(f" +{t}" for t in rt.config.tiers)
                              + f": {line}  (Ctrl-C to stop)")
                try:
                    async with asyncio.timeout(1.0):
                        await stop.wait()
                except TimeoutError:
                    pass

    async def stopping(rt: Any) -> None:
        await rt.refresh()
        n = sum(rt.status().values())
        if not quiet:
            what = "keeping" if rt.config.keep else "destroying"
            console.print(f"stopping: {what} {n} sandbox(es)")

    await run_until_signalled(cfg, failed=failed, started=started, serve=serve,
                              stopping=stopping)


def _up_hosts(*, hosts: int, replicas: int, state_dir: str | None, store: str | None,
              listen: str, backend: str, tiers: tuple[str, ...],
              edges: int, node_ttl: float, quiet: bool, profile: str, max_sandboxes: int,
              net_uplink: str | None, in_process_edges: bool) -> None:
    """``dsec up --hosts N`` (stream ``hosts``): :func:`dsec.cluster.hosts.serve`."""
    import os

    from dsec.cluster.hosts import HostsConfig, serve
    from dsec.errors import DsecError
    from dsec.statedir import default_state_dir

    for flag, bad in (("--edges", edges != 1), ("--in-process-edges", in_process_edges),
                      ("--net-uplink", net_uplink is not None)):
        if bad:
            raise click.BadParameter("not with --hosts (each host runs one edge)",
                                     param_hint=flag)
    host, _, port = listen.rpartition(":")
    if host not in ("127.0.0.1", "localhost") or not port.isdigit():
        raise click.BadParameter("with --hosts, --listen is 127.0.0.1:PORT (the relay "
                                 "into the apiservers' namespaces serves loopback only)",
                                 param_hint="--listen")
    if os.geteuid() != 0:
        raise click.ClickException("--hosts needs root (it creates network namespaces)")
    cfg = HostsConfig(state_dir=state_dir or default_state_dir(), hosts=hosts,
                      store=store, replicas=replicas, backends=tuple(sorted({"simulated", backend, *tiers})),
                      default_backend=backend, node_ttl_s=node_ttl, rest_port=int(port),
                      simulated_profile=profile, max_sandboxes_per_host=max_sandboxes)

    def started(hc: object) -> None:
        if quiet:
            return
        from dsec.cluster.hosts import HostCluster

        assert isinstance(hc, HostCluster)
        click.echo(f"dsec up --hosts {hosts}  REST {hc.url}  gateway {hc.gateway}  state "
                   f"{hc.state_dir}", err=True)
        for node, m in zip(hc.node_ids, hc.host_members, strict=True):
            click.echo(f"  host {node}: netns {m.name}, edge tcp:{m.address}:7000", err=True)
        for k, m in enumerate(hc.replica_members):
            click.echo(f"  apiserver {k}: netns {m.name} ({m.address})", err=True)
        click.echo(f"admin key: {hc.admin_key}  (also in {hc.state_dir}/local.json)",
                   err=True)
        export_lines(hc.url, hc.admin_key)

    try:
        serve(cfg, started=started)
    except DsecError as exc:
        raise click.ClickException(str(exc)) from exc
