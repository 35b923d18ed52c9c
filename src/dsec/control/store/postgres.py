"""The :class:`~dsec.control.store.StateStore` that several apiserver replicas share:
PostgreSQL through psycopg 3.

The statements are :class:`~dsec.control.store.sql.SqlStore`'s; what is PostgreSQL's own:

- **a connection pool** (psycopg_pool): each store call takes a connection for one
  transaction (one logical change: :meth:`commit_events` writes events, sandbox rows and
  the NOTIFY together) and gives it back; a broken connection (server restarted) is
  thrown away and replaced by the pool in the background, so a replica reconnects
  without restarting;
- **prepared statements**: psycopg prepares a query server-side on its second use on a
  connection (``prepare_threshold=2``): the store's statements are a fixed set, used
  thousands of times, and the first use of a one-off (schema, probes) is not prepared;
- **version allocation under a lock**: ``LOCK TABLE events IN SHARE ROW EXCLUSIVE MODE``
  in :meth:`commit_events` (``assign_versions=True``), so two replicas never hand out the
  same version and versions become visible in order (a reader never sees N+1 before N);
- **push**: the commit sends ``NOTIFY dsec_events, '<newest version>'`` in its own
  transaction (delivered exactly when the rows become visible); :meth:`listen_versions`
  runs one extra connection that LISTENs and calls back, so another replica's registry
  catches up within milliseconds instead of the 1 s poll;
- **failures are retryable errors**: an unreachable server (down, restarting, refusing)
  raises :class:`~dsec.errors.Unavailable` (HTTP 503 + ``Retry-After``, the same code on
  Aether) within ``pool_timeout_s``, never a hang and never a raw psycopg error; what a
  caller could not write was not acknowledged (the registry keeps its batch queued).

The URL's password is never logged nor put in an error message (:func:`redact_url`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import psycopg
import psycopg_pool

from dsec.control.store import IdempotencyRow, redact_url
from dsec.control.store.sql import Dialect, SqlStore
from dsec.errors import InvalidArgument, Unavailable

__all__ = ["CHANNEL", "POSTGRES", "TAG_CHANNEL", "PostgresStore"]

log = logging.getLogger("dsec.store")

#: The NOTIFY channel commits announce their newest event version on.
CHANNEL = "dsec_events"
TAG_CHANNEL = "dsec_tags"    # image tag table versions (control/store/tags.py)

POSTGRES = Dialect(
    name="postgresql", param="%s", blob="BYTEA",
    write_lock=("LOCK TABLE events IN SHARE ROW EXCLUSIVE MODE",),
    charge_lock=("LOCK TABLE snapshot_charges IN SHARE ROW EXCLUSIVE MODE",),
    # any constant: every dsec store over this database takes the same one
    schema_lock=("SELECT pg_advisory_xact_lock(7346011)",),
)

_CONN_ERRORS = (psycopg.OperationalError, psycopg.InterfaceError)
# SQLSTATE class 40: the server rolled the transaction back (psycopg 3 puts the deadlock
# and serialization classes under OperationalError, not under TransactionRollback).
_ROLLED_BACK = (psycopg.errors.TransactionRollback, psycopg.errors.DeadlockDetected,
                psycopg.errors.SerializationFailure)
_PROBE_S = 0.2
_SCHEMA_ATTEMPTS = 5    # schema set-up runs, when PostgreSQL rolls it back (a deadlock)      # while the server is down, how often a call asks it again


class PostgresStore(SqlStore):
    """A PostgreSQL database as the state store. ``url``: a libpq URL
    (``postgresql://user[:password]@host[:port]/db``; a Unix socket as
    ``postgresql://user@/db?host=/dir``). ``pool_size``: most connections this replica
    holds; ``pool_timeout_s``: how long a call waits for a connection before it fails
    with :class:`Unavailable` (the "fail fast" bound during an outage);
    ``connect_timeout_s``: how long one connection attempt may take."""

    def __init__(self, url: str, *, pool_size: int = 8, pool_timeout_s: float = 2.0,
                 connect_timeout_s: int = 2, retry_after_s: float = 1.0) -> None:
        self.url = url
        self.where = redact_url(url)
        self._retry_after = retry_after_s
        self._secret = _password(url)
        kwargs: dict[str, Any] = {
            "autocommit": False, "prepare_threshold": 2, "connect_timeout": connect_timeout_s,
            "application_name": "dsec-apiserver",
            # Store calls run on the event loop: a server that stops answering must not
            # hold it for ever. Over TCP, a peer that acknowledges nothing for 5 s drops
            # the connection (libpq ignores these on a Unix socket); a statement stuck
            # behind a lock (another replica's stalled transaction) is cancelled at 30 s.
            "keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
            "keepalives_count": 3, "tcp_user_timeout": 5000,
            "options": "-c statement_timeout=30000",
        }
        self._connect_kw = kwargs
        try:
            psycopg.conninfo.conninfo_to_dict(url)
        except psycopg.ProgrammingError as exc:
            raise InvalidArgument(f"bad PostgreSQL URL {self.where!r}: {self._clean(exc)}; "
                                  "use postgresql://user[:password]@host[:port]/database"
                                  ) from None
        # Try once directly first: the pool would only say "timed out", this says why
        # (refused, no such database, authentication failed).
        try:
            psycopg.connect(url, **kwargs).close()
        except psycopg.Error as exc:
            raise Unavailable(
                f"cannot reach the PostgreSQL state store at {self.where}: "
                f"{self._clean(exc)}; check the server is running and the URL's host, "
                "port, database, user and password (or pass --store sqlite:///path to use "
                "a local SQLite file)", retry_after=retry_after_s) from None
        self._pool_size = pool_size
        self._pool_timeout = pool_timeout_s
        self._pool = self._new_pool()
        self._pool.open(wait=True, timeout=max(5.0, pool_timeout_s))
        # Outage state: while down, calls fail at once (no pool wait on the event loop)
        # and one probe a _PROBE_S asks the server directly whether it is back.
        self._down = False
        self._probe_at = 0.0
        self._last_error = ""
        self._callbacks: list[Callable[[int], None]] = []
        self._tag_callbacks: list[Callable[[int], None]] = []
        self._listener: threading.Thread | None = None
        self._closing = threading.Event()
        self.listening = False     # True while the LISTEN connection is up
        try:
            # The schema's CREATE ... IF NOT EXISTS take table locks even when everything
            # exists; a replica starting while another writes can deadlock with it
            # (found by tests/control/test_rolling_upgrade.py: the restarted replica
            # exited "deadlock detected"). PostgreSQL rolls one side back: run it again.
            for attempt in range(_SCHEMA_ATTEMPTS):
                try:
                    super().__init__(None, POSTGRES)
                    break
                except Unavailable as exc:
                    if not exc.detail.get("rolled_back") or attempt + 1 == _SCHEMA_ATTEMPTS:
                        raise
                    log.warning("store: setting up the schema at %s: %s; again", self.where,
                                exc.message)
                    time.sleep(0.05 * (attempt + 1))
        except BaseException:
            self._pool.close()
            raise

    # ------------------------------------------------------------------ plumbing
    def _clean(self, exc: BaseException) -> str:
        msg = " ".join(str(exc).split())
        return msg.replace(self._secret, "***") if self._secret else msg

    def _new_pool(self) -> psycopg_pool.ConnectionPool[psycopg.Connection[Any]]:
        return psycopg_pool.ConnectionPool(
            self.url, kwargs=self._connect_kw, min_size=1, max_size=self._pool_size,
            timeout=self._pool_timeout, open=False, name="dsec-store",
            reconnect_timeout=86_400.0)

    def _unavailable(self) -> Unavailable:
        return Unavailable(
            f"the PostgreSQL state store at {self.where} is unreachable: "
            f"{self._last_error}; retry in {self._retry_after:g}s (replicas reconnect on "
            "their own once the server is back)",
            retry_after=self._retry_after, store="postgresql")

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        """One transaction on a pooled connection: committed when the block ends,
        rolled back on an error. A lost or unreachable server is :class:`Unavailable`,
        at once: store calls run on the apiserver's event loop, and a pool waiting out
        its timeout on every call would stall every request, not only the failing ones
        (measured: 12 s for one gateway create during an outage, behind the loops'
        own store calls, before this)."""
        if self._down:
            self._recover()
        pool = self._pool
        try:
            with pool.connection() as conn, conn.cursor() as cur:
                yield cur
        except _ROLLED_BACK as exc:
            # A deadlock or serialization failure: the server is up and rolled this
            # transaction back; it may be run again (not an outage: the store stays up).
            raise Unavailable(
                f"the PostgreSQL state store at {self.where} rolled a transaction back "
                f"({self._clean(exc)}); retry it", retry_after=0.1, store="postgresql",
                rolled_back=True) from None
        except psycopg.DataError as exc:
            # A value PostgreSQL cannot store (a NUL byte in a text field; SQLite takes
            # it): a request's bad input wherever it came from, never a 500. Found by
            # schemathesis through a session id; the doors check ids too.
            raise InvalidArgument(f"a value of this request cannot be stored: "
                                  f"{self._clean(exc)}") from None
        except _CONN_ERRORS as exc:
            self._last_error = self._clean(exc)
            if not self._down:
                log.warning("store: PostgreSQL at %s unreachable: %s", self.where,
                            self._last_error)
            self._down = True
            self._probe_at = time.monotonic()
            raise self._unavailable() from None

    def _recover(self) -> None:
        """While down: fail at once until the next probe; a probe connects directly
        (a refused socket answers in ~1 ms). When the server answers, the pool is
        replaced by a fresh one: the old one holds dead connections and backs off its
        reconnects exponentially (psycopg_pool: 1 s, 2 s, 4 s...), so it would come back
        seconds after the server did."""
        now = time.monotonic()
        if now < self._probe_at:
            raise self._unavailable()
        self._probe_at = now + _PROBE_S
        try:
            psycopg.connect(self.url, **{**self._connect_kw, "connect_timeout": 1}).close()
        except psycopg.Error as exc:
            self._last_error = self._clean(exc)
            raise self._unavailable() from None
        old, self._pool = self._pool, self._new_pool()
        self._pool.open(wait=False)
        threading.Thread(target=old.close, name="dsec-store-pool-close", daemon=True).start()
        self._down = False
        log.warning("store: PostgreSQL at %s is reachable again", self.where)

    def _committing(self, cur: Any, newest: int) -> None:
        # Delivered to listeners at commit, in commit order, never for a rollback.
        cur.execute("SELECT pg_notify(%s, %s)", (CHANNEL, str(newest)))

    def _tags_changed(self, cur: Any, version: int) -> None:
        cur.execute("SELECT pg_notify(%s, %s)", (TAG_CHANNEL, str(version)))

    # ------------------------------------------------------------ idempotency keys
    # The apiserver scopes a key by its principal with a NUL separator (see
    # dsec.control.idempotency), which SQLite's TEXT holds and PostgreSQL's refuses. The
    # key is kept as text (indexable, readable) with NUL written as U+001F, which
    # check_idempotency_key refuses in a key, so the mapping is one-to-one.
    def idem_claim(self, row: IdempotencyRow, now: float) -> IdempotencyRow:
        got = super().idem_claim(msgspec.structs.replace(row, key=_k(row.key)), now)
        return msgspec.structs.replace(got, key=row.key)

    def idem_get(self, key: str, now: float) -> IdempotencyRow | None:
        got = super().idem_get(_k(key), now)
        return None if got is None else msgspec.structs.replace(got, key=key)

    def idem_note(self, key: str, owner: str, intent: str) -> bool:
        return super().idem_note(_k(key), owner, intent)

    def idem_finish(self, key: str, owner: str, response: bytes, expires_at: float) -> bool:
        return super().idem_finish(_k(key), owner, response, expires_at)

    def idem_release(self, key: str, owner: str) -> bool:
        return super().idem_release(_k(key), owner)

    # ------------------------------------------------------------------ watch
    def listen_versions(self, callback: Callable[[int], None]) -> bool:
        self._callbacks.append(callback)
        self._start_listener()
        return True

    def listen_tags(self, callback: Callable[[int], None]) -> bool:
        self._tag_callbacks.append(callback)
        self._start_listener()
        return True

    def _start_listener(self) -> None:
        if self._listener is None:
            self._listener = threading.Thread(target=self._listen_loop,
                                              name="dsec-store-listen", daemon=True)
            self._listener.start()

    def _fire(self, version: int, channel: str = CHANNEL) -> None:
        for cb in list(self._tag_callbacks if channel == TAG_CHANNEL else self._callbacks):
            try:
                cb(version)
            except Exception:  # a watcher's bug must not stop the others
                log.exception("store version callback failed")

    def _listen_loop(self) -> None:
        """LISTEN on a connection of its own (a pooled one would be handed to others);
        reconnect with backoff after a failure and then call back with -1, since
        notifications sent meanwhile are lost: the watcher reads what it missed."""
        backoff, missed = 0.05, False
        while not self._closing.is_set():
            try:
                with psycopg.connect(self.url, autocommit=True,
                                     connect_timeout=self._connect_kw["connect_timeout"],
                                     application_name="dsec-listen") as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    conn.execute(f"LISTEN {TAG_CHANNEL}")
                    self.listening = True
                    backoff = 0.05
                    if missed:
                        self._fire(-1)
                        self._fire(-1, TAG_CHANNEL)
                        missed = False
                    while not self._closing.is_set():
                        # timeout: how often close() is noticed; a notification wakes
                        # it at once.
                        for n in conn.notifies(timeout=0.2):
                            try:
                                version = int(n.payload)
                            except ValueError:
                                version = -1
                            self._fire(version, n.channel)
            except psycopg.Error as exc:
                self.listening = False
                if self._closing.is_set():
                    break
                if not missed:
                    log.warning("store: LISTEN connection to %s lost (%s); reconnecting",
                                self.where, self._clean(exc))
                missed = True
                self._closing.wait(backoff)
                backoff = min(backoff * 2, 1.0)
        self.listening = False

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        self._closing.set()
        if self._listener is not None:
            self._listener.join(timeout=5.0)
        self._pool.close()


def _k(key: str) -> str:
    return key.replace("\x00", "\x1f")


def _password(url: str) -> str | None:
    try:
        return psycopg.conninfo.conninfo_to_dict(url).get("password")  # type: ignore[return-value]
    except psycopg.Error:
        return None

