"""Suite ``faults``: what survives kill -9, overload and restarts, counted.

The suite is assembled from parts, one module per kind of fault (``durability``,
``overload``, ``recovery``, ...): each module registers its measurements with
:func:`part`, and the suite runs every registered part in name order. A part records
counts of what was lost or leaked (targets are 0) and times to recover; it cleans up
after itself whatever happens, and a part that fails does not stop the others (its
error is recorded as a note).

Needs root for the container parts; a part that cannot run here says so in a note.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable

from dsec.bench import BenchContext, suite

__all__ = ["PartFn", "part", "parts"]

PartFn = Callable[[BenchContext], None]
_PARTS: dict[str, PartFn] = {}


def part(name: str) -> Callable[[PartFn], PartFn]:
    """Register ``fn`` as one part of the ``faults`` suite."""
    def deco(fn: PartFn) -> PartFn:
        _PARTS[name] = fn
        return fn
    return deco


def parts() -> dict[str, PartFn]:
    """Every registered part (imports every module of this package once)."""
    for mod in pkgutil.iter_modules(__path__):
        if not mod.name.startswith("_"):
            importlib.import_module(f"{__name__}.{mod.name}")
    return dict(sorted(_PARTS.items()))


@suite("faults")
def faults_suite(ctx: BenchContext) -> None:
    """Kill -9, overload and restart: acknowledged work lost, leaks, recovery times."""
    for name, fn in parts().items():
        try:
            fn(ctx)
        except Exception as exc:  # noqa: BLE001 - one broken part must not lose the others
            ctx.note(f"faults part {name} failed: {type(exc).__name__}: {exc}")
