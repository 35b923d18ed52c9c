"""Streamed files on real container sandboxes, at the edge door (issue 19, "Files"):
``file_read_stream``/``file_write_stream`` over a real Aether socket (duplex, credit),
atomic replacement (a dropped upload leaves the old file and no temporary file), the
disk cap refused with nothing left behind, ``file_rename`` and ``file_watch``, path
confinement against symlinks for every one of them, and the paused-sandbox rule."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from dsec.edge.admission import Capacity
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.client import EdgeClient
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.edge.service import serve_edge
from dsec.errors import InvalidArgument, NotFound, QuotaExceeded, StreamReset
from dsec.wire import ops
from dsec.wire.files import FileEvent, ReadStream, Rename, Watch, WatchEnd, WriteStream
from dsec.wire.spec import ExecRequest, SandboxSpec

from .conftest import _cleanup

pytestmark = pytest.mark.root

SPEC = SandboxSpec(backend="container", memory_bytes=256 << 20, pids_max=256)


@dataclass
class Edge:
    node: EdgeNode
    client: EdgeClient
    backend: ContainerBackend


@pytest.fixture
async def edge(tmp_path: object, images_dir: str) -> AsyncIterator[Edge]:
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    backend = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                               images=DirectoryImages(images_dir))
    cfg = NodeConfig(node_id="t1", capacity=Capacity(cpu_milli=64_000,
                                                     memory_bytes=64 << 30, max_sandboxes=64),
                     state_dir=os.path.join(str(tmp_path), "state"))
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


def _pattern(n: int, seed: int = 0) -> bytes:
    block = hashlib.sha256(str(seed).encode()).digest() * 2048  # 64 KiB
    return (block * (n // len(block) + 1))[:n]


async def _upload(c: EdgeClient, sid: str, path: str, data: bytes, *,
                  size: int | None = None, piece: int = 1 << 20) -> object:
    s = c.tunnel(ops.FILE_WRITE_STREAM, WriteStream(id=sid, path=path, size=size))
    for at in range(0, len(data), piece):
        await s.send(data[at:at + piece])
    s.close_write()
    return await s.result()


async def _download(c: EdgeClient, sid: str, path: str, **kw: int) -> tuple[bytes, object]:
    s = c.tunnel(ops.FILE_READ_STREAM, ReadStream(id=sid, path=path, **kw))
    s.close_write()
    out = bytearray()
    while chunk := await s.recv():
        out += chunk
    return bytes(out), await s.result()


def _host_write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _host_read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


async def _sh(node: EdgeNode, sid: str, cmd: str) -> str:
    r = await node.exec(sid, ExecRequest(shell=cmd))
    return r.stdout.decode()


async def test_stream_round_trip_past_the_frame_cap(edge: Edge) -> None:
    sid = (await edge.node.create(SPEC)).id
    data = _pattern(40 << 20, 1)   # past Aether's 16 MiB frame and read_file's one frame
    info = await _upload(edge.client, sid, "/work/big.bin", data, size=len(data))
    assert info.size == len(data) and info.path == "/work/big.bin"   # type: ignore[attr-defined]
    # the sandbox sees exactly those bytes
    out = await _sh(edge.node, sid, "sha256sum /work/big.bin")
    assert out.split()[0] == hashlib.sha256(data).hexdigest()
    got, rinfo = await _download(edge.client, sid, "/work/big.bin")
    assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    assert rinfo.size == len(data)   # type: ignore[attr-defined]
    part, _ = await _download(edge.client, sid, "/work/big.bin", offset=5, length=100_000)
    assert part == data[5:100_005]
    assert "dsec-upload" not in await _sh(edge.node, sid, "ls -a /work")


async def test_a_dropped_upload_leaves_the_old_file_and_nothing_else(edge: Edge) -> None:
    sid = (await edge.node.create(SPEC)).id
    await edge.node.write_file(sid, "/work/f", b"old")
    s = edge.client.tunnel(ops.FILE_WRITE_STREAM, WriteStream(id=sid, path="/work/f"))
    await s.send(b"x" * (3 << 20))
    s.reset()                        # the caller goes away mid-upload
    for _ in range(100):
        listing = await _sh(edge.node, sid, "ls -a /work")
        if "dsec-upload" not in listing:
            break
        await asyncio.sleep(0.05)
    assert listing.split() == [".", "..", "f"], listing
    assert await edge.node.read_file(sid, "/work/f") == b"old"
    # an announced size that does not arrive: refused, nothing changed either
    with pytest.raises(InvalidArgument, match="size=10 was announced"):
        await _upload(edge.client, sid, "/work/f", b"short", size=10)
    assert await edge.node.read_file(sid, "/work/f") == b"old"
    assert (await _sh(edge.node, sid, "ls -a /work")).split() == [".", "..", "f"]


async def test_the_disk_cap_is_refused_with_nothing_left(edge: Edge) -> None:
    sid = (await edge.node.create(SandboxSpec(backend="container", memory_bytes=256 << 20,
                                              disk_bytes=32 << 20))).id
    await edge.node.write_file(sid, "/work/f", b"old")
    # announced: refused before a byte is written
    with pytest.raises(QuotaExceeded, match="nothing was changed"):
        await _upload(edge.client, sid, "/work/f", b"", size=64 << 20)
    # unannounced: the disk fills, the upload fails, its partial file is removed
    with pytest.raises(QuotaExceeded, match="partial upload was removed"):
        await _upload(edge.client, sid, "/work/f", _pattern(48 << 20))
    assert await edge.node.read_file(sid, "/work/f") == b"old"
    assert (await _sh(edge.node, sid, "ls -a /work")).split() == [".", "..", "f"]
    used = int((await _sh(edge.node, sid, "du -sk /work")).split()[0])
    assert used < 1024, used


async def test_symlinks_never_lead_out_of_the_sandbox(edge: Edge, tmp_path: object) -> None:
    sid = (await edge.node.create(SPEC)).id
    host_dir = os.path.join(str(tmp_path), "host")
    os.makedirs(host_dir)
    _host_write(os.path.join(host_dir, "secret"), b"host secret")
    await _sh(edge.node, sid, f"mkdir -p /work && ln -s {host_dir} /work/out && "
                              f"ln -s {host_dir}/secret /work/sec && ln -s ../../.. /work/up")
    # read: resolves inside the root (no such file there), never the host's
    with pytest.raises(NotFound):
        await _download(edge.client, sid, "/work/sec")
    with pytest.raises(NotFound):
        await _download(edge.client, sid, "/work/up/" + host_dir.lstrip("/") + "/secret")
    # write through a symlinked directory: lands inside the sandbox, the host untouched
    await _sh(edge.node, sid, f"mkdir -p {host_dir}")
    await _upload(edge.client, sid, "/work/out/new", b"inside")
    assert not os.path.exists(os.path.join(host_dir, "new"))
    assert (await _sh(edge.node, sid, f"cat {host_dir}/new")) == "inside"
    # write over a symlink: replaces the link itself, not its target
    await _upload(edge.client, sid, "/work/sec", b"replaced")
    assert _host_read(os.path.join(host_dir, "secret")) == b"host secret"
    # rename: a symlinked parent resolves inside; a moved link stays a link
    await edge.client.call(ops.FILE_RENAME, Rename(id=sid, src="/work/out/new",
                                                   dst="/work/out/moved"))
    assert not os.path.exists(os.path.join(host_dir, "moved"))
    assert (await _sh(edge.node, sid, f"cat {host_dir}/moved")) == "inside"
    await _upload(edge.client, sid, "/work/out/other", b"other")
    with pytest.raises(InvalidArgument, match="exists"):
        await edge.client.call(ops.FILE_RENAME, Rename(id=sid, src="/work/out/other",
                                                       dst=f"{host_dir}/moved"))
    await edge.client.call(ops.FILE_RENAME, Rename(id=sid, src="/work/up",
                                                   dst="/work/up2"))
    assert (await _sh(edge.node, sid, "readlink /work/up2")) == "../../..\n"
    # watch through a symlinked directory: watches the sandbox's, sees nothing of the host
    s = edge.client.stream(ops.FILE_WATCH, Watch(id=sid, path="/work/out", recursive=True))
    events: list[FileEvent] = []

    async def collect() -> None:
        async for ev in s:
            if isinstance(ev, FileEvent):
                events.append(ev)
    task = asyncio.create_task(collect())
    await asyncio.sleep(0.3)
    _host_write(os.path.join(host_dir, "hostfile"), b"x")
    await _sh(edge.node, sid, f"echo hi > {host_dir}/seen")
    for _ in range(50):
        if events:
            break
        await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert [e.name for e in events] == ["seen"] * len(events) and events, events


async def test_watch_reports_changes_and_ends_with_its_directory(edge: Edge) -> None:
    sid = (await edge.node.create(SPEC)).id
    await _sh(edge.node, sid, "mkdir -p /work/w/sub")
    got: list[FileEvent] = []
    ended: list[object] = []

    async def run() -> None:
        async for ev in edge.client.stream(ops.FILE_WATCH,
                                           Watch(id=sid, path="/work/w", recursive=True)):
            if isinstance(ev, WatchEnd):
                ended.append(ev)
            else:
                got.append(ev)
    task = asyncio.create_task(run())
    await asyncio.sleep(0.3)
    await _sh(edge.node, sid, "echo a > /work/w/a; echo b >> /work/w/a; chmod 600 /work/w/a;"
                              " mv /work/w/a /work/w/b; mkdir /work/w/sub/new; sleep 0.1;"
                              " echo c > /work/w/sub/new/c; rm /work/w/b")
    await asyncio.sleep(0.3)
    kinds = [(e.type, e.path) for e in got]
    for want in [("create", "/work/w/a"), ("write", "/work/w/a"), ("chmod", "/work/w/a"),
                 ("rename", "/work/w/a"), ("create", "/work/w/b"),
                 ("create", "/work/w/sub/new"), ("create", "/work/w/sub/new/c"),
                 ("remove", "/work/w/b")]:
        assert want in kinds, (want, kinds)
    # an atomic upload is one create of its target: its temporary file is never shown
    await _upload(edge.client, sid, "/work/w/up", b"x" * 100)
    await asyncio.sleep(0.3)
    assert ("create", "/work/w/up") in [(e.type, e.path) for e in got]
    assert not [e for e in got if ".dsec-upload" in e.path], got
    await _sh(edge.node, sid, "rm -rf /work/w")
    await asyncio.wait_for(task, 5)
    assert ended == [WatchEnd(reason="removed")]


async def test_watches_per_sandbox_are_bounded(edge: Edge) -> None:
    from dsec.errors import ResourceExhausted
    from dsec.wire.files import MAX_WATCHES_PER_SANDBOX
    sid = (await edge.node.create(SPEC)).id
    streams = [edge.client.conn.stream(ops.FILE_WATCH.edge_method,
                                       Watch(id=sid, path="/tmp"), item_type=FileEvent,
                                       response_type=WatchEnd, timeout=None)
               for _ in range(MAX_WATCHES_PER_SANDBOX)]
    await asyncio.sleep(0.5)
    with pytest.raises(ResourceExhausted, match="file watches open"):
        async for _ in edge.client.stream(ops.FILE_WATCH, Watch(id=sid, path="/tmp")):
            pass
    for s in streams:
        s.cancel()


async def test_reads_on_a_paused_sandbox_do_not_resume_it(edge: Edge) -> None:
    sid = (await edge.node.create(SPEC)).id
    await edge.node.write_file(sid, "/work/f", b"data")
    await edge.node.pause(sid)
    assert await edge.node.read_file(sid, "/work/f") == b"data"
    assert (await edge.node.stat(sid, "/work/f")).size == 4
    got, _ = await _download(edge.client, sid, "/work/f")
    assert got == b"data"
    assert edge.node.get(sid).state == "paused"
    # a write resumes it, with an event saying why
    await _upload(edge.client, sid, "/work/g", b"x")
    assert edge.node.get(sid).state == "running"
    assert any(e.reason == "auto_resume" for e in edge.node.events(sid))
    # resume() of a running sandbox is a no-op success
    assert (await edge.node.resume(sid)).state == "running"


async def test_a_destroy_ends_a_stream_with_a_reason(edge: Edge) -> None:
    sid = (await edge.node.create(SPEC)).id
    s = edge.client.tunnel(ops.FILE_WRITE_STREAM, WriteStream(id=sid, path="/work/f"))
    await s.send(b"x" * 1000)
    await asyncio.sleep(0.1)
    await edge.node.destroy(sid)
    with pytest.raises(StreamReset, match="ended"):
        await s.result()


async def test_a_live_upload_has_no_name_and_sandbox_files_named_like_one_stay(
        edge: Edge) -> None:
    """An upload in flight writes an unnamed file (O_TMPFILE): nothing in the directory
    for an edge killed mid-upload to leave behind (red team 19, B11). A file the
    sandbox itself names like a temporary one is the sandbox's: no upload removes it
    (B12: the old by-name sweep deleted it)."""
    sid = (await edge.node.create(SPEC)).id
    await _sh(edge.node, sid, "mkdir -p /work && echo junk > /work/.dsec-upload-dead")
    live = edge.client.tunnel(ops.FILE_WRITE_STREAM, WriteStream(id=sid, path="/work/a"))
    await live.send(b"a" * 1000)
    await asyncio.sleep(0.3)
    names = (await _sh(edge.node, sid, "ls -a /work")).split()
    assert names == [".", "..", ".dsec-upload-dead"], names     # the live one: unnamed
    await _upload(edge.client, sid, "/work/b", b"b")
    live.close_write()
    await live.result()
    assert (await _sh(edge.node, sid, "ls -a /work")).split() == [
        ".", "..", ".dsec-upload-dead", "a", "b"]
    assert await edge.node.read_file(sid, "/work/a") == b"a" * 1000


def _inotify_fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify":
                n += 1
        except OSError:
            continue
    return n


async def _node_watch(node: EdgeNode, sid: str, path: str,
                      into: list[str]) -> None:
    """A watch at the edge door, the paths it reports appended to ``into``."""
    async def send(ev: FileEvent) -> None:
        into.append(ev.path)
    await node.file_watch(Watch(id=sid, path=path), send)


async def test_watches_share_one_inotify_instance_and_a_tenant_share(edge: Edge) -> None:
    """A6: every watch of every sandbox multiplexes the edge's ONE inotify instance (the
    host's per-uid instance budget is not the edge's to spend per watch); two watches of
    the same directory share its kernel watch, and closing one leaves the other
    working; a project is refused past half of the node's watch budget (a clear
    ResourceExhausted) while another project may still watch."""
    from dsec.edge.filestream import watch_budget
    from dsec.errors import ResourceExhausted
    before = _inotify_fds()
    a = (await edge.node.create(SPEC)).id
    b = (await edge.node.create(SPEC)).id
    got: dict[str, list[str]] = {"a1": [], "a2": [], "b": []}
    tasks = {k: asyncio.create_task(_node_watch(edge.node, sid, "/tmp", got[k]))
             for k, sid in (("a1", a), ("a2", a), ("b", b))}
    try:
        await asyncio.sleep(0.3)
        assert _inotify_fds() - before == 1, "not one shared inotify instance"
        await _sh(edge.node, a, "echo x > /tmp/one")
        await _sh(edge.node, b, "echo x > /tmp/other")
        await asyncio.sleep(0.3)
        assert "/tmp/one" in got["a1"] and "/tmp/one" in got["a2"], got
        assert "/tmp/other" in got["b"] and "/tmp/one" not in got["b"], got
        tasks.pop("a1").cancel()
        await asyncio.sleep(0.1)
        await _sh(edge.node, a, "echo y > /tmp/two")
        await asyncio.sleep(0.3)
        assert "/tmp/two" in got["a2"], got        # the shared wd stayed for a2
    finally:
        for t in tasks.values():
            t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
    assert _inotify_fds() == before, "the shared instance outlived its last watch"
    # a tenant's share: half the node's budget (8 per sandbox, spread out)
    share = max(1, watch_budget() // 2)
    spec = SandboxSpec(backend="container", project="greedy", memory_bytes=128 << 20)
    sids = [(await edge.node.create(spec)).id for _ in range(share // 8 + 1)]
    sink: list[str] = []
    held = [asyncio.create_task(_node_watch(edge.node, sids[i // 8], "/tmp", sink))
            for i in range(share)]
    try:
        await asyncio.sleep(0.5)
        assert not [t for t in held if t.done()], "refused within the share"
        with pytest.raises(ResourceExhausted, match="half of the node's budget"):
            await _node_watch(edge.node, sids[-1], "/tmp", sink)
        other = asyncio.create_task(_node_watch(edge.node, b, "/tmp", sink))
        await asyncio.sleep(0.3)
        assert not other.done(), "another project was refused by the greedy one's share"
        other.cancel()
        await asyncio.gather(other, return_exceptions=True)
    finally:
        for t in held:
            t.cancel()
        await asyncio.gather(*held, return_exceptions=True)


async def test_tmpfs_writes_are_charged_to_the_sandbox_and_bounded_by_it(edge: Edge) -> None:
    """A3: bytes the file API writes into a sandbox's tmpfs (/tmp, /dev/shm) are RAM; they
    are written by a helper in the sandbox's memory cgroup, so the sandbox is charged
    (memory_tmpfs_bytes) and its limit bounds them: a write that cannot fit is refused
    up front (write_file, a sized stream) or, streamed without a size, fails when the
    limit is hit - the sandbox's own processes live, nothing is left behind."""
    from dsec.edge.backends.container.files import TEMP_PREFIX
    spec = SandboxSpec(backend="container", memory_bytes=64 << 20, pids_max=64)
    sid = (await edge.node.create(spec)).id
    box = edge.backend.box(sid)
    base = edge.backend.governor.memory_shmem(box.cg)
    await edge.node.write_file(sid, "/tmp/a", _pattern(16 << 20))
    await _upload(edge.client, sid, "/dev/shm/b", _pattern(16 << 20, 1))
    held = edge.backend.governor.memory_shmem(box.cg) - base
    assert held >= 30 << 20, f"32 MiB written to the sandbox's tmpfs, it is charged {held}"
    assert (await edge.node.stats(sid)).memory_tmpfs_bytes >= 30 << 20
    # refused before anything changed: write_file and a sized stream
    with pytest.raises(QuotaExceeded, match="memory limit"):
        await edge.node.write_file(sid, "/tmp/a", _pattern(60 << 20))
    assert _pattern(16 << 20) == (await _download(edge.client, sid, "/tmp/a"))[0]
    with pytest.raises(QuotaExceeded, match="memory limit"):
        await _upload(edge.client, sid, "/tmp/c", _pattern(40 << 20), size=40 << 20)
    # a stream without a size: cut when the limit is hit, its temporary file removed
    with pytest.raises((QuotaExceeded, StreamReset)):
        await _upload(edge.client, sid, "/tmp/d", _pattern(48 << 20, 2))
    out = await _sh(edge.node, sid, "echo alive; ls -a /tmp")
    assert out.startswith("alive"), out
    assert "d" not in out.split() and TEMP_PREFIX not in out, out
    # the disk is not memory: the same bytes to /home are not refused by it
    await edge.node.write_file(sid, "/home/big", _pattern(60 << 20, 3))
