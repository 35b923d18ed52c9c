"""Rendering: data in, HTML out (Jinja2, autoescaped; no I/O but reading templates).

Every string a user, tenant or sandbox chose (labels, project names, event details,
problems an edge reports, error messages) reaches the page through Jinja2's HTML
autoescaping; nothing is marked safe. Attribute values are quoted in every template, and
URLs built from such strings are percent-encoded (``urlencode``) before escaping.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2

from dsec.control.ui.rate import Point

__all__ = ["Filters", "SandboxesPage", "chart", "env", "render", "sandboxes_links"]

_TEMPLATES = Path(__file__).with_name("templates")


def _size(n: float | None) -> str:
    if not n:
        return "0 B"
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    i = min(int(math.log(max(n, 1), 1024)), len(units) - 1)
    v = n / 1024 ** i
    return f"{v:.0f} {units[i]}" if i == 0 or v >= 100 else f"{v:.1f} {units[i]}"


def _when(t: float | None) -> str:
    if not t:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) + " UTC"


def _ago(t: float | None, now: float) -> str:
    if not t:
        return "never"
    d = max(0.0, now - t)
    return f"{d:.1f} s ago" if d < 120 else f"{d / 60:.0f} min ago"


def _make_env() -> jinja2.Environment:
    e = jinja2.Environment(loader=jinja2.FileSystemLoader(str(_TEMPLATES)),
                           autoescape=True, undefined=jinja2.StrictUndefined,
                           trim_blocks=True, lstrip_blocks=True)
    e.filters["size"] = _size
    e.filters["when"] = _when
    e.filters["ago"] = _ago
    return e


env = _make_env()


def render(template: str, **ctx: Any) -> str:
    ctx.setdefault("who", None)
    ctx.setdefault("csrf", "")
    ctx.setdefault("page", "")
    return env.get_template(template).render(**ctx)


@dataclass(frozen=True, slots=True)
class Filters:
    """What the sandboxes page was asked for (already checked by the list's own rules
    when it runs: a bad project path or label is the list's 400)."""

    state: str = ""
    project: str = ""
    labels: tuple[str, ...] = ()
    node: str = ""
    limit: int = 50
    cursor: str = ""

    def query(self, **change: Any) -> str:
        """This page's query string with ``change`` applied (empty values left out)."""
        vals: dict[str, Any] = {"state": self.state, "project": self.project,
                                "label": list(self.labels), "node": self.node,
                                "limit": self.limit if self.limit != 50 else "",
                                "cursor": self.cursor}
        vals.update(change)
        pairs: list[tuple[str, str]] = []
        for k, v in vals.items():
            for item in (v if isinstance(v, list) else [v]):
                if item not in ("", None):
                    pairs.append((k, str(item)))
        return urlencode(pairs)


@dataclass(frozen=True, slots=True)
class SandboxesPage:
    items: Sequence[Any]
    next_cursor: str | None


def sandboxes_links(f: Filters, page: SandboxesPage) -> dict[str, Any]:
    """The state tabs, the next page and the first page, as URLs."""
    base = "/ui/sandboxes"

    def url(q: str) -> str:
        return f"{base}?{q}" if q else base
    return {
        "state_links": {s: url(f.query(state=s, cursor="")) for s in ("", "running", "paused")},
        "next_link": url(f.query(cursor=page.next_cursor)) if page.next_cursor else None,
        "first_link": url(f.query(cursor="")) if f.cursor else None,
    }


def chart(points: Sequence[Point], *, width: int = 960, height: int = 220) -> dict[str, Any]:
    """An SVG bar chart of ``points``, as template values (no script draws it)."""
    peak = max((p.count for p in points), default=0)
    n = max(len(points), 1)
    w = width / n
    bars = []
    for i, p in enumerate(points):
        h = 0.0 if peak == 0 else height * p.count / peak
        bars.append({"x": round(i * w, 2), "y": round(height - h, 2),
                     "w": round(max(w - 1, 0.5), 2), "h": round(h, 2), "count": p.count,
                     "label": _when(p.start)})
    return {"bars": bars, "peak": peak, "total": sum(p.count for p in points),
            "width": width, "height": height,
            "first_label": _when(points[0].start) if points else "",
            "last_label": _when(points[-1].start) if points else ""}
