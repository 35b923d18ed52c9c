"""kill -9 of the edge process while spec-passthrough creates (single and batched, over
http and aether, each with its own idempotency key from the SDK) are in flight; its
supervisor restarts it and it re-adopts its journal. Count per request: none lost, none
made twice."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from dsec.cluster.local import LocalCluster
from dsec.wire.spec import SandboxSpec


@pytest.mark.parametrize("kill_after_s", [0.3, 0.7])
def test_spec_creates_across_an_edge_kill9_make_each_sandbox_once(kill_after_s: float) -> None:
    with LocalCluster(edges=1, edge_processes=True,
                      simulated_profile="paper-microvm") as cl:
        results: dict[str, Any] = {}
        label = f"e{int(kill_after_s * 10)}"

        def one(i: int, protocol: str) -> None:
            spec = SandboxSpec(labels={"rt": label, "i": str(i)}, priority=1)
            try:
                with cl.client(protocol=protocol, session_lease_s=None,
                               create_retry_s=120) as c:
                    results[str(i)] = c.sandboxes.create(spec=spec, detached=True).id
            except Exception as exc:  # noqa: BLE001
                results[str(i)] = exc

        def many(base: int, protocol: str) -> None:
            specs = [SandboxSpec(labels={"rt": label, "i": str(base + j)}) for j in range(3)]
            try:
                with cl.client(protocol=protocol, session_lease_s=None,
                               create_retry_s=120) as c:
                    for j, sb in enumerate(c.sandboxes.create_many(specs, detached=True)):
                        results[str(base + j)] = sb.id
            except Exception as exc:  # noqa: BLE001
                for j in range(3):
                    results[str(base + j)] = exc
        threads = [threading.Thread(target=one, args=(i, "http" if i % 2 else "aether"))
                   for i in range(6)]
        threads += [threading.Thread(target=many, args=(100, "http")),
                    threading.Thread(target=many, args=(200, "aether"))]
        for t in threads:
            t.start()
        time.sleep(kill_after_s)
        cl.kill_edge("edge-0")
        for t in threads:
            t.join(300)
        want = {str(i) for i in range(6)} | {str(b + j) for b in (100, 200) for j in range(3)}
        lost = {k: repr(v)[:240] for k, v in results.items() if isinstance(v, Exception)}
        with cl.client(protocol="http", session_lease_s=None) as c:
            counts: dict[str, int] = {}
            deadline = time.monotonic() + 30
            while True:
                counts = {}
                for sb in c.sandboxes.list(labels={"rt": label}):
                    if sb.info.state in ("running", "creating", "paused"):
                        i = sb.info.spec.labels["i"]
                        counts[i] = counts.get(i, 0) + 1
                if set(counts) >= want or time.monotonic() > deadline:
                    break
                time.sleep(0.3)
        twice = {k: n for k, n in counts.items() if n > 1}
        missing = sorted(want - set(counts) - set(lost))
        assert not lost and not twice and not missing, (
            f"lost (create raised): {lost}; made twice: {twice}; acknowledged but not "
            f"listed: {missing}")
