"""Disk room promised to writers of a filesystem and not yet written (one ledger per
process, per filesystem).

A writer of a layer store's filesystem (a fetched layer, a snapshot, a pulled layer)
checks the free space before it writes. Measured alone, that check is check-then-act:
two writers at once both count the same free bytes and together write through the
reserve the state dir's SQLite and journals need (red team 16 F9: two fetches onto one
node, one ENOSPC answered as an internal error). So every writer takes a :class:`Grant`
here in the same step as its check (under one lock) and subtracts every other grant on
that filesystem from the free space it sees; a grant shrinks as its bytes are written
(what is written shows in ``statvfs`` already) and is released on publish or failure.

The ledger is per process: the edge's fetches and snapshots share it; the apiserver's
pulls share theirs. Two processes writing one filesystem (``dsec up``'s apiserver and
its edges on one state dir) still each keep a reserve of their own, and an ENOSPC that
happens anyway is a capacity refusal at every writer, never an internal error.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

__all__ = ["Grant", "Room", "admit", "admit_async", "pending"]

_lock = threading.Lock()
_grants: dict[int, set[Grant]] = {}


@dataclass(eq=False, slots=True)
class Grant:
    """Bytes one writer may still write on filesystem ``dev``."""

    dev: int
    remaining: int

    def wrote(self, n: int) -> None:
        """``n`` bytes reached the filesystem (``statvfs`` counts them now)."""
        with _lock:
            self.remaining = max(0, self.remaining - n)

    def release(self) -> None:
        """Published or refused: nothing more will be written under this grant."""
        with _lock:
            held = _grants.get(self.dev)
            if held is not None:
                held.discard(self)
                if not held:
                    del _grants[self.dev]
            self.remaining = 0

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(frozen=True, slots=True)
class Room:
    """What a check saw: ``free`` bytes on the filesystem, ``total`` its size,
    ``pending`` granted to other writers and not yet written."""

    free: int
    total: int
    pending: int


def pending(path: str) -> int:
    """Bytes granted to writers of ``path``'s filesystem and not yet written."""
    dev = os.stat(path).st_dev
    with _lock:
        return sum(g.remaining for g in _grants.get(dev, ()))


def admit(path: str, size: Callable[[Room], int | None], *,
          free: Callable[[str], int] | None = None) -> tuple[Grant | None, Room]:
    """Measure ``path``'s filesystem and, under the ledger's lock, ask ``size`` how many
    bytes to grant given what it sees (None: refuse). Returns the grant (None when
    refused) and what was seen, for the caller's error message. ``free``: the free
    bytes from elsewhere (a test's)."""
    dev = os.stat(path).st_dev
    with _lock:
        st = os.statvfs(path)
        room = Room(free=st.f_bavail * st.f_frsize if free is None else free(path),
                    total=st.f_blocks * st.f_frsize,
                    pending=sum(g.remaining for g in _grants.get(dev, ())))
        n = size(room)
        if n is None:
            return None, room
        g = Grant(dev, max(0, n))
        _grants.setdefault(dev, set()).add(g)
        return g, room


async def admit_async(path: str, size: Callable[[Room], int | None], *,
                      free: Callable[[str], int] | None = None) -> tuple[Grant | None, Room]:
    """:func:`admit` in a worker thread (``statvfs`` may block on a slow filesystem). A
    caller cancelled while the thread runs never leaks the grant: it is released as
    soon as the thread is done."""
    fut = asyncio.ensure_future(asyncio.to_thread(admit, path, size, free=free))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        fut.add_done_callback(_release_result)
        raise


def _release_result(fut: asyncio.Future[tuple[Grant | None, Room]]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        grant = fut.result()[0]
        if grant is not None:
            grant.release()
