"""Store writes owed after an edge acted, during a state-store outage (red team 16: F11,
F12, found with PostgreSQL killed on the `pg` branch, in code already on main).

The outage is injected at the store boundary, on both stores (every call
raises :class:`~dsec.errors.Unavailable`, what the PostgreSQL store raises while its
server is down). Everything else is real: the apiserver, a ``dsec edge`` process over
TCP (F12), the in-process simulated edge with the paper's microVM create latency (F11).

- F11: a keyed create whose answer cannot be stored (the edge already made the sandbox)
  must not wedge its key: with the store back the retry is answered, with that sandbox.
- F12: sandboxes written off (their node lost) while the store is down stay written off
  after an apiserver restart: their tombstones are kept and written before the registry
  removals they justify.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

import dsec.control.store as store_mod
from dsec.cluster.local import LocalCluster
from dsec.control.api.plane import ControlPlane, PlaneConfig
from dsec.control.metrics import ApiMetrics
from dsec.control.store import open_store
from dsec.edge.client import EdgeClient
from dsec.errors import DsecError, SandboxNotFound, Unavailable
from dsec.wire.spec import SandboxSpec

DSEC = [sys.executable, "-c", "from dsec.cli.main import main; main()"]


class OutageStore:
    """A state store whose every call raises ``Unavailable`` while ``down``."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.down = False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kw: Any) -> Any:
            if self.down and name != "close":
                raise Unavailable("the state store is unavailable (injected outage); "
                                  "retry", retry_after=1)
            return attr(*args, **kw)
        return call


def _create(c: LocalCluster, key: str, timeout: float) -> httpx.Response:
    return httpx.post(f"{c.url}/v1/sandboxes", json={"project": "default"},
                      timeout=timeout, headers={"authorization": f"Bearer {c.api_key}",
                                                "idempotency-key": key})


def test_a_keyed_create_whose_answer_could_not_be_stored_is_answered_on_retry(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, store_url: str) -> None:
    """F11. Safe: once the store is back, the retry of the key is answered within its
    timeout, with the sandbox the first attempt made; the project holds exactly one
    sandbox for the key. (The first attempt, not acknowledged, is a retryable 503.)"""
    stores: list[OutageStore] = []

    real_open = store_mod.open_store

    def open_store(url: str, *a: Any, **kw: Any) -> OutageStore:
        stores.append(OutageStore(real_open(url, *a, **kw)))
        return stores[-1]
    monkeypatch.setattr(store_mod, "open_store", open_store)
    c = LocalCluster(edges=1, simulated_profile="paper-microvm", store=store_url,
                     state_dir=str(tmp_path / "api")).start()
    try:
        store = stores[0]
        assert _create(c, "warm", 30.0).status_code == 201
        first: dict[str, httpx.Response] = {}
        t = threading.Thread(target=lambda: first.setdefault("r", _create(c, "wedge", 30.0)))
        t.start()
        time.sleep(0.45)            # claimed and noted; the edge is creating (0.9 s)
        store.down = True
        t.join(30)
        r1 = first["r"]
        assert r1.status_code == 503, r1.text      # not acknowledged, and retryable
        time.sleep(1.0)
        store.down = False
        try:
            r2 = _create(c, "wedge", 15.0)
            if r2.status_code == 503:          # "being stored": retry once more
                time.sleep(1.5)
                r2 = _create(c, "wedge", 15.0)
        except httpx.TimeoutException:
            pytest.fail(f"after {r1.status_code} the retry of the same Idempotency-Key hung "
                        "for 15 s with the store back: the key is wedged")
        assert r2.status_code in (200, 201), r2.text
        made = r1.json().get("detail", {}).get("sandbox_id")
        assert made is None or r2.json()["id"] == made
        items = httpx.get(f"{c.url}/v1/sandboxes", params={"project": "default"},
                          headers={"authorization": f"Bearer {c.api_key}"},
                          timeout=30).json()["items"]
        assert len(items) == 2, items           # "warm" + exactly one for "wedge"
    finally:
        c.stop()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _ticks(plane: ControlPlane, n: int, every: float) -> None:
    for _ in range(n):
        try:
            await plane.tick()
        except Unavailable:
            pass        # the registry's batch waits for the store: kept, retried
        await asyncio.sleep(every)


async def _until(what: str, ok: Callable[[], bool], plane: ControlPlane,
                 timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await _ticks(plane, 1, 0.2)


async def test_sandboxes_written_off_during_a_store_outage_stay_dead_after_a_restart(
        tmp_path: Path, store_url: str) -> None:
    """F12. A real edge (SIGSTOPped: partitioned) is written off while the store is
    down; the store comes back; the apiserver restarts; the edge comes back. Safe: its
    sandbox is destroyed there (its tombstone was kept and stored before its removal),
    not resurrected."""
    token = secrets.token_hex(16)
    (tmp_path / "token").write_text(token)
    addr = f"tcp:127.0.0.1:{_port()}"
    edge = subprocess.Popen(  # noqa: ASYNC220 - started once, before the loop matters
        [*DSEC, "edge", "--listen", addr, "--node-id", "e1", "--backend", "simulated",
         "--state-dir", str(tmp_path / "e1"), "--token-file", str(tmp_path / "token"),
         "--log-level", "warning"], stdin=subprocess.DEVNULL)
    cfg = PlaneConfig(node_ttl_s=1.5, poll_timeout_s=0.4, reconnect_interval_s=0.2)
    plane2: ControlPlane | None = None
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                link = await EdgeClient.connect(addr, token=token.encode())
                break
            except (DsecError, OSError):
                assert time.monotonic() < deadline, "edge never served"
                await asyncio.sleep(0.2)
        store = OutageStore(open_store(store_url))
        plane = ControlPlane.open(store, metrics=ApiMetrics(), config=cfg)  # type: ignore[arg-type]
        plane.add_edge("e1", addr, link, token=token.encode())
        await plane.tick()
        spec = SandboxSpec(project="p", backend="simulated")
        hold = plane.admit("p", spec)
        info = await link.create(spec)
        plane.commit(hold, info)
        sid = info.id
        await plane.tick()
        # the partition, then the store's outage, then the TTL
        edge.send_signal(signal.SIGSTOP)
        store.down = True
        await _until("e1 lost", lambda: plane.watcher.is_expired("e1"), plane)
        assert plane.lost(sid) is not None
        await _ticks(plane, 3, 0.2)
        store.down = False
        await _ticks(plane, 2, 0.1)             # the kept batch commits
        await plane.close()
        await link.close()
        store.close()
        # the restart (the watcher starts empty), then the edge returns
        plane2 = ControlPlane.open(open_store(store_url), metrics=ApiMetrics(), config=cfg)
        assert plane2.lost(sid) is not None, "the tombstone never reached the store"
        edge.send_signal(signal.SIGCONT)
        link2 = await EdgeClient.connect(addr, token=token.encode())
        plane2.add_edge("e1", addr, link2, token=token.encode())
        deadline = time.monotonic() + 20
        while True:
            await plane2.tick()
            try:
                state = (await link2.get(sid)).state
            except SandboxNotFound:
                state = "destroyed"
            if state in ("destroyed", "destroying"):
                break
            assert time.monotonic() < deadline, f"{sid} was resurrected ({state})"
            await asyncio.sleep(0.2)
        assert sid not in plane2.registry
        await link2.close()
    finally:
        if plane2 is not None:
            await plane2.close()
            plane2.store.close()
        if edge.poll() is None:
            edge.send_signal(signal.SIGCONT)
            edge.terminate()
        edge.wait(30)
