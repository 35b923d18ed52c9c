"""Pushing an image's layer chain to a real blob store (file://, moto S3, nginx WebDAV):
every layer lowest first with its chunk table and manifest, idempotent, whole or not at
all from a reader's view; and access traces stored with the image."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

import msgspec
import pytest

from dsec.errors import CorruptLayer, ImageNotFound, InvalidArgument
from dsec.image import LayerStore
from dsec.image.blob import (
    BlobStore,
    layer_chunks_key,
    layer_key,
    layer_manifest_key,
    open_blobstore,
)
from dsec.image.blob.file import FileBlobStore
from dsec.image.blob.push import push_image, read_remote_layer, remote_complete
from dsec.image.blob.traces import (
    MAX_TRACE_BYTES,
    MAX_TRACE_CHUNKS,
    AccessTrace,
    load_trace,
    new_trace,
    record_trace,
)
from dsec.image.chunks import ChunkTable, build_chunk_table, verify_chunk
from dsec.image.manifest import LayerManifest
from tests.image.blob.servers import MotoServer


def _tree(root: str, files: dict[str, bytes]) -> str:
    for rel, data in files.items():
        p = os.path.join(root, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)
    return root


@pytest.fixture
def image(tmp_path: os.PathLike[str]) -> tuple[LayerStore, LayerManifest, LayerManifest]:
    """A two-layer image: ``app`` stands on ``base`` (its stack)."""
    store = LayerStore(os.path.join(str(tmp_path), "layers"))
    base = store.add_tree(_tree(os.path.join(str(tmp_path), "b"), {
        "bin/tool": os.urandom(700_000), "etc/os-release": b"ID=test\n"}),
        kind="base", name="base")
    top = store.add_tree(_tree(os.path.join(str(tmp_path), "t"), {
        "app/data": os.urandom(300_000)}), kind="base", name="app", stack=(base.digest,))
    return store, base, top


def _check_published(blob: BlobStore, store: LayerStore, m: LayerManifest) -> None:
    got, table = read_remote_layer(blob, m.digest)
    # the published manifest is the pusher's record, which pins the chunk table
    assert got == store.get(m.digest) == msgspec.structs.replace(m, chunk_table=got.chunk_table)
    assert got.chunk_table is not None and got.chunk_table.chunk_size == table.chunk_size
    with open(store.layer_path(m), "rb") as f:
        local = f.read()
    assert blob.head(layer_key(m.digest)) == len(local) == m.size_bytes
    for i in range(table.count):
        off, length = table.chunk_range(i)
        assert verify_chunk(table, i, blob.get_range(layer_key(m.digest), off, length))


@pytest.mark.parametrize("backend", ["file", "s3", "http"])
def test_push_publishes_the_chain_and_is_idempotent(
        backend: str, image: tuple[LayerStore, LayerManifest, LayerManifest],
        request: pytest.FixtureRequest, tmp_path: os.PathLike[str]) -> None:
    store, base, top = image
    if backend == "file":
        url = f"file://{tmp_path}/blobs"
    elif backend == "s3":
        url = request.getfixturevalue("s3_url")
    else:
        url = request.getfixturevalue("http_dir")[1]
    blob = open_blobstore(url)
    seen: list[tuple[str, int, int]] = []
    res = push_image(blob, store, "app", progress=lambda *a: seen.append(a))
    assert res.digest == top.digest
    assert [p.digest for p in res.layers] == [base.digest, top.digest]   # lowest first
    assert all(p.uploaded for p in res.layers)
    assert res.bytes_uploaded == base.size_bytes + top.size_bytes
    assert seen[-1] == ("upload", res.bytes_uploaded, res.bytes_uploaded)
    for m in (base, top):
        _check_published(blob, store, m)
    again = push_image(blob, store, top.digest)
    assert not any(p.uploaded for p in again.layers) and again.bytes_uploaded == 0


def test_incomplete_or_wrong_remote_layers_are_pushed_again(
        image: tuple[LayerStore, LayerManifest, LayerManifest],
        tmp_path: os.PathLike[str]) -> None:
    store, base, top = image
    blob = FileBlobStore(root=os.path.join(str(tmp_path), "blobs"))
    push_image(blob, store, "app")
    # a push killed before its manifest (the commit point): the layer is not there
    blob.delete(layer_manifest_key(top.digest))
    with pytest.raises(ImageNotFound):
        read_remote_layer(blob, top.digest)
    # a layer file of the wrong size under the key: not complete either
    blob.put_bytes(layer_key(base.digest), b"short")
    base = store.get(base.digest)               # as pushed: the chunk table recorded
    assert not remote_complete(blob, base, chunk_size=262144)
    with pytest.raises(CorruptLayer, match="5 bytes"):
        read_remote_layer(blob, base.digest)
    # right size, wrong bytes: only --verify reads it through
    with open(store.layer_path(base), "rb") as f:
        data = bytearray(f.read())
    data[100] ^= 1
    blob.put_bytes(layer_key(base.digest), bytes(data))
    assert remote_complete(blob, base, chunk_size=262144)
    assert not remote_complete(blob, base, chunk_size=262144, verify=True)
    res = push_image(blob, store, "app", verify=True)
    assert [p.uploaded for p in res.layers] == [True, True]
    for m in (base, top):
        _check_published(blob, store, m)


def test_a_changed_local_file_is_never_uploaded(
        image: tuple[LayerStore, LayerManifest, LayerManifest],
        tmp_path: os.PathLike[str]) -> None:
    store, base, _ = image
    path = store.layer_path(base)
    os.chmod(path, 0o600)
    with open(path, "r+b") as f:
        f.seek(10)
        f.write(b"\xff")
    blob = FileBlobStore(root=os.path.join(str(tmp_path), "blobs"))
    with pytest.raises(CorruptLayer, match="hashes to"):
        push_image(blob, store, "app")
    assert blob.head(layer_key(base.digest)) is None


_PUSHER = """
import sys, time
from pathlib import Path
import dsec.image.blob.s3 as s3
from dsec.image import LayerStore
from dsec.image.blob import open_blobstore
from dsec.image.blob.push import push_image
# a slow link (1 MiB per 0.1 s): on loopback the whole upload could end between two of
# the test's polls (CI saw it), so the kill could miss the window it is about
real_put = s3.obstore.put
def slow_put(store, key, file, **kw):
    if isinstance(file, Path):
        def chunks(p=file):
            with open(p, "rb") as f:
                while b := f.read(1 << 20):
                    yield b
                    time.sleep(0.1)
        file = chunks()
    return real_put(store, key, file, **kw)
s3.obstore.put = slow_put
push_image(open_blobstore(sys.argv[1], part_size=5 * 1024 * 1024, max_concurrency=1),
           LayerStore(sys.argv[2]), sys.argv[3])
"""


def test_kill_9_mid_push_leaves_no_layer_a_reader_would_use(
        s3_url: str, s3_env: MotoServer, tmp_path: os.PathLike[str]) -> None:
    store = LayerStore(os.path.join(str(tmp_path), "layers"))
    big = store.add_tree(_tree(os.path.join(str(tmp_path), "b"), {
        f"f{i}": os.urandom(4 << 20) for i in range(4)}), kind="base", name="big")
    blob = open_blobstore(s3_url)
    client, bucket = s3_env.client(), urlsplit(s3_url).netloc
    proc = subprocess.Popen([sys.executable, "-c", _PUSHER, s3_url, store.root, "big"])
    try:
        deadline = time.monotonic() + 60
        while True:          # kill once the layer file's multipart upload has a part up
            ups = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
            if ups and client.list_parts(Bucket=bucket, Key=ups[0]["Key"],
                                         UploadId=ups[0]["UploadId"]).get("Parts"):
                break
            assert proc.poll() is None, "the push ended before it could be killed"
            assert time.monotonic() < deadline, "no multipart upload appeared"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with pytest.raises(ImageNotFound):
        read_remote_layer(blob, big.digest)
    for key in (layer_key(big.digest), layer_chunks_key(big.digest),
                layer_manifest_key(big.digest)):
        assert blob.head(key) is None
    res = push_image(blob, store, "big")                  # the next push completes it
    assert res.layers[-1].uploaded
    _check_published(blob, store, big)


def test_traces_round_trip_bounded_and_never_fatal(tmp_path: os.PathLike[str]) -> None:
    blob = FileBlobStore(root=os.path.join(str(tmp_path), "blobs"))
    img = "sha256:" + "1" * 64
    layer = "sha256:" + "2" * 64
    assert load_trace(blob, img) is None
    t = new_trace(img, "node-a", {layer: [3, 1, 3, 2]}, window_s=5.0, clock=lambda: 1000.5)
    assert t.layers == {layer: [3, 1, 2]}                 # first-read order, once each
    key = record_trace(blob, t)
    assert key == f"traces/{'1' * 64}/node-a-1000500"
    assert load_trace(blob, img) == t
    t2 = new_trace(img, "node-b", {layer: [7]}, window_s=5.0, clock=lambda: 2000.0)
    record_trace(blob, t2)
    assert load_trace(blob, img) == t2                    # the newest
    assert blob.list_keys(f"traces/{'1' * 64}/") == [
        f"traces/{'1' * 64}/latest", f"traces/{'1' * 64}/node-a-1000500",
        f"traces/{'1' * 64}/node-b-2000000"]
    with pytest.raises(InvalidArgument, match="over the limit"):
        new_trace(img, "n", {layer: list(range(MAX_TRACE_CHUNKS + 1))}, window_s=1.0)
    # a malformed or oversized object is ignored (no prefetch), never an error
    blob.put_bytes(f"traces/{'1' * 64}/latest", b"\xc1garbage")
    assert load_trace(blob, img) is None
    blob.put_bytes(f"traces/{'1' * 64}/latest", b"\0" * (MAX_TRACE_BYTES + 1))
    assert load_trace(blob, img) is None
    other = AccessTrace(image="sha256:" + "3" * 64, node="n", recorded_at=1.0,
                        window_s=1.0, layers={})
    blob.put_bytes(f"traces/{'1' * 64}/latest", other.encode())
    assert load_trace(blob, img) is None                  # names another image


class _GatedStore(FileBlobStore):
    """A file store whose first layer upload waits for the test (an upload in flight)."""

    def __init__(self, root: str) -> None:
        super().__init__(root=root)
        self.entered = threading.Event()
        self.go = threading.Event()

    def put_file(self, key: str, path: str) -> None:
        self.entered.set()
        assert self.go.wait(30)
        super().put_file(key, path)


def test_a_push_holds_no_store_lock_and_prunes_keep_its_layers(
        image: tuple[LayerStore, LayerManifest, LayerManifest],
        tmp_path: os.PathLike[str]) -> None:
    store, base, top = image
    blob = _GatedStore(os.path.join(str(tmp_path), "blobs"))
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(push_image(blob, store, "app")))
    t.start()
    try:
        assert blob.entered.wait(30)
        # a build finishes while the upload is in flight (no lock held by the push) ...
        built: list[LayerManifest] = []
        b = threading.Thread(target=lambda: built.append(store.add_tree(
            _tree(os.path.join(str(tmp_path), "o"), {"x": b"1"}), kind="base",
            name="other")))
        b.start()
        b.join(20)
        assert built and store.has(built[0].digest), "a build waited for the push"
        # ... and a prune keeps the layers going up, though nothing names them now
        store.untag("app:latest")
        store.untag("base:latest")
        store.prune()
        assert store.has(base.digest) and store.has(top.digest)
    finally:
        blob.go.set()
        t.join(60)
    assert [p.digest for p in out[0].layers] == [base.digest, top.digest]  # type: ignore[attr-defined]
    _check_published(blob, store, top)
    assert store.prune().removed                        # unpinned once the push ended


def test_a_swapped_remote_chunk_table_is_refused_and_pushed_again(
        image: tuple[LayerStore, LayerManifest, LayerManifest],
        tmp_path: os.PathLike[str]) -> None:
    """Red team 17 F1: the pusher records the sha256 of the table it published; a table
    the store holds in its place (the table of other bytes labelled with the digest)
    is not the layer's, and the next push replaces it."""
    store, base, _ = image
    blob = FileBlobStore(root=os.path.join(str(tmp_path), "blobs"))
    push_image(blob, store, "app")
    recorded = store.get(base.digest).chunk_table
    assert recorded is not None
    other = os.path.join(str(tmp_path), "other")
    with open(other, "wb") as f:
        f.write(os.urandom(base.size_bytes))
    lie = build_chunk_table(other)
    blob.put_bytes(layer_chunks_key(base.digest), ChunkTable(
        digest=base.digest, size=lie.size, chunk_size=lie.chunk_size,
        hashes=list(lie.hashes)).encode())
    with pytest.raises(CorruptLayer, match="not the one its push recorded"):
        read_remote_layer(blob, base.digest)
    assert not remote_complete(blob, store.get(base.digest), chunk_size=262144)
    res = push_image(blob, store, "app")
    assert [p.uploaded for p in res.layers] == [True, False]
    _check_published(blob, store, base)
    assert store.get(base.digest).chunk_table == recorded
