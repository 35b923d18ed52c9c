"""pack_diff: snapshots of a real overlay upperdir restore the exact tree."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsec.errors import ImageError, InvalidArgument
from dsec.image import (
    DEFAULT_RESIDUE,
    LayerManifest,
    LayerStore,
    MountCache,
    compose,
    merge_layers,
    mount_root,
    restore_stack,
    snapshot,
)
from dsec.image.packdiff import Entry, plan_snapshot
from tests.conftest import requires_root
from tests.image.conftest import sweep_mounts, tree_of, write_tree

pytestmark = requires_root

BASE_FILES = {
    "a": "base-a", "d0/a": "d0a", "d0/b": "d0b", "d0/e/a": "d0ea", "d1/c": "d1c",
    "l": ("link", "d0/a"),
}


def _e(kind: str, ino: int, ctime: int = 1, opaque: bool = False) -> Entry:
    return Entry(kind, 0o644, 0, 0, 1, 1, ctime, ino, opaque)


def test_plan_is_a_pure_diff() -> None:
    prev = {"d": _e("d", 1), "d/x": _e("f", 2), "d/y": _e("f", 3), "gone": _e("d", 4),
            "gone/z": _e("f", 5), "o": _e("d", 6), "o/k": _e("f", 7)}
    cur = {"d": _e("d", 1, ctime=2), "d/x": _e("f", 2, ctime=9), "new": _e("f", 8),
           "o": _e("d", 16, opaque=True), "o/n": _e("f", 17)}
    plan = plan_snapshot(cur, prev)
    assert plan.copy == ["d", "d/x", "new", "o", "o/n"]
    assert plan.opaque == {"o"}
    assert plan.whiteouts == ["d/y", "gone"]     # gone/z is covered by gone; o/k by opaque o
    assert plan_snapshot(prev, prev).empty
    assert plan_snapshot(prev, prev, frozenset({"d/x"})).copy == ["d", "d/x"]


@pytest.fixture(scope="module")
def env() -> Iterator[tuple[LayerStore, MountCache, LayerManifest, str]]:
    tmp = tempfile.mkdtemp(prefix="dsec-pd-")
    store = LayerStore(os.path.join(tmp, "s"))
    cache = MountCache()
    try:
        src = os.path.join(tmp, "base")
        os.makedirs(src)
        write_tree(src, BASE_FILES)
        base = store.add_tree(src, kind="base", name="pdbase")
        yield store, cache, base, tmp
    finally:
        sweep_mounts(tmp)
        cache.close()
        sweep_mounts(cache.root)
        shutil.rmtree(tmp, ignore_errors=True)


def restored_tree(store: LayerStore, cache: MountCache, snap: LayerManifest,
                  tmp: str) -> dict:
    d = tempfile.mkdtemp(dir=tmp)
    with mount_root(store, cache, restore_stack(store, snap), d) as r:
        return tree_of(r.target)


def test_snapshot_chain_restores_and_unchanged_is_previous(env: tuple) -> None:
    store, cache, base, tmp = env
    stack = compose(base)
    sb = tempfile.mkdtemp(dir=tmp)
    with mount_root(store, cache, stack, sb) as root:
        t = root.target
        write_tree(t, {"new/file": "n", "d0/a": "changed"})
        os.unlink(os.path.join(t, "d1/c"))
        os.chmod(os.path.join(t, "a"), 0o600)
        os.setxattr(os.path.join(t, "new/file"), "user.tag", b"v")
        time.sleep(0.06)                         # leave the racy window (coarse ctime)
        s1 = snapshot(store, root.upper, base=stack)
        want1 = tree_of(t)
        assert (s1.kind, s1.parent, s1.stack) == ("snapshot", None, stack.digests)
        assert snapshot(store, root.upper, s1) is s1     # unchanged: the same snapshot

        shutil.rmtree(os.path.join(t, "d0/e"))
        os.mkdir(os.path.join(t, "d0/e"))                # opaque dir over the base's d0/e
        write_tree(t, {"d0/e/fresh": "f"})
        os.unlink(os.path.join(t, "new/file"))
        os.symlink("/nowhere", os.path.join(t, "dangling"))
        s2 = snapshot(store, root.upper, s1)
        want2 = tree_of(t)
        assert s2.parent == s1.digest and s2.stack == s1.stack
    assert restored_tree(store, cache, s1, tmp) == want1
    assert restored_tree(store, cache, s2, tmp) == want2
    r = restored_tree(store, cache, s1, tmp)
    assert "d1/c" not in r and r["d0/a"][4] != tree_of_base(store, cache, base, tmp)["d0/a"][4]
    d = tempfile.mkdtemp(dir=tmp)
    with mount_root(store, cache, restore_stack(store, s1), d) as rr:
        assert os.getxattr(os.path.join(rr.target, "new/file"), "user.tag") == b"v"


def tree_of_base(store: LayerStore, cache: MountCache, base: LayerManifest, tmp: str) -> dict:
    d = tempfile.mkdtemp(dir=tmp)
    with mount_root(store, cache, compose(base), d) as r:
        return tree_of(r.target)


def test_sandbox_started_from_snapshot_snapshots_on_top(env: tuple) -> None:
    store, cache, base, tmp = env
    stack = compose(base)
    sb = tempfile.mkdtemp(dir=tmp)
    with mount_root(store, cache, stack, sb) as root:
        write_tree(root.target, {"x": "1"})
        s1 = snapshot(store, root.upper, base=stack)
    child_stack = restore_stack(store, s1)
    sb2 = tempfile.mkdtemp(dir=tmp)
    with mount_root(store, cache, child_stack, sb2) as root2:
        os.unlink(os.path.join(root2.target, "x"))
        write_tree(root2.target, {"y": "2"})
        # passing the parent snapshot as `previous` is safe: its index is another upperdir
        s2 = snapshot(store, root2.upper, s1)
        want = tree_of(root2.target)
    assert s2.parent == s1.digest
    assert restored_tree(store, cache, s2, tmp) == want
    # merging the chain keeps deletions: x stays deleted, y present
    merged = merge_layers(store, cache, [s2, s1])
    assert merged.kind == "snapshot" and merged.parent is None
    assert restored_tree(store, cache, merged, tmp) == want


def test_strip_residue_and_bad_calls(env: tuple) -> None:
    store, cache, base, tmp = env
    stack = compose(base)
    sb = tempfile.mkdtemp(dir=tmp)
    with mount_root(store, cache, stack, sb) as root:
        write_tree(root.target, {"root/.bash_history": "secret", "app/__pycache__/m.pyc": "x",
                                 "app/m.py": "code", "tmp/answer": "42"})
        s = snapshot(store, root.upper, base=stack, strip=DEFAULT_RESIDUE)
    got = restored_tree(store, cache, s, tmp)
    assert "app/m.py" in got
    assert not {"root/.bash_history", "app/__pycache__", "tmp/answer"} & set(got)
    with pytest.raises(InvalidArgument):
        snapshot(store, sb)
    with pytest.raises(InvalidArgument):
        snapshot(store, os.path.join(tmp, "missing"), base=stack)
    with pytest.raises(InvalidArgument):
        snapshot(store, sb, base, base=stack)
    os.unlink(store.index_path(s.digest))
    with pytest.raises(ImageError, match="index"):
        snapshot(store, os.path.join(sb, "upper"), s)


# ---------------------------------------------------------------- property test
NAMES = ["a", "b", "c"]
DIRS = ["", "d0", "d1", "d0/e", "n"]
paths = st.builds(lambda d, n: f"{d}/{n}" if d else n, st.sampled_from(DIRS),
                  st.sampled_from(NAMES + ["d0", "d1", "e", "n"]))
ops = st.one_of(
    st.tuples(st.just("write"), paths, st.binary(max_size=64)),
    st.tuples(st.just("delete"), paths),
    st.tuples(st.just("rename"), paths, paths),
    st.tuples(st.just("chmod"), paths, st.sampled_from([0o600, 0o755, 0o644, 0o700])),
    st.tuples(st.just("symlink"), paths, st.sampled_from(["a", "/x", "../d1", "d0/b"])),
    st.tuples(st.just("mkdir"), paths),
    st.tuples(st.just("rmdir"), paths),
    st.tuples(st.just("rmtree"), st.sampled_from(DIRS[1:])),
    st.tuples(st.just("replace_dir"), st.sampled_from(DIRS[1:])),
    st.tuples(st.just("snapshot")),
)
_EXPECTED = (errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY, errno.EXDEV, errno.ENOTDIR,
             errno.EISDIR, errno.EINVAL, errno.ELOOP)


def apply_op(root: str, op: tuple) -> None:
    kind = op[0]
    p = os.path.join(root, op[1]) if len(op) > 1 else root
    try:
        if kind == "write":
            with open(p, "wb") as f:
                f.write(op[2])
        elif kind == "delete":
            os.unlink(p)
        elif kind == "rename":
            os.rename(p, os.path.join(root, op[2]))
        elif kind == "chmod":
            os.chmod(p, op[2], follow_symlinks=False) if not os.path.islink(p) else None
        elif kind == "symlink":
            os.symlink(op[2], p)
        elif kind == "mkdir":
            os.mkdir(p)
        elif kind == "rmdir":
            os.rmdir(p)
        elif kind in ("rmtree", "replace_dir"):
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            if kind == "replace_dir":
                os.mkdir(p)                     # over a whiteout: an opaque dir
    except OSError as exc:
        if exc.errno not in _EXPECTED:
            raise


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(ops, min_size=1, max_size=30))
def test_property_restored_tree_equals_source_at_every_snapshot(env: tuple,
                                                                 seq: list) -> None:
    store, cache, base, tmp = env
    stack = compose(base)
    sb = tempfile.mkdtemp(dir=tmp)
    taken: list[tuple[LayerManifest, dict]] = []
    try:
        with mount_root(store, cache, stack, sb) as root:
            prev: LayerManifest | None = None
            for op in [*seq, ("snapshot",)]:
                if op[0] != "snapshot":
                    apply_op(root.target, op)
                    continue
                s = snapshot(store, root.upper, prev, base=None if prev else stack)
                taken.append((s, tree_of(root.target)))
                prev = s
        for s, want in taken:
            assert restored_tree(store, cache, s, tmp) == want
    finally:
        sweep_mounts(sb)
        shutil.rmtree(sb, ignore_errors=True)
