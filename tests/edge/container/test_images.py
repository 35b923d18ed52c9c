"""StoreImages: the container backend's ImageResolver over the store and mount cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.edge.backends.container.images import ImageResolver, RootLayers, StoreImages
from dsec.errors import ImageNotFound, InvalidArgument
from dsec.image import LayerStore, MountCache, ensure_busybox_base, mount_overlay, snapshot
from dsec.image.mount import sys_umount
from dsec.wire.spec import SandboxSpec
from tests.conftest import requires_root
from tests.image.conftest import cache, store, write_tree

__all__ = ["cache", "store"]  # the layer store and mount cache fixtures, used by name

pytestmark = requires_root


def test_acquire_release_with_toolkits_and_snapshot(store: LayerStore, cache: MountCache,
                                                    tmp_path: object) -> None:
    tmp = str(tmp_path)
    base = ensure_busybox_base(store)
    assert ensure_busybox_base(store).digest == base.digest        # built once
    src = os.path.join(tmp, "tk")
    write_tree(src, {"opt/tool": "v1"})
    store.add_tree(src, kind="toolkit", name="tool")
    images = StoreImages(store, cache)
    assert isinstance(images, ImageResolver)
    layers = images.acquire(SandboxSpec(image="busybox", toolkits=("tool",)))
    assert isinstance(layers, RootLayers) and len(layers.lowerdirs) == 2
    assert os.path.exists(os.path.join(layers.lowerdirs[0], "opt/tool"))
    assert os.path.islink(os.path.join(layers.lowerdirs[1], "bin/sh"))
    # a sandbox on those lowers; snapshot it; a new spec starts from the snapshot
    sb = os.path.join(tmp, "sb")
    upper, work, root = (os.path.join(sb, d) for d in ("upper", "work", "root"))
    for d in (upper, work, root):
        os.makedirs(d)
    mount_overlay(layers.lowerdirs, upper, work, root)
    try:
        write_tree(root, {"work/result": "done"})
        snap = snapshot(store, upper, base=layers.token, name="run1")   # type: ignore[arg-type]
        assert store.get("run1") == snap and snap.stack == layers.token.digests  # type: ignore[attr-defined]
    finally:
        sys_umount(root)
    images.release(layers)
    assert cache.mounted() == {}
    restored = images.acquire(SandboxSpec(image="busybox", snapshot="run1"))
    try:
        assert len(restored.lowerdirs) == 3
        assert Path(restored.lowerdirs[0], "work/result").read_text() == "done"
    finally:
        images.release(restored)
    with pytest.raises(ImageNotFound):
        images.acquire(SandboxSpec(image="nope"))
    with pytest.raises(InvalidArgument):
        images.acquire(SandboxSpec(image="busybox", snapshot="run1", toolkits=("tool",)))
    with pytest.raises(InvalidArgument):
        images.release(RootLayers(("/x",)))
    assert cache.mounted() == {}
