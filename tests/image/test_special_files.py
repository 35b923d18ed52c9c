"""One rule for special files at every door (issue 15 §3): a real tree holding device
nodes (mknod), a whiteout, a FIFO and a bound unix socket gives the same layer and the
same counts through ``dsec image build DIR``, ``dsec image build TAR``, the SDK upload
(``client.images.build(dir)``, which used to be refused for a debootstrap /dev) and the
OCI importer; pack_diff applies it to a sandbox's upper.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from dsec import LocalCluster
from dsec.cli.main import cli
from dsec.image import LayerStore, MountCache, import_oci, restore_stack, snapshot
from dsec.image.compose import compose, mount_root
from dsec.image.tree import special_skip
from tests.image.test_oci import write_layout

T = 1_700_000_000
WANT = {"devices": 2, "sockets": 1}


def test_the_rule() -> None:
    assert special_skip(stat.S_IFCHR | 0o644, os.makedev(1, 3)) == "devices"
    assert special_skip(stat.S_IFBLK | 0o600, os.makedev(8, 0)) == "devices"
    assert special_skip(stat.S_IFCHR, 0) is None                 # a whiteout
    assert special_skip(stat.S_IFSOCK | 0o755, 0) == "sockets"
    for kind in (stat.S_IFIFO, stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK):
        assert special_skip(kind | 0o644, 0) is None


@pytest.fixture
def tree(tmp_path: object) -> Iterator[str]:
    root = os.path.join(str(tmp_path), "tree")
    for d in ("dev", "run", "etc", "layer"):
        os.makedirs(os.path.join(root, d))
    with open(os.path.join(root, "etc", "os-release"), "w") as f:
        f.write("ID=debian\n")
    os.mknod(os.path.join(root, "dev", "null"), stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mknod(os.path.join(root, "dev", "sda"), stat.S_IFBLK | 0o660, os.makedev(8, 0))
    os.mknod(os.path.join(root, "layer", "gone"), stat.S_IFCHR, os.makedev(0, 0))
    os.mkfifo(os.path.join(root, "run", "initctl"), 0o600)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(os.path.join(root, "run", "daemon.sock"))
    try:
        for dirpath, dirnames, filenames in os.walk(root, topdown=False):
            for n in dirnames + filenames:
                os.utime(os.path.join(dirpath, n), ns=(T * 10**9,) * 2,
                         follow_symlinks=False)
        os.utime(root, ns=(T * 10**9,) * 2)
        yield root
    finally:
        sock.close()


def _layer_listing(store: LayerStore, cache: MountCache, ref: str, where: str) -> set[str]:
    m = store.get(ref)
    with mount_root(store, cache, compose(m), where) as r:
        # the root overlay shows the whiteout as a deletion: list the layer itself
        layer = cache.acquire(m, store.layer_path(m))
        try:
            out = set()
            for dirpath, dirnames, filenames in os.walk(layer):
                for n in dirnames + filenames:
                    p = os.path.join(dirpath, n)
                    st = os.lstat(p)
                    out.add(f"{os.path.relpath(p, layer)}:{stat.S_IFMT(st.st_mode):o}")
            assert os.path.exists(os.path.join(r.target, "run", "initctl"))
            assert not os.path.exists(os.path.join(r.target, "layer", "gone"))
            return out
        finally:
            cache.release(m.digest)


def test_same_layer_and_counts_through_every_door(tree: str, tmp_path: object,
                                                  cache: MountCache) -> None:
    tmp = str(tmp_path)
    run = CliRunner().invoke
    store_root = os.path.join(tmp, "store")
    # CLI, a directory: built in place, the skipped ones left out with --exclude-path
    r = run(cli, ["image", "--root", store_root, "build", tree, "--kind", "base", "--name",
                  "deb", "--tag", "dir", "-q"])
    assert r.exit_code == 0, r.output
    assert "skipped 2 devices, 1 sockets" in r.output
    store = LayerStore(store_root)
    by_dir = store.get("deb:dir")
    assert by_dir.skipped == WANT
    # CLI, a tar from GNU tar (pax: whole mtimes; GNU tar itself drops the socket)
    tar_path = os.path.join(tmp, "tree.tar")
    p = subprocess.run(["tar", "--format=posix", "-C", tree, "-cf", tar_path, "."],
                       capture_output=True, text=True, check=True)
    assert "socket ignored" in p.stderr
    r = run(cli, ["image", "--root", store_root, "build", tar_path, "--kind", "base",
                  "--name", "deb", "--tag", "tar", "-q"])
    assert r.exit_code == 0, r.output
    assert "skipped 2 devices (" in r.output        # what this build left out
    by_tar = store.get("deb:tar")
    assert by_tar.digest == by_dir.digest             # the same layer, stored once
    listing = _layer_listing(store, cache, "deb:dir", os.path.join(tmp, "sb1"))
    assert listing == {"dev:40000", "run:40000", "etc:40000", "layer:40000",
                       "etc/os-release:100000", "layer/gone:20000", "run/initctl:10000"}
    # OCI import of the same tar as one layer
    layout = os.path.join(tmp, "oci")
    with open(tar_path, "rb") as f:
        write_layout(layout, [f.read()])
    (imported,) = import_oci(store, layout, name="deb", tag="oci", squash=False)
    assert imported.skipped == {"devices": 2}
    assert _layer_listing(store, cache, "deb:oci", os.path.join(tmp, "sb2")) == listing
    # squashed, the bottom layer drops its whiteouts (nothing below to hide)
    (squashed,) = import_oci(store, layout, name="deb", tag="oci-squashed")
    assert squashed.skipped == {"devices": 2}
    assert _layer_listing(store, cache, "deb:oci-squashed", os.path.join(tmp, "sb3")) == (
        listing - {"layer/gone:20000"})
    # the SDK upload (it used to be refused: "is a device node")
    with LocalCluster() as cl, cl.client() as c:
        view = c.images.build(tree, name="deb", tag="sdk")
        assert view.skipped == WANT
        sdk_store = LayerStore(os.path.join(cl.state_dir, "layers"))
        assert sdk_store.get("deb:sdk").digest == by_dir.digest
        assert c.images.get("deb:sdk").skipped == {}   # the client left them out


def test_pack_diff_applies_the_rule(store: LayerStore, cache: MountCache,
                                    tmp_path: object) -> None:
    tmp = str(tmp_path)
    src = os.path.join(tmp, "base")
    os.makedirs(src)
    base = store.add_tree(src, kind="base")
    root = mount_root(store, cache, compose(base), os.path.join(tmp, "sb"))
    sock = socket.socket(socket.AF_UNIX)
    try:
        os.mkfifo(os.path.join(root.target, "fifo"))
        os.mknod(os.path.join(root.target, "null"), stat.S_IFCHR | 0o666, os.makedev(1, 3))
        sock.bind(os.path.join(root.target, "sock"))
        with open(os.path.join(root.target, "f"), "w") as f:
            f.write("x")
        snap = snapshot(store, root.upper, base=compose(base))
        assert snap.skipped == {"devices": 1, "sockets": 1}
    finally:
        sock.close()
        root.unmount()
    with mount_root(store, cache, restore_stack(store, snap), os.path.join(tmp, "sb2")) as r:
        assert sorted(os.listdir(r.target)) == ["f", "fifo"]
