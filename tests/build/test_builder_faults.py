"""The builder under faults: a cancelled build destroys its build sandbox; the step cache
survives kill -9 of the whole cluster (it is the layer store)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from dsec import Image, LocalCluster
from tests.build.conftest import Debian

pytestmark = [pytest.mark.root, pytest.mark.slow]


async def test_a_cancelled_build_destroys_its_build_sandbox(debian: Debian) -> None:
    image = Image.from_image(debian.image).run("touch /marker; sleep 120")
    async with debian.cluster.async_client() as c:
        task = asyncio.create_task(image.build_async(c))

        async def building() -> list[str]:
            return [s.id for s in await c.sandboxes.list()
                    if s.info.spec.labels.get("dsec.io/build")]

        deadline = time.monotonic() + 30
        while not await building():
            assert time.monotonic() < deadline, "no build sandbox appeared"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)           # the exec is running now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await building() == []


def test_the_step_cache_survives_kill_9_of_the_cluster(tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    image = Image.from_image("base").run("echo one > /one").run(["sh", "-c", "echo 2 > /2"])
    with LocalCluster(edges=1, backend="container", subprocess=True, state_dir=state) as cl:
        with cl.client() as c:
            first = image.build(c)
        assert (first.ran, first.cached) == (2, 0)
        os.kill(cl._proc.pid, signal.SIGKILL)   # the build answered; now the machine dies
        cl._proc.wait()
    with LocalCluster(edges=1, backend="container", subprocess=True, state_dir=state) as cl, \
            cl.client() as c:
        again = image.build(c)
        assert (again.ran, again.cached, again.top) == (0, 2, first.top)
        with c.sandboxes.create(**again.create_args()) as sb:
            assert sb.exec("cat /one /2").stdout == b"one\n2\n"
        # a cache entry whose layer is gone is a miss, not an error
        c.snapshots.delete(again.top)
        third = image.build(c)
        assert (third.ran, third.cached) == (1, 1)


async def test_a_build_interrupted_inside_create_leaves_no_sandbox(
        debian: Debian, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cancellation lands after the server made the build sandbox but before its id
    came back (injected: the real create runs, then the caller is cancelled)."""
    image = Image.from_image(debian.image).run("touch /never")
    async with debian.cluster.async_client() as c:
        real = c.sandboxes.create

        async def create_then_cancelled(**kw: object) -> object:
            await real(**kw)  # type: ignore[arg-type]
            raise asyncio.CancelledError

        monkeypatch.setattr(c.sandboxes, "create", create_then_cancelled)
        with pytest.raises(asyncio.CancelledError):
            await image.build_async(c)
        left = [s.id for s in await c.sandboxes.list()
                if s.info.spec.labels.get("dsec.io/build")]
        assert left == []
