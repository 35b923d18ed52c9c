"""F6: the rollout worker asks the apiserver about every bearer key it has not seen
(``Worker._authorize`` -> ``_ask_apiserver``: a new client and a GET /v1/info per key).
Its own comment says "an unauthenticated flood must not become a flood of apiserver
calls", but the 5 s negative cache is per key: anyone who can reach the trainer API (TCP
listener by default) sends N distinct junk keys and makes N apiserver calls from the
worker's address (which the apiserver's per-address limits then hold against the worker:
the trainer's own re-checks are refused), and every 10,000 keys the cache is cleared,
valid entries included. Unknown keys must cost a bounded number of apiserver calls.

The apiserver is a stub on loopback that counts /v1/info calls and answers 401 (the
boundary this test is not about); the worker's auth code is the real one."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from dsec.errors import Unauthenticated
from dsec.rl.worker.server import Worker
from dsec.rl.worker.types import WorkerConfig


class _Counting(BaseHTTPRequestHandler):
    calls = 0

    def do_GET(self) -> None:
        type(self).calls += 1
        body = json.dumps({"code": "unauthenticated", "message": "unknown key",
                           "request_id": "stub"}).encode()
        self.send_response(401)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a: object) -> None:
        return None


def test_a_flood_of_junk_keys_is_not_a_flood_of_apiserver_calls(tmp_path: Path) -> None:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Counting)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        cfg = WorkerConfig(url=url, api_key="dsec-worker-key", project="p",
                           worker_id="w-red17")

        async def flood() -> int:
            w = Worker(cfg, str(tmp_path))
            refused = 0
            try:
                for i in range(60):
                    try:
                        await w._authorize(f"Bearer junk-{i:04d}", "reader")
                    except Unauthenticated:
                        refused += 1
            finally:
                await w.client.close()
                w.queue.close()
            return refused

        refused = asyncio.run(flood())
        assert refused == 60
        assert _Counting.calls <= 10, (
            f"60 requests with distinct junk keys made {_Counting.calls} apiserver calls "
            "from the worker")
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_flood_of_well_formed_junk_keys_costs_a_bounded_number_of_calls(
        tmp_path: Path) -> None:
    """Keys of the right shape pass the local check: the lookup budget bounds them (the
    rest get 429 at once), whatever the number of distinct keys."""
    import secrets

    from dsec.errors import RateLimited
    from dsec.rl.worker.auth import AuthLimits

    _Counting.calls = 0
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Counting)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        cfg = WorkerConfig(url=url, api_key="dsec-worker-key", project="p",
                           worker_id="w-red17")
        limits = AuthLimits()

        async def flood() -> tuple[int, int, float]:
            w = Worker(cfg, str(tmp_path))
            refused = limited = 0
            t0 = time.monotonic()
            try:
                for i in range(200):
                    key = f"dsk_{secrets.token_hex(8)}_{secrets.token_urlsafe(32)[:43]}"
                    try:
                        await w._authorize(f"Bearer {key}", "reader", f"10.0.0.{i % 50}")
                    except Unauthenticated:
                        refused += 1
                    except RateLimited:
                        limited += 1
            finally:
                await w.client.close()
                w.queue.close()
            return refused, limited, time.monotonic() - t0

        refused, limited, took = asyncio.run(flood())
        assert refused + limited == 200
        bound = limits.global_burst + limits.global_per_s * took + 1
        assert refused == _Counting.calls <= bound, (
            f"200 well-formed junk keys from 50 peers made {_Counting.calls} apiserver "
            f"calls in {took:.1f} s (budget {bound:.0f})")
    finally:
        srv.shutdown()
        srv.server_close()
