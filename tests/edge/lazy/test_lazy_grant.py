"""A node takes what a lazily read layer *is* from the control plane, never from the blob
store (red team 17 F1, remainder): the layer's manifest - its chunk table's sha256, what
it stands on, its kind - arrives with ``layer_grant`` (sent before a create, a snapshot
relay and the pins); the blob store's ``.manifest`` is never read. Whoever can write the
store forges all three objects of a layer consistently here (file, chunk table, manifest
naming that table), and nothing of it is served under the layer's digest."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
import pytest

from dsec.edge.backends.container.images import PinChange, StoreImages
from dsec.edge.lazy.layers import LazyConfig, LazyLayers
from dsec.errors import CorruptLayer, DsecError, ImageError, ImageNotFound, InvalidArgument
from dsec.image import LayerStore, MountCache
from dsec.image.blob import (
    BlobStore,
    layer_chunks_key,
    layer_key,
    layer_manifest_key,
    open_blobstore,
)
from dsec.image.chunks import ChunkTable, build_chunk_table, table_ref
from dsec.wire.spec import SandboxSpec
from tests.conftest import requires_root
from tests.edge.lazy.conftest import Remote
from tests.image.conftest import sweep_mounts, write_tree

pytestmark = requires_root


@dataclass(eq=False)
class Recording:
    """The node's blob store, noting every key it reads."""

    inner: BlobStore
    read: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.inner.url

    def head(self, key: str) -> int | None:
        self.read.append(key)
        return self.inner.head(key)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        self.read.append(key)
        return self.inner.get_range(key, offset, length)

    def put_file(self, key: str, path: str) -> None:
        self.inner.put_file(key, path)

    def put_bytes(self, key: str, data: bytes) -> None:
        self.inner.put_bytes(key, data)

    def delete(self, key: str) -> None:
        self.inner.delete(key)


@dataclass
class Bare:
    """A node that was granted nothing yet."""

    store: LayerStore
    lazy: LazyLayers
    images: StoreImages
    blob: Recording


@pytest.fixture
def bare(tmp_path: object, remote: Remote) -> Iterator[Bare]:
    tmp = str(tmp_path)
    blob = Recording(open_blobstore(remote.url))
    store = LayerStore(os.path.join(tmp, "bare-store"))
    lazy = LazyLayers(LazyConfig(blob_url=remote.url, cache_dir=os.path.join(tmp, "bc"),
                                 retry_budget_s=0.5, traces=False), blob=blob)
    cache = MountCache(lazy=lazy)
    try:
        yield Bare(store, lazy, StoreImages(store, cache, lazy), blob)
    finally:
        sweep_mounts(tmp)
        cache.close()
        sweep_mounts(cache.root)
        lazy.close()


def forge(remote: Remote, tmp: str) -> dict[str, bytes]:
    """Replace the workspace layer in the blob store with another EROFS layer (its
    ``/work/big`` other bytes), that layer's chunk table labelled with the real digest,
    and a manifest under the real digest recording that table and size: everything a
    writer of the store controls, made to agree. Returns the honest objects (to put
    back)."""
    ws = remote.workspace
    keys = {k: os.path.join(remote.blob_dir, k) for k in (
        layer_key(ws.digest), layer_chunks_key(ws.digest), layer_manifest_key(ws.digest))}
    honest = {}
    for k, p in keys.items():
        with open(p, "rb") as f:
            honest[k] = f.read()
    evil_store = LayerStore(os.path.join(tmp, "evil-store"))
    write_tree(os.path.join(tmp, "evil-tree"),
               {"work/readme": "workspace layer\n", "work/big": os.urandom(2 << 20)})
    em = evil_store.add_tree(os.path.join(tmp, "evil-tree"), kind="workspace")
    evil_path = evil_store.layer_path(em)
    lie = build_chunk_table(evil_path)
    raw, ref = table_ref(ChunkTable(digest=ws.digest, size=lie.size,
                                    chunk_size=lie.chunk_size, hashes=list(lie.hashes)))
    forged_manifest = msgspec.structs.replace(ws, chunk_table=ref, size_bytes=em.size_bytes)
    with open(evil_path, "rb") as f:
        evil = f.read()
    for k, data in ((layer_key(ws.digest), evil), (layer_chunks_key(ws.digest), raw),
                    (layer_manifest_key(ws.digest), msgspec.json.encode(forged_manifest))):
        with open(keys[k], "wb") as f:
            f.write(data)
    return honest


def restore(remote: Remote, honest: dict[str, bytes]) -> None:
    for k, data in honest.items():
        with open(os.path.join(remote.blob_dir, k), "wb") as f:
            f.write(data)


def spec_of(remote: Remote) -> SandboxSpec:
    return SandboxSpec(image=remote.base.digest, workspace=remote.workspace.digest)


def _served_big(images: StoreImages, spec: SandboxSpec) -> bytes | None:
    """The workspace's 2 MiB file as the sandbox's root would read it, or None when the
    node refused (an error at create, or EIO at the read)."""
    try:
        layers = images.acquire(spec)
    except DsecError:
        return None
    try:
        for d in layers.lowerdirs:
            p = os.path.join(d, "work", "big")
            if os.path.exists(p):
                try:
                    with open(p, "rb") as f:
                        return f.read()
                except OSError:
                    return None
        return None
    finally:
        images.release(layers)


def test_a_forged_blob_store_layer_is_never_served(bare: Bare, remote: Remote,
                                                   tmp_path: object) -> None:
    """The repro: a consistent forgery of file + table + manifest in a file:// store. A
    node asked for the layer without the control plane's grant refuses it and never
    reads the store's ``.manifest``; granted the pusher's manifest, it refuses the
    forged table with an error saying so, records nothing, and serves the honest bytes
    once the store holds them again."""
    honest = forge(remote, str(tmp_path))
    got = _served_big(bare.images, spec_of(remote))
    assert got is None or got == remote.big, (
        "the node served bytes under the workspace's digest that are not the layer "
        f"(sha256 {hashlib.sha256(got).hexdigest()[:16]}..)")
    assert not [k for k in bare.blob.read if k.endswith(".manifest")], bare.blob.read
    with pytest.raises(ImageNotFound, match="granted no manifest"):
        bare.images.acquire(spec_of(remote))
    # the control plane's grant (the pusher's manifests): the forged table is refused
    with pytest.raises(CorruptLayer, match=remote.workspace.digest):
        bare.images.grant(remote.manifests)
    assert bare.store.has(remote.base.digest)              # granted before it: fine
    assert not bare.store.has(remote.workspace.digest)
    assert not bare.lazy.knows(remote.workspace.digest)
    assert _served_big(bare.images, spec_of(remote)) is None
    assert not [k for k in bare.blob.read if k.endswith(".manifest")]
    restore(remote, honest)
    assert bare.images.grant(remote.manifests) == [m.digest for m in remote.manifests]
    assert _served_big(bare.images, spec_of(remote)) == remote.big


def test_pins_resolve_only_granted_images(bare: Bare, remote: Remote,
                                          tmp_path: object) -> None:
    """The pins door: a pinned image the control plane did not grant stays unresolved
    (and is sent again), even when the blob store offers a manifest for it."""
    forge(remote, str(tmp_path))
    ws = remote.workspace.digest
    assert bare.images.apply_pins([ws]) == PinChange(unresolved=(ws,))
    assert bare.lazy.pinned == frozenset()
    assert not [k for k in bare.blob.read if k.endswith(".manifest")]


def test_a_grant_is_checked(bare: Bare, remote: Remote) -> None:
    """What a grant may not do: record a snapshot as lazily readable, a layer without
    the push's chunk-table record, or a layer whose base is unknown here."""
    ws = remote.workspace
    with pytest.raises(InvalidArgument, match="snapshot"):
        bare.images.grant([msgspec.structs.replace(ws, kind="snapshot")])
    with pytest.raises(CorruptLayer, match="no recorded chunk table"):
        bare.images.grant([msgspec.structs.replace(ws, chunk_table=None)])
    on_unknown = msgspec.structs.replace(remote.toolkit, stack=("sha256:" + "a" * 64,))
    with pytest.raises(ImageError, match="stands on"):
        bare.images.grant([on_unknown])
    assert not bare.store.has(ws.digest) and not bare.store.has(remote.toolkit.digest)


def test_a_grant_overrides_a_record_an_older_node_took_from_the_store(
        bare: Bare, remote: Remote, tmp_path: object) -> None:
    """Upgrade path: a node that resolved a layer from the blob store's own .manifest
    (the old code) holds that record; the control plane's grant replaces it, chunk table
    and meaning, before anything is served from it."""
    honest = forge(remote, str(tmp_path))
    forged = msgspec.json.decode(manifest_in_store(remote), type=type(remote.workspace))
    bare.images.grant([remote.base])
    bare.store.add_remote(forged)                  # what the old _resolve_remote wrote
    restore(remote, honest)
    assert bare.images.grant(remote.manifests) == [m.digest for m in remote.manifests]
    assert bare.store.get(remote.workspace.digest).chunk_table == \
        remote.workspace.chunk_table
    assert _served_big(bare.images, spec_of(remote)) == remote.big


def manifest_in_store(remote: Remote) -> bytes:
    """The forged manifest ``forge`` left in the store."""
    with open(os.path.join(remote.blob_dir, layer_manifest_key(remote.workspace.digest)),
              "rb") as f:
        return f.read()
