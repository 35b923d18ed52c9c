"""``dsec key|project|quota``: the admin commands (API keys, projects, quotas).

Each is one operation of the catalogue (``create_key``, ``revoke_key``, ``projects``,
``project_get``, ``quota_set``) through the same client as ``dsec sandbox``, so the
server's rules apply unchanged (docs/api.md "Auth, roles, limits": who may mint a key
for whom, who sets which quota). Rich tables to a terminal, plain columns when piped,
``--json`` for scripts."""

from __future__ import annotations

from typing import Any

import click
import msgspec

from dsec.cli.sandbox import _table, client, conn_options, emit_json


@click.group()
def key() -> None:
    """Create, list and revoke API keys."""


@key.command("create")
@click.argument("name")
@click.option("--project", required=True, help="Project the role is on (team/sub).")
@click.option("--role", type=click.Choice(["reader", "member", "admin"]), default="member",
              show_default=True)
@click.option("--existing", is_flag=True,
              help="NAME is an existing principal to grant ROLE (superusers only).")
@click.option("-q", "--quiet", "quiet", is_flag=True, help="Print only the key.")
@conn_options
def key_create(name: str, project: str, role: str, existing: bool, quiet: bool,
               url: str | None, api_key: str | None, as_json: bool) -> None:
    """Create an API key for principal NAME with ROLE on PROJECT. The key is shown once
    (only its hash is stored)."""
    from dsec.wire import ops
    from dsec.wire.api import CreateKeyRequest

    with client(url, api_key) as c:
        got = c.call(ops.CREATE_KEY, _checked(CreateKeyRequest, name=name, project=project,
                                                 role=role, existing=existing))
    if as_json:
        emit_json(got)
    elif quiet:
        click.echo(got.api_key)
    else:
        click.echo(f"key {got.key_id} for {got.name} ({got.role} on {got.project}):")
        click.echo(got.api_key)
        click.echo(f"revoke with: dsec key revoke {got.key_id}", err=True)


@key.command("ls")
@click.option("--principal", default=None,
              help="Whose keys (default: yours; a superuser: any non-superuser's).")
@click.option("-q", "--quiet", "quiet", is_flag=True, help="Only the ids of live keys.")
@conn_options
def key_ls(principal: str | None, quiet: bool, url: str | None, api_key: str | None,
           as_json: bool) -> None:
    """List API keys: ids, owner, age, revoked or not (never a secret)."""
    import time

    from dsec.wire import ops
    from dsec.wire.calls import KeyQuery

    with client(url, api_key) as c:
        items = c.call(ops.KEYS, _checked(KeyQuery, principal=principal)).items
    if as_json:
        emit_json(items)
    elif quiet:
        click.echo("".join(f"{k.key_id}\n" for k in items if not k.revoked), nl=False)
    else:
        _table(f"{len(items)} key(s)", ["key id", "principal", "created", "state"],
               [[k.key_id, k.principal,
                 time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(k.created_at)),
                 "revoked" if k.revoked else "live"] for k in items])


@key.command("revoke")
@click.argument("key_ids", nargs=-1, required=True)
@conn_options
def key_revoke(key_ids: tuple[str, ...], url: str | None, api_key: str | None,
               as_json: bool) -> None:
    """Revoke API keys by id (the 16 hex digits after dsk_): your own; a superuser any
    non-superuser's. Stops working at once on this apiserver, within 5 s on others."""
    from dsec.wire import ops
    from dsec.wire.calls import KeyRef

    with client(url, api_key) as c:
        for k in key_ids:
            c.call(ops.REVOKE_KEY, _checked(KeyRef, id=_key_id(k)))
    emit_json({"revoked": list(key_ids)}) if as_json else click.echo(
        f"revoked {len(key_ids)} key(s)")


def _key_id(text: str) -> str:
    """A key id, also from a whole key (dsk_<id>_<secret>): what a user has at hand."""
    if text.startswith("dsk_"):
        return text[4:].split("_", 1)[0]
    return text


@click.group()
def project() -> None:
    """Projects: their quotas and usage."""


def _quota_cells(p: Any) -> list[str]:
    from dsec.wire.node import format_bytes

    q = p.quota
    u = p.usage

    def cell(used: str, cap: Any, fmt: Any = str) -> str:
        return f"{fmt(u.get(used, 0))}/{'-' if cap is None else fmt(cap)}"

    cpu = lambda v: f"{v / 1000:g}"
    return [p.path,
            cell("sandboxes", q.max_sandboxes if q else None),
            cell("cpu_milli", q.cpu_milli if q else None, cpu),
            cell("memory_bytes", q.memory_bytes if q else None, format_bytes),
            cell("snapshot_bytes", q.snapshot_bytes if q else None, format_bytes),
            cell("image_bytes", q.image_bytes if q else None, format_bytes),
            ",".join(f"{t}<={'-' if lim.max_sandboxes is None else lim.max_sandboxes}"
                     for t, lim in sorted(q.tiers.items())) if q and q.tiers else "-"]


_PCOLS = ["project", "sandboxes", "cpu", "memory", "snapshots", "images", "tiers"]


@project.command("ls")
@conn_options
def project_ls(url: str | None, api_key: str | None, as_json: bool) -> None:
    """The projects your key administers, with usage/quota (- = no quota)."""
    from dsec.wire import ops
    from dsec.wire.calls import Empty

    with client(url, api_key) as c:
        items = c.call(ops.PROJECTS, Empty()).items
    if as_json:
        emit_json(items)
    else:
        _table(f"{len(items)} project(s)", _PCOLS, [_quota_cells(p) for p in items])


@project.command("get")
@click.argument("path")
@conn_options
def project_get(path: str, url: str | None, api_key: str | None, as_json: bool) -> None:
    """One project's quota and usage (any role on it)."""
    from dsec.wire import ops
    from dsec.wire.calls import ProjectRef

    with client(url, api_key) as c:
        p = c.call(ops.PROJECT_GET, _checked(ProjectRef, path=path))
    emit_json(p) if as_json else _table(path, _PCOLS, [_quota_cells(p)])


@click.group()
def quota() -> None:
    """Set a project's quota (an admin of its parent project; a superuser at the top)."""


@quota.command("set")
@click.argument("path")
@click.option("--sandboxes", "max_sandboxes", default=None, metavar="N|none")
@click.option("--cpu", default=None, metavar="CORES|none")
@click.option("--memory", default=None, metavar="SIZE|none", help="e.g. 64GiB")
@click.option("--snapshot-bytes", default=None, metavar="SIZE|none")
@click.option("--image-bytes", default=None, metavar="SIZE|none")
@click.option("--registry-pull/--no-registry-pull", default=None,
              help="May creates pull registry images on first use.")
@click.option("--tier", "tiers", multiple=True, metavar="TIER=N|none",
              help="Most sandboxes of an isolation tier (container, gvisor, vm) in the "
                   "subtree; 0 forbids the tier, none lifts the limit (repeatable). "
                   "fncall sandboxes count in the container tier.")
@click.option("--replace", is_flag=True,
              help="Replace the whole quota (limits not given: none). Default: change only "
                   "the limits given, keep the others.")
@conn_options
def quota_set(path: str, max_sandboxes: str | None, cpu: str | None, memory: str | None,
              snapshot_bytes: str | None, image_bytes: str | None,
              registry_pull: bool | None, tiers: tuple[str, ...], replace: bool,
              url: str | None,
              api_key: str | None, as_json: bool) -> None:
    """Set limits on project PATH ('none' lifts one). Its usage is checked against them
    at each create, for the whole subtree."""
    from dsec.client.core import parse_memory
    from dsec.errors import DsecError
    from dsec.wire import ops
    from dsec.wire.api import QuotaBody, TierQuota
    from dsec.wire.calls import ProjectRef, QuotaSet
    from dsec.wire.spec import TIER_BACKENDS

    def num(text: str, conv: Any) -> int | None:
        if text.strip().lower() == "none":
            return None
        try:
            return int(conv(text))
        except (ValueError, DsecError) as exc:
            raise click.BadParameter(f"{text!r}: {exc}") from exc

    given: dict[str, Any] = {}
    if max_sandboxes is not None:
        given["max_sandboxes"] = num(max_sandboxes, int)
    if cpu is not None:
        given["cpu_milli"] = num(cpu, lambda t: round(float(t) * 1000))
    for name, text in (("memory_bytes", memory), ("snapshot_bytes", snapshot_bytes),
                       ("image_bytes", image_bytes)):
        if text is not None:
            given[name] = num(text, parse_memory)
    if registry_pull is not None:
        given["registry_pull"] = registry_pull
    tier_caps: dict[str, int | None] = {}
    for text in tiers:
        name, sep, n = text.partition("=")
        if not sep or name not in TIER_BACKENDS:
            raise click.BadParameter(f"{text!r} must be TIER=N|none with TIER one of "
                                     f"{', '.join(TIER_BACKENDS)}", param_hint="--tier")
        tier_caps[name] = num(n, int)
    if not given and not tier_caps and not replace:
        raise click.UsageError("give at least one limit (or --replace to lift them all)")
    with client(url, api_key) as c:
        base: dict[str, Any] = {}
        if not replace:
            cur = c.call(ops.PROJECT_GET, _checked(ProjectRef, path=path)).quota
            base = msgspec.structs.asdict(cur) if cur is not None else {}
        if tier_caps:
            kept = dict(base.get("tiers") or {})
            for name, cap in tier_caps.items():
                prev = kept.pop(name, None)
                lim = _checked(TierQuota, **{**(msgspec.structs.asdict(prev) if prev
                                                else {}), "max_sandboxes": cap})
                if lim != TierQuota():
                    kept[name] = lim
            given["tiers"] = kept
        q = _checked(QuotaBody, **{**base, **given})
        p = c.call(ops.QUOTA_SET, _checked(QuotaSet, path=path, quota=q))
    emit_json(p) if as_json else _table(path, _PCOLS, [_quota_cells(p)])


def _checked(t: Any, **fields: Any) -> Any:
    """``t(**fields)``, its own refusal (a bad name, path or limit) as a usage error."""
    from dsec.errors import DsecError

    try:
        return t(**fields)
    except DsecError as exc:
        raise click.BadParameter(str(exc)) from exc
