"""The edge's durable record of which sandboxes it owns: an append-only JSON-lines journal.

A restarted edge reads it back to know what it owns and asks each backend to adopt
those sandboxes (DESIGN.md, "the edge is the source of truth").

Writes are batched per tick, not per operation: :meth:`SandboxJournal.put` and
:meth:`SandboxJournal.delete` only note the sandbox id in a dict, and
:meth:`SandboxJournal.flush` (called by the node every ``flush_interval_s`` and on
close) encodes the *current* state of each noted sandbox and appends it in one
``write``. A sandbox created and destroyed within one tick costs no I/O at all, which
is what keeps the 100k-lifecycle burst off the disk. A crash loses at most one tick of
changes; those sandboxes are then either unknown to the restarted edge (created late:
the backend's own orphan sweep must handle them) or adopted and found gone (destroyed
late: recorded as ``node_lost``). ``fsync=True`` also survives power loss.

The journal is compacted (rewritten with only live records, then renamed over) on
load and whenever it holds more than 4x the live records plus 10,000 lines.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Callable, Iterable
from typing import Protocol

import msgspec

from dsec.edge.spec import SandboxSpec, SandboxState
from dsec.errors import InUse, InvalidArgument

__all__ = ["JournalRecord", "Journaled", "SandboxJournal"]

log = logging.getLogger("dsec.edge.journal")

JOURNAL = "sandboxes.jsonl"
LOCK = "edge.lock"


class JournalRecord(msgspec.Struct, array_like=True, tag="put"):
    """One sandbox as the journal stores it."""

    id: str
    state: SandboxState
    spec: SandboxSpec
    created_at: float
    last_active_at: float


class _Delete(msgspec.Struct, array_like=True, tag="del"):
    id: str


class Journaled(Protocol):
    """What the journal reads from a live sandbox record at flush time."""

    id: str
    state: SandboxState
    spec: SandboxSpec
    created_at: float
    last_active_at: float


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(JournalRecord | _Delete)


class SandboxJournal:
    """See the module docstring. Holds an exclusive lock on the state dir while open."""

    def __init__(self, state_dir: str, *, fsync: bool = False) -> None:
        self.state_dir = os.path.abspath(state_dir)
        self.path = os.path.join(self.state_dir, JOURNAL)
        self.fsync = fsync
        self._pending: dict[str, Journaled | None] = {}
        self._on_disk: set[str] = set()
        self._lines = 0
        self._fd = -1
        self._lock_fd = -1
        self.bytes_written = 0

    # ------------------------------------------------------------------ open/load
    def open(self) -> dict[str, JournalRecord]:
        """Lock the state dir, read what it holds, compact it; returns records by id."""
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
        records = self._read()
        self._rewrite(records.values())
        return records

    def _read(self) -> dict[str, JournalRecord]:
        records: dict[str, JournalRecord] = {}
        try:
            with open(self.path, "rb") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return records
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = _decoder.decode(line)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                # A torn last line is what a crash mid-write leaves; anything else is
                # corruption we report but survive (the other records still count).
                log.warning("journal %s line %d unreadable, skipped: %s", self.path, n, exc)
                continue
            if isinstance(rec, _Delete):
                records.pop(rec.id, None)
            else:
                records[rec.id] = rec
        return records

    def _rewrite(self, records: Iterable[Journaled]) -> None:
        tmp = self.path + ".tmp"
        n = 0
        ids: set[str] = set()
        with open(tmp, "wb") as f:
            chunk: list[bytes] = []
            for r in records:
                chunk.append(_encoder.encode(_record(r)))
                ids.add(r.id)
                n += 1
                if len(chunk) >= 4096:
                    f.write(b"\n".join(chunk) + b"\n")
                    chunk.clear()
            if chunk:
                f.write(b"\n".join(chunk) + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self._on_disk = ids
        self._lines = n

    # ------------------------------------------------------------------ hot path
    def put(self, rec: Journaled) -> None:
        """Note that ``rec`` changed; its state at the next flush is what gets written."""
        self._pending[rec.id] = rec

    def delete(self, sandbox_id: str) -> None:
        self._pending[sandbox_id] = None

    @property
    def dirty(self) -> bool:
        return bool(self._pending)

    def flush(self, live: Callable[[], Iterable[Journaled]] | None = None) -> int:
        """Append every noted change in one write; returns the lines written.

        ``live`` lists the live records, used to compact when the file has grown.
        """
        if not self._pending or self._fd < 0:
            return 0
        pending, self._pending = self._pending, {}
        on_disk = self._on_disk
        out: list[bytes] = []
        for sid, rec in pending.items():
            if rec is None:
                if sid in on_disk:
                    on_disk.discard(sid)
                    out.append(_encoder.encode(_Delete(sid)))
            else:
                on_disk.add(sid)
                out.append(_encoder.encode(_record(rec)))
        if out:
            data = b"\n".join(out) + b"\n"
            os.write(self._fd, data)
            if self.fsync:
                os.fsync(self._fd)
            self.bytes_written += len(data)
            self._lines += len(out)
        if live is not None and self._lines > 4 * len(on_disk) + 10_000:
            self._rewrite(live())
        return len(out)

    def close(self) -> None:
        for fd in (self._fd, self._lock_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._lock_fd = -1


def _record(r: Journaled) -> JournalRecord:
    if isinstance(r, JournalRecord):
        return r
    return JournalRecord(id=r.id, state=r.state, spec=r.spec, created_at=r.created_at,
                         last_active_at=r.last_active_at)
