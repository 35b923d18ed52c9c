"""``dsec sandbox ...``: create, list, inspect, run commands in, pause, resume, snapshot,
remove sandboxes and read their events. Rich tables by default, ``--json`` for scripts.
Sandboxes made here are not bound to a client session: they live until ``rm`` or TTL."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click
import msgspec

from dsec.logs import escape_text
from dsec.wire.spec import DEFAULT_CPU_MILLI, DEFAULT_MEMORY_BYTES, TIER_BACKENDS, isolation_of

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["client", "conn_options", "emit_json", "sandbox"]


def conn_options(fn: F) -> F:
    fn = click.option("--url", envvar="DSEC_URL", help="apiserver URL (default: dsec up).")(fn)
    fn = click.option("--api-key", envvar="DSEC_API_KEY", help="API key.")(fn)
    fn = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")(fn)
    return fn


@contextmanager
def client(url: str | None, api_key: str | None) -> Iterator[Any]:
    """A sync client without a session lease: CLI-made sandboxes outlive the command."""
    from dsec.client.sync import Client
    from dsec.errors import DsecError

    try:
        c = Client(url, api_key, protocol="http", session_lease_s=None)
    except DsecError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        yield c
    except DsecError as exc:
        raise click.ClickException(f"{exc.code}: {exc}") from exc
    finally:
        c.close()


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(msgspec.to_builtins(obj), indent=1) + "\n")


def _table(title: str, cols: list[str], rows: list[list[str]]) -> None:
    """Print rows under ``cols``. Never truncates a cell: to a terminal a rich table whose
    first column (ids) keeps its full width and whose other cells fold; piped (a script,
    ``| grep``, ``| less``), plain columns as wide as their widest cell, no width limit.
    Every cell is escaped (:func:`dsec.logs.escape_text`): labels, names, event details
    and image refs are tenant-chosen, and a newline or a terminal escape in one would
    forge rows in, or write into, the terminal of whoever lists them (red team 19, B10);
    rich cells are plain ``Text``, never console markup."""
    rows = [[escape_text(c) for c in r] for r in rows]
    if not sys.stdout.isatty():
        sys.stdout.write(plain_table(cols, rows))
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    t = Table(title=Text(escape_text(title)))
    for i, c in enumerate(cols):
        if i == 0:   # ids: never shortened, never wrapped
            t.add_column(c, no_wrap=True, overflow="ignore",
                         min_width=max([len(c)] + [len(r[0]) for r in rows]))
        else:
            t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*(Text(c) for c in r))
    Console().print(t)


def plain_table(cols: list[str], rows: list[list[str]]) -> str:
    """``cols`` and ``rows`` as left-aligned columns separated by two spaces (the last
    column unpadded), every cell whole: what ``ls`` prints to a pipe."""
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(cols)]
    out = []
    for r in [[c.upper() for c in cols], *rows]:
        cells = [v.ljust(w) for v, w in zip(r[:-1], widths, strict=False)] + r[-1:]
        out.append("  ".join(cells).rstrip() + "\n")
    return "".join(out)


def _row(info: Any) -> list[str]:
    s = info.spec
    age = time.time() - info.created_at
    labels = ",".join(f"{k}={v}" for k, v in s.labels.items() if not k.startswith("dsec.io/"))
    return [info.id, info.state, s.backend, isolation_of(s) or "-", s.image, s.project,
            f"{s.cpu_milli / 1000:g}", f"{s.memory_bytes / 2**20:.0f}Mi", f"{age:.0f}s", labels]


_COLS = ["id", "state", "backend", "isolation", "image", "project", "cpu", "memory", "age",
         "labels"]


@click.group()
def sandbox() -> None:
    """Create and drive sandboxes."""


@sandbox.command("create")
@click.option("--image", default="base", show_default=True)
@click.option("--workspace", default=None)
@click.option("--toolkit", "toolkits", multiple=True)
@click.option("--snapshot", default=None, help="Start from this snapshot (sha256:...).")
@click.option("--backend", default=None, help="Default: the server's.")
@click.option("--isolation", type=click.Choice(list(TIER_BACKENDS)), default=None,
              help="Isolation tier: container (host kernel), gvisor (gVisor's user-space "
                   "kernel), vm (a microVM with its own kernel). Picks the backend when "
                   "--backend is not given (default: the server's backend and its tier).")
@click.option("--cpu", type=float, default=DEFAULT_CPU_MILLI / 1000, show_default=True,
              help="Cores.")
@click.option("--memory", default=f"{DEFAULT_MEMORY_BYTES >> 20}MiB", show_default=True)
@click.option("--ttl", type=float, default=None, help="Lifetime in seconds.")
@click.option("--ttl-action", "ttl_action", type=click.Choice(["destroy", "pause"]),
              default="destroy", show_default=True,
              help="What the end of --ttl does: destroy, or pause (its clock stops while "
                   "paused; resumed, it runs a whole --ttl again).")
@click.option("--label", "labels", multiple=True, help="key=value, repeatable.")
@click.option("--env", "env", multiple=True, metavar="KEY=VALUE",
              help="Environment of every exec in the sandbox (repeatable).")
@click.option("--disk", default=None, help="Disk cap, bytes or e.g. '2GiB' (default: the "
                                            "server's).")
@click.option("--idle-timeout", "idle_timeout", type=float, default=None, metavar="SECONDS",
              help="Act on the sandbox after this long without an API call.")
@click.option("--idle-action", "idle_action", type=click.Choice(["destroy", "pause"]),
              default="destroy", show_default=True, help="What --idle-timeout does.")
@click.option("--project", default=None)
@click.option("-n", "count", type=click.IntRange(1, 100_000), default=1, show_default=True)
@click.option("--network", "net_mode", type=click.Choice(["none", "open", "policy"]),
              default=None, help="Egress mode (default: the server's; 'policy' when "
                                 "--allow/--deny are given).")
@click.option("--allow", "allow", multiple=True, metavar="ENTRY",
              help="Egress allowed: pypi.org:443, *.example.com, 203.0.113.0/24:8000-8100, "
                   "[2001:db8::/32]:443/udp (repeatable).")
@click.option("--deny", "deny", multiple=True, metavar="ENTRY",
              help="Egress denied, wins over --allow (repeatable).")
@click.option("--qos", type=click.Choice(["ls", "be"]), default=None,
              help="QoS class: ls latency-sensitive, be best-effort (default: ls, unless "
                   "the project's quota says qos_ls=false).")
@click.option("--cpu-quota", "cpu_quota", type=float, default=None,
              help="CPU cap in cores (default: --cpu).")
@conn_options
def create(image: str, workspace: str | None, toolkits: tuple[str, ...], snapshot: str | None,
           backend: str | None, cpu: float, memory: str, ttl: float | None, ttl_action: str,
           labels: tuple[str, ...],
           env: tuple[str, ...], disk: str | None, idle_timeout: float | None, idle_action: str,
           project: str | None, count: int, net_mode: str | None, allow: tuple[str, ...],
           deny: tuple[str, ...], qos: str | None, cpu_quota: float | None,
           isolation: str | None, url: str | None, api_key: str | None,
           as_json: bool) -> None:
    """Create sandbox(es) and print them."""
    lab = dict(_kv(x) for x in labels)
    kw = {"env": dict(_kv(x) for x in env), "disk": disk, "idle_timeout": idle_timeout,
          "idle_action": idle_action, "image": image, "workspace": workspace, "toolkits": toolkits, "snapshot": snapshot,
          "backend": backend, "cpu": cpu, "memory": memory, "ttl": ttl,
          "ttl_action": ttl_action, "labels": lab,
          "project": project, "detached": True, "qos": qos, "cpu_quota": cpu_quota,
          "isolation": isolation,
          "network": _policy(net_mode, allow, deny) if (net_mode or allow or deny) else None}
    with client(url, api_key) as c:
        sbs = c.sandboxes.create_many(count, **kw) if count > 1 else [c.sandboxes.create(**kw)]
        if as_json:
            emit_json([s.info for s in sbs])
        else:
            _table("created", _COLS, [_row(s.info) for s in sbs])


def _policy(mode: str | None, allow: tuple[str, ...], deny: tuple[str, ...]) -> Any:
    """The NetworkPolicy of --network/--allow/--deny, refused here as the server would."""
    from dsec.client.network import policy_of
    from dsec.errors import DsecError

    try:
        return policy_of(None, mode=mode, allow=allow, deny=deny,  # type: ignore[arg-type]
                         max_connections=None, rate_mbit=None).validate()
    except DsecError as exc:
        raise click.BadParameter(str(exc), param_hint="--allow/--deny/--network") from exc


@sandbox.command("network")
@click.argument("sandbox_id")
@click.option("--mode", type=click.Choice(["none", "open", "policy"]), default=None,
              help="Set the egress mode ('policy' when --allow/--deny are given).")
@click.option("--allow", "allow", multiple=True, metavar="ENTRY",
              help="Replace the allow list (repeatable).")
@click.option("--deny", "deny", multiple=True, metavar="ENTRY",
              help="Replace the deny list (repeatable).")
@conn_options
def network(sandbox_id: str, mode: str | None, allow: tuple[str, ...], deny: tuple[str, ...],
            url: str | None, api_key: str | None, as_json: bool) -> None:
    """Show a sandbox's egress policy; with --mode/--allow/--deny, replace it (live,
    atomically: flows the new policy forbids are cut)."""
    with client(url, api_key) as c:
        sb = c.sandboxes.get(sandbox_id)
        if mode or allow or deny:
            view = sb.network.update(_policy(mode, allow, deny))
        else:
            view = sb.network.get()
    if as_json:
        emit_json(view)
        return
    p = view.policy
    rows = [["mode", p.net_mode], ["generation", str(view.generation)]]
    rows += [["allow", e] for e in p.allow] + [["deny", e] for e in p.deny]
    rows += [["ceiling deny", e] for e in view.ceiling_deny]
    if view.address:
        rows.append(["address", view.address])
    rows.append(["denied packets", str(view.denied_packets)])
    _table(f"network of {sandbox_id}", ["", ""], rows)


class _Timeout(click.ParamType[Any]):
    """Seconds (> 0), or ``none``/``inf`` for no command timeout."""

    name = "SECONDS|none"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> float | None:
        if value is None or (isinstance(value, str)
                             and value.strip().lower() in ("none", "inf")):
            return None
        try:
            t = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds or 'none'", param, ctx)
        if not t > 0:
            self.fail(f"{value!r}: a timeout is > 0 seconds, or 'none'", param, ctx)
        return t


TIMEOUT = _Timeout()


def _kv(text: str) -> tuple[str, str]:
    k, sep, v = text.partition("=")
    if not sep or not k:
        raise click.BadParameter(f"{text!r} must be key=value")
    return k, v


@sandbox.command("ls")
@click.option("--project", default=None)
@click.option("--label", "labels", multiple=True)
@click.option("--state", default=None)
@click.option("--node", default=None, help="Only the sandboxes on this node.")
@click.option("--isolation", type=click.Choice(list(TIER_BACKENDS)), default=None,
              help="Only the sandboxes of this isolation tier.")
@click.option("-q", "--quiet", "quiet", is_flag=True, help="Only the ids, one per line.")
@conn_options
def ls(project: str | None, labels: tuple[str, ...], state: str | None, node: str | None,
       isolation: str | None, quiet: bool, url: str | None, api_key: str | None,
       as_json: bool) -> None:
    """List sandboxes (ids are never shortened, also when piped)."""
    with client(url, api_key) as c:
        sbs = c.sandboxes.list(project=project, labels=dict(_kv(x) for x in labels),
                               state=state, node=node,
                               isolation=isolation)
        if quiet:
            sys.stdout.write("".join(s.id + "\n" for s in sbs))
        elif as_json:
            emit_json([s.info for s in sbs])
        else:
            _table(f"{len(sbs)} sandbox(es)", _COLS, [_row(s.info) for s in sbs])


@sandbox.command("get")
@click.argument("sandbox_id")
@conn_options
def get(sandbox_id: str, url: str | None, api_key: str | None, as_json: bool) -> None:
    """Show one sandbox."""
    with client(url, api_key) as c:
        sb = c.sandboxes.get(sandbox_id)
        if as_json:
            emit_json(sb.info)
        else:
            _table(sandbox_id, _COLS, [_row(sb.info)])
            _lifetime_lines(sb.info)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) + f" (in {t - time.time():.0f}s)"


def _lifetime_lines(info: Any) -> None:
    """Where it runs and its lifetime: when it ends, or (paused: the clock stops) what it
    has left, and why it was paused (``requested``, ``idle``, ``ttl``)."""
    lines = [f"node: {info.node}"]
    if info.expires_at is not None:
        lines.append(f"expires at: {_when(info.expires_at)}")
    if info.ttl_left_s is not None:
        lines.append(f"ttl left: {info.ttl_left_s:.0f}s (runs again when it resumes)")
    if info.paused_reason:
        lines.append(f"paused: {info.paused_reason}")
    if info.paused_until is not None:
        lines.append(f"kept paused until: {_when(info.paused_until)}")
    click.echo("\n".join(escape_text(x) for x in lines))


@sandbox.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--timeout", type=TIMEOUT, default="60", show_default=True,
              help="Command timeout in seconds, or 'none' (runs until it ends; the "
                   "sandbox's TTL still applies).")
@click.option("--cwd", default=None)
@click.option("--env", "env", multiple=True, help="KEY=VALUE, repeatable.")
@click.option("--shell", is_flag=True, help="Run COMMAND joined as one shell string.")
@click.option("-d", "--background", is_flag=True,
              help="Start it in the background and print its pid (see `dsec sandbox ps`, "
                   "`attach`, `signal`); its output is kept for a later attach. No command "
                   "timeout unless --timeout is given.")
@conn_options
def exec_(sandbox_id: str, command: tuple[str, ...], timeout: float | None, cwd: str | None,
          env: tuple[str, ...], shell: bool, background: bool, url: str | None,
          api_key: str | None, as_json: bool) -> None:
    """Run COMMAND in a sandbox; exits with the command's exit code. Piped stdin is
    streamed to it (cli/stdio.py). If the OOM killer killed a process of the sandbox
    while it ran, that is said on stderr (``oom_killed`` in --json)."""
    from dsec.cli.stdio import exec_piped, oom_note, stdin_to_forward
    cmd: str | list[str] = " ".join(command) if shell else list(command)
    if background:
        # as the SDK's exec(background=True): no command timeout unless --timeout is given
        given = click.get_current_context().get_parameter_source("timeout")
        if given is not click.core.ParameterSource.COMMANDLINE:
            timeout = None
        with client(url, api_key) as c:
            h = c.sandboxes.get(sandbox_id).processes.start(
                cmd, timeout=timeout, cwd=cwd, env=dict(_kv(x) for x in env))
        emit_json({"pid": h.pid}) if as_json else click.echo(h.pid)
        return
    src = stdin_to_forward()
    if isinstance(src, int):
        exec_piped(url, api_key, sandbox_id, cmd, src, timeout=timeout, cwd=cwd,
                   env=dict(_kv(x) for x in env), as_json=as_json)
    with client(url, api_key) as c:
        sb = c.sandboxes.get(sandbox_id)
        res = sb.exec(cmd, timeout=timeout, cwd=cwd, env=dict(_kv(x) for x in env),
                      stdin=src)
    if as_json:
        emit_json({"exit_code": res.exit_code, "stdout": res.stdout.decode(errors="replace"),
                   "stderr": res.stderr.decode(errors="replace"), "timed_out": res.timed_out,
                   "oom_killed": res.oom_killed, "duration_s": res.duration_s})
        return
    sys.stdout.buffer.write(res.stdout)
    sys.stderr.buffer.write(res.stderr)
    if res.timed_out:
        click.echo(f"command timed out after {timeout or 0:g}s (command timeout)", err=True)
    if res.oom_killed:
        click.echo(oom_note(sandbox_id), err=True)
    sys.exit(res.exit_code)


def _simple(name: str, verb: str) -> None:
    @sandbox.command(name)
    @click.argument("sandbox_ids", nargs=-1, required=True)
    @conn_options
    def cmd(sandbox_ids: tuple[str, ...], url: str | None, api_key: str | None,
            as_json: bool) -> None:
        out = []
        with client(url, api_key) as c:
            for sid in sandbox_ids:
                sb = c.sandboxes.get(sid)
                r = getattr(sb, verb)()
                out.append({"id": sid, "result": msgspec.to_builtins(r)})
        if as_json:
            emit_json(out)
        else:
            for o in out:
                click.echo(f"{o['id']}: {verb} ok" + (f" {o['result']}" if o["result"] else ""))
    cmd.__doc__ = f"{verb.capitalize()} sandbox(es)."


_simple("pause", "pause")
_simple("resume", "resume")


@sandbox.command("snapshot")
@click.argument("sandbox_id")
@click.option("--strip", "strip", multiple=True, metavar="PATTERN",
              help="Leave paths matching PATTERN out (a pattern without '/' matches a "
                   "basename anywhere); repeatable.")
@click.option("--strip-residue", is_flag=True,
              help="Also strip build residue (__pycache__, *.pyc, shell histories, tmp/*...).")
@conn_options
def snapshot(sandbox_id: str, strip: tuple[str, ...], strip_residue: bool, url: str | None,
             api_key: str | None, as_json: bool) -> None:
    """Snapshot what a sandbox changed since its last snapshot (see `dsec snapshot`)."""
    pats = list(strip)
    if strip_residue:
        from dsec.image.packdiff import DEFAULT_RESIDUE
        pats += [p for p in DEFAULT_RESIDUE if p not in pats]
    with client(url, api_key) as c:
        snap = c.sandboxes.get(sandbox_id).snapshot(strip=pats)
    if as_json:
        emit_json(snap.data)
    else:
        click.echo(f"{snap.id}{' (unchanged)' if snap.unchanged else ''} parent "
                   f"{snap.parent or '-'} {snap.size} bytes on {','.join(snap.nodes)}")


@sandbox.command("expose")
@click.argument("sandbox_id")
@click.argument("port", type=click.IntRange(1, 65535))
@click.option("--token-ttl", "token_ttl", type=float, default=None,
              help="Seconds the URL's token lives (default: until the port closes, at "
                   "most 30 days).")
@conn_options
def expose(sandbox_id: str, port: int, token_ttl: float | None, url: str | None,
           api_key: str | None, as_json: bool) -> None:
    """Reach PORT inside a sandbox through the apiserver: prints the URL (with its token;
    whoever holds it reaches the port until it expires or the port is closed)."""
    with client(url, api_key) as c:
        p = c.sandboxes.get(sandbox_id).ports.expose_info(port, token_ttl_s=token_ttl)
    emit_json(p) if as_json else click.echo(p.url)


@sandbox.command("ports")
@click.argument("sandbox_id")
@conn_options
def ports(sandbox_id: str, url: str | None, api_key: str | None, as_json: bool) -> None:
    """Exposed ports of a sandbox and their URLs."""
    with client(url, api_key) as c:
        items = c.sandboxes.get(sandbox_id).ports.list()
    if as_json:
        emit_json(items)
        return
    _table(sandbox_id, ["port", "url"], [[str(p.port), p.url] for p in items])


@sandbox.command("unexpose")
@click.argument("sandbox_id")
@click.argument("port", type=click.IntRange(1, 65535))
@conn_options
def unexpose(sandbox_id: str, port: int, url: str | None, api_key: str | None,
             as_json: bool) -> None:
    """Close an exposed port: its URLs stop working, open connections end."""
    with client(url, api_key) as c:
        c.sandboxes.get(sandbox_id).ports.close(port)
    emit_json({"closed": port}) if as_json else click.echo(f"{sandbox_id}: port {port} closed")


@sandbox.command("rm")
@click.argument("sandbox_ids", nargs=-1, required=True)
@conn_options
def rm(sandbox_ids: tuple[str, ...], url: str | None, api_key: str | None,
       as_json: bool) -> None:
    """Destroy sandbox(es) (idempotent)."""
    from dsec.errors import NotFound
    with client(url, api_key) as c:
        for sid in sandbox_ids:
            try:
                c.sandboxes.get(sid).kill()
            except NotFound:
                pass
    emit_json({"removed": list(sandbox_ids)}) if as_json else click.echo(
        f"removed {len(sandbox_ids)} sandbox(es)")


@sandbox.command("events")
@click.argument("sandbox_id")
@conn_options
def events(sandbox_id: str, url: str | None, api_key: str | None, as_json: bool) -> None:
    """Lifecycle events of a sandbox."""
    with client(url, api_key) as c:
        evs = c.sandboxes.get(sandbox_id).events()
    if as_json:
        emit_json(evs)
        return
    _table(sandbox_id, ["time", "from", "to", "reason", "detail"],
           [[time.strftime("%H:%M:%S", time.localtime(e.time)) + f".{int(e.time * 1000) % 1000:03d}",
             e.from_state or "-", e.to_state, e.reason, e.detail] for e in evs])


@sandbox.command("logs")
@click.argument("sandbox_id")
@conn_options
def logs(sandbox_id: str, url: str | None, api_key: str | None, as_json: bool) -> None:
    """What happened to a sandbox, one line per event, oldest first: its lifecycle events
    (created, paused, resumed, OOM kills, why it died). A command's output is its exec's
    own result; a background process's (`exec -d`) is kept on the edge: `dsec sandbox
    ps ID`, then `dsec sandbox attach ID PID`."""
    with client(url, api_key) as c:
        evs = c.sandboxes.get(sandbox_id).events()
    if as_json:
        emit_json(evs)
        return
    for e in evs:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(e.time))
        line = (f"{stamp}.{int(e.time * 1000) % 1000:03d}Z  {e.from_state or '-'} -> "
                f"{e.to_state}  {e.reason}")
        click.echo(line + (f"  {e.detail}" if e.detail else ""))


@sandbox.command("run-code")
@click.argument("sandbox_id")
@click.argument("code")
@click.option("--timeout", type=TIMEOUT, default="60", show_default=True,
              help="Seconds the code may run (then it is interrupted), or 'none'.")
@click.option("--restart", is_flag=True, help="Restart the interpreter first (its "
                                                "variables are lost).")
@conn_options
def run_code(sandbox_id: str, code: str, timeout: float | None, restart: bool,
             url: str | None, api_key: str | None, as_json: bool) -> None:
    """Run Python CODE in the sandbox's interpreter, which keeps its state between calls
    (`run-code ID 'x = 41'`, then `run-code ID 'x + 1'` prints 42). Prints the code's
    output, then the value of its last expression; an error's traceback goes to stderr
    and the exit code is 1. Needs python3 in the image."""
    with client(url, api_key) as c:
        sb = c.sandboxes.get(sandbox_id)
        if restart:
            sb.restart_code()
        ex = sb.run_code(code, timeout=timeout)
    if as_json:
        emit_json(ex)
        sys.exit(1 if ex.error else 0)
    sys.stdout.write(ex.stdout)
    sys.stderr.write(ex.stderr)
    for r in ex.results:
        if r.text is not None:
            sys.stdout.write(r.text + "\n")
        else:
            sys.stdout.write(f"<{', '.join(sorted(r.data))}>\n")
    if ex.error is not None:
        sys.stderr.write(ex.error.traceback or f"{ex.error.name}: {ex.error.value}\n")
        sys.exit(1)
