"""The edge door walks the catalogue: every row with the edge door is served, answers
its row's edge reply type, and refuses a past-the-limit raw body with the request
type's own error (the words a request built in-process gets). Over a real Unix socket,
raw Aether calls (what any peer may send), not EdgeClient sugar."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest

from dsec.aether import Connection, connect
from dsec.edge.node import EdgeNode
from dsec.edge.service import serve_edge
from dsec.errors import DsecError, InvalidArgument
from dsec.image import LayerStore
from dsec.wire import ops
from dsec.wire.calls import ExecCall, FileRef, NetworkUpdateOnNode, ReadFile, WriteFile
from dsec.wire.files import ReadStream, Rename, Watch, WriteStream
from dsec.wire.layers import MAX_MANIFEST_BYTES, LayerPut, LayerRef
from dsec.wire.lifetime import SetTimeout
from dsec.wire.netpolicy import MAX_NET_RULES, NetworkPolicy
from dsec.wire.ops import EDGE_OPS, Op, StreamOp, TunnelOp
from dsec.wire.ports import PortExpose, PortRef
from dsec.wire.process import ProcessInput, ProcessSignal, PtyResize
from dsec.wire.spec import (
    MAX_PATH_BYTES,
    MAX_PROCESS_INPUT_BYTES,
    ExecRequest,
    PtySize,
    SandboxSpec,
)

from .conftest import make_node


@dataclass
class World:
    sid: str            # a running sandbox
    spare: str          # a sandbox the destroy row takes
    snap: str           # a snapshot of `sid`
    spare_snap: str     # a snapshot of `spare` (nothing builds on it: deletable)
    keep: str = ""      # a sandbox no row destroys (the port rows come after destroy_many)
    port_gen: int = 0   # the generation of port 8000 of `keep`, once exposed
    layer: str = ""     # a layer in the node's store (the layer rows)
    manifest: bytes = b""   # its manifest, as a holder sends it
    pid: int = 0            # processes of `keep` (issue 19): an ended `echo`,
    stdin_pid: int = 0      # a `cat` with stdin open,
    sleep_pid: int = 0      # a `sleep` to signal,
    pty_pid: int = 0        # one on a terminal


Example = Callable[[World], dict[str, Any]]

# A valid raw body for each edge row.
EXAMPLES: dict[str, Example] = {
    "node_info": lambda w: {},
    "heartbeat": lambda w: {"include_sandboxes": True},
    "feed": lambda w: {"after": 0, "limit": 10},
    "create": lambda w: {"spec": {"image": "py"}},
    "create_many": lambda w: {"specs": [{}, {"cpu_milli": 0}]},
    "get": lambda w: {"id": w.sid},
    "list": lambda w: {"labels": {}},
    "events": lambda w: {"id": w.sid},
    "pause": lambda w: {"id": w.sid},
    "resume": lambda w: {"id": w.sid},
    "stats": lambda w: {"id": w.sid},
    "exec": lambda w: {"id": w.sid, "req": {"shell": "echo hi"}},
    "exec_many": lambda w: {"calls": [{"id": w.sid, "req": {"argv": ["true"]}}]},
    "exec_stream": lambda w: {"id": w.sid, "req": {"shell": "echo hi"}},
    "write_file": lambda w: {"id": w.sid, "path": "/tmp/f", "data": b"abc"},
    "read_file": lambda w: {"id": w.sid, "path": "/tmp/f"},
    "mkdir": lambda w: {"id": w.sid, "path": "/tmp/d/e"},
    "list_dir": lambda w: {"id": w.sid, "path": "/tmp"},
    "stat": lambda w: {"id": w.sid, "path": "/tmp/f"},
    "remove": lambda w: {"id": w.sid, "path": "/tmp/d", "recursive": True},
    "snapshot": lambda w: {"id": w.sid, "strip": []},
    "snapshots": lambda w: {"sandbox_id": w.sid},
    "snapshot_get": lambda w: {"id": w.snap},
    "snapshot_delete": lambda w: {"id": w.spare_snap},
    "destroy": lambda w: {"id": w.spare, "reason": "requested"},
    "destroy_many": lambda w: {"ids": [w.sid]},
    "node_pins": lambda w: {"images": [], "gen": 0},
    "layer_grant": lambda w: {"manifests": [w.manifest]},
    "network_get": lambda w: {"id": w.sid},
    "network_update": lambda w: {"id": w.sid, "policy": {"mode": "policy",
                                                          "allow": ["pypi.org:443"]},
                                 "expect_generation": 1, "ceiling_deny": ["203.0.113.0/24"]},
    "port_expose": lambda w: {"id": w.keep, "port": 8000},
    "port_list": lambda w: {"id": w.keep},
    "port_connect": lambda w: {"id": w.keep, "port": 8000, "generation": w.port_gen},
    "port_close": lambda w: {"id": w.keep, "port": 8000},
    "layer_chain": lambda w: {"digest": w.layer},
    "layer_get": lambda w: {"digest": w.layer},
    "layer_put": lambda w: {"manifest": w.manifest},
    "file_read_stream": lambda w: {"id": w.sid, "path": "/tmp/f"},
    "file_write_stream": lambda w: {"id": w.sid, "path": "/tmp/up", "size": 3},
    "file_rename": lambda w: {"id": w.sid, "src": "/tmp/f",
                              "dst": "/tmp/f2"},
    "file_watch": lambda w: {"id": w.sid, "path": "/tmp", "timeout_s": 0.3},
    "set_timeout": lambda w: {"id": w.sid, "timeout_s": 3600.0},
    "process_start": lambda w: {"id": w.keep, "req": {"shell": "echo hi", "tag": "t"}},
    "process_list": lambda w: {"id": w.keep},
    "process_run": lambda w: {"id": w.keep, "req": {"shell": "echo hi", "tag": "r"}},
    "process_connect": lambda w: {"id": w.keep, "pid": w.pid},
    "process_input": lambda w: {"id": w.keep, "pid": w.stdin_pid, "data": b"in"},
    "process_close_stdin": lambda w: {"id": w.keep, "pid": w.stdin_pid},
    "process_signal": lambda w: {"id": w.keep, "pid": w.sleep_pid, "signal": 15},
    "pty_resize": lambda w: {"id": w.keep, "pid": w.pty_pid, "cols": 100, "rows": 30},
}

LONG = "/" + "p" * MAX_PATH_BYTES
# Past-the-limit raw bodies of the edge rows whose request types carry limits, with the
# request type built the same way in-process (whose error the edge must answer with).
INVALID: dict[str, list[tuple[Example, Callable[[World], Any]]]] = {
    "exec": [(lambda w: {"id": w.sid, "req": {"argv": ["a\0b"]}},
              lambda w: ExecCall(id=w.sid, req=ExecRequest(argv=("a\0b",))))],
    "exec_stream": [(lambda w: {"id": w.sid, "req": {"shell": "x", "timeout_s": 0.0}},
                     lambda w: ExecRequest(shell="x", timeout_s=0.0))],
    "read_file": [(lambda w: {"id": w.sid, "path": LONG},
                   lambda w: ReadFile(id=w.sid, path=LONG)),
                  (lambda w: {"id": w.sid, "path": "/f", "offset": -1},
                   lambda w: ReadFile(id=w.sid, path="/f", offset=-1))],
    "write_file": [(lambda w: {"id": w.sid, "path": "/f", "data": b"", "mode": 0o10000},
                    lambda w: WriteFile(id=w.sid, path="/f", data=b"", mode=0o10000))],
    "stat": [(lambda w: {"id": w.sid, "path": "a\0b"}, lambda w: FileRef(id=w.sid,
                                                                      path="a\0b"))],
    "network_update": [
        (lambda w: {"id": w.sid, "policy": {"mode": "policy", "allow": ["10.0.0.5/8"]}},
         lambda w: NetworkUpdateOnNode(id=w.sid, policy=NetworkPolicy(
             mode="policy", allow=("10.0.0.5/8",)))),
        (lambda w: {"id": w.sid, "policy": {"mode": "policy", "allow": [
            f"h{i}.example.com" for i in range(MAX_NET_RULES + 1)]}},
         lambda w: NetworkUpdateOnNode(id=w.sid, policy=NetworkPolicy(
             mode="policy", allow=tuple(f"h{i}.example.com" for i in range(
                 MAX_NET_RULES + 1))))),
        (lambda w: {"id": w.sid, "policy": {"mode": "none"}, "ceiling_deny": ["a..b"]},
         lambda w: NetworkUpdateOnNode(id=w.sid, policy=NetworkPolicy(),
                                       ceiling_deny=("a..b",))),
    ],
    "create": [(lambda w: {"spec": {"network": {"mode": "policy", "allow": ["x:0"]}}},
                lambda w: SandboxSpec(network=NetworkPolicy(mode="policy", allow=("x:0",)))
                .validate())],
    "port_expose": [(lambda w: {"id": w.sid, "port": 0},
                     lambda w: PortExpose(id=w.sid, port=0)),
                    (lambda w: {"id": w.sid, "port": 65536},
                     lambda w: PortExpose(id=w.sid, port=65536))],
    "port_close": [(lambda w: {"id": w.sid, "port": -1}, lambda w: PortRef(id=w.sid, port=-1))],
    "layer_chain": [(lambda w: {"digest": w.layer[:20]},
                     lambda w: LayerRef(digest=w.layer[:20]))],
    "file_read_stream": [(lambda w: {"id": w.sid, "path": "/f", "length": -1},
                          lambda w: ReadStream(id=w.sid, path="/f", length=-1))],
    "file_write_stream": [(lambda w: {"id": w.sid, "path": "/f", "size": -1},
                           lambda w: WriteStream(id=w.sid, path="/f", size=-1))],
    "file_rename": [(lambda w: {"id": w.sid, "src": "/f", "dst": LONG},
                     lambda w: Rename(id=w.sid, src="/f", dst=LONG))],
    "file_watch": [(lambda w: {"id": w.sid, "path": "/tmp", "timeout_s": 0.0},
                    lambda w: Watch(id=w.sid, path="/tmp", timeout_s=0.0))],
    "layer_put": [(lambda w: {"manifest": b" " * (MAX_MANIFEST_BYTES + 1)},
                   lambda w: LayerPut(manifest=b" " * (MAX_MANIFEST_BYTES + 1)))],
    "set_timeout": [(lambda w: {"id": w.sid, "timeout_s": -1.0},
                     lambda w: SetTimeout(id=w.sid, timeout_s=-1.0))],
    "process_input": [(lambda w: {"id": w.keep, "pid": 1, "data": b"x" * (
        MAX_PROCESS_INPUT_BYTES + 1)}, lambda w: ProcessInput(id=w.keep, pid=1, data=b"x" * (
            MAX_PROCESS_INPUT_BYTES + 1)))],
    "pty_resize": [(lambda w: {"id": w.keep, "pid": 1, "cols": 0, "rows": 1},
                    lambda w: PtyResize(id=w.keep, pid=1, cols=0, rows=1))],
    "process_signal": [(lambda w: {"id": w.keep, "pid": 0, "signal": 9},
                        lambda w: ProcessSignal(id=w.keep, pid=0, signal=9))],
}


def test_examples_cover_every_edge_row() -> None:
    assert set(EXAMPLES) == {op.name for op in EDGE_OPS}


@pytest.fixture
async def world(tmp_path: Any) -> AsyncIterator[tuple[Connection, World]]:
    store = LayerStore(f"{tmp_path}/layers")
    os.makedirs(f"{tmp_path}/tree/etc")
    layer = store.add_tree(f"{tmp_path}/tree", kind="base")
    node: EdgeNode = make_node(layer_store=store.root)
    await node.start()
    server = await serve_edge(node, f"unix:{tmp_path}/edge.sock")
    conn = await connect(f"unix:{tmp_path}/edge.sock")
    try:
        sid = (await node.create(SandboxSpec())).id
        await node.write_file(sid, "/tmp/f", b"x")
        spare = (await node.create(SandboxSpec(labels={"spare": "1"}))).id
        await node.write_file(spare, "/tmp/mine", b"spare")
        w = World(sid=sid, spare=spare, snap=(await node.snapshot(sid)).id,
                  spare_snap=(await node.snapshot(spare)).id,
                  keep=(await node.create(SandboxSpec())).id, layer=layer.digest,
                  manifest=msgspec.json.encode(layer))
        start = node.processes.start
        w.pid = (await start(w.keep, ExecRequest(shell="echo hi"))).pid
        w.stdin_pid = (await start(w.keep, ExecRequest(shell="cat", stdin_open=True))).pid
        w.sleep_pid = (await start(w.keep, ExecRequest(shell="sleep 30"))).pid
        w.pty_pid = (await start(w.keep, ExecRequest(shell="sleep 30", pty=PtySize()))).pid
        yield conn, w
    finally:
        await conn.close()
        await server.close()
        await node.close()


def _is(value: Any, tp: Any) -> bool:
    if tp is None:
        return value is None
    origin = getattr(tp, "__origin__", None)
    if origin is list:
        return isinstance(value, list) and all(isinstance(v, tp.__args__[0]) for v in value)
    return isinstance(value, origin or tp)


async def _call(conn: Connection, op: Op[Any, Any], body: dict[str, Any]) -> Any:
    if op is ops.LAYER_GET:
        s = conn.duplex(op.edge_method, body, response_type=op.reply)
        s.close_write()
        h = hashlib.sha256()
        while chunk := await s.recv(1 << 20):
            h.update(chunk)
        assert "sha256:" + h.hexdigest() == body["digest"]
        return await s.result()
    if op is ops.LAYER_PUT:      # the node holds it: answered at once, nothing read
        s = conn.duplex(op.edge_method, body, response_type=op.reply)
        stored = await s.result()
        assert stored.already
        return stored
    if op is ops.FILE_READ_STREAM:
        s = conn.duplex(op.edge_method, body, response_type=op.reply)
        s.close_write()
        data = b""
        while chunk := await s.recv():
            data += chunk
        assert data == b"abc"
        return await s.result()
    if op is ops.FILE_WRITE_STREAM:
        s = conn.duplex(op.edge_method, body, response_type=op.reply)
        await s.send(b"xyz")
        s.close_write()
        return await s.result()
    if isinstance(op, TunnelOp):
        # A duplex row; the simulated backend has no network namespace, so the edge
        # answers that (after the port and generation checks passed); a container
        # sandbox's tunnel is tests/net/test_expose.py's.
        s = conn.duplex(op.edge_method, body, response_type=op.reply)
        with pytest.raises(InvalidArgument, match="no network namespace of its own"):
            await s.result()
        return None
    if isinstance(op, StreamOp):
        s = conn.stream(op.edge_method, body, item_type=op.item, response_type=op.reply,
                        timeout=30)
        async with s:
            items = [i async for i in s]
        assert all(isinstance(i, op.item) for i in items)
        return s.result
    return await conn.call(op.edge_method, body, response_type=op.edge_reply_type, timeout=30)


async def test_every_edge_row_answers_its_reply_type(
        world: tuple[Connection, World]) -> None:
    conn, w = world
    # in table order, but destroy and destroy_many last (they take the sandboxes)
    for op in sorted(EDGE_OPS, key=lambda op: op.name in ("destroy", "destroy_many")):
        reply = await _call(conn, op, EXAMPLES[op.name](w))
        assert _is(reply, op.edge_reply_type), (op.name, reply)
        if op is ops.PORT_EXPOSE:
            w.port_gen = reply.generation


async def test_every_limit_is_refused_at_the_edge_in_the_types_words(
        world: tuple[Connection, World]) -> None:
    conn, w = world
    for name, cases in INVALID.items():
        op = ops.BY_NAME[name]
        for raw, built in cases:
            with pytest.raises(InvalidArgument) as local:
                built(w)
            with pytest.raises(DsecError) as remote:
                await _call(conn, op, raw(w))
            assert type(remote.value) is type(local.value), name
            assert remote.value.message == local.value.message, name
            assert remote.value.detail == local.value.detail, name
