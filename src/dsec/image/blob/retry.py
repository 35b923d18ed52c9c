"""Bounded retries for blob store requests (tenacity underneath).

What is transient is dsec's call: :class:`~dsec.errors.BlobUnavailable` (connect
refused/reset, timeout, 5xx, a body shorter or longer than asked). ``BlobNotFound`` and
``InvalidArgument`` are answers, never retried. Every retry loop is bounded twice: by
attempts and by a deadline, so a dead store costs a reader at most ``deadline_s`` plus
one request timeout before it sees the error.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import tenacity

from dsec.errors import BlobUnavailable, InvalidArgument

__all__ = ["DEFAULT_RETRY", "RetryPolicy"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """``attempts``: tries in all (1: no retry). Backoff doubles from ``initial_s`` up to
    ``max_s``, with full jitter; no new try starts after ``deadline_s`` seconds.
    ``sleep``/``clock`` are injected so tests and callers on a loop can replace them."""

    attempts: int = 4
    initial_s: float = 0.05
    max_s: float = 1.0
    deadline_s: float = 10.0
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise InvalidArgument(f"retry attempts {self.attempts}: at least 1 (no retry)")
        if not (0 <= self.initial_s <= self.max_s) or self.deadline_s < 0:
            raise InvalidArgument(
                f"retry backoff {self.initial_s}..{self.max_s} s, deadline "
                f"{self.deadline_s} s: need 0 <= initial <= max and deadline >= 0")

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()``, retried on ``BlobUnavailable``; the last error (its ``attempts``
        detail set) when every try failed."""
        start = self.clock()
        retrying = tenacity.Retrying(
            stop=(tenacity.stop_after_attempt(self.attempts)
                  | _PastDeadline(self.clock, start + self.deadline_s)),
            wait=tenacity.wait_random_exponential(multiplier=self.initial_s,
                                                  max=self.max_s),
            retry=tenacity.retry_if_exception_type(BlobUnavailable),
            sleep=self.sleep, reraise=True)
        n = 0
        try:
            for attempt in retrying:
                with attempt:
                    n += 1
                    return fn()
        except BlobUnavailable as exc:
            exc.detail["attempts"] = n
            exc.detail["elapsed_s"] = round(self.clock() - start, 3)
            raise
        raise AssertionError("unreachable: tenacity ended without a result or error")


class _PastDeadline(tenacity.stop.stop_base):
    """Stop once ``clock()`` passes ``at``: our injected clock, not tenacity's own."""

    def __init__(self, clock: Callable[[], float], at: float) -> None:
        self.clock = clock
        self.at = at

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return self.clock() >= self.at


DEFAULT_RETRY = RetryPolicy()
