"""``--log-level``, ``--log-format text|json`` and ``--access-log`` for the long-running
commands (``dsec up``, ``dsec apiserver``, ``dsec edge``); the work is in
:mod:`dsec.logs` (issue 19)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from dsec.logs import LOG_FORMATS, LOG_LEVELS

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["access_log_option", "log_format_option", "log_level_option"]


def log_level_option(default: str = "warning") -> Callable[[F], F]:
    return click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False),
                        default=default, show_default=True,
                        help="Least severe log records printed.")


def log_format_option(fn: F) -> F:
    return click.option("--log-format", type=click.Choice(LOG_FORMATS), default="text",
                        show_default=True,
                        help="text: 'ISO-time LEVEL logger: message' lines; json: one "
                             "object per line (ts, level, logger, msg).")(fn)


def access_log_option(fn: F) -> F:
    return click.option("--access-log", default=None, metavar="PATH|-",
                        help="Log every REST request and gateway call (method/op, path, "
                             "status/outcome, duration, client, principal) to PATH "
                             "(appended, mode 0600) or '-' for stderr, in --log-format.")(fn)
