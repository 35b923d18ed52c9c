"""Run a cluster in the foreground until SIGINT or SIGTERM: what ``dsec up`` and
``dsec apiserver`` share (they differ only in what they print while it runs).

Order, and why: the signal handlers go in before the runtime starts, so a Ctrl-C during a
slow start (edges booting, journals re-adopted) is not lost: the start finishes, then the
runtime stops at once. A start that fails is reported through ``failed`` and exits 1 (the
runtime has already undone itself, see :meth:`ClusterRuntime.start`). Whatever ends the
wait (a signal, an exception in ``serve``), ``stopping`` runs and then the runtime stops:
sandboxes destroyed, or kept with ``ClusterConfig.keep``.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Sequence

from dsec.cluster.runtime import ClusterConfig, ClusterRuntime

__all__ = ["run_until_signalled"]


async def _wait(rt: ClusterRuntime, stop: asyncio.Event) -> None:
    await stop.wait()


async def run_until_signalled(
    cfg: ClusterConfig, *,
    failed: Callable[[Exception], None],
    started: Callable[[ClusterRuntime], None],
    serve: Callable[[ClusterRuntime, asyncio.Event], Awaitable[None]] = _wait,
    stopping: Callable[[ClusterRuntime], Awaitable[None]] | None = None,
    signals: Sequence[signal.Signals] = (signal.SIGINT, signal.SIGTERM),
) -> None:
    """Start a :class:`ClusterRuntime` of ``cfg``, announce it (``started``), run
    ``serve(rt, stop)`` (default: wait for ``stop``, set by any of ``signals``), then
    ``stopping(rt)`` and stop the runtime. A start that raises is passed to ``failed``
    and ends in ``SystemExit(1)``."""
    rt = ClusterRuntime(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        try:
            await rt.start()
        except Exception as exc:
            failed(exc)
            raise SystemExit(1) from exc
        started(rt)
        try:
            await serve(rt, stop)
        finally:
            if stopping is not None:
                await stopping(rt)
            await rt.stop()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
