"""envd's polling directory watchers (``CreateWatcher`` / ``GetWatcherEvents`` /
``RemoveWatcher``: what the stock SDK's ``files.watch_dir`` uses) over dsec's streaming
``file_watch`` row.

A watcher is a ``file_watch`` stream this apiserver reads into a bounded buffer until
its owner polls it. So it is state of this apiserver process (behind several replicas,
send one client's E2B traffic to one replica), and it is bounded: at most
``max_per_principal`` watchers per principal, half of ``max_total`` per tenant (the
top-level project of the watched sandbox: an admin minting keys cannot take them all)
and ``max_total`` in all (beyond: ``429 resource_exhausted``; the slot is taken before
the watch is opened, so concurrent creates cannot all pass one check), ``max_events`` buffered per watcher (beyond: the oldest are
dropped and one event says so), and a watcher nobody polled for ``idle_s`` is closed.
Only the principal that created a watcher sees it; any other gets "not found", as for
an id that never existed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from dsec.control.api.service import Caller
from dsec.control.e2b import mapping
from dsec.errors import DsecError, NotFound, RateLimited
from dsec.wire.files import FileEvent, Watch, WatchEnd

__all__ = ["PROBE_PREFIX", "Watchers"]

#: The name of the file a new watcher creates (and removes) in the watched directory to
#: know its watch is in place before CreateWatcher answers (envd answers only then, and
#: callers write right after); its events are never shown.
PROBE_PREFIX = ".dsec-e2b-watch-"

WatchPolicy = Callable[[Caller, Watch], Awaitable[AsyncIterator[FileEvent | WatchEnd]]]


@dataclass
class _Watcher:
    owner: str
    path: str
    tenant: str | None
    probe: str
    events: collections.deque[dict[str, Any]]
    last_poll: float
    task: asyncio.Task[None] | None = None
    error: DsecError | None = None
    ended: bool = False
    dropped: int = 0
    armed: asyncio.Event = field(default_factory=asyncio.Event)


class Watchers:
    def __init__(self, *, max_per_principal: int = 64, max_total: int = 4096,
                 max_events: int = 10_000, idle_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_per_principal, self.max_total = max_per_principal, max_total
        self.max_events, self.idle_s, self.clock = max_events, idle_s, clock
        self._w: dict[str, _Watcher] = {}

    def __len__(self) -> int:
        return len(self._w)

    async def create(self, caller: Caller, watch: Watch, policy: WatchPolicy,
                     probe: Callable[[str], Awaitable[None]] | None = None, *,
                     tenant: str | None = None) -> str:
        """Open ``watch`` for ``caller``; its id. ``probe(path)`` writes and removes the
        probe file (None: answer without waiting for the watch to be in place).
        ``tenant``: the top-level project of the watched sandbox (None: the caller)."""
        self._expire()
        mine = sum(1 for w in self._w.values() if w.owner == caller.id)
        ours = 0 if tenant is None else sum(1 for w in self._w.values() if w.tenant == tenant)
        share = max(1, self.max_total // 2)
        if mine >= self.max_per_principal or ours >= share or len(self._w) >= self.max_total:
            raise RateLimited(
                f"too many directory watchers open ({mine} of principal {caller.name!r}, "
                f"{ours} on project {tenant!r}, {len(self._w)} in all; limits "
                f"{self.max_per_principal}, {share} and {self.max_total}): remove "
                "watchers you no longer poll", limit=self.max_per_principal,
                retry_after=1.0)
        # the slot is held from here (no await since the check), released if the watch
        # cannot be opened
        wid = secrets.token_hex(12)
        probe_name = PROBE_PREFIX + wid
        w = _Watcher(owner=caller.id, path=watch.path, tenant=tenant, probe=probe_name,
                     events=collections.deque(), last_poll=self.clock())
        self._w[wid] = w
        try:
            stream = await policy(caller, watch)
        except BaseException:
            self._w.pop(wid, None)
            raise
        if self._w.get(wid) is not w:       # closed meanwhile (close(), expiry)
            with contextlib.suppress(Exception):
                await stream.aclose()  # type: ignore[attr-defined]
            raise NotFound(f"watcher for {watch.path[:80]} was closed while it opened")
        w.task = asyncio.create_task(self._pump(w, stream))
        if probe is not None:
            base = watch.path.rstrip("/") or ""
            try:
                async with asyncio.timeout(5.0):
                    while not w.armed.is_set() and not w.ended:
                        await probe(f"{base}/{probe_name}")
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(0.2):
                                await w.armed.wait()
            except (TimeoutError, DsecError):
                pass    # a directory we may not write to: answered without the wait
        if w.error is not None and not w.events:
            self.remove(caller, wid)
            raise w.error
        return wid

    async def _pump(self, w: _Watcher, stream: AsyncIterator[FileEvent | WatchEnd]) -> None:
        try:
            async for item in stream:
                if not isinstance(item, FileEvent):
                    break
                if item.name.startswith(PROBE_PREFIX) or \
                        item.path.rpartition("/")[2].startswith(PROBE_PREFIX):
                    w.armed.set()
                    continue
                lost = mapping.watch_incomplete(item, w.path)
                if lost is not None:
                    # envd has no such event: the watcher ends with the error (its
                    # events so far are still taken first), never a silent gap
                    w.error = lost
                    close = getattr(stream, "aclose", None)
                    if close is not None:
                        with contextlib.suppress(Exception):
                            await close()
                    break
                ev = mapping.fs_event(item, w.path)
                if ev is None:
                    continue
                if len(w.events) >= self.max_events:
                    w.events.popleft()
                    w.dropped += 1
                w.events.append(ev)
        except DsecError as exc:
            w.error = exc
        finally:
            w.ended = True
            w.armed.set()

    def take(self, caller: Caller, wid: str) -> list[dict[str, Any]]:
        """The events since the last poll (a watch that failed raises its error once
        its buffered events are taken)."""
        self._expire()
        w = self._get(caller, wid)
        w.last_poll = self.clock()
        if not w.events and w.error is not None:
            err = w.error
            self.remove(caller, wid)
            raise err
        out = list(w.events)
        w.events.clear()
        return out

    def remove(self, caller: Caller, wid: str) -> None:
        w = self._get(caller, wid)
        del self._w[wid]
        if w.task is not None:
            w.task.cancel()

    def _get(self, caller: Caller, wid: str) -> _Watcher:
        w = self._w.get(wid)
        if w is None or w.owner != caller.id:
            raise NotFound(f"watcher {wid[:40]!r} not found (removed, idle for more than "
                           f"{self.idle_s:g}s, or never made)")
        return w

    def _expire(self) -> None:
        now = self.clock()
        for wid, w in list(self._w.items()):
            if now - w.last_poll > self.idle_s:
                del self._w[wid]
                if w.task is not None:
                    w.task.cancel()

    async def close(self) -> None:
        tasks = [w.task for w in self._w.values() if w.task is not None]
        self._w.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
