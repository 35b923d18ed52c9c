"""The chunk path's pure arithmetic: spans, merged runs, backoff, the LRU, the breaker."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsec.edge.lazy.plan import (
    Breaker,
    ChunkLru,
    Run,
    backoff_delays,
    chunk_span,
    failure_scope,
    judged_by_store,
    merge_runs,
)

CS = 256 * 1024


def test_chunk_span_clips_at_the_end() -> None:
    assert chunk_span(0, 1, CS, 10 * CS) == range(1)
    assert chunk_span(CS - 1, 2, CS, 10 * CS) == range(2)
    assert chunk_span(9 * CS, 4 * CS, CS, 9 * CS + 5) == range(9, 10)
    assert chunk_span(10 * CS, 10, CS, 10 * CS) == range(0)
    assert chunk_span(5, 0, CS, 10 * CS) == range(0)


@given(st.sets(st.integers(0, 300)), st.integers(1, 20))
def test_merge_runs_covers_each_index_once_in_adjacent_runs(idx: set[int], mx: int) -> None:
    runs = merge_runs(idx, mx)
    covered = [i for r in runs for i in range(r.first, r.first + r.count)]
    assert covered == sorted(idx)
    assert all(1 <= r.count <= mx for r in runs)
    # two runs only split where there is a gap or the run was full
    for a, b in itertools.pairwise(runs):
        assert b.first > a.first + a.count or a.count == mx


def test_run_byte_range_last_chunk_short() -> None:
    assert Run(2, 3).byte_range(CS, 4 * CS + 7) == (2 * CS, 2 * CS + 7)


def test_backoff_stays_within_budget_and_grows() -> None:
    d = list(backoff_delays(3.0, first_s=0.1, cap_s=1.0, rng=random.Random(1)))
    assert d and sum(d) <= 3.0
    assert max(d) <= 1.0
    assert list(backoff_delays(0.01, first_s=0.1, rng=random.Random(1))) == []


def test_lru_evicts_oldest_never_pinned_nor_the_new_one() -> None:
    lru = ChunkLru(3 * CS)
    for i in range(3):
        assert lru.add(("a", i), CS) == []
    lru.touch(("a", 0))
    assert lru.add(("a", 3), CS) == [("a", 1)]
    lru.pinned.add("p")
    assert lru.add(("p", 0), CS) == [("a", 2)]
    assert lru.add(("p", 1), CS) == [("a", 0)]
    assert lru.add(("p", 2), CS) == [("a", 3)]
    assert lru.add(("p", 3), CS) == []            # only pinned left: over budget, kept
    assert lru.bytes == 4 * CS and len(lru) == 4


def state(b: Breaker) -> str:
    return b.state


def test_breaker_opens_after_n_failures_and_probes_one_at_a_time() -> None:
    b = Breaker(failures=3, open_s=1.0, max_open_s=3.0)
    assert b.admit(0.0) == "pass"
    assert not b.failure(0.0) and not b.failure(0.1)
    assert b.success() is False and b.count == 0        # an answer clears the count
    assert not b.failure(1.0) and not b.failure(1.1)
    assert b.failure(1.2) and b.state == "open" and b.opens == 1
    assert b.admit(1.5) is None
    assert b.retry_in(1.5) == pytest.approx(0.7)
    assert not b.failure(1.6)                 # a fetch from before it opened: no change
    assert b.admit(2.2) == "probe"            # its time is up: one probe
    assert b.admit(2.3) is None               # every other miss still fails at once
    assert b.failure(2.4, probe=True) and b.open_s == 2.0 and b.until == 4.4
    assert b.admit(4.4) == "probe"
    assert b.failure(4.5, probe=True) and b.open_s == 3.0   # doubled, capped
    assert b.admit(7.5) == "probe"
    assert b.success() is True and state(b) == "closed" and b.open_s == 1.0
    assert b.admit(7.6) == "pass" and b.rejected == 2


def test_breaker_never_stays_half_open_on_a_lost_probe() -> None:
    b = Breaker(failures=1, open_s=1.0, max_open_s=5.0)
    b.failure(0.0)
    assert b.admit(1.0) == "probe"            # ... never reported
    assert b.admit(5.9) is None
    assert b.admit(6.0) == "probe"            # after max_open_s: another one
    b.probe_lost(6.5)                         # it never reached the store
    assert state(b) == "open" and b.admit(6.5) == "probe" and b.open_s == 1.0


def test_breaker_refuses_nonsense() -> None:
    for kw in ({"failures": 0}, {"open_s": 0.0}, {"open_s": 5.0, "max_open_s": 1.0}):
        with pytest.raises(ValueError):
            Breaker(**kw)


def test_failure_scope_tells_a_refused_key_from_a_store_down() -> None:
    """An HTTP status is an answer: the store refuses that key (429/503 SlowDown), it is
    not down (red team 22 A2); no status is no answer at all."""
    assert failure_scope(503, "x") == "layer"
    assert failure_scope(429, "x") == "layer"
    assert failure_scope(None, "blob store s3://b: read k failed: Generic S3 error: ... "
                               "non-2xx status code: 503 Service Unavailable: x") == "layer"
    assert failure_scope(None, "blob store http://h: read 4 bytes at 0 of k: HTTP 429") \
        == "layer"
    assert failure_scope(None, "blob store http://h: read k: ConnectError: [Errno 111] "
                               "Connection refused") == "store"
    assert failure_scope(None, "no answer for 262144 bytes at 0 within 10s") == "store"
    assert failure_scope("503", "connection reset") == "store"     # only ints count


def test_a_request_sent_late_does_not_judge_the_store() -> None:
    assert judged_by_store(10.0, 10.0) and judged_by_store(5.0, 10.0)
    assert not judged_by_store(4.9, 10.0) and not judged_by_store(0.01, 0.3)
