"""Overload from a tenant with a valid key (red team of issue 12's limits).

The listener limits bound strangers; these tests bound what an authenticated, low-privilege
tenant can do to a node by sheer volume through the Aether gateway: pipelining thousands
of calls per connection (never waiting for replies, or never reading them). Whatever it
does, the node must not be written off (``node_lost`` destroys every sandbox on it, other
tenants' too) and the server must not buffer its work without bound.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from dsec.aether.frame import FrameType, encode_parts
from dsec.aether.messages import method_prefix

_UP = "import sys; from dsec.cli.main import main; sys.argv[0] = 'dsec'; main()"


@pytest.fixture
def up(tmp_path: Path, cluster_store: str | None) -> Iterator[dict[str, Any]]:
    """``dsec up`` (simulated backend) in its own process, node TTL 5 s."""
    state = tmp_path / "state"
    proc = subprocess.Popen(
        [sys.executable, "-c", _UP, "up", "--state-dir", str(state), "--listen",
         "127.0.0.1:0", "--backend", "simulated", "--node-ttl", "5", "--quiet",
         *(["--store", cluster_store] if cluster_store else [])],
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        local = state / "local.json"
        while not local.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "dsec up did not start"
            time.sleep(0.1)
        info = json.loads(local.read_text())
        info["pid"] = proc.pid
        yield info
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _request(sid: int, method: str, body: Any) -> bytes:
    p = method_prefix(method) + msgspec.msgpack.encode(body)
    return encode_parts(int(FrameType.REQUEST), sid, p) + p


class Pipeliner:
    """One authenticated gateway connection that writes ``n`` requests back to back
    without waiting for any reply; a thread reads (and counts) whatever comes back."""

    def __init__(self, gateway: str, key: str, source: str) -> None:
        host, _, port = gateway.removeprefix("tcp:").rpartition(":")
        self.sock = socket.create_connection((host, int(port)), source_address=(source, 0))
        self.key = key
        self.received = 0
        self.sid = 1
        self.sock.sendall(self._next("aether.auth", key.encode()))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _next(self, method: str, body: Any) -> bytes:
        f = _request(self.sid, method, body)
        self.sid += 2
        return f

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(1 << 20)
            except OSError:
                return
            if not data:
                return
            self.received += len(data)

    def flood(self, method: str, body: Any, n: int) -> threading.Thread:
        blob = b"".join(self._next(method, body) for _ in range(n))

        def send() -> None:
            try:
                self.sock.sendall(blob)
            except OSError:
                pass
        t = threading.Thread(target=send, daemon=True)
        t.start()
        return t

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


# the apiserver's polls queued behind a tenant's gateway work, whatever the store (~19 s)
@pytest.mark.store_kinds("sqlite")
def test_a_tenant_pipelining_calls_through_the_gateway_does_not_get_the_node_written_off(
        up: dict[str, Any]) -> None:
    """A member key pipelines tens of thousands of execs on 8 gateway connections. The
    apiserver's polls of its (healthy, in-process) edge queue behind that work and time
    out; before the fix the node was declared lost after the TTL and every sandbox on it
    (the admin's too) destroyed with reason ``node_lost``."""
    admin = {"authorization": f"Bearer {up['api_key']}"}
    with httpx.Client(base_url=up["url"], headers=admin, timeout=60) as http:
        r = http.post("/v1/keys", json={"name": "tenant", "project": "default",
                                        "role": "member"})
        assert r.status_code == 201, r.text
        key = r.json()["api_key"]
        ids = []
        for _ in range(3):
            r = http.post("/v1/sandboxes", json={"project": "default"})
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
        floods = [Pipeliner(up["gateway"], key, f"127.0.0.{2 + i}") for i in range(8)]
        statuses: list[str] = []
        try:
            body = {"id": ids[0], "req": {"argv": ["true"]}}
            for p in floods:
                p.flood("api.exec", body, 40_000)
            start = time.monotonic()
            while time.monotonic() - start < 14.0:       # TTL 5 s + poll timeout 5 s + slack
                nodes = http.get("/v1/nodes").json()["items"]
                statuses += [n.get("status", "healthy") for n in nodes]
                time.sleep(0.5)
            assert sum(p.received for p in floods) > 0   # the tenant was being served
        finally:
            for p in floods:
                p.close()
        assert "lost" not in statuses, statuses
        for sid in ids:
            info = http.get(f"/v1/sandboxes/{sid}").json()
            assert info.get("state") == "running", info
            events = http.get(f"/v1/sandboxes/{sid}/events").json()["items"]
            assert not [e for e in events if e["reason"] == "node_lost"], events
