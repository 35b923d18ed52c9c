"""``run_until_signalled``: the foreground start/signal/stop that ``dsec up`` and
``dsec apiserver`` share, run for real (an in-process simulated edge, REST on a loopback
port, the gateway off) and stopped by a real SIGTERM to this process."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsec.cluster.run import run_until_signalled
from dsec.cluster.runtime import ClusterConfig, ClusterRuntime
from dsec.errors import InvalidArgument


def _config(tmp_path: Path, **kw: object) -> ClusterConfig:
    opts: dict[str, object] = {"edges": 1, **kw}
    return ClusterConfig(state_dir=str(tmp_path / "state"), listen="127.0.0.1:0",
                         gateway=None, edge_processes=False, write_local=False,
                         cpu_milli=4000, memory_bytes=8 << 30, **opts)  # type: ignore[arg-type]


async def test_sigterm_stops_it_after_stopping_ran_and_destroys_the_sandboxes(
        tmp_path: Path) -> None:
    seen: list[str] = []
    handler_before = signal.getsignal(signal.SIGTERM)

    def started(rt: ClusterRuntime) -> None:
        seen.append("started")
        asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGTERM)

    async def serve(rt: ClusterRuntime, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(base_url=rt.url, headers={
                "authorization": f"Bearer {rt.admin_key}"}) as http:
            r = await http.post("/v1/sandboxes", json={"image": "base"})
            assert r.status_code == 201, r.text
        seen.append("serving")
        await stop.wait()                   # the SIGTERM sets it
        seen.append("signalled")

    async def stopping(rt: ClusterRuntime) -> None:
        await rt.refresh()
        seen.append(f"stopping {sum(rt.status().values())}")
        nodes.extend(rt.nodes)

    nodes: list[Any] = []
    await asyncio.wait_for(run_until_signalled(
        _config(tmp_path), failed=lambda exc: seen.append(f"failed {exc}"), started=started,
        serve=serve, stopping=stopping), 60)
    assert seen == ["started", "serving", "signalled", "stopping 1"]
    # stopped: every sandbox destroyed (no keep), the edge closed
    (node,) = nodes
    assert [i.state for i in node.list()] in ([], ["destroyed"])
    # the handlers it installed are gone: SIGTERM is what it was before
    assert signal.getsignal(signal.SIGTERM) == handler_before


async def test_a_start_that_fails_is_reported_and_exits_1(tmp_path: Path) -> None:
    failures: list[Exception] = []
    with pytest.raises(SystemExit) as exit_:
        await run_until_signalled(
            _config(tmp_path, edges=0, join=False),  # no edge at all: refused
            failed=failures.append, started=lambda rt: pytest.fail("started"))
    assert exit_.value.code == 1
    assert len(failures) == 1 and isinstance(failures[0], InvalidArgument)
    assert "edges=0 must be within 1..64" in str(failures[0])
