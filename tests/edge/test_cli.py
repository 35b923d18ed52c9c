"""``dsec edge`` as a real process: serve, survive a restart with its records, stop cleanly."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from dsec.edge.service import EdgeClient
from dsec.errors import ConnectFailed
from dsec.wire.spec import SandboxSpec

DSEC = [sys.executable, "-c", "from dsec.cli.main import main; main()"]


async def _start(sock: str, state: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(  # noqa: ASYNC220
        [*DSEC, "edge", "--listen", f"unix:{sock}",
         "--state-dir", state, "--node-id", "cli-node", "--max-sandboxes", "10",
         "--label", "zone=a", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    for _ in range(300):
        if proc.poll() is not None:
            raise AssertionError(f"dsec edge exited: {proc.stderr.read().decode()}")  # type: ignore[union-attr]
        if os.path.exists(sock):
            return proc
        await asyncio.sleep(0.02)
    proc.kill()
    raise AssertionError("dsec edge did not start listening")


def _stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    return proc.returncode


async def test_edge_cli_serves_and_restarts_with_its_records(tmp_path) -> None:  # type: ignore[no-untyped-def]
    sock, state = str(tmp_path / "edge.sock"), str(tmp_path / "state")
    proc = await _start(sock, state)
    try:
        async with await EdgeClient.connect(f"unix:{sock}", timeout=10) as c:
            info = await c.info()
            assert info.node == "cli-node" and info.labels == {"zone": "a"}
            a = await c.create(SandboxSpec(project="p1"))
            b = await c.create()
            await c.pause(b.id)
    finally:
        assert _stop(proc) == 0
    assert not os.path.exists(sock)
    proc = await _start(sock, state)
    try:
        async with await EdgeClient.connect(f"unix:{sock}", timeout=10) as c:
            assert {i.id: i.state for i in await c.list()} == {a.id: "running", b.id: "paused"}
            assert (await c.get(a.id)).spec.project == "p1"
            assert (await c.exec(b.id, "echo ok")).stdout == b"ok\n"
    finally:
        assert _stop(proc) == 0


def test_edge_cli_rejects_unknown_backend(tmp_path) -> None:  # type: ignore[no-untyped-def]
    r = subprocess.run([*DSEC, "edge", "--listen",
                        f"unix:{tmp_path}/s.sock", "--backend", "nosuch"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode != 0 and "unknown backend 'nosuch'" in r.stderr


async def test_client_to_missing_socket_is_a_typed_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConnectFailed):
        await EdgeClient.connect(f"unix:{tmp_path}/none.sock", timeout=1)


def test_backend_registry_errors_are_typed() -> None:
    from dsec.edge.backends import known_backends, make_backend
    from dsec.errors import InvalidArgument

    assert {"simulated", "fncall", "container"} <= set(known_backends())
    with pytest.raises(InvalidArgument, match="unknown backend 'bogus'"):
        make_backend("bogus")
    with pytest.raises(InvalidArgument, match="bad options for backend 'simulated'"):
        make_backend("simulated", nonsense=1)
    r = subprocess.run([*DSEC, "edge", "--listen", "unix:/tmp/x.sock", "--backend-opt", "x=1"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode != 0 and "BACKEND.KEY=VALUE" in r.stderr


async def test_edge_cli_qos_flags(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``dsec edge --qos-be-only batch --memory-pressure`` (issue 22): the edge door refuses
    qos 'ls' for batch/..., gives 'be' when unset, 'ls' elsewhere."""
    from dsec.errors import PermissionDenied

    sock, state = str(tmp_path / "edge.sock"), str(tmp_path / "state")
    proc = subprocess.Popen(  # noqa: ASYNC220
        [*DSEC, "edge", "--listen", f"unix:{sock}", "--state-dir", state, "--node-id",
         "qos-node", "--log-level", "warning", "--qos-be-only", "batch",
         "--memory-pressure"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(300):
            if proc.poll() is not None or os.path.exists(sock):
                break
            await asyncio.sleep(0.02)
        assert proc.poll() is None, proc.stderr.read().decode()  # type: ignore[union-attr]
        async with await EdgeClient.connect(f"unix:{sock}", timeout=10) as c:
            with pytest.raises(PermissionDenied, match="qos='ls' is refused on node qos-node"):
                await c.create(SandboxSpec(project="batch/evals", qos="ls"))
            assert (await c.create(SandboxSpec(project="batch/evals"))).spec.qos == "be"
            assert (await c.create(SandboxSpec(project="agents"))).spec.qos == "ls"
    finally:
        assert _stop(proc) == 0
