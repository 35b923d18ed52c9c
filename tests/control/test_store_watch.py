"""Replicas learn each other's writes through the shared store (Registry.catch_up), on
both stores: PostgreSQL pushes (LISTEN/NOTIFY wakes the reader), SQLite is polled."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dsec.control.api.plane import PlaneConfig
from dsec.control.quota import QuotaIndex
from dsec.control.records import SandboxRecord
from dsec.control.registry import Registry
from dsec.control.store import open_store
from dsec.wire.api import CreateSandboxRequest
from tests.control.conftest import FakeClock, replica, served_edge


def _rec(i: int, node: str = "e0", project: str = "team") -> SandboxRecord:
    return SandboxRecord(id=f"sb-{node}-{i:04d}", node=node, project=project,
                         cpu_milli=100, memory_bytes=1 << 20)


def test_catch_up_applies_the_other_writers_events_once(store_url: str,
                                                        clock: FakeClock) -> None:
    sa, sb = open_store(store_url), open_store(store_url)
    try:
        qa, qb = QuotaIndex(), QuotaIndex()
        a = Registry(sa, clock=clock, quota=qa)
        b = Registry(sb, clock=clock, quota=qb)
        a.add_sandbox(_rec(1))
        a.add_sandbox(_rec(2))
        a.flush()
        b.add_sandbox(_rec(3, node="e1"))    # b's own batch lands after a's (a gap)
        b.flush()
        assert b.catch_up() == 2             # a's two creates; b's own is not re-applied
        assert sorted(r.id for r in b.sandboxes()) == [
            "sb-e0-0001", "sb-e0-0002", "sb-e1-0003"]
        assert b.sandbox("sb-e0-0001").cpu_milli == 100           # the full stored row
        assert qb.usage("team").sandboxes == 3                     # quota usage follows
        a.set_paused("sb-e0-0002", True)
        a.remove_sandbox("sb-e0-0001")
        a.flush()
        assert b.catch_up() == 2
        assert "sb-e0-0001" not in b and b.sandbox("sb-e0-0002").paused
        assert qb.usage("team").sandboxes == 2
        assert b.catch_up() == 0                                   # nothing new
        # a learns b's create the same way; both agree on one dense log
        assert a.catch_up() == 1 and "sb-e1-0003" in a
        assert a.applied_version == b.applied_version == sa.event_bounds()[1] == 5
        assert [e.version for e in b.read(0, 100)] == [1, 2, 3, 4, 5]
        assert [e.kind for e in b.read(0, 100)] == [e.kind for e in a.read(0, 100)]
    finally:
        sa.close()
        sb.close()


async def test_a_create_on_one_replica_is_listed_by_the_other_without_a_heartbeat(
        tmp_path: Path, store_url: str) -> None:
    # No edge polls (heartbeat every 60 s): the second replica can only learn of the
    # create through the store: PostgreSQL's NOTIFY (its safety poll is 60 s too), or
    # SQLite's poll of the store's version.
    cfg = PlaneConfig(heartbeat_interval_s=60.0, store_push_poll_s=60.0,
                      store_poll_s=0.05)
    async with served_edge(tmp_path) as edge:
        a = await replica(store_url, edge.addr, plane=cfg)
        b = await replica(store_url, edge.addr, plane=cfg)
        try:
            await a.plane.start()
            await b.plane.start()
            key = a.plane.bootstrap_admin()
            caller = a.service.authenticate(f"Bearer {key}")
            await asyncio.sleep(0.2)          # b's listener is up
            t0 = time.monotonic()
            made = [await a.service.create(caller, CreateSandboxRequest(project="team"))
                    for _ in range(3)]
            ids = {m.id for m in made}
            while not ids <= set(b.plane.registry.ids_on("e0")):
                assert time.monotonic() - t0 < 10.0, "replica b never heard of the creates"
                await asyncio.sleep(0.005)
            assert b.plane.quota.usage("team").sandboxes == 3
            await a.service.destroy(caller, made[0].id)
            while made[0].id in b.plane.registry:
                assert time.monotonic() - t0 < 20.0, "replica b never heard of the destroy"
                await asyncio.sleep(0.005)
            assert b.plane.quota.usage("team").sandboxes == 2
        finally:
            await a.close()
            await b.close()


@pytest.mark.store_kinds("postgresql")   # the store that pushes from another thread
async def test_a_replica_closes_while_notifications_pour_in(tmp_path: Path,
                                                           store_url: str) -> None:
    # Found by the rolling-upgrade test: a PostgreSQL-backed apiserver took > 60 s to
    # exit on SIGTERM. Its store-watch loop waited with asyncio.wait_for, which on
    # Python 3.11 swallows the cancel of close() when a NOTIFY sets the loop's event that
    # same instant (measured: 180 of 200 closes under a storm of notifications), so
    # close() waited for it for ever. A storm from the store's listener thread, as other
    # replicas committing make; every close must end.
    async with served_edge(tmp_path) as edge:
        for attempt in range(5):
            r = await replica(store_url, edge.addr)
            storm_on = threading.Event()
            storm_on.set()

            def storm(store: Any = r.store, on: threading.Event = storm_on) -> None:
                while on.is_set():
                    store._fire(1)          # what the LISTEN thread does on a NOTIFY
            t = threading.Thread(target=storm, daemon=True)
            try:
                await r.plane.start()
                t.start()
                await asyncio.sleep(0.05)
                closing = asyncio.ensure_future(r.plane.close())
                done, _ = await asyncio.wait({closing}, timeout=10.0)
                assert done, f"attempt {attempt}: the plane did not close in 10 s"
            finally:
                storm_on.clear()
                t.join(5)
                for task in r.plane._tasks:
                    task.cancel()
                await r.cache.close()
                await r.link.close()
                r.store.close()
