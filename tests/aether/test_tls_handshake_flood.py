"""A TLS listener under a flood of sockets that never send a ClientHello (red team 16
F8): the sockets in their handshake hold pending slots and are evicted oldest first, so
a real client (the apiserver, with the cluster CA's certificate) still gets in, whether
the listener's pending slots or the process's fd share is what is full. Real sockets on
loopback, a real TLS listener with the cluster CA's certificates."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path

from dsec.aether import Router
from dsec.aether.limits import ProcessBudget, ServerLimits
from dsec.aether.transport import Server, connect, serve
from dsec.cluster.ca import NodeCredentials, init_ca, issue_node_cert, new_node_key


def _edge_ctx(tmp_path: Path) -> tuple[object, object]:
    from cryptography.hazmat.primitives import serialization
    ca, _ = init_ca(str(tmp_path / "c"))
    key, csr = new_node_key("edge-a")
    cert = issue_node_cert(ca, csr, "edge-a")
    creds = NodeCredentials(str(tmp_path / "creds"))
    creds.save(key, cert.public_bytes(serialization.Encoding.PEM), ca.pem)
    return creds.server_context(), ca.client_context()


async def _flood(port: int, addresses: range, per_address: int) -> list[socket.socket]:
    def go() -> list[socket.socket]:
        out = []
        for i in addresses:
            for _ in range(per_address):
                s = socket.socket()
                s.bind((f"127.0.0.{i}", 0))
                s.settimeout(2)
                try:
                    s.connect(("127.0.0.1", port))
                except OSError:
                    s.close()
                    continue
                out.append(s)                 # never sends a byte
        return out
    return await asyncio.to_thread(go)


async def _until(check: object, timeout: float = 10.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not check():                                         # type: ignore[operator]
        assert asyncio.get_running_loop().time() < end, "timed out"
        await asyncio.sleep(0.05)


async def _echo_server(ctx: object, limits: ServerLimits,
                       budget: ProcessBudget | None = None) -> Server:
    r = Router()

    async def echo(body: bytes) -> bytes:
        return body
    r.add("echo", echo)
    return await serve(r, "tcp:127.0.0.1:0", ssl=ctx, limits=limits,  # type: ignore[arg-type]
                       budget=budget)


async def _client_gets_in(server: Server, client_ctx: object) -> None:
    conn = await connect(str(server.address), ssl=client_ctx,  # type: ignore[arg-type]
                         server_hostname="edge-a", timeout=5)
    try:
        assert await conn.call("echo", b"hi", timeout=5) == b"hi"
    finally:
        await conn.close()


async def test_handshake_flood_over_the_pending_slots_lets_the_client_in(
        tmp_path: Path) -> None:
    server_ctx, client_ctx = _edge_ctx(tmp_path)
    server = await _echo_server(server_ctx, ServerLimits(max_pending=40,
                                                         max_pending_per_peer=10))
    socks: list[socket.socket] = []
    try:
        socks = await _flood(server.address.port, range(2, 8), 10)    # 6 x 10 = 60 > 40
        await _until(lambda: server.stats.refused.get("evicted", 0) >= 15)
        assert server.admission.pending <= 40
        await _client_gets_in(server, client_ctx)
        # the per-address cap still holds, and its refusal on a TLS port is a plain close
        extra = await _flood(server.address.port, range(9, 10), 11)
        socks += extra
        await _until(lambda: server.stats.refused.get("peer_pending_full", 0) >= 1)
        extra[-1].settimeout(5)
        assert extra[-1].recv(100) == b""
    finally:
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()
        await server.close()
    assert server.admission.open == 0 and server.admission.pending == 0


async def test_handshake_flood_over_the_fd_share_lets_the_client_in(tmp_path: Path) -> None:
    server_ctx, client_ctx = _edge_ctx(tmp_path)
    budget = ProcessBudget(connection_share=0.5, nofile=lambda: 60)    # 30 connections
    server = await _echo_server(server_ctx, ServerLimits(max_pending=1000,
                                                         max_pending_per_peer=10), budget)
    socks: list[socket.socket] = []
    try:
        socks = await _flood(server.address.port, range(2, 8), 10)
        await _until(lambda: server.stats.refused.get("evicted", 0) >= 25)
        assert budget.connections <= 30
        await _client_gets_in(server, client_ctx)
    finally:
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()
        await server.close()
    assert budget.connections == 0
