"""EdgeService and EdgeClient over a real Unix socket."""

from __future__ import annotations

import typing
from collections.abc import AsyncIterator

import pytest

from dsec.aether import Router, connect, serve
from dsec.edge.admission import Capacity
from dsec.edge.node import EdgeNode
from dsec.edge.service import EdgeClient, EdgeHandlers, EdgeService, serve_edge
from dsec.errors import (
    CapacityExceeded,
    InvalidArgument,
    InvalidTransition,
    NotFound,
    RemoteProtocolError,
    SandboxNotFound,
    Unsatisfiable,
    WrongNode,
)
from dsec.wire import ops
from dsec.wire.calls import Empty, ExecCall, ExecMany, SandboxRef
from dsec.wire.node import EDGE_PROTOCOL, NodeInfo, Resources
from dsec.wire.ops import EDGE_OPS, StreamOp
from dsec.wire.outcome import Batch
from dsec.wire.spec import ExecChunk, ExecRequest, ExecResult, SandboxSpec

from .conftest import make_node


@pytest.fixture
async def edge(tmp_path) -> AsyncIterator[tuple[EdgeNode, EdgeClient]]:  # type: ignore[no-untyped-def]
    node = make_node(capacity=Capacity(cpu_milli=8000, memory_bytes=2**40, max_sandboxes=4),
                     labels={"zone": "z1"})
    await node.start()
    server = await serve_edge(node, f"unix:{tmp_path}/edge.sock")
    client = await EdgeClient.connect(f"unix:{tmp_path}/edge.sock", timeout=10)
    try:
        yield node, client
    finally:
        await client.close()
        await server.close()
        await node.close()


async def test_every_operation_over_the_wire(edge: tuple[EdgeNode, EdgeClient]) -> None:
    _, c = edge
    info = await c.info()
    assert info.node == "n1" and sorted(info.methods) == sorted(op.edge_method for op in EDGE_OPS)
    sb = await c.create(image="py", labels={"k": "v"}, env={"A": "1"})
    assert sb.state == "running" and sb.spec.image == "py"
    r = await c.exec(sb.id, "env; echo $A", timeout_s=5)
    assert r.exit_code == 0 and b"A=1\n" in r.stdout
    r = await c.exec(sb.id, ["cat"], stdin=b"piped")
    assert r.stdout == b"piped"
    items = [x async for x in c.exec_stream(sb.id, "echo out; cat /nope")]
    assert items[:2] == [ExecChunk(stream="stdout", data=b"out\n"),
                         ExecChunk(stream="stderr", data=b"cat: /nope: No such file or directory\n")]
    assert isinstance(items[-1], ExecResult) and items[-1].exit_code == 1
    await c.mkdir(sb.id, "/workspace/d/e")
    await c.write_file(sb.id, "/workspace/d/e/f", "abc", mode=0o600)
    await c.write_file(sb.id, "/workspace/d/e/f", b"def", append=True)
    assert await c.read_file(sb.id, "/workspace/d/e/f") == b"abcdef"
    st = await c.stat(sb.id, "/workspace/d/e/f")
    assert (st.size, st.mode, st.type) == (6, 0o600, "file")
    assert [f.name for f in await c.list_dir(sb.id, "/workspace/d")] == ["e"]
    with pytest.raises(InvalidArgument, match="not empty"):
        await c.remove(sb.id, "/workspace/d")
    await c.remove(sb.id, "/workspace/d", recursive=True)
    with pytest.raises(NotFound):
        await c.read_file(sb.id, "/workspace/d/e/f")
    assert (await c.stats(sb.id)).disk_bytes == 0
    await c.pause(sb.id)
    assert (await c.get(sb.id)).state == "paused"
    assert (await c.resume(sb.id)).state == "running"
    assert [i.id for i in await c.list(labels={"k": "v"})] == [sb.id]
    assert await c.list(state="paused") == []
    hb = await c.heartbeat()
    assert hb.counts == {"running": 1} and hb.labels == {"zone": "z1"}
    final = await c.destroy(sb.id)
    assert final.state == "destroyed"
    evs = await c.events(sb.id)
    assert evs[-1].to_state == "destroyed" and evs[-1].reason == "requested"
    feed = await c.feed(0)
    assert feed.events[-1] == evs[-1]


async def test_batches_report_per_item(edge: tuple[EdgeNode, EdgeClient]) -> None:
    node, c = edge
    res = await c.create_many([SandboxSpec()] * 3 + [SandboxSpec(cpu_milli=0)] + [SandboxSpec()] * 3)
    ok = [r for r in res if not isinstance(r, Exception)]
    assert len(ok) == 4
    assert isinstance(res[3], InvalidArgument)
    assert sum(isinstance(r, CapacityExceeded) for r in res) == 2
    out = await c.exec_many([(ok[0].id, "echo a"), (ok[1].id, ["echo", "b"]),
                             ("sb-000000000000-n1", "true"), (ok[2].id, "exit 3")])
    assert out[0].stdout == b"a\n" and out[1].stdout == b"b\n"  # type: ignore[union-attr]
    assert isinstance(out[2], SandboxNotFound)
    assert out[3].exit_code == 3  # type: ignore[union-attr]
    gone = await c.destroy_many([ok[0].id, ok[0].id, "sb-000000000000-zz"])
    assert gone[0].state == "destroyed"  # type: ignore[union-attr]
    assert isinstance(gone[1], InvalidTransition) and isinstance(gone[2], WrongNode)
    assert node.pool.count == 3


async def test_errors_cross_the_wire_typed(edge: tuple[EdgeNode, EdgeClient]) -> None:
    _, c = edge
    with pytest.raises(WrongNode):
        await c.get("sb-000000000000-elsewhere")
    with pytest.raises(InvalidArgument, match="memory_bytes"):
        await c.create(memory_bytes=-1)
    with pytest.raises(InvalidArgument, match="timeout_s"):
        sb = await c.create()
        await c.exec(sb.id, "true", timeout_s=-1)
    with pytest.raises(InvalidArgument, match="either a SandboxSpec"):
        await c.create(SandboxSpec(), image="x")
    with pytest.raises(InvalidArgument, match="exactly one of argv"):
        await c.exec(sb.id, ExecRequest())
    with pytest.raises(CapacityExceeded) as ei:
        await c.create(cpu_milli=8_000)   # fits the node, not what is left of it
    assert ei.value.detail["short"] == {"cpu_milli": 1000}
    with pytest.raises(Unsatisfiable) as un:
        await c.create(cpu_milli=10_000)  # more than the whole node: never
    assert un.value.detail == {"field": "cpu_milli", "requested": 10_000, "most": 8_000,
                               "node": "node n1"}
    assert "cpu=10 cores is more than node n1 could ever hold" in str(un.value)


async def test_tcp_edge_requires_a_token(tmp_path: object) -> None:
    from dsec.errors import InvalidArgument, Unauthenticated

    async with make_node() as node:
        with pytest.raises(InvalidArgument, match="without a token"):
            await serve_edge(node, "tcp:127.0.0.1:0")
        server = await serve_edge(node, "tcp:127.0.0.1:0", token="t" * 32)
        try:
            with pytest.raises(Unauthenticated):
                await EdgeClient.connect(str(server.address), token="wrong-token-000000")
            # the client checks the edge's protocol on connect: without a token, that fails
            with pytest.raises(Unauthenticated):
                await EdgeClient.connect(str(server.address))
            anon = EdgeClient(await connect(str(server.address)), owns_connection=True)
            with pytest.raises(Unauthenticated):
                await anon.create(SandboxSpec())
            await anon.close()
            edge = await EdgeClient.connect(str(server.address), token="t" * 32)
            info = await edge.create(SandboxSpec())
            assert (await edge.get(info.id)).state == "running"
            await edge.close()
        finally:
            await server.close()


# ------------------------------------------------------------------ built from the table
def test_edge_handlers_match_rows() -> None:
    """One handler per edge row, named as the row, taking and answering the row's edge
    types; nothing else is public (an operation the table lacks cannot be served)."""
    rows = {op.name: op for op in EDGE_OPS}
    public = {n for n in vars(EdgeHandlers) if not n.startswith("_")}
    assert public == set(rows)
    for name, op in rows.items():
        hints = typing.get_type_hints(getattr(EdgeHandlers, name))
        body = next(k for k in hints if k not in ("return", "out"))
        assert hints[body] == op.edge_type, name
        want = type(None) if op.edge_reply_type is None else op.edge_reply_type
        assert hints["return"] == want, f"{name}: answers {hints['return']}, row says {want}"
        assert ("out" in hints) == isinstance(op, StreamOp), name


async def test_the_router_serves_exactly_the_edge_rows(
        edge: tuple[EdgeNode, EdgeClient]) -> None:
    node, c = edge
    assert EdgeService(node).router.methods == sorted(op.edge_method for op in EDGE_OPS)
    info = await c.call(ops.NODE_INFO, Empty())
    assert info.protocol == EDGE_PROTOCOL
    assert sorted(info.methods) == sorted(op.edge_method for op in EDGE_OPS)


async def test_call_takes_the_rows_own_types(edge: tuple[EdgeNode, EdgeClient]) -> None:
    _, c = edge
    sb = await c.create(SandboxSpec())
    res = await c.call(ops.EXEC, ExecCall(id=sb.id, req=ExecRequest(shell="echo hi")))
    assert res.stdout == b"hi\n"
    got = await c.call(ops.EXEC_MANY, ExecMany(calls=[
        ExecCall(id=sb.id, req=ExecRequest(argv=("true",))),
        ExecCall(id="sb-000000000000-n1", req=ExecRequest(argv=("true",)))]))
    assert isinstance(got, Batch)
    first, second = got.results()
    assert isinstance(first, ExecResult) and first.exit_code == 0
    assert isinstance(second, SandboxNotFound)
    assert (await c.call(ops.EVENTS, SandboxRef(id=sb.id))).items[0].to_state == "creating"
    # rows whose edge body is the control plane's (reason, chosen id, quota room) are
    # refused by call(): their named methods fill those in
    with pytest.raises(InvalidArgument, match="EdgeClient.destroy"):
        await c.call(ops.DESTROY, SandboxRef(id=sb.id))
    assert (await c.get(sb.id)).state == "running"


async def test_an_edge_request_with_an_unknown_field_is_refused(
        edge: tuple[EdgeNode, EdgeClient]) -> None:
    """A field this edge does not know (a newer control plane's new limit, say) is an
    error naming it, never silently dropped."""
    _, c = edge
    sb = await c.create(SandboxSpec())
    with pytest.raises(InvalidArgument, match="unknown field `surprise`"):
        await c.conn.call("edge.exec", {"id": sb.id, "req": {"argv": ["true"]},
                                        "surprise": 1}, response_type=ExecResult)
    with pytest.raises(InvalidArgument, match="unknown field `max_bytes`"):
        await c.conn.call("edge.mkdir", {"id": sb.id, "path": "/tmp/x", "max_bytes": 1})


async def test_an_edge_of_another_release_is_refused_on_connect(tmp_path: object) -> None:
    """Version skew fails at connect with both versions named, not on the first body
    the other side misreads."""
    newer, older = Router(), Router()
    newer.add("edge.node_info", lambda b: NodeInfo(
        node="e9", backends=[], capacity=Resources(), labels={}, methods=[],
        protocol=EDGE_PROTOCOL + 1))
    older.add("edge.info", lambda b: None)   # before the catalogue: no edge.node_info
    skew = (f"edge e9 at .* speaks edge protocol {EDGE_PROTOCOL + 1}, this dsec speaks "
            f"{EDGE_PROTOCOL}")
    for router, match in ((newer, skew), (older, "speaks an older edge protocol")):
        server = await serve(router, f"unix:{tmp_path}/skew.sock")
        try:
            with pytest.raises(RemoteProtocolError, match=match):
                await EdgeClient.connect(f"unix:{tmp_path}/skew.sock")
        finally:
            await server.close()


async def test_a_misspelt_spec_keyword_is_refused_not_dropped(
        edge: tuple[EdgeNode, EdgeClient]) -> None:
    """``create(imagee="python")`` used to make a default sandbox without a word."""
    node, c = edge
    with pytest.raises(InvalidArgument, match="unknown field `imagee`"):
        await c.create(imagee="python")
    assert node.live_count == 0
