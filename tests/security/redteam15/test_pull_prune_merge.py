"""Red team, issue 15: the ia pull (dsec.image.pull) meeting the ib prune
(LayerStore.prune, dsec.image.gc) once both land. Run on a tree with both merged
(PYTHONPATH=/work/wt/rt15-iaib/src: ib + ia's src/dsec/image, which merges cleanly).
Real registry, real skopeo, real store; the prune is a second LayerStore on the same
root, i.e. what ``dsec image prune`` on the host or POST /v1/images/prune does."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from dsec.errors import DsecError
from dsec.image import LayerStore
from dsec.image.localregistry import Entry, LocalRegistry, push, tar_entries, write_image
from dsec.image.pull import PullOptions, pull_image

pytestmark = [pytest.mark.root]


def test_prune_during_a_pull_leaves_a_named_image_over_missing_layers(tmp_path: Path) -> None:
    """Attack / fault: an operator's (or the budget's) prune runs while a pull is between
    its layers. The pull builds each OCI layer as an unnamed, unpinned layer and names
    only the top one at the end (ia never uses ib's ``Pin``), so the prune removes the
    lower layers already built; the pull then builds the top with ``stack=`` naming
    digests that no longer exist and tags it.

    Safe (issue 15 §4 "a layer in use is never removed"): the pull pins every layer it
    makes or reuses until the name is written (store.pinned()), or fails cleanly with
    nothing named. Observed: the name points at an image whose stack is gone (every
    create from it fails)."""
    work = tempfile.mkdtemp(prefix="rt15-reg-")
    try:
        with LocalRegistry(os.path.join(work, "open")) as reg:
            lay = os.path.join(work, "layout")
            write_image(lay, "img", [tar_entries([Entry(f"l{i}", data=b"%d" % i * 100)])
                                     for i in range(3)])
            push(lay, "img", f"{reg.host}/t/img:1")
            store = LayerStore(str(tmp_path / "store"))
            pruned: list[int] = []

            def progress(phase: str, done: int, total: int) -> None:
                if phase == "layer 3/3" and done == 0:   # two layers built, none named
                    pruned.append(len(LayerStore(store.root).prune().removed))

            try:
                res = pull_image(store, f"{reg.host}/t/img:1", namespace="teama",
                                 options=PullOptions(insecure=True), progress=progress)
            except DsecError:
                return        # failing cleanly is safe
            top = store.get(res.image.digest)
            missing = [d for d in top.stack if not store.has(d)]
            assert not missing, (f"prune removed {pruned} layers mid-pull; the named image "
                                 f"{res.key} stands on {len(missing)} missing layers")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_a_pulled_layer_drops_device_nodes_without_counting_them(tmp_path: Path) -> None:
    """Merge check (ib's one special-files rule x ia's pull): ib's ``extract_tar`` now
    skips device nodes (instead of refusing the archive) and returns the count, which
    every other door stores in ``LayerManifest.skipped`` and shows (CLI, ImageView). ia's
    ``_unpack`` ignores extract_tar's result and calls ``add_tree`` without
    ``skipped=``, so a pulled layer that lost ``dev/sda`` says it skipped nothing.

    Safe: the pull passes the extraction's counts on (``skipped=ex.skipped``), as
    add_tar does. Observed: ``skipped == {}``."""
    import gzip
    import io
    import json
    import tarfile

    from tests.security.redteam15.hostile_registry import Hostile, _sha

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        ti = tarfile.TarInfo("dev/sda")
        ti.type = tarfile.CHRTYPE
        ti.devmajor, ti.devminor = 8, 0
        tf.addfile(ti)
        ti = tarfile.TarInfo("ok")
        ti.size = 2
        tf.addfile(ti, io.BytesIO(b"ok"))
    raw = buf.getvalue()
    gz = gzip.compress(raw, mtime=0)
    h = Hostile()
    try:
        cfg = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                          "rootfs": {"type": "layers", "diff_ids": [_sha(raw)]}}).encode()
        h.manifest("t/dev", "1", {
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": h.blob(cfg), "size": len(cfg)},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                        "digest": h.blob(gz), "size": len(gz)}]})
        store = LayerStore(str(tmp_path / "store"))
        res = pull_image(store, f"{h.host}/t/dev:1", namespace="teama",
                         options=PullOptions(insecure=True))
        assert store.get(res.image.digest).skipped == {"devices": 1}
    finally:
        h.close()
