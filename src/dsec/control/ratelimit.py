"""Rate limiting (per principal; per client address for failed authentication): a token
bucket per key, pure logic with an injected clock.

The apiserver asks :meth:`RateLimiter.acquire` once per request; ``None`` means go ahead,
a float is how many seconds until a token is available (sent as ``Retry-After``).
Memory is bounded: at most ``max_keys`` buckets are kept, least recently used first out.
An evicted bucket comes back full, which can only ever be more generous than the truth,
so eviction never wrongly refuses anyone.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from dsec.errors import InvalidArgument

__all__ = ["RateLimitConfig", "RateLimiter"]


@dataclass(slots=True, frozen=True, kw_only=True)
class RateLimitConfig:
    """``rate_per_s`` tokens/s refill (steady request rate per key), ``burst`` bucket size
    (requests allowed back to back), ``max_keys`` buckets kept in memory.

    ``rate_per_s=None`` disables limiting (the embedded ``dsec up`` default is generous
    rather than off, so a runaway script is still noticed)."""

    rate_per_s: float | None = 20_000.0   # an RL trainer creating 5k sandboxes/s fits
    burst: float = 40_000.0
    max_keys: int = 100_000

    def __post_init__(self) -> None:
        if self.rate_per_s is not None and not self.rate_per_s > 0:
            raise InvalidArgument(f"rate_per_s={self.rate_per_s} must be positive or None")
        if not self.burst >= 1:
            raise InvalidArgument(f"burst={self.burst} must be >= 1 request")
        if self.max_keys < 1:
            raise InvalidArgument(f"max_keys={self.max_keys} must be >= 1")


class RateLimiter:
    """Token buckets keyed by an opaque string (the principal/key id)."""

    __slots__ = ("_buckets", "_cfg", "_clock")

    def __init__(self, config: RateLimitConfig, *, clock: Callable[[], float]) -> None:
        self._cfg = config
        self._clock = clock
        # key -> (tokens, last refill time)
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    @property
    def config(self) -> RateLimitConfig:
        return self._cfg

    def acquire(self, key: str, cost: float = 1.0) -> float | None:
        """Take ``cost`` tokens for ``key``. ``None`` if allowed; else seconds to wait."""
        rate = self._cfg.rate_per_s
        if rate is None:
            return None
        now = self._clock()
        b = self._buckets.get(key)
        if b is None:
            tokens = self._cfg.burst
            if len(self._buckets) >= self._cfg.max_keys:
                self._buckets.popitem(last=False)
        else:
            tokens = min(self._cfg.burst, b[0] + (now - b[1]) * rate)
            self._buckets.move_to_end(key)
        if tokens >= cost:
            self._buckets[key] = (tokens - cost, now)
            return None
        self._buckets[key] = (tokens, now)
        return (cost - tokens) / rate

    def peek(self, key: str, cost: float = 1.0) -> float | None:
        """Like :meth:`acquire` but takes nothing: ``None`` if ``cost`` tokens are there."""
        rate = self._cfg.rate_per_s
        b = self._buckets.get(key)
        if rate is None or b is None:
            return None
        tokens = min(self._cfg.burst, b[0] + (self._clock() - b[1]) * rate)
        return None if tokens >= cost else (cost - tokens) / rate

    @staticmethod
    def retry_after_header(seconds: float) -> str:
        """``Retry-After`` takes whole seconds; round up so a client that obeys succeeds."""
        return str(max(1, math.ceil(seconds)))

    def __len__(self) -> int:
        return len(self._buckets)
