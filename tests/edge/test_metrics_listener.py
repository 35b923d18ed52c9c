"""The edge metrics listener's connection cap and head timeout (REDTEAM-14b #7): idle
peers beyond the cap are answered 503 and closed at once, the admitted ones are cut after
HEAD_TIMEOUT_S, and a scraper gets its answer once they are gone."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest

from dsec.aether.limits import ProcessBudget
from dsec.edge.metrics import HEAD_TIMEOUT_S, METRICS_LIMITS, serve_metrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _scrape(port: int) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET /metrics HTTP/1.0\r\n\r\n")
    await w.drain()
    data = await asyncio.wait_for(r.read(), 5)
    w.close()
    return data


@pytest.mark.serial  # counts refusals of 150 connections opened against a timer (131 of 134 under load)
async def test_idle_peers_capped_refused_with_503_then_cut() -> None:
    renders = []

    def render() -> bytes:
        renders.append(1)
        return b"dsec_edge_sandboxes 0\n"

    port = _free_port()
    server = await serve_metrics(f"127.0.0.1:{port}", render,
                                 budget=ProcessBudget(nofile=lambda: 100_000))
    peers: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        for _ in range(150):  # idle: connect, say nothing (one address: 16 per peer)
            peers.append(await asyncio.open_connection("127.0.0.1", port))
        await asyncio.sleep(0.3)
        answers = []
        for r, _w in peers:
            with contextlib.suppress(TimeoutError):
                answers.append(await asyncio.wait_for(r.read(), 0.05))
        refused = [a for a in answers if a.startswith(b"HTTP/1.0 503")]
        held = len(peers) - len(answers)
        assert held <= METRICS_LIMITS.max_connections_per_peer, held  # type: ignore[operator]
        assert len(refused) >= len(peers) - METRICS_LIMITS.max_connections_per_peer  # type: ignore[operator]
        assert b"per-peer limit" in refused[0]
        await asyncio.sleep(HEAD_TIMEOUT_S + 0.5)  # the admitted idle ones are cut
        for r, _w in peers:
            assert await asyncio.wait_for(r.read(), 1.0) is not None
        a, b = await _scrape(port), await _scrape(port)
        assert a.startswith(b"HTTP/1.0 200") and b"dsec_edge_sandboxes 0" in a and a == b
        assert len(renders) == 1  # the second scrape within a second reused the render
    finally:
        for _r, w in peers:
            w.close()
        server.close()
        await server.wait_closed()
