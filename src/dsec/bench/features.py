"""Suite ``features`` (issue 19): what E2B/Modal/Daytona users do every day, measured.

Each stream of issue 19 measures its own part in its own module; this table runs them in
order (one line per part), each part recording its figures on the same context. A part
that fails is noted and the others still run.
"""

from __future__ import annotations

import importlib
import logging

from dsec.bench import BenchContext, suite

__all__ = ["PARTS", "features"]

log = logging.getLogger(__name__)

#: "module:function" of each part, in run order
PARTS: list[str] = [
    "dsec.bench.processes:terminals",    # proc: PTY keystroke round trip, exec_stream first byte
    "dsec.bench.features_files:files",   # files: transfer MB/s both ways vs cat (issue 19)
    "dsec.bench.ui:ui_page_load",        # ui: the dashboard's pages with 10,000 sandboxes
]


@suite("features")
def features(ctx: BenchContext) -> None:
    """Issue 19's everyday features: file transfer, processes, terminals, lifetimes."""
    failed = []
    for part in PARTS:
        mod, _, fn = part.partition(":")
        try:
            getattr(importlib.import_module(mod), fn)(ctx)
        except Exception as exc:
            log.exception("features part %s failed", part)
            ctx.note(f"part {part} failed: {type(exc).__name__}: {exc}")
            failed.append(part)
    if failed:
        raise RuntimeError(f"features parts failed: {', '.join(failed)}")
