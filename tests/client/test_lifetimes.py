"""Lifetimes through the SDK (issue 19): set_timeout/extend over both transports, and an
acknowledged timeout survives kill -9 of the edge process (journaled with fsync first)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

from dsec import LocalCluster
from dsec.control.supervisor import RestartPolicy
from dsec.errors import InvalidArgument

T = TypeVar("T")


def _until(what: str, fn: Callable[[], T], timeout: float = 60.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        try:
            v = fn()
        except Exception:  # noqa: BLE001 - the edge may be restarting meanwhile
            v = None
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("protocol", ["http", "aether"])
def test_set_timeout_extend_and_kill_9_of_the_edge(protocol: str) -> None:
    policy = RestartPolicy(first_delay_s=0.05)
    with LocalCluster(edges=1, edge_processes=True, restart=policy) as cl, \
            cl.client(protocol=protocol) as c:
        sb = c.sandboxes.create(ttl=3600)
        paused = c.sandboxes.create(ttl=3600)
        before = time.time()
        got = sb.set_timeout(5000)
        assert got.expires_at is not None and before + 5000 <= got.expires_at <= time.time() + 5000
        got = sb.extend(100)
        want = got.expires_at
        assert want is not None and want == pytest.approx(before + 5100, abs=5)
        paused.pause()
        left = paused.set_timeout(777)
        assert left.expires_at is None and left.ttl_left_s == 777
        with pytest.raises(InvalidArgument, match="timeout_s"):
            sb.set_timeout(0)
        # acknowledged -> durable: kill -9 the edge the instant after; its supervisor
        # restarts it and it re-adopts both from its journal
        old = cl.kill_edge("edge-0")
        assert old > 0
        info = _until("the edge back", lambda: c.sandboxes.get(sb.id).info)
        assert info.state == "running" and info.expires_at == want
        p = c.sandboxes.get(paused.id).info
        assert p.state == "paused" and p.ttl_left_s == 777 and p.paused_reason == "requested"
        sb.kill()
        paused.kill()


@pytest.mark.parametrize("protocol", ["http", "aether"])
def test_the_clock_stops_while_paused_and_an_idle_pause_says_idle(protocol: str) -> None:
    """Real time, through the SDK (CLI: tests/cli/test_cli19.py): a sandbox with ttl=2
    paused for 3 s is still there with its 2 s left, and once resumed its TTL ends it
    (reason ``ttl``); ``idle_timeout`` with ``idle_action="pause"`` pauses with reason
    ``idle``, not ``requested``."""
    with LocalCluster(edges=1) as cl, cl.client(protocol=protocol, session_lease_s=None) as c:
        sb = c.sandboxes.create(ttl=2)
        idle = c.sandboxes.create(idle_timeout=1, idle_action="pause")
        sb.pause()
        time.sleep(3)
        info = c.sandboxes.get(sb.id).info
        assert info.state == "paused" and info.paused_reason == "requested", info
        assert info.expires_at is None and 1.5 < (info.ttl_left_s or 0) <= 2, info
        info = _until("the idle pause", lambda: (i := c.sandboxes.get(idle.id).info)
                      .state == "paused" and i)
        assert info.paused_reason == "idle", info
        assert [(e.to_state, e.reason) for e in idle.events()][-2:] == [
            ("pausing", "idle"), ("paused", "idle")]
        resumed = time.monotonic()
        sb.resume()
        sb.resume()                               # resume of a running one succeeds
        got = c.sandboxes.get(sb.id).info
        assert got.state == "running" and got.expires_at is not None, got
        _until("the ttl", lambda: c.sandboxes.get(sb.id).info.state == "destroyed", 20)
        assert time.monotonic() - resumed >= 1.5      # the 2 s left ran only now
        assert [(e.to_state, e.reason) for e in sb.events()][-1] == ("destroyed", "ttl")
        idle.kill()
