"""Layers hold about what their trees really use: holes stay holes, hardlinks stay one
inode, and every build is bounded (QuotaExceeded, nothing stored).

Real files, real mkfs.erofs and real mounts: a restored layer is read back through the
kernel's EROFS driver."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from dsec.errors import QuotaExceeded
from dsec.image import LayerStore, MountCache, compose, mount_root, restore_stack, snapshot
from dsec.image.archive import pack_tree
from dsec.image.erofs import CHUNK_BYTES, OutputTooLarge, layout_for, mkfs_erofs
from dsec.image.tree import copy_entry, tree_stats
from tests.conftest import requires_root

pytestmark = requires_root

GiB, MiB = 1 << 30, 1 << 20


def _sparse(path: str, size: int, chunks: dict[int, bytes]) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
        for off, data in chunks.items():
            f.seek(off)
            f.write(data)


def _allocated(path: str) -> int:
    return os.stat(path).st_blocks * 512


def _layers(store: LayerStore) -> set[str]:
    return set(os.listdir(os.path.join(store.root, "layers")))


def test_copy_entry_keeps_holes(tmp_path: object) -> None:
    src, dst = os.path.join(str(tmp_path), "src"), os.path.join(str(tmp_path), "dst")
    _sparse(src, GiB, {0: b"head", 500_000_000: b"middle", GiB - 4: b"tail"})
    copy_entry(src, dst, os.lstat(src))
    assert os.path.getsize(dst) == GiB and _allocated(dst) <= 64 << 10
    with open(dst, "rb") as f:
        f.seek(500_000_000)
        assert f.read(6) == b"middle"
        f.seek(GiB - 4)
        assert f.read() == b"tail"


def test_layout_picks_chunks_only_when_holes_make_it_smaller() -> None:
    assert layout_for(files=1, apparent_bytes=GiB, allocated_bytes=8192, entries=2) == \
        CHUNK_BYTES
    # many small dense files: flat (inline tails) is much smaller than a block each
    assert layout_for(files=2000, apparent_bytes=20_000, allocated_bytes=8_192_000,
                      entries=2001) is None
    assert layout_for(files=3, apparent_bytes=300 * MiB, allocated_bytes=300 * MiB,
                      entries=4) is None


@pytest.fixture
def base(store: LayerStore, tmp_path: object):  # type: ignore[no-untyped-def]
    src = os.path.join(str(tmp_path), "base")
    os.makedirs(os.path.join(src, "etc"))
    with open(os.path.join(src, "etc/hostname"), "w") as f:
        f.write("base\n")
    return store.add_tree(src, kind="base", name="sparsebase")


def test_snapshot_of_a_1gib_sparse_file_stores_what_it_uses(
        store: LayerStore, cache: MountCache, base, tmp_path: object) -> None:  # type: ignore[no-untyped-def]
    stack = compose(base)
    upper = os.path.join(str(tmp_path), "upper")
    os.makedirs(os.path.join(upper, "data"))
    _sparse(os.path.join(upper, "data/sparse"), GiB, {123 * MiB: b"x" * 4096})
    with open(os.path.join(upper, "data/small"), "w") as f:
        f.write("small\n")
    m = snapshot(store, upper, base=stack)
    layer = store.layer_path(m)
    assert _allocated(layer) < 1 * MiB, _allocated(layer)     # was 1 GiB
    assert m.size_bytes < 2 * MiB
    with mount_root(store, cache, restore_stack(store, m),
                    os.path.join(str(tmp_path), "sb")) as root:
        path = os.path.join(root.target, "data/sparse")
        assert os.path.getsize(path) == GiB
        with open(path, "rb") as f:
            f.seek(123 * MiB - 2)
            assert f.read(6) == b"\0\0xxxx"
        with open(os.path.join(root.target, "data/small")) as f:
            assert f.read() == "small\n"


def test_hardlinks_are_stored_once(store: LayerStore, cache: MountCache, base,
                                   tmp_path: object) -> None:  # type: ignore[no-untyped-def]
    upper = os.path.join(str(tmp_path), "upper")
    os.makedirs(upper)
    first = os.path.join(upper, "blob")
    with open(first, "wb") as f:
        f.write(os.urandom(2 * MiB))
    for i in range(50):
        os.link(first, os.path.join(upper, f"link{i}"))
    m = snapshot(store, upper, base=compose(base))
    assert _allocated(store.layer_path(m)) < 3 * MiB          # was 102 MiB
    with mount_root(store, cache, restore_stack(store, m),
                    os.path.join(str(tmp_path), "sb")) as root:
        a = os.stat(os.path.join(root.target, "blob"))
        b = os.stat(os.path.join(root.target, "link49"))
        assert a.st_size == b.st_size == 2 * MiB and a.st_ino == b.st_ino


def test_snapshot_over_its_bounds_is_refused_and_stores_nothing(
        store: LayerStore, base, tmp_path: object) -> None:  # type: ignore[no-untyped-def]
    upper = os.path.join(str(tmp_path), "upper")
    os.makedirs(upper)
    with open(os.path.join(upper, "dense"), "wb") as f:
        f.write(os.urandom(3 * MiB))
    before = _layers(store)
    with pytest.raises(QuotaExceeded, match="over the limit of 1048576 bytes"):
        snapshot(store, upper, base=compose(base), max_bytes=1 * MiB)
    _sparse(os.path.join(upper, "huge"), 8 * GiB, {0: b"x"})
    with pytest.raises(QuotaExceeded, match="file contents"):
        snapshot(store, upper, base=compose(base), max_apparent_bytes=4 * GiB)
    assert _layers(store) == before
    assert os.listdir(os.path.join(store.root, "tmp")) == []
    assert os.listdir(os.path.join(store.root, "index")) == []


def test_tar_builds_keep_holes_both_ways(store: LayerStore, tmp_path: object) -> None:
    """A directory packed for upload writes sparse tar members (PAX 1.0 sparse), and
    extraction writes holes for them: the upload and the layer are about the data."""
    src = os.path.join(str(tmp_path), "tree")
    os.makedirs(os.path.join(src, "d"))
    _sparse(os.path.join(src, "d/disk.img"), GiB, {7 * MiB: b"payload"})
    with open(os.path.join(src, "plain"), "w") as f:
        f.write("plain\n")
    buf = io.BytesIO()
    pack_tree(src, buf)
    assert len(buf.getvalue()) < 64 << 10                       # not 1 GiB of zeros
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tf:                       # stock tarfile reads it
        member = tf.getmember("d/disk.img")
        assert member.size == GiB
        assert tf.extractfile("plain").read() == b"plain\n"  # type: ignore[union-attr]
    buf.seek(0)
    m = store.add_tar(buf, kind="base", name="sparse-tar")
    assert _allocated(store.layer_path(m)) < 1 * MiB
    assert m.content_bytes == GiB + 6


def test_chunked_estimate_counts_every_chunk_that_holds_data(tmp_path: Path) -> None:
    """4 KiB of distinct data every 64 KiB: allocation is 1/16 of the file, but a chunked
    layer stores each of those chunks whole - the flat layout is no bigger, so it is
    chosen, and an over-limit layer is refused before mkfs runs."""
    src = tmp_path / "src"
    src.mkdir()
    fd = os.open(src / "chop", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for i in range(256):
            os.pwrite(fd, i.to_bytes(8, "little") * 512, i * CHUNK_BYTES)
        os.ftruncate(fd, 256 * CHUNK_BYTES)
    finally:
        os.close(fd)
    stats = tree_stats(str(src))
    # st_blocks: the 256 data blocks, plus ext4's extent-tree index block(s) once writeback
    # has placed 256 separate extents (seen under load: one more 4 KiB block)
    assert 256 * 4096 <= stats.allocated_bytes <= 256 * 4096 + 2 * 4096, stats
    assert stats.chunked_bytes == 256 * CHUNK_BYTES
    assert layout_for(files=1, apparent_bytes=stats.apparent_bytes,
                      allocated_bytes=stats.chunked_bytes, entries=1) is None
    store = LayerStore(str(tmp_path / "store"))
    with pytest.raises(QuotaExceeded, match="at least 16777216 bytes"):
        store.add_tree(str(src), kind="snapshot", max_bytes=4 * MiB, what="snapshot")


def test_mkfs_output_is_bounded_while_it_is_written(tmp_path: Path) -> None:
    """The layer's size is known only after mkfs.erofs wrote it: mkfs runs under an
    RLIMIT_FSIZE of the bound, so it stops there instead of filling the disk."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "data").write_bytes(os.urandom(8 * MiB))
    out = tmp_path / "out.erofs"
    with pytest.raises(OutputTooLarge, match="limit of 2097152 bytes"):
        mkfs_erofs(str(src), str(out), max_output_bytes=2 * MiB)
    assert not out.exists() or out.stat().st_size <= 2 * MiB
    mkfs_erofs(str(src), str(tmp_path / "ok.erofs"), max_output_bytes=16 * MiB)
