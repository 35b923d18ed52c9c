"""NoticeLimiter: one notice per (sandbox, reason) per interval, the rest folded (pure)."""

from __future__ import annotations

import pytest

from dsec.edge.lifecycle import FINAL_REASONS, NOTICE_REASONS
from dsec.edge.notices import NoticeLimiter


def test_first_goes_out_later_ones_are_folded_into_the_next() -> None:
    lim = NoticeLimiter(interval_s=10.0)
    t = 100.0
    assert lim.admit("a", "pids_limit", t) == 0
    assert [lim.admit("a", "pids_limit", t) for _ in range(5)] == [None] * 5
    assert lim.admit("a", "oom_kill", t) == 0          # another kind: its own budget
    assert lim.admit("b", "pids_limit", t) == 0        # another sandbox: its own budget
    assert lim.admit("a", "pids_limit", t + 9.9) is None
    assert lim.admit("a", "pids_limit", t + 10.0) == 6  # the 6 dropped since the last one
    assert lim.admit("a", "pids_limit", t + 20.0) == 0
    lim.forget("a")
    assert lim.admit("a", "pids_limit", t + 20.0) == 0  # a forgotten sandbox starts over
    assert lim.admit("a", "pids_limit", t + 20.0) is None


def test_interval_must_be_positive() -> None:
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="interval_s"):
            NoticeLimiter(interval_s=bad)


def test_notice_reasons_are_not_deaths() -> None:
    assert {"oom_kill", "pids_limit", "tmpfs_full", "disk_full"} <= NOTICE_REASONS
    assert not NOTICE_REASONS & FINAL_REASONS
