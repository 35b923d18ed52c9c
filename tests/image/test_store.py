"""Layer store and node mount cache against real EROFS files and mounts."""

from __future__ import annotations

import hashlib
import os
import stat

import pytest

from dsec.errors import CorruptLayer, ImageNotFound, InUse, InvalidArgument, PermissionDenied
from dsec.image import LayerStore, MountCache
from dsec.image.mount import is_mountpoint
from tests.conftest import requires_root
from tests.image.conftest import mounts_under, tree_of, write_tree

pytestmark = requires_root


def build(store: LayerStore, tmp: str, files: dict, **kw: object) -> object:
    src = os.path.join(tmp, "src-" + os.urandom(3).hex())
    os.makedirs(src)
    write_tree(src, files)
    return store.add_tree(src, **kw)  # type: ignore[arg-type]


def test_build_is_content_addressed_and_named(store: LayerStore, tmp_path: object) -> None:
    m = build(store, str(tmp_path), {"a/b": "hello", "l": ("link", "a/b")},
              kind="toolkit", name="tools", tag="v1", labels={"team": "rl"})
    path = store.layer_path(m)
    with open(path, "rb") as f:
        assert m.digest == "sha256:" + hashlib.sha256(f.read()).hexdigest()
    assert m.size_bytes == os.path.getsize(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o400   # read-only, owner only
    assert (m.kind, m.name, m.tag, m.labels, m.content_bytes) == ("toolkit", "tools", "v1",
                                                                  {"team": "rl"}, 5)
    assert store.get("tools:v1") == m
    assert store.get(m.digest) == m
    assert store.get("sha256:" + m.hex[:12]) == m
    assert store.refs() == {"tools:v1": m.digest}
    with pytest.raises(ImageNotFound):
        store.get("tools")              # :latest was never tagged
    with pytest.raises(ImageNotFound):
        store.get("sha256:" + "0" * 64)
    with pytest.raises(InvalidArgument):
        store.add_tree("/nonexistent-dir", kind="base")
    with pytest.raises(InvalidArgument):
        store.add_tree(str(tmp_path), kind="bogus")  # type: ignore[arg-type]


def test_lz4_layer_mounts_and_reads(store: LayerStore, cache: MountCache,
                                    tmp_path: object) -> None:
    data = b"compressible " * 50_000
    m = build(store, str(tmp_path), {"big": data, "d/x": "x"}, kind="base", compression="lz4")
    assert m.compression == "lz4" and m.size_bytes < len(data)
    mnt = cache.acquire(m, store.layer_path(m))
    try:
        with open(os.path.join(mnt, "big"), "rb") as f:
            assert f.read() == data
        assert tree_of(mnt)["d/x"][0] == "f"
    finally:
        cache.release(m.digest)


def test_mount_cache_shares_and_refcounts(store: LayerStore, cache: MountCache,
                                          tmp_path: object) -> None:
    m = build(store, str(tmp_path), {"f": "1"}, kind="base", name="b")
    p1 = cache.acquire(m, store.layer_path(m))
    p2 = cache.acquire(m, store.layer_path(m))
    assert p1 == p2 and cache.refs(m.digest) == 2 and is_mountpoint(p1)
    assert len(mounts_under(p1)) == 1
    with pytest.raises(InUse, match="mounted"):
        store.remove("b")
    cache.release(m.digest)
    assert is_mountpoint(p1)
    cache.release(m.digest)
    assert not os.path.exists(p1) and mounts_under(p1) == []
    with pytest.raises(InvalidArgument):
        cache.release(m.digest)
    store.remove("b")
    assert store.manifests() == [] and store.refs() == {}
    assert not os.path.exists(store.layer_path(m))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_layer_is_refused_and_mounts_nothing(store: LayerStore, cache: MountCache,
                                                     tmp_path: object, damage: str) -> None:
    m = build(store, str(tmp_path), {"f": "payload" * 100}, kind="base")
    path = store.layer_path(m)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        if damage == "flip":
            f.seek(1100)
            b = f.read(1)
            f.seek(1100)
            f.write(bytes([b[0] ^ 0xFF]))
        else:
            f.truncate(m.size_bytes // 2)
    with pytest.raises(CorruptLayer):
        cache.acquire(m, path)
    assert cache.mounted() == {} and os.listdir(cache.root) == []


def test_unverified_garbage_is_corrupt_not_mounted(store: LayerStore, tmp_path: object) -> None:
    m = build(store, str(tmp_path), {"f": "x"}, kind="base")
    path = store.layer_path(m)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.write(b"\0" * 2048)           # wipe the superblock, keep the size
    with MountCache(verify=False) as c:
        with pytest.raises(CorruptLayer):
            c.acquire(m, path)
        assert c.mounted() == {} and os.listdir(c.root) == []


def test_names_are_namespaced_and_a_tag_never_leaves_its_namespace(
        store: LayerStore, tmp_path: object) -> None:
    base = build(store, str(tmp_path), {"bin/sh": "x"}, kind="base", name="base")
    mine = build(store, str(tmp_path), {"a": "a"}, kind="toolkit", name="tools",
                 namespace="teama", owner="alice")
    theirs = build(store, str(tmp_path), {"b": "b"}, kind="toolkit", name="tools",
                   namespace="org/team")
    assert (mine.namespace, mine.owner, mine.ref) == ("teama", "alice", "teama/tools:latest")
    assert store.refs() == {"base:latest": base.digest, "teama/tools:latest": mine.digest,
                            "org/team/tools:latest": theirs.digest}
    assert store.get("teama/tools") == mine and store.get("org/team/tools:latest") == theirs
    with pytest.raises(ImageNotFound):
        store.get("tools")            # bare: cluster-wide only, and there is none
    with pytest.raises(InvalidArgument):
        store.add_tree(str(tmp_path), kind="toolkit", name="teama/x")  # project: namespace=
    # a tag only points at layers of its namespace, of an ancestor, or cluster-wide
    for ns, layer in ((None, mine), ("teamb", mine), ("org", theirs), ("teama", theirs)):
        with pytest.raises(PermissionDenied):
            store.tag(layer.digest, "t", namespace=ns)
    store.tag(theirs.digest, "t", namespace="org/team/exp")      # a descendant
    store.tag(base.digest, "t", namespace="teama")               # cluster-wide layer
    assert store.get("teama/t") == base and store.get("org/team/exp/t") == theirs
    # a snapshot is no image: it takes no name, not even in its own project
    snap = build(store, str(tmp_path), {"s": "s"}, kind="snapshot",
                 labels={"dsec.io/project": "teama"})
    assert snap.namespace == "teama"
    with pytest.raises(PermissionDenied, match="snapshot="):
        store.tag(snap.digest, "s", namespace="teama")
    assert store.untag("teama/t:latest") == base.digest and store.untag("teama/t:latest") is None
    assert store.get(base.digest) == base                       # untag keeps the layer


def test_store_files_are_private_even_in_a_preexisting_open_dir(tmp_path: object) -> None:
    root = os.path.join(str(tmp_path), "open-store")
    os.makedirs(os.path.join(root, "manifests"))
    for d in (root, os.path.join(root, "manifests")):
        os.chmod(d, 0o755)
    old = os.umask(0)        # even a careless umask gives no one else access
    try:
        store = LayerStore(root)
        m = build(store, str(tmp_path), {"a": "a"}, kind="base", name="b")
        store.write_index(m.digest, b"idx")
    finally:
        os.umask(old)
    for dirpath, _, files in os.walk(root):
        assert stat.S_IMODE(os.stat(dirpath).st_mode) == 0o700, dirpath
        for n in files:
            mode = stat.S_IMODE(os.stat(os.path.join(dirpath, n)).st_mode)
            assert mode == (0o400 if n.endswith(".erofs") else 0o600), (n, oct(mode))
