"""Bytes of large unary replies each tenant holds in one apiserver at once.

A unary reply (an exec's output, a ``list_dir``, a sandbox's events) is whole in the
apiserver's memory from the moment its edge answers until the client has read it: over
REST the body waits in the transport's buffer while the client reads slowly or not at all;
over the gateway a connection parks up to 64 MiB of them (``unread_replies_max``) and a
tenant opens as many connections as it likes. So a tenant that asks for N big replies and
never reads them held N times 16 MiB (an exec: up to 2 x 4 MiB of output) of the apiserver,
whatever the per-connection caps, and could take every other tenant's apiserver with it.

Each tenant (a top-level project, with its subprojects: as the edge counts execs) gets a
budget of such bytes. A call *reserves* what its reply can be at most before it is sent to
the edge (an exec: its worst case, 2 x min(its output cap, the edge's reply cap); an
``exec_many`` the sum of its items'; a ``read_file`` its length, or piece by piece;
``reply_reserve_bytes``, the edge link's frame size, for the other rows, which have no cap
of their own), the reservation becomes the reply's
real size when it arrives, and the door that writes the reply charges the body it writes
if that is larger (:func:`releasing_send`: REST's JSON writes a control byte as 6). It is
given back when the reply has been written out (REST, E2B, dashboard: the body sent and
drained, :func:`releasing_send`; the gateway: ``dsec.aether.after_reply_written``, its
write buffer empty), or at once if the call fails; every door that writes a budgeted
reply holds its leases (:class:`hold_replies`), and a door's call whose reply it only
reads (a check) is :class:`consumed`. A call that does not
fit waits in its tenant's queue (first come, first served; a release grants the head
of the queue as far as it makes room) up to ``wait_s``, then is refused with :class:`~dsec.errors.RateLimited` naming the
tenant, the bytes held and what to do. One reply larger than the whole budget still goes
when the tenant holds nothing (a budget never makes a call impossible, only serial).

Bounds: a tenant's unread replies hold at most its budget, plus what grew when encoded
for a door, charged as it is written (the tenant's next calls wait), plus one reply
larger than the whole budget. An exec reserved
a 64 KiB estimate for a while: 16 unread execs then held 15x a 1 MiB budget (red team
21, B3); the worst case at the 4 GiB default still lets 2,044 unary execs of a tenant
be in flight at the default 1 MiB cap (docs/api.md).

:class:`ReplyBudget` is the pure accounting; :class:`ReplyGate` adds the waiting.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from dsec.errors import InvalidArgument, RateLimited

__all__ = ["ReplyBudget", "ReplyGate", "ReplyLease", "SentThenReleased", "consumed",
           "hold_replies", "keep_or_release", "releasing_send", "tenant_of"]


def tenant_of(project: str) -> str:
    """The tenant a project's replies count against: its top-level project."""
    return project.partition("/")[0]


@dataclass(slots=True)
class ReplyBudget:
    """Bytes held per tenant against ``limit_bytes`` (None: no limit, only counted)."""

    limit_bytes: int | None
    _held: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.limit_bytes is not None and self.limit_bytes < 1:
            raise InvalidArgument(f"reply budget of {self.limit_bytes} bytes: give a "
                                  "positive number of bytes, or None for no budget")

    def held(self, tenant: str) -> int:
        return self._held.get(tenant, 0)

    def fits(self, tenant: str, n: int, own: int = 0) -> bool:
        """``n`` more bytes are within ``tenant``'s budget (or it holds nothing but the
        ``own`` bytes the asking call holds already: a call is never made impossible)."""
        held = self._held.get(tenant, 0)
        return self.limit_bytes is None or held <= own or held + n <= self.limit_bytes

    def take(self, tenant: str, n: int) -> None:
        self._held[tenant] = self._held.get(tenant, 0) + n

    def give(self, tenant: str, n: int) -> None:
        left = self._held.get(tenant, 0) - n
        if left > 0:
            self._held[tenant] = left
        else:
            self._held.pop(tenant, None)

    def tenants(self) -> dict[str, int]:
        return dict(self._held)

    def total(self) -> int:
        return sum(self._held.values())


class ReplyLease:
    """One call's bytes in its tenant's budget: resized to the reply's real size when it
    arrives, released once (later releases do nothing)."""

    __slots__ = ("_gate", "bytes", "tenant")

    def __init__(self, gate: ReplyGate, tenant: str, n: int) -> None:
        self._gate: ReplyGate | None = gate
        self.tenant = tenant
        self.bytes = n

    def resize(self, n: int) -> None:
        gate = self._gate
        if gate is None:
            return
        budget = gate.budget
        if n > self.bytes:
            budget.take(self.tenant, n - self.bytes)
        elif n < self.bytes:
            budget.give(self.tenant, self.bytes - n)
            gate._wake(self.tenant)
        self.bytes = n

    def release(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.budget.give(self.tenant, self.bytes)
            gate._wake(self.tenant)


class ReplyGate:
    """:class:`ReplyBudget` with waiting: :meth:`acquire` returns a lease once the bytes
    fit, or raises RateLimited after ``wait_s``. Waiters of a tenant queue in order and
    are granted by releases (no thundering herd: a release wakes only the waiters it
    makes room for; a newcomer does not pass a queue)."""

    def __init__(self, limit_bytes: int | None, *, wait_s: float = 30.0,
                 on_refused: Callable[[], object] | None = None) -> None:
        if not wait_s >= 0:
            raise InvalidArgument(f"reply budget wait of {wait_s} s: give 0 or more seconds")
        self.budget = ReplyBudget(limit_bytes)
        self.wait_s = wait_s
        self.on_refused = on_refused
        self._queues: dict[str, collections.deque[tuple[int, int, asyncio.Future[None]]]] = {}
        self.refused = 0        # calls refused after waiting wait_s (a metric's source)

    async def acquire(self, tenant: str, n: int, *, own: int = 0) -> ReplyLease:
        """``own``: bytes the caller holds in leases already (a read to the end takes
        room piece by piece); with nothing else held it goes, as a first call would."""
        budget = self.budget
        if tenant not in self._queues and budget.fits(tenant, n, own):
            budget.take(tenant, n)
            return ReplyLease(self, tenant, n)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        q = self._queues.setdefault(tenant, collections.deque())
        q.append((n, own, fut))
        try:
            async with asyncio.timeout(self.wait_s):
                await fut
        except BaseException as exc:
            granted = fut.done() and not fut.cancelled()
            if granted and isinstance(exc, TimeoutError):
                return ReplyLease(self, tenant, n)   # granted as the wait ran out: take it
            if granted:
                budget.give(tenant, n)               # the caller went away: give it back
            else:
                fut.cancel()
                with contextlib.suppress(ValueError):
                    q.remove((n, own, fut))
            self._grant(tenant)                      # it may have held up the queue
            if not isinstance(exc, TimeoutError):
                raise
            self.refused += 1
            if self.on_refused is not None:
                self.on_refused()
            held, limit = budget.held(tenant), budget.limit_bytes
            raise RateLimited(
                f"tenant {tenant!r} holds {held} bytes of replies its clients have not "
                f"read yet at this apiserver (its budget is {limit}); this call's reply "
                f"may be {n} bytes and did not fit within {self.wait_s:g} s. Read the "
                "replies of earlier calls (exec output, list_dir, events) before asking "
                "for more, ask for less (a smaller output_cap_bytes), or ask the "
                "operator to raise the apiserver's reply budget (--reply-budget)",
                retry_after=1.0, tenant=tenant, held=held, limit=limit, size=n) from None
        return ReplyLease(self, tenant, n)

    def _wake(self, tenant: str) -> None:
        if tenant in self._queues:
            self._grant(tenant)

    def _grant(self, tenant: str) -> None:
        """Take the bytes for the waiters at the head of ``tenant``'s queue that fit now."""
        q = self._queues.get(tenant)
        if q is None:
            return
        budget = self.budget
        while q:
            n, own, fut = q[0]
            if fut.done():
                q.popleft()
                continue
            if not budget.fits(tenant, n, own):
                break
            q.popleft()
            budget.take(tenant, n)
            fut.set_result(None)
        if not q:
            del self._queues[tenant]


# The leases of the call a door is serving, kept until the door has written its reply
# (None: no door keeps them; the policy gives its lease back as it returns).
_HELD: contextvars.ContextVar[list[ReplyLease] | None] = contextvars.ContextVar(
    "dsec_reply_leases", default=None)


class hold_replies:
    """A door around one policy call: the leases the policy took are in the list when
    it returns; the door releases them once the reply is written (and on any error).
    A class, not a generator: it wraps every REST request and gateway call."""

    __slots__ = ("_token", "leases")

    def __enter__(self) -> list[ReplyLease]:
        self.leases: list[ReplyLease] = []
        self._token = _HELD.set(self.leases)
        return self.leases

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        _HELD.reset(self._token)
        if exc_type is not None:
            for lease in self.leases:
                lease.release()


def keep_or_release(lease: ReplyLease) -> None:
    """Hand ``lease`` to the door serving this call, or release it now if none keeps it."""
    held = _HELD.get()
    if held is None:
        lease.release()
    else:
        held.append(lease)


class consumed:
    """Inside a door: the policy calls in this block answer this process, not the client
    (an E2B check's exec, a pid looked up in the process table): their replies are
    dropped when the block ends, so their leases are given back as they return instead
    of being held until the door's response is written (a long stream after them would
    keep them charged for its whole life)."""

    __slots__ = ("_token",)

    def __enter__(self) -> None:
        self._token = _HELD.set(None)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        _HELD.reset(self._token)


def _grow(leases: list[ReplyLease], n: int) -> None:
    """Charge the live ``leases`` at least ``n`` bytes in all (what the body being written
    really holds: REST's JSON writes a control byte of output as 6), in proportion."""
    live = [lease for lease in leases if lease._gate is not None]
    total = sum(lease.bytes for lease in live)
    if not live or n <= total:
        return
    extra = n - total
    for i, lease in enumerate(live):
        share = (extra if i == len(live) - 1
                 else extra * lease.bytes // total if total else 0)
        extra -= share
        lease.resize(lease.bytes + share)


def releasing_send(send: Callable[[dict[str, Any]], Awaitable[None]],
                   leases: list[ReplyLease]) -> Callable[[dict[str, Any]], Awaitable[None]]:
    """An ASGI ``send`` that keeps ``leases`` (the door's, filled while it serves) charged
    until what they stand for has been written out, then gives them back:

    - each body message is charged its own size at least (:func:`_grow`: the encoded
      body, not the reply's output, is what the transport holds);
    - the leases in the list when a body message goes are released once the *next*
      message has been sent: uvicorn waits for the transport's buffer to drain below its
      low-water mark before it writes a message, never after the last one, so the final
      body goes as a non-final message and then an empty final one (measured: a 12 MiB
      reply nobody read was "sent" at once, 9 MiB of it still in the process). A
      streamed response thus gives back what it holds one piece behind what it writes,
      not at its end.

    The door still releases every lease when its response is over (or failed)."""
    sent: list[ReplyLease] = []

    async def send_released(message: dict[str, Any]) -> None:
        if message["type"] != "http.response.body":
            await send(message)
            return
        body = message.get("body", b"")
        if body:
            _grow(leases, len(body))
        before = leases[:]
        if message.get("more_body"):
            await send(message)
        else:
            await send({**message, "more_body": True})
            # uvicorn drains before this one: then the body is out of the process
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            sent.extend(before)
        for lease in sent:
            lease.release()         # the message before has drained: its replies are out
        sent[:] = before
    return send_released


class SentThenReleased:
    """An ASGI app: ``inner``, with the reply budget's ``leases`` of its body given back
    as it is written out (:func:`releasing_send`), all of them when it is over."""

    def __init__(self, inner: Callable[..., Awaitable[None]],
                 leases: list[ReplyLease]) -> None:
        self.inner, self.leases = inner, leases

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.inner(scope, receive, releasing_send(send, self.leases))
        finally:
            for lease in self.leases:
                lease.release()
