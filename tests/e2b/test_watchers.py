"""The polling watchers' bounds (dsec.control.e2b.watchers): caps per principal and in
all, owner isolation, idle expiry, the event buffer's cap, errors after the events. The
file_watch stream is a stand-in here (the boundary these rules are about); the real one
is tests/e2b/test_sdk.py's files.watch_dir."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from dsec.control.api.service import Caller
from dsec.control.e2b.watchers import Watchers
from dsec.errors import NotFound, RateLimited, ResourceExhausted, SandboxNotFound
from dsec.wire.files import FileEvent, Watch, WatchEnd

ALICE = Caller(id="p-alice", name="alice", roles={})
BOB = Caller(id="p-bob", name="bob", roles={})
W = Watch(id="sb-000000000001-edge-0", path="/d")


def _policy(events: list[FileEvent], fail: Exception | None = None, hold: bool = True):  # type: ignore[no-untyped-def]
    async def policy(caller: Caller, w: Watch) -> AsyncIterator[FileEvent | WatchEnd]:
        async def gen() -> AsyncIterator[FileEvent | WatchEnd]:
            for e in events:
                yield e
            if fail is not None:
                raise fail
            if hold:
                await asyncio.Event().wait()
        return gen()
    return policy


async def test_caps_owner_and_expiry() -> None:
    now = [0.0]
    ws = Watchers(max_per_principal=2, max_total=3, idle_s=10, clock=lambda: now[0])
    a1 = await ws.create(ALICE, W, _policy([]))
    await ws.create(ALICE, W, _policy([]))
    with pytest.raises(RateLimited, match="principal 'alice'"):
        await ws.create(ALICE, W, _policy([]))
    await ws.create(BOB, W, _policy([]))
    with pytest.raises(RateLimited, match="3 in all"):
        await ws.create(BOB, W, _policy([]))
    with pytest.raises(NotFound):       # another principal's watcher is not there
        ws.take(BOB, a1)
    with pytest.raises(NotFound):
        ws.remove(BOB, a1)
    assert ws.take(ALICE, a1) == []
    now[0] = 11.0                        # nobody polled for 11 s: all closed
    with pytest.raises(NotFound):
        ws.take(ALICE, a1)
    assert len(ws) == 0
    await ws.close()


async def test_buffer_cap_names_and_errors_after_events() -> None:
    ws = Watchers(max_events=3)
    evs = [FileEvent(type="create", path=f"/d/sub/f{i}", name=f"f{i}") for i in range(5)]
    evs.append(FileEvent(type="overflow", path="/d"))
    wid = await ws.create(ALICE, W, _policy(evs, fail=SandboxNotFound("gone")))
    await asyncio.sleep(0.05)
    got = ws.take(ALICE, wid)
    assert [e["name"] for e in got] == ["sub/f2", "sub/f3", "sub/f4"]   # newest kept
    assert {e["type"] for e in got} == {"EVENT_TYPE_CREATE"}
    with pytest.raises(SandboxNotFound):     # the stream's error, once events are taken
        ws.take(ALICE, wid)
    with pytest.raises(NotFound):            # and the watcher is gone with it
        ws.take(ALICE, wid)


async def test_an_incomplete_watch_ends_with_an_error() -> None:
    """dsec's ``incomplete`` (the project is over its share of the node's watched
    directories, red team 22 C1) has no envd event: the watcher's events so far are
    taken, then it fails (never a watch that silently misses a subtree)."""
    ws = Watchers()
    evs = [FileEvent(type="create", path="/d/f", name="f"),
           FileEvent(type="incomplete", path="/d/sub", name="sub"),
           FileEvent(type="create", path="/d/g", name="g")]
    wid = await ws.create(ALICE, W, _policy(evs))
    await asyncio.sleep(0.05)
    assert [e["name"] for e in ws.take(ALICE, wid)] == ["f"]
    with pytest.raises(ResourceExhausted, match="stopped following '/d/sub'"):
        ws.take(ALICE, wid)
    await ws.close()


async def test_concurrent_creates_and_a_tenants_share() -> None:
    """The slot is taken before the watch is opened (concurrent creates cannot all pass
    one check), released when it cannot be opened; one tenant (the watched sandbox's
    top-level project, whatever keys it mints) holds at most half of max_total
    (red team 19, A4/A5 class)."""
    ws = Watchers(max_per_principal=100, max_total=4)
    opened = 0

    def slow(fail: bool = False):  # type: ignore[no-untyped-def]
        async def policy(caller: Caller, w: Watch) -> AsyncIterator[FileEvent | WatchEnd]:
            nonlocal opened
            await asyncio.sleep(0.05)          # the edge's answer
            if fail:
                raise SandboxNotFound("gone")
            opened += 1
            it: AsyncIterator[FileEvent | WatchEnd] = await _policy([])(caller, w)
            return it
        return policy

    res = await asyncio.gather(*[ws.create(ALICE, W, slow()) for _ in range(10)],
                               return_exceptions=True)
    assert sum(isinstance(r, str) for r in res) == 4 and len(ws) == 4 and opened == 4
    assert all(isinstance(r, (str, RateLimited)) for r in res), res
    await ws.close()
    # a failed open gives its slot back
    with pytest.raises(SandboxNotFound):
        await ws.create(ALICE, W, slow(fail=True))
    assert len(ws) == 0
    # tenant "acme" (many principals) gets half; tenant "other" still finds room
    keys = [Caller(id=f"p-{i}", name=f"k{i}", roles={}) for i in range(4)]
    for k in keys[:2]:
        await ws.create(k, W, _policy([]), tenant="acme")
    with pytest.raises(RateLimited, match="on project 'acme'"):
        await ws.create(keys[2], W, _policy([]), tenant="acme")
    await ws.create(keys[3], W, _policy([]), tenant="other")
    await ws.close()
