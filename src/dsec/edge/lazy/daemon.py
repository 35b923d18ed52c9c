"""The lazy-layer FUSE daemon's process: ``python -m dsec.edge.lazy.daemon ...``.

Started and watched by the edge (:class:`dsec.edge.lazy.layers.LazyLayers`). It mounts
:class:`~dsec.edge.lazy.fs.LazyFs` at ``--mount``, prints ``{"ev": "ready"}`` on stdout
once the mount answers, and then takes one JSON command per line on stdin::

    {"cmd": "prefetch", "layer": HEX, "chunks": [i, ...]}   background fetch
    {"cmd": "pin", "layer": HEX}                              fetch all, never evict
    {"cmd": "unpin", "layer": HEX}                            evictable again
    {"cmd": "stats"}                                          write the stats file now

and reports on stdout (``fetch_failed``, ``prefetched``, ``trace``, ``stats``). EOF on
stdin (the edge went away, also by kill -9: the kernel closes its end of the pipe) unmounts
and exits, so a daemon never outlives its edge. Not ``PR_SET_PDEATHSIG``: that fires when
the *thread* that forked the child exits, and the edge restarts a dead daemon from a
watcher thread that ends right after (every restarted daemon was SIGKILLed at once). A
killed daemon's FUSE connection is aborted by the kernel as its /dev/fuse fd closes, so
every read waiting on it fails with an error instead of hanging (tested).

pyfuse3 over libfuse3 was chosen over a C daemon: the fetch path (blob store clients:
file, S3, HTTP; retries; per-chunk verification) is dsec's Python code, and the measured
cost of serving cached chunks from Python is recorded in :mod:`dsec.edge.lazy.layers`.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any

import pyfuse3
import trio

from dsec.edge.lazy.fs import FsConfig, LazyFs
from dsec.image.blob import open_blobstore

__all__ = ["main"]

def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dsec-lazy-daemon")
    p.add_argument("--mount", required=True)
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--blob-store", required=True)
    p.add_argument("--cache-bytes", type=int, default=None)
    p.add_argument("--retry-budget-s", type=float, default=10.0)
    p.add_argument("--max-inflight", type=int, default=8)
    p.add_argument("--max-run-chunks", type=int, default=16)
    p.add_argument("--trace-window-s", type=float, default=5.0)
    p.add_argument("--breaker-failures", type=int, default=3)
    p.add_argument("--breaker-open-s", type=float, default=2.0)
    p.add_argument("--breaker-max-open-s", type=float, default=10.0)
    p.add_argument("--stats", default=None)
    p.add_argument("--workers", type=int, default=32)
    # Idle workers kept (--workers) and the most at once: a read waiting on a fetch holds
    # its worker, so there must be more workers than waiting reads (FsConfig
    # max_waiting_reads) for reads of cached chunks to be answered (red team 17 F11).
    p.add_argument("--max-workers", type=int, default=1024)
    return p.parse_args(argv)


async def _pin(fs: LazyFs, hx: str) -> None:
    await fs.prefetch(hx, None, pin=True)


async def _commands(fs: LazyFs, nursery: trio.Nursery) -> None:
    stdin = trio.lowlevel.FdStream(0)
    buf = b""
    while True:
        data = await stdin.receive_some(65536)
        if not data:
            break
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                cmd: dict[str, Any] = json.loads(line)
            except ValueError:
                continue
            c = cmd.get("cmd")
            if c == "prefetch":
                nursery.start_soon(fs.prefetch, str(cmd["layer"]), list(cmd.get("chunks", [])))
            elif c == "pin":
                nursery.start_soon(_pin, fs, str(cmd["layer"]))
            elif c == "unpin":
                fs.lru.pinned.discard(str(cmd["layer"]))
            elif c == "stats":
                fs.write_stats()
                print(json.dumps({"ev": "stats", "seq": cmd.get("seq")}), flush=True)
    nursery.cancel_scope.cancel()


async def _run(fs: LazyFs, workers: int, max_workers: int) -> None:
    async with trio.open_nursery() as n:
        n.start_soon(fs.stats_loop)
        n.start_soon(fs.trace_loop)
        n.start_soon(_commands, fs, n)
        print(json.dumps({"ev": "ready"}), flush=True)
        await pyfuse3.main(min_tasks=workers, max_tasks=max(workers, max_workers))


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    fs = LazyFs(open_blobstore(args.blob_store),
                FsConfig(cache_dir=args.cache_dir, cache_bytes=args.cache_bytes,
                         retry_budget_s=args.retry_budget_s, max_inflight=args.max_inflight,
                         max_run_chunks=args.max_run_chunks,
                         trace_window_s=args.trace_window_s, stats_path=args.stats,
                         breaker_failures=args.breaker_failures,
                         breaker_open_s=args.breaker_open_s,
                         breaker_max_open_s=max(args.breaker_open_s,
                                                args.breaker_max_open_s)))
    opts = set(pyfuse3.default_options)
    opts |= {"fsname=dsec-lazy", "subtype=dsec", "ro"}
    pyfuse3.init(fs, args.mount, opts)
    # SIGTERM: leave the main loop and unmount (pyfuse3.terminate is its clean exit)
    signal.signal(signal.SIGTERM, lambda *_: pyfuse3.terminate())
    try:
        trio.run(_run, fs, args.workers, args.max_workers)
    finally:
        pyfuse3.close(unmount=True)
        fs.close()


if __name__ == "__main__":
    main(sys.argv[1:])
