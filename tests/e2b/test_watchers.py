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
from dsec.errors import NotFound, RateLimited, SandboxNotFound
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
