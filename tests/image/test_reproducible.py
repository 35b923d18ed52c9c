"""Reproducible layers (issue 15 §4): identical trees give identical digests, whatever the
staging dir, the build time, the creation order or the xattr order; one byte changes it.

Real mkfs.erofs builds; the layer is mounted to check mtimes survive the fixed build time.
"""

from __future__ import annotations

import io
import os
import tarfile
import time

import pytest

from dsec.image import LayerStore, MountCache
from dsec.image.erofs import hash_file, mkfs_erofs
from dsec.image.tree import apply_tree

T = 1_700_000_000


def _make(root: str, *, reverse: bool, change: bytes = b"",
          xattr_reverse: bool | None = None) -> None:
    """The same tree, made in one order or its reverse (files, dirs, xattrs, links)."""
    os.makedirs(root)
    files = [("a.txt", b"alpha\n" + change), ("d/b.bin", os.urandom(0) + b"\x00" * 9000),
             ("d/e/c.py", b"print(1)\n"), ("z", b"zz")]
    xattrs = [("user.one", b"1"), ("user.two", b"2"), ("user.three", b"3")]
    steps = list(files)
    if reverse:
        steps.reverse()
    if reverse if xattr_reverse is None else xattr_reverse:
        xattrs.reverse()
    for rel, data in steps:
        os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)
    for name, value in xattrs:
        os.setxattr(os.path.join(root, "a.txt"), name, value)
    os.link(os.path.join(root, "z"), os.path.join(root, "d", "hard"))
    os.symlink("a.txt", os.path.join(root, "sym"))
    os.chmod(os.path.join(root, "d", "e", "c.py"), 0o750)
    os.chown(os.path.join(root, "z"), 1234, 5678)
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for n in filenames + dirnames:
            os.utime(os.path.join(dirpath, n), ns=(T * 10**9 + 123,) * 2,
                     follow_symlinks=False)
        os.utime(dirpath, ns=(T * 10**9,) * 2)


def test_same_tree_same_digest_one_layer(store: LayerStore, tmp_path: object) -> None:
    a, b = os.path.join(str(tmp_path), "a"), os.path.join(str(tmp_path), "elsewhere", "b")
    _make(a, reverse=False)
    _make(b, reverse=True, xattr_reverse=False)
    m1 = store.add_tree(a, kind="base", name="t", tag="1")
    time.sleep(1.1)                      # another build second: the superblock time
    m2 = store.add_tree(b, kind="base", name="t", tag="2")
    assert m2.digest == m1.digest
    assert len(store.manifests()) == 1
    assert len(os.listdir(os.path.join(store.root, "layers"))) == 1
    assert store.refs() == {"t:1": m1.digest, "t:2": m1.digest}
    # one byte more: another layer
    c = os.path.join(str(tmp_path), "c")
    _make(c, reverse=False, change=b"!")
    m3 = store.add_tree(c, kind="base", name="t", tag="3")
    assert m3.digest != m1.digest
    # an mtime is content too
    os.utime(os.path.join(a, "z"), ns=(T * 10**9 + 999,) * 2, follow_symlinks=False)
    assert store.add_tree(a, kind="base").digest not in (m1.digest, m3.digest)


def test_staged_copies_sort_xattrs(store: LayerStore, tmp_path: object) -> None:
    """mkfs.erofs keeps an inode's xattr order (ext4: insertion order), so a tree whose
    xattrs were set in another order builds another layer when built in place; every
    staged copy (pack_diff, merge, tar extraction) writes them sorted, so it is the same
    layer there."""
    a, b = os.path.join(str(tmp_path), "a"), os.path.join(str(tmp_path), "b")
    _make(a, reverse=False)
    _make(b, reverse=True)
    assert os.listxattr(os.path.join(a, "a.txt")) != os.listxattr(os.path.join(b, "a.txt"))
    digests = set()
    for src in (a, b):
        with store.staging() as stage:
            apply_tree(src, stage, keep_whiteouts=True)
            digests.add(store.add_tree(stage, kind="base").digest)
    assert len(digests) == 1


def test_identity_separates_namespaces_and_kinds(store: LayerStore, tmp_path: object) -> None:
    a = os.path.join(str(tmp_path), "a")
    _make(a, reverse=False)
    mine = store.add_tree(a, kind="base", name="x", namespace="teama")
    theirs = store.add_tree(a, kind="base", name="x", namespace="teamb")
    tool = store.add_tree(a, kind="toolkit", name="y", namespace="teama")
    again = store.add_tree(a, kind="base", name="z", namespace="teama", owner="someone-else")
    assert len({mine.digest, theirs.digest, tool.digest}) == 3
    assert again.digest == mine.digest and again.owner == mine.owner
    assert store.get("teamb/x").namespace == "teamb"
    assert store.get("teama/x").namespace == "teama"


def _tar(entries: list[tuple[str, bytes | None]], *, root: bool) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        if root:
            ti = tarfile.TarInfo("./")
            ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, T
            tf.addfile(ti)
        for name, data in entries:
            ti = tarfile.TarInfo(name)
            ti.mtime = T + 5
            if data is None:
                ti.type = tarfile.DIRTYPE
                ti.mode = 0o755
                tf.addfile(ti)
            else:
                ti.size = len(data)
                ti.pax_headers = {"SCHILY.xattr.user.b": "2", "SCHILY.xattr.user.a": "1"}
                tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("root", [True, False])
def test_same_tar_twice_same_digest(store: LayerStore, root: bool) -> None:
    """Directories the archive implies (no member of their own) and the root without
    ``./`` used to get the extraction time as mtime."""
    data = _tar([("implied/deeper/f", b"x" * 100), ("dir", None), ("dir/g", b"y")], root=root)
    m1 = store.add_tar(io.BytesIO(data), kind="workspace")
    time.sleep(1.1)
    m2 = store.add_tar(io.BytesIO(data), kind="workspace")
    assert m1.digest == m2.digest
    assert len(store.manifests()) == 1


def test_mtimes_kept_and_bench_mode_differs(store: LayerStore, cache: MountCache,
                                            tmp_path: object) -> None:
    """The fixed build time (SOURCE_DATE_EPOCH at its largest) clamps no mtime; the
    non-reproducible mode (kept for the benchmark) still gives a new digest each time."""
    a = os.path.join(str(tmp_path), "a")
    _make(a, reverse=False)
    os.environ["SOURCE_DATE_EPOCH"] = "5"       # a caller's must not clamp our mtimes
    try:
        m = store.add_tree(a, kind="base")
    finally:
        del os.environ["SOURCE_DATE_EPOCH"]
    path = cache.acquire(m, store.layer_path(m))
    try:
        for rel in ("a.txt", "d/e/c.py", "sym"):
            st = os.lstat(os.path.join(path, rel))
            assert st.st_mtime_ns == T * 10**9 + 123, rel
        assert os.lstat(path).st_mtime_ns == T * 10**9
        assert os.lstat(os.path.join(path, "z")).st_uid == 1234
    finally:
        cache.release(m.digest)
    outs = [os.path.join(str(tmp_path), f"r{i}.erofs") for i in range(2)]
    for out in outs:
        mkfs_erofs(a, out, reproducible=False)
    assert hash_file(outs[0]) != hash_file(outs[1])


def test_busybox_base_is_the_same_layer_everywhere(tmp_path: object) -> None:
    """Every node builds `base` itself: the same busybox binary now gives the same digest
    in every store (its tree was dated by when it was staged)."""
    from dsec.image import ensure_busybox_base

    a = ensure_busybox_base(LayerStore(os.path.join(str(tmp_path), "a")))
    time.sleep(1.1)
    b = ensure_busybox_base(LayerStore(os.path.join(str(tmp_path), "b")))
    assert a.digest == b.digest
