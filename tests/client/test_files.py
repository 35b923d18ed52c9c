"""``sb.files`` end to end through the SDK, sync and async, over REST and the Aether
gateway (issue 19, "Files"): streamed write and read, upload/download with progress,
rename/stat/exists/mkdir, watch, the paused-sandbox rule, and the refusals every door
must give alike. The sandboxes are simulated (the bytes still cross every hop: SDK,
gateway or REST, the apiserver's edge link, the edge); real container sandboxes, 256 MiB
round trips, bounded memory and confinement: tests/client/test_files_container.py and
tests/edge/container/test_file_streams.py."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from dsec import Client, InvalidArgument, LocalCluster, NotFound
from dsec.errors import PermissionDenied
from dsec.wire.files import FileEvent


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(edges=1) as cl:
        yield cl


@pytest.fixture(params=["http", "aether"])
def client(request: pytest.FixtureRequest, cluster: LocalCluster) -> Iterator[Client]:
    with cluster.client(protocol=request.param, session_lease_s=None) as c:
        c.info()
        assert c.transport_name == request.param
        yield c


def _data(n: int) -> bytes:
    block = hashlib.sha256(str(n).encode()).digest() * 2048
    return (block * (n // len(block) + 1))[:n]


def test_stream_write_and_read_every_kind_of_source(client: Client, tmp_path: object) -> None:
    data = _data(20 << 20)   # past one Aether frame (16 MiB) and read_file's 8 MiB pieces
    with client.sandboxes.create() as sb:
        seen: list[int] = []
        info = sb.files.write("/tmp/a", data, progress=seen.append)
        assert info is not None and info.size == len(data) and info.path == "/tmp/a"
        assert seen[-1] == len(data) and seen == sorted(seen)
        got = b"".join(sb.files.read("/tmp/a", stream=True))
        assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
        assert b"".join(sb.files.read("/tmp/a", stream=True, offset=7, length=99)) == \
            data[7:106]
        # a file object, a generator, a str
        sb.files.write("/tmp/b", io.BytesIO(data[:3 << 20]))
        assert sb.files.read("/tmp/b") == data[:3 << 20]
        sb.files.write("/tmp/c", (data[i:i + 100_000] for i in range(0, 1_000_000, 100_000)))
        assert sb.files.read("/tmp/c") == data[:1_000_000]
        sb.files.write("/tmp/d", "text", mode=0o600)
        assert sb.files.stat("/tmp/d").mode == 0o600 and sb.files.read_text("/tmp/d") == "text"
        # the announced size is checked: fewer bytes than said change nothing
        with pytest.raises(InvalidArgument, match="size=10 was announced"):
            sb.files.write("/tmp/d", iter([b"abc"]), size=10)
        assert sb.files.read_text("/tmp/d") == "text"


def test_upload_and_download_with_progress(client: Client, tmp_path: object) -> None:
    src = os.path.join(str(tmp_path), "src.bin")
    data = _data(5 << 20)
    with open(src, "wb") as f:
        f.write(data)
    os.chmod(src, 0o640)
    with client.sandboxes.create() as sb:
        ups: list[int] = []
        info = sb.files.upload(src, "/tmp/up/src.bin", progress=ups.append)
        assert info.size == len(data) and info.mode == 0o640 and ups[-1] == len(data)
        downs: list[int] = []
        dest = os.path.join(str(tmp_path), "dest")
        os.mkdir(dest)
        got = sb.files.download("/tmp/up/src.bin", dest, progress=downs.append)
        assert got.size == len(data) and downs[-1] == len(data)
        with open(os.path.join(dest, "src.bin"), "rb") as f:
            assert f.read() == data
        # a failed download leaves nothing: no partial file, no temporary file
        with pytest.raises(NotFound):
            sb.files.download("/tmp/nope", os.path.join(dest, "nope"))
        assert sorted(os.listdir(dest)) == ["src.bin"]


def test_rename_stat_exists_mkdir(client: Client) -> None:
    with client.sandboxes.create() as sb:
        sb.files.mkdir("/tmp/m/n")
        assert sb.files.stat("/tmp/m/n").type == "dir" and sb.files.exists("/tmp/m")
        sb.files.write("/tmp/m/a", b"1")
        sb.files.write("/tmp/m/b", b"2")
        with pytest.raises(InvalidArgument, match="exists; pass overwrite=True"):
            sb.files.rename("/tmp/m/a", "/tmp/m/b")
        info = sb.files.rename("/tmp/m/a", "/tmp/m/b", overwrite=True)
        assert info.path == "/tmp/m/b" and info.size == 1
        assert not sb.files.exists("/tmp/m/a") and sb.files.read("/tmp/m/b") == b"1"
        with pytest.raises(NotFound):
            sb.files.rename("/tmp/m/a", "/tmp/m/c")


def test_watch_yields_changes(client: Client) -> None:
    with client.sandboxes.create() as sb:
        sb.files.mkdir("/tmp/w")
        events: list[FileEvent] = []

        def watch() -> None:
            for ev in sb.files.watch("/tmp/w", timeout=2.0):
                events.append(ev)
                if len(events) == 3:
                    return
        t = threading.Thread(target=watch)
        t.start()
        time.sleep(0.5)
        sb.files.write("/tmp/w/a", b"1")     # atomic: appears whole (create)
        sb.files.write("/tmp/w/a", b"2", append=True)
        sb.files.remove("/tmp/w/a")
        t.join(10)
        assert [(e.type, e.path) for e in events] == [
            ("create", "/tmp/w/a"), ("write", "/tmp/w/a"), ("remove", "/tmp/w/a")]


def test_reads_of_a_paused_sandbox_leave_it_paused_writes_resume_it(client: Client) -> None:
    """The paused-sandbox rule (docs/sdk.md "Paused sandboxes"), at both API doors."""
    with client.sandboxes.create() as sb:
        sb.files.write("/tmp/f", b"data")
        sb.pause()
        assert sb.files.read("/tmp/f") == b"data"
        assert b"".join(sb.files.read("/tmp/f", stream=True)) == b"data"
        assert sb.files.stat("/tmp/f").size == 4 and sb.files.exists("/tmp/f")
        assert [i.name for i in sb.files.list("/tmp")] == ["f"]
        assert client.sandboxes.get(sb.id).info.state == "paused"
        sb.files.write("/tmp/g", b"x")              # a write resumes it ...
        assert client.sandboxes.get(sb.id).info.state == "running"
        reasons = [(e.to_state, e.reason) for e in sb.events()]
        # ... recorded `auto_resume`, whether the control plane resumed it first (within
        # the project's quota: red team 19 B3) or the edge was reached directly
        assert reasons[-2:] == [("resuming", "auto_resume"), ("running", "auto_resume")], \
            reasons
        sb.resume()                                 # resume() of a running one: a no-op
        assert client.sandboxes.get(sb.id).info.state == "running"
        assert len(sb.events()) == len(reasons)
        sb.pause()
        sb.resume()                                 # asked for: `requested`
        reasons = [(e.to_state, e.reason) for e in sb.events()]
        assert reasons[-2:] == [("resuming", "requested"), ("running", "requested")], reasons


def test_a_reader_may_read_but_not_write(cluster: LocalCluster) -> None:
    key = cluster.create_key(f"files-reader-{os.getpid()}", "default", "reader")
    with cluster.client(session_lease_s=None) as owner:
        sb = owner.sandboxes.create()
        sb.files.write("/tmp/f", b"secret")
        try:
            for proto in ("http", "aether"):
                with Client(cluster.url, key, gateway=cluster.gateway, protocol=proto,
                            session_lease_s=None) as c:
                    rsb = c.sandboxes.get(sb.id)
                    assert b"".join(rsb.files.read("/tmp/f", stream=True)) == b"secret"
                    with pytest.raises(PermissionDenied):
                        rsb.files.write("/tmp/g", b"x")
                    with pytest.raises(PermissionDenied):
                        rsb.files.rename("/tmp/f", "/tmp/h")
            assert owner.sandboxes.get(sb.id).files.read("/tmp/f") == b"secret"
            assert not sb.files.exists("/tmp/g")
        finally:
            sb.kill()


@pytest.mark.parametrize("proto", ["http", "aether"])
async def test_async_files(cluster: LocalCluster, proto: str) -> None:
    async with cluster.async_client(protocol=proto, session_lease_s=None) as c:
        sb = await c.sandboxes.create()
        try:
            async def gen() -> AsyncIterator[bytes]:
                for i in range(5):
                    yield bytes([i]) * 300_000
                    await asyncio.sleep(0)
            info = await sb.files.write("/tmp/a", gen())
            assert info is not None and info.size == 1_500_000
            chunks = [c async for c in await sb.files.read("/tmp/a", stream=True)]
            assert b"".join(chunks) == b"".join(bytes([i]) * 300_000 for i in range(5))
            assert (await sb.files.rename("/tmp/a", "/tmp/b")).path == "/tmp/b"
            assert await sb.files.exists("/tmp/b") and not await sb.files.exists("/tmp/a")
        finally:
            await sb.kill()
