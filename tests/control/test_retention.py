"""Retention keeps every growing table of the state store bounded, by count and by age,
on a schedule (the event table used to grow by two rows per lifecycle forever)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dsec.cluster.local import LocalCluster
from dsec.control.api.plane import PlaneConfig
from dsec.control.records import SandboxRecord
from dsec.control.registry import Registry
from dsec.control.retention import RetentionConfig, retain
from dsec.control.store import IdempotencyRow, LostSandboxRow
from dsec.control.store.sqlite import SqliteStore
from dsec.errors import Compacted, InvalidArgument

from .conftest import FakeClock


def _lifecycles(reg: Registry, clock: FakeClock, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        sid = f"sb-{i:012x}-n1"
        reg.add_sandbox(SandboxRecord(id=sid, node="n1", project="p", backend="simulated",
                                      cpu_milli=1, memory_bytes=1 << 20))
        reg.remove_sandbox(sid)
        clock.t += 1.0
    reg.flush()


def test_events_are_kept_by_count_and_by_age(store: SqliteStore, clock: FakeClock) -> None:
    reg = Registry(store, clock=clock, batch_size=64)
    _lifecycles(reg, clock, 1000)                       # 2000 events, one second apart
    cfg = RetentionConfig(events_keep=500, events_max_age_s=None)
    report = retain(store, cfg.plan(clock.t))
    assert report.events == 1500 and store.event_bounds() == (1501, 2000)
    reg.trim_ring()
    with pytest.raises(Compacted, match="oldest kept is 1501"):
        reg.read(100)
    assert [e.version for e in reg.read(1999)] == [2000]
    # by age: the events of the last 100 s stay (two per second of the fake clock)
    cfg = RetentionConfig(events_keep=None, events_max_age_s=100.0)
    retain(store, cfg.plan(clock.t))
    lo, hi = store.event_bounds()
    assert hi == 2000 and hi - lo + 1 == 200
    # the newest event always stays (it carries the version across restarts)
    clock.t += 10**6
    retain(store, cfg.plan(clock.t))
    assert store.event_bounds() == (2000, 2000)
    assert Registry(store, clock=clock).version == 2000


def test_idempotency_keys_leases_and_tombstones_are_bounded(store: SqliteStore) -> None:
    now = 10_000.0
    store.lease_renew("alive", now + 5)
    store.lease_renew("dead", now - 5)
    rows = [("done-old", "alive", b"r", now - 1, None),      # window over
            ("done-new", "alive", b"r", now + 100, None),    # within its window
            ("stale-bare", "dead", None, now + 100, None),   # dead holder, no sandbox
            ("stale-noted", "dead", None, now + 100, "sb-000000000001-n1"),
            ("in-flight", "alive", None, now + 100, None)]
    for key, holder, resp, exp, intent in rows:
        store.idem_claim(IdempotencyRow(key=key, fingerprint="f", owner=f"{holder}:1",
                                        holder=holder, expires_at=exp), now - 50)
        if intent:
            store.idem_note(key, f"{holder}:1", intent)
        if resp:
            store.idem_finish(key, f"{holder}:1", resp, exp)
    store.put_lost([LostSandboxRow(id=f"sb-{i:012x}-n1", node="n1", lost_at=now - i * 86_400,
                                   record={}) for i in range(10)], keep=100)
    report = retain(store, RetentionConfig(lost_max_age_s=3.5 * 86_400).plan(now))
    # the dead holder's bare claim goes; one that names a sandbox stays for the takeover
    keys = sorted(r[0] for r in store._all("SELECT key FROM idempotency"))
    assert keys == ["done-new", "in-flight", "stale-noted"]
    assert report.idempotency == 2 and report.process_leases == 1
    assert [r[0] for r in store._all("SELECT holder FROM process_leases")] == ["alive"]
    assert report.lost_sandboxes == 6 and len(store.list_lost(100)) == 4
    # finished keys are also capped by count, oldest first
    for i in range(30):
        store.idem_claim(IdempotencyRow(key=f"k{i}", fingerprint="f", owner="alive:2",
                                        holder="alive", expires_at=now + 100), now)
        store.idem_finish(f"k{i}", "alive:2", b"r", now + 200 + i)
    retain(store, RetentionConfig(idempotency_keep=10).plan(now))
    done = store._all("SELECT key FROM idempotency WHERE response IS NOT NULL")
    assert sorted(r[0] for r in done) == sorted(f"k{i}" for i in range(20, 30))


def test_the_sqlite_file_gives_freed_pages_back(tmp_path: Path, clock: FakeClock) -> None:
    store = SqliteStore(tmp_path / "big.sqlite")
    try:
        reg = Registry(store, clock=clock, batch_size=512)
        _lifecycles(reg, clock, 10_000)
        store._exec("PRAGMA wal_checkpoint(TRUNCATE)")
        before = store._all("PRAGMA page_count")[0][0]
        retain(store, RetentionConfig(events_keep=100, events_max_age_s=None,
                                      vacuum_pages=10**6).plan(clock.t))
        store._exec("PRAGMA wal_checkpoint(TRUNCATE)")
        after = store._all("PRAGMA page_count")[0][0]
        assert store.table_rows()["events"] == 100
        assert after < before / 5, (before, after)
        assert os.path.getsize(tmp_path / "big.sqlite") < before * 4096 / 5
    finally:
        store.close()


def test_bad_retention_settings_are_refused() -> None:
    for bad in ({"interval_s": 0}, {"events_keep": 0}, {"events_max_age_s": -1.0},
                {"idempotency_keep": 0}):
        with pytest.raises(InvalidArgument):
            RetentionConfig(**bad)  # type: ignore[arg-type]


@pytest.fixture
def cluster(cluster_store: str | None) -> Iterator[LocalCluster]:
    with LocalCluster(edges=1, store=cluster_store, plane=PlaneConfig(retention=RetentionConfig(
            interval_s=0.2, events_keep=100))) as cl:
        yield cl


def test_the_control_plane_trims_on_its_schedule(cluster: LocalCluster) -> None:
    h = {"authorization": f"Bearer {cluster.api_key}"}
    with httpx.Client(base_url=cluster.url, headers=h, timeout=30) as http:
        for _ in range(150):                                     # 300+ events
            # small sandboxes: placement's overlay holds a destroyed one's charge until
            # the next heartbeat, and the node's real capacity is what it is
            r = http.post("/v1/sandboxes", json={"cpu_milli": 10, "memory_bytes": 16 << 20})
            assert r.status_code == 201, r.text
            assert http.delete(f"/v1/sandboxes/{r.json()['id']}").status_code == 204
    store = cluster.runtime.plane.store
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:   # until the registry flushed and a pass ran
        oldest, newest = store.event_bounds()
        if newest >= 300 and store.table_rows()["events"] <= 100:
            break
        time.sleep(0.1)
    assert newest >= 300 and oldest > newest - 100, (oldest, newest)
    assert store.table_rows()["events"] <= 100
