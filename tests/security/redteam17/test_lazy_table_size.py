"""F2: the edge reads a layer's chunk table from the blob store with no size bound: it asks
for whatever length the store's HEAD announces (``register``: ``get_range(key, 0, size)``),
so a hostile/broken store announcing a multi-GiB table makes the edge process allocate it
(OOM of the edge, every sandbox on the node). The manifest read is capped at 1 MiB; the
table's size is known from the manifest (~34 bytes per chunk), so it can be capped too."""

from __future__ import annotations

import os

import pytest

from dsec.edge.lazy.layers import LazyConfig, LazyLayers
from dsec.errors import BlobUnavailable, DsecError
from dsec.image.blob import BlobStore, layer_chunks_key, open_blobstore
from dsec.image.chunks import chunk_count
from tests.conftest import requires_root
from tests.edge.lazy.conftest import Remote

pytestmark = requires_root


class Announcing:
    """The real file store, except that HEAD of the chunk table says 8 GiB and ranged
    reads of it are recorded (and refused, so nothing is allocated)."""

    def __init__(self, url: str) -> None:
        self.inner: BlobStore = open_blobstore(url)
        self.url = url
        self.asked: list[int] = []

    def head(self, key: str) -> int | None:
        if key.endswith(".chunks"):
            return 8 << 30
        size: int | None = self.inner.head(key)
        return size

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        if key.endswith(".chunks"):
            self.asked.append(length)
            raise BlobUnavailable("refused by the test", store=self.url, key=key)
        data: bytes = self.inner.get_range(key, offset, length)
        return data

    def put_file(self, key: str, path: str) -> None: ...
    def put_bytes(self, key: str, data: bytes) -> None: ...
    def delete(self, key: str) -> None: ...


def test_the_edge_never_asks_the_blob_store_for_an_unbounded_chunk_table(
        remote: Remote, tmp_path: object) -> None:
    ws = remote.workspace
    store = Announcing(remote.url)
    lazy = LazyLayers(LazyConfig(blob_url=remote.url,
                                 cache_dir=os.path.join(str(tmp_path), "chunks"),
                                 retry_budget_s=0.5), blob=store)
    try:
        with pytest.raises(DsecError):
            lazy.register(ws)
        bound = 64 * chunk_count(ws.size_bytes, 262144) + (1 << 16)
        assert all(n <= bound for n in store.asked), (
            f"the edge asked for a {max(store.asked)}-byte chunk table of a "
            f"{ws.size_bytes}-byte layer (at most ~{bound} bytes can be genuine)")
        assert layer_chunks_key(ws.digest)
    finally:
        lazy.close()
