"""The retry bound: attempts and a deadline on an injected clock; answers never retried."""

from __future__ import annotations

import pytest

from dsec.errors import BlobNotFound, BlobUnavailable, InvalidArgument
from dsec.image.blob.retry import RetryPolicy


class Clock:
    def __init__(self) -> None:
        self.t = 0.0
        self.slept: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def test_transient_errors_retry_until_success() -> None:
    c = Clock()
    calls = iter([BlobUnavailable("a"), BlobUnavailable("b"), "ok"])

    def fn() -> str:
        v = next(calls)
        if isinstance(v, Exception):
            raise v
        return v
    assert RetryPolicy(attempts=3, sleep=c.sleep, clock=c.now).call(fn) == "ok"
    assert len(c.slept) == 2 and all(0 <= s <= 1.0 for s in c.slept)


def test_attempts_and_deadline_bound_the_loop() -> None:
    c = Clock()
    n = 0

    def down() -> None:
        nonlocal n
        n += 1
        c.t += 3.0                          # each try takes 3 s (a timeout)
        raise BlobUnavailable("down")
    with pytest.raises(BlobUnavailable) as ei:
        RetryPolicy(attempts=100, deadline_s=10.0, sleep=c.sleep, clock=c.now).call(down)
    assert n == 4 and ei.value.detail["attempts"] == 4      # 4 tries pass 10 s
    assert ei.value.detail["elapsed_s"] >= 10.0


@pytest.mark.parametrize("exc", [BlobNotFound("gone"), InvalidArgument("bad")])
def test_answers_are_not_retried(exc: Exception) -> None:
    n = 0

    def fn() -> None:
        nonlocal n
        n += 1
        raise exc
    with pytest.raises(type(exc)):
        RetryPolicy(attempts=5, sleep=lambda s: None).call(fn)
    assert n == 1


def test_policy_validates() -> None:
    with pytest.raises(InvalidArgument):
        RetryPolicy(attempts=0)
    with pytest.raises(InvalidArgument):
        RetryPolicy(initial_s=2.0, max_s=1.0)
