"""The edge's durable record of its sandboxes: an append-only JSON-lines journal.

A restarted edge reads it back to know what it owns (and what ended, with the reason)
and asks each backend to adopt the live ones (DESIGN.md, "the edge is the source of
truth"; "durable before acknowledged").

Lines (``<state-dir>/sandboxes.jsonl``)::

    ["put", id, state, spec, created_at, last_active_at]       a live sandbox
    ["end", id, state, spec, created_at, ended_at, reason, detail]   a tombstone
    ["del", id]                                                 (read only: old journals)

Writes are batched, never one per operation. :meth:`SandboxJournal.put` and
:meth:`SandboxJournal.end` only note the sandbox in a dict; a write takes everything
noted since the previous one, encodes the *current* state of each and appends it in one
``write``. How a caller waits for that is the :data:`JournalSync` mode:

- ``"fsync"`` (default): :meth:`SandboxJournal.commit` returns once a write **and
  fsync** covering everything noted before the call has completed. Concurrent callers
  share one write+fsync (group commit): a write starts as soon as the previous one is
  done, on a thread of its own so the event loop keeps serving (and noting) meanwhile,
  and takes everything noted by then. Survives kill -9 of the edge and power loss.
- ``"write"``: the same without the fsync (the page cache survives kill -9 of the edge,
  not a host crash - after which no sandbox survives either, only the knowledge that it
  existed).
- ``"tick"``: :meth:`commit` returns at once; the node writes once per
  ``flush_interval_s``. A crash loses up to one tick of changes; a sandbox created and
  destroyed within one tick costs no I/O at all. For scale tests of the control plane.

The node commits (and so waits) before it acts on an intent that must be found after a
crash (create) and before it answers a change that must survive one (create, destroy,
pause, resume); see docs/edge.md "Persistence". A failed write hands the error to every
waiter of that write and keeps the records noted, so the next write retries them (a
half-written line is fenced off with a newline, so it cannot swallow the next record).

The journal is compacted (rewritten with the live records and the newest tombstones,
then renamed over) on open and whenever it holds more than 4x the kept records plus
10,000 lines, or more than 4x the bytes its last rewrite kept plus 256 MiB: a record
carries its spec (env up to 512 KiB, ~3 MB of JSON in control bytes), so lines alone did
not bound the file (red team 22, B4's class); tombstones are kept by bytes too (256 MiB
of the newest). It is read back line by line. A rewrite that fails at open (a full state
disk) is logged and the edge appends to the file as it is (B6's class).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import BinaryIO, Literal, Protocol

import msgspec

from dsec.errors import BackendError, InUse, InvalidArgument
from dsec.wire.ports import PortRecord
from dsec.wire.spec import SandboxSpec, SandboxState

__all__ = ["JournalContents", "JournalEnd", "JournalRecord", "JournalSync", "Journaled",
           "SandboxJournal"]

log = logging.getLogger("dsec.edge.journal")

JOURNAL = "sandboxes.jsonl"
LOCK = "edge.lock"
#: the longest line read back: far above any record the wire's spec limits allow (env
#: 512 KiB, labels ~80 KiB: a few MB of JSON); a longer one is corruption, skipped unread
_MAX_LINE = 64 << 20

JournalSync = Literal["fsync", "write", "tick"]
JOURNAL_SYNC_MODES: tuple[JournalSync, ...] = ("fsync", "write", "tick")


class JournalRecord(msgspec.Struct, array_like=True, tag="put"):
    """One live sandbox as the journal stores it (``ports``: its exposed ports, last so a
    line of an earlier release still reads)."""

    id: str
    state: SandboxState
    spec: SandboxSpec
    created_at: float
    last_active_at: float
    # Trailing and defaulted (array_like: a journal written before them still reads):
    # the generation of the sandbox's network policy (network_update compares and bumps
    # it) and the deny entries of its project's network ceilings, enforced with its own.
    net_generation: int = 0
    ceiling_deny: tuple[str, ...] = ()
    # nc's exposed ports, after nb's fields (array_like: appended, defaulted)
    ports: tuple[PortRecord, ...] = ()
    # issue 19's lifetime (appended, defaulted): the running clock's deadline (unix
    # seconds) or, paused, the stopped clock's time left; why it is paused. A line
    # without them had created_at + spec.ttl_s (dsec.edge.lifecycle.adopted_lifetime).
    expires_at: float | None = None
    ttl_left_s: float | None = None
    paused_reason: str = ""
    # when it was paused (appended, defaulted): its paused retention runs from here
    # (NodeConfig.paused_retention_s); a paused line without it is retained from adoption
    paused_at: float | None = None

    @property
    def port_records(self) -> tuple[PortRecord, ...]:
        return self.ports

    @property
    def ttl_left(self) -> float | None:
        return self.ttl_left_s


class JournalEnd(msgspec.Struct, array_like=True, tag="end", frozen=True):
    """A sandbox that ended: its final state and reason, kept so ``get(id)`` answers
    after a restart (the newest ``keep_ended`` of them)."""

    id: str
    state: SandboxState       # "destroyed", or "failed" for a create rolled back
    spec: SandboxSpec
    created_at: float
    ended_at: float
    reason: str
    detail: str = ""


class _Delete(msgspec.Struct, array_like=True, tag="del"):
    id: str


class Journaled(Protocol):
    """What the journal reads from a live sandbox record at write time."""

    id: str
    state: SandboxState
    spec: SandboxSpec
    created_at: float
    last_active_at: float
    net_generation: int
    ceiling_deny: tuple[str, ...]
    expires_at: float | None
    paused_reason: str
    paused_at: float | None

    @property
    def ttl_left(self) -> float | None: ...

    @property
    def port_records(self) -> tuple[PortRecord, ...]: ...


class Ending(Protocol):
    """A record that ended: the journal asks it for its tombstone at write time (so a
    sandbox created and ended within one tick costs nothing in ``tick`` mode)."""

    id: str

    def ended(self) -> JournalEnd: ...


@dataclass(frozen=True, slots=True)
class JournalContents:
    """What :meth:`SandboxJournal.open` found: live records by id, tombstones oldest first."""

    records: dict[str, JournalRecord]
    ended: list[JournalEnd]


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(JournalRecord | JournalEnd | _Delete)

# A noted change: the live record (state read at write time) with an optional state to
# write instead of its current one, or a tombstone (ready, or made at write time).
_Noted = tuple[Journaled, SandboxState | None] | JournalEnd | Ending
# What to keep when compacting: (live records, tombstones oldest first).
KeepFn = Callable[[], tuple[Iterable[Journaled], Iterable[JournalEnd]]]


class SandboxJournal:
    """See the module docstring. Holds an exclusive lock on the state dir while open."""

    def __init__(self, state_dir: str, *, sync: JournalSync = "fsync",
                 keep_ended: int = 10_000, compact_min_lines: int = 10_000,
                 keep_ended_bytes: int = 256 << 20, compact_min_bytes: int = 256 << 20,
                 fsync: Callable[[int], None] = os.fsync) -> None:
        """``compact_min_lines``/``compact_min_bytes``: lines/bytes the file may hold
        beyond 4x what it keeps before it is compacted; ``keep_ended_bytes``: the most
        bytes of tombstones a compaction keeps (the newest). ``fsync``: the call that makes the file durable (injected so
        tests can make it fail the way a failing disk does)."""
        if sync not in JOURNAL_SYNC_MODES:
            raise InvalidArgument(f"journal sync mode {sync!r} is not one of "
                                  f"{', '.join(JOURNAL_SYNC_MODES)}", field="journal_sync")
        self.state_dir = os.path.abspath(state_dir)
        self.path = os.path.join(self.state_dir, JOURNAL)
        self.sync: JournalSync = sync
        self.keep_ended = keep_ended
        self.compact_min_lines = compact_min_lines
        self.keep_ended_bytes = keep_ended_bytes
        self.compact_min_bytes = compact_min_bytes
        self._size = 0                        # bytes in the file
        self._kept = 0                        # bytes the last rewrite left in it
        self._read_lines = self._read_bytes = 0
        self._fsync = fsync
        self._pending: dict[str, _Noted] = {}
        self._on_disk: dict[str, SandboxState] = {}  # live id -> state its line says
        self._lines = 0
        self._fd = -1
        self._lock_fd = -1
        self._torn = False                    # the last write may have left half a line
        self._failing = False                 # writes fail (logged once, not per tick)
        self._keep: KeepFn | None = None
        # group commit: a future per commit() since the last write started (one each, so
        # a cancelled waiter cancels only its own), and whether a write is in flight.
        # Measured: a shared future under asyncio.shield costs a future and two callbacks
        # more per waiter; this took the batched durable burst from ~8k to ~14k/s.
        self._waiting: list[tuple[asyncio.Future[None], bool]] | None = None  # (fut, fsync?)
        self._scheduled = False
        # The fsync pipeline: waiters whose records are written and need an fsync that
        # starts after their write, what those records were (re-noted if it fails), and
        # whether an fsync is running on the journal thread.
        self._sync_waiting: list[asyncio.Future[None]] = []
        self._sync_taken: dict[str, _Noted] = {}
        self._syncing = False
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.bytes_written = 0
        self.writes = 0                        # write(2) calls that appended records
        self.syncs = 0                         # of which were followed by fsync
        self.compactions = 0                   # rewrites of the file (open included)

    # ------------------------------------------------------------------ open/load
    def open(self, keep: KeepFn | None = None) -> JournalContents:
        """Lock the state dir, read what it holds, compact it. ``keep`` lists what to
        keep when the file is compacted later (the node's live records and tombstones)."""
        self._keep = keep
        try:
            os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
            lock_path = os.path.join(self.state_dir, LOCK)
            self._lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise InvalidArgument(f"cannot use state dir {self.state_dir}: {exc.strerror}; "
                                  "pass a writable --state-dir") from exc
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            owner = os.pread(self._lock_fd, 32, 0).decode(errors="replace").strip()
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise InUse(f"state dir {self.state_dir} is locked by another edge (pid {owner or '?'}); "
                        "stop it or use another --state-dir", state_dir=self.state_dir) from exc
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)
        contents = self._read()
        try:
            self._rewrite(contents.records.values(), contents.ended)
        except OSError as exc:
            # A full state disk (red team 22, B6's class): the file read fine and the
            # rewrite is an optimisation - keep appending to it (its tail fenced off, it
            # may be half a line) so the edge starts and takes its sandboxes back.
            log.error("journal %s: rewrite at open failed (%s); appending to the file as "
                      "it is", self.path, exc)
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT
                                   | os.O_CLOEXEC, 0o600)
            except OSError as exc2:
                self.close()
                raise BackendError(f"cannot rewrite the journal {self.path}: {exc}, nor "
                                   f"open it: {exc2}; free space on (or repair) the state "
                                   "dir's filesystem", path=self.path) from exc
            self._on_disk = {sid: r.state for sid, r in contents.records.items()}
            self._lines = self._read_lines
            self._size = self._kept = self._read_bytes
            self._torn = True
        return contents

    def _read(self) -> JournalContents:
        records: dict[str, JournalRecord] = {}
        ended: dict[str, JournalEnd] = {}
        self._read_lines = self._read_bytes = 0
        try:
            f = open(self.path, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            return JournalContents({}, [])
        with f:
            return self._read_from(f, records, ended)

    def _read_from(self, f: BinaryIO, records: dict[str, JournalRecord],
                   ended: dict[str, JournalEnd]) -> JournalContents:
        """Line by line (red team 22, B4's class: the file can be GBs; its lines are
        bounded by the wire's spec limits, a longer one is skipped unread)."""
        n = 0
        while True:
            line = f.readline(_MAX_LINE + 1)
            if not line:
                break
            n += 1
            if len(line) > _MAX_LINE and not line.endswith(b"\n"):
                while line and not line.endswith(b"\n"):
                    line = f.readline(1 << 20)
                log.warning("journal %s line %d over %d bytes, skipped", self.path, n,
                            _MAX_LINE)
                continue
            if not line.strip():
                continue
            try:
                rec = _decoder.decode(line)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                # A torn line is what a crash (or a full disk) mid-write leaves; anything
                # else is corruption we report but survive (the other records count).
                log.warning("journal %s line %d unreadable, skipped: %s", self.path, n, exc)
                continue
            if isinstance(rec, JournalRecord):
                records[rec.id] = rec
                ended.pop(rec.id, None)
            else:
                records.pop(rec.id, None)
                if isinstance(rec, JournalEnd):
                    ended.pop(rec.id, None)  # re-insert: newest last
                    ended[rec.id] = rec
        self._read_lines, self._read_bytes = n, f.tell()
        tombs = list(ended.values())[-self.keep_ended:] if self.keep_ended else []
        return JournalContents(records, tombs)

    def _rewrite(self, records: Iterable[Journaled], ended: Iterable[JournalEnd]) -> None:
        """Replace the file with ``records`` and ``ended`` (the newest ``keep_ended``).

        A record that already has a line in the file is rewritten with the state that
        line holds, not the record's state now: the file's meaning must not change under
        a compaction. (A create's ``running`` line is written while the node still says
        ``creating`` - it switches once the line is durable, then answers; rewriting it
        as ``creating`` rolled back an answered create after a crash. A sandbox caught
        ``pausing`` keeps the ``running`` its file said.)"""
        tmp = self.path + ".tmp"
        states: dict[str, SandboxState] = {}
        written = self._on_disk
        chunk: list[bytes] = []
        for r in records:
            rec = _record(r, written.get(r.id))
            chunk.append(_encoder.encode(rec))
            states[r.id] = rec.state
        if self.keep_ended:
            # the newest keep_ended tombstones, and no more than keep_ended_bytes of them:
            # each holds its sandbox's spec (env up to 512 KiB, ~3 MB of JSON as control
            # bytes), 10,000 of those were tens of GB (red team 22, B4's class)
            tombs: list[bytes] = []
            room = self.keep_ended_bytes
            for t in reversed(list(ended)[-self.keep_ended:]):
                line = _encoder.encode(t)
                room -= len(line) + 1
                if room < 0:
                    break
                tombs.append(line)
            chunk.extend(reversed(tombs))
        n = len(chunk)
        size = sum(map(len, chunk)) + n
        # The new descriptor is opened on the temp file before the rename and swapped in
        # after it: a failure at any step leaves the old file and descriptor in use (an
        # open after closing the old one could fail, e.g. EMFILE, and leave a closed fd
        # number that a later open reuses - the journal would append into that file).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC,
                     0o600)
        try:
            for k in range(0, n, 4096):
                data = memoryview(b"\n".join(chunk[k:k + 4096]) + b"\n")
                while data:
                    data = data[os.write(fd, data):]
            self._fsync(fd)
            os.replace(tmp, self.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):  # a full disk wants its space back
                os.unlink(tmp)
            raise
        with contextlib.suppress(OSError):  # make the rename itself durable
            dfd = os.open(self.state_dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                self._fsync(dfd)
            finally:
                os.close(dfd)
        old, self._fd = self._fd, fd
        if old >= 0:
            os.close(old)
        self._on_disk = states
        self._lines = n
        self._size = self._kept = size
        self._torn = False
        self.compactions += 1

    # ------------------------------------------------------------------ noting
    def put(self, rec: Journaled, state: SandboxState | None = None) -> None:
        """Note that ``rec`` changed; its state at the next write is what gets written,
        or ``state`` if given (a state the caller will switch to once it is durable)."""
        self._pending[rec.id] = (rec, state)

    def end(self, tomb: JournalEnd | Ending) -> None:
        """Note that a sandbox ended. In ``tick`` mode a sandbox that never reached the
        file (created and ended within one tick) is not written at all."""
        self._pending[tomb.id] = tomb

    @property
    def dirty(self) -> bool:
        return bool(self._pending)

    # ------------------------------------------------------------------ writing
    def _take(self) -> tuple[bytes, dict[str, _Noted]]:
        """Encode everything noted (in the caller's thread: records are read here)."""
        pending, self._pending = self._pending, {}
        on_disk = self._on_disk
        tick = self.sync == "tick"
        out: list[bytes] = []
        for sid, item in pending.items():
            if isinstance(item, tuple):
                out.append(_encoder.encode(_record(*item)))
            elif not tick or sid in on_disk:
                out.append(_encoder.encode(item if isinstance(item, JournalEnd)
                                           else item.ended()))
        if not out:
            return b"", pending
        data = b"\n".join(out) + b"\n"
        if self._torn:
            data = b"\n" + data
        return data, pending

    def _append(self, data: bytes) -> None:
        """write(2) all of ``data`` (the fsync, if any, is the pipeline's job)."""
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]

    def _applied(self, data: bytes, taken: dict[str, _Noted]) -> None:
        on_disk = self._on_disk
        for sid, item in taken.items():
            if isinstance(item, tuple):
                on_disk[sid] = item[1] or item[0].state  # as _take encoded it
            else:
                on_disk.pop(sid, None)
        if data:
            self.bytes_written += len(data)
            self._size += len(data)
            self.writes += 1
            self._lines += data.count(b"\n")
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        """Rewrite the file when it has grown well past what it keeps - never while an
        fsync runs on the old file descriptor (the next write or fsync retries)."""
        keep = self._keep
        if (keep is not None and not self._syncing
                and (self._lines > 4 * (len(self._on_disk) + self.keep_ended)
                     + self.compact_min_lines
                     or self._size > 4 * self._kept + self.compact_min_bytes)):
            try:
                self._rewrite(*keep())
            except OSError:
                log.exception("journal compaction failed; the appended file stays valid")

    def _failed(self, taken: dict[str, _Noted]) -> None:
        """Keep what a failed write held noted (unless noted again since) for a retry."""
        self._torn = True
        for sid, item in taken.items():
            self._pending.setdefault(sid, item)

    def flush(self) -> int:
        """Write everything noted now, in the calling thread (the tick loop, close);
        returns the bytes appended."""
        if self._fd < 0 or not self._pending:
            return 0
        data, taken = self._take()
        try:
            if data:
                self._append(data)
        except OSError:
            self._failed(taken)
            raise
        self._applied(data, taken)
        return len(data)

    async def commit(self, *, sync: bool = True) -> None:
        """Return once everything noted before this call is written - and, with ``sync``
        in ``fsync`` mode, fsynced. Concurrent callers share one write and one fsync
        (group commit). Raises ``BackendError`` if that write or fsync failed (the
        records stay noted for a retry).

        ``sync=False`` is for intents: a record that only has to be found after a crash
        of the *edge* (the page cache survives kill -9). After a host crash no sandbox
        process survives either, and what is left on disk is found by the backend's
        reconcile at start, so an intent does not pay for an fsync; the answer to the
        caller does."""
        if self.sync == "tick" or self._fd < 0:
            return
        fut = asyncio.get_running_loop().create_future()
        waiting = self._waiting
        if waiting is None:
            waiting = self._waiting = []
            self._schedule()
        waiting.append((fut, sync and self.sync == "fsync"))
        await fut

    def write_soon(self) -> None:
        """Start a write of what is noted (the tick loop's job in every mode; nobody
        waits for it)."""
        if self._pending and self._fd >= 0:
            self._schedule()

    def _schedule(self) -> None:
        if self._scheduled:
            return
        self._scheduled = True
        # call_soon, not now: every caller already woken in this loop iteration (e.g. the
        # rest of a create_many, or the waiters of the fsync that just finished) notes
        # its record first and rides along in the same write.
        asyncio.get_running_loop().call_soon(self._start)

    def _start(self) -> None:
        """Write everything noted (on the loop: write(2) into the page cache costs
        ~10 µs, less than a thread hop), answer the waiters that need no fsync, and
        hand the others to the fsync pipeline."""
        self._scheduled = False
        waiters, self._waiting = self._waiting or [], None
        if self._fd < 0:
            _resolve([f for f, _ in waiters], None)
            return
        data, taken = self._take()
        if data:
            try:
                self._append(data)
            except OSError as exc:
                self._failed(taken)
                self._report_failure(exc)
                _resolve([f for f, _ in waiters], self._error(exc))
                return
        self._recovered()
        self._applied(data, taken)
        _resolve([f for f, need in waiters if not need], None)
        synced = [f for f, need in waiters if need]
        if synced:
            self._sync_waiting.extend(synced)
            self._sync_taken.update(taken)
            self._sync_soon()

    def _sync_soon(self) -> None:
        """Start an fsync for the waiters whose records are written, unless one is in
        flight (it starts the next when done: an fsync started before a write does not
        cover it)."""
        if self._syncing or not self._sync_waiting:
            return
        waiters, self._sync_waiting = self._sync_waiting, []
        taken, self._sync_taken = self._sync_taken, {}
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "dsec-journal")
        self._syncing = True
        # fsync takes ~0.2-3 ms here (MACHINE-NOTES: VM disk); on its own thread the loop
        # keeps serving, noting and writing meanwhile; those writes ride the next fsync.
        task = asyncio.get_running_loop().run_in_executor(self._pool, self._fsync, self._fd)
        task.add_done_callback(
            lambda t: self._synced(waiters, taken, None if t.cancelled() else t.exception()))

    def _synced(self, waiters: list[asyncio.Future[None]], taken: dict[str, _Noted],
                exc: BaseException | None) -> None:
        self._syncing = False
        self.syncs += exc is None
        if exc is None:
            _resolve(waiters, None)
        else:
            # What the page cache held may not reach the disk: write it again (later
            # lines win on load) and fail the callers who needed it durable. Linux
            # reports a writeback error to one fsync only (errseq_t), so the next fsync
            # of this descriptor succeeds even if pages written *before this failure*
            # were lost: the records written since and waiting for that next fsync are
            # suspect too. They are noted again (newest first wins) and their waiters
            # wait for that new write and an fsync started after it.
            self._failed(self._sync_taken)
            self._failed(taken)
            self._sync_taken = {}
            requeue, self._sync_waiting = self._sync_waiting, []
            self._report_failure(exc)
            _resolve(waiters, self._error(exc))
            if requeue:
                again = self._waiting
                if again is None:
                    again = self._waiting = []
                    self._schedule()
                again.extend((f, True) for f in requeue)
        self._maybe_compact()
        self._sync_soon()

    def _error(self, exc: BaseException) -> BackendError:
        return BackendError(
            f"the edge could not record the change in its journal {self.path}: {exc}; "
            "free space on (or repair) the state dir's filesystem", path=self.path)

    def _report_failure(self, exc: BaseException) -> None:
        if not self._failing:
            self._failing = True
            log.error("journal write to %s failed (retried every tick; answers that "
                      "need it fail meanwhile): %s", self.path, exc)

    def _recovered(self) -> None:
        if self._failing:
            self._failing = False
            log.warning("journal writes to %s work again", self.path)

    async def drain(self) -> None:
        """Wait until no write or fsync is in flight or scheduled (close)."""
        while self._syncing or self._scheduled:
            await asyncio.sleep(0.001)

    def close(self) -> None:
        # The fsync thread first: it holds the journal's fd number, and closing that
        # under it would have it fsync whatever file took the number next while its
        # waiters are told their records are durable.
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for fd in (self._fd, self._lock_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._lock_fd = -1


def _resolve(waiters: list[asyncio.Future[None]], exc: BaseException | None) -> None:
    """Wake every waiter of one write (a cancelled one is already done)."""
    for fut in waiters:
        if not fut.done():
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)


def _record(r: Journaled, state: SandboxState | None) -> JournalRecord:
    if isinstance(r, JournalRecord) and state is None:
        return r
    return JournalRecord(id=r.id, state=state or r.state, spec=r.spec,
                         created_at=r.created_at, last_active_at=r.last_active_at,
                         net_generation=r.net_generation, ceiling_deny=r.ceiling_deny,
                         ports=r.port_records, expires_at=r.expires_at,
                         ttl_left_s=r.ttl_left, paused_reason=r.paused_reason,
                         paused_at=r.paused_at)
