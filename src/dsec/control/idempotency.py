"""``Idempotency-Key`` handling for create: a retry within the window gets the same answer.

Pure bookkeeping plus an optional durable store. A key is scoped to the principal that
sent it (two users picking the same key never see each other's sandbox) and bound to a
fingerprint of the request body: reusing a key with a *different* body is a caller bug
and gets :class:`~dsec.errors.Conflict` instead of silently returning the wrong sandbox.

States of one key::

    absent --begin--> in_flight --finish--> done --(ttl)--> absent
                         └----abort (create failed)----> absent

A second request arriving while the first is ``in_flight`` waits for it (the caller awaits
the returned future), so two racing retries create one sandbox. Memory is bounded by
``max_entries``; the oldest completed entries go first. When a durable store is given,
completed entries are written through and read back on a miss, so a restarted or other
apiserver replica honours keys it did not see.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dsec.errors import Conflict, InvalidArgument

__all__ = ["Begin", "IdempotencyCache", "IdempotencyStore", "SqliteIdempotencyStore", "fingerprint",
           "validate_key"]

MAX_KEY_LEN = 255


class IdempotencyStore(Protocol):
    """Durable backing (the control plane's state store). Values are opaque bytes."""

    def idem_get(self, key: str, now: float) -> tuple[str, bytes] | None:
        """(fingerprint, response) stored for ``key`` if it has not expired at ``now``."""

    def idem_put(self, key: str, fingerprint: str, response: bytes, expires_at: float) -> None: ...


@dataclass(slots=True)
class _Entry:
    fingerprint: str
    expires_at: float
    response: bytes | None = None                # set when done
    waiter: asyncio.Future[bytes] | None = None  # set while in flight


@dataclass(slots=True, frozen=True)
class Begin:
    """What :meth:`IdempotencyCache.begin` decided.

    Exactly one of: ``replay`` (bytes to send back as-is), ``wait`` (another request with
    this key is in flight: await it for the bytes), or ``proceed`` (do the work, then call
    ``finish`` or ``abort``)."""

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
    def __init__(
        self, *, clock: Callable[[], float], ttl_s: float = 300.0, max_entries: int = 50_000,
        store: IdempotencyStore | None = None,
    ) -> None:
        if ttl_s <= 0 or max_entries < 1:
            raise InvalidArgument(f"ttl_s={ttl_s} and max_entries={max_entries} must be positive")
        self._clock = clock
        self._ttl = ttl_s
        self._max = max_entries
        self._store = store
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    @staticmethod
    def scoped(principal: str, key: str) -> str:
        return f"{principal}\x00{validate_key(key)}"

    def begin(self, scoped_key: str, fp: str) -> Begin:
        now = self._clock()
        e = self._entries.get(scoped_key)
        if e is not None and e.response is not None and e.expires_at <= now:
            del self._entries[scoped_key]
            e = None
        if e is None and self._store is not None:
            hit = self._store.idem_get(scoped_key, now)
            if hit is not None:
                e = _Entry(hit[0], now + self._ttl, response=hit[1])
                self._insert(scoped_key, e)
        if e is not None:
            if e.fingerprint != fp:
                raise Conflict(
                    "this Idempotency-Key was already used with a different request body in "
                    f"the last {self._ttl:g}s; use a new key for a new request",
                    field="Idempotency-Key")
            if e.response is not None:
                return Begin(replay=e.response)
            assert e.waiter is not None
            return Begin(wait=e.waiter)
        waiter: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._insert(scoped_key, _Entry(fp, now + self._ttl, waiter=waiter))
        return Begin(proceed=True)

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
        if self._store is not None:
            self._store.idem_put(scoped_key, e.fingerprint, response, e.expires_at)

    def abort(self, scoped_key: str, exc: BaseException) -> None:
        """The create failed: forget the key (a retry may try again) and fail waiters."""
        e = self._entries.pop(scoped_key, None)
        if e is not None and e.waiter is not None and not e.waiter.done():
            e.waiter.set_exception(exc)
            # Nobody may be waiting; mark retrieved so asyncio does not log it.
            e.waiter.exception()

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

    def __len__(self) -> int:
        return len(self._entries)


class SqliteIdempotencyStore:
    """Durable :class:`IdempotencyStore` in its own SQLite file (WAL) next to the state
    store; the control plane's ``StateStore`` interface has no table for it. Expired rows
    are purged on write, at most once per ``purge_every`` puts."""

    def __init__(self, path: str, *, purge_every: int = 1000) -> None:
        import sqlite3
        import threading

        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        if path != ":memory:":
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS idempotency (key TEXT PRIMARY KEY, "
                         "fp TEXT NOT NULL, response BLOB NOT NULL, expires_at REAL NOT NULL)")
        self._puts = 0
        self._purge_every = purge_every

    def idem_get(self, key: str, now: float) -> tuple[str, bytes] | None:
        with self._lock:
            row = self._db.execute("SELECT fp, response, expires_at FROM idempotency WHERE "
                                   "key = ?", (key,)).fetchone()
        if row is None or row[2] <= now:
            return None
        return str(row[0]), bytes(row[1])

    def idem_put(self, key: str, fingerprint: str, response: bytes, expires_at: float) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO idempotency VALUES (?, ?, ?, ?)",
                             (key, fingerprint, response, expires_at))
            self._puts += 1
            if self._puts % self._purge_every == 0:
                self._db.execute("DELETE FROM idempotency WHERE expires_at < ?",
                                 (expires_at - 3600.0,))

    def close(self) -> None:
        with self._lock:
            self._db.close()
