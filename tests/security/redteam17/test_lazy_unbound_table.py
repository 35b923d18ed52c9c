"""F1: the chunk table a node fetches from the blob store is checked only for its digest
*field* and size, never bound to the layer digest: whoever can write the blob store (or
answers for it) serves any bytes under any digest, verified "per chunk" against hashes it
chose itself. A node must never serve bytes whose layer digest it has not established."""

from __future__ import annotations

import hashlib
import os

from dsec.edge.lazy.layers import LazyConfig, LazyLayers
from dsec.errors import DsecError
from dsec.image.blob import layer_chunks_key, layer_key
from dsec.image.chunks import ChunkTable, build_chunk_table
from tests.conftest import requires_root
from tests.edge.lazy.conftest import Remote

pytestmark = requires_root


def test_a_blob_store_cannot_serve_other_bytes_under_a_layers_digest(
        remote: Remote, tmp_path: object) -> None:
    ws = remote.workspace
    path = os.path.join(remote.blob_dir, layer_key(ws.digest))
    with open(path, "rb") as f:
        good = f.read()
    evil = os.urandom(len(good))                 # same size, other bytes
    with open(path, "wb") as f:
        f.write(evil)
    lie = build_chunk_table(path)                # the table of the evil file ...
    forged = ChunkTable(digest=ws.digest, size=lie.size, chunk_size=lie.chunk_size,
                        hashes=list(lie.hashes))  # ... labelled with the real digest
    with open(os.path.join(remote.blob_dir, layer_chunks_key(ws.digest)), "wb") as f:
        f.write(forged.encode())
    lazy = LazyLayers(LazyConfig(blob_url=remote.url,
                                 cache_dir=os.path.join(str(tmp_path), "chunks"),
                                 retry_budget_s=0.5))
    try:
        served: bytes | None = None
        try:
            lazy.register(ws)
            with open(lazy.path(ws) or "", "rb", buffering=0) as f:
                served = f.read()
        except (DsecError, OSError):   # refused (CorruptLayer at register, EIO at read): safe
            served = None
        assert served is None or hashlib.sha256(served).hexdigest() == ws.hex, (
            "the node served bytes whose sha256 is not the layer's digest "
            f"(got {hashlib.sha256(served).hexdigest()[:16]}.., want {ws.hex[:16]}..)")
    finally:
        lazy.close()
