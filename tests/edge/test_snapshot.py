"""Snapshots through EdgeNode and over the wire (EdgeService/EdgeClient), simulated backend."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from dsec.edge.backends.fncall import FncallBackend
from dsec.edge.node import EdgeNode
from dsec.edge.service import EdgeClient, serve_edge
from dsec.errors import (
    Conflict,
    ImageNotFound,
    InUse,
    InvalidArgument,
    InvalidTransition,
)
from dsec.wire.spec import ExecRequest, SandboxSpec

from .conftest import make_node


def sh(cmd: str) -> ExecRequest:
    return ExecRequest(shell=cmd)


async def tree(node: EdgeNode, sid: str) -> dict[str, bytes]:
    """Every file under /workspace with its content."""
    out: dict[str, bytes] = {}
    todo = ["/workspace"]
    while todo:
        d = todo.pop()
        for f in await node.list_dir(sid, d):
            if f.type == "dir":
                todo.append(f.path)
            else:
                out[f.path] = await node.read_file(sid, f.path)
    return out


async def test_chain_restore_unchanged_and_events(node: EdgeNode) -> None:
    sb = await node.create(SandboxSpec(image="py", toolkits=("tools",), project="p/a"))
    await node.exec(sb.id, sh("write /workspace/a one; mkdir /workspace/d; write /workspace/d/b two"))
    await node.write_file(sb.id, "/workspace/x.sh", b"#!", mode=0o755)
    s1 = await node.snapshot(sb.id)
    assert s1.id.startswith("sha256:") and len(s1.id) == 71 and s1.parent is None
    assert (s1.sandbox_id, s1.project, s1.image, s1.toolkits, s1.node) == (
        sb.id, "p/a", "py", ("tools",), "n1")
    assert not s1.unchanged and s1.size_bytes == len(b"onetwo#!")

    again = await node.snapshot(sb.id)           # nothing changed: the same snapshot
    assert again.id == s1.id and again.unchanged

    await node.exec(sb.id, sh("rm /workspace/a; write /workspace/c three"))
    s2 = await node.snapshot(sb.id)
    assert s2.parent == s1.id and s2.id != s1.id

    events = node.events(sb.id)
    snaps = [e for e in events if e.reason == "snapshot"]
    assert [(e.from_state, e.to_state) for e in snaps] == [("running", "running")] * 3
    assert snaps[1].detail == f"{s1.id} (unchanged)"
    assert node.get(sb.id).state == "running" and node.get(sb.id).reason == "requested"

    for snap, want in ((s1, {"/workspace/a": b"one", "/workspace/d/b": b"two",
                             "/workspace/x.sh": b"#!"}),
                       (s2, {"/workspace/c": b"three", "/workspace/d/b": b"two",
                             "/workspace/x.sh": b"#!"})):
        clone = await node.create(SandboxSpec(snapshot=snap.id, project="p/a"))
        assert await tree(node, clone.id) == want
        assert (await node.stat(clone.id, "/workspace/x.sh")).mode == 0o755
        # A fresh sandbox from a snapshot that changed nothing: that snapshot again.
        same = await node.snapshot(clone.id)
        assert same.id == snap.id and same.unchanged
        await node.exec(clone.id, sh("write /workspace/new n"))
        child = await node.snapshot(clone.id)
        assert child.parent == snap.id and child.image == "py" and child.toolkits == ("tools",)
        await node.destroy(clone.id)
        await node.delete_snapshot(child.id)

    listed = await node.snapshots()
    assert [s.id for s in listed] == [s1.id, s2.id]
    assert [s.id for s in await node.snapshots(project="other")] == []
    assert [s.id for s in await node.snapshots(sandbox_id=sb.id)] == [s1.id, s2.id]
    assert (await node.get_snapshot(s2.id[:20])).id == s2.id
    assert set(node.heartbeat().images) >= {s1.id, s2.id}


async def test_paused_sandbox_snapshots_and_stays_paused(node: EdgeNode) -> None:
    sb = await node.create(SandboxSpec())
    await node.exec(sb.id, sh("write /workspace/f x"))
    await node.pause(sb.id)
    snap = await node.snapshot(sb.id)
    assert node.get(sb.id).state == "paused"
    assert not any(e.reason == "auto_resume" for e in node.events(sb.id))
    clone = await node.create(SandboxSpec(snapshot=snap.id))
    assert await node.read_file(clone.id, "/workspace/f") == b"x"


async def test_strip_patterns_leave_residue_out(node: EdgeNode) -> None:
    sb = await node.create(SandboxSpec())
    await node.exec(sb.id, sh("mkdir /workspace/__pycache__ /workspace/src; "
                              "write /workspace/__pycache__/m.pyc c; write /workspace/src/m.py s; "
                              "write /workspace/src/k.pyc c; write /workspace/answer.txt 42"))
    snap = await node.snapshot(sb.id, strip=["__pycache__", "*.pyc", "workspace/answer.txt"])
    clone = await node.create(SandboxSpec(snapshot=snap.id))
    assert await tree(node, clone.id) == {"/workspace/src/m.py": b"s"}
    # the source sandbox keeps its files: strip only shapes the snapshot
    assert await node.read_file(sb.id, "/workspace/answer.txt") == b"42"
    with pytest.raises(InvalidArgument, match="strip"):
        await node.snapshot(sb.id, strip="*.pyc")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="strip pattern"):
        await node.snapshot(sb.id, strip=[""])


async def test_delete_in_use_and_errors(node: EdgeNode) -> None:
    sb = await node.create(SandboxSpec())
    await node.exec(sb.id, sh("write /workspace/a 1"))
    s1 = await node.snapshot(sb.id)
    await node.exec(sb.id, sh("write /workspace/a 2"))
    s2 = await node.snapshot(sb.id)
    with pytest.raises(InUse, match=f"snapshot {s2.id} builds on it"):
        await node.delete_snapshot(s1.id)
    user = await node.create(SandboxSpec(snapshot=s2.id))
    with pytest.raises(InUse, match=user.id):
        await node.delete_snapshot(s2.id)
    await node.destroy(user.id)
    assert (await node.delete_snapshot(s2.id)).id == s2.id
    assert (await node.delete_snapshot(s1.id)).id == s1.id
    assert await node.snapshots() == []
    # The sandbox's previous snapshot is gone: the next one sits on the image again.
    s3 = await node.snapshot(sb.id)
    assert s3.parent is None and not s3.unchanged

    with pytest.raises(ImageNotFound):
        await node.get_snapshot(s1.id)
    with pytest.raises(ImageNotFound):
        await node.create(SandboxSpec(snapshot=s1.id))
    with pytest.raises(InvalidArgument, match="snapshot id"):
        await node.get_snapshot("latest")
    with pytest.raises(InvalidArgument, match="workspace and toolkits"):
        await node.create(SandboxSpec(snapshot=s3.id, toolkits=("t",)))
    await node.destroy(sb.id)
    with pytest.raises(InvalidTransition):
        await node.snapshot(sb.id)
    # failed creates left nothing reserved
    assert node.pool.usage().sandboxes == 0


async def test_backend_without_snapshots_is_a_conflict(tmp_path: object) -> None:
    node = make_node(FncallBackend(pool_size=1, root=str(tmp_path)))
    await node.start()
    try:
        sb = await node.create(SandboxSpec(backend="fncall"))
        with pytest.raises(Conflict, match="cannot take snapshots"):
            await node.snapshot(sb.id)
        assert await node.snapshots() == []
        await node.destroy(sb.id)
    finally:
        await node.close()


@pytest.fixture
async def wire(tmp_path: object) -> AsyncIterator[tuple[EdgeNode, EdgeClient]]:
    node = make_node()
    await node.start()
    server = await serve_edge(node, f"unix:{tmp_path}/edge.sock")
    client = await EdgeClient.connect(f"unix:{tmp_path}/edge.sock", timeout=10)
    try:
        yield node, client
    finally:
        await client.close()
        await server.close()
        await node.close()


async def test_snapshots_over_the_wire(wire: tuple[EdgeNode, EdgeClient]) -> None:
    _, c = wire
    sb = await c.create(image="base")
    await c.write_file(sb.id, "/workspace/f", b"data")
    snap = await c.snapshot(sb.id, strip=["*.tmp"])
    assert snap.node == "n1" and snap.sandbox_id == sb.id
    assert (await c.snapshot(sb.id)).unchanged
    clone = await c.create(snapshot=snap.id)
    assert await c.read_file(clone.id, "/workspace/f") == b"data"
    assert [s.id for s in await c.snapshots()] == [snap.id]
    assert (await c.get_snapshot(snap.id)).id == snap.id
    with pytest.raises(InUse):
        await c.delete_snapshot(snap.id)
    await c.destroy(clone.id)
    assert (await c.delete_snapshot(snap.id)).id == snap.id
    with pytest.raises(ImageNotFound):
        await c.get_snapshot(snap.id)
    with pytest.raises(InvalidArgument):
        await c.snapshot(sb.id, strip=["a\0b"])
