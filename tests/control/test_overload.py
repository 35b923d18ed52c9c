"""Overload through every door of a real ``dsec up`` (issue 12): a flood of idle
connections is refused with a reason, stalled requests are cut, and the node's own work
(execs, the apiserver's polls of its edge) goes on untouched.

The incident: 21,000 idle TCP connections from an unprivileged local user filled a
``dsec up`` process's 20,000 file descriptors in 50 s; execs failed with EMFILE, the
apiserver could not read its edge's heartbeat, wrote the node off after 10 s and had all
its sandboxes destroyed (``node_lost``). Here the process under test runs with
RLIMIT_NOFILE 1024 (set in that process only), so ~1,200 connections prove the same
point; it keeps the default node TTL (10 s), and the flood lasts longer than that.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from dsec.aether.frame import FrameDecoder, FrameType
from dsec.aether.messages import Goaway

NOFILE = 1024
_UP = ("import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({n}, {n})); "
       "from dsec.cli.main import main; sys.argv[0] = 'dsec'; main()")


def _dsec_up(state: Path, backend: str) -> Iterator[dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _UP.format(n=NOFILE), "up", "--state-dir", str(state),
         "--listen", "127.0.0.1:0", "--backend", backend, "--quiet"],
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        local = state / "local.json"
        while not local.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "dsec up did not start"
            time.sleep(0.1)
        info = json.loads(local.read_text())
        info["edge_sock"] = str(state / "edges" / "edge-0.sock")
        info["proc"] = proc
        yield info
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def up_container(tmp_path: Path) -> Iterator[dict[str, Any]]:
    yield from _dsec_up(tmp_path / "state", "container")


@pytest.fixture
def up_simulated(tmp_path: Path) -> Iterator[dict[str, Any]]:
    yield from _dsec_up(tmp_path / "state", "simulated")


class Flood:
    """Idle connections, never a byte sent; what each one hears back is collected."""

    def __init__(self) -> None:
        self.socks: list[socket.socket] = []
        self.heard: dict[int, bytes] = {}
        self.failed = 0

    def tcp(self, host: str, port: int, n: int, sources: int) -> None:
        for i in range(n):
            s = socket.socket()
            s.bind((f"127.0.0.{2 + i % sources}", 0))
            self._connect(s, (host, port))

    def unix(self, path: str, n: int) -> None:
        for _ in range(n):
            self._connect(socket.socket(socket.AF_UNIX), path)

    def _connect(self, s: socket.socket, addr: Any) -> None:
        try:
            s.connect(addr)
        except OSError:
            self.failed += 1
            s.close()
            return
        s.setblocking(False)
        self.socks.append(s)

    def listen(self) -> None:
        """Collect what arrived so far (non-blocking)."""
        for s in self.socks:
            if s.fileno() < 0:
                continue
            try:
                while data := s.recv(65536):
                    self.heard[s.fileno()] = self.heard.get(s.fileno(), b"") + data
                self.heard.setdefault(s.fileno(), b"")
                s.close()  # EOF: the server closed it
            except BlockingIOError:
                pass
            except OSError:
                s.close()

    def goaways(self) -> list[Goaway]:
        out = []
        for data in self.heard.values():
            dec = FrameDecoder()
            dec.feed(data)
            f = dec.next_frame()
            if f is not None and f.type == FrameType.GOAWAY:
                out.append(msgspec.msgpack.decode(f.payload, type=Goaway))
        return out

    def close(self) -> None:
        for s in self.socks:
            s.close()


def test_an_idle_flood_on_the_gateway_and_the_edge_socket_leaves_the_node_alone(
        up_container: dict[str, Any]) -> None:
    from dsec import Client

    up = up_container
    h = {"authorization": f"Bearer {up['api_key']}"}
    flood = Flood()
    with httpx.Client(base_url=up["url"], headers=h, timeout=30) as http:
        ids = []
        for _ in range(3):
            r = http.post("/v1/sandboxes", json={"project": "default", "backend": "container"})
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
        host, _, port = up["gateway"].removeprefix("tcp:").rpartition(":")
        try:
            flood.tcp(host, int(port), 900, sources=6)     # 900 strangers, 6 addresses
            flood.unix(up["edge_sock"], 300)               # and 300 on the edge's socket
            assert flood.failed == 0
            start = time.monotonic()
            execs = []
            # longer than the node TTL (10 s) and the flood's auth deadline (10 s)
            while time.monotonic() - start < 13.0:
                for sid in ids:
                    r = http.post(f"/v1/sandboxes/{sid}/exec",
                                  json={"argv": ["sh", "-c", "echo ok; ls /proc/self/fd"]})
                    execs.append((r.status_code, r.json().get("stdout", r.text)[:3]))
                nodes = http.get("/v1/nodes").json()["items"]
                assert [n.get("status", "healthy") for n in nodes] == ["healthy"], nodes
                flood.listen()
                time.sleep(0.5)
            assert execs and set(execs) == {(200, "ok\n")}, execs[-5:]
            # the SDK's gateway connection authenticates at once and gets in meanwhile
            with Client(up["url"], up["api_key"], gateway=up["gateway"],
                        protocol="aether") as c:
                assert c.sandboxes.get(ids[0]).info.state == "running"
            flood.listen()
            told = flood.goaways()
            # every stranger heard why it was dropped: refused at once beyond the caps
            # (overloaded), or cut at its 10 s deadline; none was left hanging
            assert len(told) == len(flood.socks), (len(told), len(flood.socks))
            refused = [g for g in told if g.code == "overloaded"]
            late = [g for g in told if "within 10s of connecting" in g.reason]
            assert len(refused) + len(late) == len(told)
            assert len(refused) >= 900 + 300 - 6 * 64 - 64
            assert any("unauthenticated connections from 127.0.0." in g.reason for g in refused)
            assert any("connections from uid:0" in g.reason for g in refused)
        finally:
            flood.close()
        for sid in ids:
            info = http.get(f"/v1/sandboxes/{sid}").json()
            assert info["state"] == "running", info
            events = http.get(f"/v1/sandboxes/{sid}/events").json()["items"]
            assert not [e for e in events if e["reason"] == "node_lost"], events
        r = http.post(f"/v1/sandboxes/{ids[0]}/exec", json={"argv": ["echo", "after"]})
        assert r.json()["stdout"] == "after\n"


def _http_read(s: socket.socket, timeout: float) -> bytes:
    s.settimeout(timeout)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


def test_rest_refuses_floods_and_cuts_slow_loris(up_simulated: dict[str, Any]) -> None:
    up = up_simulated
    host, _, port = up["url"].removeprefix("http://").rpartition(":")
    addr = (host, int(port))
    idle: list[socket.socket] = []
    try:
        for _ in range(70):            # one address may hold 64 connections with no request
            s = socket.create_connection(addr)
            idle.append(s)
        refused = [_http_read(s, 0.2) for s in idle[64:]]
        assert all(r.startswith(b"HTTP/1.1 503 ") for r in refused), refused
        body = json.loads(refused[0].split(b"\r\n\r\n", 1)[1])
        assert body["code"] == "overloaded" and "127.0.0.1" in body["message"]
        assert b"retry-after: 1" in refused[0].lower()

        # a slow-loris: the request line, then a header byte every half second
        loris = socket.create_connection(addr, source_address=("127.0.0.9", 0))
        loris.sendall(b"GET /v1/info HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        big = socket.create_connection(addr, source_address=("127.0.0.10", 0))
        big.sendall(b"GET /v1/info HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (64 << 10))
        assert _http_read(big, 5).startswith(b"HTTP/1.1 431 ")

        # clients with a request to make are served meanwhile (another address)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}",
                          headers={"authorization": f"Bearer {up['api_key']}"},
                          transport=httpx.HTTPTransport(local_address="127.0.0.11")) as http:
            assert http.get("/v1/info").status_code == 200

        start, got = time.monotonic(), b""
        loris.setblocking(False)
        while time.monotonic() - start < 15 and not got:
            try:
                loris.send(b"a")
                got = loris.recv(65536)
            except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                pass
            time.sleep(0.5)
        assert got.startswith(b"HTTP/1.1 408 "), got
        assert b"request headers not complete within 10s" in got
        # and the idle ones have been cut by now too, with a 408 saying so
        first = _http_read(idle[0], 5)
        assert first.startswith(b"HTTP/1.1 408 ") and b"no request within 10s" in first
        loris.close()
        big.close()
    finally:
        for s in idle:
            s.close()


@pytest.mark.store_kinds("sqlite")   # listener slots, whatever the store
def test_full_waiting_slots_make_room_for_clients_that_speak_at_once(
        cluster_store: str | None) -> None:
    """When a listener's slots for connections that have not yet sent a request (REST)
    or authenticated (gateway) are full, a newcomer pushes out the oldest: an idle
    flood cannot lock out clients that make their request right away."""
    from dsec.aether.limits import ServerLimits
    from dsec.cluster.local import LocalCluster
    from dsec.control.api.http_limits import HttpLimits

    five = ServerLimits(max_pending=5)
    with LocalCluster(http_limits=HttpLimits(connections=five), listener_limits=five,
                      store=cluster_store) as cl:
        host, _, port = cl.url.removeprefix("http://").rpartition(":")
        rest = [socket.create_connection((host, int(port)), source_address=(f"127.0.0.{i}", 0))
                for i in range(2, 7)]
        assert cl.gateway is not None
        gw_host, _, gw_port = cl.gateway.removeprefix("tcp:").rpartition(":")
        gw = [socket.create_connection((gw_host, int(gw_port)),
                                       source_address=(f"127.0.0.{i}", 0)) for i in range(2, 7)]
        try:
            time.sleep(0.3)
            with httpx.Client(base_url=cl.url,
                              headers={"authorization": f"Bearer {cl.api_key}"}) as http:
                assert http.get("/v1/info").status_code == 200
            with cl.client(protocol="aether") as c:
                assert c.info().principal == "admin"
            first = _http_read(rest[0], 5)
            assert first.startswith(b"HTTP/1.1 503 ") and b"dropped to make room" in first
            dec = FrameDecoder()
            dec.feed(_http_read(gw[0], 5))
            f = dec.next_frame()
            assert f is not None and f.type == FrameType.GOAWAY
            g = msgspec.msgpack.decode(f.payload, type=Goaway)
            assert g.code == "overloaded" and "dropped to make room" in g.reason
        finally:
            for s in rest + gw:
                s.close()
