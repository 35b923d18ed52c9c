"""Lifetimes on the real backends (issue 19): the TTL clock stops while paused and an
idle pause says ``idle``, on the container backend (a real freezer) and on fncall (whose
pause frees nothing): the rule lives in the node, these hold it to every backend."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest

from dsec.edge.admission import Capacity
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.backends.fncall import FncallBackend
from dsec.edge.clock import FakeClock
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.wire.spec import ExecRequest, SandboxSpec

from .conftest import _cleanup

pytestmark = pytest.mark.root

CMD = {"container": ExecRequest(shell="echo up"),
       "fncall": ExecRequest(shell="print('up')")}


@pytest.fixture(params=["container", "fncall"])
async def node(request: pytest.FixtureRequest, tmp_path: object,
               images_dir: str) -> AsyncIterator[tuple[EdgeNode, FakeClock, str]]:
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    kind: str = request.param
    backend: ContainerBackend | FncallBackend
    if kind == "container":
        backend = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                                   images=DirectoryImages(images_dir))
    else:
        backend = FncallBackend(pool_size=1, root=os.path.join(str(tmp_path), "fn"))
    clock = FakeClock()
    cfg = NodeConfig(node_id="t1", capacity=Capacity(cpu_milli=64_000, memory_bytes=64 << 30,
                                                     max_sandboxes=64))
    n = EdgeNode(cfg, backend, clock=clock)  # type: ignore[arg-type]
    await n.start()
    try:
        yield n, clock, kind
    finally:
        await n.close()
        if isinstance(backend, ContainerBackend):
            await _cleanup(backend)
        else:
            await backend.close()


async def test_paused_sandbox_keeps_its_ttl_and_idle_pause_says_idle(
        node: tuple[EdgeNode, FakeClock, str]) -> None:
    n, clock, kind = node
    a = await n.create(SandboxSpec(backend=kind, ttl_s=4))     # type: ignore[arg-type]
    clock.advance(1)
    await n.pause(a.id)
    clock.advance(30)
    assert await n.reap() == []
    assert n.get(a.id).state == "paused" and n.get(a.id).ttl_left_s == pytest.approx(3)
    assert (await n.exec(a.id, CMD[kind])).stdout.strip() == b"up"   # resumes it
    assert n.get(a.id).expires_at == pytest.approx(clock.time() + 3)
    b = await n.create(SandboxSpec(backend=kind, idle_timeout_s=2,   # type: ignore[arg-type]
                                   idle_action="pause"))
    clock.advance(3.5)
    done = {(x.sandbox_id, x.action, x.reason) for x in await n.reap()}
    assert done == {(a.id, "destroy", "ttl"), (b.id, "pause", "idle")}
    assert n.get(a.id).state == "destroyed" and n.get(a.id).reason == "ttl"
    assert n.get(b.id).state == "paused" and n.get(b.id).paused_reason == "idle"
    await n.destroy(b.id)
