"""``dsec bench``: run benchmark suites and write bench-results.{json,md}."""

from __future__ import annotations

import os

import click
from rich.console import Console

from dsec.bench import Result, merge_json, run_suites, suites, write_markdown


def _repo_root() -> str:
    here = os.path.abspath(os.getcwd())
    d = here
    while d != "/":
        if os.path.exists(os.path.join(d, "pyproject.toml")):
            return d
        d = os.path.dirname(d)
    return here


@click.command()
@click.argument("suite_names", metavar="SUITE...", nargs=-1)
@click.option("--quick", is_flag=True, help="Smaller sizes: seconds per suite, for CI and smoke runs.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="JSON output path.")
@click.option("--md", "md_path", type=click.Path(dir_okay=False), help="Markdown output path.")
@click.option("--list", "list_only", is_flag=True, help="List suites and exit.")
def bench(suite_names: tuple[str, ...], quick: bool, json_path: str | None,
          md_path: str | None, list_only: bool) -> None:
    """Run benchmark SUITEs (all when none is named) and record the figures.

    Figures of suites that did not run are kept from the previous JSON file, so one
    suite can be refreshed without re-running the others.
    """
    console = Console(soft_wrap=True)  # one line per figure, whatever the terminal width
    from dsec.nofile import raise_nofile  # dens: soft RLIMIT_NOFILE to hard (issue 22)
    raise_nofile()
    registry = suites()
    if list_only:
        for name, (_, doc) in registry.items():
            console.print(f"[bold]{name}[/]  {doc}")
        return
    names = list(suite_names) or list(registry)
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise click.BadParameter(
            f"unknown suite(s) {', '.join(unknown)}; known: {', '.join(registry)}",
            param_hint="SUITE")
    root = _repo_root()
    json_path = json_path or os.path.join(root, "bench-results.json")
    md_path = md_path or os.path.join(root, "bench-results.md")
    os.environ.setdefault("DSEC_BENCH_OUT_DIR", os.path.dirname(os.path.abspath(json_path)))  # qos: plots beside the results

    def echo(r: Result) -> None:
        params = " ".join(f"{k}={v}" for k, v in r.params.items())
        console.print(f"  [cyan]{r.suite}[/] {r.name:<28} [bold]{r.value:>14,.2f}[/] {r.unit:<12} {params}")

    results, notes, errors = run_suites(names, quick=quick, echo=echo)
    merged = merge_json(json_path, results, names, notes)
    write_markdown(md_path, merged, errors)
    for s, e in errors.items():
        console.print(f"[red]suite {s} failed:[/] {e}")
    console.print(f"wrote {json_path} and {md_path}")
    if errors:
        raise SystemExit(1)
