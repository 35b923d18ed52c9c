"""Every operation of the catalogue that the apiserver serves has exactly one policy
(:meth:`ApiService.handler`), typed with the row's request and reply: the doors call it
with the request object they decoded, so REST and the gateway cannot disagree on what an
operation takes or answers."""

from __future__ import annotations

import functools
import time
import typing
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import pytest

from dsec.control.api import service as service_module
from dsec.control.api.service import ApiService, Caller
from dsec.control.idempotency import IdempotencyCache
from dsec.control.metrics import ApiMetrics
from dsec.control.ratelimit import RateLimitConfig, RateLimiter
from dsec.errors import InternalError, Unavailable
from dsec.wire.calls import Empty, SessionOpen
from dsec.wire.ops import ALL_OPS, EDGE_OPS, GATEWAY_OPS, REST_OPS, Op, StreamOp, UploadOp


class _NoKeys:
    def authenticate(self, api_key: str) -> Caller:
        raise AssertionError("not called")


def _service() -> ApiService:
    return ApiService(authority=_NoKeys(), directory=None, placer=None,  # type: ignore[arg-type]
                      quotas=None, limiter=RateLimiter(RateLimitConfig(rate_per_s=None),
                                                          clock=time.monotonic),
                      idempotency=IdempotencyCache(clock=time.time), metrics=ApiMetrics())


API_OPS = [op for op in ALL_OPS if op in GATEWAY_OPS or op in REST_OPS]


def test_every_api_op_has_a_policy_and_edge_only_ops_none() -> None:
    svc = _service()
    for op in API_OPS:
        if isinstance(op, UploadOp):
            assert callable(svc.upload_handler(op)), op.name
        elif isinstance(op, StreamOp):
            assert callable(svc.stream_handler(op)), op.name
        else:
            assert callable(svc.handler(op)), op.name
    for op in EDGE_OPS:
        if op not in API_OPS:
            with pytest.raises(InternalError, match=f"operation {op.name!r} has no apiserver"):
                svc.handler(op)


def _hints(fn: Any) -> dict[str, Any]:
    return typing.get_type_hints(fn, vars(service_module))


@pytest.mark.parametrize("op", [op for op in API_OPS if not isinstance(op, UploadOp)],
                         ids=lambda op: op.name)
def test_policies_are_typed_with_their_rows(op: Op[Any, Any]) -> None:
    """A named policy's request annotation is the row's request type and its return
    annotation the row's reply; the shared forward reads both from the row itself."""
    policy = _service().handler(op)
    if isinstance(policy, functools.partial):      # ApiService._forward(op, ...)
        assert policy.args == (op,), op.name
        assert op.target == "sandbox" and op.role is not None
        return
    hints = _hints(policy)
    assert hints["b"] is op.request, (op.name, hints["b"])
    want: Any = op.reply
    if isinstance(op, StreamOp):
        want = AsyncIterator[op.item | op.reply]  # type: ignore[name-defined]
    got = hints["return"]
    assert got == want or (want is None and got is type(None)), (op.name, got, want)


async def test_administration_without_a_control_plane_is_unavailable() -> None:
    svc = _service()
    caller = Caller(id="p", name="p", roles={"default": "admin"})
    policy: Any = svc.handler(next(op for op in API_OPS if op.name == "session_open"))
    with pytest.raises(Unavailable, match="started without a control plane"):
        await policy(caller, SessionOpen(lease_s=60))
    info: Awaitable[Any] = svc.handler(next(op for op in API_OPS if op.name == "info"))(
        caller, Empty())
    assert (await info).principal == "p"
