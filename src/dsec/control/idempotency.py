"""``Idempotency-Key`` handling for create: a retry within the window gets the same answer.

A key is scoped to the principal that sent it (two users picking the same key never see
each other's sandbox) and bound to a fingerprint of the request body: reusing a key with a
*different* body is a caller bug and gets :class:`~dsec.errors.Conflict` instead of
silently returning the wrong sandbox.

States of one key::

    absent --begin--> in_flight --finish--> done --(ttl)--> absent
                         └----abort (create failed)----> absent

The truth lives in the control plane's :class:`~dsec.control.store.StateStore` (table
``idempotency``), so every apiserver replica over one store behaves like one: ``begin``
*claims* the key there (one transaction; of two replicas claiming at once exactly one
wins), ``finish`` stores the answer, ``abort`` releases the claim. A request that finds
the key claimed by another replica waits for that replica's answer by polling the store;
one that finds a claim of its own process waits on a future. An in-flight claim is a lease
(``in_flight_s``): a replica that died mid-create does not block the key past it.

A bounded in-memory front (``max_entries``, oldest completed first) answers repeats
without a store read. The store is purged of expired rows (and trimmed to
``max_entries`` rows, oldest first) every ``purge_every`` claims.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dsec.control.store import IdempotencyRow
from dsec.errors import Conflict, InvalidArgument

__all__ = ["Begin", "IdempotencyCache", "IdempotencyStore", "fingerprint", "validate_key"]

MAX_KEY_LEN = 255


class IdempotencyStore(Protocol):
    """The part of :class:`~dsec.control.store.StateStore` this module uses."""

    def idem_claim(self, row: IdempotencyRow, now: float) -> IdempotencyRow: ...
    def idem_get(self, key: str, now: float) -> IdempotencyRow | None: ...
    def idem_finish(self, key: str, owner: str, response: bytes, expires_at: float) -> bool: ...
    def idem_release(self, key: str, owner: str) -> bool: ...
    def idem_purge(self, now: float, keep: int) -> int: ...


@dataclass(slots=True)
class _Entry:
    fingerprint: str
    expires_at: float
    response: bytes | None = None                # set when done
    waiter: asyncio.Future[bytes] | None = None  # set while in flight
    owner: str | None = None                     # our store claim, if this process holds it


@dataclass(slots=True, frozen=True)
class Begin:
    """What :meth:`IdempotencyCache.begin` decided.

    Exactly one of: ``replay`` (bytes to send back as-is), ``wait`` (another request with
    this key is in flight, here or on another replica: await it for the bytes), or
    ``proceed`` (do the work, then call ``finish`` or ``abort``)."""

    replay: bytes | None = None
    wait: asyncio.Future[bytes] | None = None
    proceed: bool = False


def fingerprint(body: bytes) -> str:
    return hashlib.blake2b(body, digest_size=16).hexdigest()


def validate_key(key: str) -> str:
    if not (0 < len(key) <= MAX_KEY_LEN) or not key.isprintable():
        raise InvalidArgument(
            f"Idempotency-Key must be 1..{MAX_KEY_LEN} printable characters, got {len(key)} "
            "characters", field="Idempotency-Key")
    return key


class IdempotencyCache:
    """See the module docstring. ``clock`` must be wall time when a store is shared by
    several processes (expiry times are compared across them)."""

    def __init__(
        self, *, clock: Callable[[], float], ttl_s: float = 300.0, max_entries: int = 50_000,
        store: IdempotencyStore | None = None, in_flight_s: float = 60.0,
        poll_s: float = 0.02, purge_every: int = 1000,
    ) -> None:
        if ttl_s <= 0 or max_entries < 1 or in_flight_s <= 0 or poll_s <= 0:
            raise InvalidArgument(f"ttl_s={ttl_s}, max_entries={max_entries}, in_flight_s="
                                  f"{in_flight_s} and poll_s={poll_s} must be positive")
        self._clock = clock
        self._ttl = ttl_s
        self._max = max_entries
        self._store = store
        self._in_flight_s = in_flight_s
        self._poll_s = poll_s
        self._purge_every = max(1, purge_every)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._me = secrets.token_hex(6)          # this process, in claim owners
        self._seq = itertools.count(1)
        self._pollers: set[asyncio.Task[None]] = set()

    @staticmethod
    def scoped(principal: str, key: str) -> str:
        return f"{principal}\x00{validate_key(key)}"

    def _conflict(self) -> Conflict:
        return Conflict(
            "this Idempotency-Key was already used with a different request body in "
            f"the last {self._ttl:g}s; use a new key for a new request",
            field="Idempotency-Key")

    def begin(self, scoped_key: str, fp: str) -> Begin:
        now = self._clock()
        e = self._entries.get(scoped_key)
        if e is not None and e.response is not None and e.expires_at <= now:
            del self._entries[scoped_key]
            e = None
        if e is not None:
            if e.fingerprint != fp:
                raise self._conflict()
            if e.response is not None:
                return Begin(replay=e.response)
            assert e.waiter is not None
            return Begin(wait=e.waiter)
        loop = asyncio.get_running_loop()
        if self._store is None:
            self._insert(scoped_key, _Entry(fp, now + self._ttl, waiter=loop.create_future()))
            return Begin(proceed=True)
        seq = next(self._seq)
        owner = f"{self._me}:{seq}"
        row = self._store.idem_claim(IdempotencyRow(
            key=scoped_key, fingerprint=fp, owner=owner, expires_at=now + self._in_flight_s),
            now)
        if seq % self._purge_every == 0:
            self._store.idem_purge(now, self._max)
        if row.fingerprint != fp:
            raise self._conflict()
        if row.owner == owner:
            self._insert(scoped_key, _Entry(fp, now + self._ttl, waiter=loop.create_future(),
                                            owner=owner))
            return Begin(proceed=True)
        if row.response is not None:
            self._insert(scoped_key, _Entry(fp, row.expires_at, response=row.response))
            return Begin(replay=row.response)
        # Claimed by another replica and still in flight: wait for its answer.
        fut: asyncio.Future[bytes] = loop.create_future()
        self._insert(scoped_key, _Entry(fp, row.expires_at, waiter=fut))
        t = loop.create_task(self._poll(scoped_key, row.owner, fut))
        self._pollers.add(t)
        t.add_done_callback(self._pollers.discard)
        return Begin(wait=fut)

    async def _poll(self, key: str, owner: str, fut: asyncio.Future[bytes]) -> None:
        """Wait for another replica's answer; fail the waiters if its claim went away
        (its create failed, or it died and the in-flight lease ran out)."""
        assert self._store is not None
        while not fut.done():
            await asyncio.sleep(self._poll_s)
            row = self._store.idem_get(key, self._clock())
            if row is not None and row.owner == owner and row.response is None:
                continue
            e = self._entries.get(key)
            if row is not None and row.owner == owner and row.response is not None:
                if e is not None and e.waiter is fut:
                    e.response, e.waiter, e.expires_at = row.response, None, row.expires_at
                if not fut.done():
                    fut.set_result(row.response)
                return
            if e is not None and e.waiter is fut:
                del self._entries[key]
            if not fut.done():
                fut.set_exception(Conflict(
                    "the first request with this Idempotency-Key (on another apiserver "
                    "replica) failed or timed out before it answered; retry the request",
                    field="Idempotency-Key"))
                fut.exception()  # nobody may be waiting; do not log it as unretrieved

    def finish(self, scoped_key: str, response: bytes) -> None:
        e = self._entries.get(scoped_key)
        now = self._clock()
        if e is None:
            return
        e.response = response
        e.expires_at = now + self._ttl
        if e.waiter is not None and not e.waiter.done():
            e.waiter.set_result(response)
        e.waiter = None
        if self._store is not None and e.owner is not None:
            self._store.idem_finish(scoped_key, e.owner, response, e.expires_at)

    def abort(self, scoped_key: str, exc: BaseException) -> None:
        """The create failed: forget the key (a retry may try again) and fail waiters."""
        e = self._entries.pop(scoped_key, None)
        if e is not None and e.waiter is not None and not e.waiter.done():
            e.waiter.set_exception(exc)
            # Nobody may be waiting; mark retrieved so asyncio does not log it.
            e.waiter.exception()
        if e is not None and e.owner is not None and self._store is not None:
            self._store.idem_release(scoped_key, e.owner)

    def _insert(self, key: str, e: _Entry) -> None:
        self._entries[key] = e
        while len(self._entries) > self._max:
            oldest_key, oldest = next(iter(self._entries.items()))
            if oldest.response is None:  # never drop an in-flight entry: rotate it
                self._entries.move_to_end(oldest_key)
                if all(x.response is None for x in self._entries.values()):
                    break
                continue
            del self._entries[oldest_key]

    async def close(self) -> None:
        """Stop waiting for other replicas (their waiters get cancelled)."""
        for t in list(self._pollers):
            t.cancel()
        await asyncio.gather(*self._pollers, return_exceptions=True)

    def __len__(self) -> int:
        return len(self._entries)
