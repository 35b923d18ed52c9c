"""Red team 24 B3: BE caps scaled by suppression outlive an edge killed with -9; a
restarted edge without suppression (turned off, or the BE parent gone) adopts the
sandboxes and never writes their own caps back - each keeps what the suppressor last wrote (down to
1 ms per 100 ms, 0.01 core) for the rest of its life.

The caps live in the kernel (``cpu.cfs_quota_us`` per sandbox), not in any record;
``close()`` restores them (``release``), a kill -9 does not, and ``adopt`` re-applies
nothing. (With suppression still on the first tick rewrites every cap, since
``_be_quota`` starts empty - that case holds.)

Repro: a backend with suppression creates a BE sandbox; the suppressor's setter caps it
to the floor (as a tick on a busy node does); the edge then "dies" (its timer stopped,
nothing released - what kill -9 leaves); a backend on the same root without suppression
adopts the sandbox.

Fix: ``adopt`` writes the sandbox's own CPU cap from its spec (``qos_writes``/
``limit_writes``' quota) whatever the suppression setting; the suppressor then scales
from there.
"""

from __future__ import annotations

import os

import msgspec
import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from tests.edge.container.conftest import SPEC, _cleanup, new_sid

pytestmark = pytest.mark.root


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


async def test_adopted_be_sandbox_gets_its_own_cap_back(
        tmp_path: object, images_dir: str) -> None:
    root = os.path.join(str(tmp_path), "root")
    b1 = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir),
                          be_cpu_threshold=0.65)
    b2: ContainerBackend | None = None
    try:
        gov = b1.governor
        if gov.version != 1 or not gov.layout.be_cpu:
            pytest.skip("BE suppression caps through the v1 BE parent's sandboxes")
        sid = new_sid()
        spec = msgspec.structs.replace(SPEC, qos="be", cpu_milli=500)
        await b1.create(sid, spec)
        quota = os.path.join(b1.box(sid).cg.dirs["cpu"], "cpu.cfs_quota_us")
        assert _read(quota) == "50000"
        b1._set_be_cap(0.02)                 # a tick on a busy node
        assert _read(quota) == "2000"        # 0.02 cores of its 0.5
        # kill -9: the timer dies with the process, nothing is released
        if b1._suppress_timer is not None:
            b1._suppress_timer.cancel()
            b1._suppress_timer = None
        b1._suppress = None
        await b1.close()                    # sandboxes stay for adoption
        b2 = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir))
        await b2.reconcile({sid})
        assert await b2.adopt(sid, spec)
        assert _read(quota) == "50000", "the adopted BE sandbox kept the scaled cap"
    finally:
        await _cleanup(b2 or b1)
