"""The edge door of exposed ports, on real container sandboxes: ``port_connect`` tunnels
(Aether duplex streams into the sandbox's network namespace) and what bounds them —
connections per sandbox, idle tunnels, a stale generation, closing the port, destroying
the sandbox — and exposed ports surviving an edge restart (journaled before answered)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import pytest

from dsec.bench.faults._edge import EdgeProcess
from dsec.edge.admission import Capacity
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.client import EdgeClient
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.edge.service import serve_edge
from dsec.errors import NotFound, RateLimited, StreamReset
from dsec.wire import ops
from dsec.wire.ports import PortConnect, PortExpose, PortRef
from dsec.wire.spec import ExecRequest, SandboxSpec

from .conftest import _cleanup

pytestmark = pytest.mark.root

SPEC = SandboxSpec(backend="container", memory_bytes=256 << 20, pids_max=256)
GET = b"GET / HTTP/1.0\r\n\r\n"


@dataclass
class Edge:
    node: EdgeNode
    client: EdgeClient
    backend: ContainerBackend


def _cfg(tmp_path: object) -> NodeConfig:
    return NodeConfig(node_id="t1", capacity=Capacity(cpu_milli=64_000, memory_bytes=64 << 30,
                                                      max_sandboxes=64),
                      state_dir=os.path.join(str(tmp_path), "state"),
                      max_tunnels_per_sandbox=3, tunnel_idle_s=0.5)


@pytest.fixture
async def edge(tmp_path: object, images_dir: str,
               request: pytest.FixtureRequest) -> AsyncIterator[Edge]:
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    backend = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                               images=DirectoryImages(images_dir))
    cfg = _cfg(tmp_path)
    cfg = replace(cfg, **getattr(request, "param", {}))   # indirect: NodeConfig fields
    node = EdgeNode(cfg, backend)
    await node.start()
    server = await serve_edge(node, f"unix:{tmp_path}/edge.sock")
    client = await EdgeClient.connect(f"unix:{tmp_path}/edge.sock")
    try:
        yield Edge(node, client, backend)
    finally:
        await client.close()
        await server.close()
        await node.close()
        await _cleanup(backend)


async def _httpd(node: EdgeNode, sid: str, port: int = 8000) -> None:
    r = await node.exec(sid, ExecRequest(
        shell=f"mkdir -p /tmp/w && echo in-{sid[-6:]} > /tmp/w/index.html && "
              f"httpd -p 127.0.0.1:{port} -h /tmp/w", timeout_s=10))
    assert r.exit_code == 0, r


async def _get(e: Edge, sid: str, gen: int, port: int = 8000) -> bytes:
    s = e.client.tunnel(ops.PORT_CONNECT, PortConnect(id=sid, port=port, generation=gen))
    await s.send(GET)
    out = bytearray()
    async with asyncio.timeout(10):
        async for chunk in s:
            out += chunk
    return bytes(out)


async def test_a_tunnel_reaches_a_loopback_server_and_a_stale_generation_does_not(
        edge: Edge) -> None:
    sid = (await edge.node.create(SPEC)).id
    await _httpd(edge.node, sid)
    rec = await edge.client.port_expose(PortExpose(id=sid, port=8000))
    assert (await edge.client.port_expose(PortExpose(id=sid, port=8000))) == rec  # idempotent
    got = await _get(edge, sid, rec.generation)
    assert got.startswith(b"HTTP/1.1 200") and got.endswith(f"in-{sid[-6:]}\n".encode())
    with pytest.raises(NotFound, match="closed and exposed again since"):
        await _get(edge, sid, rec.generation + 2)
    with pytest.raises(NotFound, match="port 8001 .* is not exposed"):
        await _get(edge, sid, rec.generation, port=8001)


async def test_connections_per_sandbox_are_capped_and_idle_ones_closed(edge: Edge) -> None:
    sid = (await edge.node.create(SPEC)).id
    other = (await edge.node.create(SPEC)).id
    await _httpd(edge.node, sid)
    await _httpd(edge.node, other)
    gen = (await edge.client.port_expose(PortExpose(id=sid, port=8000))).generation
    ogen = (await edge.client.port_expose(PortExpose(id=other, port=8000))).generation
    # three tunnels that send nothing: the cap (3) is reached
    held = [edge.client.tunnel(ops.PORT_CONNECT, PortConnect(id=sid, port=8000,
                                                             generation=gen))
            for _ in range(3)]
    await asyncio.sleep(0.1)
    assert sum(len(r.tunnels) for r in [edge.node._live[sid]]) == 3
    with pytest.raises(RateLimited, match=r"3 open connections .* \(the limit is 3\)"):
        await _get(edge, sid, gen)
    # another sandbox is not affected
    assert (await _get(edge, other, ogen)).startswith(b"HTTP/1.1 200")
    # idle tunnels (0.5 s here) are closed by the edge: the held ones end
    async with asyncio.timeout(10):
        for s in held:
            assert await s.recv() == b""
            await s.result()
    assert not edge.node._live[sid].tunnels
    assert (await _get(edge, sid, gen)).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("edge", [{"tunnel_idle_s": 300.0, "tunnel_open_idle_s": 0.5}],
                         indirect=True)
async def test_a_tunnel_that_moved_no_byte_is_reclaimed_sooner(edge: Edge) -> None:
    """Red team 14 item 5: a client opening tunnels and sending nothing holds a place of
    the sandbox's cap for ``tunnel_open_idle_s`` (30 s by default), not the 300 s a
    tunnel that moved bytes may pause for."""
    sid = (await edge.node.create(SPEC)).id
    await _httpd(edge.node, sid)
    gen = (await edge.client.port_expose(PortExpose(id=sid, port=8000))).generation
    used = edge.client.tunnel(ops.PORT_CONNECT, PortConnect(id=sid, port=8000,
                                                            generation=gen))
    await used.send(b"GET / HT")                # bytes moved: the 300 s limit applies
    unused = edge.client.tunnel(ops.PORT_CONNECT, PortConnect(id=sid, port=8000,
                                                              generation=gen))
    async with asyncio.timeout(10):
        assert await unused.recv() == b""
        await unused.result()
    await asyncio.sleep(0.5)
    assert len(edge.node._live[sid].tunnels) == 1, edge.node._live[sid].tunnels
    used.reset("done")


async def test_closing_the_port_or_destroying_the_sandbox_cuts_its_tunnels(
        edge: Edge) -> None:
    sid = (await edge.node.create(SPEC)).id
    await _httpd(edge.node, sid)
    gen = (await edge.client.port_expose(PortExpose(id=sid, port=8000))).generation
    s = edge.client.tunnel(ops.PORT_CONNECT, PortConnect(id=sid, port=8000, generation=gen))
    await s.send(b"GET / HTTP/1.1\r\nHost: x\r\n")      # an unfinished request: held open
    await asyncio.sleep(0.1)
    await edge.client.call(ops.PORT_CLOSE, PortRef(id=sid, port=8000))
    with pytest.raises(StreamReset, match=f"port 8000 of sandbox {sid} was closed"):
        async with asyncio.timeout(10):
            await s.result()
    assert not edge.node._live[sid].tunnels
    gen = (await edge.client.port_expose(PortExpose(id=sid, port=8000))).generation
    s = edge.client.tunnel(ops.PORT_CONNECT, PortConnect(id=sid, port=8000, generation=gen))
    await s.send(b"GET / HTTP/1.1\r\nHost: x\r\n")
    await asyncio.sleep(0.1)
    await edge.node.destroy(sid)
    with pytest.raises(StreamReset, match=f"sandbox {sid} ended"):
        async with asyncio.timeout(10):
            await s.result()


async def test_an_exposed_port_survives_kill_9_of_the_edge(tmp_path: object,
                                                           images_dir: str) -> None:
    """Answered = journaled: kill -9 the edge process right after port_expose answers; the
    restarted edge lists the port with the same generation, so URLs made from it work."""
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    e = EdgeProcess(os.path.join(str(tmp_path), "edge"), images_dir)
    try:
        await e.start()
        async with await e.client() as c:
            sid = (await c.create(SPEC)).id
            rec = await c.port_expose(PortExpose(id=sid, port=8000))
            e.kill9()
        await e.start()
        async with await e.client() as c:
            assert (await c.port_list(sid)).items == [rec]
            await c.call(ops.PORT_CLOSE, PortRef(id=sid, port=8000))
            e.kill9()
        await e.start()
        async with await e.client() as c:
            assert (await c.port_list(sid)).items == []
    finally:
        await e.wipe()
