"""``dsec cluster``: the cluster CA, join tokens and joined nodes (docs/cluster.md).

These commands work on the state store and CA of ``--state-dir`` directly (the files
``dsec up`` / ``dsec apiserver`` use; the store may be in use by a running apiserver:
every replica picks the changes up within a second). Over the network, the same
operations are the superuser-only REST routes under ``/v1/cluster/`` (``--url``).
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

import click

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """'90', '90s', '30m', '24h', '7d' -> seconds."""
    m = _DURATION.fullmatch(text.strip())
    if m is None:
        raise click.BadParameter(f"{text!r} is not a duration: use e.g. 3600, 30m, 24h, 7d",
                                 param_hint="--ttl")
    return float(m[1]) * _UNIT[m[2]]


def _state_dir(value: str | None) -> str:
    from dsec.statedir import default_state_dir
    return value or default_state_dir()


def _authority(state_dir: str, store_url: str | None = None,
               cluster_dir: str | None = None) -> Any:
    """The join authority over the state dir's store (or ``store_url``) and CA (or
    ``cluster_dir``'s)."""
    import dsec.control.store as stores
    from dsec.cluster.ca import init_ca
    from dsec.cluster.join import JoinAuthority
    from dsec.control.store.sqlite import SqliteStore
    from dsec.statedir import ensure_private_dir

    d = ensure_private_dir(state_dir)
    ca, _ = init_ca(cluster_dir or os.path.join(d, "cluster"))
    if store_url is None:
        return JoinAuthority(SqliteStore(os.path.join(d, "control.sqlite")), ca)
    # open_store (the PostgreSQL stream's) where this dsec has it
    opener = getattr(stores, "open_store", None)
    if opener is None:
        raise click.ClickException("--store needs a dsec with dsec.control.store.open_store")
    return JoinAuthority(opener(store_url), ca)


def _rest(url: str, method: str, path: str, body: Any = None) -> Any:
    """A superuser call of the /v1/cluster routes ($DSEC_API_KEY or local.json's key)."""
    import httpx

    from dsec.errors import error_from_wire
    from dsec.statedir import read_local

    key = os.environ.get("DSEC_API_KEY") or (read_local() or {}).get("api_key")
    if not key:
        raise click.ClickException("--url needs an API key of a superuser in $DSEC_API_KEY")
    r = httpx.request(method, url.rstrip("/") + path, json=body, timeout=30.0,
                      headers={"authorization": f"Bearer {key}"})
    if r.status_code >= 400:
        try:
            data = r.json()
        except ValueError:
            data = {}
        raise click.ClickException(str(error_from_wire(str(data.get("code", "internal")),
                                                       str(data.get("message", r.text)))))
    return r.json() if r.content else None


def _fail(fn: Any) -> Any:
    import functools

    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        from dsec.errors import DsecError
        try:
            return fn(*a, **kw)
        except DsecError as exc:
            raise click.ClickException(str(exc)) from exc
    return wrapper


state_dir_option = click.option(
    "--state-dir", type=click.Path(file_okay=False), default=None,
    help="The cluster's state dir (default $DSEC_STATE_DIR or ~/.dsec).")
store_option = click.option(
    "--store", "store_url", default=None, metavar="URL",
    help="The state store's URL (postgresql://... for replicas sharing PostgreSQL) "
         "[default: the state dir's SQLite].")
url_option = click.option(
    "--url", default=None, metavar="URL",
    help="Go through the apiserver's REST routes at URL instead of the state dir "
         "(needs a superuser's key in $DSEC_API_KEY).")


@click.group()
def cluster() -> None:
    """The cluster CA, join tokens and joined nodes."""


@cluster.command()
@state_dir_option
@_fail
def init(state_dir: str | None) -> None:
    """Create the cluster CA in STATE_DIR/cluster (kept if it exists)."""
    from dsec.cluster.ca import init_ca
    from dsec.statedir import ensure_private_dir

    d = ensure_private_dir(_state_dir(state_dir))
    ca, created = init_ca(os.path.join(d, "cluster"))
    click.echo(f"{'created' if created else 'exists'}: cluster CA in {ca.dir}")
    click.echo(f"CA sha256: {ca.fingerprint}")


@cluster.group()
def token() -> None:
    """Join tokens: `create`, `list`, `revoke`."""


@token.command("create")
@click.option("--ttl", default="24h", show_default=True, help="How long it may be used.")
@click.option("--uses", type=click.IntRange(1, 10_000), default=1, show_default=True,
              help="How many edges may join with it.")
@click.option("--description", default="", help="A note shown by `token list`.")
@state_dir_option
@store_option
@url_option
@_fail
def token_create(ttl: str, uses: int, description: str, state_dir: str | None,
                 store_url: str | None, url: str | None) -> None:
    """Create a join token and print it (it is shown once; only its hash is kept)."""
    seconds = parse_duration(ttl)
    if url is not None:
        out = _rest(url, "POST", "/v1/cluster/tokens",
                    {"ttl_s": seconds, "uses": uses, "description": description})
        click.echo(out["token"])
        return
    tok, _ = _authority(_state_dir(state_dir), store_url).create_token(ttl_s=seconds, uses=uses,
                                                             description=description)
    click.echo(str(tok))


@token.command("list")
@state_dir_option
@store_option
@url_option
@_fail
def token_list(state_dir: str | None, store_url: str | None, url: str | None) -> None:
    """The join tokens (never their secrets)."""
    if url is not None:
        rows = _rest(url, "GET", "/v1/cluster/tokens")["items"]
    else:
        import msgspec

        from dsec.cluster.join import token_view
        rows = [msgspec.to_builtins(token_view(r))
                for r in _authority(_state_dir(state_dir), store_url).list_tokens()]
    now = time.time()
    for r in rows:
        state = ("revoked" if r["revoked"] else "expired" if r["expires_at"] <= now
                 else "used up" if r["used"] >= r["uses"] else "valid")
        click.echo(f"{r['id']}  {state:8} used {r['used']}/{r['uses']}  expires "
                   f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(r['expires_at']))}  "
                   f"{r['description']}")


@token.command("revoke")
@click.argument("token_id")
@click.option("--nodes", is_flag=True, help="Also revoke every node that joined with it.")
@state_dir_option
@store_option
@url_option
@_fail
def token_revoke(token_id: str, nodes: bool, state_dir: str | None, store_url: str | None,
                 url: str | None) -> None:
    """Revoke a join token (joins with it are refused from now on)."""
    if url is not None:
        _rest(url, "DELETE", f"/v1/cluster/tokens/{token_id}?nodes={str(nodes).lower()}")
        click.echo(f"revoked token {token_id}")
        return
    revoked = _authority(_state_dir(state_dir), store_url).revoke_token(token_id, nodes=nodes)
    click.echo(f"revoked token {token_id}" + (f" and nodes {', '.join(revoked)}"
                                              if revoked else ""))


@cluster.group()
def node() -> None:
    """Joined nodes: `list`, `revoke`."""


@node.command("list")
@state_dir_option
@store_option
@url_option
@_fail
def node_list(state_dir: str | None, store_url: str | None, url: str | None) -> None:
    """The joined nodes."""
    if url is not None:
        rows = _rest(url, "GET", "/v1/cluster/nodes")["items"]
    else:
        import msgspec

        from dsec.cluster.join import node_view
        rows = [msgspec.to_builtins(node_view(r))
                for r in _authority(_state_dir(state_dir), store_url).list_nodes()]
    click.echo(json.dumps(rows, indent=2))


@node.command("revoke")
@click.argument("node_id")
@state_dir_option
@store_option
@url_option
@_fail
def node_revoke(node_id: str, state_dir: str | None, store_url: str | None,
                url: str | None) -> None:
    """Revoke a joined node: every replica refuses its certificate and writes off its
    sandboxes (reason node_revoked); it can only come back by joining with a new token."""
    if url is not None:
        _rest(url, "POST", f"/v1/cluster/nodes/{node_id}/revoke")
    else:
        _authority(_state_dir(state_dir), store_url).revoke_node(node_id)
    click.echo(f"revoked node {node_id}")
