"""Container snapshots through EdgeNode with the layer store (StoreImages + pack_diff):
chains, exact restore (contents, modes, symlinks, deletions), toolkit layers, unchanged
snapshots, InUse, paused sandboxes, and nothing left mounted or in cgroups afterwards."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec.edge.admission import Capacity
from dsec.edge.backends.container import ContainerBackend
from dsec.edge.backends.container.images import StoreImages
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.errors import Conflict, ImageNotFound, InUse
from dsec.image import LayerStore, MountCache, ensure_busybox_base
from dsec.image.packdiff import RACY_WINDOW_NS
from dsec.wire.spec import ExecRequest, SandboxSpec

from .conftest import _cleanup

pytestmark = pytest.mark.root

SPEC = {"backend": "container", "memory_bytes": 256 << 20, "pids_max": 256}
# What a tree looks like to a test: every path under the dirs the test touches, with
# type, mode, link target, and a checksum of regular files (directory sizes depend on
# the filesystem). /tmp is a tmpfs in the sandbox (not part of the root), so the tests
# write elsewhere.
LISTING = ("cd / && find etc opt root work -xdev | sort | xargs stat -c '%n %F %a %N' "
           "&& find etc opt root work -xdev -type f | sort | xargs md5sum")


@dataclass
class Env:
    node: EdgeNode
    backend: ContainerBackend
    store: LayerStore
    cache: MountCache


@pytest.fixture
async def env(tmp_path: object) -> AsyncIterator[Env]:
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    root = str(tmp_path)
    store = LayerStore(os.path.join(root, "layers"))
    base = ensure_busybox_base(store)
    store.tag(base.digest, "base")
    tools = os.path.join(root, "tools")
    os.makedirs(os.path.join(tools, "opt/tools/lib"))
    Path(tools, "opt/tools/run.sh").write_text("#!/bin/sh\necho tool-ran\n")
    os.chmod(os.path.join(tools, "opt/tools/run.sh"), 0o755)
    Path(tools, "opt/tools/lib/data.txt").write_text("toolkit data\n")
    store.add_tree(tools, kind="toolkit", name="mytools")
    cache = MountCache()
    backend = ContainerBackend(root_dir=os.path.join(root, "c"),
                               images=StoreImages(store, cache))
    node = EdgeNode(NodeConfig(node_id="n1", capacity=Capacity(
        cpu_milli=64_000, memory_bytes=64 << 30, max_sandboxes=64)), backend,
        rng=random.Random(3))
    await node.start()
    try:
        yield Env(node, backend, store, cache)
    finally:
        ids = [i.id for i in node.list()]
        if ids:
            await node.destroy_many(ids)
        gov = backend.governor
        await _cleanup(backend)
        await node.close()
        try:
            assert cache.mounted() == {}, "layers still mounted after every sandbox went"
            assert gov.list_sandboxes() == []
        finally:
            cache.close()
        assert cache.root not in Path("/proc/self/mountinfo").read_text()


async def run(node: EdgeNode, sid: str, cmd: str) -> str:
    r = await node.exec(sid, ExecRequest(shell=cmd, timeout_s=30))
    assert r.exit_code == 0, (cmd, r.stdout, r.stderr)
    return r.stdout.decode()


async def test_chain_restores_exact_trees(env: Env) -> None:
    node = env.node
    sb = await node.create(SandboxSpec(image="base", toolkits=("mytools",), **SPEC))
    # the toolkit layer is visible and runs
    assert await run(node, sb.id, "/opt/tools/run.sh") == "tool-ran\n"
    await run(node, sb.id, "mkdir -p /work/src/pkg && echo one > /work/src/a.txt && "
              "printf 'x\\0y' > /work/src/bin.dat && chmod 640 /work/src/a.txt && "
              "ln -s ../src/a.txt /work/src/link && ln -s /nowhere /work/dangling && "
              "rm /etc/motd 2>/dev/null; rm /etc/hostname && echo changed > /etc/hosts && "
              "echo mine >> /opt/tools/lib/data.txt && chmod 700 /work/src/pkg")
    want1 = await run(node, sb.id, LISTING)
    s1 = await node.snapshot(sb.id)
    assert s1.parent is None and s1.toolkits == ("mytools",) and s1.image == "base"
    m1 = env.store.get(s1.id)
    assert m1.kind == "snapshot" and m1.labels["dsec.io/sandbox"] == sb.id

    # second step: delete a dir, replace a file by a dir, change modes and a symlink
    await run(node, sb.id, "rm -rf /work/src/pkg /opt/tools/lib && rm /work/src/link && "
              "ln -s /etc/passwd /work/src/link && rm /work/src/bin.dat && "
              "mkdir /work/src/bin.dat && echo inner > /work/src/bin.dat/f && "
              "chmod 600 /etc/hosts && echo r > /root/.profile")
    want2 = await run(node, sb.id, LISTING)
    s2 = await node.snapshot(sb.id)
    assert s2.parent == s1.id and s2.size_bytes > 0

    # Entries changed within pack_diff's racy window (coarse ctime) are captured once
    # more by the next snapshot; past it, an unchanged sandbox gives the same snapshot.
    await asyncio.sleep(RACY_WINDOW_NS / 1e9 + 0.02)
    s3 = await node.snapshot(sb.id)
    same = await node.snapshot(sb.id)
    assert same.id == s3.id and same.unchanged
    assert s3.parent in (s2.id, s2.parent) or s3.id == s2.id
    assert [e.reason for e in node.events(sb.id)].count("snapshot") == 4

    for snap, want in ((s1, want1), (s2, want2)):
        clone = await node.create(SandboxSpec(snapshot=snap.id, **SPEC))
        assert await run(node, clone.id, LISTING) == want
        # started from a snapshot and unchanged: that snapshot again
        again = await node.snapshot(clone.id)
        assert again.id == snap.id and again.unchanged
        await node.destroy(clone.id)

    # the toolkit's own layer never changed: writes went to the sandbox's upperdir
    assert os.path.exists(os.path.join(env.backend.upper_dir(sb.id), "opt/tools"))
    fresh = await node.create(SandboxSpec(image="base", toolkits=("mytools",), **SPEC))
    assert await run(node, fresh.id, "cat /opt/tools/lib/data.txt") == "toolkit data\n"
    r = await node.exec(fresh.id, ExecRequest(shell="touch /opt/tools/x"))
    assert r.exit_code == 0  # the root is writable; the layer below is not touched
    tool = env.store.get("mytools")
    with pytest.raises(InUse):  # a snapshot builds on the toolkit (and it is mounted)
        env.store.remove(tool.digest)


async def test_incremental_snapshot_of_a_clone_and_in_use(env: Env) -> None:
    node = env.node
    sb = await node.create(SandboxSpec(image="base", **SPEC))
    await run(node, sb.id, "echo a > /work/a")
    s1 = await node.snapshot(sb.id)
    clone = await node.create(SandboxSpec(snapshot=s1.id, **SPEC))
    await run(node, clone.id, "echo b > /work/b && rm /work/a")
    c1 = await node.snapshot(clone.id)
    assert c1.parent == s1.id and c1.sandbox_id == clone.id
    await run(node, clone.id, "echo c > /work/c")
    c2 = await node.snapshot(clone.id)
    assert c2.parent == c1.id

    with pytest.raises(InUse, match="in use by sandbox"):
        await node.delete_snapshot(s1.id)
    listed = [s.id for s in await node.snapshots()]
    assert listed == [s1.id, c1.id, c2.id]
    assert set(node.heartbeat().images) >= {s1.id, c1.id, c2.id, "base:latest"}

    leaf = await node.create(SandboxSpec(snapshot=c2.id, **SPEC))
    assert await run(node, leaf.id, "ls /work") == "b\nc\n"
    await node.destroy(leaf.id)
    await node.destroy(clone.id)
    with pytest.raises(InUse, match="builds on it"):
        await node.delete_snapshot(c1.id)
    await node.delete_snapshot(c2.id)
    await node.delete_snapshot(c1.id)
    await node.destroy(sb.id)
    await node.delete_snapshot(s1.id)
    assert await node.snapshots() == []
    with pytest.raises(ImageNotFound):
        await node.create(SandboxSpec(snapshot=s1.id, **SPEC))
    assert node.pool.usage().sandboxes == 0


async def test_paused_sandbox_stays_paused_and_strip(env: Env) -> None:
    node = env.node
    sb = await node.create(SandboxSpec(image="base", **SPEC))
    await run(node, sb.id, "mkdir -p /work/__pycache__ && echo c > /work/__pycache__/m.pyc && "
              "echo keep > /work/keep && echo 42 > /work/answer")
    await node.pause(sb.id)
    snap = await node.snapshot(sb.id, strip=["__pycache__", "work/answer"])
    assert node.get(sb.id).state == "paused"
    assert env.backend.governor.is_frozen(env.backend.box(sb.id).cg)
    clone = await node.create(SandboxSpec(snapshot=snap.id, **SPEC))
    assert await run(node, clone.id, "ls -a /work") == ".\n..\nkeep\n"
    # a running sandbox is thawed again after its snapshot
    await node.resume(sb.id)
    await run(node, sb.id, "echo more > /work/more")
    await node.snapshot(sb.id)
    assert not env.backend.governor.is_frozen(env.backend.box(sb.id).cg)
    assert await run(node, sb.id, "cat /work/answer") == "42\n"


async def test_disk_capped_sandbox_snapshots_and_restores(env: Env) -> None:
    """pack_diff reads the upper in the sandbox's disk subvolume like any directory."""
    node = env.node
    capped = dict(SPEC, disk_bytes=16 << 20)
    sb = await node.create(SandboxSpec(image="base", **capped))
    assert env.backend.upper_dir(sb.id) == os.path.join(env.backend.root_dir, "pool", sb.id,
                                                        "upper")
    await run(node, sb.id, "mkdir -p /work && echo on-tmpfs > /work/f && rm /etc/hostname")
    want = await run(node, sb.id, LISTING)
    snap = await node.snapshot(sb.id)
    clone = await node.create(SandboxSpec(snapshot=snap.id, **capped))
    assert await run(node, clone.id, LISTING) == want
    await node.destroy(clone.id)
    await node.destroy(sb.id)
    assert env.backend.disk.sandboxes() == []


async def test_directory_images_cannot_snapshot(tmp_path: object, images_dir: str) -> None:
    from dsec.edge.backends.container import DirectoryImages

    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "d"),
                         images=DirectoryImages(images_dir))
    node = EdgeNode(NodeConfig(node_id="n1", capacity=Capacity(
        cpu_milli=8000, memory_bytes=8 << 30, max_sandboxes=4)), b)
    await node.start()
    try:
        sb = await node.create(SandboxSpec(**SPEC))
        with pytest.raises(Conflict, match="plain directories"):
            await node.snapshot(sb.id)
        assert await node.snapshots() == []
        await node.destroy(sb.id)
    finally:
        await _cleanup(b)
        await node.close()
