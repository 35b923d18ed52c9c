"""Red team 25 A1: one idle BE sandbox with a large declared cap starves every other BE
sandbox on the node, while the BE budget and the CPUs sit idle.

``ContainerBackend._set_be_cap`` shares the suppressor's BE cap among the live BE
sandboxes *in proportion to their declared caps* (``cpu_quota_milli or cpu_milli``),
not to what they use. ``cpu_quota_milli`` is tenant-chosen up to 1,024 cores
(``MAX_CPU_MILLI``). A tenant creates one BE sandbox with ``cpu_quota_milli=1024000``
and leaves it idle: the busy BE sandbox of another tenant (1 core) is then allowed
cap x 1/1025 - about 0.001 core of a 1.3-core BE budget on this 2-core node - and the
budget it cannot use goes to nobody. Many idle (or paused) BE sandboxes with ordinary
caps do the same more slowly (100 idle 1-core sandboxes: the busy one gets 1 %).

Without suppression the same two sandboxes would share the node by CFS weight and the
busy one would get its full core: suppression, on by default, turns a cheap create call
into a node-wide BE denial of service.

Fix: share the cap by demand, not by declaration - e.g. water-filling on each BE
sandbox's usage in the last interval (an idle or frozen sandbox keeps a small floor and
gets more back at the next tick when it wakes), or clamp the weight of each sandbox to
min(own cap, node cores) and leave frozen ones out.
"""

from __future__ import annotations

import asyncio
import os
import time

import msgspec
import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.wire.spec import MAX_CPU_MILLI
from tests.edge.container.conftest import SPEC, _cleanup, new_sid

pytestmark = pytest.mark.root


def _allowed(d: str) -> float:
    with open(os.path.join(d, "cpu.cfs_quota_us")) as f:
        q = int(f.read())
    with open(os.path.join(d, "cpu.cfs_period_us")) as f:
        p = int(f.read())
    return q / p


@pytest.mark.serial
async def test_idle_be_sandbox_with_huge_cap_does_not_starve_busy_be(
        tmp_path: object, images_dir: str) -> None:
    backend = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                               images=DirectoryImages(images_dir), be_cpu_threshold=0.65)
    try:
        gov = backend.governor
        if gov.version != 1 or not gov.layout.be_cpu:
            pytest.skip("BE suppression caps through the v1 BE parent's sandboxes")
        busy, idle = new_sid(), new_sid()
        await backend.create(busy, msgspec.structs.replace(SPEC, qos="be", cpu_milli=1000))
        # another tenant's sandbox: idle, but declaring the largest cap the spec allows
        await backend.create(idle, msgspec.structs.replace(
            SPEC, qos="be", cpu_milli=100, cpu_quota_milli=MAX_CPU_MILLI))
        sup = backend._suppress
        assert sup is not None
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and sup.cap is None:
            await asyncio.sleep(0.05)
        assert sup.cap is not None
        await asyncio.sleep(0.6)     # two more ticks
        cap = sup.cap
        got = _allowed(backend.box(busy).cg.dirs["cpu"])
        # the idle sandbox uses ~nothing: the busy one may have what the cap leaves,
        # up to its own 1 core (half of it, to leave room for noise)
        want = min(1.0, cap)
        assert got >= 0.5 * want, (
            f"busy BE sandbox allowed {got:.4f} cores of a {cap:.3f}-core BE cap "
            f"(the idle one's declared 1024 cores take the rest)")
    finally:
        await _cleanup(backend)
