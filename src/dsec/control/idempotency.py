"""``Idempotency-Key`` handling for create: a retry within the window gets the same answer.

A key is scoped to the principal that sent it (two users picking the same key never see
each other's sandbox) and bound to a fingerprint of the request body: reusing a key with a
*different* body is a caller bug and gets :class:`~dsec.errors.Conflict` instead of
silently returning the wrong sandbox.

States of one key::

    absent --claim--> in_flight --note(sandbox id)--> in_flight+intent --finish--> done
                         |  ^                               |                       |
                         |  └------ take over (holder dead) ┘                     (ttl)
                         └---- release (create failed; kept holderless if it       |
                               named a sandbox that may exist) ---> absent     absent

The truth lives in the control plane's :class:`~dsec.control.store.StateStore` (table
``idempotency``), so every apiserver replica over one store behaves like one, and so does
a restarted one:

- ``begin`` *claims* the key in one transaction: of two replicas claiming at once exactly
  one wins. A request that finds the key claimed by another live process waits for that
  process's answer by polling the store; one that finds a claim of its own process
  waits on a future.
- A claim is tied to a live owner: every process renews a lease row
  (``process_leases``) every ``lease_renew_s`` and a claim whose holder's lease ran out
  (``lease_s`` after it died) is *stale*. The next request with the key takes the claim
  over at once, and so does a waiter polling for a dead holder's answer: a crash costs
  a retry about ``lease_s``, not a fixed in-flight lease. A holder on this very machine
  (same boot, same host name, same pid namespace) is checked directly: if its process
  is gone (no such pid, or a pid reused by a later process), its lease is dropped and
  the claim taken over without waiting, so ``dsec up`` restarted after a crash answers
  at once. A holder in another pid namespace (a container sharing the host's name) is
  left to its lease: its pid means nothing here.
  ``in_flight_s`` stays as a backstop for a live holder that never finishes.
- Before it asks an edge, the owner *notes* the sandbox id it is about to create
  (``Claim.note``). Whoever takes a dead owner's claim over gets that ``intent`` and looks
  for the sandbox on its edge before creating anything, so a retry after a crash returns
  the sandbox the first attempt made instead of a second one. An owner whose claim was
  taken over while it was alive (its lease lapsed in a stall) learns it from a failed
  ``note``/``finish`` (or from the edge refusing the noted id, which the new owner
  made) and asks the key again, answering its caller with the new owner's sandbox
  (:class:`ClaimLost` internally; destroying its own sandbox if the key's answer is
  another one).

A store write the claim owes after the edge acted (``finish``'s answer, ``abort``'s
release) that fails (the store is down, or its disk full) is kept and retried in the
background until it lands (:meth:`IdempotencyCache.finish_later`): meanwhile a request
with the key is answered at once with a retryable :class:`~dsec.errors.Unavailable`
(never left waiting on an answer nobody will give), and once the answer lands it is
replayed. Should this process die first, its lease lapses and the next owner finds the
sandbox through the claim's ``intent`` (red team 16, F11).

A bounded in-memory front (``max_entries``, oldest completed first) answers repeats
without a store read. The store is purged of expired rows (and trimmed to ``max_entries``
finished rows, oldest first) every ``purge_every`` claims and by the control plane's
retention pass.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import secrets
import socket
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from dsec.control.store import IdempotencyRow
from dsec.errors import Conflict, InvalidArgument, Unavailable
from dsec.ownership import start_time
from dsec.wire.canonical import canonical_bytes
from dsec.wire.spec import MAX_IDEMPOTENCY_KEY_CHARS, check_idempotency_key

__all__ = ["Begin", "Claim", "ClaimLost", "IdempotencyCache", "IdempotencyStore",
           "fingerprint", "request_fingerprint", "validate_key"]

log = logging.getLogger("dsec.idempotency")

MAX_KEY_LEN = MAX_IDEMPOTENCY_KEY_CHARS


class IdempotencyStore(Protocol):
    """The part of :class:`~dsec.control.store.StateStore` this module uses."""

    def idem_claim(self, row: IdempotencyRow, now: float) -> IdempotencyRow: ...
    def idem_get(self, key: str, now: float) -> IdempotencyRow | None: ...
    def idem_note(self, key: str, owner: str, intent: str) -> bool: ...
    def idem_finish(self, key: str, owner: str, response: bytes, expires_at: float) -> bool: ...
    def idem_release(self, key: str, owner: str) -> bool: ...
    def idem_purge(self, now: float, keep: int) -> int: ...
    def lease_renew(self, holder: str, expires_at: float) -> None: ...
    def lease_drop(self, holder: str) -> None: ...


def _boot_id() -> str:
    """The space this process's pid numbers mean something in: this boot, and this pid
    namespace. Two apiservers in containers that share the host name (host networking)
    and the boot, each in its own pid namespace, must not judge each other's pids: pid 7
    in one is another process (or none) in the other, and a live holder would be taken
    for a dead one and its claims taken over while it works."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()[:8]
    except OSError:
        boot = "noboot"
    try:
        pidns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pidns = "nons"
    return f"{boot}.{pidns}"


def local_holder(token: str) -> str:
    """A holder id that says which process holds a claim: ``boot.pidns:host:pid:start:
    token``."""
    pid = os.getpid()
    return f"{_boot_id()}:{socket.gethostname()}:{pid}:{start_time(pid) or 0}:{token}"


def holder_gone(holder: str) -> bool:
    """True only when ``holder`` names a process of this machine, boot and pid namespace
    that no longer runs (its pid is free, or taken by a later process). Holders of other
    machines or pid namespaces, or of an unknown form, are never judged here: their
    leases say."""
    parts = holder.split(":")
    if len(parts) != 5 or parts[0] != _boot_id() or parts[1] != socket.gethostname():
        return False
    try:
        pid = int(parts[2])
    except ValueError:
        return False
    start = start_time(pid)
    return start is None or str(start) != parts[3]


class ClaimLost(Unavailable):
    """This request's claim on the key was taken over by another apiserver (this one's
    lease lapsed while it worked); the other one answers for the key now. Retryable:
    the retry gets that answer. Not sent to clients as its own code: it is an
    :class:`~dsec.errors.Unavailable` (503) on the wire."""


class Retry(Exception):
    """Internal: the claim a waiter was waiting on went away; call ``begin`` again."""


@dataclass(slots=True)
class _Entry:
    fingerprint: str
    expires_at: float
    response: bytes | None = None                # set when done
    waiter: asyncio.Future[bytes] | None = None  # set while in flight
    owner: str | None = None                     # our store claim, if this process holds it
    unstored: bool = False                       # the work is done, its answer not yet stored


@dataclass(slots=True)
class Claim:
    """This request owns the key: do the work, ``note`` the sandbox id before asking an
    edge, then ``finish`` or ``abort`` through the cache. ``intent``: the sandbox id a
    previous (dead) owner noted, to look for before creating anything."""

    key: str
    owner: str | None
    intent: str | None
    _cache: IdempotencyCache

    def note(self, sandbox_id: str) -> None:
        """Record ``sandbox_id`` as what this claim creates (durably, before acting).
        Raises :class:`ClaimLost` if another apiserver took the claim over."""
        self._cache._note(self, sandbox_id)


@dataclass(slots=True, frozen=True)
class Begin:
    """What :meth:`IdempotencyCache.begin` decided.

    Exactly one of: ``replay`` (bytes to send back as-is), ``wait`` (another request with
    this key is in flight, here or on another replica: await it for the bytes; it raises
    :class:`Retry` when that request went away and ``begin`` must be called again), or
    ``claim`` (do the work, then call ``finish`` or ``abort``)."""

    replay: bytes | None = None
    wait: asyncio.Future[bytes] | None = None
    claim: Claim | None = None

    @property
    def proceed(self) -> bool:
        return self.claim is not None


def fingerprint(body: bytes) -> str:
    return hashlib.blake2b(body, digest_size=16).hexdigest()


def request_fingerprint(request: object) -> str:
    """The fingerprint of a decoded request in its canonical form
    (:func:`dsec.wire.canonical.canonical_bytes`: the fields that differ from their
    defaults, by value, keys sorted), not of its bytes on the wire: REST's JSON and the
    gateway's msgpack of one request, JSON with its keys in another order or a default
    written out, and a request of a release whose type has one more defaulted field, are
    one request under one key. (msgspec's ``omit_defaults`` tells a default by identity,
    so its own encoding wrote a decoded ``"image": "base"`` and left the default out.)"""
    # Measured (loaded 2-core VM), a create with labels, env and a TTL: 8.8 us, against
    # 12.8 us for the every-field form it replaces; only keyed creates pay it.
    return fingerprint(canonical_bytes(request))


def validate_key(key: str) -> str:
    """The request type's check (:func:`dsec.wire.spec.check_idempotency_key`): REST's
    header and the gateway's field are refused in the same words."""
    check_idempotency_key(key)
    return key


class IdempotencyCache:
    """See the module docstring. ``clock`` must be wall time when a store is shared by
    several processes (expiry times are compared across them)."""

    def __init__(
        self, *, clock: Callable[[], float], ttl_s: float = 300.0, max_entries: int = 50_000,
        store: IdempotencyStore | None = None, in_flight_s: float = 300.0,
        poll_s: float = 0.02, purge_every: int = 1000, lease_s: float = 3.0,
        lease_renew_s: float = 1.0, holder: str | None = None,
    ) -> None:
        if (ttl_s <= 0 or max_entries < 1 or in_flight_s <= 0 or poll_s <= 0
                or not 0 < lease_renew_s < lease_s):
            raise InvalidArgument(
                f"ttl_s={ttl_s}, max_entries={max_entries}, in_flight_s={in_flight_s} and "
                f"poll_s={poll_s} must be positive, and 0 < lease_renew_s={lease_renew_s} "
                f"< lease_s={lease_s}")
        self._clock = clock
        self._ttl = ttl_s
        self._max = max_entries
        self._store = store
        self._in_flight_s = in_flight_s
        self._poll_s = poll_s
        self._purge_every = max(1, purge_every)
        self.lease_s = lease_s
        self.lease_renew_s = lease_renew_s
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        # This process in claim holders (and owners, "<holder>:<seq>"): which process it is
        # (see local_holder) and a random token, so a restarted apiserver never inherits
        # the claims of its previous life.
        self.holder = holder or local_holder(secrets.token_hex(6))
        self._seq = itertools.count(1)
        self._pollers: set[asyncio.Task[None]] = set()
        self._renewer: asyncio.Task[None] | None = None
        self._renewed_at = float("-inf")
        self._closed = False

    @staticmethod
    def scoped(principal: str, key: str) -> str:
        return f"{principal}\x00{validate_key(key)}"

    def _conflict(self) -> Conflict:
        return Conflict(
            "this Idempotency-Key was already used with a different request body in "
            f"the last {self._ttl:g}s; use a new key for a new request",
            field="Idempotency-Key")

    # ----------------------------------------------------------- process lease
    def renew_lease(self) -> None:
        """Write this process's lease (``lease_s`` from now). Called every
        ``lease_renew_s`` by a background task, and before a claim if it is overdue."""
        if self._store is None or self._closed:
            return
        now = self._clock()
        self._store.lease_renew(self.holder, now + self.lease_s)
        self._renewed_at = now

    def _ensure_lease(self) -> None:
        if self._store is None:
            return
        if self._clock() - self._renewed_at >= self.lease_renew_s:
            self.renew_lease()
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.get_running_loop().create_task(
                self._renew_loop(), name="dsec-idempotency-lease")

    async def _renew_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.lease_renew_s)
            try:
                self.renew_lease()
            except Exception:
                log.exception("renewing the apiserver's idempotency lease failed")

    # ---------------------------------------------------------------- claims
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
            if e.unstored:
                raise self._unstored()
            assert e.waiter is not None
            return Begin(wait=e.waiter)
        loop = asyncio.get_running_loop()
        if self._store is None:
            self._insert(scoped_key, _Entry(fp, now + self._ttl, waiter=loop.create_future()))
            return Begin(claim=Claim(scoped_key, None, None, self))
        self._ensure_lease()
        seq = next(self._seq)
        owner = f"{self.holder}:{seq}"
        claim_row = IdempotencyRow(key=scoped_key, fingerprint=fp, owner=owner,
                                   holder=self.holder, expires_at=now + self._in_flight_s)
        row = self._store.idem_claim(claim_row, now)
        if (row.owner != owner and row.response is None and not row.stale
                and holder_gone(row.holder)):
            # Its process on this machine is gone: no need to wait for its lease to lapse.
            self._store.lease_drop(row.holder)
            row = self._store.idem_claim(claim_row, now)
        if seq % self._purge_every == 0:
            self._store.idem_purge(now, self._max)
        if row.fingerprint != fp:
            raise self._conflict()
        if row.owner == owner:
            self._insert(scoped_key, _Entry(fp, now + self._ttl, waiter=loop.create_future(),
                                            owner=owner))
            if row.intent is not None:
                log.info("took over idempotency claim %r (its apiserver is gone): looking "
                         "for sandbox %s first", scoped_key.split("\x00", 1)[-1][:40],
                         row.intent)
            return Begin(claim=Claim(scoped_key, owner, row.intent, self))
        if row.response is not None:
            self._insert(scoped_key, _Entry(fp, row.expires_at, response=row.response))
            return Begin(replay=row.response)
        if row.holder == self.holder:
            # A claim of this very process that no request here works on any more (its
            # release could not be stored yet, see _retry_later): waiting on it would
            # wait for nobody.
            raise self._unstored()
        # Claimed by another live process and still in flight: wait for its answer.
        fut: asyncio.Future[bytes] = loop.create_future()
        self._insert(scoped_key, _Entry(fp, row.expires_at, waiter=fut))
        t = loop.create_task(self._poll(scoped_key, row.owner, fut))
        self._pollers.add(t)
        t.add_done_callback(self._pollers.discard)
        return Begin(wait=fut)

    async def _poll(self, key: str, owner: str, fut: asyncio.Future[bytes]) -> None:
        """Wait for another process's answer. When its claim goes away (its create
        failed, or it died and its lease lapsed: ``stale``), the waiters get
        :class:`Retry` and claim the key themselves (taking a stale claim over)."""
        assert self._store is not None
        while not fut.done():
            await asyncio.sleep(self._poll_s)
            row = self._store.idem_get(key, self._clock())
            if (row is not None and row.owner == owner and row.response is None
                    and not row.stale):
                if not holder_gone(row.holder):
                    continue
                self._store.lease_drop(row.holder)   # a dead process of this machine
            e = self._entries.get(key)
            if row is not None and row.response is not None:
                if e is not None and e.waiter is fut:
                    e.response, e.waiter, e.expires_at = row.response, None, row.expires_at
                if not fut.done():
                    fut.set_result(row.response)
                return
            if e is not None and e.waiter is fut:
                del self._entries[key]
            if not fut.done():
                fut.set_exception(Retry())
                fut.exception()  # nobody may be waiting; do not log it as unretrieved

    def _note(self, claim: Claim, sandbox_id: str) -> None:
        claim.intent = sandbox_id
        if self._store is None or claim.owner is None:
            return
        if not self._store.idem_note(claim.key, claim.owner, sandbox_id):
            raise self._lost(claim.key)

    def _lost(self, key: str) -> ClaimLost:
        e = self._entries.pop(key, None)
        if e is not None and e.waiter is not None and not e.waiter.done():
            e.waiter.set_exception(Retry())
            e.waiter.exception()
        return ClaimLost(
            "another apiserver took over this Idempotency-Key while this one worked on it "
            "(its lease lapsed); retry the request to get that apiserver's answer",
            field="Idempotency-Key")

    def _unstored(self) -> Unavailable:
        return Unavailable(
            "an earlier request with this Idempotency-Key finished, but its outcome could "
            "not be stored yet (the state store is unavailable); it is being retried: "
            "retry this request (same key) in a moment to get that outcome",
            field="Idempotency-Key", retry_after=1)

    def finish_later(self, scoped_key: str, response: bytes, exc: BaseException,
                     on_lost: Callable[[], Awaitable[None]]) -> None:
        """``finish`` failed with ``exc`` (not ClaimLost): the store could not take the
        answer. Fail the requests waiting on it (retryable), answer later ones at once
        with a retryable error, and retry the finish in the background until it lands
        (then the key replays ``response``) or the claim turns out lost (``on_lost``:
        the caller undoes its work as after a ClaimLost)."""
        e = self._entries.get(scoped_key)
        if e is None:
            return
        e.unstored = True
        if e.waiter is not None and not e.waiter.done():
            e.waiter.set_exception(self._unstored())
            e.waiter.exception()
        e.waiter = None
        log.warning("the answer of idempotency key %r could not be stored (%s): retrying "
                    "until it is", scoped_key.split("\x00", 1)[-1][:40], exc)

        def attempt() -> bool:
            cur = self._entries.get(scoped_key)
            if cur is not e or not e.unstored:
                return True
            try:
                self.finish(scoped_key, response)
            except ClaimLost:
                lost.append(True)
            return True

        lost: list[bool] = []

        async def then() -> None:
            if lost:
                await on_lost()
        self._retry_later(attempt, then)

    def _retry_later(self, attempt: Callable[[], bool],
                     then: Callable[[], Awaitable[None]] | None = None) -> None:
        """Call ``attempt`` (a store write) again and again, backing off from 50 ms to
        1 s, until it returns True or the cache is closed; then await ``then``."""
        async def loop() -> None:
            delay = 0.05
            while not self._closed:
                await asyncio.sleep(delay)
                try:
                    if attempt():
                        break
                except Exception as err:  # noqa: BLE001 - still down: try again
                    log.debug("idempotency store write still failing: %s", err)
                delay = min(delay * 2, 1.0)
            else:
                return
            if then is not None:
                await then()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:   # no loop (a synchronous caller): the claim's lease lapses
            return
        t = running.create_task(loop(), name="dsec-idempotency-retry")
        self._pollers.add(t)
        t.add_done_callback(self._pollers.discard)

    def finish(self, scoped_key: str, response: bytes) -> None:
        """Store the answer. Raises :class:`ClaimLost` if the claim was taken over
        meanwhile (the caller must then undo its own work: the other owner answers)."""
        e = self._entries.get(scoped_key)
        now = self._clock()
        if e is None:
            return
        if self._store is not None and e.owner is not None and not self._store.idem_finish(
                scoped_key, e.owner, response, now + self._ttl):
            raise self._lost(scoped_key)
        e.response = response
        e.expires_at = now + self._ttl
        if e.waiter is not None and not e.waiter.done():
            e.waiter.set_result(response)
        e.waiter = None
        e.owner = None
        e.unstored = False

    def abort(self, scoped_key: str, exc: BaseException) -> None:
        """The create failed: forget the key (a retry may try again) and fail waiters.
        A claim that named a sandbox stays in the store without a holder, so the retry
        looks for that sandbox before creating one."""
        e = self._entries.pop(scoped_key, None)
        if e is not None and e.waiter is not None and not e.waiter.done():
            e.waiter.set_exception(exc)
            # Nobody may be waiting; mark retrieved so asyncio does not log it.
            e.waiter.exception()
        if e is not None and e.owner is not None and self._store is not None:
            owner, store = e.owner, self._store
            try:
                store.idem_release(scoped_key, owner)
            except Exception as err:  # noqa: BLE001 - a store outage, a full disk
                # Kept and retried: until it lands the claim looks held by this live
                # process, and begin answers its key with a retryable error.
                log.warning("releasing idempotency key %r failed (%s): retrying until it "
                            "lands", scoped_key.split("\x00", 1)[-1][:40], err)

                def release() -> bool:
                    store.idem_release(scoped_key, owner)
                    return True
                self._retry_later(release)

    def holds(self, claim: Claim) -> bool:
        """Whether ``claim`` is still this request's (False once another apiserver took
        it over, or its row is gone). Always True without a store."""
        if self._store is None or claim.owner is None:
            return True
        row = self._store.idem_get(claim.key, self._clock())
        return row is not None and row.owner == claim.owner

    def peek(self, scoped_key: str) -> IdempotencyRow | None:
        """The key's row in the store as it is now (None without a store or row)."""
        if self._store is None:
            return None
        return self._store.idem_get(scoped_key, self._clock())

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
        """Stop waiting for other replicas (their waiters get cancelled) and give up this
        process's lease: claims still held are taken over at once."""
        self._closed = True
        tasks = list(self._pollers)
        if self._renewer is not None:
            tasks.append(self._renewer)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._store is not None:
            try:
                self._store.lease_drop(self.holder)
            except Exception:
                log.debug("dropping the idempotency lease failed", exc_info=True)

    def __len__(self) -> int:
        return len(self._entries)
