"""Bench figures of processes and terminals (issue 19), suite ``features``.

- ``pty_rtt_p50_ms``: a keystroke's round trip through a terminal inside a container
  sandbox, as ``dsec sandbox shell`` and the SDK see it: ``process_input`` of one byte
  through the Aether gateway to the edge, written to the pty master; the sandbox's line
  discipline echoes it; the echo comes back on the ``process_connect`` stream. Target
  (issue 19): at most 5 ms on one node. Also over the REST WebSocket
  (``pty_rtt_ws_p50_ms``), the dashboard's path.
- ``exec_stream_first_byte_p50_ms``: from calling ``exec_stream("echo x")`` to its first
  output chunk, through the gateway.

``dsec up`` runs as its own process (``LocalCluster(subprocess=True)``), so the client's
work does not share a GIL with the server's.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time

from dsec.bench import BenchContext

__all__ = ["terminals"]


async def _pty_rtt(url: str, key: str, gateway: str | None, sid: str, n: int) -> list[float]:
    from dsec.client.core import AsyncClient

    async with AsyncClient(url, key, gateway=gateway, protocol="aether",
                           session_lease_s=None) as c:
        sb = await c.sandboxes.get(sid)
        term = await sb.pty.create(cols=80, rows=24, cmd=["/bin/cat"])
        stream = term.stream()
        # the echo of each key is what comes back; letters in turn, so a late echo of
        # the previous key is never taken for this one
        rtts: list[float] = []
        pending = b""
        try:
            for i in range(n + 5):
                key_b = bytes([97 + i % 26])
                t0 = time.perf_counter()
                await term.send_stdin(key_b)
                while key_b not in pending:
                    async with asyncio.timeout(10):
                        item = await stream.__anext__()
                    pending += getattr(item, "data", b"")
                pending = pending[pending.index(key_b) + 1:]
                if i >= 5:       # warm-up keys left out
                    rtts.append(time.perf_counter() - t0)
        finally:
            await stream.aclose()
            await term.kill()
        return rtts


async def _ws_rtt(url: str, key: str, sid: str, n: int) -> list[float]:
    from websockets.asyncio.client import connect as ws_connect

    from dsec.client.core import AsyncClient

    async with AsyncClient(url, key, protocol="http", session_lease_s=None) as c:
        sb = await c.sandboxes.get(sid)
        term = await sb.pty.create(cols=80, rows=24, cmd=["/bin/cat"])
    ws_url = (f"{url.replace('http://', 'ws://')}/v1/sandboxes/{sid}/processes/"
              f"{term.pid}/ws?token={key}")
    rtts: list[float] = []
    async with ws_connect(ws_url) as ws:
        pending = b""
        for i in range(n + 5):
            key_b = bytes([97 + i % 26])
            t0 = time.perf_counter()
            await ws.send(key_b)
            while key_b not in pending:
                async with asyncio.timeout(10):
                    m = await ws.recv()
                if isinstance(m, bytes):
                    pending += m
            pending = pending[pending.index(key_b) + 1:]
            if i >= 5:
                rtts.append(time.perf_counter() - t0)
        await ws.send(b'{"signal": 9}'.decode())
    return rtts


async def _first_byte(url: str, key: str, gateway: str | None, sid: str,
                      n: int) -> list[float]:
    from dsec.client.core import AsyncClient
    from dsec.wire.spec import ExecChunk

    async with AsyncClient(url, key, gateway=gateway, protocol="aether",
                           session_lease_s=None) as c:
        sb = await c.sandboxes.get(sid)
        out: list[float] = []
        for i in range(n + 3):
            t0 = time.perf_counter()
            first = None
            async for item in sb.exec_stream("echo x"):
                if first is None and isinstance(item, ExecChunk):
                    first = time.perf_counter() - t0
            if i >= 3 and first is not None:
                out.append(first)
        return out


def terminals(ctx: BenchContext) -> None:
    """Sandbox features (issue 19): PTY keystroke round trip, exec_stream first byte."""
    if os.geteuid() != 0:
        ctx.note("processes: skipped (the container backend needs root)")
        return
    from dsec.cluster.local import LocalCluster

    n = ctx.scale(400, 60)
    with LocalCluster(edges=1, backend="container", subprocess=True) as cl, \
            cl.client(protocol="http", session_lease_s=None) as c:
        sid = c.sandboxes.create(backend="container", memory="256MiB", detached=True).id
        try:
            rtt = asyncio.run(_pty_rtt(cl.url, cl.api_key, cl.gateway, sid, n))
            ctx.record("pty_rtt_p50_ms", statistics.median(rtt) * 1e3, "ms", n=len(rtt),
                       door="gateway")
            ctx.record("pty_rtt_p99_ms", sorted(rtt)[int(len(rtt) * 0.99) - 1] * 1e3, "ms",
                       n=len(rtt), door="gateway")
            ws = asyncio.run(_ws_rtt(cl.url, cl.api_key, sid, n))
            ctx.record("pty_rtt_ws_p50_ms", statistics.median(ws) * 1e3, "ms", n=len(ws),
                       door="rest-websocket")
            fb = asyncio.run(_first_byte(cl.url, cl.api_key, cl.gateway, sid,
                                         ctx.scale(200, 40)))
            ctx.record("exec_stream_first_byte_p50_ms", statistics.median(fb) * 1e3, "ms",
                       n=len(fb), door="gateway")
        finally:
            c.sandboxes.get(sid).kill()
    ctx.note("pty_rtt: one byte typed into `cat` on a pty inside a container sandbox, "
             "its echo read back (dsec up in its own process, one node); target <= 5 ms")
