"""``create_many`` across kill -9 of `dsec up` (the apiserver and, with it, its edges'
supervisor): the batch must succeed once the restarted apiserver answers, and exactly
the sandboxes it returned may exist afterwards. Before, a batch carried no
Idempotency-Keys and was never retried: the caller got ConnectionLost while the
sandboxes the first attempt made lived on (bound to the caller's session, renewed for as
long as the client ran, or until their 6 h TTL), and the caller's retry made them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from dsec import Client
from dsec.edge.service import EdgeClient
from tests.client.test_crash_recovery import Up, _listed


async def _on_edge(sock: str, run: str) -> int:
    async with await EdgeClient.connect(f"unix:{sock}") as edge:
        return sum(1 for i in await edge.list() if i.spec.labels.get("run") == run)


@pytest.mark.parametrize("transport", ["http", "aether"])
def test_create_many_across_a_kill_9_of_the_apiserver_makes_each_sandbox_once(
        tmp_path: Path, transport: str) -> None:
    up = Up(tmp_path / "state")
    up.start()
    try:
        run = uuid.uuid4().hex[:8]
        out: dict[str, Any] = {}

        def batch() -> None:
            try:
                with Client(up.url, up.key, protocol=transport,
                            gateway=f"tcp:127.0.0.1:{up.gw_port}", timeout=10,
                            create_retry_s=120) as c:
                    out["made"] = [s.id for s in c.sandboxes.create_many(
                        6, labels={"run": run}, memory="16MiB", cpu=0.01)]
            except BaseException as exc:  # noqa: BLE001 - asserted below
                out["error"] = exc

        t = threading.Thread(target=batch, daemon=True)
        t.start()
        sock = os.path.join(up.state_dir, "edges", "edge-0.sock")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:   # the batch is on the edge (0.9 s creates)
            with contextlib.suppress(Exception):   # not serving yet
                if asyncio.run(_on_edge(sock, run)):
                    break
            time.sleep(0.02)
        up.kill9()
        up.start()
        t.join(timeout=240)
        assert not t.is_alive(), "create_many hung"
        assert "error" not in out, repr(out.get("error"))
        made = out["made"]
        assert len(made) == len(set(made)) == 6
        deadline = time.monotonic() + 30
        while True:                           # the registry rebuilds from heartbeats
            listed = _listed(up, run)
            if set(made) <= listed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert listed == set(made), (sorted(listed), sorted(made))
    finally:
        up.stop()
