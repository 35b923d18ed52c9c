"""Suite ``protocol``: Aether codec throughput and RPC rates over UDS."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import tempfile
import time
import zlib
from typing import Any

from dsec.aether.frame import FrameDecoder, FrameType, encode_parts
from dsec.bench import BenchContext, suite


def _mbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def _time_loop(fn: Any, budget_s: float) -> tuple[int, float]:
    n, t0 = 0, time.perf_counter()
    batch = 1
    while True:
        for _ in range(batch):
            fn()
        n += batch
        dt = time.perf_counter() - t0
        if dt >= budget_s:
            return n, dt
        batch = min(batch * 2, 4096)


def codec(ctx: BenchContext) -> None:
    budget = 0.2 if ctx.quick else 1.0
    for size in (64, 1024, 65536):
        payload = os.urandom(size)
        frame_len = size + 25

        def enc() -> None:
            encode_parts(FrameType.RESPONSE, 7, payload)  # header; payload is written as-is

        n, dt = _time_loop(enc, budget)
        ctx.record("protocol_encode", _mbps(frame_len * n, dt), "MB/s", payload_bytes=size)

        wire = encode_parts(FrameType.RESPONSE, 7, payload) + payload
        # Decode from a stream of 64 back-to-back frames, as the read loop sees them.
        burst = wire * 64
        dec = FrameDecoder()

        def decode() -> None:
            dec.feed(burst)
            while dec.next_frame() is not None:
                pass

        n, dt = _time_loop(decode, budget)
        ctx.record("protocol_decode", _mbps(len(burst) * n, dt), "MB/s", payload_bytes=size)

        def limit() -> None:
            zlib.crc32(payload)
            bytes(bytearray(payload))  # one copy, as the decoder makes

        n, dt = _time_loop(limit, budget)
        ctx.record("limit_crc_copy", _mbps(frame_len * n, dt), "MB/s", payload_bytes=size)


def _serve_noop(path: str, ready: Any) -> None:
    import uvloop

    from dsec.aether import Router, serve

    async def main() -> None:
        r = Router()
        r.add("noop", lambda body: None)
        srv = await serve(r, f"unix:{path}")
        ready.set()
        await asyncio.Event().wait()
        await srv.close()

    uvloop.run(main())


async def _rpc(ctx: BenchContext, path: str) -> None:
    from dsec.aether import connect

    conn = await connect(f"unix:{path}")
    n = ctx.scale(60_000, 8_000)
    for _ in range(500):  # warm up
        await conn.call("noop")
    t0 = time.perf_counter()
    for _ in range(n // 3):
        await conn.call("noop")
    dt = time.perf_counter() - t0
    ctx.record("rpc_roundtrip_seq", (n // 3) / dt, "calls/s", in_flight=1, transport="uds")

    async def worker(k: int) -> None:
        for _ in range(k):
            await conn.call("noop")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(n // 64) for _ in range(64)))
    dt = time.perf_counter() - t0
    ctx.record("rpc_pipelined", (n // 64 * 64) / dt, "calls/s", in_flight=64, transport="uds")

    batch = [("noop", None)] * 64
    t0 = time.perf_counter()
    for _ in range(n // 64):
        await conn.call_batch(batch)
    dt = time.perf_counter() - t0
    ctx.record("rpc_batch64", (n // 64 * 64) / dt, "calls/s", batch=64, transport="uds")
    await conn.close()


def rpc(ctx: BenchContext) -> None:
    import uvloop

    with tempfile.TemporaryDirectory(prefix="dsec-bench-") as d:
        path = os.path.join(d, "aether.sock")
        mpctx = mp.get_context("spawn")
        ready = mpctx.Event()
        proc = mpctx.Process(target=_serve_noop, args=(path, ready), daemon=True)
        proc.start()
        try:
            if not ready.wait(30):
                raise RuntimeError("benchmark server did not start within 30 s")
            uvloop.run(_rpc(ctx, path))
        finally:
            proc.terminate()
            proc.join(5)
    ctx.note("RPC figures: client and no-op server in separate processes (one core each), "
             "one UDS connection, uvloop.")


@suite("protocol", "Aether frame codec MB/s and RPC calls/s over UDS")
def run(ctx: BenchContext) -> None:
    codec(ctx)
    rpc(ctx)
