"""Red team 16 (pg): node loss during a PostgreSQL outage, then an apiserver restart,
resurrects the lost node's sandboxes.

``ControlPlane._carry_out(EvictNode)``: the registry removes the node's sandboxes (a
batch kept and retried until the store takes it) and ``store.put_lost(rows)`` writes their
tombstones - once, with no retry; on a store error only this process's ``_lost`` has them.
When PostgreSQL is down at the TTL expiry, the removals are committed after it returns
but the tombstones never are: an apiserver that restarts before the node comes back (a
rolling upgrade, a crash) does not know those sandboxes were written off and records
them as "discovered" when the node returns (issue 16: "sandboxes written off are
destroyed on return, none resurrected").

Real PostgreSQL (PgServer), a real ``dsec edge`` process (simulated backend, TCP + token),
the apiserver runtime in this process (stopped and started again on the same store).
SIGSTOP of the edge is the partition.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dsec.cluster.pgserver import PgServer
from dsec.cluster.runtime import ClusterConfig, ClusterRuntime
from dsec.control.api.plane import PlaneConfig

DSEC = [sys.executable, "-c", "from dsec.cli.main import main; main()"]


@pytest.fixture
def pg() -> Iterator[PgServer]:
    d = tempfile.mkdtemp(prefix="dsec-rt16tb-", dir="/tmp")
    server = PgServer(d, fsync=False, remove=True)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(d, ignore_errors=True)


def _port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_sandboxes_written_off_during_a_store_outage_stay_dead_after_a_restart(
        pg: PgServer, tmp_path: Path) -> None:
    token = secrets.token_hex(16)
    tf = tmp_path / "token"
    tf.write_text(token)
    addr = f"tcp:127.0.0.1:{_port()}"
    edge = subprocess.Popen([*DSEC, "edge", "--listen", addr, "--node-id", "e1",  # noqa: ASYNC220 - returns at once
                             "--backend", "simulated", "--state-dir", str(tmp_path / "e1"),
                             "--token-file", str(tf), "--log-level", "warning"],
                            stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def cfg() -> ClusterConfig:
        return ClusterConfig(state_dir=str(tmp_path / "cp"), listen="127.0.0.1:0",
                             gateway=None, edges=0, write_local=False, store=pg.dsn,
                             remote_edges={"e1": addr}, edge_token=token.encode(),
                             plane=PlaneConfig(heartbeat_interval_s=0.3, node_ttl_s=3.0,
                                               poll_timeout_s=1.0, reconnect_interval_s=0.3))

    rt = await ClusterRuntime(cfg()).start()
    try:
        async with httpx.AsyncClient(base_url=rt.url, timeout=30.0, headers={
                "authorization": f"Bearer {rt.admin_key}"}) as http:
            deadline = time.monotonic() + 30
            while True:
                r = await http.post("/v1/sandboxes", json={"image": "base"})
                if r.status_code == 201 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.3)
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
        edge.send_signal(signal.SIGSTOP)          # partition: e1 goes silent
        await asyncio.sleep(1.5)
        pg.kill9()                                # ... and the store is down at the TTL
        await asyncio.sleep(3.5)                  # node_ttl_s passes: e1 evicted
        pg.start()
        await asyncio.sleep(3.0)                  # the registry's kept batch commits
        await rt.stop(keep=True)                  # a restart (rolling upgrade, crash)
        rt = await ClusterRuntime(cfg()).start()
        edge.send_signal(signal.SIGCONT)          # heal
        async with httpx.AsyncClient(base_url=rt.url, timeout=30.0, headers={
                "authorization": f"Bearer {rt.admin_key}"}) as http:
            deadline = time.monotonic() + 8
            while time.monotonic() < deadline:
                await asyncio.sleep(0.5)
                r = await http.get(f"/v1/sandboxes/{sid}")
                state = r.json().get("state") if r.status_code == 200 else r.status_code
                assert state != "running", (
                    f"{sid}, written off when e1 was lost, is running again after the "
                    "restart: its tombstone was never stored (the store was down at the "
                    "eviction)")
    finally:
        with contextlib.suppress(Exception):
            edge.send_signal(signal.SIGCONT)
        edge.terminate()
        try:
            edge.wait(30)
        except subprocess.TimeoutExpired:
            edge.kill()
        await rt.stop(keep=True)
