"""The edge's own Aether service (dsec.edge.service, served by `dsec edge --listen ...`):
whoever reaches it can create, exec in, read and destroy every sandbox of the node, so
it must not answer an unauthenticated peer, and its Unix socket must not be open to
every local user."""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator

import pytest

from dsec.aether import connect
from dsec.edge.node import EdgeNode
from dsec.edge.service import EdgeClient, serve_edge
from dsec.errors import InvalidArgument, Unauthenticated
from dsec.wire.spec import SandboxSpec
from tests.edge.conftest import make_node


@pytest.fixture
async def node() -> AsyncIterator[EdgeNode]:
    n = make_node(node_id="sec-edge")
    await n.start()
    try:
        yield n
    finally:
        await n.close()


async def test_edge_refuses_an_unauthenticated_tcp_peer(node: EdgeNode) -> None:
    with pytest.raises(InvalidArgument, match="without a token"):
        await serve_edge(node, "tcp:127.0.0.1:0")  # no open TCP edge by accident
    server = await serve_edge(node, "tcp:127.0.0.1:0", token=os.urandom(32))
    try:
        with pytest.raises(Unauthenticated):  # EdgeClient.connect asks the node's protocol
            await EdgeClient.connect(str(server.address), timeout=10)
        # a raw connection that skips that: every method is still refused
        stranger = EdgeClient(await connect(str(server.address)), timeout=10,
                              owns_connection=True)
        try:
            with pytest.raises(Unauthenticated):
                await stranger.create(SandboxSpec())
            with pytest.raises(Unauthenticated):
                await stranger.list()
        finally:
            await stranger.close()
        assert node.live_count == 0
    finally:
        await server.close()


async def test_edge_unix_socket_is_not_world_accessible(node: EdgeNode, tmp_path: object) -> None:
    old = os.umask(0o022)  # a typical service umask
    try:
        path = os.path.join(str(tmp_path), "edge.sock")
        server = await serve_edge(node, f"unix:{path}")
    finally:
        os.umask(old)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode & 0o002 == 0, f"edge socket {path} is world-writable ({oct(mode)})"
    finally:
        await server.close()
