"""Red team B (issue 19, lifetimes): a paused sandbox is never reaped, at all.

Since ``life`` the TTL clock stops while a sandbox is paused, and nothing else bounds how
long a sandbox may stay paused. Sandboxes now outlive their client by default, so:

- a sandbox created with ``idle_timeout_s`` + ``idle_action="pause"`` (and a TTL) that its
  client forgets is idle-paused by the edge itself and then lives forever: no TTL, no
  sweeper, still holding its project's sandbox count and memory quota and its upper
  layer's disk. Before ``life`` its TTL reaped it (event ``ttl``);
- any client that pauses and exits leaks the sandbox the same way (the 6 h default TTL the
  apiserver gives every sandbox stops meaning anything once it is paused).

The peers bound it (E2B keeps a paused sandbox a bounded time). Whatever the bound a fix
picks, a sandbox nobody touched for more than :data:`MAX_TTL_S` (30 days, the longest
lifetime anyone may ask for) plus its TTL must be gone, with an event that says why.
"""

from __future__ import annotations

from dsec.edge.clock import FakeClock
from dsec.edge.node import EdgeNode
from dsec.wire.spec import MAX_TTL_S, SandboxSpec
from tests.edge.conftest import clock, node  # noqa: F401  (pytest fixtures)


async def test_b_an_idle_paused_sandbox_is_not_immortal(clock: FakeClock,  # noqa: F811
                                                        node: EdgeNode) -> None:  # noqa: F811
    info = await node.create(SandboxSpec(ttl_s=60, idle_timeout_s=5, idle_action="pause"))
    clock.advance(6)
    await node.reap()
    assert node.get(info.id).state == "paused"        # the edge paused it, nobody asked
    for _ in range(40):                               # nobody ever comes back
        clock.advance((MAX_TTL_S + 60) / 20)
        await node.reap()
    got = node.get(info.id)
    assert got.state in ("destroyed", "destroying"), (
        f"{info.id} asked ttl_s=60, was idle-paused by the edge and is still "
        f"{got.state} {2 * (MAX_TTL_S + 60) / 86400:.0f} days later "
        f"(ttl_left_s={got.ttl_left_s})")


async def test_b_a_paused_and_forgotten_sandbox_is_not_immortal(clock: FakeClock,  # noqa: F811
                                                                node: EdgeNode) -> None:  # noqa: F811
    info = await node.create(SandboxSpec(ttl_s=6 * 3600))   # the apiserver's default TTL
    await node.pause(info.id)                               # ... and the client exits
    for _ in range(40):
        clock.advance((MAX_TTL_S + 6 * 3600) / 20)
        await node.reap()
    got = node.get(info.id)
    assert got.state in ("destroyed", "destroying"), (got.state, got.ttl_left_s)
