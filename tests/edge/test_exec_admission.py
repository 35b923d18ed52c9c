"""Commands running at once are bounded per sandbox and per node (issue 12, red team).

Each running command holds file descriptors of the edge process (output pipes, stdin,
a pidfd). A member key running 600 ``sleep``s in its own sandbox took every fd of a
``dsec up`` process (RLIMIT_NOFILE 1024) and other tenants' execs and creates failed
with EMFILE (500 ``backend_error``). Beyond the caps an exec is refused at once with a
clear, retryable error; the others keep working.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsec.edge.admission import Capacity
from dsec.edge.backends import make_backend
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.errors import CapacityExceeded, InvalidArgument, RateLimited
from dsec.wire.spec import ExecRequest, SandboxSpec


async def test_execs_beyond_the_per_sandbox_and_node_caps_are_refused_clearly() -> None:
    node = EdgeNode(NodeConfig(node_id="e0", capacity=Capacity(
        cpu_milli=10**6, memory_bytes=1 << 40, max_sandboxes=10),
        max_execs=8, max_execs_per_sandbox=3), {"simulated": make_backend("simulated")})
    await node.start()
    try:
        a1, a2, a3 = [(await node.create(SandboxSpec(image="base", project="team/x"))).id
                      for _ in range(3)]
        b1, b2, b3 = [(await node.create(SandboxSpec(image="base", project="other"))).id
                      for _ in range(3)]
        nap = ExecRequest(argv=("sleep", "0.5"))
        quick = ExecRequest(argv=("true",))
        # per sandbox: min(3, 8 // 4) = 2
        running = [asyncio.ensure_future(node.exec(a1, nap)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(RateLimited, match=f"sandbox {a1} already runs 2 commands"):
            await node.exec(a1, quick)
        # per tenant (top-level project, sub-projects together): 8 // 2 = 4
        running += [asyncio.ensure_future(node.exec(a2, nap)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(RateLimited, match="project team already runs 4 commands"):
            await node.exec(a3, quick)
        # another tenant still gets in, up to the node's cap of 8 (it may take 4)
        running += [asyncio.ensure_future(node.exec(b, nap)) for b in (b1, b1, b2, b2)]
        await asyncio.sleep(0.05)
        assert node._execs == 8
        with pytest.raises((CapacityExceeded, RateLimited)):
            await node.exec(b3, quick)
        with pytest.raises((CapacityExceeded, RateLimited)):
            async for _ in node.exec_stream(b3, quick):
                pass
        assert [r.exit_code for r in await asyncio.gather(*running)] == [0] * 8
        # the slots came back, also after refusals
        assert (await node.exec(a3, quick)).exit_code == 0
        assert node._execs == 0 and not node._execs_by_tenant
    finally:
        await node.close()


def test_exec_caps_refuse_nonsense() -> None:
    cap = Capacity(cpu_milli=1, memory_bytes=1, max_sandboxes=1)
    with pytest.raises(InvalidArgument, match="max_execs=0"):
        NodeConfig(node_id="e0", capacity=cap, max_execs=0)
    with pytest.raises(InvalidArgument, match="max_execs_per_sandbox=0"):
        NodeConfig(node_id="e0", capacity=cap, max_execs_per_sandbox=0)
    NodeConfig(node_id="e0", capacity=cap, max_execs=None, max_execs_per_sandbox=None)


_UP = ("import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)); "
       "from dsec.cli.main import main; sys.argv[0] = 'dsec'; main()")


@pytest.fixture
def up_container(tmp_path: Path) -> Iterator[dict[str, Any]]:
    if os.geteuid() != 0:
        pytest.skip("the container backend needs root")
    state = tmp_path / "state"
    proc = subprocess.Popen(
        [sys.executable, "-c", _UP, "up", "--state-dir", str(state), "--listen",
         "127.0.0.1:0", "--backend", "container", "--quiet"],
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (state / "local.json").exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "dsec up did not start"
            time.sleep(0.1)
        yield json.loads((state / "local.json").read_text())
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_a_tenant_running_hundreds_of_commands_cannot_take_the_nodes_fds(
        up_container: dict[str, Any]) -> None:
    from dsec.aether import connect

    up = up_container
    admin = {"authorization": f"Bearer {up['api_key']}"}
    async with httpx.AsyncClient(base_url=up["url"], headers=admin, timeout=60) as http:
        r = await http.post("/v1/keys", json={"name": "t", "project": "default",
                                              "role": "member"})
        key = r.json()["api_key"]
        r = await http.post("/v1/sandboxes", json={"project": "default",
                                                   "backend": "container"})
        assert r.status_code == 201, r.text
        victim = r.json()["id"]
        r = await http.post("/v1/sandboxes", json={"project": "default",
                                                   "backend": "container"},
                            headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 201, r.text
        mine = r.json()["id"]
        conn = await connect(up["gateway"], token=key)
        try:
            flood = asyncio.ensure_future(conn.call_batch(
                [("api.exec", {"id": mine,
                               "req": {"argv": ["sleep", "8"], "timeout_s": 30}})] * 600,
                timeout=60, return_exceptions=True))
            await asyncio.sleep(4)
            r = await http.post(f"/v1/sandboxes/{victim}/exec", json={"argv": ["echo", "ok"]})
            assert (r.status_code, r.json().get("stdout")) == (200, "ok\n"), r.text
            r = await http.post("/v1/sandboxes", json={"project": "default",
                                                       "backend": "container"})
            assert r.status_code == 201, r.text
            results = await flood
        finally:
            await conn.close()
        errors = [x for x in results if isinstance(x, Exception)]
        assert len(errors) < 600 and errors            # some ran, the rest were refused
        assert all(isinstance(e, (RateLimited, CapacityExceeded)) for e in errors), {
            f"{type(e).__name__}: {e}" for e in errors}
        r = await http.post(f"/v1/sandboxes/{victim}/exec", json={"argv": ["echo", "ok"]})
        assert r.status_code == 200, r.text


async def test_a_command_collects_no_more_output_than_its_reply_can_carry() -> None:
    """``output_cap_bytes`` may be up to 1 GiB (for exec_stream), but a reply is at most
    16 MiB: a plain exec collected all of it in the edge's memory (1 GB for one
    ``head -c 600M``) only to fail. Now it keeps ``max_reply_output_bytes`` per stream and
    flags the rest truncated; a stream still gets everything."""
    node = EdgeNode(NodeConfig(node_id="e0", capacity=Capacity(
        cpu_milli=10**6, memory_bytes=1 << 40, max_sandboxes=10),
        max_reply_output_bytes=1 << 20), {"simulated": make_backend("simulated")})
    await node.start()
    try:
        sid = (await node.create(SandboxSpec(image="base"))).id
        await node.write_file(sid, "/big", b"y" * (3 << 20))
        big = ExecRequest(argv=("cat", "/big"), output_cap_bytes=1 << 30)
        res = await node.exec(sid, big)
        assert (len(res.stdout), res.stdout_truncated) == (1 << 20, True)
        (one,) = await node.exec_many([(sid, big)])
        assert not isinstance(one, Exception)
        assert (len(one.stdout), one.stdout_truncated) == (1 << 20, True)
        got = 0
        async for item in node.exec_stream(sid, big):
            got += len(getattr(item, "data", b""))
        assert got == 3 << 20
    finally:
        await node.close()
