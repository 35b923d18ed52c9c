"""The sync client's loop thread ends as ``asyncio.run`` ends a loop: tasks still pending
(a process handle's follower, the close a generator left behind) are cancelled and
awaited and async generators finalized before the loop closes. Before, `dsec sandbox
attach` printed "Task was destroyed but it is pending!" at exit now and then (CI)."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from dsec.client.sync import _Loop


def test_stopping_the_loop_leaves_no_task_or_generator_pending(
        caplog: pytest.LogCaptureFixture) -> None:
    lp = _Loop()
    closed: list[str] = []

    async def gen() -> object:
        try:
            yield 1
            yield 2
        finally:
            await asyncio.sleep(0)          # a close that needs the loop
            closed.append("gen")

    async def begin() -> object:
        g = gen()
        await anext(g)                      # suspended at a yield: needs aclose()
        return g

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            closed.append("task")

    g = lp.run(begin())
    asyncio.run_coroutine_threadsafe(forever(), lp.loop)
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        lp.stop()
        del g
        gc.collect()
    assert lp.loop.is_closed()
    assert sorted(closed) == ["gen", "task"], closed
    assert not [r for r in caplog.records if "destroyed" in r.getMessage()], caplog.text
