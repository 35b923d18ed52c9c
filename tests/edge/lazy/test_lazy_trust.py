"""What a lazy node trusts (red team 17 F1/F2): the chunk table it verifies chunks against
is the one the pusher recorded (sha256 in the manifest), never merely what the blob store
holds; and the only thing a node writes to the store is an access trace."""

from __future__ import annotations

import os

import msgspec
import pytest

from dsec.edge.lazy.layers import LazyConfig, LazyLayers, TraceWrites
from dsec.errors import CorruptLayer, PermissionDenied
from dsec.image.blob import layer_chunks_key, layer_key, open_blobstore
from dsec.image.chunks import ChunkTable, build_chunk_table
from tests.conftest import requires_root
from tests.edge.lazy.conftest import Remote

pytestmark = requires_root


def _lazy(remote: Remote, tmp: str) -> LazyLayers:
    return LazyLayers(LazyConfig(blob_url=remote.url, cache_dir=os.path.join(tmp, "chunks"),
                                 retry_budget_s=0.5))


def test_a_layer_without_a_recorded_chunk_table_is_refused(remote: Remote,
                                                           tmp_path: object) -> None:
    lazy = _lazy(remote, str(tmp_path))
    try:
        bare = msgspec.structs.replace(remote.workspace, chunk_table=None)
        with pytest.raises(CorruptLayer, match="no recorded chunk table"):
            lazy.register(bare)
        assert not lazy.knows(bare.digest) and lazy.path(bare) is None
        lazy.register(remote.workspace)          # as pushed: served
        assert lazy.knows(remote.workspace.digest)
    finally:
        lazy.close()


def test_a_cached_table_that_is_not_the_recorded_one_is_fetched_again(
        remote: Remote, tmp_path: object) -> None:
    ws = remote.workspace
    lazy = _lazy(remote, str(tmp_path))
    try:
        lazy.register(ws)
        path = lazy.table_path(ws.digest)
        with open(path, "rb") as f:
            honest = f.read()
        other = os.path.join(str(tmp_path), "other")
        with open(other, "wb") as f:
            f.write(os.urandom(ws.size_bytes))
        lie = build_chunk_table(other)
        forged = ChunkTable(digest=ws.digest, size=lie.size, chunk_size=lie.chunk_size,
                            hashes=list(lie.hashes)).encode()
        with open(path, "wb") as f:           # left by an older edge, or tampered with
            f.write(forged)
        lazy.register(ws)
        with open(path, "rb") as f:
            assert f.read() == honest
    finally:
        lazy.close()


def test_the_store_cannot_shrink_or_swap_the_recorded_table(remote: Remote,
                                                            tmp_path: object) -> None:
    ws = remote.workspace
    key = os.path.join(remote.blob_dir, layer_chunks_key(ws.digest))
    with open(key, "rb") as f:
        honest = f.read()
    lazy = _lazy(remote, str(tmp_path))
    try:
        for bad in (honest[:-1], honest[:-1] + bytes([honest[-1] ^ 1])):
            with open(key, "wb") as f:
                f.write(bad)
            with pytest.raises(CorruptLayer):
                lazy.register(ws)
            assert not lazy.knows(ws.digest)
    finally:
        lazy.close()


def test_a_node_writes_only_access_traces(remote: Remote) -> None:
    store = TraceWrites(open_blobstore(remote.url))
    ws = remote.workspace
    before = os.path.getsize(os.path.join(remote.blob_dir, layer_key(ws.digest)))
    for write in (lambda: store.put_bytes(layer_key(ws.digest), b"x"),
                  lambda: store.put_bytes(layer_chunks_key(ws.digest), b"x"),
                  lambda: store.delete(layer_key(ws.digest))):
        with pytest.raises(PermissionDenied, match="only access traces"):
            write()
    assert os.path.getsize(os.path.join(remote.blob_dir, layer_key(ws.digest))) == before
    store.put_bytes("traces/" + ws.hex + "/latest", b"hint")
    assert store.get_range("traces/" + ws.hex + "/latest", 0, 4) == b"hint"


def test_one_request_never_asks_for_more_than_max_run_bytes(tmp_path: object) -> None:
    """Red team 17 F2: runs are capped in bytes as well as chunks, whatever the table's
    chunk size (a run is held in memory whole, per request in flight)."""
    from types import SimpleNamespace

    from dsec.edge.lazy.fs import MAX_RUN_BYTES, FsConfig, LazyFs
    from dsec.image.blob import open_blobstore

    fs = LazyFs(open_blobstore(f"file://{tmp_path}/blob"),
                FsConfig(cache_dir=os.path.join(str(tmp_path), "c")))
    for chunk_size, want in ((256 << 10, 16), (1 << 20, 4), (4 << 20, 1), (64 << 20, 1)):
        lay = SimpleNamespace(table=SimpleNamespace(chunk_size=chunk_size))
        got = fs._run_cap(lay, None)  # type: ignore[arg-type]
        assert got == want and got * chunk_size <= max(MAX_RUN_BYTES, chunk_size)
    assert fs._run_cap(SimpleNamespace(table=SimpleNamespace(chunk_size=256 << 10)),  # type: ignore[arg-type]
                       4) == 4
