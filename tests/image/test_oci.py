"""OCI import from a layout directory, an OCI tarball and a docker-save tarball."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from dsec.errors import CorruptLayer, ImageError, UnsafeArchive
from dsec.image import LayerStore, MountCache, RootStack, import_oci, mount_root
from tests.conftest import requires_root
from tests.image.conftest import tree_of

pytestmark = requires_root


def layer_tar(entries: list[tuple[str, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in entries:
            ti = tarfile.TarInfo(name)
            ti.mtime = 1_700_000_000
            if data is None:
                ti.type = tarfile.DIRTYPE
                ti.mode = 0o755
                tf.addfile(ti)
            else:
                ti.size = len(data)
                ti.mode = 0o644
                tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


L1 = layer_tar([("etc/", None), ("etc/a", b"a1"), ("etc/keep", b"k"), ("d/", None),
                ("d/x", b"x"), ("d/y", b"y"), ("z", b"z1")])
L2 = layer_tar([("etc/.wh.a", b""), ("d/", None), ("d/.wh..wh..opq", b""), ("d/new", b"n"),
                ("z", b"z2")])
WANT = {"etc": "d", "etc/keep": b"k", "d": "d", "d/new": b"n", "z": b"z2"}


def write_layout(root: str, layers: list[bytes], *, gz: bool = True) -> None:
    blobs = os.path.join(root, "blobs", "sha256")
    os.makedirs(blobs)

    def put(data: bytes) -> str:
        hx = hashlib.sha256(data).hexdigest()
        with open(os.path.join(blobs, hx), "wb") as f:
            f.write(data)
        return f"sha256:{hx}"

    descs = []
    for raw in layers:
        data = gzip.compress(raw) if gz else raw
        descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                      "digest": put(data), "size": len(data)})
    config = json.dumps({"config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]},
                         "rootfs": {"type": "layers", "diff_ids": []}}).encode()
    manifest = json.dumps({"schemaVersion": 2, "mediaType":
                           "application/vnd.oci.image.manifest.v1+json",
                           "config": {"digest": put(config), "size": len(config)},
                           "layers": descs}).encode()
    index = {"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": put(manifest),
         "size": len(manifest), "annotations": {"org.opencontainers.image.ref.name": "v1"}}]}
    with open(os.path.join(root, "index.json"), "w") as f:
        json.dump(index, f)
    with open(os.path.join(root, "oci-layout"), "w") as f:
        json.dump({"imageLayoutVersion": "1.0.0"}, f)


def tar_dir(src: str, out: str) -> None:
    with tarfile.open(out, "w") as tf:
        for name in sorted(os.listdir(src)):
            tf.add(os.path.join(src, name), arcname=name)


def check(store: LayerStore, cache: MountCache, layers: list, tmp: str) -> None:
    with mount_root(store, cache, RootStack(tuple(layers)), os.path.join(tmp, "sb")) as r:
        got = tree_of(r.target)
        flat = {k: ("d" if v[0] == "d" else Path(r.target, k).read_bytes())
                for k, v in got.items()}
        assert flat == WANT


def test_import_oci_layout_squashed_and_layered(store: LayerStore, cache: MountCache,
                                                tmp_path: object) -> None:
    tmp = str(tmp_path)
    layout = os.path.join(tmp, "oci")
    write_layout(layout, [L1, L2])
    [m] = import_oci(store, layout, name="img")
    assert m.kind == "base" and store.get("img") == m
    assert json.loads(m.labels["oci.cmd"]) == ["/bin/sh"]
    check(store, cache, [m], tmp)
    layered = import_oci(store, layout, name="img-layers", squash=False)
    assert len(layered) == 2
    check(store, cache, layered, os.path.join(tmp, "2"))


def test_import_oci_tarball_and_docker_save(store: LayerStore, cache: MountCache,
                                            tmp_path: object) -> None:
    tmp = str(tmp_path)
    layout = os.path.join(tmp, "oci")
    write_layout(layout, [L1, L2], gz=False)
    tar_dir(layout, os.path.join(tmp, "oci.tar"))
    [m] = import_oci(store, os.path.join(tmp, "oci.tar"), name="fromtar")
    check(store, cache, [m], tmp)
    # docker save: manifest.json naming <id>/layer.tar paths
    ds = os.path.join(tmp, "ds")
    for i, data in enumerate([L1, L2]):
        os.makedirs(os.path.join(ds, f"l{i}"))
        with open(os.path.join(ds, f"l{i}", "layer.tar"), "wb") as f:
            f.write(data)
    with open(os.path.join(ds, "cfg.json"), "w") as f:
        json.dump({"config": {"WorkingDir": "/work"}}, f)
    with open(os.path.join(ds, "manifest.json"), "w") as f:
        json.dump([{"Config": "cfg.json", "RepoTags": ["x:1"],
                    "Layers": ["l0/layer.tar", "l1/layer.tar"]}], f)
    tar_dir(ds, os.path.join(tmp, "ds.tar"))
    [m2] = import_oci(store, os.path.join(tmp, "ds.tar"), name="docker", ref="x:1")
    assert m2.labels["oci.workingdir"] == '"/work"'
    check(store, cache, [m2], os.path.join(tmp, "2"))


def test_bad_oci_inputs_leave_nothing(store: LayerStore, tmp_path: object) -> None:
    tmp = str(tmp_path)
    layout = os.path.join(tmp, "oci")
    write_layout(layout, [L1, layer_tar([("../escape", b"x")])])
    with pytest.raises(UnsafeArchive):
        import_oci(store, layout, name="evil")
    corrupt = os.path.join(tmp, "corrupt")
    write_layout(corrupt, [L1], gz=False)
    blobs = os.path.join(corrupt, "blobs", "sha256")
    victim = max((os.path.join(blobs, n) for n in os.listdir(blobs)), key=os.path.getsize)
    with open(victim, "r+b") as f:
        f.seek(600)
        f.write(b"Q")
    with pytest.raises(CorruptLayer):
        import_oci(store, corrupt, name="corrupt")
    with pytest.raises(ImageError):
        import_oci(store, tmp, name="nolayout")
    assert store.manifests() == [] and os.listdir(os.path.join(store.root, "tmp")) == []
