"""The PostgreSQL state store's figures for suite ``cluster`` (called by
:mod:`dsec.bench.cluster`, which owns the suite; this module registers none).

- ``cluster_watch_p50_ms`` / ``cluster_watch_p99_ms``: from a commit on replica A (its
  registry's flush returned) to replica B's registry holding the sandbox, B being a real
  :class:`~dsec.control.api.plane.ControlPlane` running its loops on its own event loop
  (thread). ``store: postgresql``: LISTEN/NOTIFY wakes B's reader; ``store: sqlite``
  (same machine, for comparison): B polls the store's version every ``store_poll_s``.
- ``cluster_store_commit_rows_per_s``: ``commit_events`` throughput of each store on this
  machine, events with one sandbox row each, by batch size (the registry batches; a
  single-event commit is the worst case). PostgreSQL runs with its defaults (fsync on,
  synchronous_commit on: every commit waits for its WAL on disk); SQLite in WAL mode with
  ``synchronous=NORMAL`` (no fsync per commit) - the embedded default's trade.

Each run starts its own throwaway server (:class:`dsec.cluster.pgserver.PgServer`) in a
temp dir and removes it after.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from dsec.bench import Result

__all__ = ["run"]

SUITE = "cluster"


def run(quick: bool) -> list[Result]:
    """Every figure of this module (see the module docstring)."""
    from dsec.cluster.pgserver import PgServer

    out: list[Result] = []
    d = tempfile.mkdtemp(prefix="dsec-pgb-", dir="/tmp")
    server = PgServer(d, fsync=True, remove=True)
    try:
        server.start()
        out += _watch(lambda name: _database(server, name), "postgresql", quick)
        with tempfile.TemporaryDirectory(prefix="dsec-bench-sqlite-") as sd:
            out += _watch(lambda name: f"sqlite://{sd}/{name}.sqlite", "sqlite", quick)
            out += _commits(lambda name: f"sqlite://{sd}/{name}.sqlite", "sqlite", quick)
        out += _commits(lambda name: _database(server, name), "postgresql", quick)
    finally:
        server.stop()
        shutil.rmtree(d, ignore_errors=True)
    return out


def _database(server: Any, name: str) -> str:
    import psycopg

    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name}")
        conn.execute(f"CREATE DATABASE {name} TEMPLATE template0")
    return str(server.dsn_for(name))


def _rec(i: int) -> Any:
    from dsec.control.records import SandboxRecord
    return SandboxRecord(id=f"sb-e0-{os.getpid():x}-{i:06d}", node="e0", project="bench",
                         cpu_milli=100, memory_bytes=1 << 20)


def _watch(url_of: Callable[[str], str], store: str, quick: bool) -> list[Result]:
    """Replica A commits one sandbox every ``gap_s``; B (a started ControlPlane on its own
    loop) records when each lands in its registry (its on_commit hook, after catch_up)."""
    from dsec.control.api.plane import ControlPlane, PlaneConfig
    from dsec.control.metrics import ApiMetrics
    from dsec.control.registry import Registry
    from dsec.control.store import open_store

    n, gap_s = (60, 0.02) if quick else (400, 0.02)
    url = url_of("watch")
    sa, sb = open_store(url), open_store(url)
    cfg = PlaneConfig(heartbeat_interval_s=3600.0, store_poll_s=1.0, flush_delay_s=None)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="bench-replica-b", daemon=True)
    thread.start()
    plane_b = ControlPlane.open(sb, metrics=ApiMetrics(), config=cfg)
    committed: dict[str, float] = {}
    seen: dict[str, float] = {}
    waiting: set[str] = set()
    lock = threading.Lock()

    def landed(_version: int) -> None:        # on B's loop, after each catch_up
        now = time.perf_counter()
        with lock:
            for sid in [s for s in waiting if s in plane_b.registry]:
                seen[sid] = now
                waiting.discard(sid)

    plane_b.registry.on_commit.append(landed)
    try:
        asyncio.run_coroutine_threadsafe(plane_b.start(), loop).result(30)
        time.sleep(0.3)                     # B's listener connection is up
        a = Registry(sa, clock=time.time)
        for i in range(n):
            rec = _rec(i)
            with lock:
                waiting.add(rec.id)
            a.add_sandbox(rec)
            a.flush()
            committed[rec.id] = time.perf_counter()
            time.sleep(gap_s)
        deadline = time.monotonic() + 5.0
        while waiting and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        asyncio.run_coroutine_threadsafe(plane_b.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        sa.close()
        sb.close()
    lat = sorted((seen[s] - committed[s]) * 1000 for s in seen if s in committed)
    missed = n - len(lat)
    if not lat:
        return []
    p99 = lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))]
    params = {"store": store, "replicas": 2, "samples": len(lat), "missed": missed,
              "push": store == "postgresql"}
    return [Result(SUITE, "cluster_watch_p50_ms", statistics.median(lat), "ms", params),
            Result(SUITE, "cluster_watch_p99_ms", p99, "ms", params)]


def _commits(url_of: Callable[[str], str], store: str, quick: bool) -> list[Result]:
    from dsec.control.store import EventRow, SandboxRow, open_store

    out: list[Result] = []
    for batch, rows in ((1, 300 if quick else 3000), (100, 5000 if quick else 50_000),
                        (512, 10_240 if quick else 102_400)):
        s = open_store(url_of(f"commits_{batch}"))
        try:
            t0 = time.perf_counter()
            for b in range(rows // batch):
                events = [EventRow(version=0, time=0.0, kind="sandbox_added",
                                   sandbox_id=f"sb-{b}-{i}", node_id="e0",
                                   payload={"reason": "created"}) for i in range(batch)]
                ups = [SandboxRow(id=f"sb-{b}-{i}", node="e0", project="bench",
                                  record={"id": f"sb-{b}-{i}"}) for i in range(batch)]
                s.commit_events(events, ups, assign_versions=True)
            took = time.perf_counter() - t0
        finally:
            s.close()
        out.append(Result(SUITE, "cluster_store_commit_rows_per_s", rows / took, "rows/s",
                          {"store": store, "batch": batch,
                           "durability": "fsync per commit" if store == "postgresql"
                           else "WAL, synchronous=NORMAL"}))
    return out
