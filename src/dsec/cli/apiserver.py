"""``dsec apiserver``: the management plane alone (REST + Aether gateway + control plane)
against edges that run elsewhere (``dsec edge`` on this or other machines).

The apiserver keeps no sandbox state of its own: it rebuilds its view from the edges'
heartbeats, and its durable state (keys, quotas, sessions, idempotency keys, lost-node
tombstones) is in the state store: ``<state-dir>/control.sqlite`` by default, or the one
``--store URL`` names. Several apiserver replicas share one PostgreSQL store
(``--store postgresql://...``) and learn each other's writes through LISTEN/NOTIFY
(docs/host-security.md). An edge that is not reachable yet is dialled again on every poll.
"""

from __future__ import annotations

from typing import Any

import click

from dsec.cli.e2b_options import e2b_banner, e2b_config, e2b_options
from dsec.cli.edge import (
    blob_store_option,
    net_default_option,
    reply_budget_option,
    secret_in_argv,
)
from dsec.cli.logopts import access_log_option, log_format_option, log_level_option


def _edges(values: tuple[str, ...]) -> dict[str, str]:
    from dsec.errors import InvalidArgument
    from dsec.ids import parse_node_id

    out: dict[str, str] = {}
    for v in values:
        node, sep, addr = v.partition("=")
        if not sep or not addr.startswith(("unix:", "tcp:")):
            raise click.BadParameter(f"{v!r} must look like NODE=unix:PATH or "
                                     "NODE=tcp:HOST:PORT", param_hint="--edge")
        try:
            parse_node_id(node)
        except InvalidArgument as exc:
            raise click.BadParameter(str(exc), param_hint="--edge") from exc
        if node in out:
            raise click.BadParameter(f"edge {node!r} given twice", param_hint="--edge")
        out[node] = addr
    return out


@click.command()
@click.option("--edge", "edges", multiple=True, metavar="NODE=ADDR",
              help="An edge to use (repeatable): NODE=unix:PATH or NODE=tcp:HOST:PORT; "
                   "NODE is the edge's --node-id. Edges may also join by token "
                   "(`dsec cluster token create`, `dsec edge --join`).")
@click.option("--state-dir", type=click.Path(file_okay=False), default=None,
              help="Where the control plane's state lives (default $DSEC_STATE_DIR or "
                   "~/.dsec).")
@click.option("--store", "store", default=None, metavar="URL", envvar="DSEC_STORE",
              callback=secret_in_argv,
              help="The state store: postgresql://user[:password]@host[:port]/db (shared "
                   "by apiserver replicas) or sqlite:///path (default: control.sqlite in "
                   "the state dir; env DSEC_STORE).")
@click.option("--listen", default="127.0.0.1:8470", show_default=True,
              help="REST address HOST:PORT (port 0 picks a free one).")
@click.option("--gateway", default="tcp:127.0.0.1:0", show_default=True,
              help="Aether gateway address ('off' to disable).")
@click.option("--backend", default="simulated", show_default=True,
              help="Default sandbox backend of creates that name none.")
@click.option("--edge-token-file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="File with the secret tcp: edges require (their --token-file).")
@click.option("--cluster-dir", type=click.Path(file_okay=False), default=None,
              help="[join] The cluster CA's directory (default <state-dir>/cluster; made "
                   "if absent). Replicas on several hosts must share one CA: give each a "
                   "copy of the same directory (docs/cluster.md).")
@click.option("--quiet", is_flag=True, help="Print nothing but errors.")
@click.option("--node-ttl", type=click.FloatRange(min=0, min_open=True), default=10.0,
              show_default=True, metavar="SECONDS",
              help="An edge silent this long is lost: its sandboxes are evicted (node_lost) "
                   "and destroyed when it returns (as `dsec up --node-ttl`).")
@click.option("--sandbox-list-interval", type=click.FloatRange(min=0), default=5.0,
              show_default=True, metavar="SECONDS",
              help="Ask each edge for its whole sandbox list at most this often (0: at "
                   "every 1 s poll); in between, polls cost O(changes), not O(sandboxes). "
                   "It repairs what an edge's event feed missed; another replica's "
                   "sandboxes arrive through the state store (docs/deploy.md).")
@net_default_option
@reply_budget_option
@blob_store_option
@log_level_option()
@log_format_option
@access_log_option
@e2b_options
def apiserver(edges: tuple[str, ...], state_dir: str | None, store: str | None, listen: str,
              gateway: str, backend: str, edge_token_file: str | None, quiet: bool,
              node_ttl: float, sandbox_list_interval: float, net_default: Any,
              reply_budget: Any = None, cluster_dir: str | None = None, blob_store: str | None = None,
              log_level: str = "warning", log_format: str = "text",
              access_log: str | None = None,
              e2b: str | None = None, e2b_domain: str | None = None,
              e2b_tls_cert: str | None = None, e2b_tls_key: str | None = None) -> None:
    """Run the API (REST, gateway, control plane) against edges given by address."""
    import uvloop

    from dsec.cluster.runtime import ClusterConfig
    from dsec.control.api.plane import PlaneConfig
    from dsec.statedir import default_state_dir

    remote = _edges(edges)
    token = None
    if edge_token_file is not None:
        with open(edge_token_file, "rb") as f:
            token = f.read().strip()
    cfg = ClusterConfig(state_dir=state_dir or default_state_dir(), store=store, listen=listen,
                        gateway=None if gateway == "off" else gateway, backend=backend,
                        edges=0, remote_edges=remote, edge_token=token,
                        net_default=net_default, cluster_dir=cluster_dir,
                        reply_budget=reply_budget,
                        blob_store=blob_store,
                        **e2b_config(e2b, e2b_domain, e2b_tls_cert, e2b_tls_key),
                        plane=PlaneConfig(node_ttl_s=node_ttl,
                                          sandbox_list_interval_s=sandbox_list_interval))
    from dsec.logs import configure
    configure(log_level, log_format, access_log=access_log)   # issue 19
    uvloop.run(_run(cfg, quiet))


async def _run(cfg: Any, quiet: bool) -> None:
    from dsec.cluster.run import run_until_signalled

    def failed(exc: Exception) -> None:
        click.echo(f"dsec apiserver failed: {exc}", err=True)

    def started(rt: Any) -> None:
        if quiet:
            return
        from dsec.control.store import redact_url
        where = redact_url(cfg.store) if cfg.store else f"{cfg.state_dir}/control.sqlite"
        click.echo(f"dsec apiserver  REST {rt.url}  gateway {rt.gateway_address}  store "
                   f"{where}  edges {', '.join(cfg.remote_edges) or '(joined only)'}", err=True)
        click.echo(f"admin key: {rt.admin_key}  (also in {cfg.state_dir}/local.json)",
                   err=True)
        if (banner := e2b_banner(rt)) is not None:
            click.echo(banner, err=True)

    await run_until_signalled(cfg, failed=failed, started=started)
