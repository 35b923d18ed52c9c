"""Benchmark suites behind ``dsec bench``.

Each module in this package registers one or more suites with :func:`suite`; the runner
discovers them by importing every module here, so adding a suite is adding a file.
A suite is ``fn(ctx: BenchContext) -> None`` and calls ``ctx.record(...)`` per figure.
Performance is measured here, never asserted in tests (CONVENTIONS.md #14).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import pkgutil
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from dsec.errors import InvalidArgument

__all__ = [
    "BenchContext", "Result", "machine_info", "merge_json", "run_suites", "suite", "suites",
    "write_markdown",
]

SuiteFn = Callable[["BenchContext"], None]
_SUITES: dict[str, tuple[SuiteFn, str]] = {}


def suite(name: str, doc: str = "") -> Callable[[SuiteFn], SuiteFn]:
    """Register ``fn`` as the benchmark suite ``name``."""
    def deco(fn: SuiteFn) -> SuiteFn:
        first_line = (fn.__doc__ or "").strip().split("\n", 1)[0]
        _SUITES[name] = (fn, doc or first_line)
        return fn
    return deco


def suites() -> dict[str, tuple[SuiteFn, str]]:
    """All registered suites (imports every module of this package once)."""
    for mod in pkgutil.iter_modules(__path__):
        if not mod.name.startswith("_"):
            importlib.import_module(f"{__name__}.{mod.name}")
    return dict(sorted(_SUITES.items()))


@dataclass(slots=True)
class Result:
    suite: str
    name: str
    value: float
    unit: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class BenchContext:
    """Passed to each suite: where to record, and whether to run the quick variant."""

    suite: str
    quick: bool = False
    results: list[Result] = field(default_factory=list)
    echo: Callable[[Result], None] | None = None
    notes: list[str] = field(default_factory=list)

    def record(self, name: str, value: float, unit: str, **params: Any) -> Result:
        r = Result(self.suite, name, float(value), unit, params)
        self.results.append(r)
        if self.echo is not None:
            self.echo(r)
        return r

    def note(self, text: str) -> None:
        """A sentence for the markdown report (e.g. what bounds a figure)."""
        self.notes.append(text)

    def scale(self, full: int, quick: int) -> int:
        return quick if self.quick else full


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "machine": platform.machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def run_suites(
    names: Iterable[str], *, quick: bool, echo: Callable[[Result], None] | None = None
) -> tuple[list[Result], dict[str, list[str]], dict[str, str]]:
    """Run suites by name; returns results, notes per suite and errors per suite."""
    registry = suites()
    names = list(names)
    for name in names:
        if name not in registry:
            raise InvalidArgument(
                f"unknown benchmark suite {name!r}; known: {', '.join(registry)}", suite=name)
    results: list[Result] = []
    notes: dict[str, list[str]] = {}
    errors: dict[str, str] = {}
    for name in names:
        fn, _ = registry[name]
        ctx = BenchContext(name, quick=quick, echo=echo)
        try:
            fn(ctx)
        except Exception as exc:  # one broken suite must not lose the others' figures
            errors[name] = f"{type(exc).__name__}: {exc}"
            # where it broke (a bare "TimeoutError: " said nothing of which step)
            logging.getLogger(__name__).error("suite %s failed", name, exc_info=exc)
        results.extend(ctx.results)
        notes[name] = ctx.notes
    return results, notes, errors


def merge_json(path: str, results: list[Result], ran: Iterable[str],
               notes: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """Replace the figures of the suites that ran; keep the others from the old file."""
    ran = set(ran)
    old: list[dict[str, Any]] = []
    try:
        with open(path) as f:
            old = [r for r in json.load(f).get("results", []) if r.get("suite") not in ran]
    except (OSError, ValueError):
        pass
    old_notes: dict[str, list[str]] = {}
    try:
        with open(path) as f:
            old_notes = {k: v for k, v in json.load(f).get("notes", {}).items() if k not in ran}
    except (OSError, ValueError):
        pass
    doc = {
        "machine": machine_info(),
        "notes": {**old_notes, **{s: n for s, n in (notes or {}).items() if n}},
        "results": old + [
            {"suite": r.suite, "name": r.name, "value": r.value, "unit": r.unit, "params": r.params}
            for r in results
        ],
    }
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return doc


def write_markdown(path: str, doc: dict[str, Any], errors: dict[str, str]) -> None:
    m = doc["machine"]
    notes: dict[str, list[str]] = doc.get("notes", {})
    lines = [
        "# dsec benchmark results",
        "",
        (f"Machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}, kernel {m['kernel']}, "
        f"run {m['time']}. Written by `dsec bench`; see docs/benchmarks.md for what each "
        "figure means and its target."),
        "",
    ]
    by_suite: dict[str, list[dict[str, Any]]] = {}
    for r in doc["results"]:
        by_suite.setdefault(r["suite"], []).append(r)
    for s, rows in sorted(by_suite.items()):
        lines += [f"## {s}", "", "| name | value | unit | params |", "|---|---:|---|---|"]
        for r in rows:
            params = ", ".join(f"{k}={v}" for k, v in r["params"].items())
            lines.append(f"| {r['name']} | {_fmt(r['value'])} | {r['unit']} | {params} |")
        for n in notes.get(s, []):
            lines += ["", f"- {n}"]
        if s in errors:
            lines += ["", f"**suite failed:** {errors[s]}"]
        lines.append("")
    for s, e in errors.items():
        if s not in by_suite:
            lines += [f"## {s}", "", f"**suite failed:** {e}", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def _fmt(v: float) -> str:
    if v == 0 or abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 1:
        return f"{v:,.2f}"
    return f"{v:.4g}"
