"""Fixtures for lazy layers: layers pushed to a file:// blob store, and a node with an
empty layer store that reads them through the FUSE daemon. Everything mounted or started
is undone in the fixtures' finally blocks (EROFS mounts first, then the daemon)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import pytest

from dsec.edge.backends.container.images import StoreImages
from dsec.edge.lazy.layers import LazyConfig, LazyLayers
from dsec.image import LayerStore, MountCache, ensure_busybox_base
from dsec.image.blob import (
    BlobStore,
    layer_chunks_key,
    layer_key,
    layer_manifest_key,
    open_blobstore,
)
from dsec.image.chunks import build_chunk_table, table_ref
from dsec.image.manifest import LayerManifest
from tests.image.conftest import sweep_mounts, write_tree

__all__ = ["Remote", "fuse_mounts", "push_layer"]


def push_layer(blob: BlobStore, store: LayerStore, m: LayerManifest) -> LayerManifest:
    """The layer file, its chunk table and its manifest, as ``dsec image push`` stores them;
    returns the pusher's manifest, which records the table's sha256 (what a node gets
    from the control plane)."""
    path = store.layer_path(m)
    raw, ref = table_ref(build_chunk_table(path, expect_digest=m.digest))
    blob.put_file(layer_key(m.digest), path)
    blob.put_bytes(layer_chunks_key(m.digest), raw)
    m = store.record_chunk_table(m.digest, ref)
    blob.put_bytes(layer_manifest_key(m.digest), msgspec.json.encode(m))
    return m


def fuse_mounts() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [ln.split(" ")[4] for ln in f if " - fuse.dsec " in ln]


@dataclass
class Remote:
    """Layers that exist only in the blob store: a busybox base, a workspace with a
    2 MiB random file and a toolkit."""

    url: str
    blob_dir: str
    base: LayerManifest
    workspace: LayerManifest
    toolkit: LayerManifest
    big: bytes

    @property
    def manifests(self) -> list[LayerManifest]:
        """The pusher's manifests, lowest first: what the control plane grants a node
        (``layer_grant``) before a create needs them."""
        return [self.base, self.workspace, self.toolkit]


@pytest.fixture
def remote(tmp_path: object) -> Iterator[Remote]:
    tmp = str(tmp_path)
    src = LayerStore(os.path.join(tmp, "src-store"))
    base = ensure_busybox_base(src)
    big = os.urandom(2 << 20)
    write_tree(os.path.join(tmp, "ws"), {"work/readme": "workspace layer\n", "work/big": big})
    ws = src.add_tree(os.path.join(tmp, "ws"), kind="workspace", name="ws")
    write_tree(os.path.join(tmp, "tk"), {"opt/tool": "toolkit layer\n"})
    tk = src.add_tree(os.path.join(tmp, "tk"), kind="toolkit", name="tk")
    blob_dir = os.path.join(tmp, "blob")
    blob = open_blobstore("file://" + blob_dir)
    base, ws, tk = (push_layer(blob, src, m) for m in (base, ws, tk))
    yield Remote("file://" + blob_dir, blob_dir, base, ws, tk, big)


@dataclass
class Node:
    store: LayerStore
    lazy: LazyLayers
    cache: MountCache
    images: StoreImages


@pytest.fixture
def node(tmp_path: object, remote: Remote) -> Iterator[Node]:
    tmp = str(tmp_path)
    store = LayerStore(os.path.join(tmp, "node-store"))
    lazy = LazyLayers(LazyConfig(blob_url=remote.url, cache_dir=os.path.join(tmp, "chunks"),
                                 retry_budget_s=1.0, trace_window_s=1.0))
    cache = MountCache(lazy=lazy)
    lazy.on_restart(cache.rebind_lazy)
    try:
        images = StoreImages(store, cache, lazy)
        images.grant(remote.manifests)       # as the control plane does before a create
        yield Node(store, lazy, cache, images)
    finally:
        sweep_mounts(tmp)
        cache.close()
        sweep_mounts(cache.root)
        lazy.close()
