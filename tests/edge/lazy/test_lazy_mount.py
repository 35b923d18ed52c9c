"""A node with an empty layer store starts from layers that exist only in the blob store,
reading through the FUSE daemon only the chunks it touches (issue 17)."""

from __future__ import annotations

import os
from pathlib import Path

from dsec.image import mount_overlay
from dsec.image.mount import sys_umount
from dsec.wire.spec import SandboxSpec
from tests.conftest import requires_root
from tests.edge.lazy.conftest import Node, Remote, fuse_mounts

pytestmark = requires_root


def test_stack_from_blob_store_reads_only_touched_chunks(node: Node, remote: Remote,
                                                         tmp_path: object) -> None:
    assert not os.path.exists(node.store.layer_path(remote.workspace))
    spec = SandboxSpec(image=remote.base.digest, workspace=remote.workspace.digest,
                       toolkits=(remote.toolkit.digest,))
    layers = node.images.acquire(spec)
    try:
        # no layer file was downloaded: manifests only, the files are the daemon's
        for m in (remote.base, remote.workspace, remote.toolkit):
            assert node.store.has(m.digest) and not os.path.exists(node.store.layer_path(m))
        sb = os.path.join(str(tmp_path), "sb")
        upper, work, root = (os.path.join(sb, d) for d in ("upper", "work", "root"))
        for d in (upper, work, root):
            os.makedirs(d)
        mount_overlay(layers.lowerdirs, upper, work, root)
        try:
            assert Path(root, "opt/tool").read_text() == "toolkit layer\n"
            assert Path(root, "work/readme").read_text() == "workspace layer\n"
            assert os.path.islink(os.path.join(root, "bin/sh"))
            st = node.lazy.stats(fresh=True)
            total = sum(m.size_bytes for m in (remote.base, remote.workspace, remote.toolkit))
            # the 2 MiB file was not read: far less than the layers were fetched
            assert 0 < st["bytes_fetched"] < total - (1 << 20)
            assert Path(root, "work/big").read_bytes() == remote.big
            assert node.lazy.stats(fresh=True)["verify_failures"] == 0
        finally:
            sys_umount(root)
    finally:
        node.images.release(layers)
    assert node.cache.mounted() == {}


def test_close_leaves_no_fuse_mount_or_daemon(remote: Remote, tmp_path: object) -> None:
    from dsec.edge.lazy.layers import LazyConfig, LazyLayers
    from dsec.image import MountCache

    lazy = LazyLayers(LazyConfig(blob_url=remote.url,
                                 cache_dir=os.path.join(str(tmp_path), "c")))
    pid, mount = lazy.pid, lazy.mount
    assert mount in fuse_mounts()
    cache = MountCache(lazy=lazy)
    lazy.register(remote.toolkit)
    cache.acquire(remote.toolkit, "/nonexistent/layer")
    cache.close()
    lazy.close()
    assert mount not in fuse_mounts()
    assert pid is not None and not os.path.exists(f"/proc/{pid}")   # exited and reaped
    assert not os.path.exists(lazy.root)
