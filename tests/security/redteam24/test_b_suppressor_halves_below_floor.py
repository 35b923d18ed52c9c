"""Red team 24 B2: ``CpuSuppressor.tick`` halves the cap on a saturated node after
``be_cpu_cap`` applied the policy's floor, so the cap falls through ``floor_cores``
towards zero (0.02 -> 0.01 -> 0.005 ... one halving per quarter second) - the policy
promises "never below ``floor_cores`` (BE always makes some progress)".

Pure: injected readers, a node whose busy time is 2 cores every interval and whose BE
sandboxes use nothing (host work saturates it).

Fix: ``cap = max(policy.floor_cores, min(cap, self.cap * 0.5))``.
"""

from __future__ import annotations

from dsec.edge.qos import CpuSuppressor, CpuSuppressPolicy


def test_saturated_node_keeps_be_at_its_floor() -> None:
    t = [0.0]
    busy = [0]
    caps: list[float | None] = []
    policy = CpuSuppressPolicy(threshold=0.65, floor_cores=0.02, interval_s=0.25)
    sup = CpuSuppressor(cores=2.0, busy_ns=lambda: busy[0], be_ns=lambda: 0,
                        set_cap=caps.append, clock=lambda: t[0], policy=policy)
    for _ in range(20):
        sup.tick()
        t[0] += 0.25
        busy[0] += int(2.0 * 0.25 * 1e9)     # both cores busy with non-BE work
    assert sup.cap is not None
    assert sup.cap >= policy.floor_cores, (sup.cap, caps)
