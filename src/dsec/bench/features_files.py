"""Files part of suite ``features`` (issue 19): file transfer MB/s, 1 GiB both ways over
the Aether gateway and REST, against ``cat`` of the same file through ``exec_stream``,
all in one run on one container sandbox of a ``dsec up`` process (its own process: the
SDK's CPU is not the server's).

Figures: ``file_write_mbps`` and ``file_read_mbps`` (param ``transport``: aether|rest),
``exec_cat_read_mbps`` (the file's bytes through exec's stdout stream), and
``file_transfer_server_rss_growth_mb`` (the peak RSS the ``dsec up`` process gained
during one transport's round trip: bounded memory, not the file's size). MB = 10^6
bytes. ``--quick``: 256 MiB instead of 1 GiB.
"""

from __future__ import annotations

import asyncio
import hashlib
import tempfile
import time
from typing import Any, Literal

from dsec.bench import BenchContext

__all__ = ["files"]

_BLOCK = hashlib.sha256(b"bench").digest() * 32768      # 1 MiB


def _hwm_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6
    return 0.0


def _reset_hwm(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


async def _cat(cl: Any, sid: str, n: int,
               proto: Literal["aether", "http"] = "aether") -> tuple[int, float]:
    """``cat`` of the file through exec_stream (its output cap raised to the file's
    size): (bytes seen, seconds)."""
    from dsec.client.core import AsyncClient
    from dsec.wire import ops
    from dsec.wire.calls import ExecCall
    from dsec.wire.spec import MAX_OUTPUT_CAP_BYTES, ExecChunk, ExecRequest, ExecResult
    req = ExecRequest(shell="cat /work/big", timeout_s=600.0,
                      output_cap_bytes=min(n, MAX_OUTPUT_CAP_BYTES))
    async with AsyncClient(cl.url, cl.api_key, gateway=cl.gateway, protocol=proto,
                           session_lease_s=None) as c:
        t = await c._transport()
        got = 0
        t0 = time.perf_counter()
        async for item in t.stream(ops.EXEC_STREAM, ExecCall(id=sid, req=req), timeout=None):
            if isinstance(item, ExecChunk):
                got += len(item.data)
            elif isinstance(item, ExecResult) and item.exit_code != 0:
                raise RuntimeError(f"cat exited {item.exit_code}")
        return got, time.perf_counter() - t0


def _cat_part(ctx: BenchContext, cl: Any, sid: str, n: int, mib: int,
              proto: Literal["aether", "http"] = "aether", label: str = "aether") -> None:
    """``exec_cat_read_mbps``; a failure is noted, not fatal to the file figures. Seen
    at load average 34 on the 2-core VM before exec_stream had per-stream credit
    (redteam-19 A2): the starved apiserver read the edge link too slowly, and the edge
    closed the link at 64 MiB of unread replies (every call on it failed)."""
    try:
        got, dt = asyncio.run(_cat(cl, sid, n, proto))
    except Exception as exc:  # noqa: BLE001 - recorded as a note
        ctx.note(f"exec_cat_read_mbps ({label}) not measured: {type(exc).__name__}: {exc}")
        return
    ctx.record("exec_cat_read_mbps", got / dt / 1e6, "MB/s", transport=label, mib=mib)
    if got != n:
        ctx.note(f"cat through exec_stream ({label}) delivered {got} of {n} bytes")


def files(ctx: BenchContext) -> None:
    """File transfer MB/s both ways over Aether and REST vs cat through exec."""
    from dsec.client.sync import Client
    from dsec.cluster.local import LocalCluster

    mib = ctx.scale(1024, 256)
    n = mib << 20
    want = hashlib.sha256()
    for _ in range(mib):
        want.update(_BLOCK)
    with tempfile.TemporaryDirectory(prefix="dsec-bench-files-") as state, \
            LocalCluster(backend="container", subprocess=True, state_dir=state,
                         disk_pool_bytes=(2 * mib + 1024) << 20) as cl:
        pid = cl._proc.pid
        runs: tuple[tuple[Literal["aether", "http"], str], ...] = (
            ("aether", "aether"), ("http", "rest"))
        for proto, label in runs:
            with Client(cl.url, cl.api_key, gateway=cl.gateway, protocol=proto,
                        session_lease_s=None) as c, \
                    c.sandboxes.create(disk=f"{mib + 256}MiB", memory="512MiB") as sb:
                _reset_hwm(pid)
                base = _hwm_mb(pid)
                t0 = time.perf_counter()
                sb.files.write("/work/big", (_BLOCK for _ in range(mib)), size=n)
                dt = time.perf_counter() - t0
                ctx.record("file_write_mbps", n / dt / 1e6, "MB/s", transport=label,
                           mib=mib)
                h, got = hashlib.sha256(), 0
                t0 = time.perf_counter()
                for chunk in sb.files.read("/work/big", stream=True):
                    h.update(chunk)
                    got += len(chunk)
                dt = time.perf_counter() - t0
                if got != n or h.digest() != want.digest():
                    raise RuntimeError(f"{label}: read back {got} bytes, sha256 "
                                       f"{'equal' if h.digest() == want.digest() else 'differs'}")
                ctx.record("file_read_mbps", n / dt / 1e6, "MB/s", transport=label, mib=mib)
                ctx.record("file_transfer_server_rss_growth_mb", _hwm_mb(pid) - base, "MB",
                           transport=label, mib=mib)
                # the baseline of the same run at the same door (issue 19: "vs cat
                # through exec"): exec_stream's NDJSON over REST, frames over Aether
                _cat_part(ctx, cl, sb.id, n, mib, proto, label)
    ctx.note("file transfer: SDK -> gateway/REST -> edge link -> edge -> the sandbox's "
             "overlay, each hop under credit (Aether duplex: 256 KiB window per stream) "
             "or TCP's window (REST); figures on the loaded dev VM are relative")
