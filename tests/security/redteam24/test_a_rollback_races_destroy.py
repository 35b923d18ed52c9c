"""Red team 24 A1: a create's roll-back (``_abort_create_now``, now run to its end as a
shielded task) and a client's destroy of the same id both finish the sandbox.

A create with a client-chosen id fails in the backend; the roll-back moves the record
to ``failed`` and awaits ``backend.destroy``. The state table allows ``failed ->
destroying`` (a retry), so a destroy of that id that arrives meanwhile starts a second
teardown. Whichever ends second finds the record already finished: the roll-back
tombstones a record that is still ``destroying`` (journal.end of a non-final state),
and the destroy's ``del self._live[id]`` raises a raw ``KeyError`` at the client, and
both call ``backend.destroy`` at once (see D1 for what that does on the vm tier). The
race predates ``_to_the_end``; the shielding keeps it: the roll-back's tail now always
runs, also after its caller left.

Fixed: a roll-back in flight owns the record (``_Sandbox.ending``); a destroy waits for
it, then is answered as a destroy of an ended sandbox is. Suggested were - ``destroy`` of a sandbox whose create is
being rolled back waits for that roll-back (e.g. a ``rec.busy`` future set with the
``fail`` move) and answers with its tombstone, or the table gets a ``rolling_back``
state that refuses ``destroy``; and the finishing steps use ``_live.pop(id, None)``
and check the state before tombstoning.
"""

from __future__ import annotations

import asyncio

from dsec.edge.backends.simulated import SimulatedBackend
from dsec.errors import BackendError, DsecError
from dsec.wire.spec import SandboxSpec
from tests.edge.conftest import make_node

SID = "sb-00000000abcd-n1"


class SlowTeardown(SimulatedBackend):
    """Create fails after allocating; destroy takes a while (a real umount/rmtree)."""

    async def create(self, sid, spec):  # type: ignore[no-untyped-def]
        await super().create(sid, spec)
        raise BackendError("mount failed after allocating")

    destroys = 0

    async def destroy(self, sid):  # type: ignore[no-untyped-def]
        self.destroys += 1
        await asyncio.sleep(0.05)
        await super().destroy(sid)


async def test_destroy_during_create_rollback_is_clean() -> None:
    backend = SlowTeardown()
    async with make_node(backend) as node:
        create = asyncio.ensure_future(node.create(SandboxSpec(), sandbox_id=SID))
        for _ in range(200):      # until the roll-back is inside backend.destroy
            rec = node._live.get(SID)
            if rec is not None and rec.state == "failed":
                break
            await asyncio.sleep(0)
        assert node._live[SID].state == "failed"
        destroy = asyncio.ensure_future(node.destroy(SID))
        res = await asyncio.gather(create, destroy, return_exceptions=True)
        # the create fails with the backend's error; the destroy either answers with
        # the tombstone or a typed error - never a raw KeyError from the node's tables
        assert isinstance(res[0], DsecError), res[0]
        assert not isinstance(res[1], BaseException) or isinstance(res[1], DsecError), \
            repr(res[1])
        # the roll-back ended it (its tombstone: failed, create_failed - as any rolled
        # back create); the destroy waited for it, started no second teardown
        final = node.get(SID)
        assert (final.state, final.reason) == ("failed", "create_failed"), final
        assert SID not in node._live and node.pool.held == frozenset()
        evs = [(e.from_state, e.to_state) for e in node.events(SID)]
        assert "destroying" not in [t for _, t in evs], evs
        assert backend.destroys == 1, backend.destroys
