"""NoticeLimiter: one notice per (sandbox, reason) per interval, the rest folded (pure)."""

from __future__ import annotations

import pytest

from dsec.edge.lifecycle import FINAL_REASONS, NOTICE_REASONS
from dsec.edge.notices import NoticeLimiter


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_first_goes_out_later_ones_are_folded_into_the_next() -> None:
    clock = Clock()
    lim = NoticeLimiter(interval_s=10.0, clock=clock)
    assert lim.admit("a", "pids_limit") == 0
    assert [lim.admit("a", "pids_limit") for _ in range(5)] == [None] * 5
    assert lim.admit("a", "oom_kill") == 0          # another kind: its own budget
    assert lim.admit("b", "pids_limit") == 0        # another sandbox: its own budget
    clock.t += 9.9
    assert lim.admit("a", "pids_limit") is None
    clock.t += 0.1
    assert lim.admit("a", "pids_limit") == 6        # the 6 dropped since the last one
    clock.t += 10.0
    assert lim.admit("a", "pids_limit") == 0
    lim.forget("a")
    assert lim.admit("a", "pids_limit") == 0        # a forgotten sandbox starts over
    assert lim.admit("a", "pids_limit") is None


def test_interval_zero_lets_everything_through_and_negative_is_refused() -> None:
    lim = NoticeLimiter(interval_s=0.0, clock=Clock())
    assert [lim.admit("a", "oom_kill") for _ in range(3)] == [0, 0, 0]
    with pytest.raises(ValueError, match="interval_s"):
        NoticeLimiter(interval_s=-1)


def test_notice_reasons_are_not_deaths() -> None:
    assert {"oom_kill", "pids_limit", "tmpfs_full"} <= NOTICE_REASONS
    assert not NOTICE_REASONS & FINAL_REASONS
