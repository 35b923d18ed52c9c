"""Composition of base, workspace and toolkits into one overlay root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.errors import ImageError, InvalidArgument
from dsec.image import LayerStore, MountCache, RootStack, compose, mount_overlay, mount_root
from dsec.image.compose import acquire_stack
from tests.conftest import requires_root
from tests.image.conftest import mounts_under, write_tree

pytestmark = requires_root


def layer(store: LayerStore, tmp: str, kind: str, files: dict) -> object:
    src = os.path.join(tmp, "src-" + os.urandom(3).hex())
    os.makedirs(src)
    write_tree(src, files)
    return store.add_tree(src, kind=kind)  # type: ignore[arg-type]


def test_priority_toolkits_over_workspace_over_base(store: LayerStore, cache: MountCache,
                                                    tmp_path: object) -> None:
    tmp = str(tmp_path)
    base = layer(store, tmp, "base", {"who": "base", "only-base": "b", "ws": "base"})
    ws = layer(store, tmp, "workspace", {"who": "ws", "ws": "ws", "repo/main.py": "print()"})
    t1 = layer(store, tmp, "toolkit", {"who": "t1", "t1": "t1"})
    t2 = layer(store, tmp, "toolkit", {"who": "t2"})
    stack = compose(base, ws, [t1, t2])
    assert stack.digests == (t2.digest, t1.digest, ws.digest, base.digest)
    with mount_root(store, cache, stack, os.path.join(tmp, "sb")) as root:
        def read(p: str) -> str:
            return Path(root.target, p).read_text()
        assert (read("who"), read("ws"), read("only-base"), read("t1")) == ("t2", "ws", "b", "t1")
        with open(os.path.join(root.target, "who"), "w") as f:
            f.write("mine")
        assert Path(root.upper, "who").read_text() == "mine"
        # second sandbox shares the layer mounts and sees the image, not sandbox 1's write
        with mount_root(store, cache, stack, os.path.join(tmp, "sb2")) as root2:
            assert Path(root2.target, "who").read_text() == "t2"
            assert cache.refs(base.digest) == 2
    assert cache.mounted() == {}
    assert mounts_under(tmp) == []


def test_compose_checks_kinds(store: LayerStore, tmp_path: object) -> None:
    tmp = str(tmp_path)
    base = layer(store, tmp, "base", {"a": "1"})
    tk = layer(store, tmp, "toolkit", {"a": "2"})
    with pytest.raises(InvalidArgument, match="toolkit layer"):
        compose(tk)
    with pytest.raises(InvalidArgument, match="workspace"):
        compose(base, tk)
    with pytest.raises(InvalidArgument, match="twice"):
        compose(base, None, [tk, tk])


def test_new_mount_api_and_missing_lower(store: LayerStore, cache: MountCache,
                                         tmp_path: object) -> None:
    tmp = str(tmp_path)
    layers = [layer(store, tmp, "toolkit", {f"f{i}": str(i), "top": str(i)}) for i in range(3)]
    stack = RootStack(tuple(layers))
    lowers = acquire_stack(store, cache, stack)
    target = os.path.join(tmp, "ro")
    os.mkdir(target)
    try:
        mount_overlay(lowers, None, None, target, api="new")     # fsconfig(lowerdir+)
        try:
            assert sorted(os.listdir(target)) == ["f0", "f1", "f2", "top"]
            assert Path(target, "top").read_text() == "0"
        finally:
            os.system(f"umount {target}")
        with pytest.raises(ImageError, match="missing"):
            mount_overlay([*lowers, os.path.join(tmp, "nope")], None, None, target)
        assert mounts_under(target) == []
    finally:
        for m in layers:
            cache.release(m.digest)
    assert cache.mounted() == {}
