"""B3: the per-tenant reply budget (dsec.control.replybudget) bounds what calls *reserve*,
not the bytes a tenant's unread replies hold. An exec reserves 64 KiB + 4 KiB
(``reply_exec_reserve_bytes``) whatever its output cap, and ``exec_many`` 1 MiB for up
to ``max_exec_batch`` (1,024) results; the real sizes are charged only when the replies
arrive. So a tenant with a budget of B starts B / 68 KiB execs (15,420 at the 1 GiB
default; the edges' per-tenant exec caps are the only other bound) each of whose replies
can be 2 x 4 MiB: the apiserver then holds ~120x the budget for one tenant, every byte
admitted, before the first wait. The module says "overshoot once"; once is enough to take
the apiserver (the budget's stated purpose: "could take every other tenant's apiserver
with it").

Repro: a budget of 1 MiB; 16 concurrent execs of one tenant, each printing 1 MiB, whose
replies are not yet written (a door keeps their leases: ``hold_replies``, as the gateway
does for a peer that does not read). The tenant ends up holding 16 MiB, 16x its budget.
Secure behaviour: what a tenant holds stays within a small factor of its budget (an
exec whose reply would not fit reserves its worst case, or waits)."""

from __future__ import annotations

import asyncio

import pytest

from dsec import LocalCluster
from dsec.bench._e2b_calls import E2BTarget
from dsec.control.replybudget import hold_replies
from dsec.wire import ops
from dsec.wire.calls import ExecCall
from dsec.wire.spec import ExecRequest

pytestmark = pytest.mark.root

LIMIT = 1 << 20


def test_a_tenants_unread_exec_replies_stay_near_its_budget(
        e2b_cluster: LocalCluster, e2b_target: E2BTarget,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import Sandbox

    service = e2b_cluster.runtime.service
    monkeypatch.setattr(service.replies.budget, "limit_bytes", LIMIT)
    monkeypatch.setattr(service.replies, "wait_s", 2.0)
    sb = Sandbox.create(e2b_target.template, timeout=120, **e2b_target.opts())
    try:
        held: list[int] = []

        async def flood() -> None:
            caller = service.authenticate(f"Bearer {e2b_target.api_key}")
            policy = service.handler(ops.EXEC)
            req = ExecRequest(argv=("/bin/sh", "-c", "head -c 1048576 /dev/zero"),
                              output_cap_bytes=2 << 20)
            with hold_replies() as leases:      # replies not written yet
                results = await asyncio.gather(
                    *(policy(caller, ExecCall(id=sb.sandbox_id, req=req))
                      for _ in range(16)), return_exceptions=True)
                held.append(service.replies.budget.held("default"))
            for lease in leases:
                lease.release()
            ok = [r for r in results if not isinstance(r, BaseException)]
            held.append(sum(len(r.stdout) for r in ok))

        asyncio.run_coroutine_threadsafe(flood(), e2b_cluster._loop).result(120)
        assert held[0] <= 2 * LIMIT, (
            f"one tenant holds {held[0]} bytes of unwritten replies against a reply "
            f"budget of {LIMIT} ({held[0] / LIMIT:.0f}x; {held[1]} bytes of output "
            "admitted)")
    finally:
        sb.kill()
