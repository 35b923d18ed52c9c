"""Fixtures for the control-plane tests: a real SQLite store in a temp dir."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec.control.api.plane import ControlPlane, IamAuthority
from dsec.control.api.service import ApiService
from dsec.control.idempotency import IdempotencyCache
from dsec.control.ratelimit import RateLimitConfig, RateLimiter
from dsec.control.store.sqlite import SqliteStore


class FakeClock:
    """A settable clock injected into the objects under test."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "state.db"


@pytest.fixture
def store(store_path: Path) -> Iterator[SqliteStore]:
    s = SqliteStore(store_path)
    try:
        yield s
    finally:
        s.close()


def api_service(store: SqliteStore, plane: ControlPlane, *,
                idempotency: dict[str, Any] | None = None, **kw: Any) -> ApiService:
    """An apiserver's service over ``plane`` as the tests wire it (one place instead of
    one per test module): IAM from the plane's store, the plane as directory, placer and
    quota gate, no rate limit, idempotency keys in ``store`` (``idempotency``: extra
    IdempotencyCache options), ``kw`` passed on (``config=ApiConfig(...)``, ...). Sets
    ``plane.service``."""
    svc = ApiService(authority=IamAuthority(plane.iam, store), directory=plane, placer=plane,
                     quotas=plane,
                     limiter=RateLimiter(RateLimitConfig(rate_per_s=None), clock=time.monotonic),
                     idempotency=IdempotencyCache(clock=time.time, store=store,
                                                  **(idempotency or {})),
                     metrics=plane.metrics, **kw)
    plane.service = svc
    return svc
