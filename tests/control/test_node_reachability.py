""""I cannot reach my edge" is not "the edge is lost" (issue 12).

An apiserver out of file descriptors could not poll its own edge, expired it after 10 s
and, when it could poll again, had every sandbox on it destroyed (node_lost) though the
edge never died. Only the edge's silence counts toward the node TTL now; an edge that
answers with errors, or that this apiserver cannot reach for its own reasons, is held
``unreachable`` with its sandboxes. And the TTL is a setting: an edge restarted (say, to
upgrade it) within it keeps its sandboxes.

Real pieces: edges served over Aether on Unix sockets (in this process, or ``dsec edge``
processes), the control plane with an injected clock; the apiserver that runs out of
file descriptors runs in a subprocess of its own with a low RLIMIT_NOFILE.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec.cluster.compose import api_service
from dsec.control.api.plane import ControlPlane, PlaneConfig
from dsec.control.api.service import ApiService
from dsec.control.metrics import ApiMetrics
from dsec.control.store import StateStore, open_store
from dsec.edge.admission import Capacity
from dsec.edge.backends import make_backend
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.edge.service import EdgeClient, serve_edge
from dsec.errors import Unavailable
from dsec.wire.api import CreateSandboxRequest
from tests.control.conftest import FakeClock

DSEC = [sys.executable, "-c", "from dsec.cli.main import main; main()"]


def _apiserver(db: str, clock: FakeClock, ttl: float = 10.0
               ) -> tuple[StateStore, ControlPlane, ApiService]:
    store = open_store(db)
    plane = ControlPlane.open(store, metrics=ApiMetrics(), clock=clock, config=PlaneConfig(
        node_ttl_s=ttl, reconnect_interval_s=0.0, poll_timeout_s=5.0))
    return store, plane, api_service(store, plane)


async def _close(store: StateStore, plane: ControlPlane, service: ApiService) -> None:
    await service.idempotency.close()
    await plane.close()
    for e in plane.edges.values():
        await e.link.close()
    store.close()


async def test_an_edge_that_answers_with_errors_is_held_not_lost(tmp_path: Path,
                                                                 store_url: str) -> None:
    """The incident's own mechanism: the edge's heartbeat handler hit EMFILE (listing its
    layer store) and answered ``internal_error``; the apiserver took that for silence."""
    node = EdgeNode(NodeConfig(node_id="e0", capacity=Capacity(
        cpu_milli=10**6, memory_bytes=1 << 40, max_sandboxes=100)),
        {"simulated": make_backend("simulated")})
    await node.start()
    addr = f"unix:{tmp_path / 'e0.sock'}"
    server = await serve_edge(node, addr)
    clock = FakeClock(time.time())
    store, plane, service = _apiserver(store_url, clock)
    try:
        plane.add_edge("e0", addr, await EdgeClient.connect(addr))
        admin = service.authenticate(f"Bearer {plane.bootstrap_admin()}")
        await plane.tick()
        ids = {(await service.create(admin, CreateSandboxRequest(project="team"))).id
               for _ in range(3)}
        await plane.tick()

        real_heartbeat = node.heartbeat

        def out_of_fds(**_: Any) -> Any:
            raise OSError(24, "Too many open files", "/var/lib/dsec/layers/manifests")

        node.heartbeat = out_of_fds  # type: ignore[method-assign]
        for _ in range(8):              # 40 s of failing polls, TTL 10 s
            clock.t += 5.0
            await plane.tick()
        (view,) = plane.nodes()
        assert (view.status, view.healthy) == ("unreachable", False)
        assert "answered" in view.problem and "Too many open files" in view.problem
        assert not plane.watcher.is_expired("e0")
        assert ids <= set(plane.registry.ids_on("e0"))
        assert all(plane.lost(i) is None for i in ids)
        # held out of placement meanwhile, and a create says why (an outage, not a lack
        # of capacity that asking for less would fix)
        with pytest.raises(Unavailable, match="e0: unreachable"):
            await service.create(admin, CreateSandboxRequest(project="team"))

        node.heartbeat = real_heartbeat  # type: ignore[method-assign]
        clock.t += 1.0
        await plane.tick()
        (view,) = plane.nodes()
        assert (view.status, view.healthy, view.problem) == ("healthy", True, "")
        assert {node.get(i).state for i in ids} == {"running"}
        assert ids <= set(plane.registry.ids_on("e0"))
        assert plane.quota.usage("team").sandboxes == 3
    finally:
        await _close(store, plane, service)
        await server.close()
        await node.close()


@pytest.fixture
def edge_proc(tmp_path: Path) -> Iterator[Any]:
    """``start()`` runs ``dsec edge`` (simulated backend, journal in tmp_path) on a Unix
    socket and returns its address; ``stop()`` SIGTERMs it (its sandboxes stay in the
    journal, as in an upgrade)."""
    sock = tmp_path / "e0.sock"
    procs: list[subprocess.Popen[bytes]] = []

    class Edge:
        address = f"unix:{sock}"

        def start(self) -> str:
            p = subprocess.Popen([*DSEC, "edge", "--listen", self.address, "--node-id", "e0",
                                  "--cpu-milli", "1000000",
                                  "--state-dir", str(tmp_path / "edge"), "--log-level",
                                  "warning"])
            procs.append(p)
            deadline = time.monotonic() + 30
            while not sock.exists():
                assert p.poll() is None, "dsec edge exited"
                assert time.monotonic() < deadline, "dsec edge did not start"
                time.sleep(0.05)
            return self.address

        def stop(self) -> None:
            p = procs[-1]
            p.send_signal(signal.SIGTERM)
            assert p.wait(30) == 0

    try:
        yield Edge()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


_BLIND = textwrap.dedent("""
    import asyncio, json, os, resource, sys, time
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    sys.path.insert(0, sys.argv[3])
    from tests.control.conftest import FakeClock
    from tests.control.test_node_reachability import _apiserver, _close
    from dsec.wire.api import CreateSandboxRequest
    from dsec.edge.service import EdgeClient

    async def main():
        addr, db = sys.argv[1], sys.argv[2]
        clock = FakeClock(time.time())
        store, plane, service = _apiserver(db, clock)
        out = {}
        try:
            plane.add_edge("e0", addr, await EdgeClient.connect(addr))
            admin = service.authenticate(f"Bearer {plane.bootstrap_admin()}")
            await plane.tick()
            ids = [(await service.create(admin, CreateSandboxRequest(project="t"))).id
                   for _ in range(3)]
            await plane.tick()
            # The link drops (as when the edge restarts or a peer resets it) while this
            # process has no file descriptor left to reconnect with.
            await plane.edges["e0"].link.close()
            hog = []
            try:
                while True:
                    hog.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                pass
            for _ in range(8):          # 40 s of failed reconnects, TTL 10 s
                clock.t += 5.0
                await plane.tick()
            (v,) = plane.nodes()
            out["held"] = [v.status, v.healthy, v.problem,
                           plane.watcher.is_expired("e0"),
                           sorted(set(ids) & set(plane.registry.ids_on("e0")))]
            for fd in hog:
                os.close(fd)
            clock.t += 1.0
            await plane.tick()
            (v,) = plane.nodes()
            link = plane.edges["e0"].link
            out["back"] = [v.status, v.healthy,
                           sorted(set(ids) & set(plane.registry.ids_on("e0"))),
                           sorted([(await link.get(i)).state for i in ids])]
            out["ids"] = sorted(ids)
        finally:
            await _close(store, plane, service)
        print(json.dumps(out), flush=True)

    asyncio.run(main())
""")


def test_an_apiserver_out_of_fds_holds_its_edge_and_keeps_its_sandboxes(
        tmp_path: Path, edge_proc: Any, store_url: str) -> None:
    addr = edge_proc.start()
    root = str(Path(__file__).resolve().parents[2])
    run = subprocess.run(
        [sys.executable, "-c", _BLIND, addr, store_url, root],
        check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    status, healthy, problem, expired, kept = out["held"]
    assert (status, healthy, expired) == ("unreachable", False, False), out
    assert "blind" in problem and "Too many open files" in problem
    assert kept == out["ids"]
    assert out["back"] == ["healthy", True, out["ids"], ["running"] * 3]


async def test_an_edge_restarted_within_the_node_ttl_keeps_its_sandboxes(
        tmp_path: Path, edge_proc: Any, store_url: str) -> None:
    """The upgrade path (docs/control.md): stop the edge, start the new version on the
    same state dir and address within ``node_ttl_s`` (``dsec up --node-ttl``); it
    re-adopts its sandboxes from its journal and the apiserver reconnects. Here the
    edge is away for 25 s of the apiserver's clock, beyond the old fixed 10 s."""
    addr = edge_proc.start()
    clock = FakeClock(time.time())
    store, plane, service = _apiserver(store_url, clock, ttl=30.0)
    try:
        plane.add_edge("e0", addr, await EdgeClient.connect(addr))
        admin = service.authenticate(f"Bearer {plane.bootstrap_admin()}")
        await plane.tick()
        ids = {(await service.create(admin, CreateSandboxRequest(project="team"))).id
               for _ in range(3)}
        await plane.tick()

        edge_proc.stop()
        for _ in range(5):
            clock.t += 5.0
            await plane.tick()
        (view,) = plane.nodes()
        assert view.status == "silent" and "written off as lost in 5.0s" in view.problem
        edge_proc.start()
        clock.t += 1.0
        await plane.tick()
        (view,) = plane.nodes()
        assert view.status == "healthy", view
        assert not plane.watcher.is_expired("e0")
        assert ids <= set(plane.registry.ids_on("e0"))
        link = plane.edges["e0"].link
        assert {(await link.get(i)).state for i in ids} == {"running"}
        got = await service.get(admin, min(ids))
        assert got.state == "running"
    finally:
        await _close(store, plane, service)


def test_dsec_up_takes_the_node_ttl() -> None:
    out = subprocess.run([*DSEC, "up", "--help"], check=True, capture_output=True, text=True,
                         timeout=60)
    text = " ".join(out.stdout.split())
    assert "--node-ttl SECONDS" in text and "Restart (upgrade) an edge within it" in text
    bad = subprocess.run([*DSEC, "up", "--node-ttl", "0"], check=False, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "--node-ttl" in bad.stderr
