"""The catalogue walked through every door (issue 13's closing test).

One in-process cluster (one edge, the simulated backend). For every row of
``dsec.wire.ops.ALL_OPS`` there is a valid example request (``EXAMPLES``; a row without
one fails ``test_examples_cover_the_catalogue``), and for each door the row lists the
example answers with the row's reply type:

- ``rest``: raw httpx, the request laid out by the row's ``Rest`` binding
  (:func:`dsec.wire.rest.encode_request`), the status the row names;
- ``gateway``: a raw ``dsec.aether.connect`` to the apiserver's gateway and
  ``conn.call("api.<name>", body)`` with a plain msgpack body;
- ``edge``: a raw connection to the edge's socket and ``edge.<name>`` with the row's edge
  request type's body;
- ``sdk-http`` / ``sdk-aether``: the SDK (``Client.call(op, body)``, the typed escape
  hatch under every SDK method; the SDK's own sugar for the stream and upload rows).

And for each row with limited fields, raw bodies past each limit (``INVALID``: dicts, as
an attacker sends them; a request type past a limit cannot even be built) are refused
at every door that takes the field as ``400 invalid_argument`` with the same message
word for word, never echoing the big value; the SDK cannot even build them (the same
words, in-process). Destructive rows run last; each example of a destructive row makes
its own victim.

Beside: a still answer (get, list, stat, ...) is the same value at every door; a
command's bytes come back the same through all five; a reader is refused a member or
admin row alike at REST and the gateway; an unknown sandbox and another tenant's are one
404; an unknown field is refused by name; each Aether door serves exactly its rows; one
idempotency key is one sandbox whichever door retries; a body msgspec refuses is worded
alike at every door, and REST refuses a query parameter its row does not name.
"""

from __future__ import annotations

import base64
import io
import json
import os
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from dsec.aether import connect
from dsec.cluster.local import LocalCluster
from dsec.errors import DsecError, InvalidArgument
from dsec.wire import ops
from dsec.wire import spec as wspec
from dsec.wire.api import (
    CreateKeyRequest,
    ExecStreamLine,
    ImagePromoteRequest,
    ImagePullRequest,
    ImagePushRequest,
    ImageTagRequest,
    QuotaBody,
)
from dsec.wire.calls import (
    CreateMany,
    CreateManyOnNode,
    CreateOnNode,
    CreateSandbox,
    DestroyMany,
    DestroyOnNode,
    Empty,
    ExecCall,
    ExecMany,
    FeedRequest,
    FileRef,
    HeartbeatRequest,
    ImagePrune,
    ImageRef,
    ImageUpload,
    KeyQuery,
    KeyRef,
    ListRequest,
    ListSandboxes,
    Mkdir,
    NetworkUpdate,
    NetworkUpdateOnNode,
    NodeRef,
    ProjectRef,
    QuotaSet,
    ReadFile,
    Remove,
    ResumeOnNode,
    SandboxRef,
    SessionOpen,
    SessionRef,
    SnapshotCall,
    SnapshotOnNode,
    SnapshotQuery,
    SnapshotRef,
    WriteFile,
)
from dsec.wire.cluster import JoinTokenCreate, JoinTokenRevoke
from dsec.wire.files import ReadStream, Rename, Watch, WatchEnd, WriteStream
from dsec.wire.jsonform import run_item, stream_item
from dsec.wire.layers import (
    ImagePin,
    ImagePinRef,
    LayerFetch,
    LayerGrant,
    LayerPut,
    LayerRef,
    NodePins,
    PinSet,
)
from dsec.wire.lifetime import SetTimeout
from dsec.wire.netpolicy import NetworkPolicy
from dsec.wire.ops import ALL_OPS, Op, StreamOp, TunnelOp, UploadOp
from dsec.wire.outcome import Batch, undecodable
from dsec.wire.ports import PortConnect, PortExpose, PortRef
from dsec.wire.process import (
    ProcessInput,
    ProcessRef,
    ProcessRunItem,
    ProcessRunLine,
    ProcessSignal,
    PtyResize,
)
from dsec.wire.rest import decode_reply, encode_request
from dsec.wire.spec import ExecChunk, ExecRequest, ExecResult, FileInfo, SandboxSpec

from .conftest import requires_root

TIMEOUT = 60.0


# ================================================================== the world
@dataclass
class World:
    """What the examples name: a running sandbox with a file, a snapshot of it, and ways
    to make a fresh victim for each call of a destructive row."""

    cluster: LocalCluster
    sid: str = ""
    snap: str = ""
    image: str = ""                 # a layer's digest (built at start)
    tmp: str = ""
    oci: str = ""                   # an OCI image tarball
    registry: str = ""              # host:port of a local registry holding cat/pulled:1
    # a build's step layer on the base (a snapshot layer in the store: the world's
    # backend is simulated, whose snapshots are not layers)
    built: str = ""
    _n: list[int] = field(default_factory=lambda: [0])

    def n(self) -> int:
        self._n[0] += 1
        return self._n[0]

    def rest(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(method, f"{self.cluster.url}{path}", timeout=TIMEOUT,
                             headers={"authorization": f"Bearer {self.cluster.api_key}",
                                      **kw.pop("headers", {})}, **kw)

    def ok(self, method: str, path: str, **kw: Any) -> httpx.Response:
        r = self.rest(method, path, **kw)
        assert r.status_code < 300, (method, path, r.status_code, r.text)
        return r

    def join_token(self) -> str:
        """A fresh join token's id (for a row that revokes one)."""
        return str(self.cluster.runtime.join_authority.create_token(ttl_s=600)[1].id)

    def joined_node(self) -> str:
        """A freshly joined node's id (joined for real: CSR signed, token spent)."""
        from dsec.cluster.ca import new_node_key
        from dsec.cluster.join import join_request
        auth = self.cluster.runtime.join_authority
        tok, _ = auth.create_token(ttl_s=600)
        node = f"cat-far-{self.n()}"
        _, csr = new_node_key(node)
        auth.join(join_request(str(tok), node_id=node, csr=csr.decode(),
                               address="tcp:127.0.0.1:7443", nonce=auth.challenge().nonce))
        return node

    def sandbox(self) -> str:
        """A fresh sandbox (with a file at /tmp/f)."""
        sid = str(self.ok("POST", "/v1/sandboxes", json={"labels": {"cat": "fresh"}}
                          ).json()["id"])
        self.ok("PUT", f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/f"},
                content=b"fresh")
        return sid

    def port_gen(self) -> int:
        """The generation of port 8000 of the world's sandbox (exposed if it was not):
        the URL token says it, ``v1.<generation>.<expiry>.<mac>``."""
        r = self.ok("POST", f"/v1/sandboxes/{self.sid}/ports", json={"port": 8000})
        return int(r.json()["token"].split(".")[1])

    def paused(self) -> str:
        sid = self.sandbox()
        self.ok("POST", f"/v1/sandboxes/{sid}/pause")
        return sid

    def snapshot(self) -> str:
        """A fresh snapshot nothing builds on (its sandbox gone)."""
        sid = self.sandbox()
        self.ok("PUT", f"/v1/sandboxes/{sid}/files", params={"path": f"/tmp/s{self.n()}"},
                content=os.urandom(8))
        snap = str(self.ok("POST", f"/v1/sandboxes/{sid}/snapshot").json()["id"])
        self.ok("DELETE", f"/v1/sandboxes/{sid}")
        return snap

    def manifest_json(self) -> bytes:
        """The world image's manifest as a holder sends it (the edge holds it already)."""
        from dsec.image import LayerStore
        store = LayerStore(os.path.join(self.cluster.state_dir, "layers"))
        return msgspec.json.encode(store.get(self.image))

    def file(self) -> str:
        """A new file of the world's sandbox (each rename moves its own)."""
        path = f"/tmp/r{self.n()}"
        self.ok("PUT", f"/v1/sandboxes/{self.sid}/files", params={"path": path},
                content=b"renamed")
        return path

    def dir(self) -> str:
        path = f"/tmp/d{self.n()}"
        self.ok("POST", f"/v1/sandboxes/{self.sid}/files/mkdir", params={"path": path + "/x"})
        return path

    def session(self) -> str:
        return str(self.ok("POST", "/v1/sessions", params={"lease_s": 60}).json()["id"])

    def key(self) -> str:
        r = self.ok("POST", "/v1/keys", json={"name": f"cat-{self.n()}", "project": "default",
                                               "role": "reader"})
        return str(r.json()["key_id"])

    def pushed(self) -> str:
        """The built layer, pushed to the cluster's blob store (what a pin needs)."""
        self.ok("POST", "/v1/images/push", json={"ref": self.image})
        return self.image

    def pinned(self) -> str:
        """The built layer, pinned on edge-0 (a victim for unpin)."""
        self.ok("POST", "/v1/nodes/edge-0/pins", json={"ref": self.pushed()})
        return self.image

    def process(self, shell: str = "echo hi", *, stdin: bool = False) -> int:
        """A fresh process of the world's sandbox (issue 19), its pid."""
        r = self.ok("POST", f"/v1/sandboxes/{self.sid}/processes",
                    json={"shell": shell, "stdin_open": stdin, "timeout_s": None})
        return int(r.json()["pid"])

    def pty_process(self) -> int:
        r = self.ok("POST", f"/v1/sandboxes/{self.sid}/processes",
                    json={"shell": "sleep 30", "pty": {"cols": 80, "rows": 24}})
        return int(r.json()["pid"])

    def image_name(self) -> str:
        """A fresh name on the built layer."""
        name = f"cat-del-{self.n()}:latest"
        self.ok("POST", "/v1/images/tag", json={"source": self.image, "target": name})
        return name


def _layer_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"print('tool')\n"
        info = tarfile.TarInfo("opt/tool.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _oci_tar(tmp: str) -> str:
    """A one-layer OCI layout, tarred (what ``docker save``-like tools give)."""
    from tests.image.test_oci import layer_tar, tar_dir, write_layout
    root = os.path.join(tmp, "layout")
    os.makedirs(root)
    write_layout(root, [layer_tar([("etc/", None), ("etc/hello", b"hi")])])
    out = os.path.join(tmp, "image.tar")
    tar_dir(root, out)
    return out


# ================================================================ the examples
Example = Callable[[World], Any]

# A valid request of each row (its request type: the API's, or the edge's for edge rows).
EXAMPLES: dict[str, Example] = {
    "create": lambda w: CreateSandbox(spec=SandboxSpec(labels={"cat": "1"})),
    "create_many": lambda w: CreateMany(items=[SandboxSpec(), SandboxSpec(cpu_milli=500)]),
    "get": lambda w: SandboxRef(id=w.sid),
    "list": lambda w: ListSandboxes(labels={"cat": "world"}, limit=10),
    "exec": lambda w: ExecCall(id=w.sid, req=ExecRequest(shell="echo hi")),
    "exec_many": lambda w: ExecMany(calls=[ExecCall(id=w.sid, req=ExecRequest(
        argv=("echo", "a"))), ExecCall(id=w.sid, req=ExecRequest(shell="true"))]),
    "exec_stream": lambda w: ExecCall(id=w.sid, req=ExecRequest(shell="echo hi")),
    "read_file": lambda w: ReadFile(id=w.sid, path="/tmp/f"),
    "write_file": lambda w: WriteFile(id=w.sid, path="/tmp/w", data=b"\x00\xffbytes"),
    "list_dir": lambda w: FileRef(id=w.sid, path="/tmp"),
    "stat": lambda w: FileRef(id=w.sid, path="/tmp/f"),
    "mkdir": lambda w: Mkdir(id=w.sid, path=f"/tmp/m{w.n()}/a/b"),
    "pause": lambda w: SandboxRef(id=w.sandbox()),
    "resume": lambda w: SandboxRef(id=w.paused()),
    "stats": lambda w: SandboxRef(id=w.sid),
    "events": lambda w: SandboxRef(id=w.sid),
    "snapshot": lambda w: SnapshotCall(id=w.sid, strip=["/tmp/cache"]),
    "snapshots": lambda w: SnapshotQuery(sandbox_id=w.sid),
    "snapshot_get": lambda w: SnapshotRef(id=w.snap),
    "node_info": lambda w: Empty(),
    "heartbeat": lambda w: HeartbeatRequest(include_sandboxes=True),
    "feed": lambda w: FeedRequest(after=0, limit=10),
    "info": lambda w: Empty(),
    "nodes": lambda w: Empty(),
    "session_open": lambda w: SessionOpen(lease_s=30.0),
    "session_renew": lambda w: SessionRef(id=w.session()),
    "create_key": lambda w: CreateKeyRequest(name=f"cat-new-{w.n()}", project="default",
                                             role="member"),
    "projects": lambda w: Empty(),
    "keys": lambda w: KeyQuery(),
    "project_get": lambda w: ProjectRef(path="default"),
    "quota_set": lambda w: QuotaSet(path="default/cat", quota=QuotaBody(max_sandboxes=50)),
    "images": lambda w: Empty(),
    "image_get": lambda w: ImageRef(ref="cat-tool:latest"),
    "image_tag": lambda w: ImageTagRequest(source="cat-tool:latest",
                                           target=f"cat-tag-{w.n()}:v1"),
    "image_build": lambda w: ImageUpload(name=f"cat-built-{w.n()}", kind="toolkit"),
    "image_import": lambda w: ImageUpload(name=f"cat-oci-{w.n()}"),
    "image_pull": lambda w: ImagePullRequest(ref=f"{w.registry}/cat/pulled:1",
                                             insecure=True),
    "image_prune": lambda w: ImagePrune(dry_run=True),
    "image_push": lambda w: ImagePushRequest(ref="cat-tool:latest"),
    "image_pin": lambda w: ImagePin(node="edge-0", ref=w.pushed()),
    "image_pins": lambda w: NodePins(node="edge-0"),
    "image_promote": lambda w: ImagePromoteRequest(
        top=w.built, base="cat-base", target=f"cat-promoted-{w.n()}:1", env={"A": "1"},
        workdir="/srv"),
    "port_expose": lambda w: PortExpose(id=w.sid, port=8000),
    "port_list": lambda w: SandboxRef(id=w.sid),
    "port_connect": lambda w: PortConnect(id=w.sid, port=8000, generation=w.port_gen()),
    "port_close": lambda w: PortRef(id=w.sid, port=8000),
    # issue 19: processes (the simulated backend runs them through exec_stream)
    "process_start": lambda w: ExecCall(id=w.sid, req=ExecRequest(shell="echo hi",
                                                                  tag="cat")),
    "process_list": lambda w: SandboxRef(id=w.sid),
    "process_run": lambda w: ExecCall(id=w.sid, req=ExecRequest(shell="echo hi",
                                                                tag="cat-run")),
    "process_connect": lambda w: ProcessRef(id=w.sid, pid=w.process()),
    "process_input": lambda w: ProcessInput(id=w.sid, pid=w.process("cat", stdin=True),
                                            data=b"\x00\xffin"),
    "process_close_stdin": lambda w: ProcessRef(id=w.sid, pid=w.process("cat", stdin=True)),
    "process_signal": lambda w: ProcessSignal(id=w.sid, pid=w.process("sleep 30"),
                                              signal=15),
    "pty_resize": lambda w: PtyResize(id=w.sid, pid=w.pty_process(), cols=120, rows=40),
    # destructive: each call makes its own victim
    "remove": lambda w: Remove(id=w.sid, path=w.dir(), recursive=True),
    "destroy": lambda w: SandboxRef(id=w.sandbox()),
    "snapshot_delete": lambda w: SnapshotRef(id=w.snapshot()),
    "session_close": lambda w: SessionRef(id=w.session()),
    "revoke_key": lambda w: KeyRef(id=w.key()),
    "image_delete": lambda w: ImageRef(ref=w.image_name()),
    "destroy_many": lambda w: DestroyMany(ids=[w.sandbox(), w.sandbox()]),
    "image_unpin": lambda w: ImagePinRef(node="edge-0", image=w.pinned()),
    # last of all (the catalogue's last rows): drain the world's one edge, then undrain
    # it, so no create of another example finds it drained
    "node_drain": lambda w: NodeRef(id="edge-0"),
    "node_undrain": lambda w: NodeRef(id="edge-0"),
    "layer_chain": lambda w: LayerRef(digest=w.image),
    "layer_get": lambda w: LayerRef(digest=w.image),
    "layer_put": lambda w: LayerPut(manifest=w.manifest_json()),
    "layer_fetch": lambda w: LayerFetch(node="edge-0", digest=w.image),
    "network_get": lambda w: SandboxRef(id=w.sid),
    "network_update": lambda w: NetworkUpdate(id=w.sid, policy=NetworkPolicy(
        mode="policy", allow=("pypi.org:443/tcp", "*.pythonhosted.org:443"))),
    "cluster_tokens": lambda w: Empty(),
    "cluster_token_create": lambda w: JoinTokenCreate(ttl_s=600, description="catalogue"),
    "cluster_token_revoke": lambda w: JoinTokenRevoke(id=w.join_token()),
    "cluster_nodes": lambda w: Empty(),
    "cluster_node_revoke": lambda w: NodeRef(id=w.joined_node()),
    "node_migrate": lambda w: NodeRef(id="edge-0"),
    "node_pins": lambda w: PinSet(images=[], gen=0),
    "file_read_stream": lambda w: ReadStream(id=w.sid, path="/tmp/f"),
    "file_write_stream": lambda w: WriteStream(id=w.sid, path="/tmp/up", size=3),
    "file_rename": lambda w: Rename(id=w.sid, src=w.file(), dst=f"/tmp/moved{w.n()}"),
    "file_watch": lambda w: Watch(id=w.sid, path="/tmp", timeout_s=0.2),
    "set_timeout": lambda w: SetTimeout(id=w.sid, timeout_s=3600.0),
    "layer_grant": lambda w: LayerGrant(manifests=[w.manifest_json()]),
}
DESTRUCTIVE = ("remove", "destroy", "snapshot_delete", "session_close", "revoke_key",
               "image_delete", "destroy_many", "image_unpin", "node_drain", "node_undrain",
               "cluster_token_revoke", "cluster_node_revoke", "node_migrate")

_RESOLVED = {"backend": "simulated", "project": "default"}


def _edge_body(op: Op[Any, Any], req: Any) -> Any:
    """The edge's request for an API request (rows whose edge request differs: the
    control plane's fields at their ordinary values)."""
    if op.edge_request is None:
        return req
    if isinstance(req, CreateSandbox):
        return CreateOnNode(spec=msgspec.structs.replace(req.spec, **_RESOLVED))
    if isinstance(req, CreateMany):
        return CreateManyOnNode(specs=[msgspec.structs.replace(s, **_RESOLVED)
                                       for s in req.items])
    if isinstance(req, ListSandboxes):
        return ListRequest(project=req.project, labels=req.labels, state=req.state)
    if op is ops.DESTROY:
        return DestroyOnNode(id=req.id)
    if op is ops.RESUME:
        return ResumeOnNode(id=req.id)
    if isinstance(req, SnapshotCall):
        return SnapshotOnNode(id=req.id, strip=req.strip)
    if isinstance(req, NetworkUpdate):
        return NetworkUpdateOnNode(id=req.id, policy=req.policy,
                                   expect_generation=req.expect_generation)
    raise AssertionError(f"no edge form for {op.name}")


def _raw(obj: Any) -> Any:
    """A request object as the plain msgpack-able structure a peer sends (bytes kept)."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(obj))


def _is(value: Any, tp: Any) -> bool:
    if tp is None:
        return value is None
    origin: Any = getattr(tp, "__origin__", None)
    if origin is list:
        return isinstance(value, list) and all(isinstance(v, tp.__args__[0]) for v in value)
    if origin is Batch:
        return isinstance(value, Batch) and all(
            o.error is None and isinstance(o.value, tp.__args__[0]) for o in value.items)
    cls: type = origin or tp
    return isinstance(value, cls)


# ================================================================== the doors
def _doors(op: Op[Any, Any]) -> list[str]:
    doors = [d for d in ("rest", "gateway", "edge") if d in op.doors]
    if op.doors & ops.API_DOORS:
        doors += ["sdk-http"] if isinstance(op, UploadOp) else ["sdk-http", "sdk-aether"]
    return doors


def _edge_address(cluster: LocalCluster) -> str:
    return f"unix:{cluster.state_dir}/edges/edge-0.sock"


async def _aether(address: str, token: str | None, method: str, body: Any, op: Op[Any, Any],
                  reply_type: Any) -> Any:
    conn = await connect(address, token=token)
    try:
        if op is ops.LAYER_GET:
            import hashlib
            d = conn.duplex(method, body, response_type=reply_type)
            d.close_write()
            h, n = hashlib.sha256(), 0
            while chunk := await d.recv(1 << 20):
                h.update(chunk)
                n += len(chunk)
            assert n > 0 and "sha256:" + h.hexdigest() == body["digest"]
            return await d.result()
        if op is ops.LAYER_PUT:
            # the edge holds the layer (one store with the apiserver): answered at once,
            # nothing read (a real transfer: tests/edge/test_layer_move.py)
            d = conn.duplex(method, body, response_type=reply_type)
            stored = await d.result()
            assert stored.already and stored.digest in body["manifest"].decode()
            return stored
        if op is ops.FILE_READ_STREAM:
            d = conn.duplex(method, body, response_type=reply_type)
            d.close_write()
            got = b""
            while chunk := await d.recv():
                got += chunk
            assert got == b"hello", got
            return await d.result()
        if op is ops.FILE_WRITE_STREAM:
            d = conn.duplex(method, body, response_type=reply_type)
            await d.send(b"up!")
            d.close_write()
            return await d.result()
        if isinstance(op, TunnelOp):
            # The world's sandbox is simulated: no network namespace, which the edge says
            # once the port and its generation checked out (a real tunnel:
            # tests/net/test_expose.py).
            d = conn.duplex(method, body, response_type=reply_type)
            with pytest.raises(InvalidArgument, match="no network namespace of its own"):
                await d.result()
            return None
        if isinstance(op, StreamOp):
            s = conn.stream(method, body, item_type=op.item, response_type=reply_type,
                            timeout=TIMEOUT)
            async with s:
                items = [i async for i in s]
            # a watch of a quiet directory ends at its timeout with no event
            assert (items or op is ops.FILE_WATCH) and all(
                isinstance(i, op.item) for i in items), items
            if op is ops.PROCESS_RUN:   # the entry first, then output only
                assert items[0].started is not None and items[0].started.pid > 0, items
                assert all(i.started is None for i in items[1:]) and len(items) > 1
            return s.result
        return await conn.call(method, body, response_type=reply_type, timeout=TIMEOUT)
    finally:
        await conn.close()


def _rest_call(w: World, op: Op[Any, Any], req: Any) -> Any:
    assert op.rest is not None
    if isinstance(op, UploadOp) or op is ops.FILE_WRITE_STREAM:
        content = (b"up!" if op is ops.FILE_WRITE_STREAM else
                   _layer_tar() if op is ops.IMAGE_BUILD else Path(w.oci).read_bytes())
        r = encode_request(op, req)
        resp = w.rest(r.method, r.path, params=r.params, content=content)
    else:
        r = encode_request(op, req)
        resp = w.rest(r.method, r.path, params=r.params, headers=r.headers,
                      content=r.content)
    assert resp.status_code == op.rest.status, (op.name, resp.status_code, resp.text)
    if op is ops.FILE_WATCH:
        lines = [msgspec.json.decode(ln) for ln in resp.content.splitlines() if ln]
        assert lines[-1] == {"end": {"reason": "timeout"}}, lines
        return msgspec.convert(lines[-1]["end"], WatchEnd)
    if op is ops.FILE_READ_STREAM:
        assert resp.content == b"hello"
        return resp.content
    if op is ops.FILE_WRITE_STREAM:
        return msgspec.json.decode(resp.content, type=FileInfo)
    if op is ops.PROCESS_RUN:
        run_lines = [msgspec.json.decode(ln, type=ProcessRunLine)
                     for ln in resp.content.splitlines() if ln]
        run = [run_item(ln) for ln in run_lines]
        assert isinstance(run[0], ProcessRunItem) and run[0].started is not None, run
        assert run[0].started.tag == "cat-run" and len(run) > 2, run
        assert all(isinstance(i, ProcessRunItem) and i.started is None
                   for i in run[1:-1]), run
        return run[-1]
    if op.rest.reply == "ndjson":
        lines = [msgspec.json.decode(ln, type=ExecStreamLine)
                 for ln in resp.content.splitlines() if ln]
        items = [stream_item(ln) for ln in lines]
        assert all(isinstance(i, ExecChunk) for i in items[:-1]) and len(items) > 1, items
        return items[-1]
    return decode_reply(op, resp.content)


def _sdk_call(w: World, op: Op[Any, Any], req: Any, transport: str) -> Any:
    with w.cluster.client(protocol=transport, session_lease_s=None) as c:
        if op is ops.EXEC_STREAM:
            items = list(c.sandboxes.get(req.id).exec_stream(req.req.shell))
            assert len(items) > 1 and all(isinstance(i, ExecChunk) for i in items[:-1])
            return items[-1]
        if op is ops.PROCESS_RUN:
            async def run() -> list[Any]:
                t = await c._a._transport()
                return [i async for i in t.stream(op, req, timeout=None)]
            got = c._run(run())
            assert got[0].started is not None and got[0].started.pid > 0, got
            assert all(i.started is None for i in got[1:-1]) and len(got) > 2, got
            return got[-1]
        if op is ops.PROCESS_CONNECT:
            items = list(c.sandboxes.get(req.id).processes.connect(req.pid).stream())
            assert len(items) > 1 and all(isinstance(i, ExecChunk) for i in items[:-1])
            return items[-1]
        if op is ops.FILE_READ_STREAM:
            sb = c.sandboxes.get(req.id)
            assert b"".join(sb.files.read(req.path, stream=True)) == b"hello"
            return sb.files.stat(req.path)
        if op is ops.FILE_WRITE_STREAM:
            return c.sandboxes.get(req.id).files.write(req.path, b"up!", size=req.size)
        if op is ops.FILE_WATCH:
            assert list(c.sandboxes.get(req.id).files.watch(req.path,
                                                            timeout=req.timeout_s)) == []
            return WatchEnd(reason="timeout")
        if op is ops.IMAGE_BUILD:
            return c.images.build(_layer_file(w), name=req.name, kind=req.kind)
        if op is ops.IMAGE_IMPORT:
            return c.images.import_oci(w.oci, name=req.name)
        return c.call(op, req)


def _layer_file(w: World) -> str:
    path = os.path.join(w.tmp, "layer.tar")
    if not os.path.exists(path):
        with open(path, "wb") as f:
            f.write(_layer_tar())
    return path


def _call(w: World, op: Op[Any, Any], door: str, req: Any) -> Any:
    cl = w.cluster
    if door == "rest":
        return _rest_call(w, op, req)
    if door == "gateway":
        assert cl.gateway is not None
        return cl._on_loop(_aether(cl.gateway, cl.api_key, op.api_method, _raw(req), op,
                                   op.reply), timeout=TIMEOUT)
    if door == "edge":
        return cl._on_loop(_aether(_edge_address(cl), None, op.edge_method,
                                   _raw(_edge_body(op, req)), op, op.edge_reply_type),
                           timeout=TIMEOUT)
    return _sdk_call(w, op, req, door.removeprefix("sdk-"))


# ================================================================= the tests
@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    from dsec.image.localregistry import Entry, push, registry, tar_entries, write_image
    tmp = str(tmp_path_factory.mktemp("catalogue"))
    with LocalCluster(edges=1, registries=("127.0.0.1",),
                      blob_store=f"file://{tmp}/blobs") as cl, \
            registry(os.path.join(tmp, "registry")) as reg:
        w = World(cluster=cl, tmp=tmp, registry=reg.host)
        layout = os.path.join(tmp, "pull-layout")
        write_image(layout, "p", [tar_entries([Entry("etc", "dir"),
                                                Entry("etc/pulled", data=b"yes")])])
        push(layout, "p", f"{reg.host}/cat/pulled:1")
        w.oci = _oci_tar(w.tmp)
        w.sid = str(w.ok("POST", "/v1/sandboxes", json={"labels": {"cat": "world"}}
                         ).json()["id"])
        w.ok("PUT", f"/v1/sandboxes/{w.sid}/files", params={"path": "/tmp/f"},
             content=b"hello")
        w.snap = str(w.ok("POST", f"/v1/sandboxes/{w.sid}/snapshot").json()["id"])
        r = w.ok("POST", "/v1/images", params={"name": "cat-tool", "kind": "toolkit"},
                 content=_layer_tar())
        w.image = str(r.json()["items"][0]["digest"])
        w.built = _step_layer(cl, w.tmp)
        yield w


def _step_layer(cl: LocalCluster, tmp: str) -> str:
    from dsec.image import LayerStore
    from dsec.image.manifest import PROJECT_LABEL

    store = LayerStore(os.path.join(cl.state_dir, "layers"))
    os.makedirs(os.path.join(tmp, "cat-base", "etc"))
    base = store.add_tree(os.path.join(tmp, "cat-base"), kind="base", name="cat-base")
    tree = os.path.join(tmp, "step")
    os.makedirs(os.path.join(tree, "srv"))
    with open(os.path.join(tree, "srv", "made"), "w") as f:
        f.write("by a step\n")
    return store.add_tree(tree, kind="snapshot", labels={PROJECT_LABEL: "default"},
                          stack=(base.digest, *base.stack)).digest


def _order() -> list[Op[Any, Any]]:
    last = [op for op in ALL_OPS if op.name in DESTRUCTIVE and op is not ops.NODE_MIGRATE]
    # node_migrate runs while edge-0 is drained (between node_drain and node_undrain);
    # with no other node, each sandbox stays, reported as not moved
    last.insert(last.index(ops.NODE_DRAIN) + 1, ops.NODE_MIGRATE)
    return [op for op in ALL_OPS if op.name not in DESTRUCTIVE] + last


CASES = [pytest.param(op, door, id=f"{op.name}-{door}",
                      marks=[requires_root] if op in (ops.IMAGE_IMPORT, ops.IMAGE_PULL,
                                                      ops.IMAGE_PROMOTE)
                      else [])
         for op in _order() for door in _doors(op)]


def test_examples_cover_the_catalogue() -> None:
    assert set(EXAMPLES) == {op.name for op in ALL_OPS}
    assert set(DESTRUCTIVE) <= set(EXAMPLES)


def test_every_row_has_a_door_and_the_api_doors_together() -> None:
    """A row on one API door and not the other is a door the catalogue forgot (uploads
    are REST-only until chunked uploads come to Aether)."""
    for op in ALL_OPS:
        assert op.doors, op.name
        if isinstance(op, UploadOp):
            assert op.doors == {"rest"}, op.name
        elif op.doors & ops.API_DOORS:
            assert op.doors >= ops.API_DOORS, op.name


@pytest.mark.parametrize(("op", "door"), CASES)
def test_every_row_answers_its_reply_type_at_every_door(world: World, op: Op[Any, Any],
                                                          door: str) -> None:
    req = EXAMPLES[op.name](world)
    reply = _call(world, op, door, req)
    want = op.edge_reply_type if door == "edge" else op.reply
    if door == "rest" and op.rest is not None and op.rest.reply == "raw":
        want = bytes          # the raw body (file_read_stream: the file's FileInfo
                              # rides the x-dsec-file header, the SDK's answer)
    if door.startswith("sdk-") and isinstance(op, UploadOp):
        from dsec.wire.api import ImageView
        want = ImageView          # the SDK's build/import answer the one layer made
    assert _is(reply, want), (op.name, door, reply)


# ============================================================ past each limit
Raw = dict[str, Any]
BIG = "a" * 100_000
LONG_PATH = "/" + "p" * wspec.MAX_PATH_BYTES


@dataclass(frozen=True)
class Bad:
    """One raw request past a limit: the gateway body (the API request's fields), the
    ``MAX_*`` constant of :mod:`dsec.wire.spec` it passes (None: a bound without one)
    and the words the refusal must contain. ``doors``: where the field exists (the
    edge's request type may lack it)."""

    label: str
    body: Callable[[World], Raw]
    needle: str
    limit: str | None = None
    doors: frozenset[str] | None = None
    want: tuple[int, str] = (400, "invalid_argument")
    xfail: str | None = None        # a known gap between the doors, named precisely
    policy: bool = False            # refused by the apiserver's policy, not the type
    decode: bool = False            # refused by msgspec's decoding, not the type's check


def _spec_bad(label: str, spec: Raw, needle: str, limit: str | None) -> Bad:
    return Bad(label, lambda w: {"spec": spec}, needle, limit)


def _exec_bad(label: str, req: Raw, needle: str, limit: str | None = None) -> Bad:
    return Bad(label, lambda w: {"id": w.sid, "req": req}, needle, limit)


_EXEC_BAD = [
    _exec_bad("argv bytes", {"argv": ["true"] + [BIG] * 11},
              f"{wspec.MAX_ARGV_BYTES}-byte limit", "MAX_ARGV_BYTES"),
    _exec_bad("one argument", {"argv": ["true", "a" * (wspec.MAX_ARG_BYTES + 1)]},
              f"argv[1] is {wspec.MAX_ARG_BYTES + 1} bytes", "MAX_ARG_BYTES"),
    _exec_bad("argv count", {"argv": ["a"] * (wspec.MAX_ARGV_ITEMS + 1)},
              f"argv has {wspec.MAX_ARGV_ITEMS + 1} entries", "MAX_ARGV_ITEMS"),
    _exec_bad("NUL in argv", {"argv": ["echo", "a\0b"]}, "argv[1] contains a NUL"),
    _exec_bad("env count", {"shell": "true", "env": {
        f"K{i}": "" for i in range(wspec.MAX_ENV_ITEMS + 1)}},
        f"env has {wspec.MAX_ENV_ITEMS + 1} entries", "MAX_ENV_ITEMS"),
    _exec_bad("env name", {"shell": "true", "env": {"A=B": "c"}}, "env name 'A=B'"),
    _exec_bad("stdin", {"shell": "true", "stdin": b"x" * (wspec.MAX_STDIN_BYTES + 1)},
              f"over the {wspec.MAX_STDIN_BYTES}-byte limit", "MAX_STDIN_BYTES"),
    _exec_bad("cwd", {"shell": "true", "cwd": "/" + "d" * wspec.MAX_CWD_BYTES},
              f"cwd is {wspec.MAX_CWD_BYTES + 1} bytes", "MAX_CWD_BYTES"),
    _exec_bad("user", {"shell": "true", "user": "u" * (wspec.MAX_USER_BYTES + 1)},
              f"user is {wspec.MAX_USER_BYTES + 1} bytes", "MAX_USER_BYTES"),
    _exec_bad("hide", {"shell": "true",
                       "hide": [f"h{i}" for i in range(wspec.MAX_HIDE_ENTRIES + 1)]},
              f"hide has {wspec.MAX_HIDE_ENTRIES + 1} entries", "MAX_HIDE_ENTRIES"),
    _exec_bad("hide name", {"shell": "true", "hide": ["a/b"]}, "hide entry 'a/b'"),
    _exec_bad("timeout", {"shell": "true", "timeout_s": wspec.MAX_EXEC_TIMEOUT_S + 1},
              "timeout_s", "MAX_EXEC_TIMEOUT_S"),
    _exec_bad("output cap", {"shell": "true",
                             "output_cap_bytes": wspec.MAX_OUTPUT_CAP_BYTES + 1},
              "output_cap_bytes", "MAX_OUTPUT_CAP_BYTES"),
    _exec_bad("hide count", {"shell": "true", "hide": [f"d{i}" for i in range(
        wspec.MAX_HIDE_ENTRIES + 1)]}, f"over the limit of {wspec.MAX_HIDE_ENTRIES}",
        "MAX_HIDE_ENTRIES"),
    _exec_bad("hide entry", {"shell": "true", "hide": ["../etc"]},
              "must be the name of a top-level entry"),
]
_API = frozenset({"rest", "gateway"})


def _net_bad(label: str, policy: Raw, needle: str, limit: str | None) -> Bad:
    return Bad(label, lambda w: {"id": w.sid, "policy": policy}, needle, limit)


def _pol(**kw: Any) -> Raw:
    return {"mode": "policy", **kw}


# (label, raw policy, words of the refusal, the MAX_* it passes)
_NET_BAD: list[tuple[str, Raw, str, str | None]] = [
    (" entries", _pol(allow=[f"h{i}.example.com" for i in range(wspec.MAX_NET_RULES + 1)]),
     f"policy.allow has {wspec.MAX_NET_RULES + 1} entries", "MAX_NET_RULES"),
    (" entry length", _pol(deny=["x" * (wspec.MAX_NET_ENTRY_CHARS + 1)]),
     f"policy.deny[0] is {wspec.MAX_NET_ENTRY_CHARS + 1} characters", "MAX_NET_ENTRY_CHARS"),
    (" domain length", _pol(allow=[".".join(["abcdefgh"] * 29) + ".org"]),
     f"over the {wspec.MAX_NET_DOMAIN_BYTES}-byte limit", "MAX_NET_DOMAIN_BYTES"),
    (" label length", _pol(allow=["a" * (wspec.MAX_NET_LABEL_BYTES + 1) + ".org"]),
     "has a label of 64 bytes", "MAX_NET_LABEL_BYTES"),
    (" domain port span", _pol(allow=["example.com:8000-9000"]),
     "spans 1001 ports", "MAX_NET_DOMAIN_PORTS"),
    (" connections", _pol(max_connections=wspec.MAX_NET_CONNECTIONS + 1),
     "policy.max_connections", "MAX_NET_CONNECTIONS"),
    (" rate", _pol(rate_mbit=wspec.MAX_NET_RATE_MBIT + 1), "policy.rate_mbit",
     "MAX_NET_RATE_MBIT"),
    (" host bits", _pol(allow=["203.0.113.5/24"]), "did you mean 203.0.113.0/24?", None),
    (" port 0", _pol(allow=["pypi.org:0"]), "ports are 1..65535", None),
    (" protocol", _pol(allow=["pypi.org:443/icmp"]), "unknown protocol 'icmp'", None),
    (" star", _pol(allow=["*"]), "use mode 'open'", None),
    (" metadata", _pol(allow=["169.254.169.254"]), "is never reachable", None),
    (" empty", _pol(allow=[""]), "policy.allow[0] is empty", None),
    (" entries under none", {"mode": "none", "allow": ["pypi.org"]}, "under mode 'none'",
     None),
]

# A body msgspec itself refuses (a wrong JSON type, an ``Annotated`` Meta bound such as
# ImageTagRequest's 1200-char source) never reaches the type's own check: every door
# words it through dsec.wire.outcome.undecodable, the operation's name and the path in
# the whole request ("the create request does not decode: Expected `int`, got `str` -
# at `$.spec.cpu_milli`", REST's body being the spec).

INVALID: dict[str, list[Bad]] = {
    "get": [Bad("id length", lambda w: {"id": "s" * (wspec.MAX_ID_CHARS + 1)}, "an id is",
                "MAX_ID_CHARS")],
    "create": [
        _spec_bad("cpu", {"cpu_milli": wspec.MAX_CPU_MILLI + 1}, "cpu_milli",
                  "MAX_CPU_MILLI"),
        _spec_bad("memory", {"memory_bytes": wspec.MAX_MEMORY_BYTES + 1}, "memory_bytes",
                  "MAX_MEMORY_BYTES"),
        _spec_bad("disk", {"disk_bytes": wspec.MAX_DISK_BYTES + 1}, "disk_bytes",
                  "MAX_DISK_BYTES"),
        _spec_bad("pids", {"pids_max": wspec.MAX_PIDS + 1}, "pids_max", "MAX_PIDS"),
        Bad("a field of the wrong type", lambda w: {"spec": {"cpu_milli": "many"}},
            "cpu_milli", decode=True),
        # the apiserver's tighter cap (policy: the edge takes what its node allows)
        Bad("pids over the apiserver's cap", lambda w: {"spec": {"pids_max": 20_000}},
            "fork-bomb guard", doors=_API, policy=True),
        _spec_bad("ttl", {"ttl_s": wspec.MAX_TTL_S + 1}, "ttl_s", "MAX_TTL_S"),
        _spec_bad("env", {"env": {f"K{i}": "v" * 100_000 for i in range(6)}},
                  f"over the {wspec.MAX_SPEC_ENV_BYTES}-byte limit", "MAX_SPEC_ENV_BYTES"),
        _spec_bad("label count", {"labels": {f"k{i}": "" for i in range(
            wspec.MAX_LABELS + 1)}}, f"has {wspec.MAX_LABELS + 1} entries", "MAX_LABELS"),
        _spec_bad("label key", {"labels": {"k" * (wspec.MAX_LABEL_KEY_CHARS + 1): ""}},
                  "label", "MAX_LABEL_KEY_CHARS"),
        _spec_bad("label value", {"labels": {"k": "v" * (wspec.MAX_LABEL_VALUE_CHARS + 1)}},
                  "label", "MAX_LABEL_VALUE_CHARS"),
        _spec_bad("priority", {"priority": wspec.MAX_PRIORITY + 1}, "priority",
                  "MAX_PRIORITY"),
        _spec_bad("toolkit count", {"toolkits": ["tk"] * (wspec.MAX_TOOLKITS + 1)},
                  f"toolkits has {wspec.MAX_TOOLKITS + 1} entries", "MAX_TOOLKITS"),
        _spec_bad("image ref", {"image": "i" * (wspec.MAX_REF_CHARS + 1)}, "image",
                  "MAX_REF_CHARS"),
        # (the edge's case: tests/security/catalogue/test_edge_spec_rules.py; this
        # harness gives the edge a resolved project)
        Bad("project path", lambda w: {"spec": {"project": "Default/../x"}},
            "invalid project path", doors=_API),
        Bad("idempotency key", lambda w: {"idempotency_key": "k" * (
            wspec.MAX_IDEMPOTENCY_KEY_CHARS + 1)}, "idempotency", "MAX_IDEMPOTENCY_KEY_CHARS",
            doors=_API),
    ],
    "create_many": [
        Bad("batch size", lambda w: {"items": [{}] * (wspec.MAX_BATCH_ITEMS + 1)},
            f"{wspec.MAX_BATCH_ITEMS + 1}", "MAX_BATCH_ITEMS", doors=_API),
    ],
    "list": [
        Bad("label filters", lambda w: {"labels": {f"k{i}": "v" for i in range(
            wspec.MAX_LABELS + 1)}}, "labels filter has", "MAX_LABELS"),
        Bad("page size", lambda w: {"limit": 100_000}, "limit", doors=_API, policy=True),
        Bad("page size zero", lambda w: {"limit": 0}, "limit", doors=_API, policy=True),
    ],
    "exec": _EXEC_BAD,
    "exec_stream": [_exec_bad("NUL in argv", {"argv": ["a\0b"]}, "argv[0] contains a NUL"),
                    _EXEC_BAD[1], _EXEC_BAD[6]],
    "exec_many": [Bad("an item past a limit", lambda w: {"calls": [
        {"id": w.sid, "req": {"argv": ["true", "a" * (wspec.MAX_ARG_BYTES + 1)]}}]},
        f"argv[1] is {wspec.MAX_ARG_BYTES + 1} bytes", "MAX_ARG_BYTES")],
    "read_file": [
        Bad("path", lambda w: {"id": w.sid, "path": LONG_PATH},
            f"path is {wspec.MAX_PATH_BYTES + 1} bytes", "MAX_PATH_BYTES"),
        Bad("offset", lambda w: {"id": w.sid, "path": "/tmp/f", "offset": -1}, "offset"),
        Bad("length", lambda w: {"id": w.sid, "path": "/tmp/f",
                                 "length": wspec.MAX_FILE_READ_BYTES + 1},
            "pass offset/length", "MAX_FILE_READ_BYTES", want=(413, "payload_too_large")),
    ],
    "write_file": [
        Bad("mode", lambda w: {"id": w.sid, "path": "/tmp/x", "data": b"",
                               "mode": wspec.MAX_FILE_MODE + 1}, "mode", "MAX_FILE_MODE"),
        Bad("NUL in path", lambda w: {"id": w.sid, "path": "/tmp/a\0b", "data": b""},
            "NUL"),
    ],
    "list_dir": [Bad("path", lambda w: {"id": w.sid, "path": LONG_PATH},
                     "path is", "MAX_PATH_BYTES")],
    "stat": [Bad("path", lambda w: {"id": w.sid, "path": LONG_PATH},
                 "path is", "MAX_PATH_BYTES")],
    "mkdir": [Bad("path", lambda w: {"id": w.sid, "path": LONG_PATH},
                  "path is", "MAX_PATH_BYTES")],
    "remove": [Bad("path", lambda w: {"id": w.sid, "path": LONG_PATH},
                   "path is", "MAX_PATH_BYTES")],
    "port_expose": [
        Bad("port 0", lambda w: {"id": w.sid, "port": 0}, "port=0 must be within 1..65535"),
        Bad("port 65536", lambda w: {"id": w.sid, "port": 65536},
            "port=65536 must be within 1..65535"),
        Bad("token lifetime", lambda w: {"id": w.sid, "port": 80, "token_ttl_s": 1e9},
            "token_ttl_s=1000000000.0 must be within (0, 2.592e+06] seconds"),
    ],
    "port_close": [Bad("port", lambda w: {"id": w.sid, "port": 70000},
                       "port=70000 must be within 1..65535")],
    "process_start": [
        _exec_bad("pty cols", {"shell": "sh", "pty": {"cols": wspec.MAX_PTY_CELLS + 1,
                                                       "rows": 24}},
                  f"pty cols={wspec.MAX_PTY_CELLS + 1} must be within", "MAX_PTY_CELLS"),
        _exec_bad("tag", {"shell": "sh", "tag": "t" * (wspec.MAX_PROCESS_TAG_BYTES + 1)},
                  f"process tag is {wspec.MAX_PROCESS_TAG_BYTES + 1} bytes",
                  "MAX_PROCESS_TAG_BYTES"),
    ],
    "process_input": [Bad("data", lambda w: {"id": w.sid, "pid": 1, "data": b"x" * (
        wspec.MAX_PROCESS_INPUT_BYTES + 1)}, f"over the {wspec.MAX_PROCESS_INPUT_BYTES}-byte "
        "limit for one write", "MAX_PROCESS_INPUT_BYTES")],
    "process_signal": [Bad("signal", lambda w: {"id": w.sid, "pid": 1, "signal": 65},
                           "signal=65 is not a signal number")],
    "pty_resize": [Bad("rows", lambda w: {"id": w.sid, "pid": 1, "cols": 80, "rows": 0},
                       "pty rows=0 must be within", "MAX_PTY_CELLS")],
    "destroy_many": [Bad("batch size", lambda w: {"ids": ["s"] * (wspec.MAX_BATCH_ITEMS + 1)},
                         f"{wspec.MAX_BATCH_ITEMS + 1}", "MAX_BATCH_ITEMS"),
                     Bad("reason", lambda w: {"ids": ["s"], "reason": "r" * (
                         wspec.MAX_REASON_CHARS + 1)}, "reason", "MAX_REASON_CHARS")],
    "snapshot": [Bad("strip count", lambda w: {"id": w.sid, "strip": ["/tmp/x"] * (
        wspec.MAX_STRIP_PATTERNS + 1)}, "strip has", "MAX_STRIP_PATTERNS"),
                 Bad("strip pattern", lambda w: {"id": w.sid, "strip": ["x" * (
                     wspec.MAX_STRIP_PATTERN_CHARS + 1)]}, "strip pattern",
                     "MAX_STRIP_PATTERN_CHARS")],
    "keys": [Bad("principal pattern", lambda w: {"principal": "Not A Name"},
                  "invalid principal 'Not A Name'")],
    "session_open": [Bad("lease too short", lambda w: {"lease_s": 0.5}, "lease_s",
                         policy=True),
                     Bad("lease too long", lambda w: {"lease_s": 1e9}, "lease_s",
                         policy=True)],
    "create_key": [Bad("name", lambda w: {"name": "no such name!", "project": "default"},
                       "name", policy=True)],
    "quota_set": [Bad("negative", lambda w: {"path": "default", "quota": {
        "max_sandboxes": -1}}, "max_sandboxes"),
                  Bad("beyond 64 bits", lambda w: {"path": "default", "quota": {
                      "cpu_milli": 2**63}}, "cpu_milli")],
    "image_tag": [Bad("source length", lambda w: {"source": "s" * 5000, "target": "t:1"},
                      "source", decode=True)],
    "network_update": [_net_bad(f"policy{suffix}", raw, needle, limit)
                       for suffix, raw, needle, limit in _NET_BAD],
    "file_read_stream": [Bad("length", lambda w: {"id": w.sid, "path": "/tmp/f",
                                                  "length": -1}, "must be >= 0")],
    "file_write_stream": [Bad("size", lambda w: {"id": w.sid, "path": "/tmp/f",
                                                 "size": -1}, "size=-1 must be within")],
    "file_rename": [Bad("dst", lambda w: {"id": w.sid, "src": "/tmp/f", "dst": LONG_PATH},
                        f"dst is {wspec.MAX_PATH_BYTES + 1} bytes", "MAX_PATH_BYTES")],
    "file_watch": [Bad("timeout", lambda w: {"id": w.sid, "path": "/tmp",
                                             "timeout_s": 1e9}, "timeout_s=")],
    "set_timeout": [Bad("timeout past 30 days", lambda w: {
        "id": w.sid, "timeout_s": wspec.MAX_TTL_S + 1}, "timeout_s=", "MAX_TTL_S"),
                    Bad("timeout zero", lambda w: {"id": w.sid, "timeout_s": 0},
                        "must be within (0, ")],
}
# process_run starts as process_start does: the same request, refused by the same words
INVALID["process_run"] = INVALID["process_start"]
INVALID["create"] += [_spec_bad(f"network{suffix}", {"network": raw},
                                needle.replace("policy", "network", 1), limit)
                      for suffix, raw, needle, limit in _NET_BAD]


def _rest_raw(op: Op[Any, Any], raw: Raw) -> tuple[str, str, list[tuple[str, str]],
                                                     dict[str, str], bytes | None]:
    """A raw request body laid out on REST as the row's binding says (the inverse of
    the server's decoding, with nothing checked on this side)."""
    rest = op.rest
    assert rest is not None
    fields = dict(raw)
    path = rest.path
    for name in ops.path_params(rest.path):
        text = str(fields.pop(name))
        path = path.replace("{" + name + ":path}", text).replace("{" + name + "}", text)
    params: list[tuple[str, str]] = []
    for name, param in rest.query.items():
        v = fields.pop(name, None)
        if isinstance(v, dict):
            params += [(param, f"{k}={x}") for k, x in v.items()]
        elif isinstance(v, list):
            params += [(param, str(x)) for x in v]
        elif isinstance(v, bool):
            params.append((param, "true" if v else "false"))
        elif v is not None:
            params.append((param, str(v)))
    headers = {header: str(fields.pop(name)) for name, header in rest.headers.items()
               if name in fields}
    content: bytes | None = None
    if rest.body == "*":
        content = json.dumps(fields).encode()
        fields = {}
    elif rest.body is not None:
        value = fields.pop(rest.body, None)
        if isinstance(value, bytes):
            content = value
        else:
            if rest.body == "req" and isinstance(value, dict) and "stdin" in value:
                value = {**value, "stdin": base64.b64encode(value["stdin"]).decode(),
                         "stdin_encoding": "base64"}
            content = json.dumps(value if value is not None else {}).encode()
    assert not fields, f"{op.name}: fields with no place on REST: {sorted(fields)}"
    return rest.method, path, params, headers, content


def _edge_raw(op: Op[Any, Any], raw: Raw) -> Raw:
    if op is ops.CREATE:
        return {"spec": {**raw["spec"], **_RESOLVED}}
    return raw


def _refusal(w: World, op: Op[Any, Any], door: str, raw: Raw) -> tuple[int, str, str, Any]:
    """(status, code, message, detail's limit) of one raw request at one door."""
    cl = w.cluster
    if door == "rest":
        method, path, params, headers, content = _rest_raw(op, raw)
        r = w.rest(method, path, params=params, headers=headers, content=content)
        if r.status_code < 400:
            return r.status_code, "ok", "", None
        body = r.json()
        return (r.status_code, body.get("code", ""), body.get("message", ""),
                body.get("detail", {}).get("limit"))

    async def run() -> tuple[int, str, str, Any]:
        if door == "gateway":
            assert cl.gateway is not None
            address, token, method, body = cl.gateway, cl.api_key, op.api_method, raw
        else:
            address, token, method, body = (_edge_address(cl), None, op.edge_method,
                                            _edge_raw(op, raw))
        conn = await connect(address, token=token)
        try:
            if isinstance(op, StreamOp):
                s = conn.stream(method, body, timeout=TIMEOUT)
                async with s:
                    _ = [i async for i in s]
            else:
                await conn.call(method, body, timeout=TIMEOUT)
            return 200, "ok", "", None
        except DsecError as exc:
            return exc.http_status, exc.code, exc.message, exc.detail.get("limit")
        finally:
            await conn.close()
    out: tuple[int, str, str, Any] = cl._on_loop(run(), timeout=TIMEOUT)
    return out


BAD_CASES = [pytest.param(name, i, id=f"{name}-{bad.label.replace(' ', '_')}",
                          marks=[pytest.mark.xfail(strict=True, reason=bad.xfail)]
                          if bad.xfail else [])
             for name in [op.name for op in _order()] for i, bad in enumerate(
                 INVALID.get(name, []))]


def test_every_limit_is_exercised() -> None:
    """Every ``MAX_*`` limit of the vocabulary is passed by some raw request below."""
    used = {bad.limit for cases in INVALID.values() for bad in cases}
    assert {n for n in dir(wspec) if n.startswith("MAX_")} <= used
    assert set(INVALID) <= set(EXAMPLES)


@pytest.mark.parametrize(("name", "i"), BAD_CASES)
def test_past_each_limit_every_door_refuses_alike(world: World, name: str, i: int) -> None:
    op = ops.BY_NAME[name]
    bad = INVALID[name][i]
    doors = [d for d in ("rest", "gateway", "edge")
             if d in op.doors and (bad.doors is None or d in bad.doors)]
    raw = bad.body(world)
    got = {door: _refusal(world, op, door, raw) for door in doors}
    assert {(s, c) for s, c, _, _ in got.values()} == {bad.want}, got
    messages = {door: m for door, (_, _, m, _) in got.items()}
    assert len(set(messages.values())) == 1, "\n".join(
        f"{d}: {m}" for d, m in messages.items())                # word for word
    msg = next(iter(messages.values()))
    assert bad.needle in msg, msg
    assert len(msg) < 400, f"the refusal echoes the value: {len(msg)} chars"
    if bad.limit is not None:
        want = getattr(wspec, bad.limit)
        assert {lim for _, _, _, lim in got.values()} == {want}, got
    # The SDK cannot even send it: building the request in-process fails with the same
    # words (a refusal by the request type; a policy's refusal, say the apiserver's pids
    # cap, needs the server).
    if bad.policy:
        msgspec.convert(raw, type=op.request)
        return
    with pytest.raises(msgspec.ValidationError) as built:
        msgspec.convert(raw, type=op.request)
    if bad.decode:
        assert undecodable(op.name, built.value).message == msg, (built.value, msg)
        return
    cause = built.value.__cause__
    assert isinstance(cause, DsecError), built.value
    assert cause.message == msg, (cause.message, msg)


# Rows whose answer does not move between two calls: every door answers the same value.
STILL = ("get", "list", "read_file", "list_dir", "stat", "events", "snapshots", "snapshot_get",
         "info", "project_get", "image_get", "projects", "images")


@pytest.mark.parametrize("name", STILL)
def test_a_still_answer_is_the_same_at_every_door(world: World, name: str) -> None:
    """One record per reply, whatever the door: the same request answers the same value
    through REST, the gateway and both SDK transports (and the edge, where it takes the
    API's request and answers the API's reply)."""
    op = ops.BY_NAME[name]
    req = EXAMPLES[name](world)
    doors = [d for d in _doors(op) if d != "edge" or op.edge_plain]
    got = {door: _call(world, op, door, req) for door in doors}
    first = got[doors[0]]
    for door, reply in got.items():
        assert reply == first, f"{name}: {doors[0]} answered {first!r}, {door} {reply!r}"


# ============================================================== who may ask
ROLE_ROWS = [pytest.param(op, id=op.name) for op in _order()
             if op.role in ("member", "admin") and op.doors & ops.API_DOORS]


@pytest.fixture(scope="module")
def reader_key(world: World) -> str:
    return str(world.cluster.create_key("cat-reader", "default", "reader"))


def _as(w: World, op: Op[Any, Any], door: str, req: Any, key: str) -> tuple[int, str, str]:
    """(status, code, message) of ``req`` at an API door, acting with ``key``."""
    cl = w.cluster
    if door == "rest":
        r = encode_request(op, req)
        resp = httpx.request(r.method, f"{cl.url}{r.path}", params=r.params,
                             content=r.content, timeout=TIMEOUT,
                             headers={**r.headers, "authorization": f"Bearer {key}"})
        if resp.status_code < 400:
            return resp.status_code, "ok", ""
        body = resp.json()
        return resp.status_code, body["code"], body["message"]

    async def run() -> tuple[int, str, str]:
        assert cl.gateway is not None
        conn = await connect(cl.gateway, token=key)
        try:
            if isinstance(op, StreamOp):
                s = conn.stream(op.api_method, _raw(req), timeout=TIMEOUT)
                async with s:
                    _ = [i async for i in s]
            elif isinstance(op, TunnelOp):
                d = conn.duplex(op.api_method, _raw(req))
                d.close_write()
                await d.result()
            else:
                await conn.call(op.api_method, _raw(req), timeout=TIMEOUT)
            return 200, "ok", ""
        except DsecError as exc:
            return exc.http_status, exc.code, exc.message
        finally:
            await conn.close()
    out: tuple[int, str, str] = cl._on_loop(run(), timeout=TIMEOUT)
    return out


def test_layer_fetch_is_a_superusers_at_both_api_doors(world: World) -> None:
    """A tenant (even a project's admin) cannot make a node fetch: refused alike at REST
    and the gateway, and nothing moves."""
    admin = str(world.cluster.create_key("cat-proj-admin", "default", "admin"))
    req = LayerFetch(node="edge-0", digest=world.image)
    got = {door: _as(world, ops.LAYER_FETCH, door, req, admin) for door in ("rest", "gateway")}
    assert {s for s, _, _ in got.values()} == {403}, got
    assert len({(c, m) for _, c, m in got.values()}) == 1, got
    assert "superuser" in got["rest"][2]


def test_the_role_rows_are_every_member_and_admin_row() -> None:
    names = {op.name for op in _order()
             if op.role in ("member", "admin") and op.doors & ops.API_DOORS}
    assert {str(p.id) for p in ROLE_ROWS} == names >= {"create", "exec", "destroy", "quota_set"}


@pytest.mark.parametrize("op", ROLE_ROWS)
def test_a_row_needing_more_than_reader_is_refused_alike_at_both_api_doors(
        world: World, reader_key: str, op: Op[Any, Any]) -> None:
    """The row's role is the rule at every door: a reader's request for a member (or
    admin) row is refused by REST and the gateway with the same status and words."""
    if op.reply is not None and getattr(op.reply, "__origin__", None) is Batch:
        # a batch answers 200 and each item's outcome in place: every item refused
        got_items = {door: _batch_as(world, op, door, EXAMPLES[op.name](world), reader_key)
                     for door in ("rest", "gateway")}
        for items in got_items.values():
            assert items and {c for c, _ in items} == {"permission_denied"}, got_items
        assert len({tuple(v) for v in got_items.values()}) == 1, got_items
        return
    got = {door: _as(world, op, door, EXAMPLES[op.name](world), reader_key)
           for door in ("rest", "gateway")}
    assert {s for s, _, _ in got.values()} == {403}, got
    assert len({(c, m) for _, c, m in got.values()}) == 1, got


def _batch_as(w: World, op: Op[Any, Any], door: str, req: Any,
              key: str) -> list[tuple[str, str]]:
    """(code, message) of each item of a batch row's answer, acting with ``key``."""
    cl = w.cluster
    if door == "rest":
        r = encode_request(op, req)
        resp = httpx.request(r.method, f"{cl.url}{r.path}", params=r.params,
                             content=r.content, timeout=TIMEOUT,
                             headers={**r.headers, "authorization": f"Bearer {key}"})
        assert resp.status_code == 200, resp.text
        batch = decode_reply(op, resp.content)
    else:
        async def run() -> Any:
            assert cl.gateway is not None
            conn = await connect(cl.gateway, token=key)
            try:
                return await conn.call(op.api_method, _raw(req), response_type=op.reply,
                                       timeout=TIMEOUT)
            finally:
                await conn.close()
        batch = cl._on_loop(run(), timeout=TIMEOUT)
    out = []
    for item in batch.results():
        assert isinstance(item, DsecError), item
        out.append((item.code, item.message))
    return out


# ====================================================== a sandbox no one has
GHOST = "sb-000000000000-edge-0"
SANDBOX_ROWS = [pytest.param(op, id=op.name) for op in _order()
                if op.target == "sandbox" and op.batch_of is None
                and op.doors & ops.API_DOORS]


@pytest.mark.parametrize("op", SANDBOX_ROWS)
def test_an_unknown_sandbox_is_one_answer_at_both_api_doors(world: World,
                                                            op: Op[Any, Any]) -> None:
    """An id no sandbox has: the same 404 and words through REST and the gateway, for
    every sandbox row (and the same as for another project's sandbox: ids never leak)."""
    req = msgspec.structs.replace(EXAMPLES[op.name](world), id=GHOST)
    got = {door: _as(world, op, door, req, world.cluster.api_key)
           for door in ("rest", "gateway")}
    assert {(s, c) for s, c, _ in got.values()} == {(404, "sandbox_not_found")}, got
    assert len({m for _, _, m in got.values()}) == 1, got


@pytest.fixture(scope="module")
def stranger_key(world: World) -> str:
    """An admin of another project: a tenant the world's sandbox is hidden from."""
    return str(world.cluster.create_key("cat-stranger", "cat-other", "admin"))


@pytest.mark.parametrize("op", SANDBOX_ROWS)
def test_another_projects_sandbox_reads_as_no_sandbox_at_both_api_doors(
        world: World, stranger_key: str, op: Op[Any, Any]) -> None:
    """Another tenant's sandbox answers exactly as a missing one does, at both doors."""
    req = EXAMPLES[op.name](world)
    ghost = msgspec.structs.replace(req, id=GHOST)
    for door in ("rest", "gateway"):
        hidden = _as(world, op, door, req, stranger_key)
        missing = _as(world, op, door, ghost, stranger_key)
        assert hidden[:2] == missing[:2] == (404, "sandbox_not_found"), (door, hidden)
        assert hidden[2].replace(req.id, GHOST) == missing[2], (door, hidden, missing)


# ====================================================== a field nobody knows
UNKNOWN_ROWS = [pytest.param(op, id=op.name) for op in _order()
                if "gateway" in op.doors]


@pytest.mark.parametrize("op", UNKNOWN_ROWS)
def test_an_unknown_field_is_refused_by_name_at_the_aether_doors(
        world: World, op: Op[Any, Any]) -> None:
    """A field this release does not know is refused by name, never dropped (a dropped
    ``parents: false`` would make the parents anyway): at the gateway and, where it
    takes the same request, the edge, in the same words but for the method's name."""
    req = EXAMPLES[op.name](world)
    body = {**_raw(req), "parnets": False}
    cl = world.cluster

    async def run(address: str, token: str | None, method: str) -> DsecError:
        conn = await connect(address, token=token)
        try:
            with pytest.raises(DsecError) as ei:
                await conn.call(method, body, timeout=TIMEOUT)
            return ei.value
        finally:
            await conn.close()
    assert cl.gateway is not None
    gw = cl._on_loop(run(cl.gateway, cl.api_key, op.api_method), timeout=TIMEOUT)
    assert (gw.http_status, gw.code) == (400, "invalid_argument"), gw
    assert "parnets" in gw.message, gw.message
    if "edge" in op.doors and op.edge_plain:
        edge = cl._on_loop(run(_edge_address(cl), None, op.edge_method), timeout=TIMEOUT)
        assert edge.code == gw.code
        assert edge.message.replace(op.edge_method, op.api_method) == gw.message


def test_an_unknown_query_parameter_is_refused_by_name_at_rest(world: World) -> None:
    """Every REST route takes the query parameters its row names and refuses any other
    by name, as the Aether doors refuse an unknown field (``parnets=false`` made the
    parents), GET one sandbox (the fast path) included; nothing is done."""
    where = f"/tmp/q{world.n()}/a"
    r = world.rest("POST", f"/v1/sandboxes/{world.sid}/files/mkdir",
                   params={"path": f"{where}/b", "parnets": "false"})
    assert r.status_code == 400 and "'parnets'" in r.json()["message"], r.text
    assert r.json()["detail"]["field"] == "parnets"
    r = world.rest("GET", f"/v1/sandboxes/{world.sid}/files/stat", params={"path": where})
    assert r.status_code == 404, r.text                       # the mkdir did nothing
    for op in ops.REST_OPS:
        assert op.rest is not None
        if op.rest.method != "GET" or ops.path_params(op.rest.path) not in ((), ("id",)):
            continue
        path = op.rest.path.replace("{id}", world.sid if op.target == "sandbox"
                                    else "sha256:" + "0" * 64)
        r = world.rest("GET", path, params={"bogus": "1"})
        assert r.status_code == 400, (op.name, r.text)
        assert r.json()["detail"]["field"] == "bogus", (op.name, r.text)


# ============================================== no door the row does not list
def test_a_door_serves_exactly_its_rows(world: World) -> None:
    """Each door serves the rows that list it and nothing else: the edge's advertised
    methods are its rows, and a row is unknown at an Aether door it does not list (the
    gateway's uploads; the edge's management rows; the gateway's node rows)."""
    from dsec.errors import UnknownMethod
    from dsec.wire.node import NodeInfo
    cl = world.cluster

    async def probe(address: str, token: str | None, method: str) -> str:
        conn = await connect(address, token=token)
        try:
            # an unknown field: a known method refuses the body, so nothing happens
            await conn.call(method, {"parnets": 1}, timeout=TIMEOUT)
            return "served"
        except UnknownMethod:
            return "unknown"
        except DsecError:
            return "served"      # known, refused for its body
        finally:
            await conn.close()

    info = _call(world, ops.NODE_INFO, "edge", Empty())
    assert isinstance(info, NodeInfo)
    assert set(info.methods) == {op.edge_method for op in ops.EDGE_OPS}
    assert cl.gateway is not None
    for op in ALL_OPS:
        gw = cl._on_loop(probe(cl.gateway, cl.api_key, op.api_method), timeout=TIMEOUT)
        edge = cl._on_loop(probe(_edge_address(cl), None, op.edge_method), timeout=TIMEOUT)
        assert (gw == "served") == ("gateway" in op.doors), (op.name, gw)
        assert (edge == "served") == ("edge" in op.doors), (op.name, edge)


def test_one_idempotency_key_is_one_sandbox_whichever_door_retries(world: World) -> None:
    """A create retried through the other door with the same key and spec is the same
    request (fingerprints are of the decoded request, not of its bytes)."""
    key = f"cat-retry-{world.n()}"
    req = CreateSandbox(spec=SandboxSpec(labels={"retry": "1"}, cpu_milli=250),
                        idempotency_key=key)
    first = _call(world, ops.CREATE, "rest", req)
    again = _call(world, ops.CREATE, "gateway", req)
    sdk = _call(world, ops.CREATE, "sdk-aether", req)
    assert first.id == again.id == sdk.id
    other = msgspec.structs.replace(req, spec=SandboxSpec(labels={"retry": "2"}))
    got = _as(world, ops.CREATE, "gateway", other, world.cluster.api_key)
    assert got[:2] == (409, "conflict") and "different request" in got[2], got


@pytest.mark.parametrize("name", ["exec", "exec_many"])
def test_a_command_answers_the_same_at_every_door(world: World, name: str) -> None:
    """Bytes that are not UTF-8 (base64 on REST, raw in msgpack) and both streams come
    back the same through every door (duration aside)."""
    op = ops.BY_NAME[name]
    req = ExecRequest(shell="cat; cat /nope; exit 3", stdin=b"\xff\x00ok")
    body: Any = (ExecMany(calls=[ExecCall(id=world.sid, req=req)]) if name == "exec_many"
                 else ExecCall(id=world.sid, req=req))
    seen = {}
    for door in _doors(op):
        reply = _call(world, op, door, body)
        result = reply.items[0].value if name == "exec_many" else reply
        seen[door] = (result.exit_code, result.stdout, result.stderr, result.timed_out)
    assert set(seen.values()) == {
        (3, b"\xff\x00ok", b"cat: /nope: No such file or directory\n", False)}, seen
    assert len(seen) == 5, seen


def _streamed(w: World, door: str, body: ExecCall) -> tuple[int, bytes, bytes]:
    """(exit code, stdout, stderr) of an exec_stream, chunks and final reply together."""
    op, cl = ops.EXEC_STREAM, w.cluster
    items: list[Any]
    if door == "rest":
        r = encode_request(op, body)
        resp = w.rest(r.method, r.path, params=r.params, headers=r.headers,
                      content=r.content)
        assert resp.status_code == 200, resp.text
        items = [stream_item(msgspec.json.decode(ln, type=ExecStreamLine))
                 for ln in resp.content.splitlines() if ln]
    elif door.startswith("sdk-"):
        with cl.client(protocol=door.removeprefix("sdk-"), session_lease_s=None) as c:
            assert body.req.shell is not None
            items = list(c.sandboxes.get(body.id).exec_stream(body.req.shell,
                                                              stdin=body.req.stdin))
    else:
        async def run() -> list[Any]:
            gw = door == "gateway"
            assert cl.gateway is not None
            conn = await connect(cl.gateway if gw else _edge_address(cl),
                                 token=cl.api_key if gw else None)
            try:
                s = conn.stream(op.api_method if gw else op.edge_method, _raw(body),
                                item_type=ExecChunk, response_type=ExecResult,
                                timeout=TIMEOUT)
                async with s:
                    got = [i async for i in s]
                return [*got, s.result]
            finally:
                await conn.close()
        items = cl._on_loop(run(), timeout=TIMEOUT)
    *chunks, final = items
    assert isinstance(final, ExecResult), final
    out = b"".join(c.data for c in chunks if c.stream == "stdout") + final.stdout
    err = b"".join(c.data for c in chunks if c.stream == "stderr") + final.stderr
    return final.exit_code, out, err


def test_a_streamed_command_answers_the_same_at_every_door(world: World) -> None:
    body = ExecCall(id=world.sid, req=ExecRequest(shell="cat; cat /nope; exit 3",
                                                  stdin=b"\xff\x00ok"))
    seen = {door: _streamed(world, door, body) for door in _doors(ops.EXEC_STREAM)}
    assert len(seen) == 5 and set(seen.values()) == {
        (3, b"\xff\x00ok", b"cat: /nope: No such file or directory\n")}, seen
