"""Red team 24 B1: BE suppression's cap is not a cap once a tenant has many BE
sandboxes - each one keeps at least 1 ms per 100 ms period (0.01 core), so N of them
take N x 0.01 cores whatever the suppressor decided.

``ContainerBackend._set_be_cap`` shares the BE cap among the live BE sandboxes by
scaling each one's ``cpu.cfs_quota_us``; ``max(1, ...)`` milli and
``Governor.set_cpu_quota``'s ``max(1000, ...)`` us (the kernel's smallest quota) put a
floor of 0.01 core under each. With the node busy (two host spinners: everything not
BE counts as LS) the suppressor's cap falls to ``floor_cores`` (0.02), but 12 idle BE
sandboxes are still allowed 0.12 cores together - 6x the cap; 200 would be allowed the
whole 2-core node. A BE tenant escapes suppression by creating sandboxes instead of
forking.

Fix: when the per-sandbox share would fall below the kernel's 1 ms quota, lengthen
``cpu.cfs_period_us`` of the suppressed sandboxes (v1 allows up to 1 s: 1 ms/1 s =
0.001 core) or throttle only the busiest k sandboxes and freeze/give 0 to the rest; at
least count the floor: cap = max(policy floor, n x 0.01) must be reported, not hidden.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import msgspec
import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from tests.edge.container.conftest import SPEC, _cleanup, new_sid

pytestmark = pytest.mark.root

N = 12


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


@pytest.mark.serial
async def test_many_be_sandboxes_stay_within_the_suppressed_cap(
        tmp_path: object, images_dir: str) -> None:
    backend = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                               images=DirectoryImages(images_dir), be_cpu_threshold=0.65)
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        gov = backend.governor
        if gov.version != 1 or not gov.layout.be_cpu:
            pytest.skip("BE suppression caps through the v1 BE parent's sandboxes")
        sids = [new_sid() for _ in range(N)]
        for sid in sids:
            await backend.create(sid, msgspec.structs.replace(SPEC, qos="be", cpu_milli=100))
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])  # noqa: ASYNC220
                for _ in range(2)]
        sup = backend._suppress
        assert sup is not None
        deadline = time.monotonic() + 8.0
        while time.monotonic() < deadline and (sup.cap is None or sup.cap > 0.05):
            await asyncio.sleep(0.1)
        assert sup.cap is not None and sup.cap <= 0.05, sup.cap
        await asyncio.sleep(0.6)     # two more ticks: every sandbox re-capped
        cap = sup.cap
        allowed = 0.0
        for sid in sids:
            d = backend.box(sid).cg.dirs["cpu"]
            allowed += int(_read(os.path.join(d, "cpu.cfs_quota_us"))) / int(
                _read(os.path.join(d, "cpu.cfs_period_us")))
        # what the BE sandboxes may use together is what the suppressor decided
        assert allowed <= cap * 1.1 + 0.005, (allowed, cap)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        await _cleanup(backend)
