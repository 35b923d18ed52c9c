"""Rolling upgrade of apiserver replicas (issue 16, Operations; docs/deploy.md).

Two real ``dsec apiserver`` processes share one state store and one real ``dsec edge``
process; a TCP load balancer (the test's stand-in for a Kubernetes Service: each new
connection to the first backend that accepts it) is the one address clients use. SDK
clients create, exec, read and destroy sandboxes throughout while each replica in turn is
stopped with SIGTERM (it must drain and exit 0) and started again. Counted: client calls
that failed (must be 0: the SDK's own retries are allowed, an error raised to the caller
is not), replicas that did not exit cleanly, and sandboxes left on the edge afterwards
(must be 0: no duplicate from a retried create, no leak).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Self

import httpx
import pytest

from dsec.client.sync import Client
from dsec.cluster import DSEC_ARGV
from dsec.edge.client import EdgeClient


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Balancer:
    """Accepts on 127.0.0.1 and splices each connection to the next backend (round
    robin) that accepts it, as a Service's endpoints do once a stopping pod's listener
    is closed. Runs its own event loop thread."""

    def __init__(self, backends: list[int]) -> None:
        self.backends = backends
        self.port = 0
        self._i = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server: asyncio.Server | None = None

    def __enter__(self) -> Self:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _client(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        up = None
        # Each backend once, from the next in turn. (Reading the turn anew after each
        # await, as this did, let concurrent connections move it meanwhile: one tried the
        # stopping replica twice, never the live one, and was closed unanswered.)
        first = self._i
        self._i += 1
        for k in range(len(self.backends)):
            port = self.backends[(first + k) % len(self.backends)]
            with contextlib.suppress(OSError):
                up = await asyncio.open_connection("127.0.0.1", port)
                break
        if up is None:
            w.close()
            return
        ur, uw = up

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except OSError:
                pass
            finally:
                with contextlib.suppress(OSError):
                    dst.close()
        await asyncio.gather(pipe(r, uw), pipe(ur, w))


class Replica:
    def __init__(self, d: Path, i: int, edge_sock: Path, store: str | None) -> None:
        self.port = _free_port()
        self.log = d / f"apiserver-{i}.log"
        self.argv = [*DSEC_ARGV, "apiserver", "--edge", f"edge-0=unix:{edge_sock}",
                     "--state-dir", str(d / "state"), "--listen", f"127.0.0.1:{self.port}",
                     "--gateway", "off", *(["--store", store] if store else [])]
        self.proc: subprocess.Popen[bytes] | None = None
        self.key = ""

    def start(self) -> None:
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=f,
                                         stderr=f)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=2
                             ).status_code == 200:
                    keys = re.findall(r"admin key: (\S+)", self.log.read_text())
                    if keys:
                        self.key = keys[-1]
                        return
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            time.sleep(0.1)
        raise AssertionError(f"replica on {self.port} did not start: "
                             f"{self.log.read_text()[-3000:]}")

    def sigterm(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def cluster(tmp_path: Path, cluster_store: str | None, request: pytest.FixtureRequest
            ) -> Iterator[tuple[list[Replica], Balancer, Path]]:
    sock = tmp_path / "edge.sock"
    edge = subprocess.Popen(
        [*DSEC_ARGV, "edge", "--listen", f"unix:{sock}", "--node-id", "edge-0",
         "--backend", "simulated", "--state-dir", str(tmp_path / "edge"),
         "--journal-sync", "write", "--cpus", "1000", "--memory", "1TiB",
         "--max-sandboxes", "100000", "--log-level", "warning"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "edge.log", "wb"))  # noqa: SIM115 - closed with the process
    reps: list[Replica] = []
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert edge.poll() is None and time.monotonic() < deadline, (
                (tmp_path / "edge.log").read_text())
            time.sleep(0.05)
        reps = [Replica(tmp_path, i, sock, cluster_store) for i in range(2)]
        for r in reps:
            r.start()
        with Balancer([r.port for r in reps]) as lb:
            yield reps, lb, sock
    finally:
        for r in reps:
            r.kill()
        edge.send_signal(signal.SIGTERM)
        try:
            edge.wait(30)
        except subprocess.TimeoutExpired:
            edge.kill()
            edge.wait(10)


def _live_on_edge(sock: Path) -> list[str]:
    async def ask() -> list[str]:
        async with await EdgeClient.connect(f"unix:{sock}") as e:
            return [i.id for i in await e.list() if i.state not in ("destroyed", "failed")]
    return asyncio.run(ask())


def test_rolling_upgrade_loses_no_client_call(
        cluster: tuple[list[Replica], Balancer, Path]) -> None:
    reps, lb, sock = cluster
    url = f"http://127.0.0.1:{lb.port}"
    stop = threading.Event()
    done: list[int] = []
    failures: list[str] = []
    lock = threading.Lock()

    def client(n: int) -> None:
        with Client(url, reps[0].key, protocol="http", session_lease_s=None,
                    timeout=30) as c:
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    sb = c.sandboxes.create(labels={"client": str(n)})
                    out = sb.exec(["echo", f"{n}-{i}"])
                    assert out.stdout == f"{n}-{i}\n".encode(), out
                    assert sb.refresh().state == "running"
                    sb.kill()
                    with lock:
                        done.append(n)
                except Exception as exc:  # noqa: BLE001 - every failure is counted
                    with lock:
                        failures.append(f"client {n} round {i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(4)]
    for t in threads:
        t.start()

    def progress(more: int) -> None:
        want = len(done) + more
        deadline = time.monotonic() + 60
        while len(done) < want:
            assert time.monotonic() < deadline, f"clients stalled at {len(done)}: {failures}"
            time.sleep(0.05)

    exits = []
    try:
        progress(20)
        for r in reps:                       # upgrade each replica in turn
            exits.append(r.sigterm())        # drains in-flight requests, exits
            progress(20)                     # the other replica serves alone meanwhile
            r.start()                        # "the new version"
            progress(20)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert exits == [0, 0], exits
    assert failures == [], failures[:5]
    assert len(done) >= 100
    # every sandbox a client made was destroyed by it: no duplicate from a retried
    # create, no leak (the edge is the source of truth)
    deadline = time.monotonic() + 10
    while (left := _live_on_edge(sock)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == []
    assert os.path.exists(sock)
