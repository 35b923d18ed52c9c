"""kill -9 of the apiserver (``dsec up``) while SDK creates that pass a whole spec
(``create(spec=...)`` and ``create_many([spec, ...])``, over http and over aether) are in
flight; the same apiserver is started again on the same state dir and ports. Every create
must answer with exactly one sandbox: counted by label, none lost (a create that raised),
none twice (a second sandbox for one request)."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from typing import Any

import httpx
import pytest

from dsec.bench.faults.recovery import _Up
from dsec.wire.spec import SandboxSpec


def _count(up: _Up, label: str) -> dict[str, int]:
    r = httpx.get(f"{up.url}/v1/sandboxes", params={"label": f"rt={label}", "limit": 1000},
                  headers={"authorization": f"Bearer {up.key}"}, timeout=30)
    r.raise_for_status()
    out: dict[str, int] = {}
    for item in r.json()["items"]:
        i = item["spec"]["labels"]["i"]
        out[i] = out.get(i, 0) + 1
    return out


@pytest.mark.parametrize("kill_after_s", [0.3, 0.8])
def test_spec_creates_across_an_apiserver_kill9_make_each_sandbox_once(
        kill_after_s: float) -> None:
    from dsec.client.sync import Client

    state = tempfile.mkdtemp(prefix="rt13-kill9-")
    up = _Up(os.path.join(state, "state"))
    label = os.urandom(4).hex()
    results: dict[str, Any] = {}
    try:
        up.start()

        def one(i: int, protocol: str) -> None:
            spec = SandboxSpec(labels={"rt": label, "i": str(i)}, cpu_milli=500,
                               priority=3, env={"K": "v"})
            try:
                with Client(up.url, up.key, protocol=protocol, gateway=up.gateway,
                            session_lease_s=None, timeout=30, create_retry_s=120) as c:
                    results[str(i)] = c.sandboxes.create(spec=spec, detached=True).id
            except Exception as exc:  # noqa: BLE001 - counted as lost
                results[str(i)] = exc

        def many(base: int, protocol: str) -> None:
            specs = [SandboxSpec(labels={"rt": label, "i": str(base + j)}) for j in range(4)]
            try:
                with Client(up.url, up.key, protocol=protocol, gateway=up.gateway,
                            session_lease_s=None, timeout=30, create_retry_s=120) as c:
                    for j, sb in enumerate(c.sandboxes.create_many(specs, detached=True)):
                        results[str(base + j)] = sb.id
            except Exception as exc:  # noqa: BLE001
                for j in range(4):
                    results[str(base + j)] = exc
        threads = [threading.Thread(target=one, args=(i, "http" if i % 2 else "aether"))
                   for i in range(6)]
        threads += [threading.Thread(target=many, args=(100, "http")),
                    threading.Thread(target=many, args=(200, "aether"))]
        for t in threads:
            t.start()
        time.sleep(kill_after_s)
        up.kill9()
        up.start()
        for t in threads:
            t.join(300)
        want = {str(i) for i in range(6)} | {str(b + j) for b in (100, 200) for j in range(4)}
        lost = {k: repr(v)[:200] for k, v in results.items() if isinstance(v, Exception)}
        deadline = time.monotonic() + 30
        counts = _count(up, label)
        while time.monotonic() < deadline and set(counts) != want:
            time.sleep(0.3)
            counts = _count(up, label)
        twice = {k: n for k, n in counts.items() if n > 1}
        missing = sorted(want - set(counts))
        assert not lost and not twice and not missing, (
            f"lost (create raised): {lost}; made twice: {twice}; no sandbox: {missing}")
    finally:
        up.stop()
        shutil.rmtree(state, ignore_errors=True)
