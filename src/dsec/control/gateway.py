"""The Aether gateway: the apiserver's operations over Aether, built from the catalogue.

Every row of :mod:`dsec.wire.ops` with the gateway door is one method, ``api.<name>``,
whose body is the row's request type and whose reply is the row's reply type; the
handler is :meth:`ApiService.handler` for that row, the same policy REST calls. So the
same auth, roles, rate limits, idempotency and forwarding apply at both doors; only the
encoding differs (msgpack with raw bytes, no base64, no HTTP parsing) and calls multiplex
and pipeline on one connection. ``api.create_many`` and ``api.exec_many`` carry many
items in one request, grouped per edge into one batched edge call each; their replies
are ``Batch[T]``, one outcome per item.

The API key comes once per connection (``aether.auth``, i.e. ``connect(address,
token=api_key)``): until then the peer may send nothing else, frames over 4 KiB, or stay
longer than the listener's ``auth_timeout_s``, so a stranger holding connections costs
a bounded number of file descriptors and bytes (see :mod:`dsec.aether.limits`). The
connection keeps a :class:`GatewaySession` (the key and the peer's address); every call
is authorized through it (the service's principal cache makes that a dict lookup, a
revoked key stops working within ``principal_cache_s``) and charged to the key's rate
limit, and failed keys are charged to the peer's address, never a shared budget.
Bodies carry no key. The wire version is :data:`~dsec.wire.api.GATEWAY_PROTOCOL`,
advertised by ``/v1/info``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from dsec.aether import Router, Server, StreamSender, after_reply_written, serve
from dsec.aether.connection import DuplexStream
from dsec.aether.limits import ServerLimits
from dsec.control.api.service import AdminOps, ApiService, Caller
from dsec.control.filedoors import gateway_relay
from dsec.control.replybudget import hold_replies
from dsec.errors import DsecError, InvalidArgument
from dsec.logs import access, access_enabled
from dsec.wire.ops import GATEWAY_OPS, Op, StreamOp, TunnelOp, UploadOp

__all__ = ["GatewaySession", "gateway_router", "serve_gateway"]


@dataclass(frozen=True, slots=True)
class GatewaySession:
    """What a gateway connection authenticated with: its API key, and the peer's
    address key (``ip`` or ``uid:N``) that failed re-checks of the key are charged to."""

    key: str
    peer: str


def gateway_router(service: ApiService, admin: AdminOps | None = None) -> Router:
    """The ``api.*`` methods of every gateway row, bound to ``service`` (``admin``: the
    administration it hands projects, keys, sessions and images to, when the service was
    built without one)."""
    if admin is not None and service.admin is None:
        service.admin = admin
    authenticate = service.authenticate

    def admit(credential: bytes, peer: str) -> GatewaySession:
        # Failures charge the peer address's anonymous budget (429 once it is spent),
        # like REST does per client address.
        session = GatewaySession(key=credential.decode("utf-8", "replace"),
                                 peer=peer or "gateway")
        authenticate(session.key, session.peer)
        return session

    r = Router(authenticate=admit, credential="API key")
    for op in GATEWAY_OPS:
        if isinstance(op, UploadOp):
            raise InvalidArgument(f"{op.name}: uploads are REST-only (a raw body stream)")
        if isinstance(op, TunnelOp):
            r.add(op.api_method, _tunneled(service, op), request_type=op.request,
                  duplex=True, with_context=True)
        elif isinstance(op, StreamOp):
            r.add(op.api_method, _streamed(service, op), request_type=op.request,
                  streaming=True, with_context=True)
        else:
            r.add(op.api_method, _bound(service, op), request_type=op.request,
                  with_context=True)
    return r


def _bound(service: ApiService, op: Op[Any, Any]) -> Callable[[GatewaySession, Any],
                                                           Awaitable[Any]]:
    """The handler of one row: authorize the connection's key, run the row's policy,
    answer its reply; errors pass through ``service.redact`` (no host paths)."""
    policy = service.handler(op)
    authenticate, redact = service.authenticate, service.redact
    count = _counter(service, op)

    async def handle(session: GatewaySession, body: Any) -> Any:
        t0, outcome = time.perf_counter(), "internal"
        try:
            with hold_replies() as leases:
                reply = await policy(authenticate(session.key, session.peer), body)
            for lease in leases:    # the reply counts against its tenant until written
                after_reply_written(lease.release)
            outcome = "ok"
            return reply
        except DsecError as exc:
            outcome = exc.code
            raise redact(exc) from None
        finally:
            count(outcome, time.perf_counter() - t0, session.peer)
    return handle


def _counter(service: ApiService, op: Op[Any, Any]) -> Callable[..., None]:
    """Count and time one call of ``op`` (``dsec_gateway_calls_total{op,outcome}``,
    ``dsec_gateway_call_seconds{op}``); the ok series exist from the start so a
    dashboard shows 0, not "no data"."""
    m = service.metrics
    ok = m.gateway_calls.labels(op.name, "ok")
    seconds = m.gateway_latency.labels(op.name)

    def count(outcome: str, dt: float, peer: str = "-") -> None:
        (ok if outcome == "ok" else m.gateway_calls.labels(op.name, outcome)).inc()
        seconds.observe(dt)
        if access_enabled():    # issue 19: --access-log
            access(f"{op.api_method} {outcome}", door="gateway", op=op.name,
                   outcome=outcome, duration_ms=round(dt * 1000, 3), client=peer)
    return count


def _streamed(service: ApiService, op: StreamOp[Any, Any, Any],
              ) -> Callable[[GatewaySession, Any, StreamSender], Awaitable[Any]]:
    """The handler of a streaming row: items as STREAM frames, then the final reply."""
    policy = service.stream_handler(op)
    authenticate, redact = service.authenticate, service.redact
    count = _counter(service, op)
    final_type = op.reply

    async def handle(session: GatewaySession, body: Any, out: StreamSender) -> Any:
        t0, outcome = time.perf_counter(), "internal"
        caller: Caller
        try:
            caller = authenticate(session.key, session.peer)
            final: Any = None
            async for item in await policy(caller, body):
                if isinstance(item, final_type):
                    final = item
                else:
                    await out.send(item)
            if final is None:
                raise InvalidArgument(f"{op.name} stream ended without a result")
            outcome = "ok"
        except DsecError as exc:
            outcome = exc.code
            raise redact(exc) from None
        finally:
            count(outcome, time.perf_counter() - t0, session.peer)
        return final
    return handle


def _tunneled(service: ApiService, op: TunnelOp[Any, Any],
              ) -> Callable[[GatewaySession, Any, DuplexStream], Awaitable[Any]]:
    """The handler of a duplex row (streamed files): the policy opens the edge's stream
    after the access check, the relay moves bytes both ways under both streams' credit
    (dsec.control.filedoors), the edge's answer ends the call."""
    authenticate, redact = service.authenticate, service.redact
    count = _counter(service, op)

    async def handle(session: GatewaySession, body: Any, stream: DuplexStream) -> Any:
        t0, outcome = time.perf_counter(), "internal"
        try:
            edge, done = await service.open_file_stream(
                authenticate(session.key, session.peer), op, body)
            info = await gateway_relay(stream, edge, done)
            outcome = "ok"
            return info
        except DsecError as exc:
            outcome = exc.code
            raise redact(exc) from None
        finally:
            count(outcome, time.perf_counter() - t0, session.peer)
    return handle


async def serve_gateway(service: ApiService, admin: AdminOps | None, address: str, *,
                        limits: ServerLimits | None = None) -> Server:
    """Listen on ``address`` (``tcp:HOST:PORT`` or ``unix:PATH``) for gateway calls, under
    ``limits`` (default :data:`dsec.aether.limits.DEFAULT_LIMITS`)."""
    return await serve(gateway_router(service, admin), address, limits=limits)
