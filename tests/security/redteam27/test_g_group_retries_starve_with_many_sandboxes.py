"""The limits timer retries pending lowerings and retired groups' removal (red team 26
B and G) "once per pass over the boxes": `_settle_groups()` runs when
`self._poll_next % len(boxes) == 0`. With more than _POLL_SLICE (256) sandboxes a tick
checks 256 of them and `_poll_next` advances by 256, so the condition holds only when
256 x ticks is a multiple of the box count: every len/gcd(len, 256) ticks. With 257
sandboxes that is every 257 ticks of ~5 s (limits_poll_s x 256/257): a pending group
keeps its departed member's limit, and a retired group its memcg, for ~21 minutes
instead of ~10 s; 10,001 sandboxes (the density target): 10,001 ticks of 0.128 s,
~21 minutes; a count that changes meanwhile can skip it for longer.

Repro: a real grouped backend whose table holds 257 sandboxes (stubs the tick skips:
dying) and one pending group; 257 timer ticks (~21 minutes of timer time, run back to
back) call `_settle_groups` once.

Fix: settle when a tick wraps around (start + len(chunk) >= len(boxes)), or on its own
timer.
"""

from __future__ import annotations

import types

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.edge.memgroups import MemoryGroup

pytestmark = [pytest.mark.root]


async def test_settle_runs_about_once_per_pass(grouped: ContainerBackend) -> None:
    b = grouped
    n = 257
    stubs = {f"stub-{i}": types.SimpleNamespace(dying=True, init_pid=0)
             for i in range(n)}
    real = dict(b._boxes)
    calls = []
    settle = b._settle_groups
    b._settle_groups = lambda: calls.append(1)   # type: ignore[method-assign]
    g = MemoryGroup("/nonexistent/+mg-stub-0", ("p", "bu"), pending=True)
    b._memgroups.groups[g.dir] = g
    try:
        b._boxes.clear()
        b._boxes.update(stubs)   # type: ignore[arg-type]
        ticks = n
        for _ in range(ticks):
            b._poll_limits()
            if b._poll is not None:
                b._poll.cancel()
                b._poll = None
    finally:
        b._boxes.clear()
        b._boxes.update(real)
        b._settle_groups = settle   # type: ignore[method-assign]
        del b._memgroups.groups[g.dir]
    passes = ticks * 256 // n
    assert len(calls) >= passes // 2, (
        f"{ticks} limits-timer ticks over {n} sandboxes ({passes} passes over them, "
        f"~{ticks * 5 * 256 / n / 60:.0f} min at limits_poll_s=5) settled the memory "
        f"groups {len(calls)} time(s): pending lowerings and retired groups wait that long")
