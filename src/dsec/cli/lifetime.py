"""``dsec sandbox stats ID`` and ``dsec sandbox timeout ID SECONDS [--extend]`` (issue
19: a sandbox's resource use now, and its lifetime). Registered on the ``sandbox`` group
through :data:`dsec.cli.main.EXTENSIONS`."""

from __future__ import annotations

import time

import click

from dsec.cli.sandbox import _table, client, conn_options, emit_json

__all__ = ["register"]


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


@click.command("stats")
@click.argument("sandbox_id")
@conn_options
def stats(sandbox_id: str, url: str | None, api_key: str | None, as_json: bool) -> None:
    """Resource use of a sandbox now: CPU (time, and percent of one core over the last
    interval), memory (current, peak, limit), processes, disk (used of its cap), network
    bytes, OOM kills."""
    with client(url, api_key) as c:
        st = c.sandboxes.get(sandbox_id).stats()
    if as_json:
        emit_json(st)
        return
    pct = "-" if st.cpu_percent is None else f"{st.cpu_percent:.1f}% over {st.cpu_interval_s:g}s"
    rows = [
        ["cpu", f"{st.cpu_seconds:.2f} s", pct],
        ["memory", _size(st.memory_bytes),
         (f"peak {_size(st.memory_peak_bytes)}, limit {_size(st.memory_limit_bytes)}, "
          f"tmpfs {_size(st.memory_tmpfs_bytes)}")],
        ["pids", str(st.pids), f"max {st.pids_max if st.pids_max is not None else '-'}"],
        ["disk", _size(st.disk_bytes),
         f"of {_size(st.disk_cap_bytes)}" + (" (FULL)" if st.disk_full else "")],
        ["network", f"rx {_size(st.net_rx_bytes)}", f"tx {_size(st.net_tx_bytes)}"],
        ["oom kills", str(st.oom_kills), ""],
    ]
    _table(sandbox_id, ["resource", "now", "detail"], rows)


@click.command("timeout")
@click.argument("sandbox_id")
@click.argument("seconds", type=float)
@click.option("--extend", is_flag=True, help="Add SECONDS to the time it has left.")
@conn_options
def timeout(sandbox_id: str, seconds: float, extend: bool, url: str | None,
            api_key: str | None, as_json: bool) -> None:
    """End a sandbox SECONDS from now (--extend: SECONDS after its current deadline).
    A paused sandbox's clock is stopped: this sets what it has left when it resumes."""
    with client(url, api_key) as c:
        sb = c.sandboxes.get(sandbox_id)
        info = sb.extend(seconds) if extend else sb.set_timeout(seconds)
    if as_json:
        emit_json(info)
    elif info.expires_at is not None:
        click.echo(f"{sandbox_id} expires at "
                   f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(info.expires_at))} "
                   f"(in {info.expires_at - time.time():.0f}s)")
    else:
        click.echo(f"{sandbox_id} is {info.state}: {info.ttl_left_s:.0f}s left when it "
                   "resumes")


def register(group: click.Group) -> None:
    group.add_command(stats)
    group.add_command(timeout)
