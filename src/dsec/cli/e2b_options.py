"""``--e2b`` and its companions for ``dsec up`` and ``dsec apiserver`` (issue 20): serve
the E2B-compatible API (dsec.control.e2b, docs/e2b.md) on a listener of its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

__all__ = ["DEFAULT_E2B_LISTEN", "e2b_banner", "e2b_config", "e2b_options"]

DEFAULT_E2B_LISTEN = "127.0.0.1:8471"


def e2b_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option("--e2b-tls-key", type=click.Path(dir_okay=False, exists=True),
                     default=None, help="Private key of --e2b-tls-cert.")(f)
    f = click.option("--e2b-tls-cert", type=click.Path(dir_okay=False, exists=True),
                     default=None,
                     help="Serve the E2B API over TLS with this certificate (PEM; for "
                          "E2B_DOMAIN set-ups: it must cover *.DOMAIN).")(f)
    f = click.option("--e2b-domain", default=None, metavar="DOMAIN",
                     help="Route host names {port}-{sandboxID}.DOMAIN to the sandbox's "
                          "envd (the SDK's E2B_DOMAIN).")(f)
    return click.option(
        "--e2b", "e2b", is_flag=False, flag_value=DEFAULT_E2B_LISTEN, default=None,
        metavar="[HOST:PORT]",
        help=f"Serve the E2B-compatible API on HOST:PORT (bare --e2b: "
             f"{DEFAULT_E2B_LISTEN}); point E2B_API_URL and E2B_SANDBOX_URL at it "
             "(docs/e2b.md).")(f)


def e2b_config(e2b: str | None, e2b_domain: str | None, e2b_tls_cert: str | None,
               e2b_tls_key: str | None) -> dict[str, Any]:
    """The ClusterConfig fields of the flags (refusing companions without ``--e2b``)."""
    if e2b is None and (e2b_domain or e2b_tls_cert or e2b_tls_key):
        raise click.BadParameter("only with --e2b", param_hint="--e2b-domain/--e2b-tls-*")
    if bool(e2b_tls_cert) != bool(e2b_tls_key):
        raise click.BadParameter("give both or neither", param_hint="--e2b-tls-cert/-key")
    return {"e2b": e2b, "e2b_domain": e2b_domain, "e2b_tls_cert": e2b_tls_cert,
            "e2b_tls_key": e2b_tls_key}


def e2b_banner(rt: Any) -> str | None:
    """The lines that point the stock E2B SDK at this cluster (None when off)."""
    url = getattr(rt, "e2b_url", None)
    if not url:
        return None
    return (f"E2B API {url}:\n  export E2B_API_URL={url} E2B_SANDBOX_URL={url} "
            f"E2B_API_KEY={rt.admin_key}")
