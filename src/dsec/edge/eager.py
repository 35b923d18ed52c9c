"""Run coroutines eagerly: step them inline and pay for a task only if they really wait.

``asyncio.gather`` over N coroutines creates N tasks. With the simulated zero profile a
whole create or destroy finishes without ever suspending, and the burst benchmark does
100k of each, so a task apiece would cost more than the work (measured: a task
round trip is several microseconds on the dev VM, the create path itself ~10 us).
:func:`gather_eager` first steps each coroutine once; those that finish are done, and
only those that yielded a future are wrapped (:func:`_resume`) into a task that carries
on from exactly where they stopped. This is the 3.12 ``eager_task_factory`` idea,
limited to the batch calls that need it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator, Sequence
from typing import Any, TypeVar

__all__ = ["gather_eager"]

T = TypeVar("T")


class _Yield:
    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __await__(self) -> Generator[Any, Any, Any]:
        return (yield self.obj)


async def _resume(coro: Coroutine[Any, Any, T], yielded: Any) -> T:
    """Continue a coroutine that already ran up to its first suspension point."""
    while True:
        try:
            value = await _Yield(yielded)
        except BaseException as exc:  # noqa: BLE001 - thrown in by the task, pass it on
            try:
                yielded = coro.throw(exc)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
        else:
            try:
                yielded = coro.send(value)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]


async def gather_eager(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T | BaseException]:
    """Run ``coros`` concurrently; results or exceptions in order (never raises theirs)."""
    out: list[Any] = [None] * len(coros)
    pending: list[tuple[int, asyncio.Task[T]]] = []
    loop = asyncio.get_running_loop()
    for i, coro in enumerate(coros):
        try:
            yielded = coro.send(None)
        except StopIteration as stop:
            out[i] = stop.value
        except Exception as exc:  # noqa: BLE001 - reported in place
            out[i] = exc
        else:
            pending.append((i, loop.create_task(_resume(coro, yielded))))
    if pending:
        try:
            await asyncio.wait([t for _, t in pending])
        except asyncio.CancelledError:
            for _, t in pending:
                t.cancel()
            raise
        for i, t in pending:
            err = t.exception()
            out[i] = err if err is not None else t.result()
    return out
