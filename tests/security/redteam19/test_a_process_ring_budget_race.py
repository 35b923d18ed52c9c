"""``ProcessTable.start`` checks the node's ring budget (``_make_room``) *before* it
awaits the backend's spawn and reserves the ring only *after*: concurrent starts all
pass the check, then all reserve. On the container backend the spawn waits for the
zygote's ``Running`` reply, so N ``process_start`` calls sent at once (one member key,
any door) each get a ring although the budget holds only a few: the edge's ring memory
(1 MiB per process by default, filled by whatever the process prints) is bounded by the
exec caps (up to half of RLIMIT_NOFILE/8 per tenant), not by ``ring_budget``. The same
check-then-await-then-commit shape: ``per_sandbox`` (the table length is checked before
the await too).

Below: a budget of 4 rings, 12 starts at once in one container sandbox: at most 4 may
run, and the reserved bytes must never exceed the budget."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest

from dsec.edge.admission import Capacity
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.edge.processes import ProcessLimits
from dsec.errors import CapacityExceeded, RateLimited
from dsec.wire.spec import ExecRequest, SandboxSpec
from tests.edge.container.conftest import _cleanup

pytestmark = pytest.mark.root

RING = 64 << 10


@pytest.fixture
async def node(tmp_path: object, images_dir: str) -> AsyncIterator[EdgeNode]:
    if os.geteuid() != 0:
        pytest.fail("needs root (CI runs as root)")
    backend = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                               images=DirectoryImages(images_dir))
    cfg = NodeConfig(node_id="r19", capacity=Capacity(cpu_milli=64_000,
                                                      memory_bytes=64 << 30,
                                                      max_sandboxes=8))
    n = EdgeNode(cfg, backend)
    await n.start()
    n.processes.limits = ProcessLimits(per_sandbox=32, ring_bytes=RING,
                                       ring_budget=4 * RING)
    try:
        yield n
    finally:
        await n.close()
        await _cleanup(backend)


async def test_concurrent_starts_stay_within_the_ring_budget(node: EdgeNode) -> None:
    sid = (await node.create(SandboxSpec(backend="container", memory_bytes=256 << 20,
                                         pids_max=256))).id
    res = await asyncio.gather(*[node.processes.start(sid, ExecRequest(argv=("sleep", "30")))
                                 for _ in range(12)], return_exceptions=True)
    ok = [r for r in res if not isinstance(r, BaseException)]
    bad = [r for r in res if isinstance(r, BaseException)
           and not isinstance(r, (CapacityExceeded, RateLimited))]
    assert not bad, bad
    reserved = node.processes.reserved_bytes
    assert len(ok) <= 4 and reserved <= 4 * RING, (
        f"12 concurrent process_start calls got {len(ok)} rings reserved ({reserved} "
        f"bytes) past a ring budget of {4 * RING} bytes (4 rings): the budget is checked "
        "before the spawn's await and reserved after it")
