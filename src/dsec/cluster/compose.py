"""One place where an apiserver's :class:`~dsec.control.api.service.ApiService` is wired.

The runtime (``dsec up``/``dsec apiserver``/``LocalCluster``), the ``api`` bench's
apiserver worker and the control-plane tests that run several apiserver replicas over one
store all build it here, so a new collaborator of ``ApiService`` is added once and every
one of them runs what ships.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from dsec.control.api.plane import ControlPlane, IamAuthority
from dsec.control.api.service import ApiConfig, ApiService
from dsec.control.idempotency import IdempotencyCache
from dsec.control.ratelimit import RateLimitConfig, RateLimiter
from dsec.control.store import StateStore

__all__ = ["api_service"]


def api_service(store: StateStore, plane: ControlPlane, *,
                rate: RateLimitConfig | None = None,
                anon_rate: RateLimitConfig | None = None,
                clock: Callable[[], float] = time.monotonic,
                config: ApiConfig | None = None,
                idempotency: dict[str, Any] | None = None,
                **kw: Any) -> ApiService:
    """An apiserver's service over ``plane``: IAM from ``store``, the plane as directory,
    placer, quota gate, image resolver and admin (projects, keys, sessions, images);
    idempotency keys durable in ``store`` (``idempotency``: extra
    :class:`~dsec.control.idempotency.IdempotencyCache` options); a per-key rate limit of
    ``rate`` (None: unlimited) and, when ``anon_rate`` is given, a per-address limit on
    failed authentications; ``clock`` (monotonic) for both and for the service's caches.
    ``kw`` is passed on to ``ApiService``. Sets ``plane.service``, which the plane's
    loops call back into."""
    svc = ApiService(
        authority=IamAuthority(plane.iam, store), directory=plane, placer=plane,
        quotas=plane,
        limiter=RateLimiter(rate or RateLimitConfig(rate_per_s=None), clock=clock),
        # wall clock: an idempotency key's lifetime outlives this process (it is stored)
        idempotency=IdempotencyCache(clock=time.time, store=store, **(idempotency or {})),
        metrics=plane.metrics, config=config or ApiConfig(), clock=clock,
        anon_limiter=None if anon_rate is None else RateLimiter(anon_rate, clock=clock),
        images=plane, admin=plane, **kw)
    plane.service = svc
    return svc
