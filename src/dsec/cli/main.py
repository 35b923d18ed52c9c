"""``dsec`` entry point. Subcommands load lazily so ``dsec --help`` stays fast.

To add a command, add ``"name": "module:attribute"`` to ``COMMANDS``; the module holds a
click command or group.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

COMMANDS: dict[str, str] = {
    "apiserver": "dsec.cli.apiserver:apiserver",
    "bench": "dsec.cli.bench:bench",
    "cluster": "dsec.cli.cluster:cluster",
    "demo": "dsec.cli.demo:demo",
    "edge": "dsec.cli.edge:edge",
    "image": "dsec.cli.image:image",
    "key": "dsec.cli.admin:key",
    "node": "dsec.cli.node:node",
    "project": "dsec.cli.admin:project",
    "quota": "dsec.cli.admin:quota",
    "sandbox": "dsec.cli.sandbox:sandbox",
    "snapshot": "dsec.cli.snapshot:snapshot",
    "up": "dsec.cli.up:up",
}


# Commands another module adds to a group (`register(group)`), so that module may import
# the group's helpers without an import cycle (issue 19: `dsec sandbox
# stats|timeout|shell|cp|ps|attach|signal|fs`).
EXTENSIONS: dict[str, tuple[str, ...]] = {
    "sandbox": ("dsec.cli.lifetime:register", "dsec.cli.shell:register",
                "dsec.cli.cp:register", "dsec.cli.procs:register",
                "dsec.cli.fs:register"),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        mod, _, attr = target.partition(":")
        cmd: click.Command = getattr(importlib.import_module(mod), attr)
        for ext in EXTENSIONS.get(name, ()):
            emod, _, fn = ext.partition(":")
            getattr(importlib.import_module(emod), fn)(cmd)
        return cmd


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dsec")
def cli() -> None:
    """dsec: elastic sandboxes for agentic reinforcement learning."""


def main(argv: list[str] | None = None) -> Any:
    from dsec.errors import DsecError

    try:
        return cli.main(args=argv, standalone_mode=True)
    except DsecError as exc:  # pragma: no cover - click already handled most
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
